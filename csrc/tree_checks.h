// Argument checks shared by the CPU and CUDA glue: shapes, dtypes and devices, all readable from
// tensor metadata without touching device memory (so they never synchronize).
#pragma once

#include <ATen/ATen.h>

#include "segment_tree.h"

namespace torchreplay {

inline void check_levels(const at::Tensor& levels, const char* name, const tree::Layout& L,
                         const at::Tensor& leaves) {
  TORCH_CHECK(levels.dim() == 1 && levels.numel() == L.internal_nodes && levels.is_contiguous() &&
                  levels.scalar_type() == at::kDouble,
              name, " must be a contiguous float64 1-D tensor of ", L.internal_nodes, " elements, got ",
              levels.scalar_type(), " of shape ", levels.sizes());
  TORCH_CHECK(levels.device() == leaves.device(), name, " must be on the leaves' device ", leaves.device(), ", got ",
              levels.device());
}

// Leaves and sums: what sampling reads.
inline tree::Layout check_sample_storage(const at::Tensor& leaves, const at::Tensor& sums, int64_t capacity) {
  TORCH_CHECK(capacity >= 1, "capacity must be >= 1, got ", capacity);
  const tree::Layout L = tree::make_layout(capacity);
  TORCH_CHECK(leaves.dim() == 1 && leaves.numel() == L.padded_leaves && leaves.is_contiguous(),
              "leaves must be a contiguous 1-D tensor of ", L.padded_leaves, " elements, got shape ", leaves.sizes());
  TORCH_CHECK(leaves.scalar_type() == at::kFloat || leaves.scalar_type() == at::kDouble,
              "leaves must be float32 or float64, got ", leaves.scalar_type());
  check_levels(sums, "sums", L, leaves);
  return L;
}

// Leaves, sums and mins: what updates write.
inline void check_tree_storage(const at::Tensor& leaves, const at::Tensor& sums, const at::Tensor& mins,
                               int64_t capacity) {
  check_levels(mins, "mins", check_sample_storage(leaves, sums, capacity), leaves);
}

inline void check_indices(const at::Tensor& indices, const at::Tensor& leaves) {
  TORCH_CHECK(indices.dim() == 1, "indices must be 1-D, got shape ", indices.sizes());
  TORCH_CHECK(indices.scalar_type() == at::kLong, "indices must be int64, got ", indices.scalar_type());
  TORCH_CHECK(indices.device() == leaves.device(), "indices must be on the tree's device ", leaves.device(),
              ", got ", indices.device());
}

inline void check_priorities(const at::Tensor& priorities, const at::Tensor& indices, const at::Tensor& leaves) {
  TORCH_CHECK(priorities.dim() == 1 && priorities.numel() == indices.numel(),
              "priorities must be 1-D with one value per index (", indices.numel(), "), got shape ",
              priorities.sizes());
  TORCH_CHECK(priorities.scalar_type() == leaves.scalar_type(), "priorities must have the tree's dtype ",
              leaves.scalar_type(), ", got ", priorities.scalar_type());
  TORCH_CHECK(priorities.device() == leaves.device(), "priorities must be on the tree's device ", leaves.device(),
              ", got ", priorities.device());
}

inline void check_uniforms(const at::Tensor& u, const at::Tensor& leaves) {
  TORCH_CHECK(u.dim() == 1, "u must be 1-D, got shape ", u.sizes());
  TORCH_CHECK(u.scalar_type() == at::kDouble, "u must be float64, got ", u.scalar_type());
  TORCH_CHECK(u.device() == leaves.device(), "u must be on the tree's device ", leaves.device(), ", got ",
              u.device());
}

}  // namespace torchreplay
