// CRC-32 (zlib's polynomial, reflected) in plain table-driven code that compiles for both the host
// and the GPU. The host's fast path is crc32.h (carry-less multiply folding); this one exists so
// that pages read straight into device memory (kvikio) are verified where they landed, with the
// same checksums the shard files carry. The C++ test checks it, and the chunk-and-combine scheme
// the GPU kernel uses, against zlib on the host.
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

// a * b modulo the CRC polynomial, in the reflected order (bit 31 is x^0). The GF(2) product
// behind combining CRCs, as in zlib's crc32_combine (Mark Adler's method); written from the maths.
TR_CRC_HD uint32_t multmodp(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (uint32_t bit = 1u << 31; a != 0; bit >>= 1) {
    if (a & bit) {
      product ^= b;
      a ^= bit;
    }
    b = (b & 1u) ? (b >> 1) ^ kReflectedPoly : b >> 1;
  }
  return product;
}

// x^(8n) modulo the polynomial: what appending n zero bytes multiplies a CRC register by.
TR_CRC_HD uint32_t x8nmodp(uint64_t n) {
  uint32_t result = 1u << 31;  // x^0
  uint32_t power = 1u << 23;   // x^8
  for (; n != 0; n >>= 1) {
    if (n & 1u) result = multmodp(power, result);
    power = multmodp(power, power);
  }
  return result;
}

// The CRC of A followed by B from crc(A), crc(B) and |B|, for zlib-convention CRCs.
TR_CRC_HD uint32_t crc32_combine(uint32_t crc_a, uint32_t crc_b, uint64_t length_b) {
  return multmodp(x8nmodp(length_b), crc_a) ^ crc_b;
}

// A span split into `parts` chunks of ceil(n / parts) bytes (the last ones shorter or empty):
// chunk t is [begin, end). The GPU computes one chunk per thread, then combines.
TR_CRC_HD void chunk_bounds(uint64_t n, int parts, int t, uint64_t* begin, uint64_t* end) {
  const uint64_t chunk = (n + static_cast<uint64_t>(parts) - 1) / static_cast<uint64_t>(parts);
  const uint64_t lo = static_cast<uint64_t>(t) * chunk;
  *begin = lo < n ? lo : n;
  *end = lo + chunk < n ? lo + chunk : n;
}

// The span's CRC from its chunks' CRCs, in order. The common chunk length's shift is computed once.
TR_CRC_HD uint32_t combine_chunks(const uint32_t* chunk_crcs, int parts, uint64_t n) {
  uint64_t begin = 0, end = 0;
  chunk_bounds(n, parts, 0, &begin, &end);
  const uint64_t chunk = end - begin;
  const uint32_t chunk_shift = x8nmodp(chunk);
  uint32_t crc = chunk_crcs[0];
  for (int t = 1; t < parts; ++t) {
    chunk_bounds(n, parts, t, &begin, &end);
    const uint64_t length = end - begin;
    if (length == 0) break;
    crc = multmodp(length == chunk ? chunk_shift : x8nmodp(length), crc) ^ chunk_crcs[t];
  }
  return crc;
}

}  // namespace crc
}  // namespace torchreplay
