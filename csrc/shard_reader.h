// Cold-tier row reader for shard files (docs/storage_format.md), torch-free so the C++ unit test
// and the torch op share it.
//
// One call reads the rows of many (file, field block) segments: it plans which pages cover the
// rows, coalesces adjacent pages into one read, reads them on several threads with pread
// (O_DIRECT when asked), checks every page against its CRC32 and copies the rows out of the
// verified pages into their destination. The Python version of this loop held the GIL for every
// checksum and row copy, which serialized its I/O threads; here no interpreter is involved.
//
// Failures are data, not exceptions: a file that cannot be opened or read, a short read or a
// checksum mismatch is reported per segment, so the caller decides which rollouts to give up on.
// Only an inconsistent request (rows outside their block, a destination too small) is refused,
// before any byte is read.
#pragma once

#include <fcntl.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <iterator>
#include <limits>
#include <mutex>
#include <new>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "crc32.h"

namespace torchreplay {
namespace shard {

constexpr int64_t kAlign = 4096;
// Reads larger than this are split so several threads share one long run (a whole-block read).
constexpr int64_t kTaskBytes = 4 << 20;

// Rows of one field block of one file.
struct Segment {
  int64_t file;          // index into the file list
  int64_t block_offset;  // byte offset of the block in the file (4 KiB aligned)
  int64_t block_bytes;   // payload bytes of the block (the file pads it to 4 KiB)
  int64_t row_bytes;     // bytes per token row
  int64_t page_size;     // checksum page size (a multiple of 4 KiB)
  int64_t crc_begin;     // index of the block's page 0 in the checksum list
  int64_t dest;          // destination index; -1 = verify the pages only
  int64_t row_begin;     // this segment's rows in the row list: [row_begin, row_end)
  int64_t row_end;
};
constexpr int kSegmentFields = 9;

// Token rows [start, end) of the block go to destination rows [dest, dest + end - start).
struct Row {
  int64_t start, end, dest;
};
constexpr int kRowFields = 3;

struct Dest {
  char* data;
  int64_t bytes;
};

enum Code : int64_t { kOk = 0, kChecksum = 1, kShortRead = 2, kOpenFailed = 3, kReadFailed = 4 };

// Per segment: the first failure (code + detail: the block's page index for kChecksum, bytes got
// for kShortRead, errno otherwise), bytes read and pread calls made.
struct Status {
  int64_t code = kOk, detail = 0, bytes = 0, reads = 0;
};
constexpr int kStatusFields = 4;

// Per checksum page: what the read found.
static_assert(sizeof(Segment) == kSegmentFields * sizeof(int64_t), "Segment mirrors a row of int64s");
static_assert(sizeof(Row) == kRowFields * sizeof(int64_t), "Row mirrors a row of int64s");
static_assert(sizeof(Status) == kStatusFields * sizeof(int64_t), "Status mirrors a row of int64s");

enum PageState : uint8_t { kPageUnread = 0, kPageOk = 1, kPageBad = 2 };

// The names of the fields above in order, and of the codes by value. Python's typed views of these
// rows (torchreplay/storage/reader_abi.py) are checked against them at import: a field added or
// moved here without its Python twin is refused then, instead of every row being misread.
constexpr const char* kSegmentFieldNames[] = {"file",      "block_offset", "block_bytes", "row_bytes", "page_size",
                                              "crc_begin", "dest",         "row_begin",   "row_end"};
constexpr const char* kRowFieldNames[] = {"start", "end", "dest"};
constexpr const char* kStatusFieldNames[] = {"code", "detail", "bytes", "reads"};
constexpr const char* kCodeNames[] = {"ok", "checksum", "short_read", "open_failed", "read_failed"};
constexpr const char* kPageStateNames[] = {"unread", "ok", "bad"};
static_assert(std::size(kSegmentFieldNames) == kSegmentFields, "a name per Segment field");
static_assert(std::size(kRowFieldNames) == kRowFields, "a name per Row field");
static_assert(std::size(kStatusFieldNames) == kStatusFields, "a name per Status field");
static_assert(std::size(kCodeNames) == kReadFailed + 1, "a name per Code, by value");
static_assert(std::size(kPageStateNames) == kPageBad + 1, "a name per PageState, by value");

// "Segment=file,...;Row=...;Status=...;Code=ok:0,...;PageState=unread:0,...": the op
// torchreplay::shard_reader_layout returns it.
inline std::string layout_description() {
  std::string out;
  auto add = [&out](const char* kind, const char* const* names, size_t n, bool numbered) {
    out += out.empty() ? "" : ";";
    out += std::string(kind) + "=";
    for (size_t i = 0; i < n; ++i) {
      out += (i ? "," : "") + std::string(names[i]) + (numbered ? ":" + std::to_string(i) : "");
    }
  };
  add("Segment", kSegmentFieldNames, std::size(kSegmentFieldNames), false);
  add("Row", kRowFieldNames, std::size(kRowFieldNames), false);
  add("Status", kStatusFieldNames, std::size(kStatusFieldNames), false);
  add("Code", kCodeNames, std::size(kCodeNames), true);
  add("PageState", kPageStateNames, std::size(kPageStateNames), true);
  return out;
}

inline int64_t align_up(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

inline int64_t pages_of(const Segment& g) {
  return std::max<int64_t>(1, (g.block_bytes + g.page_size - 1) / g.page_size);
}

// Empty when the request is consistent, else why not. Checked before any file is opened, so a
// bad range never turns into an out-of-bounds read or write.
inline std::string validate(const std::vector<Segment>& segs, const std::vector<Row>& rows, int64_t files,
                            int64_t crcs, const std::vector<Dest>& dests) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max() / 4;
  for (size_t i = 0; i < segs.size(); ++i) {
    const Segment& g = segs[i];
    const std::string at = "segment " + std::to_string(i) + ": ";
    if (g.file < 0 || g.file >= files) return at + "file index " + std::to_string(g.file) + " out of range";
    if (g.block_offset < 0 || g.block_offset % kAlign || g.block_offset > kMax)
      return at + "block offset " + std::to_string(g.block_offset) + " is negative or not 4 KiB aligned";
    if (g.block_bytes < 0 || g.block_bytes > kMax || g.row_bytes < 0 || g.row_bytes > kMax)
      return at + "negative or implausible block/row size";
    if (g.page_size <= 0 || g.page_size % kAlign || g.page_size > (int64_t{1} << 30))
      return at + "page size " + std::to_string(g.page_size) + " is not a multiple of 4 KiB in [4 KiB, 1 GiB]";
    if (g.crc_begin < 0 || g.crc_begin > crcs - pages_of(g))
      return at + "page checksums [" + std::to_string(g.crc_begin) + ", +" + std::to_string(pages_of(g)) +
             ") outside the " + std::to_string(crcs) + " given";
    if (g.dest < -1 || g.dest >= static_cast<int64_t>(dests.size()))
      return at + "destination index " + std::to_string(g.dest) + " out of range";
    if (g.row_begin < 0 || g.row_begin > g.row_end || g.row_end > static_cast<int64_t>(rows.size()))
      return at + "row range out of range";
    const int64_t block_rows = g.row_bytes ? g.block_bytes / g.row_bytes : 0;
    const int64_t dest_rows = (g.dest >= 0 && g.row_bytes) ? dests[g.dest].bytes / g.row_bytes : 0;
    for (int64_t r = g.row_begin; r < g.row_end; ++r) {
      const Row& w = rows[r];
      if (w.start < 0 || w.end < w.start || w.dest < 0)
        return at + "row " + std::to_string(r) + " has a negative or reversed range";
      if (g.row_bytes == 0) continue;
      if (w.end > block_rows)
        return at + "row " + std::to_string(r) + " [" + std::to_string(w.start) + ", " + std::to_string(w.end) +
               ") runs past the block's " + std::to_string(block_rows) + " rows";
      if (g.dest >= 0 && w.dest > dest_rows - (w.end - w.start))
        return at + "row " + std::to_string(r) + " does not fit its destination (" + std::to_string(dest_rows) +
               " rows)";
    }
  }
  return {};
}

namespace detail {

struct Task {
  int64_t seg;
  int64_t file_offset;  // where the read starts
  int64_t read_bytes;   // 4 KiB aligned
  int64_t block_pos;    // block byte the read starts at (a page boundary)
  int64_t valid_bytes;  // payload bytes in the read (the rest is block padding)
  int64_t order_lo, order_hi;  // rows that may intersect it, in `order`
};

struct AlignedBuffer {
  char* data = nullptr;
  ~AlignedBuffer() { std::free(data); }
  bool reserve(int64_t bytes) {
    data = static_cast<char*>(std::aligned_alloc(kAlign, static_cast<size_t>(align_up(std::max<int64_t>(bytes, 1)))));
    return data != nullptr;
  }
};

}  // namespace detail

// Reads, verifies and copies. `segs`, `rows` and `dests` must have passed validate(). `page_state`
// (one entry per checksum) receives kPageOk/kPageBad for each page read; `status` one per segment.
inline void read_rows(const std::vector<std::string>& paths, const std::vector<Segment>& segs,
                      const std::vector<Row>& rows, const int64_t* crcs, const std::vector<Dest>& dests,
                      uint8_t* page_state, std::vector<Status>& status, bool direct, int threads) {
  using detail::Task;
  status.assign(segs.size(), Status{});
  // Plan: per segment, rows ordered by start; runs of adjacent or overlapping pages become one
  // read, split at kTaskBytes.
  std::vector<int64_t> order;
  std::vector<Task> tasks;
  std::vector<char> file_used(paths.size(), 0);
  for (size_t s = 0; s < segs.size(); ++s) {
    const Segment& g = segs[s];
    const int64_t first = static_cast<int64_t>(order.size());
    for (int64_t r = g.row_begin; r < g.row_end; ++r)
      if (rows[r].end > rows[r].start && g.row_bytes) order.push_back(r);
    std::sort(order.begin() + first, order.end(),
              [&](int64_t a, int64_t b) { return rows[a].start < rows[b].start; });
    const int64_t ps = g.page_size;
    const int64_t chunk = std::max(ps, kTaskBytes / ps * ps);
    const int64_t padded = align_up(g.block_bytes);
    auto emit = [&](int64_t page_a, int64_t page_b, int64_t lo, int64_t hi) {
      for (int64_t p = page_a * ps; p < (page_b + 1) * ps && p < padded; p += chunk) {
        const int64_t end = std::min({p + chunk, (page_b + 1) * ps, padded});
        tasks.push_back(Task{static_cast<int64_t>(s), g.block_offset + p, end - p, p,
                             std::min(end, g.block_bytes) - p, lo, hi});
      }
    };
    int64_t run_a = -1, run_b = -1, run_lo = first;
    for (int64_t k = first; k < static_cast<int64_t>(order.size()); ++k) {
      const Row& w = rows[order[k]];
      const int64_t a = w.start * g.row_bytes / ps, b = (w.end * g.row_bytes - 1) / ps;
      if (run_a >= 0 && a <= run_b + 1) {
        run_b = std::max(run_b, b);
        continue;
      }
      if (run_a >= 0) emit(run_a, run_b, run_lo, k);
      run_a = a, run_b = b, run_lo = k;
    }
    if (run_a >= 0) emit(run_a, run_b, run_lo, static_cast<int64_t>(order.size()));
    if (static_cast<int64_t>(order.size()) > first) file_used[g.file] = 1;
  }
  if (tasks.empty()) return;

  std::vector<int> fds(paths.size(), -1), open_errno(paths.size(), 0);
  for (size_t f = 0; f < paths.size(); ++f) {
    if (!file_used[f]) continue;
    fds[f] = ::open(paths[f].c_str(), O_RDONLY | O_CLOEXEC | (direct ? O_DIRECT : 0));
    if (fds[f] < 0) {
      open_errno[f] = errno;
    } else if (!direct) {
      // Sampled pages are scattered: kernel readahead would read (and cache) bytes nobody asked
      // for, and a fresh descriptor per call starts with a sequential guess. fio does the same
      // for its random jobs (fadvise_hint). Advisory, so a failure changes nothing.
      ::posix_fadvise(fds[f], 0, 0, POSIX_FADV_RANDOM);
    }
  }
  auto fail = [&](int64_t seg, int64_t code, int64_t detail) {
    if (status[seg].code == kOk) status[seg].code = code, status[seg].detail = detail;
  };
  int64_t biggest = 0;
  for (const Task& t : tasks) biggest = std::max(biggest, t.read_bytes);

  // What a reader hands the checker: a task's bytes (or why there are none).
  struct Read {
    size_t task;
    char* buf;
    int64_t got, reads;
    int err;
  };
  auto read_task = [&](size_t i, char* buf) {
    const Task& t = tasks[i];
    Read r{i, buf, 0, 0, 0};
    const int fd = fds[segs[t.seg].file];
    while (fd >= 0 && r.got < t.read_bytes) {
      const ssize_t n = ::pread(fd, buf + r.got, static_cast<size_t>(t.read_bytes - r.got), t.file_offset + r.got);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) r.err = errno;
      if (n <= 0) break;
      r.got += n;
      ++r.reads;
    }
    return r;
  };
  // Runs on one thread only (the caller), so the status needs no lock.
  auto check_task = [&](const Read& r) {
    const Task& t = tasks[r.task];
    const Segment& g = segs[t.seg];
    Status& st = status[t.seg];
    st.bytes += r.got;
    st.reads += r.reads;
    if (fds[g.file] < 0) return fail(t.seg, kOpenFailed, open_errno[g.file]);
    if (r.err) return fail(t.seg, kReadFailed, r.err);
    if (r.got < t.read_bytes) return fail(t.seg, kShortRead, r.got);
    bool intact = true;
    for (int64_t p = 0; p < t.valid_bytes; p += g.page_size) {
      const int64_t page = (t.block_pos + p) / g.page_size;
      const int64_t n = std::min(g.page_size, t.valid_bytes - p);
      const int64_t crc = crc::crc32(0, reinterpret_cast<const uint8_t*>(r.buf) + p, static_cast<size_t>(n));
      const bool ok = crc == crcs[g.crc_begin + page];
      page_state[g.crc_begin + page] = ok ? kPageOk : kPageBad;
      if (!ok && intact) fail(t.seg, kChecksum, page);
      intact = intact && ok;
    }
    if (!intact || g.dest < 0) return;
    char* out = dests[g.dest].data;
    const int64_t lo = t.block_pos, hi = t.block_pos + t.valid_bytes;
    for (int64_t k = t.order_lo; k < t.order_hi; ++k) {
      const Row& w = rows[order[k]];
      const int64_t a = w.start * g.row_bytes, b = w.end * g.row_bytes;
      const int64_t from = std::max(a, lo), to = std::min(b, hi);
      if (from < to) std::memcpy(out + w.dest * g.row_bytes + (from - a), r.buf + (from - lo), to - from);
    }
  };

  // Reader threads do nothing but pread, so `threads` requests stay in flight the whole time (as
  // with `threads` psync fio jobs) instead of pausing for checksums and copies, which the calling
  // thread does meanwhile. Buffers circulate through a fixed pool: memory stays bounded and a
  // reader starts its next pread while its last buffer is still being checked.
  const int64_t n_readers = std::min<int64_t>(std::max(threads, 1), static_cast<int64_t>(tasks.size()));
  std::vector<detail::AlignedBuffer> buffers(static_cast<size_t>(2 * n_readers));
  std::vector<char*> free_bufs;
  for (auto& b : buffers)
    if (b.reserve(biggest)) free_bufs.push_back(b.data);
  std::mutex mu;
  std::condition_variable buffer_freed, read_done;
  std::deque<Read> ready;
  std::atomic<size_t> next{0};
  auto reader = [&]() {
    for (size_t i; (i = next.fetch_add(1)) < tasks.size();) {
      char* buf;
      {
        std::unique_lock<std::mutex> lock(mu);
        buffer_freed.wait(lock, [&] { return !free_bufs.empty(); });
        buf = free_bufs.back();
        free_bufs.pop_back();
      }
      Read r = read_task(i, buf);
      {
        std::lock_guard<std::mutex> lock(mu);
        ready.push_back(r);
      }
      read_done.notify_one();
    }
  };
  std::vector<std::thread> pool;
  if (!free_bufs.empty()) {
    try {
      for (int64_t k = 0; k < n_readers; ++k) pool.emplace_back(reader);
    } catch (const std::system_error&) {
      // Fewer readers than asked (a thread limit): those running take every task.
    }
  }
  if (pool.empty()) {
    // No reader thread (or no buffer): read and check here, one task at a time.
    detail::AlignedBuffer own;
    const bool have = !free_bufs.empty() || own.reserve(biggest);
    char* buf = free_bufs.empty() ? own.data : free_bufs.front();
    for (size_t i = 0; i < tasks.size(); ++i) {
      if (!have) {
        fail(tasks[i].seg, kReadFailed, ENOMEM);
        continue;
      }
      check_task(read_task(i, buf));
    }
  } else {
    for (size_t checked = 0; checked < tasks.size(); ++checked) {
      Read r;
      {
        std::unique_lock<std::mutex> lock(mu);
        read_done.wait(lock, [&] { return !ready.empty(); });
        r = ready.front();
        ready.pop_front();
      }
      check_task(r);
      {
        std::lock_guard<std::mutex> lock(mu);
        free_bufs.push_back(r.buf);
      }
      buffer_freed.notify_one();
    }
    for (auto& th : pool) th.join();
  }
  for (size_t f = 0; f < fds.size(); ++f)
    if (fds[f] >= 0) ::close(fds[f]);
}

}  // namespace shard
}  // namespace torchreplay
