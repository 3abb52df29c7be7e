"""A short run through every CUDA kernel of the extension, for compute-sanitizer's memcheck.

benchmarks/gpu_check.sh runs it as `compute-sanitizer --tool memcheck python gpu_memcheck_probe.py`:
a whole pytest session under the sanitizer takes minutes, this takes seconds. Sizes are odd and small
on purpose, so that the last block of every kernel is partial and out-of-bounds accesses at the edges
would show. Each check compares with the CPU back end, so the probe also fails on a wrong result.

    python benchmarks/gpu_memcheck_probe.py [--device cuda]   # --device cpu: the same run on the CPU
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    import torchreplay as tr
    from torchreplay.storage import TieredStorage

    gen = torch.Generator().manual_seed(0)
    # The tree: batched update with repeated indices, stratified and plain sampling, total and min.
    for dtype in (torch.float32, torch.float64):
        capacity = 1031
        cpu, dev = tr.SegmentTree(capacity, dtype=dtype), tr.SegmentTree(capacity, dtype=dtype, device=device)
        idx = torch.randint(0, capacity, (777,), generator=gen)
        prio = torch.rand(777, generator=gen, dtype=dtype)
        cpu.update(idx, prio)
        dev.update(idx.to(device), prio.to(device))
        u = torch.rand(333, dtype=torch.float64, generator=gen)
        for stratified in (True, False):
            want = cpu.sample(u=u, stratified=stratified)
            got = dev.sample(u=u.to(device), stratified=stratified)
            assert all(torch.equal(w, g.cpu()) for w, g in zip(want, got)), f"tree sample differs ({dtype})"
        assert cpu.total().item() == dev.total().item() and cpu.min().item() == dev.min().item()

    # The buffer: a batch gathered and padded on the device from the VRAM tier, and cold pages read
    # straight into device memory and checksummed there (POSIX reads: kvikio has its own test).
    def rollouts(n: int, seed: int) -> dict:
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(3, 41, (n,), generator=g).tolist()
        return {
            "tokens": [torch.randint(0, 50_000, (k,), generator=g) for k in lengths],
            "logprobs": [-torch.rand(k, generator=g) for k in lengths],
            "prompt_len": torch.full((n,), 2),
            "response_mask": [torch.arange(k) >= 2 for k in lengths],
            "advantage": torch.randn(n, generator=g),
            "reward": torch.rand(n, generator=g),
            "group_id": torch.arange(n) // 4,
            "policy_version": 0,
        }

    with tempfile.TemporaryDirectory() as spill:
        storages = {
            "host": None,
            "device tier": TieredStorage(device=device, device_bytes=1 << 20),
            "staged cold reads": TieredStorage(hot_bytes=0, spill_dir=spill, io="posix", device=device),
        }
        batches = {}
        for name, storage in storages.items():
            buf = tr.RolloutBuffer(97, sampler=tr.PrioritizedSampler(), storage=storage, seed=0)
            buf.add(rollouts(61, seed=1))
            buf.add(rollouts(29, seed=2))
            buf.storage.flush()
            batches[name] = buf.sample(37, device=device, generator=torch.Generator().manual_seed(5))
            buf.close()
        want = batches["host"]
        for name, got in batches.items():
            assert torch.equal(want.handles.slot, got.handles.slot), name
            assert torch.equal(want.tokens.cpu(), got.tokens.cpu()), f"{name}: tokens differ"
            assert torch.equal(want.logprobs.cpu(), got.logprobs.cpu()), f"{name}: logprobs differ"
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(f"probe ok on {device}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
