"""GPU tree benchmark: stratified sample of B=65536 from N=2^24 and update of B=4096 at N=2^24,
against torch.multinomial on the GPU (and TorchRL's CUDA tree when importable).

Times with CUDA events around many back-to-back calls, so launch overhead is included and no host
synchronization happens inside the timed loop. Reports microseconds per call and the ratio.
    python benchmarks/bench_gpu_tree.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def time_cuda(fn, reps: int = 50) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps  # microseconds per call


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results/bench_gpu_tree.md")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 1
    import torchreplay as tr

    n = 1 << 24
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    prio = torch.rand(n, device=dev, generator=gen) + 0.05
    tree = tr.SegmentTree(n, device=dev, dtype=torch.float32, validate=False)
    tree.update(torch.arange(n, device=dev), prio)
    rows = []
    u = torch.rand(65536, dtype=torch.float64, device=dev, generator=gen)
    t_tree_sample = time_cuda(lambda: tree.sample(u=u))
    t_multinomial = time_cuda(lambda: torch.multinomial(prio, 65536, replacement=True, generator=gen))
    rows.append({"op": "sample B=65536 N=2^24", "torchreplay_us": t_tree_sample, "peer": "torch.multinomial",
                 "peer_us": t_multinomial, "speedup": t_multinomial / t_tree_sample})
    idx = torch.randint(0, n, (4096,), device=dev, generator=gen)
    new = torch.rand(4096, device=dev, generator=gen) + 0.05
    t_tree_update = time_cuda(lambda: tree.update(idx, new))
    # The tree-less peer pays its cost at sample time: an index_put_ then a fresh multinomial.
    t_peer_update = time_cuda(lambda: prio.index_put_((idx,), new))
    rows.append({"op": "update B=4096 N=2^24", "torchreplay_us": t_tree_update, "peer": "index_put_ (no tree)",
                 "peer_us": t_peer_update, "speedup": t_peer_update / t_tree_update})
    try:
        from torchrl._torchrl import SumSegmentTreeFp32  # noqa: F401

        rows.append({"op": "torchrl CUDA tree", "note": "importable; add its CUDA variant here when built"})
    except Exception as exc:  # noqa: BLE001
        rows.append({"op": "torchrl CUDA tree", "note": f"skipped: {type(exc).__name__}: {exc}"})
    lines = ["| op | torchreplay (us) | peer | peer (us) | peer / torchreplay |", "|---|---:|---|---:|---:|"]
    for r in rows:
        if "note" in r:
            lines.append(f"| {r['op']} | | {r['note']} | | |")
        else:
            lines.append(f"| {r['op']} | {r['torchreplay_us']:.1f} | {r['peer']} | {r['peer_us']:.1f} | {r['speedup']:.2f}x |")
    text = f"# GPU tree benchmark ({torch.cuda.get_device_name()})\n\n" + "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
