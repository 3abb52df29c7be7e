// CPU kernels for the segment tree: torch-free, over raw pointers, parallel through a caller-given
// `parallel_for(begin, end, grain, fn(begin, end))` so the torch build uses ATen's thread pool and
// the standalone C++ build (ctest) can use a plain loop.
#pragma once

#include <algorithm>
#include <cstdint>
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

// Sample n leaves from uniforms u (validated by the caller; the tree must be non-empty).
// Descents are interleaved in small groups, level by level, with the next level's node prefetched,
// so the memory latency of one descent hides behind the arithmetic of the others.
template <typename scalar_t, typename ParallelFor>
void sample(const Layout& L, const scalar_t* leaves, const double* sums, const double* u, int64_t n,
            bool stratified, int64_t* out_indices, scalar_t* out_priorities, ParallelFor&& parallel_for) {
  const double total = sums[0];
  constexpr int kGroup = 16;
  parallel_for(0, n, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t g0 = begin; g0 < end; g0 += kGroup) {
      const int width = static_cast<int>(std::min<int64_t>(kGroup, end - g0));
      double target[kGroup];
      int64_t node[kGroup];
      for (int g = 0; g < width; ++g) {
        target[g] = sample_target(u[g0 + g], g0 + g, n, stratified, total);
        node[g] = 0;
      }
      for (int d = 1; d < L.depth; ++d) {
        const double* level = sums + L.level_offset[d];
        for (int g = 0; g < width; ++g) {
          const double* children = level + node[g] * kArity;
          node[g] = node[g] * kArity + choose_child(children, target[g]);
          const void* next = d + 1 < L.depth ? static_cast<const void*>(sums + L.level_offset[d + 1] + node[g] * kArity)
                                             : static_cast<const void*>(leaves + node[g] * kArity);
          __builtin_prefetch(next);
        }
      }
      for (int g = 0; g < width; ++g) {
        const int64_t leaf = node[g] * kArity + choose_child(leaves + node[g] * kArity, target[g]);
        out_indices[g0 + g] = leaf;
        out_priorities[g0 + g] = leaves[leaf];
      }
    }
  });
}

}  // namespace cpu
}  // namespace tree
}  // namespace torchreplay
