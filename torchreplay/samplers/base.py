"""The sampler protocol and a base class for samplers backed by a SegmentTree."""

from __future__ import annotations

import math
from typing import Any, Protocol, runtime_checkable

import torch

from torchreplay.checks import check_int
from torchreplay.tree import SegmentTree


class SlotView(Protocol):
    """Read-only per-slot metadata the buffer shares with its sampler (CPU tensors of `capacity`)."""

    capacity: int
    live: torch.Tensor  # bool
    advantage: torch.Tensor  # float32
    policy_version: torch.Tensor  # int64
    group_id: torch.Tensor  # int64
    seq: torch.Tensor  # int64 insertion order, unique per stored rollout
    reuse: torch.Tensor  # int64 times sampled

    @property
    def current_version(self) -> int: ...

    def live_count(self) -> int: ...


WEIGHT_NORMS = ("batch_max", "batch_mean", "buffer_max")


@runtime_checkable
class Sampler(Protocol):
    """What a buffer needs from a sampler. Every hook receives CPU int64 slot tensors.

    - `bind(slots)` once, before anything else: the buffer's metadata.
    - `on_advance(version)`: the buffer's version moved (in add, compose, advance or a load). It is
      called before the new rollouts of that call are inserted and before anything is sampled,
      with `slots.current_version` already equal to `version`.
    - `on_insert(slots)`: these slots just became live (their metadata is already written).
    - `on_remove(slots)`: these slots were evicted; never return them again.
    - `on_priority(slots)`: their advantage changed.
    - `sample(n, generator, remaining=None)`: `(slots int64 [k], weights float32 [k])`, live slots
      only, with IS weights (all ones for samplers that do not reweight). `remaining`, when given,
      is an int64 tensor of `capacity`: slot s may appear at most `remaining[s]` times in the
      result (0: not at all). Draws beyond a slot's budget are redrawn from the rest; k < n only
      when nothing drawable is left.
    - `state_dict()` / `load_state_dict(state)`: tensors and plain Python values only.
    - `to(device)`: move any device state (the priority tree).
    """

    def bind(self, slots: SlotView) -> None: ...

    def on_insert(self, slots: torch.Tensor) -> None: ...

    def on_remove(self, slots: torch.Tensor) -> None: ...

    def on_priority(self, slots: torch.Tensor) -> None: ...

    def on_advance(self, version: int) -> None: ...

    def sample(self, n: int, generator: torch.Generator | None,
               remaining: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def to(self, device: torch.device | str) -> "Sampler": ...


@runtime_checkable
class ProportionalSampler(Sampler, Protocol):
    """A `Sampler` over a priority mass, as every `TreeSampler` is: what draws at given positions
    of the mass (`Ledger.draw_at`) and sampling across ranks (`DistributedRolloutBuffer`) need.

    - `proportional`: True when `sample` draws exactly in proportion to the priorities (global
      sampling across ranks needs it; `PNewestSampler` sets False).
    - `beta`, `weight_norm`: the IS weights' exponent and normalization (one of `WEIGHT_NORMS`),
      as `is_weights` applies them; `TreeSampler`'s defaults are beta 0 (every weight 1) and
      "batch_max". A sampler outside this protocol (`GroupSampler`, any plain `Sampler`) counts
      as beta 0 with no normalization of its own: its weights are used as it returns them.
    - `mass()`: (sum of priorities, smallest positive priority or +inf).
    - `draw_at(u)`: the slots at positions `u` in [0, 1) of the mass, with their priorities.
    - `draw(n, generator, remaining=None)`: proportional draws under per-slot budgets, with their
      priorities and the smallest drawable priority.
    - `is_weights(prio, buffer_min)`: IS weights for rows drawn with priorities `prio`.
    """

    proportional: bool
    beta: float
    weight_norm: str

    def mass(self) -> tuple[float, float]: ...

    def draw_at(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def draw(self, n: int, generator: torch.Generator | None,
             remaining: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, float]: ...

    def is_weights(self, prio: torch.Tensor, buffer_min: float) -> torch.Tensor: ...


def occurrence_rank(slots: torch.Tensor) -> torch.Tensor:
    """For each entry, how many earlier entries name the same slot (0 for a slot's first draw):
    what a per-slot budget is compared with."""
    order = torch.argsort(slots, stable=True)
    _, inverse, counts = torch.unique_consecutive(slots[order], return_inverse=True, return_counts=True)
    rank = torch.empty_like(slots)
    rank[order] = torch.arange(slots.numel()) - (torch.cumsum(counts, 0) - counts)[inverse]
    return rank


def check_weight_norm(weight_norm: str) -> str:
    if weight_norm not in WEIGHT_NORMS:
        raise ValueError(f"weight_norm must be one of {WEIGHT_NORMS}, got {weight_norm!r}")
    return weight_norm


class TreeSampler:
    """Proportional sampling from a SegmentTree whose leaf i is `priority(slots)` for live slots.

    Subclasses define `priority`; this class keeps the tree in step with the buffer, draws
    stratified batches under per-slot budgets and turns priorities into IS weights
    `w_i = (N P(i)) ** -beta`, normalized by `weight_norm`:

    - "batch_max": divided by the largest weight in the returned batch (the lowest-priority row
      drawn gets 1; every weight is in (0, 1]).
    - "batch_mean": divided by the batch's mean weight (the returned rows average 1).
    - "buffer_max": divided by the largest weight any live rollout could get, `(N P_min) ** -beta`
      with `P_min` over non-zero priorities (PER's original rule).

    A leaf with priority 0 is never drawn and never sets a scale. A subclass whose priorities
    depend on the buffer's version sets `depends_on_version = True` (every live leaf is rewritten
    when the version moves) or overrides `changed_by_version` to name only the slots that change.
    """

    tree_dtype = torch.float64
    beta: float = 0.0  # no reweighting unless a subclass (or the caller, annealing) sets it
    weight_norm: str = "batch_max"
    depends_on_version = False
    proportional = True  # draws are exactly proportional to the leaves (global sampling relies on it)

    def __init__(self) -> None:
        self.slots: SlotView | None = None
        self.tree: SegmentTree | None = None
        self._device = torch.device("cpu")
        self._version: int | None = None

    # -- hooks ---------------------------------------------------------------------------------
    def bind(self, slots: SlotView) -> None:
        self.slots = slots
        self.tree = SegmentTree(slots.capacity, device=self._device, dtype=self.tree_dtype)
        self._version = None

    def priority(self, slots: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def write_priorities(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Set these slots' leaves (subclasses that rewrite priorities, e.g. on a version move)."""
        device = self.tree.device
        self.tree.update(slots.to(device), values.to(device=device, dtype=self.tree_dtype))

    def on_insert(self, slots: torch.Tensor) -> None:
        self.write_priorities(slots, self.priority(slots))

    def on_remove(self, slots: torch.Tensor) -> None:
        self.write_priorities(slots, torch.zeros(slots.numel(), dtype=self.tree_dtype))

    def on_priority(self, slots: torch.Tensor) -> None:
        self.write_priorities(slots, self.priority(slots))

    def changed_by_version(self, old: int | None, new: int) -> torch.Tensor:
        """The live slots whose priority changes when the version moves from `old` to `new`."""
        if self.depends_on_version and old != new:
            return self.slots.live.nonzero().flatten()
        return torch.empty(0, dtype=torch.int64)

    def on_advance(self, version: int) -> None:
        # The new priorities are computed and written (the tree checks them first) before the
        # version is taken, so a priority that fails leaves the sampler as it was.
        changed = self.changed_by_version(self._version, version)
        if changed.numel():
            self.write_priorities(changed, self.priority(changed))
        self._version = version

    # -- sampling ------------------------------------------------------------------------------
    def mass(self) -> tuple[float, float]:
        """(sum of priorities, smallest positive priority or +inf): what exact global sampling
        across shards needs from each shard."""
        return float(self.tree.total()), float(self.tree.min())

    def draw_at(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The slots at positions `u` in [0, 1) of the priority mass (not stratified), with their
        priorities (float64, CPU)."""
        slots, prio = self.tree.sample(u=u.to(self.tree.device), stratified=False)
        return slots.cpu(), prio.cpu().to(torch.float64)

    def sample(self, n: int, generator: torch.Generator | None,
               remaining: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        slots, prio, drawable_min = self.draw(n, generator, remaining)
        return slots, self.is_weights(prio, drawable_min)

    def draw(self, n: int, generator: torch.Generator | None,
             remaining: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Stratified proportional draw of up to n slots under `remaining` budgets; returns the
        slots, their priorities (float64, CPU) and the smallest positive priority among the slots
        that were drawable (budget > 0) when the call began (+inf if none; nan unless this
        sampler's weights are normalized by it, `weight_norm="buffer_max"`).

        The first pass is stratified over the whole mass. A slot drawn more often than its budget
        keeps its first `remaining` draws; it is then set aside (its leaf zeroed for the rest of
        this call) and the missing rows are redrawn, stratified, from what is left. So every
        budget holds and the others keep their relative probabilities. The tree is exactly as
        before when this returns or raises."""
        empty = torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.float64)
        if n <= 0:
            return (*empty, math.inf)
        aside: list[tuple[torch.Tensor, torch.Tensor]] = []

        def set_aside(slots: torch.Tensor) -> None:
            if slots.numel():
                aside.append((slots, self.tree[slots.to(self.tree.device)].clone()))
                self.write_priorities(slots, torch.zeros(slots.numel(), dtype=self.tree_dtype))

        kept_slots, kept_prio = [], []
        try:
            used = None
            if remaining is not None:
                used = torch.zeros(self.slots.capacity, dtype=torch.int64)
                set_aside((self.slots.live & (remaining <= 0)).nonzero().flatten())
            # One more device read, so only for the normalization that uses it.
            drawable_min = float(self.tree.min()) if self.weight_norm == "buffer_max" and self.beta else math.nan
            # No more rows than the budgets left can come back, so a count past them (compose's
            # n_replay=2**40 under a reuse cap) draws what fits instead of allocating n uniforms.
            need = n if remaining is None else min(n, int(remaining.sum(dtype=torch.float64)))
            while need > 0 and float(self.tree.total()) > 0:
                u = torch.rand(need, dtype=torch.float64, generator=generator)
                slots, prio = self.tree.sample(u=u.to(self.tree.device))
                slots, prio = slots.cpu(), prio.cpu().to(torch.float64)
                if remaining is None:
                    kept_slots.append(slots)
                    kept_prio.append(prio)
                    break
                keep = occurrence_rank(slots) < (remaining[slots] - used[slots])
                slots, prio = slots[keep], prio[keep]
                used.index_add_(0, slots, torch.ones_like(slots))
                kept_slots.append(slots)
                kept_prio.append(prio)
                need -= slots.numel()
                spent = torch.unique(slots)
                set_aside(spent[used[spent] >= remaining[spent]])
        finally:
            for slots, values in reversed(aside):
                self.write_priorities(slots, values)
        if not kept_slots:
            return (*empty, drawable_min)
        return torch.cat(kept_slots), torch.cat(kept_prio), drawable_min

    def is_weights(self, prio: torch.Tensor, buffer_min: float) -> torch.Tensor:
        """IS weights (float32) for rows drawn with priorities `prio`, under `weight_norm`;
        `buffer_min` is the smallest positive priority in the sampled population."""
        if self.beta == 0 or prio.numel() == 0:
            return torch.ones(prio.shape, dtype=torch.float32)
        p = prio.to(torch.float64)
        if self.weight_norm == "buffer_max":
            return (p / buffer_min).pow(-self.beta).to(torch.float32)
        w = (p / p.min()).pow(-self.beta)
        if self.weight_norm == "batch_mean":
            w = w / w.mean()
        return w.to(torch.float32)

    # -- state ---------------------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {"type": type(self).__name__, "config": self.config(), "tree": self.tree.state_dict(),
                "version": self._version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("type") != type(self).__name__:
            raise ValueError(f"sampler state is for {state.get('type')!r}, this sampler is {type(self).__name__}")
        if state.get("config") != self.config():
            raise ValueError(f"sampler config differs: saved {state.get('config')}, this sampler {self.config()}")
        version = state.get("version")
        # A buffer's versions lie in [0, 2**62) (docs/concepts.md); the sampler's is one of them.
        check_int(version, "sampler state 'version'", low=0, high=2**62 - 1, allow_none=True, error=ValueError)
        self.tree.load_state_dict(state["tree"])
        self._version = version

    def to(self, device: torch.device | str) -> "TreeSampler":
        self._device = torch.device(device)
        if self.tree is not None:
            self.tree.to(self._device)
        return self
