#!/usr/bin/env python3
"""CPU benchmark of prioritized-sampling structures.

Compares torchreplay's SegmentTree with TorchRL's C++ segment trees, cpprb's
PrioritizedReplayBuffer, a vectorized NumPy sum tree and two tree-less torch
baselines (``torch.multinomial`` and cumsum + ``torch.searchsorted``) on three
operations, reported in million ops per second (B ops per call):

* ``update``: write B random positive priorities at B random indices.
* ``sample``: draw B indices proportionally to priority (stratified where the
  contender allows it), returning the indices and their priorities.
* ``sample_then_update``: sample B, then write new priorities at those indices.

Tree contenders keep a min tree up to date on every write, as a prioritized
replay buffer needs min(p) for its importance weights.  Peers that cannot be
imported are skipped with a note.  Install them with benchmarks/setup_peers.sh.

    python benchmarks/bench_tree.py            # full grid, ~3-4 min on 2 cores
    python benchmarks/bench_tree.py --quick    # N=2^16,2^20 x B=256,4096
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _machine import cpu_model, package_versions


def peer_versions() -> dict[str, str]:
    return package_versions(("torchreplay", "torchrl", "tensordict", "cpprb"))


OPS: tuple[str, ...] = ("update", "sample", "sample_then_update")
FULL_SIZES: tuple[int, ...] = (1 << 16, 1 << 20, 1 << 22)
FULL_BATCHES: tuple[int, ...] = (256, 4096, 65536)
QUICK_SIZES: tuple[int, ...] = (1 << 16, 1 << 20)
QUICK_BATCHES: tuple[int, ...] = (256, 4096)
# Distinct pre-generated input batches cycled through per cell, so that input
# generation stays out of the timed region without reusing one batch forever.
INPUT_POOL = 8
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench_tree.md"


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Inputs:
    """Pre-generated update batches in both NumPy and torch form (shared memory)."""

    idx_np: list[np.ndarray]
    prio_np: list[np.ndarray]
    idx_t: list[torch.Tensor]
    prio_t: list[torch.Tensor]


def make_inputs(n: int, b: int, seed: int) -> Inputs:
    rng = np.random.default_rng(seed)
    idx_np = [rng.integers(0, n, size=b, dtype=np.int64) for _ in range(INPUT_POOL)]
    # Bounded away from zero so every leaf stays sampleable.
    prio_np = [rng.uniform(0.05, 2.0, size=b).astype(np.float32) for _ in range(INPUT_POOL)]
    return Inputs(
        idx_np=idx_np,
        prio_np=prio_np,
        idx_t=[torch.from_numpy(a) for a in idx_np],
        prio_t=[torch.from_numpy(a) for a in prio_np],
    )


def initial_priorities(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0.05, 2.0, size=n).astype(np.float32)


# ----------------------------------------------------------------------- contenders


class Contender(ABC):
    """One structure under test, holding N priorities.

    ``update``/``sample_then_update`` take the position ``k`` of a
    pre-generated batch in ``Inputs``; ``sample`` returns the sampled indices
    so that the harness can sanity-check them outside the timed region.
    """

    name: str = ""
    note: str = ""
    inputs: Inputs

    def __init__(self, n: int, prio: np.ndarray, seed: int) -> None:
        self.n = n

    def set_inputs(self, inputs: Inputs) -> None:
        self.inputs = inputs

    @abstractmethod
    def update(self, k: int) -> None: ...

    @abstractmethod
    def sample(self, b: int) -> Any: ...

    def sample_then_update(self, b: int, k: int) -> None:
        idx = self.sample(b)
        self.update_at(idx, k)

    @abstractmethod
    def update_at(self, idx: Any, k: int) -> None:
        """Write the k-th pre-generated priority batch at ``idx`` (as sampled)."""

    @staticmethod
    def as_numpy_indices(idx: Any) -> np.ndarray:
        return idx.numpy() if isinstance(idx, torch.Tensor) else np.asarray(idx)


class TorchReplayTree(Contender):
    name = "torchreplay"
    note = (
        "torchreplay.SegmentTree(dtype=float32) with torch tensors; min tracked internally; "
        "stratified sample(B, generator=g)"
    )

    def __init__(self, n: int, prio: np.ndarray, seed: int) -> None:
        super().__init__(n, prio, seed)
        import torchreplay as tr

        self.tree = tr.SegmentTree(n, dtype=torch.float32)
        self.tree.update(torch.arange(n, dtype=torch.int64), torch.from_numpy(prio))
        self.gen = torch.Generator().manual_seed(seed)

    def update(self, k: int) -> None:
        self.tree.update(self.inputs.idx_t[k], self.inputs.prio_t[k])

    def sample(self, b: int) -> torch.Tensor:
        idx, _prio = self.tree.sample(b, generator=self.gen)
        return idx

    def update_at(self, idx: torch.Tensor, k: int) -> None:
        self.tree.update(idx, self.inputs.prio_t[k][: idx.numel()])


class TorchRLTree(Contender):
    name = "torchrl"
    note = (
        "torchrl._torchrl Sum+MinSegmentTreeFp32 driven with NumPy arrays; sample = "
        "stratified u*total -> scan_lower_bound, then at() for the priorities"
    )

    def __init__(self, n: int, prio: np.ndarray, seed: int) -> None:
        super().__init__(n, prio, seed)
        from torchrl._torchrl import MinSegmentTreeFp32, SumSegmentTreeFp32

        self.sum_tree = SumSegmentTreeFp32(n)
        self.min_tree = MinSegmentTreeFp32(n)
        all_idx = np.arange(n, dtype=np.int64)
        self.sum_tree.update(all_idx, prio)
        self.min_tree.update(all_idx, prio)
        self.rng = np.random.default_rng(seed)
        self.strata: dict[int, np.ndarray] = {}

    def update(self, k: int) -> None:
        self.update_at(self.inputs.idx_np[k], k)

    def update_at(self, idx: np.ndarray, k: int) -> None:
        prio = self.inputs.prio_np[k][: idx.size]
        self.sum_tree.update(idx, prio)
        self.min_tree.update(idx, prio)

    def sample(self, b: int) -> np.ndarray:
        base = self.strata.get(b)
        if base is None:
            base = self.strata[b] = np.arange(b, dtype=np.float32)
        total = np.float32(self.sum_tree.query(0, self.n))
        u = (base + self.rng.random(b, dtype=np.float32)) * (total / np.float32(b))
        idx = self.sum_tree.scan_lower_bound(u)
        # float32 rounding can push u past the total; the tree then answers n.
        np.minimum(idx, self.n - 1, out=idx)
        self.last_prio = self.sum_tree.at(idx)
        return idx


class CpprbBuffer(Contender):
    name = "cpprb"
    note = (
        "cpprb.PrioritizedReplayBuffer(alpha=1, eps=0) with one float32 field; sample(B, beta=0.4) "
        "also gathers that field and computes IS weights; update = update_priorities"
    )

    def __init__(self, n: int, prio: np.ndarray, seed: int) -> None:
        super().__init__(n, prio, seed)
        from cpprb import PrioritizedReplayBuffer

        self.rb = PrioritizedReplayBuffer(n, {"obs": {"shape": 1, "dtype": np.float32}}, alpha=1.0, eps=0.0)
        self.rb.add(obs=np.zeros((n, 1), dtype=np.float32), priorities=prio)

    def update(self, k: int) -> None:
        self.rb.update_priorities(self.inputs.idx_np[k], self.inputs.prio_np[k])

    def update_at(self, idx: np.ndarray, k: int) -> None:
        self.rb.update_priorities(idx, self.inputs.prio_np[k][: idx.size])

    def sample(self, b: int) -> np.ndarray:
        return self.rb.sample(b, beta=0.4)["indexes"]


class NumpySumTree:
    """Sum + min tree in flat arrays (root at 1, leaves at [cap, cap + n)), vectorized per level."""

    def __init__(self, n: int, prio: np.ndarray) -> None:
        self.n = n
        self.cap = 1 << max(0, (n - 1).bit_length())
        self.depth = self.cap.bit_length() - 1
        self.sum = np.zeros(2 * self.cap, dtype=np.float32)
        self.min = np.full(2 * self.cap, np.inf, dtype=np.float32)
        self.sum[self.cap : self.cap + n] = prio
        self.min[self.cap : self.cap + n] = prio
        for level in reversed(range(self.depth)):
            lo, hi = 1 << level, 2 << level
            self.sum[lo:hi] = self.sum[2 * lo : 2 * hi : 2] + self.sum[2 * lo + 1 : 2 * hi : 2]
            self.min[lo:hi] = np.minimum(self.min[2 * lo : 2 * hi : 2], self.min[2 * lo + 1 : 2 * hi : 2])

    def update(self, idx: np.ndarray, prio: np.ndarray) -> None:
        pos = idx.astype(np.int64, copy=False) + self.cap
        self.sum[pos] = prio
        self.min[pos] = prio
        # np.unique sorts once; parents of a sorted array stay sorted, so each
        # further level is deduplicated by comparing neighbours only.
        pos = np.unique(pos)
        for _ in range(self.depth):
            pos >>= 1
            keep = np.empty(pos.size, dtype=bool)
            keep[0] = True
            np.not_equal(pos[1:], pos[:-1], out=keep[1:])
            pos = pos[keep]
            left = pos << 1
            self.sum[pos] = self.sum[left] + self.sum[left + 1]
            self.min[pos] = np.minimum(self.min[left], self.min[left + 1])

    def lower_bound(self, u: np.ndarray) -> np.ndarray:
        """First leaf whose prefix sum reaches u, descending all samples together."""
        pos = np.ones(u.size, dtype=np.int64)
        for _ in range(self.depth):
            pos <<= 1
            left = self.sum[pos]
            go_right = u > left
            u = np.where(go_right, u - left, u)
            pos += go_right
        return np.minimum(pos - self.cap, self.n - 1)


class NumpyTree(Contender):
    name = "numpy_tree"
    note = "vectorized NumPy sum+min tree (this file); update level by level, stratified batched descent"

    def __init__(self, n: int, prio: np.ndarray, seed: int) -> None:
        super().__init__(n, prio, seed)
        self.tree = NumpySumTree(n, prio)
        self.rng = np.random.default_rng(seed)

    def update(self, k: int) -> None:
        self.tree.update(self.inputs.idx_np[k], self.inputs.prio_np[k])

    def update_at(self, idx: np.ndarray, k: int) -> None:
        self.tree.update(idx, self.inputs.prio_np[k][: idx.size])

    def sample(self, b: int) -> np.ndarray:
        total = self.tree.sum[1]
        u = (np.arange(b, dtype=np.float32) + self.rng.random(b, dtype=np.float32)) * (total / np.float32(b))
        idx = self.tree.lower_bound(u)
        self.last_prio = self.tree.sum[idx + self.tree.cap]
        return idx


class TorchMultinomial(Contender):
    name = "torch_multinomial"
    note = "torch.multinomial(p, B, replacement=True) over all N (not stratified); update = index_put_"

    def __init__(self, n: int, prio: np.ndarray, seed: int) -> None:
        super().__init__(n, prio, seed)
        self.prio = torch.from_numpy(prio.copy())
        self.gen = torch.Generator().manual_seed(seed)

    def update(self, k: int) -> None:
        self.prio.index_put_((self.inputs.idx_t[k],), self.inputs.prio_t[k])

    def update_at(self, idx: torch.Tensor, k: int) -> None:
        self.prio.index_put_((idx,), self.inputs.prio_t[k][: idx.numel()])

    def sample(self, b: int) -> torch.Tensor:
        idx = torch.multinomial(self.prio, b, replacement=True, generator=self.gen)
        self.last_prio = self.prio[idx]
        return idx


class TorchSearchsorted(Contender):
    name = "torch_searchsorted"
    note = (
        "float64 cumsum (recomputed on the first sample after any update) + stratified "
        "torch.searchsorted; update = index_put_"
    )

    def __init__(self, n: int, prio: np.ndarray, seed: int) -> None:
        super().__init__(n, prio, seed)
        self.prio = torch.from_numpy(prio.copy())
        self.gen = torch.Generator().manual_seed(seed)
        self.cdf: torch.Tensor | None = None

    def update(self, k: int) -> None:
        self.prio.index_put_((self.inputs.idx_t[k],), self.inputs.prio_t[k])
        self.cdf = None

    def update_at(self, idx: torch.Tensor, k: int) -> None:
        self.prio.index_put_((idx,), self.inputs.prio_t[k][: idx.numel()])
        self.cdf = None

    def sample(self, b: int) -> torch.Tensor:
        if self.cdf is None:
            # float64 so the prefix sums over millions of leaves keep their resolution.
            self.cdf = torch.cumsum(self.prio, 0, dtype=torch.float64)
        total = self.cdf[-1]
        u = (torch.arange(b, dtype=torch.float64) + torch.rand(b, generator=self.gen, dtype=torch.float64)) * (
            total / b
        )
        idx = torch.searchsorted(self.cdf, u).clamp_max_(self.n - 1)
        self.last_prio = self.prio[idx]
        return idx


CONTENDERS: tuple[type[Contender], ...] = (
    TorchReplayTree,
    TorchRLTree,
    CpprbBuffer,
    NumpyTree,
    TorchMultinomial,
    TorchSearchsorted,
)


def probe(cls: type[Contender]) -> str | None:
    """Build a tiny instance; return why the contender is unusable, or None."""
    try:
        n = 64
        c = cls(n, initial_priorities(n, 0), 0)
        c.set_inputs(make_inputs(n, 8, 0))
        c.update(0)
        c.sample_then_update(8, 1)
        check_indices(c.sample(8), n)
        return None
    except Exception as exc:  # noqa: BLE001 - an unusable peer is skipped, whatever the reason
        first_line = (str(exc).splitlines() or [""])[0]
        hint = ""
        if isinstance(exc, ImportError):
            hint = (
                " (install torchreplay, or run from the repo root with PYTHONPATH=.)"
                if cls is TorchReplayTree
                else " (run benchmarks/setup_peers.sh)"
            )
        return f"{type(exc).__name__}: {first_line}{hint}"


def check_indices(idx: Any, n: int) -> None:
    arr = Contender.as_numpy_indices(idx)
    if arr.size and (arr.min() < 0 or arr.max() >= n):
        raise AssertionError(f"sampled index out of range [0, {n}): {arr.min()}..{arr.max()}")


# -------------------------------------------------------------------------- timing


@dataclass
class Budget:
    """Per-cell limits. A cell's contenders take turns in `rounds` blocks, so each gets about
    min_time / rounds seconds per block: on a shared machine whose speed drifts by 2x within
    minutes, timing one contender for a whole cell and then the next measured the drift as much as
    the contenders, and the ratio of two such cells moved by +-30% between runs."""

    min_time: float = 1.0
    rounds: int = 8
    min_repeats: int = 2  # per block
    max_repeats: int = 20000
    warmup: int = 1  # per block; the cache holds another contender's data when a block starts
    # A single call slower than this gets one repeat per block.
    slow_call: float = 0.4


def measure_block(fn: Callable[[int], None], budget: Budget, first_input: int) -> list[float]:
    """Per-call seconds of one block: warm-up calls, then until min_repeats and the block's time."""
    k = first_input
    warm_start = time.perf_counter()
    for _ in range(budget.warmup):
        fn(k % INPUT_POOL)
        k += 1
    warm_call = (time.perf_counter() - warm_start) / max(1, budget.warmup)
    min_repeats = 1 if warm_call > budget.slow_call else budget.min_repeats
    block_time = budget.min_time / budget.rounds
    times: list[float] = []
    spent = 0.0
    while len(times) < budget.max_repeats and (len(times) < min_repeats or spent < block_time):
        t0 = time.perf_counter()
        fn(k % INPUT_POOL)
        dt = time.perf_counter() - t0
        times.append(dt)
        spent += dt
        k += 1
    return times


def quartiles(times: list[float]) -> tuple[float, float, float]:
    return tuple(statistics.quantiles(times, n=4)) if len(times) > 1 else (times[0],) * 3


def op_call(contender: Contender, op: str, b: int) -> Callable[[int], None]:
    """The timed call for one op; its argument picks the pre-generated input batch."""
    if op == "update":
        return contender.update
    if op == "sample":
        return lambda _k: contender.sample(b)
    return lambda k: contender.sample_then_update(b, k)


# ------------------------------------------------------------------------- results


@dataclass
class Cell:
    n: int
    b: int
    op: str
    contender: str
    mops: float
    median_s: float
    q1_s: float
    q3_s: float
    repeats: int
    # Median seconds per call in each round, in round order: the paired samples of the ratio.
    round_medians_s: list[float] = field(default_factory=list)


def round_ratios(ours: Cell, theirs: Cell) -> list[float]:
    """Per-round speed ratios ours/theirs: both contenders ran in the same round, minutes apart at most."""
    return [t / o for o, t in zip(ours.round_medians_s, theirs.round_medians_s)]


@dataclass
class Report:
    meta: dict[str, Any]
    contenders: dict[str, str]
    skipped: dict[str, str]
    cells: list[Cell] = field(default_factory=list)


def pow2_label(v: int) -> str:
    return f"2^{v.bit_length() - 1}" if v > 0 and v & (v - 1) == 0 else str(v)


def fmt_mops(v: float | None) -> str:
    if v is None:
        return "—"
    return f"{v:.3g}" if v < 100 else f"{v:.0f}"


def render_markdown(report: Report, names: list[str]) -> str:
    by_key: dict[tuple[int, int, str, str], Cell] = {(c.n, c.b, c.op, c.contender): c for c in report.cells}
    keys = sorted({(c.n, c.b, OPS.index(c.op)) for c in report.cells})
    header = ["N", "B", "op", *names, "torchreplay / torchrl", "per-round IQR"]
    lines = [
        "# Segment-tree benchmark (CPU)",
        "",
        "Million ops per second (B ops per call, median over all timed calls); higher is better. The "
        "contenders of a cell take turns in rounds; the ratio is the median of the per-round ratios, "
        "with their interquartile range.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---:"] * 2 + ["---"] + ["---:"] * (len(names) + 2)) + "|",
    ]
    for n, b, op_i in keys:
        op = OPS[op_i]
        vals = [by_key.get((n, b, op, name)) for name in names]
        ours, theirs = by_key.get((n, b, op, "torchreplay")), by_key.get((n, b, op, "torchrl"))
        ratio, spread = "—", "—"
        if ours is not None and theirs is not None:
            ratios = round_ratios(ours, theirs)
            ratio = f"{statistics.median(ratios):.2f}x"
            if len(ratios) > 1:
                q1, _, q3 = statistics.quantiles(ratios, n=4)
                spread = f"{q1:.2f}-{q3:.2f}x"
        row = [pow2_label(n), str(b), op, *(fmt_mops(v.mops if v else None) for v in vals), ratio, spread]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "## Contenders", ""]
    lines += [f"- **{name}**: {note}" for name, note in report.contenders.items()]
    if report.skipped:
        lines += ["", "## Skipped", ""]
        lines += [f"- **{name}**: {why}" for name, why in report.skipped.items()]
    lines += ["", "## Setup", ""]
    lines += [f"- {k}: {v}" for k, v in report.meta.items()]
    lines += [
        "",
        (
            "Notes: `sample_then_update` counts B ops per call (one sample of B plus one update of B). "
            "Tree contenders update a min tree on every write; the torch baselines keep no min. "
            "Inputs: priorities uniform in [0.05, 2), indices uniform in [0, N), fixed seeds."
        ),
        "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- main


def parse_int_list(text: str) -> list[int]:
    """'65536,2^20,1<<22' -> [65536, 1048576, 4194304]."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if "^" in part:
            base, exp = part.split("^", 1)
            out.append(int(base) ** int(exp))
        elif "<<" in part:
            a, s = part.split("<<", 1)
            out.append(int(a) << int(s))
        elif part:
            out.append(int(part))
    if not out or any(v <= 0 for v in out):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="N=2^16,2^20 and B=256,4096")
    p.add_argument("--sizes", type=parse_int_list, help="comma list of N (e.g. 2^16,2^20)")
    p.add_argument("--batches", type=parse_int_list, help="comma list of B (e.g. 256,4096)")
    p.add_argument("--ops", type=lambda s: s.split(","), default=list(OPS), help=f"subset of {','.join(OPS)}")
    p.add_argument(
        "--contenders",
        type=lambda s: s.split(","),
        help="subset of " + ",".join(c.name for c in CONTENDERS),
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="Markdown output (JSON written next to it)")
    p.add_argument(
        "--min-time", type=float, default=Budget.min_time, help="seconds of timed calls per cell and contender"
    )
    p.add_argument(
        "--rounds", type=int, default=Budget.rounds, help="turns the contenders of a cell take (ratio samples)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads; 0 keeps torch's default. The default 1 matches the "
        "single-threaded peers and avoids OpenMP stalls when other processes share the cores",
    )
    args = p.parse_args(argv)
    bad_ops = set(args.ops) - set(OPS)
    if bad_ops:
        p.error(f"unknown ops: {sorted(bad_ops)}")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    known = {c.name for c in CONTENDERS}
    if args.contenders and set(args.contenders) - known:
        p.error(f"unknown contenders: {sorted(set(args.contenders) - known)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = args.sizes or list(QUICK_SIZES if args.quick else FULL_SIZES)
    batches = args.batches or list(QUICK_BATCHES if args.quick else FULL_BATCHES)
    budget = Budget(min_time=args.min_time, rounds=args.rounds)
    selected = [c for c in CONTENDERS if not args.contenders or c.name in args.contenders]

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    load1 = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load1 > 0.5:
        # With other processes on the cores, a multi-threaded torch op can wait
        # a whole scheduler tick for a descheduled worker (ms-sized stalls).
        print(f"[bench_tree] warning: 1-min load average is {load1:.2f}; results may be noisy", file=sys.stderr)

    started = time.perf_counter()
    usable: list[type[Contender]] = []
    skipped: dict[str, str] = {}
    for cls in selected:
        why = probe(cls)
        if why is None:
            usable.append(cls)
        else:
            skipped[cls.name] = why
            print(f"[bench_tree] skipping {cls.name}: {why}", file=sys.stderr)

    report = Report(
        meta={
            "date": _dt.datetime.now().isoformat(timespec="seconds"),
            "cpu": f"{cpu_model()} ({torch.get_num_threads()} torch threads)",
            "python": platform.python_version(),
            "torch": torch.__version__,
            "numpy": np.__version__,
            **peer_versions(),
            "load average at start": f"{load1:.2f}",
            "seed": args.seed,
            "min time per cell and contender (s)": budget.min_time,
            "rounds per cell": budget.rounds,
        },
        contenders={c.name: c.note for c in usable},
        skipped=skipped,
    )

    for n in sizes:
        prio0 = initial_priorities(n, args.seed)
        inputs_by_b = {b: make_inputs(n, b, args.seed + b) for b in batches}
        contenders: list[Contender] = []
        for cls in usable:
            t0 = time.perf_counter()
            contenders.append(cls(n, prio0, args.seed + 1))
            print(
                f"[bench_tree] N={pow2_label(n)} {cls.name}: built in {time.perf_counter() - t0:.2f}s", file=sys.stderr
            )
        for b in batches:
            if b > n:
                continue
            for contender in contenders:
                contender.set_inputs(inputs_by_b[b])
                check_indices(contender.sample(b), n)
            for op in args.ops:
                times: list[list[float]] = [[] for _ in contenders]
                round_medians: list[list[float]] = [[] for _ in contenders]
                for r in range(budget.rounds):
                    # Alternate the order (ABBA...) so neither contender always runs first in a round.
                    order = range(len(contenders)) if r % 2 == 0 else reversed(range(len(contenders)))
                    for i in order:
                        block = measure_block(op_call(contenders[i], op, b), budget, first_input=r)
                        times[i] += block
                        round_medians[i].append(statistics.median(block))
                for contender, cell_times, medians in zip(contenders, times, round_medians):
                    q1, median, q3 = quartiles(cell_times)
                    mops = b / median / 1e6
                    report.cells.append(
                        Cell(n, b, op, contender.name, mops, median, q1, q3, len(cell_times), medians)
                    )
                    print(
                        f"[bench_tree]   B={b:<6} {op:<19} {contender.name:<12} {mops:10.3f} Mops/s "
                        f"({median * 1e3:.3f} ms/call, {len(cell_times)} reps)",
                        file=sys.stderr,
                    )
        del contenders
    report.meta["wall time (s)"] = round(time.perf_counter() - started, 1)

    names = [c.name for c in CONTENDERS if c in selected]
    markdown = render_markdown(report, names)
    print(markdown)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(markdown)
    json_path = args.out.with_suffix(".json")
    json_path.write_text(
        json.dumps(
            {
                "meta": report.meta,
                "contenders": report.contenders,
                "skipped": report.skipped,
                "results": [asdict(c) for c in report.cells],
            },
            indent=2,
        )
        + "\n"
    )
    print(f"[bench_tree] wrote {args.out} and {json_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
