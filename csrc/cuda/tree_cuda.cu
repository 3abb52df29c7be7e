// CUDA kernels for the segment tree. Launch glue only: the arithmetic is segment_tree.h, shared
// with the CPU back end. Compile with --fmad=false so sample targets round as on the CPU.
#include "tree_cuda.h"

#include <cuda_runtime.h>

#include "../segment_tree.h"

namespace torchreplay {
namespace tree {
namespace cuda {
namespace {

constexpr int kThreads = 256;

int blocks_for(int64_t n) { return static_cast<int>((n + kThreads - 1) / kThreads); }

__global__ void claim_reset(const int64_t* indices, int64_t n, int64_t capacity, int64_t* winner) {
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n && valid_index(indices[i], capacity)) winner[indices[i]] = -1;
}

// The highest input position per leaf wins: the CPU's "last occurrence wins", without a sort.
__global__ void claim_last(const int64_t* indices, int64_t n, int64_t capacity, int64_t* winner) {
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n && valid_index(indices[i], capacity)) {
    atomicMax(reinterpret_cast<long long*>(winner + indices[i]), static_cast<long long>(i));
  }
}

template <typename scalar_t>
__global__ void write_winners(const int64_t* indices, const scalar_t* priorities, int64_t n, int64_t capacity,
                              const int64_t* winner, scalar_t* leaves) {
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n && valid_index(indices[i], capacity) && winner[indices[i]] == i && valid_priority(priorities[i])) {
    leaves[indices[i]] = priorities[i];
  }
}

// One thread per input recomputes that input's ancestor at level d. Duplicated ancestors are
// recomputed by several threads from the same finished children and so write the same value.
template <typename scalar_t>
__global__ void recompute_ancestors(Layout L, int d, const int64_t* indices, int64_t n, const scalar_t* leaves,
                                    double* sums, double* mins) {
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n && valid_index(indices[i], L.capacity)) {
    recompute_node(L, leaves, sums, mins, d, indices[i] / cover_of_level(L, d));
  }
}

template <typename scalar_t>
__global__ void recompute_level(Layout L, int d, const scalar_t* leaves, double* sums, double* mins) {
  int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (j < L.level_nodes[d]) recompute_node(L, leaves, sums, mins, d, j);
}

template <typename scalar_t>
__global__ void zero_padding(Layout L, scalar_t* leaves) {
  int64_t i = L.capacity + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < L.padded_leaves) leaves[i] = scalar_t(0);
}

template <typename scalar_t>
__global__ void descend_batch(Layout L, const scalar_t* leaves, const double* sums, const double* u, int64_t n,
                              bool stratified, int64_t* out_indices, scalar_t* out_priorities) {
  int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (k >= n) return;
  const double total = sums[0];
  const double uk = u[k];
  if (!(total > 0.0) || !valid_uniform(uk)) {
    out_indices[k] = -1;
    out_priorities[k] = scalar_t(0);
    return;
  }
  const int64_t leaf = descend(L, leaves, sums, sample_target(uk, k, n, stratified, total));
  out_indices[k] = leaf;
  out_priorities[k] = leaves[leaf];
}

}  // namespace

template <typename scalar_t>
cudaError_t update(int64_t capacity, scalar_t* leaves, double* sums, double* mins, const int64_t* indices,
                   const scalar_t* priorities, int64_t n, int64_t* winner, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const Layout L = make_layout(capacity);
  const int blocks = blocks_for(n);
  claim_reset<<<blocks, kThreads, 0, stream>>>(indices, n, capacity, winner);
  claim_last<<<blocks, kThreads, 0, stream>>>(indices, n, capacity, winner);
  write_winners<scalar_t><<<blocks, kThreads, 0, stream>>>(indices, priorities, n, capacity, winner, leaves);
  for (int d = L.depth - 1; d >= 0; --d) {
    recompute_ancestors<scalar_t><<<blocks, kThreads, 0, stream>>>(L, d, indices, n, leaves, sums, mins);
  }
  return cudaGetLastError();
}

template <typename scalar_t>
cudaError_t sample(int64_t capacity, const scalar_t* leaves, const double* sums, const double* u, int64_t n,
                   bool stratified, int64_t* out_indices, scalar_t* out_priorities, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const Layout L = make_layout(capacity);
  descend_batch<scalar_t><<<blocks_for(n), kThreads, 0, stream>>>(L, leaves, sums, u, n, stratified, out_indices,
                                                                    out_priorities);
  return cudaGetLastError();
}

template <typename scalar_t>
cudaError_t rebuild(int64_t capacity, scalar_t* leaves, double* sums, double* mins, cudaStream_t stream) {
  const Layout L = make_layout(capacity);
  zero_padding<scalar_t><<<1, kThreads, 0, stream>>>(L, leaves);
  for (int d = L.depth - 1; d >= 0; --d) {
    recompute_level<scalar_t><<<blocks_for(L.level_nodes[d]), kThreads, 0, stream>>>(L, d, leaves, sums, mins);
  }
  return cudaGetLastError();
}

int runtime_version() { return CUDART_VERSION; }

#define TR_INSTANTIATE(T)                                                                                   \
  template cudaError_t update<T>(int64_t, T*, double*, double*, const int64_t*, const T*, int64_t, int64_t*, \
                                 cudaStream_t);                                                             \
  template cudaError_t sample<T>(int64_t, const T*, const double*, const double*, int64_t, bool, int64_t*, T*, \
                                 cudaStream_t);                                                             \
  template cudaError_t rebuild<T>(int64_t, T*, double*, double*, cudaStream_t);

TR_INSTANTIATE(float)
TR_INSTANTIATE(double)
#undef TR_INSTANTIATE

}  // namespace cuda
}  // namespace tree
}  // namespace torchreplay
