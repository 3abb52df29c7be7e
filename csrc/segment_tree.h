// Tree arithmetic shared by the CPU and CUDA back ends.
//
// Everything here is `__host__ __device__` inline code over raw pointers, so the CPU tests run the
// same descent and update logic that the GPU runs, and the two back ends return the same indices
// for the same uniforms.
//
// Layout: a K-ary tree (K = 8) whose internal nodes are float64 sums. Eight doubles are one 64-byte
// cache line, so a descent touches one line per level: 7 levels for 2^20 leaves instead of 20 for a
// binary tree. Internal levels are stored top-down in one flat array; level d holds
// ceil(capacity / K^(depth - d)) nodes, padded to a multiple of K so that every node's children can
// be read as one full group without bounds checks (padding is zero). The root level is padded too:
// with every level starting at a multiple of K, each group of children sits in one cache line of a
// 64-byte aligned array (a lone root slot put every group across two lines). Leaves live in their own array
// (float32 or float64), padded to a multiple of K with zeros. A parallel `mins` array holds, for
// every internal node, the minimum over the *live* (priority > 0) leaves below it, +inf if none.
//
// Precision: a parent is always recomputed from its children in a fixed order, never updated by a
// delta, so sums cannot drift no matter how many updates run; the root differs from the exact sum of
// the leaves only by the rounding of one summation tree (depth * K additions).
#pragma once

#include <cstdint>

// Host-only SSE2 (baseline x86-64, so no dispatch) for the minimum of a group of children.
#if !defined(__CUDACC__) && defined(__SSE2__)
#define TR_HOST_SSE2 1
#include <emmintrin.h>
#else
#define TR_HOST_SSE2 0
#endif

#if defined(__CUDACC__)
#define TR_HD __host__ __device__ __forceinline__
#define TR_UNROLL _Pragma("unroll")
#else
#define TR_HD inline
#define TR_UNROLL _Pragma("GCC unroll 8")
#endif

namespace torchreplay {
namespace tree {

constexpr int kArity = 8;
// 8^21 > 2^63, so no int64 capacity needs more levels.
constexpr int kMaxDepth = 21;

struct Layout {
  int64_t capacity;      // number of addressable leaves
  int64_t padded_leaves;  // capacity rounded up to a multiple of kArity
  int depth;              // number of internal levels (root is level 0)
  int64_t level_offset[kMaxDepth + 1];  // start of each internal level in `sums`/`mins`
  int64_t level_size[kMaxDepth];        // stored (padded) node count per internal level
  int64_t level_nodes[kMaxDepth];       // nodes that cover at least one leaf; the rest stay 0 / +inf
  int64_t internal_nodes;               // total stored internal nodes
};

TR_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

TR_HD int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// capacity >= 1. Deterministic in capacity alone, so the host and the device agree on it.
TR_HD Layout make_layout(int64_t capacity) {
  Layout L{};
  L.capacity = capacity;
  L.padded_leaves = round_up(capacity, kArity);
  int depth = 1;
  int64_t span = kArity;  // leaves under one node of the bottom internal level... times K^(depth-1)
  while (span < capacity) {
    span *= kArity;
    ++depth;
  }
  L.depth = depth;
  int64_t offset = 0;
  for (int d = 0; d < depth; ++d) {
    // Leaves covered by one node at level d: K^(depth - d).
    int64_t cover = 1;
    for (int i = 0; i < depth - d; ++i) cover *= kArity;
    int64_t nodes = ceil_div(capacity, cover);
    int64_t stored = round_up(nodes, kArity);
    L.level_offset[d] = offset;
    L.level_size[d] = stored;
    L.level_nodes[d] = nodes;
    offset += stored;
  }
  L.level_offset[depth] = offset;
  L.internal_nodes = offset;
  return L;
}

// Leaf count covered by one node at internal level d.
TR_HD int64_t cover_of_level(const Layout& L, int d) {
  int64_t cover = 1;
  for (int i = 0; i < L.depth - d; ++i) cover *= kArity;
  return cover;
}

TR_HD double positive_infinity() { return __builtin_huge_val(); }

// The smallest positive value of a group of K children (+inf if none), and the smallest of K mins.
// A minimum is exact in any order, so the host computes it in SSE lanes (baseline x86-64) and the
// GPU one by one, with the same result. On the host this is a third of the bottom level's
// recompute instructions; the update of a small batch is bound by them.
template <typename value_t>
TR_HD double live_min_portable(const value_t* children) {
  double lowest = positive_infinity();
TR_UNROLL
  for (int c = 0; c < kArity; ++c) {
    const double v = static_cast<double>(children[c]);
    if (v > 0.0 && v < lowest) lowest = v;
  }
  return lowest;
}

TR_HD double group_min_portable(const double* mins) {
  double lowest = positive_infinity();
TR_UNROLL
  for (int c = 0; c < kArity; ++c) lowest = mins[c] < lowest ? mins[c] : lowest;
  return lowest;
}

#if TR_HOST_SSE2
inline double live_min(const float* children) {
  const __m128 zero = _mm_setzero_ps();
  const __m128 inf = _mm_set1_ps(__builtin_huge_valf());
  __m128 lanes[2] = {_mm_loadu_ps(children), _mm_loadu_ps(children + 4)};
  for (__m128& v : lanes) {
    const __m128 live = _mm_cmpgt_ps(v, zero);
    v = _mm_or_ps(_mm_and_ps(live, v), _mm_andnot_ps(live, inf));
  }
  __m128 m = _mm_min_ps(lanes[0], lanes[1]);
  m = _mm_min_ps(m, _mm_movehl_ps(m, m));
  m = _mm_min_ss(m, _mm_shuffle_ps(m, m, 1));
  return static_cast<double>(_mm_cvtss_f32(m));
}

inline double live_min(const double* children) {
  const __m128d zero = _mm_setzero_pd();
  const __m128d inf = _mm_set1_pd(__builtin_huge_val());
  __m128d m = inf;
  for (int i = 0; i < kArity / 2; ++i) {
    const __m128d v = _mm_loadu_pd(children + 2 * i);
    const __m128d live = _mm_cmpgt_pd(v, zero);
    m = _mm_min_pd(m, _mm_or_pd(_mm_and_pd(live, v), _mm_andnot_pd(live, inf)));
  }
  return _mm_cvtsd_f64(_mm_min_sd(m, _mm_unpackhi_pd(m, m)));
}

inline double group_min(const double* mins) {
  const __m128d m = _mm_min_pd(_mm_min_pd(_mm_loadu_pd(mins), _mm_loadu_pd(mins + 2)),
                               _mm_min_pd(_mm_loadu_pd(mins + 4), _mm_loadu_pd(mins + 6)));
  return _mm_cvtsd_f64(_mm_min_sd(m, _mm_unpackhi_pd(m, m)));
}
#else
template <typename value_t>
TR_HD double live_min(const value_t* children) { return live_min_portable(children); }
TR_HD double group_min(const double* mins) { return group_min_portable(mins); }
#endif

// Recompute internal node j of level d from its K children. Children are summed left to right in
// float64 from 0.0, which fixes the rounding so every back end produces bit-identical sums, and makes
// a node's stored sum equal to the last prefix choose_child computes over its children.
template <typename scalar_t>
TR_HD void recompute_node(const Layout& L, const scalar_t* leaves, double* sums, double* mins, int d,
                          int64_t j) {
  double total = 0.0;
  double lowest;
  if (d == L.depth - 1) {
    const scalar_t* child = leaves + j * kArity;
TR_UNROLL
    for (int c = 0; c < kArity; ++c) total += static_cast<double>(child[c]);
    lowest = live_min(child);
  } else {
    const int64_t base = L.level_offset[d + 1] + j * kArity;
TR_UNROLL
    for (int c = 0; c < kArity; ++c) total += sums[base + c];
    lowest = group_min(mins + base);
  }
  sums[L.level_offset[d] + j] = total;
  mins[L.level_offset[d] + j] = lowest;
}

// Index of the lowest / highest set bit of a non-zero mask.
TR_HD int lowest_bit(unsigned mask) {
#if defined(__CUDA_ARCH__)
  return __ffs(static_cast<int>(mask)) - 1;
#else
  return __builtin_ctz(mask);
#endif
}

TR_HD int highest_bit(unsigned mask) {
#if defined(__CUDA_ARCH__)
  return 31 - __clz(static_cast<int>(mask));
#else
  return 31 - __builtin_clz(mask);
#endif
}

// Pick the child of a node whose prefix range contains `target`, and make `target` relative to it.
//
// The arithmetic is fixed so that every back end, and every CPU kernel (one sample at a time or a
// sorted batch merged against the node), chooses the same child: the prefix sums P_c are summed
// left to right from 0.0 exactly as recompute_node sums the node's total, the child is the first
// live one with target < P_c, and the new target is target - P_(c-1), one rounding. The prefixes do
// not depend on `target`, so the choice is a comparison mask rather than a chain of data-dependent
// branches (a mispredicted branch per level was most of the CPU descent's time).
//
// A zero-priority child is never chosen, even when rounding pushes `target` to or past the node's
// total: then the last child with positive mass is taken and `target` becomes its whole mass. This
// is what keeps an index >= capacity (or a dead leaf) from ever coming back, a known failure of
// float32 trees. Only an empty node (which callers rule out) gives child 0.
// The choice from the two masks (bit c: child c has mass; target < P_(c+1)), shared by the
// portable and counted versions so both settle boundaries identically.
template <typename value_t>
TR_HD int settle_child(const value_t* children, const double* prefix, unsigned live, unsigned below,
                       double& target) {
  const unsigned hit = live & below;
  if (hit != 0) {
    const int c = lowest_bit(hit);
    target -= prefix[c];
    return c;
  }
  if (live == 0) return 0;
  const int c = highest_bit(live);
  target = static_cast<double>(children[c]);
  return c;
}

template <typename value_t>
TR_HD int choose_child_portable(const value_t* children, double& target) {
  double prefix[kArity + 1];
  prefix[0] = 0.0;
  unsigned live = 0;
  unsigned below = 0;
TR_UNROLL
  for (int c = 0; c < kArity; ++c) {
    const double v = static_cast<double>(children[c]);
    prefix[c + 1] = prefix[c] + v;
    live |= static_cast<unsigned>(v > 0.0) << c;
    below |= static_cast<unsigned>(target < prefix[c + 1]) << c;
  }
  return settle_child(children, prefix, live, below, target);
}

// The host's version of choose_child_portable: the same prefix sums, but the child is found by
// counting the prefixes at or below `target` instead of building and combining two bit masks. For
// every non-NaN target both give the same child and target: the prefixes never decrease (every
// child is >= 0), so the `below` bits are monotone and the count is the lowest set bit of `below`,
// and that child is always live (a dead child adds 0, so target < P_(c+1) = P_c would have stopped
// the count one child earlier; P_0 = 0 <= target). The live mask is needed only for an overshoot.
// Targets are never NaN on the host: the CPU ops refuse to sample a tree whose total is not finite.
// About half the instructions of the mask version, with no vector-to-scalar moves, and the descent
// is bound by these instructions wherever the tree is in cache: 20-30% faster per level measured.
// The GPU keeps the portable code; csrc/tests checks the two against each other.
template <typename value_t>
TR_HD int choose_child_counted(const value_t* children, double& target) {
  double prefix[kArity + 1];
  prefix[0] = 0.0;
  int passed = 0;
TR_UNROLL
  for (int c = 0; c < kArity; ++c) {
    prefix[c + 1] = prefix[c] + static_cast<double>(children[c]);
    passed += static_cast<int>(prefix[c + 1] <= target);
  }
  if (passed < kArity) {
    target -= prefix[passed];
    return passed;
  }
  unsigned live = 0;
TR_UNROLL
  for (int c = 0; c < kArity; ++c) live |= static_cast<unsigned>(static_cast<double>(children[c]) > 0.0) << c;
  return settle_child(children, prefix, live, 0u, target);
}

template <typename value_t>
TR_HD int choose_child(const value_t* children, double& target) {
#if defined(__CUDA_ARCH__)
  return choose_child_portable(children, target);
#else
  return choose_child_counted(children, target);
#endif
}

// Map a uniform u in [0, 1) for sample k of a batch of n to a prefix-sum target in [0, total).
// Stratified: sample k draws from [k/n, (k+1)/n). The expression is written so that the CPU
// (compiled with -ffp-contract=off) and the GPU (--fmad=false) round it identically.
TR_HD double sample_target(double u, int64_t k, int64_t n, bool stratified, double total) {
  double unit = stratified ? (static_cast<double>(k) + u) / static_cast<double>(n) : u;
  return unit * total;
}

// Descend from the root to a leaf. Requires sums[root] > 0.
template <typename scalar_t>
TR_HD int64_t descend(const Layout& L, const scalar_t* leaves, const double* sums, double target) {
  int64_t node = 0;
  for (int d = 1; d < L.depth; ++d) {
    const double* children = sums + L.level_offset[d] + node * kArity;
    node = node * kArity + choose_child(children, target);
  }
  const scalar_t* children = leaves + node * kArity;
  return node * kArity + choose_child(children, target);
}

// Validity rules shared by the host-side checks and the device kernels.
template <typename scalar_t>
TR_HD bool valid_priority(scalar_t p) {
  double v = static_cast<double>(p);
  return v >= 0.0 && v < positive_infinity();  // false for NaN, negative, +inf
}

TR_HD bool valid_index(int64_t i, int64_t capacity) { return i >= 0 && i < capacity; }

TR_HD bool valid_uniform(double u) { return u >= 0.0 && u < 1.0; }

// The k-th uniform in [0, 1) of a stream named by `seed`: SplitMix64's output function (Steele,
// Lea and Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014; constants from
// Vigna's reference) applied to the stream's k-th state, top 53 bits. A counter-based stream:
// any thread computes any k directly, so a batch's uniforms cost ~1 ns each and need no shared
// generator state, unlike torch.rand's Mersenne Twister (~8 ns each, serial, plus an allocation).
TR_HD double counter_uniform(uint64_t seed, uint64_t k) {
  uint64_t z = seed + (k + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * (1.0 / 9007199254740992.0);  // 2^-53
}

}  // namespace tree
}  // namespace torchreplay
