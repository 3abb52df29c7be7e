// CUDA glue for the storage ops: per-page CRC-32 of bytes that kvikio read into device memory,
// so cold pages bound for the GPU are verified there instead of round-tripping through the host.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "crc_cuda.h"

namespace torchreplay {
namespace {

at::Tensor page_crc32_cuda(const at::Tensor& data_in, int64_t page_size) {
  TORCH_CHECK_VALUE(page_size > 0 && page_size % 4096 == 0, "page_crc32: page_size must be a positive multiple of 4096, got ",
                    page_size);
  TORCH_CHECK_TYPE(data_in.scalar_type() == at::kByte && data_in.dim() == 1 && data_in.is_cuda(),
                   "page_crc32: data must be a 1-D uint8 CUDA tensor");
  const c10::cuda::CUDAGuard guard(data_in.device());
  const at::Tensor data = data_in.contiguous();
  const int64_t n = data.numel();
  const int64_t pages = n == 0 ? 1 : (n + page_size - 1) / page_size;
  at::Tensor out = at::empty({pages}, data.options().dtype(at::kLong));
  const cudaError_t err = crc::cuda::page_crc32(data.data_ptr<uint8_t>(), n, page_size, out.data_ptr<int64_t>(),
                                                c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "page_crc32 launch failed: ", cudaGetErrorString(err));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(torchreplay, CUDA, m) { m.impl("page_crc32", &page_crc32_cuda); }

}  // namespace torchreplay
