// CRC-32 (the zlib / gzip polynomial, reflected) of a byte range, identical to zlib's crc32().
//
// The shard reader checks every page it reads, and on this kind of 2-core machine zlib's table
// version (~2.2 GB/s) was the largest CPU cost of a cold sample, competing with the process's
// other threads under load. On x86-64 with PCLMULQDQ the bulk of each buffer is folded with
// carry-less multiplies (the folding method of Intel's white paper "Fast CRC Computation for
// Generic Polynomials Using PCLMULQDQ Instruction", 2009), and zlib handles short buffers and
// the last < 16 bytes. Elsewhere zlib does everything.
#pragma once

// Without zlib's headers (a minimal build image), setup.py defines TORCHREPLAY_NO_ZLIB and the
// table-driven CRC of crc32_portable.h takes zlib's place: the same checksum, slower on short
// buffers only, since the bulk still goes through the carry-less multiply path.
#ifdef TORCHREPLAY_NO_ZLIB
#include "crc32_portable.h"
#else
#include <zlib.h>
#endif

#include <cstddef>
#include <cstdint>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define TORCHREPLAY_CRC32_CLMUL 1
#endif

namespace torchreplay {
namespace crc {

#ifdef TORCHREPLAY_NO_ZLIB
inline uint32_t crc32_zlib(uint32_t crc, const uint8_t* data, size_t n) {
  static const auto table = [] {
    struct Table { uint32_t entry[256]; } t{};
    for (uint32_t i = 0; i < 256; ++i) t.entry[i] = table_entry(i);
    return t;
  }();
  return crc32_table(table.entry, crc, data, n);
}
#else
inline uint32_t crc32_zlib(uint32_t crc, const uint8_t* data, size_t n) {
  // zlib takes uInt lengths; pages are at most 1 GiB, but stay correct for any size.
  while (n > 0) {
    const size_t step = n > (1u << 30) ? (1u << 30) : n;
    crc = static_cast<uint32_t>(::crc32(crc, data, static_cast<uInt>(step)));
    data += step;
    n -= step;
  }
  return crc;
}
#endif

#ifdef TORCHREPLAY_CRC32_CLMUL
// Folding constants for the reflected polynomial 0x104C11DB7, each x^k mod P bit-reflected:
// k1/k2 fold 512 bits ahead, k3/k4 128 bits, k5 64 -> 32, and P' / mu for Barrett reduction.
constexpr uint64_t kK1 = 0x154442bd4, kK2 = 0x1c6e41596;
constexpr uint64_t kK3 = 0x1751997d0, kK4 = 0x0ccaa009e;
constexpr uint64_t kK5 = 0x163cd6124;
constexpr uint64_t kP = 0x1db710641, kMu = 0x1f7011641;

__attribute__((target("pclmul,sse4.1"))) inline __m128i fold(__m128i x, __m128i k, __m128i next) {
  return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11)), next);
}

// `state` is the running CRC register (zlib's value, not inverted); n >= 64 and a multiple of 16.
__attribute__((target("pclmul,sse4.1"))) inline uint32_t fold_blocks(uint32_t state, const uint8_t* p, size_t n) {
  auto load = [](const uint8_t* q) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)); };
  __m128i x0 = _mm_xor_si128(load(p), _mm_cvtsi32_si128(static_cast<int>(state)));
  __m128i x1 = load(p + 16), x2 = load(p + 32), x3 = load(p + 48);
  p += 64;
  n -= 64;
  const __m128i k12 = _mm_set_epi64x(static_cast<long long>(kK2), static_cast<long long>(kK1));
  for (; n >= 64; p += 64, n -= 64) {
    x0 = fold(x0, k12, load(p));
    x1 = fold(x1, k12, load(p + 16));
    x2 = fold(x2, k12, load(p + 32));
    x3 = fold(x3, k12, load(p + 48));
  }
  const __m128i k34 = _mm_set_epi64x(static_cast<long long>(kK4), static_cast<long long>(kK3));
  x0 = fold(fold(fold(x0, k34, x1), k34, x2), k34, x3);
  for (; n >= 16; p += 16, n -= 16) x0 = fold(x0, k34, load(p));
  // 128 -> 64 bits (appending 32 zero bits), 64 -> 32, then Barrett reduction to the remainder.
  x0 = _mm_xor_si128(_mm_srli_si128(x0, 8), _mm_clmulepi64_si128(k34, x0, 0x01));
  const __m128i low32 = _mm_setr_epi32(-1, 0, 0, 0);
  const __m128i k5 = _mm_set_epi64x(0, static_cast<long long>(kK5));
  x0 = _mm_xor_si128(_mm_srli_si128(x0, 4), _mm_clmulepi64_si128(_mm_and_si128(x0, low32), k5, 0x00));
  const __m128i pmu = _mm_set_epi64x(static_cast<long long>(kMu), static_cast<long long>(kP));
  __m128i t = _mm_clmulepi64_si128(_mm_and_si128(x0, low32), pmu, 0x10);
  t = _mm_clmulepi64_si128(_mm_and_si128(t, low32), pmu, 0x00);
  return static_cast<uint32_t>(_mm_extract_epi32(_mm_xor_si128(x0, t), 1));
}

inline bool have_clmul() {
  static const bool ok = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
  return ok;
}
#endif

// crc32(crc, data, n) as zlib computes it: `crc` is the CRC of what came before (0 to start).
inline uint32_t crc32(uint32_t crc, const uint8_t* data, size_t n) {
#ifdef TORCHREPLAY_CRC32_CLMUL
  if (n >= 64 && have_clmul()) {
    const size_t bulk = n & ~static_cast<size_t>(15);
    crc = ~fold_blocks(~crc, data, bulk);
    return crc32_zlib(crc, data + bulk, n - bulk);
  }
#endif
  return crc32_zlib(crc, data, n);
}

}  // namespace crc
}  // namespace torchreplay
