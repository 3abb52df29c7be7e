// CUDA glue for the storage ops: CRC-32 of the pages kvikio read into device memory, so cold
// pages bound for the GPU are verified where they landed instead of round-tripping to the host.
// Checks read tensor metadata only (see tree_cuda_ops.cpp); the kernel refuses bad spans itself.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "crc_cuda.h"

namespace torchreplay {
namespace {

at::Tensor span_crc32_cuda(const at::Tensor& data_in, const at::Tensor& spans_in) {
  TORCH_CHECK_TYPE(data_in.scalar_type() == at::kByte && data_in.dim() == 1 && data_in.is_cuda(),
                   "span_crc32: data must be a 1-D uint8 CUDA tensor");
  TORCH_CHECK_TYPE(spans_in.scalar_type() == at::kLong && spans_in.dim() == 2 && spans_in.size(1) == 2 &&
                       spans_in.device() == data_in.device(),
                   "span_crc32: spans must be int64 [K, 2] on the data's device");
  const c10::cuda::CUDAGuard guard(data_in.device());
  const at::Tensor data = data_in.contiguous(), spans = spans_in.contiguous();
  at::Tensor out = at::empty({spans.size(0)}, spans.options());
  const cudaError_t err = crc::cuda::span_crc32(data.data_ptr<uint8_t>(), data.numel(), spans.data_ptr<int64_t>(),
                                                spans.size(0), out.data_ptr<int64_t>(),
                                                c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "span_crc32 launch failed: ", cudaGetErrorString(err));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(torchreplay, CUDA, m) { m.impl("span_crc32", &span_crc32_cuda); }

}  // namespace torchreplay
