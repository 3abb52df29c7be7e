// CPU kernels for the segment tree: torch-free, over raw pointers, parallel through a caller-given
// `parallel_for(begin, end, grain, fn(begin, end))` so the torch build uses ATen's thread pool and
// the standalone C++ build (ctest) can use a plain loop.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "../segment_tree.h"

namespace torchreplay {
namespace tree {
namespace cpu {

// Rebuild every internal node from the leaves: O(capacity). Used after loading leaves wholesale.
template <typename scalar_t, typename ParallelFor>
void rebuild(const Layout& L, scalar_t* leaves, double* sums, double* mins, ParallelFor&& parallel_for) {
  for (int64_t i = L.capacity; i < L.padded_leaves; ++i) leaves[i] = scalar_t(0);
  for (int d = L.depth - 1; d >= 0; --d) {
    parallel_for(0, L.level_nodes[d], 4096, [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j) recompute_node(L, leaves, sums, mins, d, j);
    });
  }
}

// How many list entries ahead the update prefetches the lines it will read and write. The update is
// bound by cache misses at the bottom two levels of a large tree (the leaves and the level above
// them do not fit in L2), and a prefetch 8 nodes ahead measured 20-25% faster than none at 2^20.
constexpr int64_t kUpdatePrefetchAhead = 8;

// Recomputes every ancestor, up to level `top`, of a sorted stream of keys: keys[i] * key_span is a
// leaf index under the touched bottom node (key_span = 1 for leaf indices, kArity for bottom nodes).
// Level-synchronous: the touched nodes of a level form a sorted, de-duplicated list; all of them are
// recomputed, then the list becomes their parents. Every node is recomputed once and only after all
// of its touched children. The recomputes of one level are independent, so the out-of-order core
// overlaps their float64 add chains and cache misses (a walk that finished a parent as soon as the
// stream moved past it serialized them behind a hard-to-predict branch per node). `list` holds
// `count` entries of scratch. The de-duplication writes unconditionally and advances by a compare,
// so it has no branch to mispredict either.
template <typename scalar_t>
void recompute_ancestors(const Layout& L, const scalar_t* leaves, double* sums, double* mins, const int64_t* keys,
                         int64_t count, int64_t key_span, int top, int64_t* list) {
  int64_t m = 0;
  int64_t previous = -1;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t node = keys[i] * key_span / kArity;
    list[m] = node;
    m += node != previous;
    previous = node;
  }
  for (int d = L.depth - 1;; --d) {
    const bool bottom = d == L.depth - 1;
    const int64_t own = L.level_offset[d];
    const int64_t children = bottom ? 0 : L.level_offset[d + 1];
    for (int64_t k = 0; k < m; ++k) {
      if (k + kUpdatePrefetchAhead < m) {
        const int64_t ahead = list[k + kUpdatePrefetchAhead];
        if (bottom) {
          __builtin_prefetch(leaves + ahead * kArity);
        } else {
          __builtin_prefetch(sums + children + ahead * kArity);
          __builtin_prefetch(mins + children + ahead * kArity);
        }
        __builtin_prefetch(sums + own + ahead, 1);
        __builtin_prefetch(mins + own + ahead, 1);
      }
      recompute_node(L, leaves, sums, mins, d, list[k]);
    }
    if (d <= top) break;
    int64_t parents = 0;
    previous = -1;
    for (int64_t k = 0; k < m; ++k) {
      const int64_t parent = list[k] / kArity;
      list[parents] = parent;  // parents <= k: never overwrites an entry not yet read
      parents += parent != previous;
      previous = parent;
    }
    m = parents;
  }
}

// Below this many touched nodes an update runs as one stream: splitting costs the serial recompute
// of the shared top levels and a thread hand-off, worth it only for a few thousand nodes per chunk.
constexpr int64_t kUpdateChunkMin = 1024;
constexpr int64_t kUpdateMaxChunks = 16;

// Cuts a sorted stream of `count` keys into up to `chunks` pieces of similar size, each cut moved
// forward to where the level-`split` ancestor changes, so no node at or below that level is touched
// by two pieces: that is what lets the pieces run on different threads. cut has chunks + 1 entries;
// pieces may be empty.
inline void cut_stream(const Layout& L, const int64_t* keys, int64_t count, int64_t key_span, int split,
                       int64_t chunks, int64_t* cut) {
  const int64_t cover = cover_of_level(L, split);
  cut[0] = 0;
  for (int64_t c = 1; c < chunks; ++c) {
    int64_t at = std::max(cut[c - 1], c * count / chunks);
    while (at > 0 && at < count && keys[at] * key_span / cover == keys[at - 1] * key_span / cover) ++at;
    cut[c] = at;
  }
  cut[chunks] = count;
}

// An unsorted update finds its touched bottom nodes through a bitmap (one bit per node, zeroed and
// scanned a word at a time) while that has at most this many words per index, else by sorting the
// nodes: at 2^16 leaves and B=256 the earlier byte map cost more than the whole rest of the update.
constexpr int64_t kBitmapWordsPerIndex = 16;

// Batched update. Leaves are written in input order, so for duplicate indices the last occurrence
// wins. Then every touched ancestor is recomputed once, from a sorted stream of touched bottom
// nodes: stratified samples come back sorted, so sample-then-update streams the indices themselves
// (each chunk writes its own leaves first); otherwise the bottom nodes are sorted and de-duplicated
// first, through a bitmap when the batch is not tiny next to the tree (O(n + nodes / 64)), else a sort.
//
// A long stream is cut into chunks at boundaries of level-`split` nodes, so that below that level
// no node is shared between chunks and the chunks run in parallel; the few nodes above it are then
// recomputed serially. Inputs must be valid (checked by the caller).
template <typename scalar_t, typename ParallelFor>
void update(const Layout& L, scalar_t* leaves, double* sums, double* mins, const int64_t* indices,
            const scalar_t* priorities, int64_t n, ParallelFor&& parallel_for) {
  if (n == 0) return;
  const int bottom = L.depth - 1;
  const bool sorted = std::is_sorted(indices, indices + n);

  // keys[i] * key_span / cover(d) is the level-d ancestor of stream entry i.
  const int64_t* keys = indices;
  int64_t count = n;
  int64_t key_span = 1;
  std::vector<int64_t> nodes;
  if (!sorted) {
    for (int64_t i = 0; i < n; ++i) {
      if (i + kUpdatePrefetchAhead < n) __builtin_prefetch(leaves + indices[i + kUpdatePrefetchAhead], 1);
      leaves[indices[i]] = priorities[i];
    }
    nodes.reserve(static_cast<size_t>(std::min<int64_t>(n, L.level_nodes[bottom])));
    const int64_t words = ceil_div(L.level_nodes[bottom], 64);
    if (words <= kBitmapWordsPerIndex * n) {
      std::vector<uint64_t> touched(static_cast<size_t>(words), 0);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t node = indices[i] / kArity;
        touched[node >> 6] |= uint64_t{1} << (node & 63);
      }
      for (int64_t w = 0; w < words; ++w) {
        for (uint64_t bits = touched[w]; bits != 0; bits &= bits - 1) nodes.push_back(w * 64 + __builtin_ctzll(bits));
      }
    } else {
      nodes.resize(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) nodes[i] = indices[i] / kArity;
      std::sort(nodes.begin(), nodes.end());
      nodes.erase(std::unique(nodes.begin(), nodes.end()), nodes.end());
    }
    keys = nodes.data();
    count = static_cast<int64_t>(nodes.size());
    key_span = kArity;
  }

  auto stream = [&](int64_t begin, int64_t end, int top) {
    if (sorted) {
      for (int64_t i = begin; i < end; ++i) {
        if (i + kUpdatePrefetchAhead < end) __builtin_prefetch(leaves + keys[i + kUpdatePrefetchAhead], 1);
        leaves[keys[i]] = priorities[i];
      }
    }
    thread_local std::vector<int64_t> list;
    if (list.size() < static_cast<size_t>(end - begin)) list.resize(static_cast<size_t>(end - begin));
    recompute_ancestors(L, leaves, sums, mins, keys + begin, end - begin, key_span, top, list.data());
  };

  // The split level: the coarsest with enough nodes (16 per chunk) for balanced cuts.
  int64_t chunks = std::min(kUpdateMaxChunks, count / kUpdateChunkMin);
  int split = -1;
  if (chunks >= 2) {
    for (int d = 1; d < L.depth; ++d) {
      if (L.level_nodes[d] >= 16 * chunks) {
        split = d;
        break;
      }
    }
  }
  if (split < 0) {
    stream(0, count, 0);
    return;
  }

  int64_t cut[kUpdateMaxChunks + 1];
  cut_stream(L, keys, count, key_span, split, chunks, cut);
  parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      if (cut[c] < cut[c + 1]) stream(cut[c], cut[c + 1], split);
    }
  });
  // Above the split level every live node is recomputed: fewer than 16 * chunks of them.
  for (int d = split - 1; d >= 0; --d) {
    for (int64_t j = 0; j < L.level_nodes[d]; ++j) recompute_node(L, leaves, sums, mins, d, j);
  }
}

// Sampling descends level by level over a block of samples at once (level-synchronous), not one
// sample root to leaf at a time: the per-sample work at a level is independent, so the out-of-order
// core and a software prefetch overlap the cache misses of many samples. Sorted targets (always the
// case for stratified sampling) go further: the samples sharing a node are adjacent, and a run of
// at least kMergeRun of them is merged against the node's prefix sums in one O(K + run) pass, so the
// top levels, where every sample shares a handful of nodes, cost almost nothing. The merge's loop
// exits are data-dependent branches, so shorter runs are cheaper one by one: at runs of ~8 the
// merge measured 40-50% slower than choose_child per sample, at 16 about even.
constexpr int64_t kSampleBlock = 8192;
constexpr int64_t kMergeRun = 16;
constexpr int64_t kPrefetchAhead = 16;

// All samples of a sorted run share `parent` and have non-decreasing targets, except for a tail
// of overshoot targets that all sit at or past the node's total. choose_child of each of them is
// then non-decreasing along the run, which is what makes this merge give exactly its answers.
template <typename value_t>
void merge_run(const value_t* children, int64_t parent, double* target, int64_t* node, int64_t m) {
  double prefix = 0.0;
  int64_t j = 0;
  int last = -1;
  for (int c = 0; c < kArity; ++c) {
    const double v = static_cast<double>(children[c]);
    const double before = prefix;
    prefix += v;
    if (!(v > 0.0)) continue;
    last = c;
    while (j < m && target[j] < prefix) {
      target[j] -= before;
      node[j] = parent * kArity + c;
      ++j;
    }
  }
  // Rounding overshoot, as in choose_child.
  for (; j < m; ++j) {
    if (last >= 0) target[j] = static_cast<double>(children[last]);
    node[j] = parent * kArity + (last < 0 ? 0 : last);
  }
}

// One level of the descent: node[k] (a node of this level's parents) becomes its chosen child,
// read from `level`, the flat array of those children.
template <typename value_t>
void descend_level(const value_t* level, double* target, int64_t* node, int64_t m, int64_t merge_run_min) {
  int64_t k = 0;
  while (k < m) {
    const int64_t parent = node[k];
    if (k + kPrefetchAhead < m) __builtin_prefetch(level + node[k + kPrefetchAhead] * kArity);
    const value_t* children = level + parent * kArity;
    int64_t e = k + 1;
    while (e < m && e - k < merge_run_min && node[e] == parent) ++e;
    if (e - k < merge_run_min) {
      for (; k < e; ++k) node[k] = parent * kArity + choose_child(children, target[k]);
      continue;
    }
    while (e < m && node[e] == parent) ++e;
    merge_run(children, parent, target + k, node + k, e - k);
    k = e;
  }
}

// Sample n leaves from uniforms u (validated by the caller; the tree must be non-empty). Returns,
// sample for sample, what descend() returns for sample_target(u[k], k, n, stratified, sums[0]).
template <typename scalar_t, typename ParallelFor>
void sample(const Layout& L, const scalar_t* leaves, const double* sums, const double* u, int64_t n,
            bool stratified, int64_t* out_indices, scalar_t* out_priorities, ParallelFor&& parallel_for) {
  const double total = sums[0];
  parallel_for(0, n, 1024, [&](int64_t begin, int64_t end) {
    thread_local std::vector<double> scratch;
    if (scratch.size() < static_cast<size_t>(kSampleBlock)) scratch.resize(static_cast<size_t>(kSampleBlock));
    double* target = scratch.data();
    for (int64_t b0 = begin; b0 < end; b0 += kSampleBlock) {
      const int64_t m = std::min(kSampleBlock, end - b0);
      int64_t* node = out_indices + b0;
      bool ascending = true;
      for (int64_t k = 0; k < m; ++k) {
        target[k] = sample_target(u[b0 + k], b0 + k, n, stratified, total);
        node[k] = 0;
        ascending &= k == 0 || target[k - 1] <= target[k];
      }
      // Unsorted targets (plain, non-stratified u) descend one by one, still level-synchronously.
      const int64_t merge_min = ascending ? kMergeRun : std::numeric_limits<int64_t>::max();
      for (int d = 0; d + 1 < L.depth; ++d) descend_level(sums + L.level_offset[d + 1], target, node, m, merge_min);
      descend_level(leaves, target, node, m, merge_min);
      for (int64_t k = 0; k < m; ++k) out_priorities[b0 + k] = leaves[node[k]];
    }
  });
}

}  // namespace cpu
}  // namespace tree
}  // namespace torchreplay
