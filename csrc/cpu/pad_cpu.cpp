// Ragged -> padded copy for sampled batches: row k of the output receives tokens
// [starts[k], starts[k] + lengths[k]) of `values`, left- or right-aligned, and, when `fill` is
// given, the rest of the row is set to it, so `out` needs no prefill and every output byte is
// written once. One memcpy per row, rows in parallel. This replaces a gather through [B, T] index
// tensors, which cost more than the bytes it moved.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <optional>

namespace torchreplay {
namespace {

void pad_rows_cpu(const at::Tensor& values, const at::Tensor& starts_in, const at::Tensor& lengths_in,
                  const at::Tensor& dest_in, at::Tensor& out, bool left, const std::optional<at::Scalar>& fill) {
  TORCH_CHECK(values.dim() >= 1 && values.is_contiguous(), "values must be a contiguous tensor of token rows");
  TORCH_CHECK(out.dim() == values.dim() + 1 && out.is_contiguous(), "out must be contiguous [B, T, *row shape]");
  TORCH_CHECK(out.scalar_type() == values.scalar_type(), "out dtype ", out.scalar_type(), " != values dtype ",
              values.scalar_type());
  for (int64_t d = 1; d < values.dim(); ++d) {
    TORCH_CHECK(out.size(d + 1) == values.size(d), "out's row shape must match values' row shape");
  }
  for (const auto* t : {&starts_in, &lengths_in, &dest_in}) {
    TORCH_CHECK(t->dim() == 1 && t->scalar_type() == at::kLong && t->numel() == starts_in.numel(),
                "starts, lengths and dest must be 1-D int64 tensors of equal length");
  }
  const at::Tensor starts = starts_in.contiguous(), lengths = lengths_in.contiguous(), dest = dest_in.contiguous();
  const int64_t n = starts.numel(), rows_out = out.size(0), width = out.size(1), tokens = values.size(0);
  const int64_t* s = starts.data_ptr<int64_t>();
  const int64_t* l = lengths.data_ptr<int64_t>();
  const int64_t* r = dest.data_ptr<int64_t>();
  for (int64_t k = 0; k < n; ++k) {
    TORCH_CHECK_INDEX(r[k] >= 0 && r[k] < rows_out, "dest[", k, "] = ", r[k], " outside [0, ", rows_out, ")");
    TORCH_CHECK_INDEX(l[k] >= 0 && l[k] <= width, "lengths[", k, "] = ", l[k], " outside [0, ", width, "]");
    TORCH_CHECK_INDEX(s[k] >= 0 && s[k] + l[k] <= tokens, "row ", k, " [", s[k], ", ", s[k] + l[k],
                      ") runs outside the ", tokens, " token rows");
  }
  const int64_t row_bytes = values.numel() ? values.nbytes() / tokens : 0;
  const char* src = static_cast<const char*>(values.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  const int64_t inner = tokens ? values.numel() / tokens : 0;  // elements per token row
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const int64_t offset = left ? width - l[k] : 0;
      std::memcpy(dst + (r[k] * width + offset) * row_bytes, src + s[k] * row_bytes, l[k] * row_bytes);
    }
    if (!fill.has_value()) return;
    AT_DISPATCH_ALL_TYPES_AND3(at::kBool, at::kHalf, at::kBFloat16, out.scalar_type(), "pad_rows_fill", [&] {
      const scalar_t value = fill->to<scalar_t>();
      scalar_t* base = out.data_ptr<scalar_t>();
      for (int64_t k = begin; k < end; ++k) {
        const int64_t pad = (width - l[k]) * inner;
        scalar_t* row = base + r[k] * width * inner;
        scalar_t* gap = left ? row : row + l[k] * inner;
        std::fill(gap, gap + pad, value);
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(torchreplay, CPU, m) { m.impl("pad_rows", &pad_rows_cpu); }

}  // namespace torchreplay
