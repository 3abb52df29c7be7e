#!/usr/bin/env python3
"""Tiered-storage throughput against fio on the same disk, and RSS under a hot budget.

Throughput mode (default), all in ``--spill-dir``:

* **spill**: bytes of shard files written per second through ``RolloutBuffer.add`` with
  ``TieredStorage(hot_bytes=H, spill_dir=..., io="posix", direct=D)``, timed from the first
  ``add`` to the end of ``storage.flush()`` (and, without O_DIRECT, an fsync of every shard file,
  as fio's ``end_fsync=1``). Run with H = 0 (every add waits for its own shard to be written)
  and with a small H (``--hot-mib``, default 256 MiB), which lets the next add overlap the write.
  Baseline: ``fio --rw=write --bs=4M`` (torchreplay writes in 4 MiB tasks) with as many requests
  in flight as torchreplay has I/O threads (``--ioengine=libaio --iodepth=io_threads``), same
  directory, same total size, ``--direct`` matching D. Ratio target: >= 80%.
* **cold sample**: bytes of token data paged in per second by ``buffer.sample(B)`` with every
  shard cold (hot_bytes=0), from ``metrics()["storage_cold_bytes_read"]``: end to end (sample wall
  time, which includes planning and padding) and I/O only (time inside the I/O back end's
  ``read_rows``, measured by wrapping it: the C++ reader's preads with the page checksums and row
  copies done meanwhile). Baseline: ``fio --rw=randread`` at torchreplay's page size (64 KiB),
  ``--numjobs=io_threads`` psync readers (torchreplay's reader also keeps io_threads preads in
  flight) on one file of the same size (each reading its own part once, in random order), same
  directory, ``--direct`` matching D; and the same at torchreplay's mean request size (adjacent
  pages are read as one request, so requests average more than a page). The disk's speed drifts
  by tens of percent within a minute on a shared machine, so ``--repeats`` cold-sample runs (3)
  are each followed by their fio runs, each fio run lasting as long as its cold-sample run (short
  bursts read faster than a sustained pass here), and the report gives the median of the paired
  ratios.
  Ratio target: >= 70%.

Reads are kept honest with O_DIRECT (default; ``--buffered`` turns it off). In buffered mode the
page cache is dropped between the write and read phases with ``echo 3 > /proc/sys/vm/drop_caches``
where permitted, else per file with fsync + posix_fadvise(DONTNEED); ``fincore`` (util-linux)
checks what stayed resident. fio's buffered jobs invalidate the cache themselves.

``--rss``: in a child process, spill ``--rss-gib`` (4 GiB) of rollouts, fresh tensors each add,
with a ``--hot-mib`` (256 MiB) hot budget, sampling a few rollouts after every add; report peak
RSS growth (from /proc/self/statm, polled every 5 ms) against the budget, plus the fixed overhead.

fio is installed with ``apt-get install -y fio`` when missing (as root, unless --no-install-fio);
without it, ``dd oflag=direct`` measures the write baseline and a Python O_DIRECT pread loop the
read baseline.

    python benchmarks/bench_storage.py --quick          # 512 MiB, ~1 min
    python benchmarks/bench_storage.py                  # 4 GiB, ~3-5 min
    python benchmarks/bench_storage.py --rss            # 4 GiB through a 256 MiB hot budget
"""

from __future__ import annotations

import argparse
import cProfile
import datetime as _dt
import io
import json
import math
import os
import platform
import pstats
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from _machine import cpu_model

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench_storage.md"
VOCAB = 151_000
MiB = 1 << 20
GiB = 1 << 30


# --------------------------------------------------------------------------- data


def rollout_batches(n: int, count: int, seed: int, prompt: int = 1024, mean_resp: int = 4000,
                    cv: float = 1.0, max_resp: int = 16000) -> list[dict[str, Any]]:
    """`count` distinct add-batches of `n` rollouts in the ragged {"values", "offsets"} form."""
    g = torch.Generator().manual_seed(seed)
    sigma = math.sqrt(math.log1p(cv * cv))
    mu = math.log(mean_resp) - sigma**2 / 2
    out = []
    for k in range(count):
        resp = torch.exp(mu + sigma * torch.randn(n, generator=g)).round().clamp_(1, max_resp).long()
        lengths = resp + prompt
        offsets = torch.zeros(n + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        total = int(offsets[-1])
        tokens = torch.randint(0, VOCAB, (total,), generator=g)
        pos = torch.arange(total) - torch.repeat_interleave(offsets[:-1], lengths)
        mask = pos >= prompt
        logprobs = (-torch.rand(total, generator=g) * 5).masked_fill_(~mask, 0.0)
        out.append({
            "tokens": {"values": tokens, "offsets": offsets},
            "logprobs": {"values": logprobs, "offsets": offsets},
            "response_mask": {"values": mask, "offsets": offsets},
            "prompt_len": torch.full((n,), prompt, dtype=torch.int64),
            "reward": torch.rand(n, generator=g),
            "advantage": torch.randn(n, generator=g),
            "group_id": torch.arange(n, dtype=torch.int64) // 16 + k * n,
            "policy_version": 0,
        })
    return out


def batch_bytes(b: dict[str, Any]) -> int:
    return sum(v["values"].numel() * v["values"].element_size() for k, v in b.items() if isinstance(v, dict))


def fresh_copy(b: dict[str, Any]) -> dict[str, Any]:
    return {k: ({"values": v["values"].clone(), "offsets": v["offsets"]} if isinstance(v, dict)
                else (v.clone() if isinstance(v, torch.Tensor) else v)) for k, v in b.items()}


# ----------------------------------------------------------------- page cache


def supports_direct(path: str) -> bool:
    probe = os.path.join(path, ".direct-probe")
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o644)
        os.close(fd)
        return True
    except (OSError, AttributeError):
        return False
    finally:
        try:
            os.unlink(probe)
        except OSError:
            pass


def resident_bytes(files: list[str]) -> int | None:
    """Bytes of `files` in the page cache, via util-linux fincore; None if unavailable."""
    if not shutil.which("fincore") or not files:
        return None
    total = 0
    for i in range(0, len(files), 200):
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *files[i:i + 200]],
                             capture_output=True, text=True)
        if out.returncode != 0:
            return None
        total += sum(int(x) for x in out.stdout.split())
    return total


def drop_page_cache(files: list[str]) -> str:
    """Evict `files` from the page cache; returns how (for the report)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        how = "echo 3 > /proc/sys/vm/drop_caches: worked"
    except OSError as exc:
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        how = f"drop_caches failed ({exc.strerror}); used fsync + posix_fadvise(DONTNEED) per shard file"
    left = resident_bytes(files)
    if left is not None:
        how += f"; fincore: {left / MiB:.1f} MiB still resident"
    return how


# ------------------------------------------------------------------------- fio


def ensure_fio(allow_install: bool) -> tuple[str | None, str]:
    fio = shutil.which("fio")
    if fio:
        return fio, "already installed"
    if not allow_install:
        return None, "fio missing (--no-install-fio)"
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return None, "fio missing and cannot apt-get install it (not root or no apt-get)"
    print("[bench_storage] fio missing: apt-get update && apt-get install -y fio", file=sys.stderr)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    ok = (subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True).returncode == 0
          and subprocess.run(["apt-get", "install", "-y", "-qq", "fio"], env=env, capture_output=True).returncode == 0)
    fio = shutil.which("fio")
    return (fio, "installed from Debian packages by this run") if ok and fio else (None, "apt-get install fio failed")


def run_fio(fio: str, args: list[str]) -> dict[str, Any]:
    out = subprocess.run([fio, "--output-format=json", *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"fio failed: {out.stderr.strip()[-300:]}")
    text = out.stdout[out.stdout.index("{"):]
    return json.loads(text)["jobs"][0]


def fio_write(fio: str, path: str, size: int, direct: bool, depth: int) -> tuple[float, str]:
    args = ["--name=seqwrite", f"--filename={path}", "--rw=write", "--bs=4M", f"--size={size}",
            f"--direct={int(direct)}", "--ioengine=libaio", f"--iodepth={depth}", "--numjobs=1",
            f"--end_fsync={0 if direct else 1}"]
    job = run_fio(fio, args)
    return job["write"]["bw_bytes"], "fio " + " ".join(args)


def fio_randread(fio: str, path: str, size: int, bs: int, direct: bool, jobs: int, runtime_ms: int
                 ) -> tuple[float, str]:
    # Each job reads its own 1/jobs of the file once, in random order: no block is read twice, so
    # buffered runs cannot hit the page cache after fio's initial invalidate.
    part = size // jobs // bs * bs
    args = ["--name=randread", f"--filename={path}", "--rw=randread", f"--bs={bs}", f"--size={part}",
            f"--offset_increment={part}", f"--direct={int(direct)}", "--ioengine=psync", f"--numjobs={jobs}",
            "--group_reporting", f"--runtime={runtime_ms}ms", "--invalidate=1"]
    job = run_fio(fio, args)
    return job["read"]["bw_bytes"], "fio " + " ".join(args)


def dd_write(path: str, size: int, direct: bool) -> tuple[float, str]:
    count = max(1, size // (4 * MiB))
    args = ["dd", "if=/dev/zero", f"of={path}", "bs=4M", f"count={count}"]
    args.append("oflag=direct" if direct else "conv=fsync")
    t0 = time.perf_counter()
    subprocess.run(args, check=True, capture_output=True)
    return count * 4 * MiB / (time.perf_counter() - t0), " ".join(args)


def python_randread(path: str, bs: int, direct: bool, jobs: int, runtime: float) -> tuple[float, str]:
    """Fallback random-read baseline: `jobs` threads of aligned pread at random offsets."""
    import mmap

    size = os.path.getsize(path)
    blocks = size // bs
    done = [0] * jobs
    stop = time.perf_counter() + runtime

    def worker(j: int) -> None:
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        buf = mmap.mmap(-1, bs)
        rng = random.Random(j)
        try:
            while time.perf_counter() < stop:
                done[j] += os.preadv(fd, [buf], rng.randrange(blocks) * bs)
        finally:
            os.close(fd)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(j,)) for j in range(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done) / (time.perf_counter() - t0), f"python pread x{jobs} threads, bs={bs}, O_DIRECT={direct}"


# ------------------------------------------------------------------- torchreplay


class ReadTimer:
    """Wraps an I/O back end's read_rows (the C++ reader: pread + page CRC32 + row copies, fused):
    wall time during which at least one call is in flight, calls, pread requests and bytes read."""

    def __init__(self, backend: Any) -> None:
        from torchreplay.storage.reader_abi import ReadStatus  # the status row's columns, by name

        self.reads_column, self.bytes_column = ReadStatus._fields.index("reads"), ReadStatus._fields.index("bytes")
        self.inner = backend.read_rows
        self.lock = threading.Lock()
        self.active = 0
        self.since = 0.0
        self.seconds = 0.0
        self.calls = 0
        self.ranges = 0
        self.bytes = 0
        backend.read_rows = self

    def __call__(self, *args: Any) -> Any:
        with self.lock:
            if self.active == 0:
                self.since = time.perf_counter()
            self.active += 1
        status = None
        try:
            status = self.inner(*args)
            return status
        finally:
            with self.lock:
                self.active -= 1
                if self.active == 0:
                    self.seconds += time.perf_counter() - self.since
                self.calls += 1
                if status is not None:
                    self.ranges += int(status[:, self.reads_column].sum())
                    self.bytes += int(status[:, self.bytes_column].sum())


def spill_run(tr: Any, batches: list[dict[str, Any]], adds: int, spill_dir: str, hot_bytes: int, direct: bool,
              io_threads: int, capacity: int) -> tuple[Any, dict[str, Any]]:
    from torchreplay.storage import TieredStorage

    storage = TieredStorage(hot_bytes=hot_bytes, spill_dir=spill_dir, io="posix", direct=direct,
                            io_threads=io_threads)
    buf = tr.RolloutBuffer(capacity, sampler=tr.UniformSampler(), storage=storage, seed=0)
    add_s = 0.0
    t0 = time.perf_counter()
    for k in range(adds):
        a = time.perf_counter()
        buf.add(batches[k % len(batches)])
        add_s += time.perf_counter() - a
    storage.flush()
    t_flush = time.perf_counter()
    files = sorted(str(p) for p in Path(spill_dir).glob("*.trs"))
    if not direct:
        for path in files:  # as fio's end_fsync=1: the bytes are on the disk
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    elapsed = time.perf_counter() - t0
    m = buf.metrics()
    return buf, {
        "hot_bytes": hot_bytes,
        "adds": adds,
        "rollouts": len(buf),
        "spilled_bytes": m["storage_spilled_bytes"],
        "spilled_shards": m["storage_spilled_shards"],
        "seconds": elapsed,
        "add_seconds": add_s,
        "flush_seconds": t_flush - t0 - add_s,
        "fsync_seconds": time.perf_counter() - t_flush if not direct else 0.0,
        "bytes_per_s": m["storage_spilled_bytes"] / elapsed,
        "files": files,
    }


def cold_sample_run(buf: Any, batch_size: int, calls: int, profile: bool, seed: int = 1) -> dict[str, Any]:
    timer = ReadTimer(buf.storage.io)
    gen = torch.Generator().manual_seed(seed)
    m0 = buf.metrics()
    prof = cProfile.Profile() if profile else None
    times = []
    for _ in range(calls):
        if prof:
            prof.enable()
        t0 = time.perf_counter()
        batch = buf.sample(batch_size, generator=gen)
        times.append(time.perf_counter() - t0)
        if prof:
            prof.disable()
        width = batch.tokens.shape[1]
        del batch
    m1 = buf.metrics()
    read = m1["storage_cold_bytes_read"] - m0["storage_cold_bytes_read"]
    total = sum(times)
    out = {
        "batch_size": batch_size,
        "calls": calls,
        "seconds": total,
        "cold_bytes_read": read,
        "hot_hits": m1["storage_hot_hits"] - m0["storage_hot_hits"],
        "cold_reads": m1["storage_cold_reads"] - m0["storage_cold_reads"],
        "bytes_per_s": read / total,
        "io_seconds": timer.seconds,
        "io_bytes_per_s": timer.bytes / timer.seconds if timer.seconds else 0.0,
        "read_rows_calls": timer.calls,
        "ranges": timer.ranges,
        "mean_range_bytes": timer.bytes / timer.ranges if timer.ranges else 0,
        "padded_width": width,
    }
    if prof:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(12)
        out["profile_top_tottime"] = s.getvalue()
    return out


def throughput_mode(args: argparse.Namespace) -> dict[str, Any]:
    import torchreplay as tr
    from torchreplay.storage import format as fmt

    base = Path(args.spill_dir or tempfile.mkdtemp(prefix="torchreplay-bench-storage-", dir="/var/tmp"))
    base.mkdir(parents=True, exist_ok=True)
    direct = not args.buffered
    if direct and not supports_direct(str(base)):
        sys.exit(f"{base} does not support O_DIRECT; pass --buffered or another --spill-dir")
    size = int(args.size_gib * GiB)
    fio, fio_how = ensure_fio(not args.no_install_fio)

    batches = rollout_batches(args.rollouts_per_add, 4, args.seed)
    per_add = sum(batch_bytes(b) for b in batches) / len(batches)
    adds = max(2, round(size / per_add))
    capacity = 1 << max(1, (adds * args.rollouts_per_add - 1).bit_length())
    print(f"[bench_storage] {adds} adds x {args.rollouts_per_add} rollouts (~{per_add / MiB:.0f} MiB each) "
          f"into {base}, O_DIRECT={direct}", file=sys.stderr)

    results: dict[str, Any] = {"spill": [], "cold": None}
    keep = None
    for hot in (0, args.hot_mib * MiB):
        d = base / f"tr-hot{hot // MiB}"
        shutil.rmtree(d, ignore_errors=True)
        buf, rec = spill_run(tr, batches, adds, str(d), hot, direct, args.io_threads, capacity)
        print(f"[bench_storage] spill hot_bytes={hot // MiB} MiB: {rec['spilled_bytes'] / MiB:.0f} MiB in "
              f"{rec['seconds']:.2f}s = {rec['bytes_per_s'] / MiB:.0f} MiB/s (add {rec['add_seconds']:.2f}s, "
              f"flush {rec['flush_seconds']:.2f}s)", file=sys.stderr)
        results["spill"].append({k: v for k, v in rec.items() if k != "files"})
        if hot == 0:
            keep = (buf, rec["files"], d)
        else:
            buf.close()
            shutil.rmtree(d, ignore_errors=True)
    del batches

    buf, files, keep_dir = keep
    filesystem = fs_of(str(base))
    fio_file = str(base / "fio-testfile")
    base_res: dict[str, Any] = {"tool": fio_how, "randread_runs": [], "randread_matched_runs": []}
    colds: list[dict[str, Any]] = []
    try:
        if fio:
            bw, cmd = fio_write(fio, fio_file, size, direct, args.io_threads)
        else:
            bw, cmd = dd_write(fio_file, size, direct)
        base_res["write_bytes_per_s"], base_res["write_cmd"] = bw, cmd
        print(f"[bench_storage] baseline write: {bw / MiB:.0f} MiB/s ({cmd})", file=sys.stderr)
        # The disk's speed drifts by tens of percent within a minute here (shared machine), so each
        # cold-sample run is paired with fio runs right after it, and the report gives the medians.
        for rep in range(args.repeats):
            cache = "not needed: O_DIRECT reads bypass the page cache" if direct else drop_page_cache(files)
            cold = cold_sample_run(buf, args.batch_size, args.sample_calls, args.profile and rep == 0, seed=1 + rep)
            colds.append(cold)
            print(f"[bench_storage] cold sample {rep + 1}/{args.repeats} B={args.batch_size} x{args.sample_calls}: "
                  f"{cold['cold_bytes_read'] / MiB:.0f} MiB in {cold['seconds']:.2f}s = "
                  f"{cold['bytes_per_s'] / MiB:.0f} MiB/s end to end, {cold['io_bytes_per_s'] / MiB:.0f} MiB/s in "
                  f"read_rows; mean request {cold['mean_range_bytes'] / 1024:.0f} KiB", file=sys.stderr)
            # As long as the cold run it pairs with: this disk serves short bursts faster than a
            # sustained pass (fio here: 561-746 MiB/s over 1-2 s, 577-592 MiB/s over 7 s).
            runtime_ms = min(args.fio_runtime * 1000, max(1000, round(cold["seconds"] * 1000)))
            if fio:
                bw, cmd = fio_randread(fio, fio_file, size, fmt.PAGE_SIZE, direct, args.io_threads, runtime_ms)
            else:
                if not direct:
                    drop_page_cache([fio_file])
                bw, cmd = python_randread(fio_file, fmt.PAGE_SIZE, direct, args.io_threads, runtime_ms / 1000)
            base_res["randread_runs"].append(bw)
            base_res["randread_cmd"] = cmd
            print(f"[bench_storage] baseline randread: {bw / MiB:.0f} MiB/s ({cmd})", file=sys.stderr)
            # torchreplay coalesces adjacent pages into one request, so its requests average more
            # than a page; fio at that size (rounded up to 4 KiB) is the same-block-size comparison.
            matched = fmt.align_up(round(colds[0]["mean_range_bytes"])) if colds[0]["ranges"] else fmt.PAGE_SIZE
            if fio and matched != fmt.PAGE_SIZE:
                bw, cmd = fio_randread(fio, fio_file, size, matched, direct, args.io_threads, runtime_ms)
                base_res["randread_matched_runs"].append(bw)
                base_res["randread_matched_cmd"], base_res["randread_matched_bs"] = cmd, matched
                print(f"[bench_storage] baseline randread at the mean request size: {bw / MiB:.0f} MiB/s",
                      file=sys.stderr)
    finally:
        buf.close()
        shutil.rmtree(keep_dir, ignore_errors=True)
        try:
            os.unlink(fio_file)
        except OSError:
            pass
        if not args.spill_dir:
            shutil.rmtree(base, ignore_errors=True)
    results["cold_runs"] = colds
    order = sorted(range(len(colds)), key=lambda k: colds[k]["bytes_per_s"])
    results["cold"] = colds[order[len(order) // 2]]  # the median run, for the detail line
    results["page_cache"] = cache
    base_res["randread_bytes_per_s"] = statistics.median(base_res["randread_runs"])
    results["baseline"] = base_res
    results["setup"] = {
        "spill_dir": str(base),
        "filesystem": filesystem,
        "O_DIRECT": direct,
        "total size": f"{size / GiB:.2f} GiB target; {adds} adds x {args.rollouts_per_add} rollouts "
                      f"(~{per_add / MiB:.0f} MiB of token data each, 4 distinct batches re-added)",
        "io_threads": args.io_threads,
        "page size (read block)": fmt.PAGE_SIZE,
        "capacity": capacity,
    }
    return results


def fs_of(path: str) -> str:
    out = subprocess.run(["df", "-T", path], capture_output=True, text=True)
    lines = out.stdout.splitlines()
    if len(lines) >= 2:
        parts = lines[1].split()
        return f"{parts[0]} ({parts[1]})"
    return "unknown"


# -------------------------------------------------------------------------- rss


RSS_CHILD = r"""
import json, os, sys, threading, time, torch
sys.path.insert(0, {bench_dir!r})
import torchreplay as tr
from torchreplay.storage import TieredStorage
from bench_storage import rollout_batches, batch_bytes, fresh_copy
torch.set_num_threads({threads})
def rss():
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
sources = rollout_batches({n}, 2, {seed})
per_add = sum(batch_bytes(b) for b in sources) / 2
adds = max(2, round({total} / per_add))
storage = TieredStorage(hot_bytes={hot}, spill_dir={spill_dir!r}, io='posix', direct={direct})
buf = tr.RolloutBuffer(1 << max(1, (adds * {n} - 1).bit_length()), sampler=tr.UniformSampler(),
                       storage=storage, seed=0)
peak = [0]; stop = [False]
def poll():
    while not stop[0]:
        peak[0] = max(peak[0], rss()); time.sleep(0.005)
base = rss()
t = threading.Thread(target=poll, daemon=True); t.start()
t0 = time.perf_counter()
for k in range(adds):
    batch = fresh_copy(sources[k % 2])  # new memory each add: the buffer must hold or drop it
    buf.add(batch)
    del batch
    buf.sample(8, generator=torch.Generator().manual_seed(k))
buf.storage.flush()
elapsed = time.perf_counter() - t0
stop[0] = True; t.join()
peak[0] = max(peak[0], rss())
m = buf.metrics()
print(json.dumps(dict(base_rss=base, peak_rss=peak[0], end_rss=rss(), adds=adds, per_add=per_add,
                      spilled_bytes=m['storage_spilled_bytes'], hot_bytes_end=m['storage_hot_bytes'],
                      rollouts=len(buf), seconds=elapsed)))
buf.close()
"""


def rss_mode(args: argparse.Namespace) -> dict[str, Any]:
    base = Path(args.spill_dir or tempfile.mkdtemp(prefix="torchreplay-bench-rss-", dir="/var/tmp"))
    d = base / "rss"
    shutil.rmtree(d, ignore_errors=True)
    direct = not args.buffered and supports_direct(str(base))
    code = RSS_CHILD.format(bench_dir=str(Path(__file__).resolve().parent), threads=max(1, args.threads),
                            n=args.rollouts_per_add, seed=args.seed, total=int(args.rss_gib * GiB),
                            hot=args.hot_mib * MiB, spill_dir=str(d), direct=direct)
    import torchreplay

    # The child imports the same torchreplay as this process (an installed one or a source tree).
    env = {**os.environ}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(Path(torchreplay.__file__).resolve().parent.parent), env.get("PYTHONPATH")) if p)
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=1800)
    finally:
        shutil.rmtree(d, ignore_errors=True)
        if not args.spill_dir:
            shutil.rmtree(base, ignore_errors=True)
    if out.returncode != 0:
        raise RuntimeError(f"rss child failed: {out.stderr.strip()[-800:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["growth"] = res["peak_rss"] - res["base_rss"]
    res["budget"] = args.hot_mib * MiB
    res["O_DIRECT"] = direct
    res["spill_dir"] = str(d)
    return res


# ------------------------------------------------------------------------ report


def mib(v: float) -> str:
    return f"{v / MiB:.0f}"


def fmt_kib(v: int) -> str:
    return f"{v // 1024} KiB"


def render_throughput(r: dict[str, Any]) -> list[str]:
    base, cold = r["baseline"], r["cold"]
    w, rr = base.get("write_bytes_per_s"), base.get("randread_bytes_per_s")
    lines = [
        "| measurement | torchreplay (MiB/s) | baseline (MiB/s) | ratio | target |",
        "|---|---:|---:|---:|---:|",
    ]
    for s in r["spill"]:
        ratio = s["bytes_per_s"] / w if w else None
        lines.append(
            f"| spill, hot_bytes={s['hot_bytes'] // MiB} MiB ({mib(s['spilled_bytes'])} MiB in {s['seconds']:.1f} s) | "
            f"{mib(s['bytes_per_s'])} | {mib(w) if w else '—'} (seq write) | "
            f"{f'{100 * ratio:.0f}%' if ratio else '—'} | >= 80% "
            f"{'met' if ratio and ratio >= 0.8 else '**not met**'} |"
        )
    colds = r.get("cold_runs") or [cold]
    baselines = [(base.get("randread_runs") or [rr], f"rand read, bs={fmt_kib(r['setup']['page size (read block)'])}")]
    if base.get("randread_matched_runs"):
        baselines.append((base["randread_matched_runs"],
                          f"rand read, bs={fmt_kib(base['randread_matched_bs'])} (mean request)"))
    paired = []
    for bws, what in baselines:
        for label, key in (("cold sample, end to end", "bytes_per_s"),
                           ("cold sample, I/O only (read_rows)", "io_bytes_per_s")):
            # Each cold run against the fio runs made right after it; medians of those ratios.
            ratios = [c[key] / bw for c, bw in zip(colds, bws) if bw]
            ratio = statistics.median(ratios) if ratios else None
            paired.append(f"{label} vs {what}: " + ", ".join(f"{100 * x:.0f}%" for x in ratios))
            lines.append(
                f"| {label} (B={cold['batch_size']} x {cold['calls']}, {mib(cold['cold_bytes_read'])} MiB"
                f"{f', median of {len(colds)}' if len(colds) > 1 else ''}) | "
                f"{mib(statistics.median(c[key] for c in colds))} | "
                f"{mib(statistics.median(bws)) if bws and bws[0] else '—'} ({what}) | "
                f"{f'{100 * ratio:.0f}%' if ratio else '—'} | "
                f">= 70% {'met' if ratio and ratio >= 0.7 else '**not met**'} |"
            )
    lines += [
        "",
        "Spill detail: " + "; ".join(
            f"hot_bytes={s['hot_bytes'] // MiB} MiB: add {s['add_seconds']:.2f} s + flush {s['flush_seconds']:.2f} s"
            + (f" + fsync {s['fsync_seconds']:.2f} s" if s['fsync_seconds'] else "")
            + f", {s['spilled_shards']} shards"
            for s in r["spill"]
        ) + ".",
        f"Cold-sample detail: {cold['cold_reads']} shard reads, {cold['ranges']} requests "
        f"(mean {cold['mean_range_bytes'] / 1024:.0f} KiB), {cold['hot_hits']} hot hits, "
        f"{cold['io_seconds']:.2f} s of {cold['seconds']:.2f} s inside read_rows, "
        f"padded width {cold['padded_width']} (median run).",
        "Paired ratios per run: " + "; ".join(paired) + ".",
        f"Page cache between phases: {r['page_cache']}.",
        "",
        "Baseline commands:",
        "",
        f"- write: `{base.get('write_cmd', '—')}`",
        f"- read: `{base.get('randread_cmd', '—')}`",
        *([f"- read at the mean request size: `{base['randread_matched_cmd']}`"]
          if base.get("randread_matched_cmd") else []),
        f"- fio: {base['tool']}",
    ]
    if cold.get("profile_top_tottime"):
        lines += ["", "cProfile of the cold-sample calls (top by tottime):", "", "```",
                  cold["profile_top_tottime"].strip(), "```"]
    return lines


def render_markdown(report: dict[str, Any]) -> str:
    lines = ["# Tiered-storage benchmark", ""]
    if "throughput" in report:
        lines += render_throughput(report["throughput"])
        lines += ["", "## Storage setup", ""]
        lines += [f"- {k}: {v}" for k, v in report["throughput"]["setup"].items()]
    if "rss" in report:
        r = report["rss"]
        over = r["growth"] - r["budget"]
        lines += [
            "## RSS under a hot budget",
            "",
            "| spilled (GiB) | hot budget (MiB) | peak RSS growth (MiB) | growth - budget (MiB) "
            "| hot at end (MiB) | time (s) |",
            "|---:|---:|---:|---:|---:|---:|",
            f"| {r['spilled_bytes'] / GiB:.2f} | {mib(r['budget'])} | {mib(r['growth'])} | {over / MiB:+.0f} | "
            f"{mib(r['hot_bytes_end'])} | {r['seconds']:.1f} |",
            "",
            f"{r['adds']} adds of ~{r['per_add'] / MiB:.0f} MiB (fresh tensors each; the caller's batch in flight is "
            f"part of the growth), sample(8) after each; O_DIRECT={r['O_DIRECT']}; baseline RSS "
            f"{mib(r['base_rss'])} MiB after imports and making the source batches (so the growth includes "
            "thread pools and allocator warm-up); RSS polled every 5 ms from /proc/self/statm "
            "in the child.",
        ]
    lines += ["", "## Setup", ""]
    lines += [f"- {k}: {v}" for k, v in report["meta"].items()]
    lines.append("")
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="512 MiB, 3 sample calls, 5 s fio reads (rss: 512 MiB)")
    p.add_argument("--rss", action="store_true", help="RSS-under-budget mode instead of throughput")
    p.add_argument("--spill-dir", help="directory on the disk under test (default: a new dir in /var/tmp)")
    p.add_argument("--size-gib", type=float, help="bytes to spill (default 4; quick 0.5)")
    p.add_argument("--rss-gib", type=float, help="bytes to spill in --rss mode (default 4; quick 0.5)")
    p.add_argument("--hot-mib", type=int, default=256, help="hot budget for --rss and the second spill run")
    p.add_argument("--rollouts-per-add", type=int, default=1024, help="rollouts per add (one shard each)")
    p.add_argument("--batch-size", type=int, default=256, help="B of the cold sample calls")
    p.add_argument("--sample-calls", type=int, help="cold sample calls (default 10; quick 3)")
    p.add_argument("--io-threads", type=int, default=4, help="TieredStorage io_threads; also fio's queue depth/jobs")
    p.add_argument("--fio-runtime", type=int,
                   help="cap on seconds of fio random reads, which otherwise last as long as the cold-sample run "
                   "they pair with (default 15; quick 5)")
    p.add_argument("--repeats", type=int, default=3,
                   help="cold-sample runs, each followed by its fio random reads (medians reported; quick 1)")
    p.add_argument("--buffered", action="store_true", help="no O_DIRECT (drop the page cache between phases)")
    p.add_argument("--no-install-fio", action="store_true", help="do not apt-get install fio when missing")
    p.add_argument("--profile", action="store_true",
                   help="cProfile the cold-sample calls (top functions in the report)")
    p.add_argument("--out", type=Path, help="Markdown output, JSON next to it (default benchmarks/results/"
                   "bench_storage[_rss][_quick].md)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads; 0 keeps torch's default")
    args = p.parse_args(argv)
    args.size_gib = args.size_gib or (0.5 if args.quick else 4.0)
    args.rss_gib = args.rss_gib or (0.5 if args.quick else 4.0)
    args.sample_calls = args.sample_calls or (3 if args.quick else 10)
    args.fio_runtime = args.fio_runtime or (5 if args.quick else 15)
    if args.quick and "--repeats" not in (argv if argv is not None else sys.argv):
        args.repeats = 1
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.out is None:
        name = "bench_storage" + ("_rss" if args.rss else "") + ("_quick" if args.quick else "")
        args.out = DEFAULT_OUT.with_name(name + ".md")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    load1 = os.getloadavg()[0]
    if load1 > 0.5:
        print(f"[bench_storage] warning: 1-min load average is {load1:.2f}; results may be noisy", file=sys.stderr)
    started = time.perf_counter()
    try:
        import torchreplay

        tr_version = f"{torchreplay.__version__} ({Path(torchreplay.__file__).parent})"
    except ImportError as exc:
        sys.exit(f"torchreplay is not importable ({exc}); run from the repo root with PYTHONPATH=.")
    report: dict[str, Any] = {}
    if args.rss:
        report["rss"] = rss_mode(args)
        r = report["rss"]
        print(f"[bench_storage] rss: spilled {r['spilled_bytes'] / GiB:.2f} GiB, peak growth {mib(r['growth'])} MiB "
              f"vs budget {mib(r['budget'])} MiB", file=sys.stderr)
    else:
        report["throughput"] = throughput_mode(args)
    report["meta"] = {
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "cpu": f"{cpu_model()} ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchreplay": tr_version,
        "load average at start / end": f"{load1:.2f} / {os.getloadavg()[0]:.2f}",
        "seed": args.seed,
        "wall time (s)": round(time.perf_counter() - started, 1),
    }
    markdown = render_markdown(report)
    print(markdown)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(markdown)
    json_path = args.out.with_suffix(".json")
    json_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"[bench_storage] wrote {args.out} and {json_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
