// Per-page CRC-32 on the GPU: one thread per page, the byte table in shared memory. A page's CRC
// is a serial chain, so a thread per page is the simple way to use the GPU's width: a cold batch
// verifies hundreds to thousands of 4 KiB pages at once, each ~4096 dependent table lookups.
#include "crc_cuda.h"

#include "../crc32_portable.h"

namespace torchreplay {
namespace crc {
namespace cuda {
namespace {

constexpr int kThreads = 128;

__global__ void page_crc32_kernel(const uint8_t* data, int64_t n, int64_t page_size, int64_t pages, int64_t* out) {
  __shared__ uint32_t table[256];
  for (int i = threadIdx.x; i < 256; i += blockDim.x) table[i] = table_entry(static_cast<uint32_t>(i));
  __syncthreads();
  const int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (p >= pages) return;
  const int64_t begin = p * page_size;
  const int64_t end = begin + page_size < n ? begin + page_size : n;
  const int64_t length = end > begin ? end - begin : 0;
  out[p] = static_cast<int64_t>(crc32_table(table, 0, data + begin, static_cast<size_t>(length)));
}

}  // namespace

cudaError_t page_crc32(const uint8_t* data, int64_t n, int64_t page_size, int64_t* out, cudaStream_t stream) {
  const int64_t pages = n == 0 ? 1 : (n + page_size - 1) / page_size;
  const int64_t blocks = (pages + kThreads - 1) / kThreads;
  page_crc32_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(data, n, page_size, pages, out);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace crc
}  // namespace torchreplay
