"""The built-in samplers."""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import torch

from torchreplay.samplers.base import SlotView, TreeSampler


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
    """PER on advantage magnitude: p_i = (|A_i| + eps) ** alpha, IS weights with exponent beta.

    `beta` may be annealed by the caller (`sampler.beta = ...`) between samples.
    """

    def __init__(self, alpha: float = 1.0, beta: float = 0.4, eps: float = 1e-3) -> None:
        super().__init__()
        self.alpha = _check_positive("alpha", alpha, allow_zero=True)
        self.beta = _check_positive("beta", beta, allow_zero=True)
        self.eps = _check_positive("eps", eps)

    def base_priority(self, slots: torch.Tensor) -> torch.Tensor:
        return (self.slots.advantage[slots].double().abs() + self.eps).pow(self.alpha)

    def priority(self, slots: torch.Tensor) -> torch.Tensor:
        return self.base_priority(slots)

    def config(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "eps": self.eps}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "beta": self.beta}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.beta = _check_positive("beta", state.get("beta", self.beta), allow_zero=True)


class FreshnessSampler(PrioritizedSampler):
    """FreshPER: the prioritized weight times exp(-(t_now - t_i) / tau), t in policy versions.

    exp(-(t_now - t_i)/tau) = exp(-t_now/tau) * exp(t_i/tau), and proportional sampling ignores the
    common factor, so each leaf stores the fixed factor exp((t_i - t_ref)/tau) and nothing changes
    as t_now advances: O(1) per inserted or updated leaf. Only when t_now - t_ref exceeds
    `rebase_after * tau` (the factors of new leaves would grow towards overflow) is t_ref moved
    and the live leaves rewritten, once per `rebase_after * tau` versions.
    """

    rebase_after = 32.0

    def __init__(self, alpha: float = 1.0, beta: float = 0.4, eps: float = 1e-3, tau: float = 4.0) -> None:
        super().__init__(alpha=alpha, beta=beta, eps=eps)
        self.tau = _check_positive("tau", tau)
        self.t_ref = 0
        self.rebases = 0

    def priority(self, slots: torch.Tensor) -> torch.Tensor:
        age_from_ref = (self.slots.policy_version[slots] - self.t_ref).double()
        return self.base_priority(slots) * torch.exp(age_from_ref / self.tau)

    def on_advance(self, version: int) -> None:
        if version - self.t_ref > self.rebase_after * self.tau:
            self.t_ref = version
            self.rebases += 1
            live = self.slots.live.nonzero().flatten()
            if live.numel():
                self._write(live, self.priority(live))

    def config(self) -> dict[str, Any]:
        return {**super().config(), "tau": self.tau}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "t_ref": self.t_ref, "rebases": self.rebases}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.t_ref = int(state["t_ref"])
        self.rebases = int(state["rebases"])


class PNewestSampler(TreeSampler):
    """verl's p-time: a fraction `p` of each batch is the newest live rollouts (by insertion), the
    rest is uniform over the other live rollouts."""

    tree_dtype = torch.float32

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

    def _newest(self, k: int) -> list[int]:
        out: list[int] = []
        for slot, seq in reversed(self._order):
            if len(out) == k:
                break
            if self._alive(slot, seq):
                out.append(slot)
        return out

    def sample(self, n: int, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        newest = self._newest(min(math.ceil(self.p * n), n))
        rest = n - len(newest)
        newest_t = torch.tensor(newest, dtype=torch.int64)
        if rest and newest:
            # Exclude the newest from the uniform part for the duration of this draw.
            self._write(newest_t, torch.zeros(len(newest), dtype=self.tree_dtype))
        try:
            if rest and self.tree.total().item() > 0:
                drawn, _ = super().sample(rest, generator)
            elif rest:  # everything live is among the newest: draw those again
                pick = torch.randint(len(newest), (rest,), generator=generator)
                drawn = newest_t[pick]
            else:
                drawn = torch.empty(0, dtype=torch.int64)
        finally:
            if rest and newest:
                self._write(newest_t, self.priority(newest_t))
        slots = torch.cat([newest_t, drawn])
        return slots, torch.ones(n, dtype=torch.float32)

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
        if isinstance(per_group, bool) or not isinstance(per_group, int) or per_group < 1:
            raise ValueError(f"per_group must be an int >= 1, got {per_group!r}")
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

    def sample(self, n: int, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._groups:
            raise ValueError("cannot sample: the buffer is empty")
        out: list[int] = []
        while len(out) < n:
            gid = self._groups[int(torch.randint(len(self._groups), (1,), generator=generator))]
            members = sorted(self._members[gid])
            take = min(self.per_group, len(members), n - len(out))
            order = torch.randperm(len(members), generator=generator)[:take]
            out.extend(members[i] for i in order.tolist())
        return torch.tensor(out, dtype=torch.int64), torch.ones(n, dtype=torch.float32)

    def state_dict(self) -> dict[str, Any]:
        return {"type": "GroupSampler", "config": {"per_group": self.per_group},
                "group_order": torch.tensor(self._groups, dtype=torch.int64)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("type") != "GroupSampler" or state.get("config") != {"per_group": self.per_group}:
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
