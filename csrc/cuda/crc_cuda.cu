// CRC-32 of byte spans on the GPU: one thread per span (a page of a shard block), the byte table in
// shared memory. A page's CRC is a serial chain, so a thread per page is the simple way to use the
// GPU's width: a cold batch verifies hundreds to thousands of 4 KiB pages at once, each ~4096
// dependent table lookups.
#include "crc_cuda.h"

#include "../crc32_portable.h"

namespace torchreplay {
namespace crc {
namespace cuda {
namespace {

constexpr int kThreads = 128;

__global__ void span_crc32_kernel(const uint8_t* data, int64_t n, const int64_t* spans, int64_t k, int64_t* out) {
  __shared__ uint32_t table[256];
  for (int i = threadIdx.x; i < 256; i += blockDim.x) table[i] = table_entry(static_cast<uint32_t>(i));
  __syncthreads();
  const int64_t s = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (s >= k) return;
  const int64_t begin = spans[2 * s], length = spans[2 * s + 1];
  if (begin < 0 || length < 0 || begin > n || length > n - begin) {
    out[s] = -1;
    return;
  }
  out[s] = static_cast<int64_t>(crc32_table(table, 0, data + begin, static_cast<size_t>(length)));
}

}  // namespace

cudaError_t span_crc32(const uint8_t* data, int64_t n, const int64_t* spans, int64_t k, int64_t* out,
                       cudaStream_t stream) {
  if (k == 0) return cudaSuccess;
  const int64_t blocks = (k + kThreads - 1) / kThreads;
  span_crc32_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(data, n, spans, k, out);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace crc
}  // namespace torchreplay
