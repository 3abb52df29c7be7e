// CRC-32 (zlib's polynomial, reflected) in plain table-driven code that compiles for both the host
// and the GPU. The host's fast path is crc32.h (carry-less multiply folding); this one exists so
// that pages read straight into device memory (kvikio) are verified where they landed, with the
// same checksums the shard files carry. The C++ test checks it against zlib on the host.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define TR_CRC_HD __host__ __device__ __forceinline__
#else
#define TR_CRC_HD inline
#endif

namespace torchreplay {
namespace crc {

constexpr uint32_t kReflectedPoly = 0xEDB88320u;

// Entry i of the byte-at-a-time table: the remainder of byte i shifted through eight steps.
TR_CRC_HD uint32_t table_entry(uint32_t i) {
  uint32_t r = i;
  for (int k = 0; k < 8; ++k) r = (r & 1u) ? (r >> 1) ^ kReflectedPoly : r >> 1;
  return r;
}

// zlib's crc32(crc, data, n) through a 256-entry table (from table_entry).
TR_CRC_HD uint32_t crc32_table(const uint32_t* table, uint32_t crc, const uint8_t* data, size_t n) {
  uint32_t r = ~crc;
  for (size_t i = 0; i < n; ++i) r = table[(r ^ data[i]) & 0xFFu] ^ (r >> 8);
  return ~r;
}

}  // namespace crc
}  // namespace torchreplay
