// CPU implementations of the torchreplay tree ops: argument checks, then the torch-free kernels in
// tree_cpu.h, on as many threads as torch's intra-op setting (torch.set_num_threads) allows, through
// claim_pool.h rather than at::parallel_for (why: see there). Every check runs before any write, so
// a rejected call leaves the tree unchanged.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../tree_checks.h"
#include "claim_pool.h"
#include "tree_cpu.h"

#include <vector>

namespace torchreplay {
namespace {

tree::cpu::ClaimParallelFor threads_for_call() { return tree::cpu::ClaimParallelFor{at::get_num_threads()}; }

void check_index_values(const at::Tensor& indices, int64_t capacity) {
  const int64_t* idx = indices.data_ptr<int64_t>();
  for (int64_t i = 0; i < indices.numel(); ++i) {
    TORCH_CHECK_INDEX(tree::valid_index(idx[i], capacity), "indices[", i, "] = ", idx[i],
                      " is out of range for a tree of capacity ", capacity);
  }
}

template <typename scalar_t>
void check_priority_values(const at::Tensor& priorities) {
  const scalar_t* p = priorities.data_ptr<scalar_t>();
  for (int64_t i = 0; i < priorities.numel(); ++i) {
    TORCH_CHECK_VALUE(tree::valid_priority(p[i]), "priorities[", i, "] = ", p[i],
                      " is not a finite non-negative number");
  }
}

void tree_update_cpu(at::Tensor& leaves, at::Tensor& sums, at::Tensor& mins, const at::Tensor& indices_in,
                     const at::Tensor& priorities_in, int64_t capacity) {
  check_tree_storage(leaves, sums, mins, capacity);
  check_indices(indices_in, leaves);
  check_priorities(priorities_in, indices_in, leaves);
  const at::Tensor indices = indices_in.contiguous();
  const at::Tensor priorities = priorities_in.contiguous();
  check_index_values(indices, capacity);
  const tree::Layout L = tree::make_layout(capacity);
  AT_DISPATCH_FLOATING_TYPES(leaves.scalar_type(), "tree_update_cpu", [&] {
    check_priority_values<scalar_t>(priorities);
    tree::cpu::update(L, leaves.data_ptr<scalar_t>(), sums.data_ptr<double>(), mins.data_ptr<double>(),
                      indices.data_ptr<int64_t>(), priorities.data_ptr<scalar_t>(), indices.numel(),
                      threads_for_call());
  });
}

// Both sampling ops after their own checks: n uniforms in [0, 1) at `u` -> (indices, priorities).
std::tuple<at::Tensor, at::Tensor> sample_checked(const at::Tensor& leaves, const at::Tensor& sums, const double* u,
                                                  int64_t n, int64_t capacity, bool stratified) {
  at::Tensor indices = at::empty({n}, leaves.options().dtype(at::kLong));
  at::Tensor priorities = at::empty({n}, leaves.options());
  if (n == 0) return {indices, priorities};
  const double total = sums.data_ptr<double>()[0];
  TORCH_CHECK_VALUE(total > 0.0, "cannot sample from an empty tree: every priority is 0");
  // Only float64 leaves can get here; the descent's child choice assumes finite targets.
  TORCH_CHECK_VALUE(total < tree::positive_infinity(),
                    "cannot sample: the priorities sum to more than the largest float64; scale them down");
  const tree::Layout L = tree::make_layout(capacity);
  AT_DISPATCH_FLOATING_TYPES(leaves.scalar_type(), "tree_sample_cpu", [&] {
    tree::cpu::sample(L, leaves.data_ptr<scalar_t>(), sums.data_ptr<double>(), u, n, stratified,
                      indices.data_ptr<int64_t>(), priorities.data_ptr<scalar_t>(), threads_for_call());
  });
  return {indices, priorities};
}

std::tuple<at::Tensor, at::Tensor> tree_sample_cpu(const at::Tensor& leaves, const at::Tensor& sums,
                                                   const at::Tensor& u_in, int64_t capacity, bool stratified) {
  check_sample_storage(leaves, sums, capacity);
  check_uniforms(u_in, leaves);
  const at::Tensor u = u_in.contiguous();
  const double* uv = u.data_ptr<double>();
  for (int64_t i = 0; i < u.numel(); ++i) {
    TORCH_CHECK_VALUE(tree::valid_uniform(uv[i]), "u[", i, "] = ", uv[i], " is outside [0, 1)");
  }
  return sample_checked(leaves, sums, uv, u.numel(), capacity, stratified);
}

// sample(batch_size) on the CPU: the uniforms come from counter_uniform(seed, k) inside the op,
// which at B=4096 saves ~30-40 us of torch.rand (a tenth of a sample-then-update at N=2^20).
std::tuple<at::Tensor, at::Tensor> tree_sample_seeded_cpu(const at::Tensor& leaves, const at::Tensor& sums,
                                                          int64_t seed, int64_t batch_size, int64_t capacity,
                                                          bool stratified) {
  check_sample_storage(leaves, sums, capacity);
  TORCH_CHECK_VALUE(batch_size >= 0, "batch_size must be >= 0, got ", batch_size);
  std::vector<double> u(static_cast<size_t>(batch_size));
  for (int64_t k = 0; k < batch_size; ++k) u[k] = tree::counter_uniform(static_cast<uint64_t>(seed), k);
  return sample_checked(leaves, sums, u.data(), batch_size, capacity, stratified);
}

at::Tensor tree_get_cpu(const at::Tensor& leaves, const at::Tensor& indices_in, int64_t capacity) {
  check_indices(indices_in, leaves);
  TORCH_CHECK(capacity >= 1 && leaves.dim() == 1 && leaves.numel() >= capacity,
              "leaves must be 1-D with at least capacity (", capacity, ") elements, got shape ", leaves.sizes());
  const at::Tensor indices = indices_in.contiguous();
  check_index_values(indices, capacity);
  return leaves.index_select(0, indices);
}

void tree_rebuild_cpu(at::Tensor& leaves, at::Tensor& sums, at::Tensor& mins, int64_t capacity) {
  check_tree_storage(leaves, sums, mins, capacity);
  const tree::Layout L = tree::make_layout(capacity);
  AT_DISPATCH_FLOATING_TYPES(leaves.scalar_type(), "tree_rebuild_cpu", [&] {
    check_priority_values<scalar_t>(leaves);
    tree::cpu::rebuild(L, leaves.data_ptr<scalar_t>(), sums.data_ptr<double>(), mins.data_ptr<double>(),
                       threads_for_call());
  });
}

// The root holds the total and the global live minimum; reading it is a device-side slice, so the
// same function serves every device without a host round trip.
at::Tensor tree_root(const at::Tensor& levels) {
  TORCH_CHECK(levels.dim() == 1 && levels.numel() >= 1 && levels.scalar_type() == at::kDouble,
              "expected the tree's float64 sums/mins array, got ", levels.scalar_type(), " of shape ",
              levels.sizes());
  return levels.select(0, 0).clone();
}

}  // namespace

TORCH_LIBRARY_IMPL(torchreplay, CPU, m) {
  m.impl("tree_update", &tree_update_cpu);
  m.impl("tree_sample", &tree_sample_cpu);
  m.impl("tree_sample_seeded", &tree_sample_seeded_cpu);
  m.impl("tree_get", &tree_get_cpu);
  m.impl("tree_rebuild", &tree_rebuild_cpu);
}

TORCH_LIBRARY_IMPL(torchreplay, CompositeExplicitAutograd, m) {
  m.impl("tree_total", &tree_root);
  m.impl("tree_min", &tree_root);
}

}  // namespace torchreplay
