// Torch-free launcher for CRC-32 of byte spans of device memory (see crc32_portable.h). Like the tree
// launchers it takes raw pointers and a stream and does not synchronize with the host.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace torchreplay {
namespace crc {
namespace cuda {

// out[k] = zlib crc32 of bytes [spans[2k], spans[2k] + spans[2k + 1]) of `data` (n bytes), or -1
// for a span outside [0, n): the host validates first, this only keeps memory safe.
cudaError_t span_crc32(const uint8_t* data, int64_t n, const int64_t* spans, int64_t k, int64_t* out,
                       cudaStream_t stream);

}  // namespace cuda
}  // namespace crc
}  // namespace torchreplay
