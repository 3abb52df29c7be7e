"""Checkpoint benchmark against a loopback S3 server (moto), in one run:

1. upload throughput of the Checkpointer (shards + state + manifest) against raw boto3
   `put_object` of the same bytes to the same server, as a ratio;
2. p50/p99 latency of `add` and `sample` with and without a checkpoint in flight (target: p99
   inflation at most 5%): two buffers in one process, driven in alternating blocks, the
   inflation's 90% interval from a paired block bootstrap.

The S3 server (moto) runs in a separate process.

    python benchmarks/bench_checkpoint.py [--quick] [--pin] [--blocks 40]
        [--out benchmarks/results/bench_checkpoint.md]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import torchreplay as tr
from torchreplay.checkpoint import Checkpointer
from torchreplay.checkpoint.uploader import RemoteStore


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_batch(n: int, length: int, version: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    total = n * length
    return {
        "tokens": {"values": torch.randint(0, 50_000, (total,), generator=g), "offsets": torch.arange(n + 1) * length},
        "logprobs": {"values": -torch.rand(total, generator=g), "offsets": torch.arange(n + 1) * length},
        "response_mask": {"values": torch.ones(total, dtype=torch.bool), "offsets": torch.arange(n + 1) * length},
        "prompt_len": torch.zeros(n, dtype=torch.long), "reward": torch.rand(n, generator=g),
        "advantage": torch.randn(n, generator=g), "group_id": torch.arange(n), "policy_version": version,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--interval", type=float, default=1.0,
                        help="seconds between manifests in the 'with' run (real runs use 60-300)")
    parser.add_argument("--blocks", type=int, default=40, help="blocks of calls per buffer, alternating (ABBA)")
    parser.add_argument("--bootstrap", type=int, default=1000, help="resamples for the inflation's 90%% interval")
    parser.add_argument("--block-calls", type=int, default=100, help="add + sample calls per block")
    parser.add_argument("--block-warmup", type=int, default=10,
                        help="calls at the start of each block that are not recorded")
    parser.add_argument("--hot-mib", type=int, default=256, help="hot tier budget of each buffer")
    parser.add_argument("--pin", action="store_true",
                        help="trainer (this process) on the first CPU; the upload helper (helper_cpus) and the "
                             "S3 server on the last, in both arms")
    parser.add_argument("--step-ms", type=float, default=10.0,
                        help="simulated training step after each add + sample: the trainer thread waits (on the "
                             "GPU, in a real run) and uses no CPU. 0 = back-to-back calls, which produce shards faster "
                             "than the S3 server here can take them, so uploads fall ever further behind")
    parser.add_argument("--out", default="benchmarks/results/bench_checkpoint.md")
    args = parser.parse_args()
    if args.quick:
        args.blocks, args.block_calls = 4, 30
    cpus = sorted(os.sched_getaffinity(0))
    trainer_cpus, background_cpus = ({cpus[0]}, [cpus[-1]]) if args.pin and len(cpus) > 1 else (set(cpus), None)
    server_cpus = background_cpus or cpus
    os.sched_setaffinity(0, trainer_cpus)
    torch.set_num_threads(1)
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    import boto3

    # The S3 server runs in its own process, as a real endpoint would: in-process, its request
    # handling would compete with the trainer for this process's GIL and be measured as ours.
    # It runs at the lowest CPU priority for the same reason: a real endpoint's request handling
    # happens on someone else's CPU, while on this 2-core machine moto's would take the trainer's.
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              preexec_fn=lambda: (os.nice(19), os.sched_setaffinity(0, server_cpus)))
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("moto server did not start")
            time.sleep(0.1)
    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket="bench-ckpt")
    steps, n, length = (4, 128, 1024) if args.quick else (8, 512, 1024)
    results: dict = {"load_average": os.getloadavg()[0], "trainer_cpus": sorted(trainer_cpus), "step_ms": args.step_ms,
                     "background_cpus": background_cpus, "server_cpus": server_cpus, "steps": steps, "rollouts_per_step": n, "tokens": length}

    # 1. upload throughput
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Checkpointer("s3://bench-ckpt/tput", interval_s=3600, endpoint_url=endpoint)
        buf = tr.RolloutBuffer(steps * n, sampler=tr.UniformSampler(), checkpoint=ckpt, seed=0,
                               storage=tr.TieredStorage(hot_bytes=0, spill_dir=tmp, io="posix"))
        for s in range(steps):
            buf.add(make_batch(n, length, s, s))
        buf.storage.flush()
        buf.checkpoint()
        paths = sorted(Path(tmp).glob("*.trs"))
        shard_bytes = sum(os.path.getsize(p) for p in paths)
        # The checkpointer's upload path (a helper process like the checkpointer's own: S3Store.put_file,
        # transfer manager, CRC32 checksums) on the same files, timed alone: in a run the uploads
        # overlap training. The helper is started before the clock, as the checkpointer's is.
        remote = RemoteStore("s3://bench-ckpt/tput", endpoint, retry_budget_s=60.0)
        remote.start()
        start = time.perf_counter()
        for i, p in enumerate(paths):
            remote.put_file(f"shards/again-{i}.trs", str(p))
        ckpt_s = time.perf_counter() - start
        remote.close()
        datas = [p.read_bytes() for p in paths]
        start = time.perf_counter()
        for i, d in enumerate(datas):
            client.put_object(Bucket="bench-ckpt", Key=f"raw/{i}", Body=d)
        raw_s = time.perf_counter() - start
        buf.close()
    results["upload"] = {"bytes": shard_bytes, "checkpointer_MBps": shard_bytes / ckpt_s / 1e6,
                         "raw_put_object_MBps": shard_bytes / raw_s / 1e6, "ratio": raw_s / ckpt_s}

    # 2. latency with and without a checkpoint in flight
    def latency() -> dict:
        """Two buffers in this process, driven in alternating blocks of calls: one without a
        checkpointer, one whose every sealed shard is uploaded and which publishes a manifest every
        `--interval` seconds from inside its calls, as in a real run. This machine's speed drifts by
        tens of percent within a minute, so separate runs per arm compare different machines; blocks
        of ~1.5 s in ABBA order see the same drift. The first calls of each block are not recorded,
        so uploads left over from the other buffer's block do not count against this one."""
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = Checkpointer("s3://bench-ckpt/lat", interval_s=args.interval, endpoint_url=endpoint,
                                helper_cpus=background_cpus)
            buffers = {}
            for arm in ("without", "with"):
                os.makedirs(f"{tmp}/{arm}")
                buffers[arm] = tr.RolloutBuffer(
                    64 * 64, sampler=tr.PrioritizedSampler(), checkpoint=ckpt if arm == "with" else None, seed=0,
                    storage=tr.TieredStorage(hot_bytes=args.hot_mib << 20, spill_dir=f"{tmp}/{arm}", io="posix"))
                for s in range(8):
                    buffers[arm].add(make_batch(64, 512, 0, 100 + s))
            # blocks[arm][op][k]: the recorded latencies of block k of that buffer
            blocks = {arm: {"add": [], "sample": []} for arm in buffers}
            seed = 1000
            for block in range(args.blocks):
                for arm in ("without", "with") if block % 4 in (0, 3) else ("with", "without"):
                    buf = buffers[arm]
                    adds, samples = [], []
                    for i in range(args.block_calls):
                        batch = make_batch(64, 512, 0, seed)
                        seed += 1
                        t0 = time.perf_counter()
                        buf.add(batch)
                        t1 = time.perf_counter()
                        buf.sample(64)
                        t2 = time.perf_counter()
                        if i >= args.block_warmup:
                            adds.append(t1 - t0)
                            samples.append(t2 - t1)
                        if args.step_ms:
                            time.sleep(args.step_ms / 1e3)
                    blocks[arm]["add"].append(adds)
                    blocks[arm]["sample"].append(samples)
            buffers["without"].close()
            t_end = time.perf_counter()
            buffers["with"].close()  # publishes a last manifest: waits for every upload
            drain_s = time.perf_counter() - t_end
        out: dict = {"manifests": len(ckpt.published), "close_s": drain_s,
                     "calls_per_arm": sum(len(b) for b in blocks["with"]["add"])}
        rng = np.random.default_rng(0)
        for op in ("add", "sample"):
            for arm in buffers:
                values = np.concatenate(blocks[arm][op])
                out[f"{op}_p50_ms_{arm}"] = 1e3 * float(np.median(values))
                out[f"{op}_p99_ms_{arm}"] = 1e3 * float(np.quantile(values, 0.99))
            out[f"{op}_p99_inflation"] = out[f"{op}_p99_ms_with"] / out[f"{op}_p99_ms_without"] - 1
            # 90% interval by a paired block bootstrap: resample block k of both buffers together
            # (they ran seconds apart, under the same drift), recompute the pooled p99 ratio.
            ratios = []
            for _ in range(args.bootstrap):
                pick = rng.integers(0, args.blocks, args.blocks)
                with_p99 = np.quantile(np.concatenate([blocks["with"][op][k] for k in pick]), 0.99)
                without_p99 = np.quantile(np.concatenate([blocks["without"][op][k] for k in pick]), 0.99)
                ratios.append(with_p99 / without_p99 - 1)
            out[f"{op}_p99_inflation_ci90"] = [float(np.quantile(ratios, 0.05)), float(np.quantile(ratios, 0.95))]
        return out

    results["latency"] = lat = latency()
    server.terminate()
    server.wait()
    u = results["upload"]
    lines = [
        "# Checkpoint benchmark (loopback moto S3)", "",
        f"load average at start: {results['load_average']:.2f}; {steps} shards of {n} rollouts x {length} tokens; "
        + (f"trainer on CPU {sorted(trainer_cpus)}, upload helper and S3 server on CPU {background_cpus} (--pin)"
           if background_cpus else "no CPU placement (all processes on every CPU)"), "",
        "| upload | MB/s |", "|---|---:|",
        f"| Checkpointer upload path (helper process, S3Store.put_file) | {u['checkpointer_MBps']:.1f} |",
        f"| raw boto3 put_object, same bytes | {u['raw_put_object_MBps']:.1f} |",
        f"| ratio (Checkpointer / raw) | {u['ratio']:.2f} |", "",
        f"Latency: {lat['calls_per_arm']} recorded add + sample calls per arm (64 rollouts x 512 tokens each, "
        f"tiered storage with a {args.hot_mib} MiB hot budget), two buffers driven in {args.blocks} alternating "
        f"blocks of {args.block_calls} calls (ABBA order; the first {args.block_warmup} of each block not recorded). "
        f"'without' has no checkpointer; 'with' uploaded every sealed shard (one per add) and published "
        f"{lat['manifests']} manifests (interval {args.interval:g} s, counting the one on close). "
        + (f"Each add + sample is followed by a simulated {args.step_ms:g} ms training step (the trainer thread "
           f"sleeps, as it waits on the GPU in a real run)" if args.step_ms else
           "Calls run back to back (--step-ms 0): shards are produced faster than the server takes them")
        + f"; close() then waited {lat['close_s']:.1f} s for the uploads to finish.", "",
        "| latency (ms) | p50 without | p50 with | p99 without | p99 with | p99 inflation | 90% interval (block bootstrap) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ] + [
        f"| {op} | {lat[f'{op}_p50_ms_without']:.2f} | {lat[f'{op}_p50_ms_with']:.2f} | "
        f"{lat[f'{op}_p99_ms_without']:.2f} | {lat[f'{op}_p99_ms_with']:.2f} | {100 * lat[f'{op}_p99_inflation']:+.1f}% | "
        + " to ".join(f"{100 * x:+.1f}%" for x in lat[f"{op}_p99_inflation_ci90"]) + " |"
        for op in ("add", "sample")
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
