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

// Batched update. Leaves are written in input order, so for duplicate indices the last occurrence
// wins. Then the touched ancestors are recomputed level by level from sorted, de-duplicated node
// lists: each node once, in ascending memory order, and disjoint between threads.
// Inputs must be valid (checked by the caller).
template <typename scalar_t, typename ParallelFor>
void update(const Layout& L, scalar_t* leaves, double* sums, double* mins, const int64_t* indices,
            const scalar_t* priorities, int64_t n, ParallelFor&& parallel_for) {
  if (n == 0) return;
  for (int64_t i = 0; i < n; ++i) leaves[indices[i]] = priorities[i];

  // The bottom internal level's touched nodes, sorted and unique, found the cheapest way:
  // stratified samples come back sorted (sample-then-update needs no sort at all); a batch that is
  // large next to the tree is bucketed through a bitmap, O(n + nodes); otherwise sorted.
  const int bottom = L.depth - 1;
  std::vector<int64_t> nodes;
  nodes.reserve(static_cast<size_t>(std::min<int64_t>(n, L.level_nodes[bottom])));
  if (std::is_sorted(indices, indices + n)) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t parent = indices[i] / kArity;
      if (nodes.empty() || nodes.back() != parent) nodes.push_back(parent);
    }
  } else if (L.level_nodes[bottom] <= 32 * n) {
    std::vector<uint8_t> touched(static_cast<size_t>(L.level_nodes[bottom]), 0);
    for (int64_t i = 0; i < n; ++i) touched[indices[i] / kArity] = 1;
    for (int64_t j = 0; j < L.level_nodes[bottom]; ++j) {
      if (touched[j]) nodes.push_back(j);
    }
  } else {
    nodes.assign(indices, indices + n);
    std::sort(nodes.begin(), nodes.end());
    int64_t unique = 0;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t parent = nodes[i] / kArity;
      if (unique == 0 || nodes[unique - 1] != parent) nodes[unique++] = parent;
    }
    nodes.resize(unique);
  }
  for (int d = bottom; d >= 0; --d) {
    if (d < bottom) {
      // Children -> parents keeps the list sorted; adjacent de-duplication is then exact.
      int64_t unique = 0;
      for (int64_t i = 0; i < static_cast<int64_t>(nodes.size()); ++i) {
        const int64_t parent = nodes[i] / kArity;
        if (unique == 0 || nodes[unique - 1] != parent) nodes[unique++] = parent;
      }
      nodes.resize(unique);
    }
    const int64_t count = static_cast<int64_t>(nodes.size());
    parallel_for(0, count, 2048, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) recompute_node(L, leaves, sums, mins, d, nodes[i]);
    });
  }
}

// Sampling descends level by level over a block of samples at once (level-synchronous), not one
// sample root to leaf at a time: the per-sample work at a level is independent, so the out-of-order
// core and a software prefetch overlap the cache misses of many samples. Sorted targets (always the
// case for stratified sampling) go further: the samples sharing a node are adjacent, and a run of
// at least kMergeRun of them is merged against the node's prefix sums in one O(K + run) pass, so the
// top levels, where every sample shares a handful of nodes, cost almost nothing.
constexpr int64_t kSampleBlock = 8192;
constexpr int64_t kMergeRun = 6;
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
