"""Checkpoint benchmark against a loopback S3 server (moto), in one run:

1. upload throughput of the Checkpointer (shards + state + manifest) against raw boto3
   `put_object` of the same bytes to the same server, as a ratio;
2. p50/p99 latency of `add` and `sample` with and without a checkpoint in flight (target: p99
   inflation at most 5%).

The S3 server (moto) runs in a separate process.

    python benchmarks/bench_checkpoint.py [--quick] [--out benchmarks/results/bench_checkpoint.md]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import torchreplay as tr
from torchreplay.checkpoint import Checkpointer


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


def pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--interval", type=float, default=1.0,
                        help="seconds between manifests in the 'with' run (real runs use 60-300)")
    parser.add_argument("--reps", type=int, default=3, help="alternating without/with latency runs per arm")
    parser.add_argument("--pin", action="store_true",
                        help="trainer (this process) on the first CPU; the upload helper (helper_cpus) and the "
                             "S3 server on the last, in both arms")
    parser.add_argument("--step-ms", type=float, default=10.0,
                        help="simulated training step after each add + sample: the trainer thread waits (on the "
                             "GPU, in a real run) and uses no CPU. 0 = back-to-back calls, which produce shards faster "
                             "than the S3 server here can take them, so uploads fall ever further behind")
    parser.add_argument("--out", default="benchmarks/results/bench_checkpoint.md")
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    trainer_cpus, background_cpus = ({cpus[0]}, [cpus[-1]]) if args.pin and len(cpus) > 1 else (set(cpus), None)
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
                              preexec_fn=lambda: (os.nice(19), os.sched_setaffinity(0, background_cpus or cpus)))
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
                     "background_cpus": background_cpus, "steps": steps, "rollouts_per_step": n, "tokens": length}

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
        # The checkpointer's upload path (the helper process: S3Store.put_file, transfer manager,
        # CRC32 checksums) on the same files, timed alone: in a run the uploads overlap training.
        start = time.perf_counter()
        for i, p in enumerate(paths):
            ckpt._remote.put_file(f"shards/again-{i}.trs", str(p))
        ckpt_s = time.perf_counter() - start
        datas = [p.read_bytes() for p in paths]
        start = time.perf_counter()
        for i, d in enumerate(datas):
            client.put_object(Bucket="bench-ckpt", Key=f"raw/{i}", Body=d)
        raw_s = time.perf_counter() - start
        buf.close()
    results["upload"] = {"bytes": shard_bytes, "checkpointer_MBps": shard_bytes / ckpt_s / 1e6,
                         "raw_put_object_MBps": shard_bytes / raw_s / 1e6, "ratio": raw_s / ckpt_s}

    # 2. latency with and without a checkpoint in flight
    def latency_run(in_flight: bool) -> dict:
        """Without: no checkpointer at all. With: every sealed shard is uploaded and a manifest is
        published every `--interval` seconds from inside the buffer calls, as in a real run."""
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = Checkpointer("s3://bench-ckpt/lat", interval_s=args.interval, endpoint_url=endpoint,
                                helper_cpus=background_cpus) if in_flight else None
            buf = tr.RolloutBuffer(64 * 64, sampler=tr.PrioritizedSampler(), checkpoint=ckpt, seed=0,
                                   storage=tr.TieredStorage(hot_bytes=256 << 20, spill_dir=tmp, io="posix"))
            for s in range(8):
                buf.add(make_batch(64, 512, 0, 100 + s))
            add_lat, sample_lat = [], []
            calls = 100 if args.quick else 1000
            for i in range(calls):
                batch = make_batch(64, 512, 0, 1000 + i)
                t0 = time.perf_counter()
                buf.add(batch)
                t1 = time.perf_counter()
                buf.sample(64)
                t2 = time.perf_counter()
                add_lat.append(t1 - t0)
                sample_lat.append(t2 - t1)
                if args.step_ms:
                    time.sleep(args.step_ms / 1e3)
            t_end = time.perf_counter()
            buf.close()  # publishes a last manifest: waits for every upload
            drain_s = time.perf_counter() - t_end
            published = len(ckpt.published) if ckpt else 0
        return {"manifests": published, "close_s": drain_s, "add_p50_ms": 1e3 * statistics.median(add_lat),
                "add_p99_ms": 1e3 * pct(add_lat, 0.99),
                "sample_p50_ms": 1e3 * statistics.median(sample_lat), "sample_p99_ms": 1e3 * pct(sample_lat, 0.99)}

    # Alternate the arms so that drift in the machine's load hits both alike; report each arm's
    # median over repetitions (a p99 over 1000 calls is the 10th-slowest call: one run is noisy).
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for _ in range(args.reps):
        for in_flight in (False, True):
            runs[in_flight].append(latency_run(in_flight))

    def median_run(arm: list[dict]) -> dict:
        return {k: statistics.median(r[k] for r in arm) for k in arm[0]}

    quiet, busy = median_run(runs[False]), median_run(runs[True])
    results["latency_runs"] = {"without": runs[False], "with": runs[True]}
    results["latency"] = {"without": quiet, "with": busy,
                          "add_p99_inflation": busy["add_p99_ms"] / quiet["add_p99_ms"] - 1,
                          "sample_p99_inflation": busy["sample_p99_ms"] / quiet["sample_p99_ms"] - 1}
    server.terminate()
    server.wait()
    u, lat = results["upload"], results["latency"]
    lines = [
        "# Checkpoint benchmark (loopback moto S3)", "",
        f"load average at start: {results['load_average']:.2f}; {steps} shards of {n} rollouts x {length} tokens; "
        + (f"trainer on CPU {sorted(trainer_cpus)}, upload helper and S3 server on CPU {background_cpus} (--pin)"
           if background_cpus else "no CPU placement (all processes on every CPU)"), "",
        "| upload | MB/s |", "|---|---:|",
        f"| Checkpointer upload path (helper process, S3Store.put_file) | {u['checkpointer_MBps']:.1f} |",
        f"| raw boto3 put_object, same bytes | {u['raw_put_object_MBps']:.1f} |",
        f"| ratio (Checkpointer / raw) | {u['ratio']:.2f} |", "",
        f"Latency: median over {args.reps} alternating runs per arm of {100 if args.quick else 1000} add + sample calls (64 rollouts x 512 tokens each, tiered "
        f"storage); 'without' has no checkpointer; 'with' uploaded every sealed shard (one per add) and "
        f"published {busy['manifests']:g} manifests (interval {args.interval:g} s, counting the one on close). "
        + (f"Each add + sample is followed by a simulated {args.step_ms:g} ms training step (the trainer thread "
           f"sleeps, as it waits on the GPU in a real run)" if args.step_ms else
           "Calls run back to back (--step-ms 0): shards are produced faster than the server takes them")
        + f"; close() then waited {busy['close_s']:.1f} s for the uploads to finish.", "",
        "| latency (ms) | p50 without | p50 with | p99 without | p99 with | p99 inflation |",
        "|---|---:|---:|---:|---:|---:|",
        f"| add | {lat['without']['add_p50_ms']:.2f} | {lat['with']['add_p50_ms']:.2f} | {lat['without']['add_p99_ms']:.2f} "
        f"| {lat['with']['add_p99_ms']:.2f} | {100 * lat['add_p99_inflation']:+.1f}% |",
        f"| sample | {lat['without']['sample_p50_ms']:.2f} | {lat['with']['sample_p50_ms']:.2f} | "
        f"{lat['without']['sample_p99_ms']:.2f} | {lat['with']['sample_p99_ms']:.2f} | {100 * lat['sample_p99_inflation']:+.1f}% |",
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
