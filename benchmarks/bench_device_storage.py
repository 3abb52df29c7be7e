"""Device-bound sampling: batches assembled on the device against the same batch assembled on the
host and moved, in the same run, on the same data.

Contenders, each a RolloutBuffer fed identical rollouts, each `sample(B, device=D)`:

* ``host``: no storage device; the batch is padded on the host and moved (`ReplayBatch.to`).
  For the hot case the data is in host RAM; for the cold case every read is a cold read.
* ``device-tier`` (hot case): `TieredStorage(device=D, device_bytes=...)` holding every shard, so
  the batch is gathered and padded on the device.
* ``staged`` (cold case): `TieredStorage(device=D, io=..., hot_bytes=0)`: cold pages read straight
  into device memory (kvikio where it works; with D=cpu, POSIX preads) and checksummed there.

Calls alternate between contenders (ABAB), so machine drift hits both alike; the report gives
each one's median seconds per call and the ratio host / contender (> 1: faster than host).
The page cache is dropped before each cold call when the process may (root), else warm reads.

    python benchmarks/bench_device_storage.py [--device cuda] [--size-mib 1024] [--out FILE]
    python benchmarks/bench_device_storage.py --device cpu --size-mib 64   # smoke run, no GPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import cpu_model  # noqa: E402


def make_batches(total_bytes: int, per_add: int, seed: int) -> list[dict]:
    """Rollouts of 256-2048 tokens (int64 tokens, float32 logprobs, bool mask: 13 bytes a token)."""
    g = torch.Generator().manual_seed(seed)
    batches, size = [], 0
    while size < total_bytes:
        lengths = torch.randint(256, 2049, (per_add,), generator=g)
        prompt = torch.full((per_add,), 64)
        batches.append({
            "tokens": [torch.randint(1, 50_000, (int(n),), generator=g) for n in lengths],
            "prompt_len": prompt,
            "response_mask": [torch.arange(int(n)) >= 64 for n in lengths],
            "logprobs": [-torch.rand(int(n), generator=g) for n in lengths],
            "reward": torch.rand(per_add, generator=g),
            "advantage": torch.randn(per_add, generator=g),
            "group_id": torch.arange(per_add) // 8,
            "policy_version": 0,
        })
        size += int(lengths.sum()) * 13
    return batches


def drop_page_cache() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def alternate(contenders: dict, batch_size: int, calls: int, device: torch.device, cold: bool) -> dict:
    times: dict[str, list[float]] = {name: [] for name in contenders}
    gens = {name: torch.Generator().manual_seed(7) for name in contenders}
    cache_dropped = None
    for _ in range(calls):
        for name, buf in contenders.items():
            if cold:
                cache_dropped = drop_page_cache()
            sync(device)
            t0 = time.perf_counter()
            batch = buf.sample(batch_size, device=device, generator=gens[name])
            sync(device)
            times[name].append(time.perf_counter() - t0)
            del batch
    return {"median_s": {k: statistics.median(v) for k, v in times.items()}, "page_cache_dropped": cache_dropped}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--size-mib", type=int, default=1024, help="token bytes stored")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--io", default="auto", help="back end of the staged contender (auto: kvikio on CUDA)")
    p.add_argument("--spill-dir", help="directory on the disk under test (default: a new dir in /var/tmp)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/bench_device_storage.md"))
    args = p.parse_args(argv)
    import torchreplay as tr
    from torchreplay.storage import TieredStorage

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (use --device cpu for a smoke run)")
        return 1
    io = args.io if args.io != "auto" else ("kvikio" if device.type == "cuda" else "posix")
    batches = make_batches(args.size_mib << 20, 512, seed=0)
    rollouts = sum(len(b["tokens"]) for b in batches)
    root = Path(tempfile.mkdtemp(prefix="torchreplay-devbench-", dir=args.spill_dir or "/var/tmp"))

    def buffer(storage):
        buf = tr.RolloutBuffer(rollouts, sampler=tr.UniformSampler(), storage=storage, seed=0)
        for b in batches:
            buf.add(b)
        buf.storage.flush()
        return buf

    report: dict = {"device": str(device), "size_mib": args.size_mib, "rollouts": rollouts,
                    "batch_size": args.batch_size, "calls": args.calls, "cpu": cpu_model(),
                    "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    # Hot: host RAM + copy against the device tier.
    hot = {"host": buffer(None),
           "device-tier": buffer(TieredStorage(device=device, device_bytes=4 * (args.size_mib << 20)))}
    report["hot"] = alternate(hot, args.batch_size, args.calls, device, cold=False)
    for buf in hot.values():
        buf.close()
    del hot
    # Cold: host reader + copy against pages staged on the device.
    cold = {"host": buffer(TieredStorage(hot_bytes=0, spill_dir=root / "host", io="posix")),
            "staged": None}
    try:
        cold["staged"] = buffer(TieredStorage(hot_bytes=0, spill_dir=root / "staged", io=io, device=device))
    except (tr.StorageError, ValueError) as exc:
        report["cold_skipped"] = f"staged contender unavailable with io={io}: {exc}"
        del cold["staged"]
    report["cold"] = alternate(cold, args.batch_size, args.calls, device, cold=True)
    staged_bytes = cold["staged"].metrics()["storage_device_staged_bytes"] if "staged" in cold else 0
    report["cold"]["staged_bytes"] = staged_bytes
    for buf in cold.values():
        buf.close()
    lines = [f"# Device-bound sampling ({device}, {args.size_mib} MiB, B={args.batch_size}, {args.calls} calls each)",
             "", f"CPU: {report['cpu']}; GPU: {report['gpu']}; staged io: {io}", "",
             "| data | contender | median s/call | host / contender |", "|---|---|---:|---:|"]
    for case in ("hot", "cold"):
        med = report[case]["median_s"]
        for name, sec in med.items():
            lines.append(f"| {case} | {name} | {sec:.5f} | {med['host'] / sec:.2f}x |")
    lines += ["", f"page cache dropped before cold calls: {report['cold']['page_cache_dropped']}; "
              f"bytes staged on the device: {staged_bytes}"]
    if "cold_skipped" in report:
        lines.append(f"cold staged contender skipped: {report['cold_skipped']}")
    markdown = "\n".join(lines) + "\n"
    print(markdown)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(markdown)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
