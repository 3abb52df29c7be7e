// C++ unit tests of the cold-tier row reader (csrc/shard_reader.h) on a hand-built block file:
// rows come back byte for byte, a flipped byte is caught on its page and its rows are not copied,
// a missing or truncated file is reported, and inconsistent requests are refused up front.
#include <unistd.h>
#include <zlib.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "crc32_portable.h"
#include "shard_reader.h"

#include "check.h"

using torchreplay::testing::failures;
using namespace torchreplay::shard;

namespace {

constexpr int64_t kPage = 4096;
constexpr int64_t kBlockOffset = 8192;  // the header's room in a real shard
constexpr int64_t kRowBytes = 12;       // e.g. int32 x 3 per token

struct Fixture {
  std::string path;
  std::vector<char> file;       // the whole file
  std::vector<int64_t> crcs;    // per page of the block
  std::vector<int64_t> offsets; // token row offsets of the rollouts
  int64_t block_bytes = 0;

  explicit Fixture(const std::string& dir) : path(dir + "/block.trs") {
    std::mt19937_64 rng(7);
    offsets.push_back(0);
    for (int r = 0; r < 60; ++r) offsets.push_back(offsets.back() + 1 + static_cast<int64_t>(rng() % 900));
    block_bytes = offsets.back() * kRowBytes;
    file.assign(static_cast<size_t>(kBlockOffset + align_up(block_bytes)), 0);
    for (int64_t i = 0; i < block_bytes; ++i) file[kBlockOffset + i] = static_cast<char>(rng());
    for (int64_t p = 0; p < block_bytes; p += kPage) {
      const auto* data = reinterpret_cast<const Bytef*>(file.data() + kBlockOffset + p);
      crcs.push_back(static_cast<int64_t>(crc32(crc32(0L, Z_NULL, 0), data,
                                                static_cast<uInt>(std::min(kPage, block_bytes - p)))));
    }
    write();
  }
  void write() const {
    FILE* f = std::fopen(path.c_str(), "wb");
    std::fwrite(file.data(), 1, file.size(), f);
    std::fclose(f);
  }
  Segment segment(int64_t rows) const {
    return Segment{0, kBlockOffset, block_bytes, kRowBytes, kPage, 0, 0, 0, rows};
  }
};

struct Result {
  std::vector<char> out;
  std::vector<Status> status;
  std::vector<uint8_t> pages;
  std::string refused;
};

Result read(const Fixture& fx, const std::vector<int>& rollouts, bool direct, int threads,
            std::vector<Row>* rows_out = nullptr, Segment* seg_override = nullptr) {
  std::vector<Row> rows;
  int64_t dest = 0;
  for (int r : rollouts) {
    rows.push_back(Row{fx.offsets[r], fx.offsets[r + 1], dest});
    dest += fx.offsets[r + 1] - fx.offsets[r];
  }
  if (rows_out) rows = *rows_out;
  Result res;
  res.out.assign(static_cast<size_t>(dest * kRowBytes), 'x');
  std::vector<Segment> segs{seg_override ? *seg_override : fx.segment(static_cast<int64_t>(rows.size()))};
  std::vector<Dest> dests{{res.out.data(), static_cast<int64_t>(res.out.size())}};
  res.pages.assign(fx.crcs.size(), kPageUnread);
  res.refused = validate(segs, rows, 1, static_cast<int64_t>(fx.crcs.size()), dests);
  if (!res.refused.empty()) return res;
  read_rows({fx.path}, segs, rows, fx.crcs.data(), dests, res.pages.data(), res.status, direct, threads);
  return res;
}

std::vector<char> expected(const Fixture& fx, const std::vector<int>& rollouts) {
  std::vector<char> want;
  for (int r : rollouts)
    want.insert(want.end(), fx.file.begin() + kBlockOffset + fx.offsets[r] * kRowBytes,
                fx.file.begin() + kBlockOffset + fx.offsets[r + 1] * kRowBytes);
  return want;
}

bool direct_supported(const std::string& dir) {
  const std::string probe = dir + "/probe";
  const int fd = ::open(probe.c_str(), O_CREAT | O_WRONLY | O_DIRECT, 0644);
  if (fd < 0) return false;
  ::close(fd);
  ::unlink(probe.c_str());
  return true;
}

void test_rows_round_trip(const Fixture& fx, bool direct) {
  const std::vector<std::vector<int>> cases{{0}, {59}, {3, 4, 5, 40}, {50, 2, 2, 17}, {}};
  std::vector<int> all;
  for (int r = 0; r < 60; ++r) all.push_back(r);
  for (int threads : {1, 3, 8}) {
    for (const auto& rollouts : cases) {
      Result res = read(fx, rollouts, direct, threads);
      CHECK(res.refused.empty(), "refused: %s", res.refused.c_str());
      CHECK(res.status[0].code == kOk, "code %lld", (long long)res.status[0].code);
      CHECK(res.out == expected(fx, rollouts), "rows differ (threads %d, direct %d)", threads, direct);
    }
    Result res = read(fx, all, direct, threads);
    CHECK(res.out == expected(fx, all), "whole block differs");
    CHECK(res.status[0].bytes == align_up(fx.block_bytes), "read %lld bytes", (long long)res.status[0].bytes);
    for (uint8_t p : res.pages) CHECK(p == kPageOk, "every page verified");
  }
}

void test_flipped_byte(Fixture& fx) {
  const int64_t bad_page = 3;
  fx.file[kBlockOffset + bad_page * kPage + 17] ^= 1;
  fx.write();
  std::vector<int> all;
  for (int r = 0; r < 60; ++r) all.push_back(r);
  Result res = read(fx, all, false, 4);
  CHECK(res.status[0].code == kChecksum && res.status[0].detail == bad_page, "code %lld page %lld",
        (long long)res.status[0].code, (long long)res.status[0].detail);
  for (size_t p = 0; p < res.pages.size(); ++p)
    CHECK(res.pages[p] == (static_cast<int64_t>(p) == bad_page ? kPageBad : kPageOk), "page %zu state %d", p,
          res.pages[p]);
  // Bytes of the bad page never reach the destination.
  const int64_t lo = bad_page * kPage, hi = lo + kPage;
  for (int64_t i = lo; i < hi && i < static_cast<int64_t>(res.out.size()); ++i)
    CHECK(res.out[i] == 'x', "byte %lld of a bad page was copied", (long long)i);
  fx.file[kBlockOffset + bad_page * kPage + 17] ^= 1;
  fx.write();
}

void test_missing_and_truncated(Fixture& fx) {
  ::unlink(fx.path.c_str());
  Result res = read(fx, {1, 2}, false, 2);
  CHECK(res.status[0].code == kOpenFailed && res.status[0].detail == ENOENT, "code %lld errno %lld",
        (long long)res.status[0].code, (long long)res.status[0].detail);
  fx.write();
  CHECK(::truncate(fx.path.c_str(), kBlockOffset + kPage) == 0, "truncate");
  res = read(fx, {59}, false, 2);
  CHECK(res.status[0].code == kShortRead, "code %lld", (long long)res.status[0].code);
  fx.write();
}

void test_refused(const Fixture& fx) {
  std::vector<Row> past{Row{0, fx.offsets.back() + 1, 0}};
  Result res = read(fx, {0}, false, 1, &past);
  CHECK(res.refused.find("runs past") != std::string::npos, "got '%s'", res.refused.c_str());
  std::vector<Row> too_big{Row{0, 1000, 0}};  // destination holds rollout 0 only
  res = read(fx, {0}, false, 1, &too_big);
  CHECK(res.refused.find("does not fit") != std::string::npos, "got '%s'", res.refused.c_str());
  Segment seg = fx.segment(1);
  seg.block_offset += 512;
  res = read(fx, {0}, false, 1, nullptr, &seg);
  CHECK(res.refused.find("aligned") != std::string::npos, "got '%s'", res.refused.c_str());
  seg = fx.segment(1);
  seg.crc_begin = 1;  // the last page's checksum would be past the list
  res = read(fx, {0}, false, 1, nullptr, &seg);
  CHECK(res.refused.find("checksums") != std::string::npos, "got '%s'", res.refused.c_str());
}

void test_crc_matches_zlib() {
  std::mt19937_64 rng(11);
  std::vector<uint8_t> buf(70000);
  for (auto& b : buf) b = static_cast<uint8_t>(rng());
  for (int i = 0; i < 3000; ++i) {
    // Every length class: below the folding minimum, odd tails, unaligned starts, whole pages.
    const size_t off = rng() % 32, n = i < 200 ? static_cast<size_t>(i) : rng() % (buf.size() - 32);
    const uint32_t init = i % 2 ? static_cast<uint32_t>(rng()) : 0;
    const uint32_t want = static_cast<uint32_t>(::crc32(init, buf.data() + off, static_cast<uInt>(n)));
    const uint32_t got = torchreplay::crc::crc32(init, buf.data() + off, n);
    CHECK(want == got, "n=%zu off=%zu init=%08x: zlib %08x, ours %08x", n, off, init, want, got);
  }
}

// The table version is what the GPU runs on pages kvikio read into device memory.
void test_portable_crc_matches_zlib() {
  uint32_t table[256];
  for (uint32_t i = 0; i < 256; ++i) table[i] = torchreplay::crc::table_entry(i);
  std::mt19937_64 rng(12);
  std::vector<uint8_t> buf(3 * 4096 + 77);
  for (auto& b : buf) b = static_cast<uint8_t>(rng());
  for (int i = 0; i < 400; ++i) {
    const size_t off = rng() % 64, n = i < 100 ? static_cast<size_t>(i) : rng() % (buf.size() - 64);
    const uint32_t init = i % 3 ? 0 : static_cast<uint32_t>(rng());
    const uint32_t want = static_cast<uint32_t>(::crc32(init, buf.data() + off, static_cast<uInt>(n)));
    const uint32_t got = torchreplay::crc::crc32_table(table, init, buf.data() + off, n);
    CHECK(want == got, "n=%zu off=%zu init=%08x: zlib %08x, table %08x", n, off, init, want, got);
  }
}

// The GPU kernel's scheme: chunks hashed apart, then combined (crc32_portable.h).
void test_chunked_crc_matches_zlib() {
  uint32_t table[256];
  for (uint32_t i = 0; i < 256; ++i) table[i] = torchreplay::crc::table_entry(i);
  std::mt19937_64 rng(13);
  std::vector<uint8_t> buf(65536 + 100);
  for (auto& b : buf) b = static_cast<uint8_t>(rng());
  for (int i = 0; i < 300; ++i) {
    const size_t n = i < 150 ? static_cast<size_t>(i) : (i % 7 == 0 ? 65536 : rng() % buf.size());
    const int parts = i % 3 == 0 ? 64 : 1 + static_cast<int>(rng() % 100);
    std::vector<uint32_t> chunk_crcs(parts);
    for (int t = 0; t < parts; ++t) {
      uint64_t lo = 0, hi = 0;
      torchreplay::crc::chunk_bounds(n, parts, t, &lo, &hi);
      chunk_crcs[t] = torchreplay::crc::crc32_table(table, 0, buf.data() + lo, hi - lo);
    }
    const uint32_t want = static_cast<uint32_t>(::crc32(0, buf.data(), static_cast<uInt>(n)));
    const uint32_t got = torchreplay::crc::combine_chunks(chunk_crcs.data(), parts, n);
    CHECK(want == got, "n=%zu parts=%d: zlib %08x, chunked %08x", n, parts, want, got);
  }
  for (int i = 0; i < 50; ++i) {
    const size_t a = rng() % 5000, b = rng() % 5000;
    const uint32_t ca = static_cast<uint32_t>(::crc32(0, buf.data(), static_cast<uInt>(a)));
    const uint32_t cb = static_cast<uint32_t>(::crc32(0, buf.data() + a, static_cast<uInt>(b)));
    const uint32_t want = static_cast<uint32_t>(::crc32_combine(ca, cb, static_cast<z_off_t>(b)));
    CHECK(torchreplay::crc::crc32_combine(ca, cb, b) == want, "combine a=%zu b=%zu", a, b);
  }
}

}  // namespace

int main() {
  test_chunked_crc_matches_zlib();
  test_crc_matches_zlib();
  test_portable_crc_matches_zlib();
  char tmpl[] = "/tmp/torchreplay-reader-test-XXXXXX";
  const char* dir = ::mkdtemp(tmpl);
  if (!dir) {
    std::printf("mkdtemp failed\n");
    return 1;
  }
  Fixture fx(dir);
  test_rows_round_trip(fx, false);
  if (direct_supported(dir)) test_rows_round_trip(fx, true);
  test_flipped_byte(fx);
  test_missing_and_truncated(fx);
  test_refused(fx);
  ::unlink(fx.path.c_str());
  ::rmdir(dir);
  if (failures) {
    std::printf("%d check(s) failed\n", failures);
    return 1;
  }
  std::printf("shard reader: all checks passed\n");
  return 0;
}
