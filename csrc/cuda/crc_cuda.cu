// CRC-32 of byte spans on the GPU. A CRC is a serial chain, and a span is a 64 KiB page: one
// thread per page would make ~65k dependent table lookups (~1.5 ms). Instead a block of kParts
// threads takes a page, each thread the CRC of one chunk (1 KiB), and the chunks are combined
// with GF(2) shifts (crc32_combine). The splitting and combining are crc32_portable.h's, which the
// host's C++ test checks against zlib.
#include "crc_cuda.h"

#include "../crc32_portable.h"

namespace torchreplay {
namespace crc {
namespace cuda {
namespace {

constexpr int kParts = 64;

__global__ void span_crc32_kernel(const uint8_t* data, int64_t n, const int64_t* spans, int64_t* out) {
  __shared__ uint32_t table[256];
  __shared__ uint32_t chunk_crcs[kParts];
  for (int i = threadIdx.x; i < 256; i += blockDim.x) table[i] = table_entry(static_cast<uint32_t>(i));
  __syncthreads();
  const int64_t s = blockIdx.x;
  const int64_t begin = spans[2 * s], length = spans[2 * s + 1];
  const bool valid = begin >= 0 && length >= 0 && begin <= n && length <= n - begin;
  uint64_t lo = 0, hi = 0;
  if (valid) chunk_bounds(static_cast<uint64_t>(length), kParts, threadIdx.x, &lo, &hi);
  chunk_crcs[threadIdx.x] = crc32_table(table, 0, data + begin + lo, static_cast<size_t>(hi - lo));
  __syncthreads();
  if (threadIdx.x == 0) {
    out[s] = valid ? static_cast<int64_t>(combine_chunks(chunk_crcs, kParts, static_cast<uint64_t>(length))) : -1;
  }
}

}  // namespace

cudaError_t span_crc32(const uint8_t* data, int64_t n, const int64_t* spans, int64_t k, int64_t* out,
                       cudaStream_t stream) {
  if (k == 0) return cudaSuccess;
  if (k > 0x7fffffff) return cudaErrorInvalidValue;
  span_crc32_kernel<<<static_cast<unsigned>(k), kParts, 0, stream>>>(data, n, spans, out);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace crc
}  // namespace torchreplay
