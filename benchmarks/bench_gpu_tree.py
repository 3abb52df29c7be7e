"""GPU tree benchmark (P2): the stratified sample of B=65536 from N=2^24 and the update of B=4096
at N=2^24, on the device, against torch.multinomial on the same device and against this project's
CPU tree on the same priorities.

Contenders alternate in rounds (A B C, A B C, ...), so drift of the machine lands on all of them
alike; each round gives one ratio per peer, and the report gives the median ratio with its range.
Device contenders are timed with CUDA events around back-to-back calls (launch overhead included,
no host synchronization inside the timed loop); the CPU tree with a wall clock.

    python benchmarks/bench_gpu_tree.py [--out FILE] [--rounds 5]
    python benchmarks/bench_gpu_tree.py --device cpu --log2n 16 --rounds 2   # rehearsal, no GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import torch


def timer(device: torch.device) -> Callable[[Callable[[], object], int], float]:
    """Microseconds per call of fn, over reps back-to-back calls after a short warm-up."""

    def cuda_time(fn: Callable[[], object], reps: int) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) * 1000 / reps

    def wall_time(fn: Callable[[], object], reps: int) -> float:
        fn()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) * 1e6 / reps

    return cuda_time if device.type == "cuda" else wall_time


def rounds(contenders: dict[str, tuple[Callable[[], object], Callable, int]], n_rounds: int) -> dict[str, list[float]]:
    """Times every contender once per round, in the same order each round; us per call per round."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(n_rounds):
        for name, (fn, time_fn, reps) in contenders.items():
            times[name].append(time_fn(fn, reps))
    return times


def summarize(op: str, times: dict[str, list[float]], ours: str) -> list[dict]:
    rows = []
    for peer, peer_times in times.items():
        if peer == ours:
            continue
        ratios = [p / o for p, o in zip(peer_times, times[ours])]
        rows.append({"op": op, "torchreplay": ours, "torchreplay_us": statistics.median(times[ours]),
                     "peer": peer, "peer_us": statistics.median(peer_times),
                     "speedup_median": statistics.median(ratios), "speedup_min": min(ratios),
                     "speedup_max": max(ratios), "rounds": len(ratios)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/bench_gpu_tree.md"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--log2n", type=int, default=24, help="tree size N = 2^log2n")
    parser.add_argument("--sample-batch", type=int, default=65536)
    parser.add_argument("--update-batch", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (use --device cpu for a rehearsal)")
        return 1
    import torchreplay as tr

    n, b_sample, b_update = 1 << args.log2n, args.sample_batch, args.update_batch
    gen = torch.Generator(device=device).manual_seed(0)
    prio = torch.rand(n, device=device, generator=gen) + 0.05
    tree = tr.SegmentTree(n, device=device, dtype=torch.float32, validate=False)
    tree.update(torch.arange(n, device=device), prio)
    cpu_prio = prio.cpu()
    cpu_tree = tr.SegmentTree(n, device="cpu", dtype=torch.float32, validate=False)
    cpu_tree.update(torch.arange(n), cpu_prio)
    device_time, cpu_time = timer(device), timer(torch.device("cpu"))
    reps = 50 if device.type == "cuda" else 5

    u = torch.rand(b_sample, dtype=torch.float64, device=device, generator=gen)
    u_cpu = u.cpu()
    sample_times = rounds({
        "tree": (lambda: tree.sample(u=u), device_time, reps),
        "torch.multinomial": (lambda: torch.multinomial(prio, b_sample, replacement=True, generator=gen),
                              device_time, reps),
        "CPU tree": (lambda: cpu_tree.sample(u=u_cpu), cpu_time, 5),
    }, args.rounds)

    idx = torch.randint(0, n, (b_update,), device=device, generator=gen)
    new = torch.rand(b_update, device=device, generator=gen) + 0.05
    idx_cpu, new_cpu = idx.cpu(), new.cpu()
    # The tree-less peer pays its cost at sample time: an index_put_ now, a fresh multinomial later.
    update_times = rounds({
        "tree": (lambda: tree.update(idx, new), device_time, reps),
        "index_put_ (no tree)": (lambda: prio.index_put_((idx,), new), device_time, reps),
        "CPU tree": (lambda: cpu_tree.update(idx_cpu, new_cpu), cpu_time, 5),
    }, args.rounds)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rows = (summarize(f"sample B={b_sample} N=2^{args.log2n}", sample_times, "tree")
            + summarize(f"update B={b_update} N=2^{args.log2n}", update_times, "tree"))
    lines = [f"# GPU tree benchmark ({name}, torch {torch.__version__}, {args.rounds} alternating rounds)", "",
             "| op | torchreplay (us, median) | peer | peer (us, median) | peer / torchreplay: median (range) |",
             "|---|---:|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['op']} | {r['torchreplay_us']:.1f} | {r['peer']} | {r['peer_us']:.1f} | "
                     f"{r['speedup_median']:.2f}x ({r['speedup_min']:.2f}-{r['speedup_max']:.2f}) |")
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps({"device": name, "torch": torch.__version__, "rows": rows,
                                                         "times_us": {"sample": sample_times,
                                                                      "update": update_times}}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
