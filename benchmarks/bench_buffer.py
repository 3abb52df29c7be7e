#!/usr/bin/env python3
"""Per-step cost of torchreplay's RolloutBuffer next to TorchRL, on realistic LLM rollouts.

One RL step of a GRPO-style trainer, on the CPU, for each contender:

* ``add``: store the step's fresh rollouts (default 8192: 512 prompts x group 16). Each rollout
  is a 1024-token prompt plus a response whose length is lognormal with mean 4000 tokens and
  coefficient of variation 1, capped at 16000. Per token: ``tokens`` int64, ``logprobs`` float32,
  ``response_mask`` bool (13 B/token, ~66 KB per rollout, ~0.54 GB per step).
* ``sample+update``: draw a training batch of B rollouts (default B = rollouts per step), get it
  as padded [B, T] tensors (tokens, logprobs, response_mask, attention_mask) with IS weights,
  then write B new priorities (and, for torchreplay, ``advance`` the policy version).

Contenders (each in its own child process; they take turns, see below):

* **torchreplay**: ``RolloutBuffer(capacity, PrioritizedSampler(alpha, beta, eps))``, hot-only
  storage; ``add`` gets the fast ragged form ``{"values": flat, "offsets": [n+1]}``;
  ``sample(B)`` returns the padded batch; ``update_priorities(handles, A)``; ``advance(v)``.
* **torchrl**: ``TensorDictReplayBuffer(storage=LazyStackStorage(capacity),
  sampler=PrioritizedSampler(capacity, alpha, beta, eps))``. LazyStackStorage (a list of
  per-rollout TensorDicts, sampled as a LazyStackedTensorDict) is what TorchRL's own LLM recipes
  use for ragged rollouts. A padded LazyTensorStorage would need capacity x 17k x 13 B (~15 GB at
  64k slots), far over this machine's RAM. ``add`` = building the per-rollout TensorDicts from
  the same flat tensors (zero-copy views) + ``extend``; ``sample+update`` = ``sample(B)`` +
  padding the three token fields with ``LazyStackedTensorDict.get(key, as_padded_tensor=True)``
  (the same [B, T] tensors torchreplay returns) + ``update_priority(index, |A|)``.

Both use the same capacity, the same data, priorities (|A| + eps) ** alpha, FIFO overwrite when
full. The buffers are first filled to capacity (add only, one contender at a time). Then come
``--steps`` rounds: in each, every contender times one full step, in alternating order (AB, BA,
...), as bench_tree.py's contenders take turns. Run one after the other, the contenders met
different machines (on a shared machine the speed drifts by 2x within minutes: three sequential
runs gave TorchRL ratios of 2.1x, 2.8x and 6.5x); within a round they meet the same one. Reported:
median seconds per step for each part; the torchreplay / torchrl ratio as the median of the
per-round ratios, with their IQR and range; each contender's share of a ``--step-seconds`` (30 s)
RL step (target for torchreplay: at most 1%), median over rounds with IQR and range.

Capacity: 1M slots would need 1M x ~66 KB = ~66 GB; the default is the largest power of two
whose rollout bytes fit in each contender's share of 40% of the RAM left after the sampled
batches and step data (the contenders' buffers are alive together; stated in the output), capped
at 1M. Override with --capacity.

    python benchmarks/bench_buffer.py            # 8192 rollouts/step, B=8192 (~5-8 min on 2 cores)
    python benchmarks/bench_buffer.py --quick    # 1024 rollouts/step, B=1024, capacity 8192
    python benchmarks/bench_buffer.py --dapo --contenders torchreplay --capacity 32768 --steps 16
                                                 # issue 28: packed sample vs the ragged copy floor

With the packed layout (default; --no-packed skips it), torchreplay's step also draws the same
batch with layout="packed" and times a bare copy of that draw's ragged token bytes (the floor),
reported as per-round ratios: the packed sample's and the padded one's to the floor, and the
share of a --step-seconds step with packed output (add + packed sample + update + advance).

Run TorchRL from a venv that has it (built as docs/benchmarks.md says, with benchmarks/setup_peers.sh):
    PYTHONPATH=. $BENCH_PY benchmarks/bench_buffer.py --quick
"""

from __future__ import annotations

import argparse
import datetime as _dt
import inspect
import json
import math
import os
import platform
import resource
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _machine import cpu_model, package_versions


def peer_versions() -> dict[str, str]:
    return package_versions(("torchreplay", "torchrl", "tensordict"))


DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench_buffer.md"
CONTENDERS = ("torchreplay", "torchrl")
BYTES_PER_TOKEN = 8 + 4 + 1  # tokens int64 + logprobs float32 + response_mask bool
MAX_CAPACITY = 1 << 20
VOCAB = 151_000


# --------------------------------------------------------------------------- data


class RolloutSource:
    """Fresh rollouts per step, as a generator would hand them over: flat token tensors + offsets.

    Random pools are generated once; each step slices and clones them (outside the timed region),
    so every step's tensors are new memory that the buffers must hold on their own.
    """

    def __init__(self, cfg: dict[str, Any], seed: int) -> None:
        self.n = cfg["rollouts_per_step"]
        self.prompt = cfg["prompt_len"]
        self.max_resp = cfg["max_response"]
        self.group = cfg["group"]
        self.gen = torch.Generator().manual_seed(seed)
        cv = cfg["response_cv"]
        self.sigma = math.sqrt(math.log1p(cv * cv))
        self.mu = math.log(cfg["mean_response"]) - self.sigma**2 / 2
        mean_len = self.prompt + cfg["mean_response"]
        pool = int(self.n * mean_len * 1.25) + self.prompt + self.max_resp
        self.tok_pool = torch.randint(0, VOCAB, (pool,), generator=self.gen)
        self.lp_pool = -torch.rand(pool, generator=self.gen) * 5
        self.step = 0

    def lengths(self) -> torch.Tensor:
        while True:
            resp = torch.exp(self.mu + self.sigma * torch.randn(self.n, generator=self.gen))
            resp = resp.round().clamp_(1, self.max_resp).long()
            total = int(resp.sum()) + self.n * self.prompt
            if total <= self.tok_pool.numel():
                return resp + self.prompt

    def next(self) -> dict[str, Any]:
        n, lengths = self.n, self.lengths()
        offsets = torch.zeros(n + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        total = int(offsets[-1])
        shift = torch.randint(0, self.tok_pool.numel() - total + 1, (1,), generator=self.gen).item()
        tokens = self.tok_pool[shift : shift + total].clone()
        logprobs = self.lp_pool[shift : shift + total].clone()
        pos = torch.arange(total) - torch.repeat_interleave(offsets[:-1], lengths)
        response_mask = pos >= self.prompt
        logprobs.masked_fill_(~response_mask, 0.0)
        reward = (torch.rand(n, generator=self.gen) < 0.4).float()
        groups = reward.view(-1, self.group)
        advantage = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6)).reshape(-1)
        advantage += 0.01 * torch.randn(n, generator=self.gen)  # no exact ties at zero
        out = {
            "offsets": offsets,
            "lengths": lengths,
            "tokens": tokens,
            "logprobs": logprobs,
            "response_mask": response_mask,
            "prompt_len": torch.full((n,), self.prompt, dtype=torch.int64),
            "reward": reward,
            "advantage": advantage,
            "group_id": torch.arange(n, dtype=torch.int64) // self.group + self.step * (n // self.group),
            "policy_version": self.step,
        }
        self.step += 1
        return out


def new_advantages(b: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(b, generator=gen)


# ----------------------------------------------------------------------- contenders


class TorchReplayContender:
    name = "torchreplay"

    def __init__(self, cfg: dict[str, Any]) -> None:
        import torchreplay as tr

        self.tr = tr
        self.buf = tr.RolloutBuffer(
            cfg["capacity"],
            sampler=tr.PrioritizedSampler(alpha=cfg["alpha"], beta=cfg["beta"], eps=cfg["eps"]),
            max_staleness=None,
            overflow="evict_oldest",
            seed=cfg["seed"],
            token_dtype=getattr(torch, cfg.get("token_dtype", "int64")),
        )
        self.gen = torch.Generator().manual_seed(cfg["seed"] + 7)
        self.reuse_output = cfg.get("reuse_output", True)
        # The packed layout (issue 28) where this tree has it (a --baseline-tree may not).
        self.packed = cfg.get("packed", True) and "layout" in inspect.signature(self.buf.sample).parameters
        self.floor_out: dict[str, torch.Tensor] = {}
        self.calls = 0
        self.note = (
            f"torchreplay.RolloutBuffer({cfg['capacity']}, PrioritizedSampler(alpha={cfg['alpha']}, "
            f"beta={cfg['beta']}, eps={cfg['eps']})), hot-only storage, overflow='evict_oldest'; "
            "add({'values', 'offsets'}) ragged fast path; "
            f"token_dtype={cfg.get('token_dtype', 'int64')}; "
            f"sample(B, reuse_output={cfg.get('reuse_output', True)}) -> padded ReplayBatch; "
            + ("the same draw again with layout='packed' -> PackedReplayBatch, and a bare copy of its "
               "ragged token bytes (the floor); " if self.packed else "")
            + "update_priorities(handles, A); advance(v)"
        )

    def add(self, d: dict[str, Any]) -> dict[str, float]:
        off = d["offsets"]
        batch = {
            "tokens": {"values": d["tokens"], "offsets": off},
            "logprobs": {"values": d["logprobs"], "offsets": off},
            "response_mask": {"values": d["response_mask"], "offsets": off},
            "prompt_len": d["prompt_len"],
            "reward": d["reward"],
            "advantage": d["advantage"],
            "group_id": d["group_id"],
            "policy_version": d["policy_version"],
        }
        t0 = time.perf_counter()
        self.buf.add(batch)
        added = time.perf_counter() - t0
        # `add` copies the caller's tensors once, into the packed shard (the caller may reuse them
        # at once). Its floor: a bare copy of the same token bytes into fresh memory, timed here.
        t0 = time.perf_counter()
        copies = [torch.empty_like(d[k]).copy_(d[k]) for k in ("tokens", "logprobs", "response_mask")]
        floor = time.perf_counter() - t0
        del copies
        return {"add": added, "add_copy_floor": floor}

    def sample_update(self, b: int, version: int, adv: torch.Tensor) -> tuple[dict[str, float], Any]:
        if self.packed:
            return self.sample_both_layouts(b, version, adv)
        t0 = time.perf_counter()
        batch = self.buf.sample(b, generator=self.gen, reuse_output=self.reuse_output)
        t1 = time.perf_counter()
        self.buf.update_priorities(batch.handles, adv)
        t2 = time.perf_counter()
        self.buf.advance(version)
        t3 = time.perf_counter()
        shape = tuple(batch.tokens.shape)
        return {"sample": t1 - t0, "update": t2 - t1, "advance": t3 - t2}, (batch, shape)

    def sample_both_layouts(self, b: int, version: int, adv: torch.Tensor) -> tuple[dict[str, float], Any]:
        """The same draw (the generator's state put back in between) as a padded and as a packed
        batch, and the floor for the packed one: a bare copy of the same ragged token bytes into warm
        memory (outputs are reused across steps as `reuse_output` makes them). The floor sits between
        the two samples, which alternate around it from step to step (padded, floor, packed; then
        packed, floor, padded), so drift lands on both ratios alike."""
        state = self.gen.get_state()
        order = ("padded", "floor", "packed") if self.calls % 2 == 0 else ("packed", "floor", "padded")
        self.calls += 1
        times: dict[str, float] = {}
        ragged = batch = None
        for part in order:
            if part == "floor":
                outputs = [self.floor_output(name, values) for name, values in ragged.items()]  # not timed
                t0 = time.perf_counter()
                for out, values in zip(outputs, ragged.values()):
                    out.copy_(values)
                times["ragged_floor"] = time.perf_counter() - t0
                continue
            self.gen.set_state(state)
            t0 = time.perf_counter()
            out = self.buf.sample(b, generator=self.gen, reuse_output=self.reuse_output, layout=part)
            times["sample" if part == "padded" else "sample_packed"] = time.perf_counter() - t0
            if ragged is None:  # the floor's source: the draw's ragged bytes (not timed)
                fields = ("tokens", "logprobs", "response_mask")
                ragged = ({k: out.data[k] for k in fields} if part == "packed"
                          else {k: out.data[k][out.attention_mask] for k in fields})
            if part == "padded":
                shape = tuple(out.tokens.shape)
            else:
                batch = out
        times["packed_tokens"] = batch.num_tokens
        times["ragged_bytes"] = sum(v.numel() * v.element_size() for v in ragged.values())
        t0 = time.perf_counter()
        self.buf.update_priorities(batch.handles, adv)
        t1 = time.perf_counter()
        self.buf.advance(version)
        t2 = time.perf_counter()
        times.update(update=t1 - t0, advance=t2 - t1)
        return times, (batch, shape)

    def warm_up(self, b: int) -> None:
        """After the fill, not timed: one draw in each layout and the floor's destinations, so the
        rounds measure reused outputs as a training loop meets them after its first step (an output
        still grows when a later draw holds more tokens than any before, and that is timed)."""
        if not self.packed:
            return
        gen = torch.Generator().manual_seed(12345)
        for layout in ("padded", "packed"):
            batch = self.buf.sample(b, generator=gen, reuse_output=self.reuse_output, layout=layout)
        for name in ("tokens", "logprobs", "response_mask"):
            self.floor_output(name, batch.data[name])

    def floor_output(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """A warm destination for the floor's copy of `like` (grown when a draw holds more tokens)."""
        out = self.floor_out.get(name)
        if out is None or out.numel() < like.numel():
            out = self.floor_out[name] = torch.empty(int(like.numel() * 1.1), dtype=like.dtype)
            out.fill_(0)  # fault its pages in now, as reuse_output's arenas are after their first use
        return out[: like.numel()].view(like.shape)

    def advance_only(self, version: int) -> None:
        self.buf.advance(version)

    def size(self) -> int:
        return len(self.buf)


class TorchRLContender:
    name = "torchrl"

    def __init__(self, cfg: dict[str, Any]) -> None:
        from tensordict import TensorDict, lazy_stack
        from torchrl.data import LazyStackStorage, TensorDictReplayBuffer
        from torchrl.data.replay_buffers.samplers import PrioritizedSampler

        self.TensorDict, self.lazy_stack = TensorDict, lazy_stack
        cap = cfg["capacity"]
        self.rb = TensorDictReplayBuffer(
            storage=LazyStackStorage(cap),
            sampler=PrioritizedSampler(cap, alpha=cfg["alpha"], beta=cfg["beta"], eps=cfg["eps"]),
            priority_key="priority",
        )
        torch.manual_seed(cfg["seed"] + 7)  # TorchRL's sampler draws from the global generator
        self.note = (
            f"torchrl.data.TensorDictReplayBuffer(storage=LazyStackStorage({cap}), "
            f"sampler=PrioritizedSampler({cap}, alpha={cfg['alpha']}, beta={cfg['beta']}, eps={cfg['eps']}), "
            "priority_key='priority'); add = per-rollout TensorDicts of zero-copy views of the flat tensors, "
            "lazy_stack, set advantage/priority=|A|, extend; sample(B) then "
            "get(key, as_padded_tensor=True) for tokens/logprobs/response_mask + attention_mask from lengths; "
            "update_priority(index, |A|)"
        )

    def add(self, d: dict[str, Any]) -> dict[str, float]:
        t0 = time.perf_counter()
        lens = d["lengths"].tolist()
        td_cls = self.TensorDict
        tds = [
            td_cls(tokens=t, logprobs=lp, response_mask=m, batch_size=[])
            for t, lp, m in zip(d["tokens"].split(lens), d["logprobs"].split(lens), d["response_mask"].split(lens))
        ]
        stacked = self.lazy_stack(tds)
        stacked.set("advantage", d["advantage"])
        stacked.set("reward", d["reward"])
        stacked.set("group_id", d["group_id"])
        stacked.set("prompt_len", d["prompt_len"])
        stacked.set("policy_version", torch.full_like(d["group_id"], d["policy_version"]))
        stacked.set("priority", d["advantage"].abs())
        t1 = time.perf_counter()
        self.rb.extend(stacked)
        t2 = time.perf_counter()
        return {"add": t2 - t0, "build": t1 - t0, "extend": t2 - t1}

    def sample_update(self, b: int, version: int, adv: torch.Tensor) -> tuple[dict[str, float], Any]:
        t0 = time.perf_counter()
        s = self.rb.sample(b)
        t1 = time.perf_counter()
        out = {
            k: s.get(k, as_padded_tensor=True, padding_side="right", padding_value=0)
            for k in ("tokens", "logprobs", "response_mask")
        }
        lengths = torch.tensor([td.get("tokens").shape[0] for td in s.tensordicts], dtype=torch.int64)
        out["attention_mask"] = torch.arange(out["tokens"].shape[1])[None, :] < lengths[:, None]
        out["weights"] = s.get("priority_weight")
        index = s.get("index")
        t2 = time.perf_counter()
        self.rb.update_priority(index, adv.abs())
        t3 = time.perf_counter()
        shape = tuple(out["tokens"].shape)
        return {"sample": t1 - t0, "pad": t2 - t1, "update": t3 - t2}, (out, shape)

    def advance_only(self, version: int) -> None:
        pass

    def size(self) -> int:
        return len(self.rb)


# "torchreplay@base" is the same contender code run against another source tree of torchreplay
# (--baseline-tree: a checkout of an older commit with its extension built in place), so that a
# refactoring is measured against the code it replaced, in the same run.
BASELINE = "torchreplay@base"
CONTENDER_CLASSES = {"torchreplay": TorchReplayContender, "torchrl": TorchRLContender,
                     BASELINE: TorchReplayContender}


# ------------------------------------------------------------------------- worker


class Worker:
    """One contender in its own process: `fill` to capacity (add only), then one timed `step` per
    round on the parent's word, then a `summary`."""

    def __init__(self, name: str, cfg: dict[str, Any]) -> None:
        if cfg["threads"] > 0:
            torch.set_num_threads(cfg["threads"])
        self.name, self.cfg = name, cfg
        self.load_start = os.getloadavg()[0]
        self.contender = CONTENDER_CLASSES[name](cfg)
        self.src = RolloutSource(cfg, cfg["seed"])
        self.adv_gen = torch.Generator().manual_seed(cfg["seed"] + 11)
        self.fill_records: list[dict[str, float]] = []
        self.shape: tuple[int, ...] = ()
        self.started = time.perf_counter()

    def fill(self) -> dict[str, Any]:
        fill_steps = max(1, -(-self.cfg["capacity"] // self.cfg["rollouts_per_step"]))
        for _ in range(fill_steps):
            d = self.src.next()
            self.fill_records.append(self.contender.add(d))
            self.contender.advance_only(self.src.step)
            del d
            print(f"[bench_buffer:{self.name}] fill step {self.src.step}: add {self.fill_records[-1]['add']:.3f}s, "
                  f"size {self.contender.size()}", file=sys.stderr, flush=True)
        warm_up = getattr(self.contender, "warm_up", None)
        if warm_up is not None:
            warm_up(self.cfg["batch_size"])
        return {"size": self.contender.size()}

    def step(self) -> dict[str, float]:
        d = self.src.next()
        rec = self.contender.add(d)
        del d
        adv = new_advantages(self.cfg["batch_size"], self.adv_gen)
        times, (batch, self.shape) = self.contender.sample_update(self.cfg["batch_size"], self.src.step, adv)
        del batch  # freeing the padded batch is not timed
        rec.update(times)
        # The packed run's extra parts (its sample, the floor, sizes) are reported on their own.
        packed_parts = ("sample_packed", "ragged_floor", "packed_tokens", "ragged_bytes")
        rec["sample_update"] = sum(v for k, v in times.items() if k not in packed_parts)
        rec["total"] = rec["add"] + rec["sample_update"]  # the copy floor is a reference, not a cost
        if "sample_packed" in times:
            rec["total_packed"] = rec["add"] + times["sample_packed"] + times["update"] + times["advance"]
        rec["load"] = os.getloadavg()[0]
        print(f"[bench_buffer:{self.name}] step {self.src.step}: "
              + ", ".join(f"{k} {int(v)}" if k in packed_parts[2:] else f"{k} {v:.3f}s" for k, v in rec.items())
              + f"; batch {list(self.shape)}", file=sys.stderr, flush=True)
        return rec

    def summary(self) -> dict[str, Any]:
        source = sys.modules["torchreplay"].__file__ if "torchreplay" in sys.modules else None
        return {
            "name": self.name,
            "note": self.contender.note + (f" (torchreplay from {os.path.dirname(source)})" if source else ""),
            "fill": self.fill_records,
            "batch_shape": list(self.shape),
            "size": self.contender.size(),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "load_start": self.load_start,
            "load_end": os.getloadavg()[0],
            "wall_s": time.perf_counter() - self.started,
        }


def serve(name: str, cfg: dict[str, Any]) -> None:
    """The child's loop: one JSON command per stdin line ("fill", "step", "summary"), one JSON
    answer per stdout line ({"error": ...} if the command failed)."""
    worker = None
    for line in sys.stdin:
        command = line.strip()
        try:
            if worker is None:
                worker = Worker(name, cfg)
            answer = getattr(worker, command)()
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which skips the contender
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)
        if command == "summary":
            return


class WorkerProcess:
    """The parent's handle on one contender's child process."""

    def __init__(self, name: str, cfg: dict[str, Any]) -> None:
        self.name = name
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--worker-config", json.dumps(cfg)]
        env = dict(os.environ)
        if name == BASELINE:  # the baseline tree's torchreplay comes first on the path
            env["PYTHONPATH"] = os.pathsep.join(p for p in (cfg["baseline_tree"], env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, text=True,
                                     env=env)

    def ask(self, command: str, timeout: float) -> dict[str, Any]:
        """Send one command and wait for its answer; {'error': ...} on failure or timeout."""
        try:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            return {"error": f"worker gone: {exc}"}
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            return {"error": f"no answer to {command!r} within {timeout:.0f}s (exit code {self.proc.poll()})"}
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def probe(name: str, cfg: dict[str, Any] | None = None) -> str | None:
    """Why a contender cannot run here (import failure), or None."""
    if name == BASELINE:
        tree = (cfg or {}).get("baseline_tree")
        if not tree:
            return "no --baseline-tree given"
        code = "import torchreplay, sys; sys.exit(0 if torchreplay.__file__.startswith(sys.argv[1]) else 1)"
        env = {**os.environ, "PYTHONPATH": tree}
        # cwd=tree: `python -c` puts the working directory first on the path, as a worker's script dir is.
        result = subprocess.run([sys.executable, "-c", code, os.path.abspath(tree)], env=env, capture_output=True,
                                text=True, cwd=tree)
        return None if result.returncode == 0 else (
            f"torchreplay from {tree} does not import: {(result.stderr.strip().splitlines() or ['?'])[-1]} "
            "(build it there: python setup.py build_ext --inplace)")
    try:
        if name == "torchreplay":
            import torchreplay  # noqa: F401
        else:
            import tensordict  # noqa: F401
            from torchrl.data import LazyStackStorage, TensorDictReplayBuffer  # noqa: F401
            from torchrl.data.replay_buffers.samplers import PrioritizedSampler  # noqa: F401
        return None
    except Exception as exc:  # noqa: BLE001 - an unusable peer is skipped, whatever the reason
        first = (str(exc).splitlines() or [""])[0]
        hint = (
            " (run from the repo root with PYTHONPATH=.)"
            if name == "torchreplay"
            else " (run benchmarks/setup_peers.sh and use that venv)"
        )
        return f"{type(exc).__name__}: {first}{hint}"


# --------------------------------------------------------------------- capacity


def mem_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def auto_capacity(cfg: dict[str, Any], contenders: int = 1) -> tuple[int, str]:
    mean_len = cfg["prompt_len"] + cfg["mean_response"]
    width = cfg["prompt_len"] + cfg["max_response"]
    per_rollout = mean_len * BYTES_PER_TOKEN
    step_bytes = cfg["rollouts_per_step"] * per_rollout
    # Padded batch (tokens, logprobs, response_mask, attention_mask) and about as much again in
    # temporaries while it is built.
    sample_bytes = 2 * cfg["batch_size"] * width * (BYTES_PER_TOKEN + 1)
    avail = mem_available()
    # The contenders run side by side (they take turns in rounds): each gets its share.
    budget = 0.4 * max(0, avail - contenders * (sample_bytes + 3 * step_bytes)) / contenders
    cap = MAX_CAPACITY
    while cap > cfg["rollouts_per_step"] and cap * per_rollout > budget:
        cap //= 2
    cap = max(cap, cfg["rollouts_per_step"])
    why = (
        f"1M slots x {mean_len} tokens x {BYTES_PER_TOKEN} B = {MAX_CAPACITY * per_rollout / 1e9:.0f} GB does not fit; "
        f"MemAvailable {avail / 2**30:.1f} GiB minus a sampled batch (~{sample_bytes / 2**30:.1f} GiB with "
        f"temporaries) and 3 steps of data ({3 * step_bytes / 2**30:.1f} GiB) per contender, 40% of the rest "
        f"shared by {contenders} contender(s) running side by side ({budget / 2**30:.1f} GiB each) holds {cap} "
        f"slots ({cap * per_rollout / 2**30:.1f} GiB of rollouts)"
    )
    return cap, why


# ------------------------------------------------------------------------ report


def med(records: list[dict[str, float]], key: str) -> float | None:
    vals = [r[key] for r in records if key in r]
    return statistics.median(vals) if vals else None


def fmt_s(v: float | None) -> str:
    if v is None:
        return "—"
    return f"{v:.4f}" if v < 0.1 else f"{v:.3f}"


def per_round(a: list[dict[str, float]], key_a: str, b: list[dict[str, float]] | None = None,
              key_b: str | None = None) -> list[float]:
    """Per round: a's value (or a's / b's, both measured in that round)."""
    if b is None:
        return [r[key_a] for r in a if key_a in r]
    return [x[key_a] / y[key_b] for x, y in zip(a, b) if key_a in x and y.get(key_b)]


def spread(values: list[float], fmt: str = "{:.2f}") -> tuple[str, str, str]:
    """(median, IQR, min-max) of per-round values, formatted."""
    if not values:
        return "—", "—", "—"
    f = fmt.format
    q1, _, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (values[0],) * 3
    return f(statistics.median(values)), f"{f(q1)}-{f(q3)}", f"{f(min(values))}-{f(max(values))}"


def packed_section(steps: list[dict[str, float]], step_s: float) -> list[str]:
    """The packed layout (issue 28 item 5): the packed sample and the padded one against the floor
    measured in the same rounds, and the buffer's share of an RL step with packed output."""
    ragged_gb, tokens = med(steps, "ragged_bytes") / 1e9, med(steps, "packed_tokens")
    lines = ["", "## Packed layout: sample against the ragged copy floor", "",
             f"The same draw (B rows, median {tokens / 1e6:.1f} M tokens, {ragged_gb:.2f} GB of ragged token "
             "bytes) as a packed batch (`layout=\"packed\"`: flat tokens, logprobs, response_mask, plus "
             "cu_seqlens; position_ids are derived when a trainer first reads them) and as a padded one, and the floor: a bare copy of the same ragged "
             "bytes into warm memory, timed between the two samples (which alternate around it). Ratios: "
             "median of the per-round ratios to that round's floor.", "",
             "| per step | seconds (median) | / ragged copy floor | ratio IQR | ratio min-max |",
             "|---|---:|---:|---:|---:|"]
    for label, key in (("ragged copy floor", "ragged_floor"), ("sample, layout=\"packed\"", "sample_packed"),
                       ("sample, layout=\"padded\"", "sample")):
        ratio = spread(per_round(steps, key, steps, "ragged_floor"))
        lines.append(f"| {label} | {fmt_s(med(steps, key))} | {ratio[0]}x | {ratio[1]}x | {ratio[2]}x |")
    packed_ratio = statistics.median(per_round(steps, "sample_packed", steps, "ragged_floor"))
    share = spread([100 * v / step_s for v in per_round(steps, "total_packed")], "{:.3f}")
    lines += ["", f"Packed sample within 2x of the floor: {'met' if packed_ratio <= 2 else '**not met**'} "
              f"({packed_ratio:.2f}x).", "",
              f"**torchreplay's share of a {step_s:.0f} s RL step with packed output (add + packed sample + "
              f"update + advance): {share[0]}%** (median over rounds; IQR {share[1]}%, range {share[2]}%); "
              f"target <= 0.5%: {'met' if float(share[0]) <= 0.5 else '**not met**'}."]
    return lines


def render_markdown(report: dict[str, Any]) -> str:
    res = report["results"]
    tr_, rl = res.get("torchreplay"), res.get("torchrl")
    step_s = report["meta"]["RL step (s)"]
    rounds = report["config"]["steps"]
    if rl:
        for r in rl["steps"]:
            r["sample_padded"] = r["sample"] + r["pad"]
    rows = [
        ("add (s)", "add", "add"),
        ("sample to a padded batch (s)", "sample", "sample_padded"),
        ("update priorities (s)", "update", "update"),
        ("advance (s)", "advance", None),
        ("**sample + update** (s)", "sample_update", "sample_update"),
        ("**add + sample + update** (s)", "total", "total"),
    ]
    lines = [
        "# Replay-buffer step benchmark (CPU)",
        "",
        f"Median seconds per RL step over {rounds} rounds at a full buffer (lower is better). The "
        "contenders run side by side, each in its own process, and take turns: one timed step each per "
        "round, in alternating order, so each round gives one paired ratio; the ratio column is the "
        "median of the per-round ratios (< 1: torchreplay is faster), with their IQR and range.",
        "",
        "| per step | torchreplay | torchrl | torchreplay / torchrl | ratio IQR | ratio min-max |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, k_tr, k_rl in rows:
        a = med(tr_["steps"], k_tr) if tr_ and k_tr else None
        b = med(rl["steps"], k_rl) if rl and k_rl else None
        ratio = spread(per_round(tr_["steps"], k_tr, rl["steps"], k_rl)) if tr_ and rl and k_tr and k_rl else None
        ratio_cells = [f"{ratio[0]}x", f"{ratio[1]}x", f"{ratio[2]}x"] if ratio and ratio[0] != "—" else ["—"] * 3
        lines.append(f"| {label} | {fmt_s(a)} | {fmt_s(b)} | " + " | ".join(ratio_cells) + " |")
    if rl:
        lines += [
            "",
            f"TorchRL breakdown: add = build TensorDicts {fmt_s(med(rl['steps'], 'build'))} s + extend "
            f"{fmt_s(med(rl['steps'], 'extend'))} s; sample to a padded batch = sample (lazy stack) "
            f"{fmt_s(med(rl['steps'], 'sample'))} s + padding {fmt_s(med(rl['steps'], 'pad'))} s.",
        ]
    for name, r in ((n, x) for n, x in (("torchreplay", tr_), ("torchrl", rl)) if x):
        share = spread([100 * v / step_s for v in per_round(r["steps"], "total")])
        lines += ["", f"**{name}'s share of a {step_s:.0f} s RL step: {share[0]}%** (median over rounds; "
                  f"IQR {share[1]}%, range {share[2]}%)" + (
                      f"; target <= 1%: {'met' if float(share[0]) <= 1 else '**not met**'}." if name == "torchreplay"
                      else ".")]
    if tr_ and med(tr_["steps"], "sample_packed"):
        lines += packed_section(tr_["steps"], step_s)
    base = res.get(BASELINE)
    if tr_ and base:
        lines += ["", f"## torchreplay against {BASELINE} ({report['config'].get('baseline_tree')})", "",
                  "The same contender code on another source tree, in the same rounds: per-round ratio "
                  "torchreplay / baseline (1.00x: the same; < 1: this tree is faster).", "",
                  "| per step | torchreplay | baseline | ratio (median) | ratio IQR | ratio min-max |",
                  "|---|---:|---:|---:|---:|---:|"]
        for label, key in (("add (s)", "add"), ("sample + update (s)", "sample_update"),
                           ("add + sample + update (s)", "total")):
            ratio = spread(per_round(tr_["steps"], key, base["steps"], key))
            lines.append(f"| {label} | {fmt_s(med(tr_['steps'], key))} | {fmt_s(med(base['steps'], key))} | "
                         f"{ratio[0]}x | {ratio[1]}x | {ratio[2]}x |")
    if tr_ and med(tr_["steps"], "add_copy_floor"):
        copy = spread(per_round(tr_["steps"], "add", tr_["steps"], "add_copy_floor"))
        lines += [
            "",
            f"torchreplay's add copies the step's token bytes once, into its shard: add "
            f"{fmt_s(med(tr_['steps'], 'add'))} s against {fmt_s(med(tr_['steps'], 'add_copy_floor'))} s for a bare "
            f"copy of the same bytes into fresh memory, timed right after it (add / copy per round: median "
            f"{copy[0]}x, IQR {copy[1]}x, range {copy[2]}x).",
        ]
    lines += ["", "## Per contender", ""]
    lines += ["| contender | fill add (s, median) | first add (s) | batch shape | size | peak RSS (GiB) | wall (s) |",
              "|---|---:|---:|---|---:|---:|---:|"]
    for name, r in res.items():
        lines.append(
            f"| {name} | {fmt_s(med(r['fill'], 'add'))} | {fmt_s(r['fill'][0]['add'])} | {r['batch_shape']} | "
            f"{r['size']} | {r['peak_rss_bytes'] / 2**30:.2f} | {r['wall_s']:.0f} |"
        )
    lines += ["", "## Per round (seconds; load average at the end of each step)", ""]
    names = list(res)
    lines += ["| round | " + " | ".join(f"{n} total | {n} load" for n in names) + " |",
              "|---:|" + "---:|---:|" * len(names)]
    for i in range(rounds):
        cells = []
        for n in names:
            steps = res[n]["steps"]
            cells += [fmt_s(steps[i]["total"]), f"{steps[i]['load']:.2f}"] if i < len(steps) else ["—", "—"]
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    lines += ["", "## Contenders", ""]
    lines += [f"- **{name}**: {r['note']}" for name, r in res.items()]
    if report["skipped"]:
        lines += ["", "## Skipped", ""]
        lines += [f"- **{name}**: {why}" for name, why in report["skipped"].items()]
    lines += ["", "## Setup", ""]
    lines += [f"- {k}: {v}" for k, v in report["meta"].items()]
    lines += [
        "",
        (
            "Notes: each contender runs in its own child process, all alive together; they take turns, "
            "one step each per round (order AB, BA, ...). Fresh tensors each step (cloned from random pools "
            "outside the timed region). Each buffer is first filled to capacity with add-only steps ('fill', "
            "one contender at a time); timed steps then evict the oldest rollouts. torchreplay's "
            "sample+update includes advance(); TorchRL has no equivalent. The padded batch is freed outside "
            "the timed region. With the packed measurements, torchreplay draws once in each layout after "
            "the fill (not timed), so the rounds meet its reused outputs warm, as a training loop does "
            "after its first step."
        ),
        "",
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1024 rollouts/step, B=1024, capacity <= 8192")
    p.add_argument("--dapo", action="store_true",
                   help="DAPO scale (issue 28): 8192 rollouts/step of a 1024-token prompt + lognormal response "
                   "(mean 2048, CV 1, cap 10240), ~40 KB ragged each, padded batches ~1.3 GB")
    p.add_argument("--no-packed", action="store_true",
                   help="skip the packed-layout measurements (the same draw with layout='packed' and the floor)")
    p.add_argument("--rollouts-per-step", type=int, help="fresh rollouts added per step (default 8192; quick 1024)")
    p.add_argument("--batch-size", type=int, help="rollouts sampled per step (default: rollouts per step)")
    p.add_argument("--capacity", type=int, help="buffer slots for both contenders (default: largest that fits)")
    p.add_argument("--steps", type=int, help="rounds after the fill: one timed step per contender each (default 8)")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--mean-response", type=int, default=None, help="default 4000 (2048 with --dapo)")
    p.add_argument("--response-cv", type=float, default=1.0, help="coefficient of variation of response length")
    p.add_argument("--max-response", type=int, default=None, help="default 16000 (10240 with --dapo)")
    p.add_argument("--group", type=int, default=16, help="rollouts per prompt (GRPO group)")
    p.add_argument("--token-dtype", choices=["int64", "int32"], default="int64",
                   help="torchreplay's stored/returned token dtype (TorchRL keeps the input's int64)")
    p.add_argument("--no-reuse-output", action="store_true",
                   help="torchreplay allocates fresh padded outputs per sample (default: reuse_output=True)")
    p.add_argument("--alpha", type=float, default=1.0)
    p.add_argument("--beta", type=float, default=0.4)
    p.add_argument("--eps", type=float, default=1e-3)
    p.add_argument("--step-seconds", type=float, default=30.0, help="RL step time the buffer's share is taken of")
    p.add_argument("--contenders", type=lambda s: s.split(","), default=None,
                   help=f"comma-separated, from {', '.join(CONTENDER_CLASSES)} (default: torchreplay,torchrl, "
                   f"plus {BASELINE} with --baseline-tree)")
    p.add_argument("--baseline-tree", help=f"a torchreplay source tree with its extension built in place: the "
                   f"{BASELINE} contender (e.g. git worktree add /tmp/base OLD_COMMIT)")
    p.add_argument("--out", type=Path, help="Markdown output, JSON written next to it (default "
                   "benchmarks/results/bench_buffer.md; bench_buffer_quick.md with --quick, bench_buffer_dapo.md with "
                   "--dapo)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900, help="seconds allowed per worker command (the fill, one step)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads; 0 keeps torch's default. The default 1 avoids OpenMP stalls when "
        "other processes share the cores",
    )
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--worker-config", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.mean_response is None:
        args.mean_response = 2048 if args.dapo else 4000
    if args.max_response is None:
        args.max_response = 10240 if args.dapo else 16000
    if args.out is None:
        args.out = DEFAULT_OUT.with_name("bench_buffer_quick.md" if args.quick else
                                         "bench_buffer_dapo.md" if args.dapo else DEFAULT_OUT.name)
    if args.contenders is None:
        args.contenders = list(CONTENDERS) + ([BASELINE] if args.baseline_tree else [])
    if set(args.contenders) - set(CONTENDER_CLASSES):
        p.error(f"unknown contenders: {sorted(set(args.contenders) - set(CONTENDER_CLASSES))}")
    return args


def run_rounds(names: list[str], cfg: dict[str, Any], timeout: float) -> tuple[dict[str, Any], dict[str, str]]:
    """Every contender in its own child process, all alive at once: each fills its buffer, then
    the contenders take turns, one timed step each per round, in alternating order (AB, BA, ...),
    so that the machine's drift lands on both alike and each round gives one paired ratio.
    Returns (results by contender, with `steps` in round order; why the others were skipped)."""
    skipped: dict[str, str] = {}
    workers: dict[str, WorkerProcess] = {}
    for name in names:
        why_not = probe(name, cfg)
        if why_not:
            skipped[name] = why_not
            print(f"[bench_buffer] skipping {name}: {why_not}", file=sys.stderr)
        else:
            workers[name] = WorkerProcess(name, cfg)
    steps: dict[str, list[dict[str, float]]] = {name: [] for name in workers}

    def drop(name: str, why: str) -> None:
        skipped[name] = why
        print(f"[bench_buffer] {name} failed: {why}", file=sys.stderr)
        workers.pop(name).close()

    try:
        for name in list(workers):  # one at a time: the fill is not compared
            answer = workers[name].ask("fill", timeout)
            if "error" in answer:
                drop(name, answer["error"])
        for r in range(cfg["steps"]):
            order = list(workers) if r % 2 == 0 else list(reversed(workers))
            for name in order:
                answer = workers[name].ask("step", timeout)
                if "error" in answer:
                    drop(name, answer["error"])
                else:
                    steps[name].append(answer)
        results = {}
        for name in list(workers):
            answer = workers[name].ask("summary", timeout)
            if "error" in answer:
                drop(name, answer["error"])
            else:
                results[name] = {**answer, "steps": steps[name]}
    finally:
        for worker in workers.values():
            worker.close()
    return results, skipped


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        serve(args.worker, json.loads(args.worker_config))
        return 0

    n = args.rollouts_per_step or (1024 if args.quick else 8192)
    cfg: dict[str, Any] = {
        "rollouts_per_step": n,
        "batch_size": args.batch_size or n,
        "steps": args.steps or 8,
        "prompt_len": args.prompt_len,
        "mean_response": args.mean_response,
        "response_cv": args.response_cv,
        "max_response": args.max_response,
        "group": args.group,
        "token_dtype": args.token_dtype,
        "reuse_output": not args.no_reuse_output,
        "packed": not args.no_packed,
        "alpha": args.alpha,
        "beta": args.beta,
        "eps": args.eps,
        "seed": args.seed,
        "threads": args.threads,
        "baseline_tree": os.path.abspath(args.baseline_tree) if args.baseline_tree else None,
    }
    if n % args.group:
        sys.exit(f"--rollouts-per-step ({n}) must be a multiple of --group ({args.group})")
    runnable = [name for name in args.contenders if probe(name, cfg) is None]
    if args.capacity:
        cfg["capacity"], why = args.capacity, "set with --capacity"
    else:
        cfg["capacity"], why = auto_capacity(cfg, max(1, len(runnable)))
        if args.quick:
            cfg["capacity"] = min(cfg["capacity"], 8 * n)
            why += f"; --quick caps it at 8 steps ({8 * n})"
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    load1 = os.getloadavg()[0]
    if load1 > 0.5:
        print(f"[bench_buffer] warning: 1-min load average is {load1:.2f}; results may be noisy", file=sys.stderr)
    print(f"[bench_buffer] capacity {cfg['capacity']}: {why}", file=sys.stderr)

    started = time.perf_counter()
    results, skipped = run_rounds(args.contenders, cfg, args.timeout)

    mean_len = cfg["prompt_len"] + cfg["mean_response"]
    report = {
        "meta": {
            "date": _dt.datetime.now().isoformat(timespec="seconds"),
            "cpu": f"{cpu_model()} ({os.cpu_count()} cores, {args.threads} torch threads per worker)",
            "python": platform.python_version(),
            "torch": torch.__version__,
            **peer_versions(),
            "load average at start": f"{load1:.2f}",
            "load average per worker (start/end)": ", ".join(
                f"{k} {r['load_start']:.2f}/{r['load_end']:.2f}" for k, r in results.items()
            ),
            "rollouts per step": n,
            "batch size B": cfg["batch_size"],
            "capacity": f"{cfg['capacity']} ({why})",
            "rollout": (
                f"{cfg['prompt_len']} prompt tokens + lognormal response (mean {cfg['mean_response']}, "
                f"CV {cfg['response_cv']}, cap {cfg['max_response']}); group {cfg['group']}; "
                f"~{mean_len * BYTES_PER_TOKEN / 1e3:.0f} KB/rollout, "
                f"~{n * mean_len * BYTES_PER_TOKEN / 1e9:.2f} GB/step"
            ),
            "sampler": f"prioritized, alpha {cfg['alpha']}, beta {cfg['beta']}, eps {cfg['eps']}",
            "rounds (one timed step per contender each)": cfg["steps"],
            "RL step (s)": args.step_seconds,
            "seed": args.seed,
        },
        "config": cfg,
        "skipped": skipped,
        "results": results,
    }
    report["meta"]["wall time (s)"] = round(time.perf_counter() - started, 1)
    if not results:
        print("[bench_buffer] no contender ran", file=sys.stderr)
        return 1
    markdown = render_markdown(report)
    print(markdown)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(markdown)
    json_path = args.out.with_suffix(".json")
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"[bench_buffer] wrote {args.out} and {json_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
