// CUDA glue for the torchreplay tree ops, compiled only when torch has CUDA. Checks here read
// tensor metadata only; value checks (ranges, NaN) are the Python wrapper's, because reading device
// values would synchronize. The kernels skip invalid entries, so a bypassed check cannot corrupt
// memory.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../tree_checks.h"
#include "tree_cuda.h"

namespace torchreplay {
namespace {

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, what, " failed: ", cudaGetErrorString(err));
}

void tree_update_cuda(at::Tensor& leaves, at::Tensor& sums, at::Tensor& mins, const at::Tensor& indices_in,
                      const at::Tensor& priorities_in, int64_t capacity) {
  check_tree_storage(leaves, sums, mins, capacity);
  check_indices(indices_in, leaves);
  check_priorities(priorities_in, indices_in, leaves);
  const c10::cuda::CUDAGuard guard(leaves.device());
  const at::Tensor indices = indices_in.contiguous();
  const at::Tensor priorities = priorities_in.contiguous();
  at::Tensor winner = at::empty({capacity}, leaves.options().dtype(at::kLong));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  AT_DISPATCH_FLOATING_TYPES(leaves.scalar_type(), "tree_update_cuda", [&] {
    check_launch(tree::cuda::update(capacity, leaves.data_ptr<scalar_t>(), sums.data_ptr<double>(),
                                    mins.data_ptr<double>(), indices.data_ptr<int64_t>(),
                                    priorities.data_ptr<scalar_t>(), indices.numel(), winner.data_ptr<int64_t>(),
                                    stream),
                 "tree_update");
  });
}

std::tuple<at::Tensor, at::Tensor> tree_sample_cuda(const at::Tensor& leaves, const at::Tensor& sums,
                                                    const at::Tensor& u_in, int64_t capacity, bool stratified) {
  check_sample_storage(leaves, sums, capacity);
  check_uniforms(u_in, leaves);
  const c10::cuda::CUDAGuard guard(leaves.device());
  const at::Tensor u = u_in.contiguous();
  const int64_t n = u.numel();
  at::Tensor indices = at::empty({n}, leaves.options().dtype(at::kLong));
  at::Tensor priorities = at::empty({n}, leaves.options());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  AT_DISPATCH_FLOATING_TYPES(leaves.scalar_type(), "tree_sample_cuda", [&] {
    check_launch(tree::cuda::sample(capacity, leaves.data_ptr<scalar_t>(), sums.data_ptr<double>(),
                                    u.data_ptr<double>(), n, stratified, indices.data_ptr<int64_t>(),
                                    priorities.data_ptr<scalar_t>(), stream),
                 "tree_sample");
  });
  return {indices, priorities};
}

at::Tensor tree_get_cuda(const at::Tensor& leaves, const at::Tensor& indices, int64_t capacity) {
  check_indices(indices, leaves);
  TORCH_CHECK(capacity >= 1 && leaves.dim() == 1 && leaves.numel() >= capacity,
              "leaves must be 1-D with at least capacity (", capacity, ") elements, got shape ", leaves.sizes());
  const c10::cuda::CUDAGuard guard(leaves.device());
  // Out-of-range reads would be a device-side assert; masked, they read as 0 instead.
  const at::Tensor valid = indices.ge(0).logical_and(indices.lt(capacity));
  const at::Tensor safe = indices.clamp(0, capacity - 1);
  return at::where(valid, leaves.index_select(0, safe), at::zeros({}, leaves.options()));
}

void tree_rebuild_cuda(at::Tensor& leaves, at::Tensor& sums, at::Tensor& mins, int64_t capacity) {
  check_tree_storage(leaves, sums, mins, capacity);
  const c10::cuda::CUDAGuard guard(leaves.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  AT_DISPATCH_FLOATING_TYPES(leaves.scalar_type(), "tree_rebuild_cuda", [&] {
    check_launch(tree::cuda::rebuild(capacity, leaves.data_ptr<scalar_t>(), sums.data_ptr<double>(),
                                     mins.data_ptr<double>(), stream),
                 "tree_rebuild");
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(torchreplay, CUDA, m) {
  m.impl("tree_update", &tree_update_cuda);
  m.impl("tree_sample", &tree_sample_cuda);
  m.impl("tree_get", &tree_get_cuda);
  m.impl("tree_rebuild", &tree_rebuild_cuda);
}

}  // namespace torchreplay
