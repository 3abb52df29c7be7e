// Torch glue of the cold-tier row reader (csrc/shard_reader.h). Tensors carry the request so one
// op call covers every cold shard of a sampled batch; torch releases the GIL around op calls, so
// the reader's threads and Python's never wait on each other.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "../shard_reader.h"

namespace torchreplay {
namespace {

at::Tensor read_shard_rows_cpu(std::vector<std::string> paths, const at::Tensor& segments_in,
                               const at::Tensor& rows_in, const at::Tensor& crcs_in, at::TensorList dests_in,
                               const at::Tensor& page_state, bool direct, int64_t threads) {
  TORCH_CHECK(segments_in.dim() == 2 && segments_in.size(1) == shard::kSegmentFields &&
                  segments_in.scalar_type() == at::kLong,
              "segments must be int64 [S, ", shard::kSegmentFields, "]");
  TORCH_CHECK(rows_in.dim() == 2 && rows_in.size(1) == shard::kRowFields && rows_in.scalar_type() == at::kLong,
              "rows must be int64 [R, ", shard::kRowFields, "]");
  TORCH_CHECK(crcs_in.dim() == 1 && crcs_in.scalar_type() == at::kLong, "crcs must be a 1-D int64 tensor");
  TORCH_CHECK(page_state.dim() == 1 && page_state.scalar_type() == at::kByte && page_state.is_contiguous() &&
                  page_state.numel() == crcs_in.numel(),
              "page_state must be a contiguous uint8 tensor with one entry per checksum");
  TORCH_CHECK(threads >= 1 && threads <= 256, "threads must be in [1, 256], got ", threads);
  for (const auto* t : {&segments_in, &rows_in, &crcs_in, &page_state}) {
    TORCH_CHECK(t->device().is_cpu(), "read_shard_rows takes CPU tensors");
  }
  const at::Tensor segments = segments_in.contiguous(), rows_t = rows_in.contiguous(), crcs = crcs_in.contiguous();
  std::vector<shard::Segment> segs(segments.size(0));
  std::memcpy(segs.data(), segments.data_ptr<int64_t>(), segs.size() * sizeof(shard::Segment));
  std::vector<shard::Row> rows(rows_t.size(0));
  std::memcpy(rows.data(), rows_t.data_ptr<int64_t>(), rows.size() * sizeof(shard::Row));
  std::vector<shard::Dest> dests;
  dests.reserve(dests_in.size());
  for (const at::Tensor& d : dests_in) {
    TORCH_CHECK(d.device().is_cpu() && d.is_contiguous(), "destinations must be contiguous CPU tensors");
    dests.push_back({static_cast<char*>(d.data_ptr()), static_cast<int64_t>(d.nbytes())});
  }
  const std::string why = shard::validate(segs, rows, static_cast<int64_t>(paths.size()), crcs.numel(), dests);
  TORCH_CHECK_VALUE(why.empty(), "read_shard_rows: ", why);
  page_state.zero_();
  std::vector<shard::Status> status;
  shard::read_rows(paths, segs, rows, crcs.data_ptr<int64_t>(), dests, page_state.data_ptr<uint8_t>(), status,
                   direct, static_cast<int>(threads));
  at::Tensor out = at::empty({static_cast<int64_t>(status.size()), shard::kStatusFields}, at::kLong);
  std::memcpy(out.data_ptr<int64_t>(), status.data(), status.size() * sizeof(shard::Status));
  return out;
}

// CRC32 of each `page_size` piece of a byte buffer (the last may be short), the checksums a shard
// header records. Spilling computed them with zlib from Python, at ~2 GB/s per thread: the
// largest CPU cost of a spill after the copy itself.
at::Tensor page_crc32_cpu(const at::Tensor& data_in, int64_t page_size) {
  TORCH_CHECK_VALUE(page_size > 0 && page_size % 4096 == 0, "page_crc32: page_size must be a positive multiple of 4096, got ",
                    page_size);
  TORCH_CHECK_TYPE(data_in.scalar_type() == at::kByte && data_in.dim() == 1 && data_in.device().is_cpu(),
                   "page_crc32: data must be a 1-D uint8 CPU tensor");
  const at::Tensor data = data_in.contiguous();
  const int64_t n = data.numel();
  const int64_t pages = n == 0 ? 1 : (n + page_size - 1) / page_size;
  at::Tensor out = at::empty({pages}, at::kLong);
  const auto* bytes = data.data_ptr<uint8_t>();
  auto* crcs = out.data_ptr<int64_t>();
  for (int64_t p = 0; p < pages; ++p) {
    const int64_t begin = p * page_size;
    const int64_t length = std::min(page_size, n - begin);
    crcs[p] = static_cast<int64_t>(crc::crc32(0, bytes + begin, static_cast<size_t>(std::max<int64_t>(length, 0))));
  }
  return out;
}

// CRC32 of byte spans [begin, begin + length) of a buffer: the pages of cold rows staged for a
// device batch (the CUDA twin verifies them in device memory; this one runs the same path on the
// host, where the tests exercise it).
at::Tensor span_crc32_cpu(const at::Tensor& data_in, const at::Tensor& spans_in) {
  TORCH_CHECK_TYPE(data_in.scalar_type() == at::kByte && data_in.dim() == 1 && data_in.device().is_cpu(),
                   "span_crc32: data must be a 1-D uint8 CPU tensor");
  TORCH_CHECK_TYPE(spans_in.scalar_type() == at::kLong && spans_in.dim() == 2 && spans_in.size(1) == 2 &&
                       spans_in.device().is_cpu(),
                   "span_crc32: spans must be int64 [K, 2] on the CPU");
  const at::Tensor data = data_in.contiguous(), spans = spans_in.contiguous();
  const int64_t n = data.numel(), k = spans.size(0);
  const auto* span = spans.data_ptr<int64_t>();
  for (int64_t s = 0; s < k; ++s) {
    const int64_t begin = span[2 * s], length = span[2 * s + 1];
    TORCH_CHECK_VALUE(begin >= 0 && length >= 0 && begin <= n && length <= n - begin, "span_crc32: span ", s, " [",
                      begin, ", +", length, ") is outside the ", n, "-byte buffer");
  }
  at::Tensor out = at::empty({k}, at::kLong);
  const auto* bytes = data.data_ptr<uint8_t>();
  auto* crcs = out.data_ptr<int64_t>();
  for (int64_t s = 0; s < k; ++s) {
    crcs[s] = static_cast<int64_t>(crc::crc32(0, bytes + span[2 * s], static_cast<size_t>(span[2 * s + 1])));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(torchreplay, CPU, m) {
  m.impl("span_crc32", &span_crc32_cpu);
  m.impl("read_shard_rows", &read_shard_rows_cpu);
  m.impl("page_crc32", &page_crc32_cpu);
}

}  // namespace torchreplay
