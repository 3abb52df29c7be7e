"""Ledger: which rollouts are live, and the caps that decide it.

The ledger owns the SlotTable and keeps the sampler in step with it. It enforces the contract's
hard caps where they arise: the staleness cap whenever the version moves, the reuse cap inside
every draw (per-slot budgets) and after every use, capacity eviction oldest-first. Its insert is
all-or-nothing: victims are chosen first (pure queries), then the table and the sampler change,
and a hook that raises gets every change undone. It knows nothing of bytes: the buffer hands it
shard ids and is told which shard rows died, to release them once a call has committed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

import torch

from torchreplay.assembly import effective_sample_size
from torchreplay.checks import check_int
from torchreplay.errors import SchemaError
from torchreplay.samplers import ProportionalSampler, Sampler
from torchreplay.samplers.base import occurrence_rank
from torchreplay.schema import check_finite_advantages
from torchreplay.slots import LIMIT, SlotTable, TableState

EVICTION_REASONS = ("staleness", "reuse", "capacity", "corrupt")
SHORT_POLICIES = ("raise", "truncate")
MAX_VERSION = LIMIT  # versions lie in [0, 2**62)

Released = list[tuple[int, int]]  # (shard id, rows that died)
COUNTERS = (*(f"evicted_{r}" for r in EVICTION_REASONS), "stale_handle_updates", "sampled_fresh", "sampled_replay",
            "added", "sample_calls")


def check_cap(name: str, value: int | None) -> int | None:
    """max_staleness (0 to 2**62) and max_reuse (1 to 2**62), or None for no cap. A cap above
    2**62 would be no cap at all (versions and use counts stay below it) and overflow int64 in
    the budgets computed from it. ValueError for any bad value: a cap is a recorded config's field too."""
    return check_int(value, name, low=1 if name == "max_reuse" else 0, high=LIMIT, allow_none=True, error=ValueError)


def check_short(if_short: str) -> None:
    if if_short not in SHORT_POLICIES:
        raise ValueError(f"if_short must be one of {SHORT_POLICIES}, got {if_short!r}")


def replay_count(n_fresh: int, replay_ratio: float | None, n_replay: int | None, multiple_of: int | None) -> int:
    """How many replayed rows `compose` asks for: `n_replay` exactly, or `replay_ratio` of the whole
    batch, rounded so that the whole batch is a multiple of `multiple_of`. A bad count is a
    ValueError, whatever its type (compose's documented error)."""
    check_int(multiple_of, "multiple_of", low=1, allow_none=True, error=ValueError)
    if (replay_ratio is None) == (n_replay is None):
        raise ValueError("compose needs exactly one of replay_ratio and n_replay")
    if n_replay is not None:
        check_int(n_replay, "n_replay", low=0, error=ValueError)
        if multiple_of is not None and (n_fresh + n_replay) % multiple_of:
            raise ValueError(f"n_replay: {n_fresh} fresh + {n_replay} replayed is not a multiple of {multiple_of}")
        return n_replay
    if isinstance(replay_ratio, bool) or not isinstance(replay_ratio, (int, float)) or not 0 <= replay_ratio < 1:
        raise ValueError(f"replay_ratio must be a number in [0, 1), got {replay_ratio!r}")
    count = round(n_fresh * replay_ratio / (1 - replay_ratio))
    if multiple_of is not None:
        total = max(multiple_of, round((n_fresh + count) / multiple_of) * multiple_of)
        while total < n_fresh:
            total += multiple_of
        count = total - n_fresh
    return count


class Ledger:
    """Live rollouts, their caps and the sampler's view of them (see the module docstring)."""

    def __init__(self, capacity: int, sampler: Sampler, max_staleness: int | None, max_reuse: int | None) -> None:
        self.capacity = capacity
        self.sampler = sampler
        self.max_staleness = max_staleness
        self.max_reuse = max_reuse
        self.slots = SlotTable(capacity, track_versions=max_staleness is not None)
        self.counters: dict[str, float] = dict.fromkeys(COUNTERS, 0)
        self.sampler.bind(self.slots)
        self.sampler.on_advance(self.slots.version)
        self.last_ess = self.last_replay_weight_mean = math.nan

    @property
    def version(self) -> int:
        return self.slots.version

    # -- the caps (pure) ------------------------------------------------------------------------
    def stale(self, version: int) -> torch.Tensor:
        """Live slots past the staleness cap at `version` (age = version - policy_version)."""
        if self.max_staleness is None:
            return torch.empty(0, dtype=torch.int64)
        return self.slots.older_than(version - self.max_staleness)

    def remaining(self, excluded: torch.Tensor | None = None) -> torch.Tensor | None:
        """Per slot, how many more times it may be returned (None: no limit anywhere); 0 for
        dead slots and for the `excluded` ones."""
        if excluded is None:
            excluded = torch.empty(0, dtype=torch.int64)
        if self.max_reuse is None and excluded.numel() == 0:
            return None
        t = self.slots
        if self.max_reuse is None:
            remaining = torch.full((self.capacity,), MAX_VERSION, dtype=torch.int64)
        else:
            remaining = (self.max_reuse - t.reuse).clamp(min=0)
        remaining[~t.live] = 0
        remaining[excluded] = 0
        return remaining

    def draw(self, n: int, generator: torch.Generator, excluded: torch.Tensor, if_short: str,
             n_fresh: int = 0, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Up to n slots within every cap; all-or-nothing on the generator. A short draw raises
        with if_short='raise', else is cut so that n_fresh + its length stays a multiple of `multiple`."""
        state = generator.get_state()
        try:
            slots, weights = self.sampler.sample(n, generator, self.remaining(excluded))
            if slots.numel() < n:
                if if_short == "raise":
                    raise ValueError(
                        f"cannot fill a batch of {n}: only {slots.numel()} draws fit the caps (live rollouts "
                        f"{self.slots.count}, non-zero priority and reuse budget left); pass if_short='truncate' "
                        "for a shorter batch")
                keep = max(0, slots.numel() - (n_fresh + slots.numel()) % multiple)
                if keep < slots.numel():  # which rows go is random: draws come sorted by slot
                    kept = torch.sort(torch.randperm(slots.numel(), generator=generator)[:keep]).values
                    slots, weights = slots[kept], weights[kept]
        except BaseException:
            generator.set_state(state)
            raise
        return slots, weights

    def draw_at(self, u: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The slots at positions `u` in [0, 1) of a `ProportionalSampler`'s priority mass, with
        their priorities (float64), within the reuse budgets: a slot named more often than it may
        still be returned keeps its first draws, and the others are redrawn with `generator`
        from the slots with budget left, in proportion to their priorities. Returns (slots,
        priorities, how many were redrawn). ValueError, with the generator as it was, when too
        few rollouts have budget left. (An owner's half of sampling across ranks.)"""
        sampler = self.sampler
        if not isinstance(sampler, ProportionalSampler):
            raise TypeError(f"draws at positions of the mass need a ProportionalSampler, got {type(sampler).__name__}")
        slots, prio = sampler.draw_at(u)
        remaining = self.remaining()
        if remaining is None or slots.numel() == 0:
            return slots, prio, 0
        over = occurrence_rank(slots) >= remaining[slots]
        n_over = int(over.sum())
        if not n_over:
            return slots, prio, 0
        kept = slots[~over]
        remaining.index_add_(0, kept, -torch.ones_like(kept))
        state = generator.get_state()
        extra, extra_prio, _ = sampler.draw(n_over, generator, remaining)
        if extra.numel() < n_over:
            generator.set_state(state)
            raise ValueError("the requested rollouts exceed their reuse budgets and no other rollout of this buffer "
                             "has budget left")
        slots, prio = slots.clone(), prio.clone()
        slots[over], prio[over] = extra, extra_prio
        return slots, prio, n_over

    # -- changes --------------------------------------------------------------------------------
    def insert(self, meta: Mapping[str, torch.Tensor], n: int, shard: int, overflow_ok: bool) -> tuple[torch.Tensor, Released]:
        """Make n new rollouts live (rows 0..n-1 of `shard`), moving the version to their newest
        and evicting what that makes stale, then the oldest if room is short. Returns their slots
        and the shard rows that died. Raises (having changed nothing) if a sampler hook fails."""
        t = self.slots
        version = max(t.version, int(meta["policy_version"].max()))
        stale = self.stale(version)
        short = n - len(t.free) - stale.numel()
        crowded = torch.empty(0, dtype=torch.int64)
        if short > 0:
            if not overflow_ok:
                raise SchemaError(f"buffer full: {n} rollouts to add, {len(t.free)} free slots (overflow='raise')")
            oldest = t.oldest(short + stale.numel())
            crowded = oldest[~torch.isin(oldest, stale)][:short]
        victims = torch.cat([stale, crowded])
        undo = (t.snapshot_rows(victims), list(t.free), t.count, t.next_seq, t.version)
        slots = taken_rows = None
        try:
            released = self._kill(victims)
            self.set_version(version)
            slots = t.take(n)
            taken_rows = t.snapshot_rows(slots)
            t.insert(slots, meta, shard)
            self.sampler.on_insert(slots)
        except BaseException:
            self._undo_insert(victims, slots, taken_rows, undo)
            raise
        self.counters["evicted_staleness"] += stale.numel()
        self.counters["evicted_capacity"] += crowded.numel()
        self.counters["added"] += n
        return slots, released

    def _undo_insert(self, victims: torch.Tensor, slots: torch.Tensor | None, taken_rows, undo) -> None:
        t = self.slots
        victim_rows, free, count, next_seq, version = undo
        if slots is not None:
            self.sampler.on_remove(slots)
            t.restore_rows(slots, taken_rows)
        t.restore_rows(victims, victim_rows)
        t.free, t.count, t.next_seq = free, count, next_seq
        t.compact()
        self.set_version(version)
        if victims.numel():
            self.sampler.on_insert(victims)

    def _kill(self, slots: torch.Tensor) -> Released:
        if slots.numel() == 0:
            return []
        self.sampler.on_remove(slots)
        return self.slots.kill(slots)

    def evict(self, slots: torch.Tensor, reason: str) -> Released:
        """Evict now, for the commit step of a call (after everything that can fail)."""
        if slots.numel() == 0:
            return []
        self.counters[f"evicted_{reason}"] += slots.numel()
        return self._kill(slots)

    def evict_rows(self, shard_id: int, rows: list[int]) -> tuple[int, Released]:
        """Evict the live rollouts stored in these rows of a shard (found unreadable)."""
        t = self.slots
        hit = ((t.shard == shard_id) & t.live).nonzero().flatten()
        hit = hit[torch.isin(t.row[hit], torch.tensor(rows, dtype=torch.int64))]
        return hit.numel(), self.evict(hit, "corrupt")

    def set_version(self, version: int) -> None:
        """Move the version and tell the sampler; if its hook raises, the version stays."""
        old = self.slots.version
        if version != old:
            self.slots.version = version
            try:
                self.sampler.on_advance(version)
            except BaseException:
                self.slots.version = old
                raise

    def advance(self, version: int) -> tuple[int, Released]:
        """Move the version forward and evict what it makes stale; returns (evicted, released)."""
        stale = self.stale(version)
        self.set_version(version)  # first: the one step that can raise (a sampler hook)
        released = self.evict(stale, "staleness")
        if self.max_staleness is not None:
            self.slots.drop_versions_below(version - self.max_staleness)
        return stale.numel(), released

    def record_use(self, slots: torch.Tensor) -> Released:
        """One use per occurrence; evict what reached max_reuse."""
        self.slots.reuse.index_put_((slots,), torch.ones_like(slots), accumulate=True)
        if self.max_reuse is None or slots.numel() == 0:
            return []
        unique = torch.unique(slots)
        return self.evict(unique[(self.slots.reuse[unique] >= self.max_reuse) & self.slots.live[unique]], "reuse")

    def set_max_reuse(self, value: int | None) -> Released:
        """Change the reuse cap; a lower one evicts what has reached it now, as a tighter staleness
        cap does (a live rollout at the cap could be counted but never read)."""
        t = self.slots
        over = (t.live & (t.reuse >= value)).nonzero().flatten() if value is not None else t.live_slots()[:0]
        released = self.evict(over, "reuse")  # first: the one step that can raise (a sampler hook)
        self.max_reuse = value
        return released

    def check_uses(self, slots: torch.Tensor) -> None:
        """ValueError unless every slot is live and named no more often than its reuse budget."""
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= self.capacity):
            raise ValueError(f"slots outside [0, {self.capacity})")
        if not bool(self.slots.live[slots].all()):
            raise ValueError("slots must name live rollouts")
        if self.max_reuse is not None and slots.numel():
            # Clamped: a dead slot's count may lie past a cap that was lowered since it died.
            budget = (self.max_reuse - self.slots.reuse).clamp(min=0)
            if bool((torch.bincount(slots, minlength=self.capacity) > budget).any()):
                raise ValueError(f"slots name a rollout more often than its reuse budget (max_reuse {self.max_reuse})")

    def carry_reuse(self, slots: torch.Tensor, reuse: torch.Tensor) -> Released:
        """Set use counts carried over from another run; evict what is already at max_reuse."""
        self.slots.reuse[slots] = reuse
        if self.max_reuse is None:
            return []
        return self.evict(slots[(reuse >= self.max_reuse) & self.slots.live[slots]], "reuse")

    def check_admissible(self, versions: torch.Tensor, overflow_raises: bool) -> None:
        """SchemaError unless a batch of rollouts at `versions` may be inserted now."""
        n = versions.numel()
        if n > self.capacity:
            raise SchemaError(f"batch of {n} rollouts exceeds the buffer capacity {self.capacity}")
        if int(versions.max()) >= MAX_VERSION or int(versions.min()) < 0:
            raise SchemaError(f"field 'policy_version': versions must lie in [0, 2**62), got {versions.tolist()}")
        if overflow_raises and n > len(self.slots.free):
            room = len(self.slots.free) + self.stale(max(self.version, int(versions.max()))).numel()
            if n > room:
                raise SchemaError(f"buffer full: {n} rollouts to add, {room} free slots counting those the add "
                                  "makes stale (overflow='raise')")
        if self.max_staleness is not None:
            stale = versions < max(self.version, int(versions.max())) - self.max_staleness
            if bool(stale.any()):
                i = int(stale.nonzero()[0, 0])
                raise SchemaError(
                    f"field 'policy_version', rollout {i}: version {int(versions[i])} is older than the "
                    f"staleness cap allows (current {self.version}, max_staleness {self.max_staleness})")

    def set_advantages(self, slot: torch.Tensor, generation: torch.Tensor, advantages: torch.Tensor) -> int:
        """New advantages for the (slot, generation) pairs still live; the rest are counted as stale
        handles. All-or-nothing: if the sampler rejects a priority, every advantage stays."""
        if not isinstance(advantages, torch.Tensor) or not advantages.is_floating_point():
            raise TypeError("advantages must be a floating-point tensor")
        advantages = advantages.detach().cpu().to(torch.float32).reshape(-1)
        slot, generation = slot.cpu(), generation.cpu()
        if advantages.numel() != slot.numel():
            raise ValueError(f"advantages has {advantages.numel()} values for {slot.numel()} handles")
        check_finite_advantages(advantages)
        if slot.numel() and (int(slot.min()) < 0 or int(slot.max()) >= self.capacity):
            raise ValueError(f"handles.slot outside [0, {self.capacity})")
        t = self.slots
        current = t.live[slot] & (t.generation[slot] == generation)
        slot, advantages = slot[current], advantages[current]
        if slot.numel():
            changed = torch.unique(slot)
            old = t.advantage[changed].clone()
            t.advantage[slot] = advantages  # last occurrence wins for repeated handles
            try:
                self.sampler.on_priority(changed)
            except BaseException:
                t.advantage[changed] = old
                raise
        self.counters["stale_handle_updates"] += int((~current).sum())
        return int(current.sum())

    def note_weights(self, weights: torch.Tensor | None, replay_weights: torch.Tensor | None) -> None:
        """The IS weights of the batch just returned (all rows) and of its replayed rows."""
        if weights is not None and weights.numel():
            self.last_ess = effective_sample_size(weights)
        self.last_replay_weight_mean = float(replay_weights.double().mean()) \
            if replay_weights is not None and replay_weights.numel() else math.nan

    # -- state ----------------------------------------------------------------------------------
    def state(self) -> "LedgerState":
        """The ledger as a value (copies): what snapshots and checkpoints record."""
        return LedgerState(self.slots.state(), MappingProxyType(dict(self.counters)), self.last_ess,
                           self.last_replay_weight_mean, self.sampler.state_dict())

    def adopt(self, state: "LedgerState", shard_ids: Mapping[int, int] | None = None) -> SlotTable:
        """Take `state` (its table's live slots naming shards renamed by `shard_ids`): the
        sampler's state is loaded into a sampler bound to the new table, or everything is put
        back. Returns the old table."""
        table = SlotTable.from_state(state.table, self.max_staleness is not None, shard_ids)
        old_table, old_sampler = self.slots, self.sampler.state_dict()
        self.slots = table
        try:
            self.sampler.bind(table)
            self.sampler.load_state_dict(state.sampler)
        except Exception:
            self.slots = old_table
            self.sampler.bind(old_table)
            self.sampler.load_state_dict(old_sampler)
            raise
        self.counters = dict(state.counters)
        self.last_ess, self.last_replay_weight_mean = state.last_ess, state.last_replay_weight_mean
        return old_table

    # -- metrics --------------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        t = self.slots
        ages = t.ages(t.live)
        reuse = t.reuse[t.live]
        out: dict[str, float] = {
            "size": t.count,
            "capacity": self.capacity,
            "policy_version": t.version,
            "age_mean": float(ages.double().mean()) if ages.numel() else 0.0,
            "age_max": int(ages.max()) if ages.numel() else 0,
            "reuse_mean": float(reuse.double().mean()) if reuse.numel() else 0.0,
            "ess_fraction": self.last_ess,
            "replay_weight_mean": self.last_replay_weight_mean,
        }
        for name, values, bins in (("age", ages, ((0, 0), (1, 1), (2, 3), (4, 7), (8, None))),
                                   ("reuse", reuse, ((0, 0), (1, 1), (2, 3), (4, None)))):
            for lo, hi in bins:
                key = f"{name}_hist_{lo}" if lo == hi else (f"{name}_hist_{lo}_{hi}" if hi else f"{name}_hist_{lo}_plus")
                sel = (values >= lo) if hi is None else ((values >= lo) & (values <= hi))
                out[key] = int(sel.sum())
        out.update(self.counters)
        return out


@dataclass(frozen=True)
class LedgerState:
    """A ledger as a value: its slot table, counters, the last batch's statistics and the
    sampler's own state (validated by the sampler when a ledger adopts it). `parse` is the one
    validator of a ledger read from a state; `Ledger.state()` is consistent by construction."""

    table: TableState
    counters: Mapping[str, int]
    last_ess: float
    last_replay_weight_mean: float
    sampler: Any

    def to_state(self) -> dict[str, Any]:
        """The state's keys for the ledger, in the order `state_dict()` and checkpoints record them."""
        return {**self.table.to_state(), "counters": dict(self.counters), "last_ess": self.last_ess,
                "last_replay_weight_mean": self.last_replay_weight_mean, "sampler": self.sampler}

    @classmethod
    def parse(cls, state: Mapping[str, Any], capacity: int) -> "LedgerState":
        """The ledger of `state` for a buffer of `capacity` slots, checked before anything is built
        from it (ValueError naming the key)."""
        table = TableState.parse(state, capacity)
        counters = state.get("counters")
        if not isinstance(counters, Mapping) or set(counters) != set(COUNTERS):
            raise ValueError(f"state 'counters' must have the keys {sorted(COUNTERS)}")
        for name, value in counters.items():
            check_int(value, f"state counter {name!r}", low=0, high=LIMIT, error=ValueError)
        # Statistics of the last batch: nan before the first, else a non-negative float.
        stats = {}
        for name in ("last_ess", "last_replay_weight_mean"):
            value = state.get(name, math.nan)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not ((isinstance(value, float) and math.isnan(value)) or 0 <= value <= LIMIT):
                raise ValueError(f"state {name!r} must be nan or a number in [0, 2**62], got {value!r}")
            stats[name] = float(value)
        if "sampler" not in state:
            raise ValueError("state has no 'sampler' (the sampler's state_dict)")
        return cls(table, MappingProxyType(dict(counters)), stats["last_ess"], stats["last_replay_weight_mean"],
                   state["sampler"])
