// A small thread pool for the CPU tree kernels in which the calling thread never waits for a helper
// that has not started.
//
// Why not at::parallel_for: with the OpenMP backend it hands each thread a fixed share and joins at
// a barrier, so every call needs all of its threads scheduled. On a machine whose cores are shared
// with other processes a worker is often not, and the call then stalls for scheduler ticks: on the
// 2-core benchmark machine under load, sample-then-update at 2^20/4096 fell from ~10 to ~0.3 M ops/s
// in some runs, far below one thread. Here the work is cut into chunks that threads claim from a
// shared counter; the caller claims too, so it finishes alone if no helper shows up, and it only
// waits for chunks a helper has already claimed. Results never depend on which thread ran a chunk.
//
// Helpers spin briefly after a job (back-to-back kernel calls find them awake, as OpenMP's do),
// then sleep on a condition variable. Torch-free, so the C++ tests run it too.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>

#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#define TR_HAVE_ATFORK 1
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TR_CPU_RELAX() _mm_pause()
#else
#define TR_CPU_RELAX() std::this_thread::yield()
#endif

namespace torchreplay {
namespace tree {
namespace cpu {

class ClaimPool {
 public:
  // The process-wide pool. Never destroyed: helpers may still be parked when static destructors run.
  // A forked child gets a fresh one: the parent's helpers do not exist there, and its mutex may have
  // been held across the fork.
  static ClaimPool& instance() {
#if defined(TR_HAVE_ATFORK)
    static const bool registered = [] {
      pthread_atfork(nullptr, nullptr, [] { slot().store(nullptr, std::memory_order_relaxed); });
      return true;
    }();
    (void)registered;
#endif
    ClaimPool* pool = slot().load(std::memory_order_acquire);
    if (pool != nullptr) return *pool;
    auto* fresh = new ClaimPool();
    if (slot().compare_exchange_strong(pool, fresh, std::memory_order_acq_rel)) return *fresh;
    delete fresh;  // another thread installed one first; no helper of `fresh` was started
    return *pool;
  }

  // Runs fn(c) for every c in [0, chunks), on the caller and up to `helpers` helper threads. fn must
  // not throw (the tree kernels do not): a helper has no caller to hand an exception to.
  template <typename Fn>
  void run(int64_t chunks, int helpers, Fn&& fn) {
    if (chunks <= 0) return;
    if (helpers <= 0 || chunks == 1) {
      for (int64_t c = 0; c < chunks; ++c) fn(c);
      return;
    }
    auto job = std::make_shared<Job>();
    job->chunks = chunks;
    job->helpers = helpers;
    job->ctx = &fn;
    job->call = [](void* ctx, int64_t c) { (*static_cast<std::remove_reference_t<Fn>*>(ctx))(c); };
    post(job, helpers);
    work(*job);
    // Only chunks already claimed by a helper can be outstanding; a helper that has not woken up
    // yet finds none left and touches nothing of this call.
    for (int spins = 0; job->done.load(std::memory_order_acquire) < chunks; ++spins) {
      if (spins < 4096) {
        TR_CPU_RELAX();
      } else {
        std::this_thread::yield();
      }
    }
  }

 private:
  struct Job {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    int64_t chunks = 0;
    int helpers = 0;
    void* ctx = nullptr;
    void (*call)(void*, int64_t) = nullptr;
  };

  static void work(Job& job) {
    for (int64_t c; (c = job.next.fetch_add(1, std::memory_order_relaxed)) < job.chunks;) {
      job.call(job.ctx, c);
      job.done.fetch_add(1, std::memory_order_release);
    }
  }

  void post(const std::shared_ptr<Job>& job, int helpers) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (; started_ < helpers; ++started_) {
        const int id = started_;
        std::thread([this, id] { helper_loop(id); }).detach();
      }
      job_ = job;
      generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
  }

  void helper_loop(int id) {
    uint64_t seen = 0;
    for (;;) {
      // Spin a little for the next job before sleeping: kernels come in quick succession.
      const auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(200);
      while (generation_.load(std::memory_order_acquire) == seen && std::chrono::steady_clock::now() < spin_until) {
        for (int i = 0; i < 64; ++i) TR_CPU_RELAX();
      }
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [&] { return generation_.load(std::memory_order_relaxed) != seen; });
        seen = generation_.load(std::memory_order_relaxed);
        job = job_;
      }
      // Helpers beyond what this call asked for (the thread count went down) sit it out.
      if (job && id < job->helpers) work(*job);
    }
  }

  ClaimPool() = default;

  static std::atomic<ClaimPool*>& slot() {
    static std::atomic<ClaimPool*> pool{nullptr};
    return pool;
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  std::atomic<uint64_t> generation_{0};
  std::shared_ptr<Job> job_;
  int started_ = 0;
};

// The kernels' parallel_for(begin, end, grain, fn(begin, end)) over the pool: up to four pieces per
// thread (so the caller can absorb a late helper's share), none smaller than `grain`.
struct ClaimParallelFor {
  int threads;
  template <typename Fn>
  void operator()(int64_t begin, int64_t end, int64_t grain, Fn&& fn) const {
    if (begin >= end) return;
    const int64_t range = end - begin;
    const int64_t most = static_cast<int64_t>(threads) * 4;
    int64_t pieces = grain > 0 ? (range + grain - 1) / grain : range;
    if (pieces > most) pieces = most;
    if (threads <= 1 || pieces <= 1) {
      fn(begin, end);
      return;
    }
    const int helpers = static_cast<int>(pieces < threads ? pieces : threads) - 1;
    ClaimPool::instance().run(pieces, helpers, [&](int64_t c) {
      const int64_t lo = begin + range * c / pieces;
      const int64_t hi = begin + range * (c + 1) / pieces;
      if (lo < hi) fn(lo, hi);
    });
  }
};

}  // namespace cpu
}  // namespace tree
}  // namespace torchreplay
