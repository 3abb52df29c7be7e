// Torch-free launchers for the CUDA segment-tree kernels. They take raw device pointers and a
// stream, so the .cu compiles with the CUDA toolkit alone; the torch glue lives in
// tree_cuda_ops.cpp, built only when torch has CUDA. None of them synchronizes with the host.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace torchreplay {
namespace tree {
namespace cuda {

// Batched update; duplicates resolve to the last occurrence, like the CPU. `winner` is scratch of
// at least `capacity` int64 (contents irrelevant). Invalid entries (index out of range, priority
// negative/NaN/inf) are skipped: the host validates first, this only keeps memory safe.
template <typename scalar_t>
cudaError_t update(int64_t capacity, scalar_t* leaves, double* sums, double* mins, const int64_t* indices,
                   const scalar_t* priorities, int64_t n, int64_t* winner, cudaStream_t stream);

// Stratified (or plain) sampling from uniforms u. If the tree is empty every index is -1.
template <typename scalar_t>
cudaError_t sample(int64_t capacity, const scalar_t* leaves, const double* sums, const double* u, int64_t n,
                   bool stratified, int64_t* out_indices, scalar_t* out_priorities, cudaStream_t stream);

// O(capacity) rebuild of every internal node from the leaves.
template <typename scalar_t>
cudaError_t rebuild(int64_t capacity, scalar_t* leaves, double* sums, double* mins, cudaStream_t stream);

// CUDART_VERSION the kernels were compiled with.
int runtime_version();

}  // namespace cuda
}  // namespace tree
}  // namespace torchreplay
