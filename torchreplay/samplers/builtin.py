"""The built-in samplers."""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import torch

from torchreplay.checks import check_int
from torchreplay.samplers.base import SlotView, TreeSampler, check_weight_norm


def _check_positive(name: str, value: float, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{name} must be a finite number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")
    return float(value)


class UniformSampler(TreeSampler):
    """Uniform over the live window: Arnal et al.'s FIFO replay window.

    The window itself is the buffer's: capacity with oldest-first overflow, `max_staleness` and
    `max_reuse`. `RolloutBuffer(capacity=W, sampler=UniformSampler())` is the whole configuration.
    """

    tree_dtype = torch.float32

    def priority(self, slots: torch.Tensor) -> torch.Tensor:
        return torch.ones(slots.numel(), dtype=self.tree_dtype)


class PrioritizedSampler(TreeSampler):
    """PER on advantage magnitude: p_i = (|A_i| + eps) ** alpha for A_i != 0, and p_i = 0 for a
    zero advantage (a GRPO group whose rewards were all equal: no policy gradient), unless
    `keep_zero_advantage=True` gives those eps ** alpha. Zero-priority rollouts stay stored (a
    later `update_priorities` can revive them) but are never drawn and never set the IS scale.
    IS weights use exponent beta and `weight_norm` (see TreeSampler).

    `beta` may be annealed by the caller (`sampler.beta = ...`) between samples.

    Defaults from the replay study (docs/demo_findings.md, benchmarks/replay_study.py): alpha 0.6
    beat 1.0 and 0.3 on the sparse task and tied on the dense one, where alpha 1 spent the reuse
    budget on a few rollouts; `batch_mean` weights were best on the dense task and tied on the
    sparse one. beta (0.4 against annealing to 1) and eps made no measurable difference.
    """

    def __init__(self, alpha: float = 0.6, beta: float = 0.4, eps: float = 1e-3, weight_norm: str = "batch_mean",
                 keep_zero_advantage: bool = False) -> None:
        super().__init__()
        self.alpha = _check_positive("alpha", alpha, allow_zero=True)
        self.beta = _check_positive("beta", beta, allow_zero=True)
        self.eps = _check_positive("eps", eps)
        self.weight_norm = check_weight_norm(weight_norm)
        if not isinstance(keep_zero_advantage, bool):
            raise TypeError(f"keep_zero_advantage must be a bool, got {type(keep_zero_advantage).__name__}")
        self.keep_zero_advantage = keep_zero_advantage

    def base_priority(self, slots: torch.Tensor) -> torch.Tensor:
        magnitude = self.slots.advantage[slots].double().abs()
        p = (magnitude + self.eps).pow(self.alpha)
        return p if self.keep_zero_advantage else p.masked_fill(magnitude == 0, 0.0)

    def priority(self, slots: torch.Tensor) -> torch.Tensor:
        return self.base_priority(slots)

    def config(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "eps": self.eps, "weight_norm": self.weight_norm,
                "keep_zero_advantage": self.keep_zero_advantage}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "beta": self.beta}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.beta = _check_positive("beta", state.get("beta", self.beta), allow_zero=True)


class FreshnessSampler(PrioritizedSampler):
    """FreshPER: the prioritized weight times exp(-(t_now - t_i) / tau), t in policy versions.

    exp(-(t_now - t_i)/tau) = exp(-t_now/tau) * exp(t_i/tau), and proportional sampling ignores the
    common factor, so each leaf stores the fixed factor exp((t_i - t_ref)/tau) and nothing changes
    as t_now advances: O(1) per inserted or updated leaf. `t_ref` is the buffer's version rounded
    down to a multiple of `period = max(1, floor(rebase_after * tau))`: no stored rollout is newer
    than the version, so every factor stays below exp(period / tau) <= exp(32) at any version up to
    2**62, and ranks at the same version use the same reference (exact global sampling). When the
    version crosses a period boundary, `t_ref` moves before any new leaf is written and the live
    leaves are rewritten, once per period. A rollout ~700 tau older than t_ref underflows to
    priority 0 (its true relative weight is below 1e-300).
    """

    rebase_after = 32.0

    def __init__(self, alpha: float = 0.6, beta: float = 0.4, eps: float = 1e-3, tau: float = 4.0,
                 weight_norm: str = "batch_mean", keep_zero_advantage: bool = False) -> None:
        super().__init__(alpha=alpha, beta=beta, eps=eps, weight_norm=weight_norm,
                         keep_zero_advantage=keep_zero_advantage)
        self.tau = _check_positive("tau", tau)
        self.period = max(1, math.floor(self.rebase_after * self.tau))
        self.t_ref = 0
        self.rebases = 0

    def priority(self, slots: torch.Tensor) -> torch.Tensor:
        age_from_ref = (self.slots.policy_version[slots] - self.t_ref).double()
        return self.base_priority(slots) * torch.exp(age_from_ref / self.tau)

    def on_advance(self, version: int) -> None:
        t_ref = version - version % self.period
        if t_ref != self.t_ref:
            old, self.t_ref = self.t_ref, t_ref
            live = self.slots.live.nonzero().flatten()
            try:
                self.write_priorities(live, self.priority(live))
            except BaseException:
                self.t_ref = old
                raise
            self.rebases += 1  # a diagnostic, not state: a failed call that rebased twice counts both
        super().on_advance(version)

    def config(self) -> dict[str, Any]:
        return {**super().config(), "tau": self.tau}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "t_ref": self.t_ref}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        t_ref = state.get("t_ref")
        check_int(t_ref, "FreshnessSampler state 't_ref' (a version)", low=0, high=2**62 - 1, error=ValueError)
        self.t_ref = t_ref


class PNewestSampler(TreeSampler):
    """verl's p-time: a fraction `p` of each batch is the newest live rollouts (by insertion), the
    rest is uniform over the other live rollouts."""

    tree_dtype = torch.float32
    proportional = False

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        p = _check_positive("p", p, allow_zero=True)
        if p > 1:
            raise ValueError(f"p must be in [0, 1], got {p}")
        self.p = p
        self._order: deque[tuple[int, int]] = deque()  # (slot, seq), oldest left

    def priority(self, slots: torch.Tensor) -> torch.Tensor:
        return torch.ones(slots.numel(), dtype=self.tree_dtype)

    def on_insert(self, slots: torch.Tensor) -> None:
        super().on_insert(slots)
        self._order.extend(zip(slots.tolist(), self.slots.seq[slots].tolist()))
        # Dead entries are skipped lazily; compact once they dominate, amortized O(1) per insert.
        if len(self._order) > 2 * self.slots.live_count() + 1024:
            self._order = deque((s, q) for s, q in self._order if self._alive(s, q))

    def _alive(self, slot: int, seq: int) -> bool:
        return bool(self.slots.live[slot]) and int(self.slots.seq[slot]) == seq

    def _newest(self, k: int, remaining: torch.Tensor | None) -> list[int]:
        out: list[int] = []
        for slot, seq in reversed(self._order):
            if len(out) == k:
                break
            if self._alive(slot, seq) and (remaining is None or int(remaining[slot]) > 0):
                out.append(slot)
        return out

    def sample(self, n: int, generator: torch.Generator | None,
               remaining: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        newest = self._newest(min(math.ceil(self.p * n), n), remaining)
        newest_t = torch.tensor(newest, dtype=torch.int64)
        rest = n - len(newest)
        # The uniform part excludes the newest for this draw...
        others = torch.full((self.slots.capacity,), n, dtype=torch.int64) if remaining is None else remaining.clone()
        others[newest_t] = 0
        drawn, _, _ = self.draw(rest, generator, others)
        # ...unless nothing else is left: then the newest are drawn again, within their budgets.
        if drawn.numel() < rest and newest:
            again = others.zero_()
            again[newest_t] = n if remaining is None else remaining[newest_t] - 1
            extra, _, _ = self.draw(rest - drawn.numel(), generator, again)
            drawn = torch.cat([drawn, extra])
        slots = torch.cat([newest_t, drawn])
        return slots, torch.ones(slots.numel(), dtype=torch.float32)

    def config(self) -> dict[str, Any]:
        return {"p": self.p}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        live = self.slots.live.nonzero().flatten()
        order = torch.argsort(self.slots.seq[live])
        self._order = deque(zip(live[order].tolist(), self.slots.seq[live[order]].tolist()))


class GroupSampler:
    """RePO-style: draw groups uniformly among groups with live rollouts, then up to
    `per_group` rollouts uniformly (without replacement) within each group."""

    def __init__(self, per_group: int = 4) -> None:
        check_int(per_group, "per_group", low=1)
        self.per_group = per_group
        self.slots: SlotView | None = None
        self._members: dict[int, set[int]] = {}
        self._groups: list[int] = []  # live group ids, for O(1) uniform choice
        self._position: dict[int, int] = {}

    def bind(self, slots: SlotView) -> None:
        self.slots = slots

    def on_insert(self, slots: torch.Tensor) -> None:
        for slot, gid in zip(slots.tolist(), self.slots.group_id[slots].tolist()):
            members = self._members.get(gid)
            if members is None:
                members = self._members[gid] = set()
                self._position[gid] = len(self._groups)
                self._groups.append(gid)
            members.add(slot)

    def on_remove(self, slots: torch.Tensor) -> None:
        for slot, gid in zip(slots.tolist(), self.slots.group_id[slots].tolist()):
            members = self._members.get(gid)
            if members is None:
                continue
            members.discard(slot)
            if not members:
                del self._members[gid]
                pos = self._position.pop(gid)
                last = self._groups.pop()
                if last != gid:
                    self._groups[pos] = last
                    self._position[last] = pos

    def on_priority(self, slots: torch.Tensor) -> None:
        pass

    def on_advance(self, version: int) -> None:
        pass

    def sample(self, n: int, generator: torch.Generator | None,
               remaining: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        out: list[int] = []
        budget: dict[int, int] = {}
        exhausted: set[int] = set()
        while len(out) < n and len(exhausted) < len(self._groups):
            gid = self._groups[int(torch.randint(len(self._groups), (1,), generator=generator))]
            members = sorted(self._members[gid])
            if remaining is not None:
                members = [m for m in members if budget.setdefault(m, int(remaining[m])) > 0]
            if not members:
                exhausted.add(gid)
                continue
            take = min(self.per_group, len(members), n - len(out))
            order = torch.randperm(len(members), generator=generator)[:take]
            for i in order.tolist():
                out.append(members[i])
                if remaining is not None:
                    budget[members[i]] -= 1
        return torch.tensor(out, dtype=torch.int64), torch.ones(len(out), dtype=torch.float32)

    def config(self) -> dict[str, Any]:
        return {"per_group": self.per_group}

    def state_dict(self) -> dict[str, Any]:
        return {"type": "GroupSampler", "config": self.config(),
                "group_order": torch.tensor(self._groups, dtype=torch.int64)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("type") != "GroupSampler" or state.get("config") != self.config():
            raise ValueError(f"sampler state does not match GroupSampler(per_group={self.per_group})")
        self._members, self._groups, self._position = {}, [], {}
        live = self.slots.live.nonzero().flatten()
        by_group: dict[int, set[int]] = {}
        for slot, gid in zip(live.tolist(), self.slots.group_id[live].tolist()):
            by_group.setdefault(gid, set()).add(slot)
        order = state["group_order"].tolist()
        if sorted(order) != sorted(by_group):
            raise ValueError("sampler state's groups do not match the buffer's live rollouts")
        for gid in order:
            self._position[gid] = len(self._groups)
            self._groups.append(gid)
            self._members[gid] = by_group[gid]

    def to(self, device: torch.device | str) -> "GroupSampler":
        return self
