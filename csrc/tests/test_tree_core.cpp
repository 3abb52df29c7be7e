// C++ unit tests of the torch-free tree core (csrc/segment_tree.h and csrc/cpu/tree_cpu.h),
// against a plain float64 reference. No framework: each check prints what failed and the test
// exits non-zero, which is what ctest reads.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <thread>
#include <vector>

#include "cpu/claim_pool.h"
#include "cpu/tree_cpu.h"

#include "check.h"

using torchreplay::testing::failures;
using namespace torchreplay::tree;

namespace {

struct SerialFor {
  template <typename Fn>
  void operator()(int64_t begin, int64_t end, int64_t, Fn&& fn) const {
    if (begin < end) fn(begin, end);
  }
};

// Two threads over halves: exercises the kernels' claim that chunks are independent.
struct TwoThreadFor {
  template <typename Fn>
  void operator()(int64_t begin, int64_t end, int64_t, Fn&& fn) const {
    if (begin >= end) return;
    int64_t mid = begin + (end - begin) / 2;
    std::thread t([&] { if (begin < mid) fn(begin, mid); });
    fn(mid, end);
    t.join();
  }
};

// The claim pool the torch build uses, with 3 threads (so chunks outnumber a 2-way split).
struct PoolFor {
  template <typename Fn>
  void operator()(int64_t begin, int64_t end, int64_t grain, Fn&& fn) const {
    cpu::ClaimParallelFor{3}(begin, end, grain, fn);
  }
};

template <typename scalar_t>
struct Tree {
  Layout L;
  std::vector<scalar_t> leaves;
  std::vector<double> sums, mins;
  explicit Tree(int64_t capacity)
      : L(make_layout(capacity)),
        leaves(L.padded_leaves, 0),
        sums(L.internal_nodes, 0.0),
        mins(L.internal_nodes, positive_infinity()) {}
};

// Reference descent over the flat prefix sums of the leaves.
int64_t reference_index(const std::vector<double>& p, double target) {
  int64_t last = -1;
  for (size_t i = 0; i < p.size(); ++i) {
    if (p[i] > 0) {
      if (target < p[i]) return static_cast<int64_t>(i);
      last = static_cast<int64_t>(i);
      target -= p[i];
    }
  }
  return last;
}

void test_layout() {
  for (int64_t cap : {1LL, 7LL, 8LL, 9LL, 64LL, 65LL, 1000LL, 1LL << 20, (1LL << 20) + 3}) {
    Layout L = make_layout(cap);
    CHECK(L.padded_leaves >= cap && L.padded_leaves % kArity == 0, "cap=%lld", (long long)cap);
    CHECK(cover_of_level(L, 0) >= cap, "root must cover every leaf, cap=%lld", (long long)cap);
    CHECK(L.level_nodes[0] == 1 && L.level_size[0] == kArity, "one root, padded to a group");
    for (int d = 0; d <= L.depth; ++d) CHECK(L.level_offset[d] % kArity == 0, "level %d starts a group", d);
    for (int d = 1; d < L.depth; ++d) {
      CHECK(L.level_size[d] % kArity == 0, "level %d padded", d);
      CHECK(L.level_size[d] >= (cap + cover_of_level(L, d) - 1) / cover_of_level(L, d), "level %d covers", d);
      // Levels tile the flat array: level d starts where level d - 1 ends, so no two overlap.
      // (Mutation checked: `offset += kArity` instead of `offset += stored` in make_layout overlaps
      // the levels yet keeps every offset a multiple of K: this check and the node count below fail
      // on it, every older layout check passes, and the later tests then crash.)
      CHECK(L.level_offset[d] == L.level_offset[d - 1] + L.level_size[d - 1], "cap=%lld: level %d overlaps %d",
            (long long)cap, d, d - 1);
      // Every stored node of level d - 1 has its whole group of K children stored at level d.
      CHECK(L.level_size[d] >= L.level_nodes[d - 1] * kArity, "cap=%lld: level %d holds its parents' groups",
            (long long)cap, d);
    }
    CHECK(L.internal_nodes == L.level_offset[L.depth] &&
              L.level_offset[L.depth] == L.level_offset[L.depth - 1] + L.level_size[L.depth - 1],
          "cap=%lld: internal node count", (long long)cap);
    CHECK(L.padded_leaves >= L.level_nodes[L.depth - 1] * kArity, "cap=%lld: leaf groups", (long long)cap);
    // The fewest levels that cover the leaves: one fewer would not. (Mutation checked: `span <= capacity`
    // in make_layout adds a level at cap = 8 and 64; only this check fails on it.)
    CHECK(L.depth == 1 || cover_of_level(L, 1) < cap, "cap=%lld: depth %d is not minimal", (long long)cap, L.depth);
  }
}

template <typename scalar_t, typename For>
void test_update_sample(int64_t capacity, int rounds, uint32_t seed) {
  Tree<scalar_t> t(capacity);
  std::vector<double> ref(capacity, 0.0);
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> pick(0, capacity - 1);
  std::uniform_real_distribution<double> val(0.0, 10.0), unit(0.0, 1.0);
  for (int r = 0; r < rounds; ++r) {
    int64_t n = 1 + static_cast<int64_t>(rng() % 64);
    std::vector<int64_t> idx(n);
    std::vector<scalar_t> pr(n);
    for (int64_t i = 0; i < n; ++i) {
      idx[i] = pick(rng);
      // A fifth of updates kill a leaf, so zero leaves sit among live ones.
      pr[i] = rng() % 5 == 0 ? scalar_t(0) : static_cast<scalar_t>(val(rng));
    }
    cpu::update(t.L, t.leaves.data(), t.sums.data(), t.mins.data(), idx.data(), pr.data(), n, For{});
    for (int64_t i = 0; i < n; ++i) ref[idx[i]] = static_cast<double>(pr[i]);  // last wins

    double exact = 0, lowest = positive_infinity();
    for (double v : ref) {
      exact += v;
      if (v > 0) lowest = std::min(lowest, v);
    }
    CHECK(std::fabs(t.sums[0] - exact) <= 1e-12 * std::max(1.0, exact), "root %.17g vs %.17g", t.sums[0], exact);
    CHECK(t.mins[0] == lowest, "min %.17g vs %.17g", t.mins[0], lowest);
    for (int64_t i = 0; i < capacity; ++i) CHECK(static_cast<double>(t.leaves[i]) == ref[i], "leaf %lld", (long long)i);
    if (exact <= 0) continue;

    const int64_t B = 33;
    std::vector<double> u(B);
    for (double& x : u) x = unit(rng);
    u[0] = 0.0;
    u[B - 1] = std::nextafter(1.0, 0.0);  // the boundary that breaks fp32 trees elsewhere
    std::vector<int64_t> out(B);
    std::vector<scalar_t> outp(B);
    cpu::sample(t.L, t.leaves.data(), t.sums.data(), u.data(), B, true, out.data(), outp.data(), For{});
    for (int64_t k = 0; k < B; ++k) {
      CHECK(out[k] >= 0 && out[k] < capacity, "index %lld out of range", (long long)out[k]);
      CHECK(ref[out[k]] > 0, "sampled dead leaf %lld", (long long)out[k]);
      CHECK(k == 0 || out[k] >= out[k - 1], "stratified samples come back sorted");
      CHECK(static_cast<double>(outp[k]) == ref[out[k]], "priority of sample %lld", (long long)k);
      CHECK(out[k] == descend(t.L, t.leaves.data(), t.sums.data(), sample_target(u[k], k, B, true, t.sums[0])),
            "batched and single descent agree");
      // Away from rounding-level ties the tree picks what the flat reference picks.
      double target = sample_target(u[k], k, B, true, exact);
      int64_t expect = reference_index(ref, target);
      double prefix = 0;
      for (int64_t i = 0; i < expect; ++i) prefix += ref[i];
      bool near_edge = std::fabs(target - prefix) < 1e-9 * exact || std::fabs(target - prefix - ref[expect]) < 1e-9 * exact;
      CHECK(near_edge || out[k] == expect, "sample %lld: tree %lld vs reference %lld", (long long)k,
            (long long)out[k], (long long)expect);
    }
  }
}

void test_rebuild_matches_updates() {
  Tree<float> a(1000), b(1000);
  std::vector<int64_t> idx(1000);
  std::vector<float> pr(1000);
  for (int64_t i = 0; i < 1000; ++i) {
    idx[i] = i;
    pr[i] = static_cast<float>((i * 37) % 11);
  }
  cpu::update(a.L, a.leaves.data(), a.sums.data(), a.mins.data(), idx.data(), pr.data(), 1000, SerialFor{});
  std::copy(pr.begin(), pr.end(), b.leaves.begin());
  cpu::rebuild(b.L, b.leaves.data(), b.sums.data(), b.mins.data(), SerialFor{});
  CHECK(a.sums == b.sums, "rebuild equals incremental sums");
  CHECK(a.mins == b.mins, "rebuild equals incremental mins");
}

void test_single_live_leaf_at_every_boundary() {
  // Only the last leaf is live: every u, including the largest double below 1, must land on it.
  for (int64_t cap : {1LL, 8LL, 9LL, 513LL}) {
    Tree<float> t(cap);
    int64_t last = cap - 1;
    float one = 1e-30f;  // tiny mass: targets and sums round hard
    cpu::update(t.L, t.leaves.data(), t.sums.data(), t.mins.data(), &last, &one, 1, SerialFor{});
    double us[] = {0.0, 0.5, std::nextafter(1.0, 0.0)};
    for (double u : us) {
      int64_t got = descend(t.L, t.leaves.data(), t.sums.data(), sample_target(u, 0, 1, false, t.sums[0]));
      CHECK(got == last, "cap %lld u %.17g -> %lld", (long long)cap, u, (long long)got);
    }
  }
}


// The level-synchronous sampler (merged runs, blocks, thread chunks) must return, sample for
// sample, what the one-at-a-time descend() returns (the CUDA kernel's path). Priorities spread
// over 60 orders of magnitude, with dead runs, make the prefix sums round hard, so targets land on
// rounding edges and in the overshoot fallback too.
template <typename scalar_t, typename For>
void test_batched_sample_matches_descend(int64_t capacity, uint32_t seed) {
  Tree<scalar_t> t(capacity);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::vector<int64_t> idx(capacity);
  std::vector<scalar_t> pr(capacity);
  for (int64_t i = 0; i < capacity; ++i) {
    idx[i] = i;
    const uint64_t kind = rng() % 8;
    // Dead runs start at leaf 37 (not 0), so capacities 1 and 9 have live leaves among dead ones
    // too; the last leaf is always live, so no capacity gives an empty tree (which sample() rules
    // out). Before this, capacities 1 and 9 were all dead and 4 of main()'s 14 calls checked nothing.
    const bool dead_run = (i / 37) % 5 == 1;
    pr[i] = dead_run || kind == 0 ? scalar_t(0)
            : kind == 1           ? static_cast<scalar_t>(1e-30)
            : kind == 2           ? static_cast<scalar_t>(1e30)
                                  : static_cast<scalar_t>(unit(rng) * 10.0);
    if (i == capacity - 1 && !(pr[i] > 0)) pr[i] = static_cast<scalar_t>(1.0 + unit(rng));
  }
  cpu::update(t.L, t.leaves.data(), t.sums.data(), t.mins.data(), idx.data(), pr.data(), capacity, SerialFor{});
  CHECK(t.sums[0] > 0, "cap %lld: the test built an empty tree", (long long)capacity);
  if (!(t.sums[0] > 0)) return;
  int64_t checked = 0;
  for (int64_t B : {1LL, 7LL, 33LL, 1000LL, 20000LL}) {
    for (bool stratified : {true, false}) {
      std::vector<double> u(B);
      for (double& x : u) x = unit(rng);
      u[0] = 0.0;
      u[B - 1] = std::nextafter(1.0, 0.0);
      if (!stratified && B > 2) std::sort(u.begin(), u.begin() + B / 2);  // a sorted half, an unsorted half
      std::vector<int64_t> out(B);
      std::vector<scalar_t> outp(B);
      cpu::sample(t.L, t.leaves.data(), t.sums.data(), u.data(), B, stratified, out.data(), outp.data(), For{});
      int bad = 0;
      for (int64_t k = 0; k < B && bad < 5; ++k) {
        const int64_t want = descend(t.L, t.leaves.data(), t.sums.data(), sample_target(u[k], k, B, stratified, t.sums[0]));
        const bool ok = out[k] == want && out[k] >= 0 && out[k] < capacity && t.leaves[out[k]] > 0 &&
                        outp[k] == t.leaves[out[k]];
        CHECK(ok, "cap %lld B %lld stratified %d sample %lld: batched %lld, descend %lld", (long long)capacity,
              (long long)B, stratified, (long long)k, (long long)out[k], (long long)want);
        bad += !ok;
        ++checked;
      }
    }
  }
  // (Mutation checked: cpu::sample returning leaves[node[k] + 1] as the priority fails here at every
  // capacity, caps 1 and 9 included.)
  CHECK(checked == 2 * (1 + 7 + 33 + 1000 + 20000), "cap %lld: %lld samples checked", (long long)capacity,
        (long long)checked);
}

// Chunked, threaded updates (sorted sampled indices and unsorted ones with duplicates) must leave
// exactly the tree that a rebuild from the same leaves gives: last occurrence wins, every touched
// ancestor recomputed, bit for bit.
template <typename scalar_t, typename For>
void test_large_updates_match_rebuild(int64_t capacity, uint32_t seed) {
  Tree<scalar_t> t(capacity), ref(capacity);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::uniform_int_distribution<int64_t> pick(0, capacity - 1);
  for (int r = 0; r < 12; ++r) {
    // Every third batch is tiny, so unsorted updates take the sort path as well as the bitmap.
    const int64_t n = 1 + static_cast<int64_t>(rng() % (r % 3 == 2 ? 24 : 40000));
    std::vector<int64_t> idx(n);
    std::vector<scalar_t> pr(n);
    const int shape = r % 4;  // 0: sampled (sorted), 1: random, 2: sorted with duplicates, 3: one narrow range
    if (shape == 0 && t.sums[0] > 0) {
      std::vector<double> u(n);
      for (double& x : u) x = unit(rng);
      std::vector<scalar_t> unused(n);
      cpu::sample(t.L, t.leaves.data(), t.sums.data(), u.data(), n, true, idx.data(), unused.data(), For{});
    } else {
      const int64_t lo = shape == 3 ? pick(rng) : 0;
      const int64_t width = shape == 3 ? std::min<int64_t>(capacity - lo, 700) : capacity;
      for (int64_t& i : idx) i = lo + static_cast<int64_t>(rng() % static_cast<uint64_t>(width));
      if (shape == 2) std::sort(idx.begin(), idx.end());
    }
    for (scalar_t& p : pr) p = rng() % 6 == 0 ? scalar_t(0) : static_cast<scalar_t>(unit(rng) * 3.0);
    cpu::update(t.L, t.leaves.data(), t.sums.data(), t.mins.data(), idx.data(), pr.data(), n, For{});
    for (int64_t i = 0; i < n; ++i) ref.leaves[idx[i]] = pr[i];
    cpu::rebuild(ref.L, ref.leaves.data(), ref.sums.data(), ref.mins.data(), SerialFor{});
    CHECK(t.leaves == ref.leaves, "cap %lld round %d (n %lld): leaves", (long long)capacity, r, (long long)n);
    CHECK(t.sums == ref.sums, "cap %lld round %d (n %lld): sums", (long long)capacity, r, (long long)n);
    CHECK(t.mins == ref.mins, "cap %lld round %d (n %lld): mins", (long long)capacity, r, (long long)n);
  }
}

// The host's counted child choice must give the portable (GPU) one's child and target exactly:
// groups with zeros, -0.0, denormals, huge and tiny values side by side, targets on and past every
// prefix boundary, and an infinite target.
template <typename value_t>
void test_choose_child_matches_portable(uint32_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  const double specials[] = {0.0, -0.0, 1e-310, 1e-30, 1.0, 3.0, 1e30, 1e300};
  for (int r = 0; r < 200000; ++r) {
    value_t children[kArity];
    for (value_t& c : children) {
      const uint64_t kind = rng() % 4;
      c = kind == 0 ? static_cast<value_t>(specials[rng() % 8]) : static_cast<value_t>(unit(rng) * 4.0);
    }
    double prefix[kArity + 1] = {0.0};
    for (int c = 0; c < kArity; ++c) prefix[c + 1] = prefix[c] + static_cast<double>(children[c]);
    const uint64_t how = rng() % 5;
    const double target = how == 0   ? prefix[rng() % (kArity + 1)]
                          : how == 1 ? std::nextafter(prefix[rng() % (kArity + 1)], 0.0)
                          : how == 2 ? prefix[kArity] * (1.0 + unit(rng) * 1e-15)
                          : how == 3 ? unit(rng) * prefix[kArity]
                                     : std::numeric_limits<double>::infinity();
    double t_portable = target, t_host = target;
    const int c_portable = choose_child_portable(children, t_portable);
    const int c_host = choose_child(children, t_host);
    const bool same_target = t_portable == t_host || (t_portable != t_portable && t_host != t_host);
    CHECK(c_portable == c_host && same_target, "round %d: portable child %d target %.17g, host child %d target %.17g",
          r, c_portable, t_portable, c_host, t_host);
    if (c_portable != c_host || !same_target) return;
  }
}

// The host's lane-wise minimums must equal the portable (GPU) ones: zeros, -0.0, denormals, huge
// values and all-dead groups.
template <typename value_t>
void test_group_minimums_match_portable(uint32_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  const double specials[] = {0.0, -0.0, 1e-310, 1e-45, 1e-30, 1.0, 1e30, 1e300};
  for (int r = 0; r < 200000; ++r) {
    value_t children[kArity];
    double mins[kArity];
    const bool all_dead = r % 97 == 0;
    for (int c = 0; c < kArity; ++c) {
      const uint64_t kind = rng() % 4;
      children[c] = all_dead ? value_t(0)
                    : kind == 0 ? static_cast<value_t>(specials[rng() % 8])
                                : static_cast<value_t>(unit(rng) * 4.0);
      mins[c] = rng() % 5 == 0 ? std::numeric_limits<double>::infinity() : unit(rng) * 1e3;
    }
    const double live_host = live_min(children), live_portable = live_min_portable(children);
    CHECK(live_host == live_portable, "round %d: live min host %.17g, portable %.17g", r, live_host, live_portable);
    const double host = group_min(mins), portable = group_min_portable(mins);
    CHECK(host == portable, "round %d: min host %.17g, portable %.17g", r, host, portable);
    if (live_host != live_portable || host != portable) return;
  }
}

// Pieces of a threaded update must not share a node at or below the split level.
void test_cut_stream_aligns_to_split_nodes() {
  const Layout L = make_layout(1 << 20);
  std::mt19937_64 rng(12);
  for (int r = 0; r < 50; ++r) {
    const int64_t count = 1 + static_cast<int64_t>(rng() % 50000);
    std::vector<int64_t> keys(count);
    const int64_t width = r % 3 == 0 ? 5000 : L.capacity;  // clustered keys force long moves
    for (int64_t& k : keys) k = static_cast<int64_t>(rng() % static_cast<uint64_t>(width));
    std::sort(keys.begin(), keys.end());
    for (int split = 1; split < L.depth; ++split) {
      const int64_t chunks = 1 + static_cast<int64_t>(rng() % cpu::kUpdateMaxChunks);
      int64_t cut[cpu::kUpdateMaxChunks + 1];
      cpu::cut_stream(L, keys.data(), count, 1, split, chunks, cut);
      const int64_t cover = cover_of_level(L, split);
      CHECK(cut[0] == 0 && cut[chunks] == count, "cuts span the stream");
      for (int64_t c = 1; c < chunks; ++c) {
        CHECK(cut[c] >= cut[c - 1], "cuts ascend");
        CHECK(cut[c] == 0 || cut[c] == count || keys[cut[c]] / cover != keys[cut[c] - 1] / cover,
              "cut %lld of %lld at split %d splits a node", (long long)c, (long long)chunks, split);
      }
    }
  }
}

// Every chunk runs exactly once, whatever mix of caller and helpers claims it, including calls
// from several threads at once and thread counts that go up and down between calls.
void test_claim_pool_runs_every_chunk_once() {
  std::vector<std::thread> callers;
  std::atomic<int> bad{0};
  for (int t = 0; t < 3; ++t) {
    callers.emplace_back([t, &bad] {
      for (int r = 0; r < 300; ++r) {
        const int64_t chunks = 1 + (r * 7 + t) % 40;
        std::vector<std::atomic<int>> hits(static_cast<size_t>(chunks));
        cpu::ClaimPool::instance().run(chunks, 1 + (r + t) % 3, [&](int64_t c) { hits[c].fetch_add(1); });
        for (auto& h : hits) bad += h.load() != 1;
      }
    });
  }
  for (auto& c : callers) c.join();
  CHECK(bad.load() == 0, "%d chunks ran other than once", bad.load());
}

}  // namespace

int main() {
  test_layout();
  test_update_sample<float, SerialFor>(1, 50, 1);
  test_update_sample<float, SerialFor>(9, 200, 2);
  test_update_sample<double, SerialFor>(100, 200, 3);
  test_update_sample<float, TwoThreadFor>(5000, 100, 4);
  test_update_sample<double, TwoThreadFor>(70000, 20, 5);
  for (int64_t cap : {1LL, 9LL, 100LL, 5000LL, 70000LL, 1LL << 18}) {
    test_batched_sample_matches_descend<float, SerialFor>(cap, 6);
    test_batched_sample_matches_descend<double, TwoThreadFor>(cap, 7);
  }
  test_large_updates_match_rebuild<float, SerialFor>(1 << 16, 8);
  test_large_updates_match_rebuild<float, TwoThreadFor>((1 << 16) + 5, 9);
  test_large_updates_match_rebuild<double, TwoThreadFor>(300000, 10);
  test_large_updates_match_rebuild<float, TwoThreadFor>(2000, 11);
  test_large_updates_match_rebuild<float, PoolFor>((1 << 18) + 1, 15);
  for (int64_t cap : {100LL, 70000LL}) test_batched_sample_matches_descend<float, PoolFor>(cap, 16);
  test_claim_pool_runs_every_chunk_once();
  test_cut_stream_aligns_to_split_nodes();
  test_choose_child_matches_portable<float>(13);
  test_choose_child_matches_portable<double>(14);
  test_group_minimums_match_portable<float>(16);
  test_group_minimums_match_portable<double>(17);
  test_rebuild_matches_updates();
  test_single_live_leaf_at_every_boundary();
  if (failures) {
    std::printf("%d check(s) failed\n", failures);
    return 1;
  }
  std::printf("tree core: all checks passed\n");
  return 0;
}
