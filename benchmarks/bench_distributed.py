#!/usr/bin/env python3
"""Sample latency of `DistributedRolloutBuffer`, global vs local mode, on CPU with gloo.

For each world size, each rank fills its shard with `--per-rank` rollouts (lengths uniform in
[`--min-len`, `--max-len`] tokens, random advantages, PrioritizedSampler) and then times `--calls`
`sample(batch)` calls per mode after `--warmup` untimed ones. Reported per cell:

* latency: wall time of one `sample` call in milliseconds, slowest rank (a step waits for it):
  median and p90 over calls;
* bytes per sampled rollout: bytes every rank sent to other ranks (not to itself), summed over
  ranks and divided by the rollouts sampled job-wide; payload (rollout fields) and control
  (shard table, request counts and positions) separately. Local mode moves no payload.

Processes are forked from this script (one intra-op thread each) and talk over loopback TCP, so
with more ranks than cores the numbers include CPU oversubscription; they show the protocol's cost
and its scaling, not a network.

    .venv/bin/python benchmarks/bench_distributed.py                 # worlds 2 and 4, ~1 min on 2 cores
    .venv/bin/python benchmarks/bench_distributed.py --worlds 2 --calls 20 --batch 64
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def make_rollouts(n: int, min_len: int, max_len: int, seed: int) -> dict[str, Any]:
    """n synthetic rollouts: prompt of 16 tokens, the rest response."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return {
        "tokens": [torch.randint(0, 50000, (t,), generator=g) for t in lengths],
        "prompt_len": torch.full((n,), 16),
        "response_mask": [torch.arange(t) >= 16 for t in lengths],
        "logprobs": [-torch.rand(t, generator=g) for t in lengths],
        "reward": torch.rand(n, generator=g),
        "advantage": torch.randn(n, generator=g),
        "group_id": torch.arange(n) // 8,
        "policy_version": 0,
    }


def worker(rank: int, world: int, init_file: str, out_dir: str, args: argparse.Namespace) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    import torchreplay as tr
    from torchreplay.distributed import DistributedRolloutBuffer

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    data = make_rollouts(args.per_rank, args.min_len, args.max_len, seed=rank)
    result: dict[str, Any] = {}
    for mode in ("local", "global"):
        buf = DistributedRolloutBuffer(mode=mode, capacity=args.per_rank,
                                       sampler=tr.PrioritizedSampler(alpha=1.0, beta=0.4))
        buf.add(data)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(args.warmup):
            buf.sample(args.batch, generator=gen)
        before = buf.metrics(global_=True)
        times = []
        for _ in range(args.calls):
            dist.barrier()
            t0 = time.perf_counter()
            buf.sample(args.batch, generator=gen)
            times.append(time.perf_counter() - t0)
        after = buf.metrics(global_=True)
        # The slowest rank per call.
        t = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        rollouts = args.calls * args.batch * world
        result[mode] = {
            "median_ms": statistics.median(t.tolist()) * 1e3,
            "p90_ms": sorted(t.tolist())[int(0.9 * (len(t) - 1))] * 1e3,
            "payload_b": (after["dist_payload_bytes_sent"] - before["dist_payload_bytes_sent"]) / rollouts,
            "control_b": (after["dist_control_bytes_sent"] - before["dist_control_bytes_sent"]) / rollouts,
        }
    if rank == 0:
        Path(out_dir, f"world{world}.json").write_text(json.dumps(result))
    dist.barrier()
    os._exit(0)  # skip interpreter teardown of the process group


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--per-rank", type=int, default=2048, help="rollouts per shard")
    parser.add_argument("--batch", type=int, default=128, help="rollouts per rank per sample call")
    parser.add_argument("--min-len", type=int, default=64, help="tokens")
    parser.add_argument("--max-len", type=int, default=448, help="tokens")
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    if min(args.worlds) < 1 or args.batch < 1 or args.calls < 1 or not 16 < args.min_len <= args.max_len:
        parser.error("worlds, batch and calls must be >= 1, and 16 < min-len <= max-len")
    # Plain dict input: skip RolloutBuffer's optional TensorDict import (several seconds).
    import torchreplay  # noqa: F401 - imported once here, inherited by the forked ranks

    ctx = mp.get_context("fork")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.worlds:
            init_file = Path(tmp, f"init{world}")
            procs = [ctx.Process(target=worker, args=(r, world, str(init_file), tmp, args)) for r in range(world)]
            for p in procs:
                p.start()
            for p in procs:
                p.join(600)
            if any(p.exitcode != 0 for p in procs):
                raise SystemExit(f"world {world}: a rank failed (exit codes {[p.exitcode for p in procs]})")
            res = json.loads(Path(tmp, f"world{world}.json").read_text())
            for mode in ("local", "global"):
                rows.append((world, mode, res[mode]))
    mean_len = (args.min_len + args.max_len) / 2
    # tokens int64 + logprobs float32 + response_mask bool per token.
    raw = mean_len * (8 + 4 + 1)
    print(f"torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} CPUs, gloo over loopback; "
          f"{args.per_rank} rollouts/rank, batch {args.batch}/rank, {args.min_len}-{args.max_len} tokens "
          f"(raw ~{raw:.0f} B/rollout), {args.calls} calls\n")
    print("| ranks | mode | median ms | p90 ms | payload B/rollout | control B/rollout |")
    print("|---:|:---|---:|---:|---:|---:|")
    for world, mode, r in rows:
        print(f"| {world} | {mode} | {r['median_ms']:.2f} | {r['p90_ms']:.2f} | {r['payload_b']:.0f} | "
              f"{r['control_b']:.1f} |")


if __name__ == "__main__":
    main()
