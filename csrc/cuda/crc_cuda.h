// Torch-free launcher for per-page CRC-32 of device memory (see crc32_portable.h). Like the tree
// launchers it takes raw pointers and a stream and does not synchronize with the host.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace torchreplay {
namespace crc {
namespace cuda {

// out[p] = zlib crc32 of bytes [p * page_size, min((p + 1) * page_size, n)) of `data`, for each of
// the ceil(n / page_size) pages (one page of length 0 when n == 0).
cudaError_t page_crc32(const uint8_t* data, int64_t n, int64_t page_size, int64_t* out, cudaStream_t stream);

}  // namespace cuda
}  // namespace crc
}  // namespace torchreplay
