"""SlotTable: the per-slot metadata and the bookkeeping every eviction rule needs.

The buffer and its samplers share one table. It answers the questions the caps ask (which live
slots are the oldest, which are older than a version) without changing anything, so a caller can
decide everything first and commit afterwards: the buffer's calls are all-or-nothing because the
table's queries are pure and its few mutations (`take`, `insert`, `kill`) have exact inverses.
"""

from __future__ import annotations

import warnings
from collections import deque
from dataclasses import dataclass
from itertools import islice
from types import MappingProxyType
from typing import Any, Mapping

import torch

from torchreplay.checks import check_int

# Per-rollout fields the table holds (samplers, metrics, batches read them here, not in shards).
TABLE_FIELDS = ("advantage", "reward", "group_id", "policy_version", "prompt_len")

# Every version, count and sequence number a buffer holds stays at most LIMIT, so the sum of any
# two still fits int64: no increment, age or budget computed from them can wrap. A restored state
# is held to these ranges before it is adopted (docs/checkpoints.md "What a restore adopts").
LIMIT = 2**62


# The table's per-slot columns and their dtypes, in the order states record them.
COLUMNS: Mapping[str, torch.dtype] = MappingProxyType({
    "live": torch.bool, "generation": torch.int64, "seq": torch.int64, "reuse": torch.int64,
    "advantage": torch.float32, "reward": torch.float32, "group_id": torch.int64, "policy_version": torch.int64,
    "prompt_len": torch.int64, "shard": torch.int64, "row": torch.int64})


@dataclass(frozen=True)
class TableState:
    """A slot table as a value: its columns (CPU tensors of `capacity`, named as in `COLUMNS`), the
    version, live count, next sequence number and the free stack (slots popped from the end).

    `parse` is the one validator of a table read from a state (state_dict, checkpoint, import); a
    live table's `SlotTable.state()` is consistent by construction. A TableState owns its
    tensors: whoever builds a table from it (`SlotTable.from_state`) copies them."""

    columns: Mapping[str, torch.Tensor]
    version: int
    count: int
    next_seq: int
    free: torch.Tensor

    @property
    def capacity(self) -> int:
        return self.columns["live"].numel()

    def to_state(self) -> dict[str, Any]:
        """The state's keys for the table (what `state_dict()` and checkpoints record)."""
        return {"table": dict(self.columns), "version": self.version, "count": self.count,
                "next_seq": self.next_seq, "free": self.free}

    def live_shards(self) -> tuple[list[int], list[int]]:
        """The shards live slots name, ascending, and how many live slots name each."""
        ids, rows = torch.unique(self.columns["shard"][self.columns["live"]], return_counts=True)
        return ids.tolist(), rows.tolist()

    @classmethod
    def parse(cls, state: Mapping[str, Any], capacity: int) -> "TableState":
        """The table of `state` (the keys `to_state` writes), checked to be a consistent table of
        `capacity` slots before anything is built from it; ValueError naming the key otherwise.
        Nothing of the size the state claims is allocated before its tensors are checked."""
        table = state.get("table")
        if not isinstance(table, Mapping):
            raise ValueError("state 'table' must be a mapping of slot tensors")
        for name, dtype in COLUMNS.items():
            value = table.get(name)
            if not isinstance(value, torch.Tensor) or value.shape != (capacity,) or value.dtype != dtype:
                raise ValueError(f"state table[{name!r}] must be a {dtype} tensor of shape ({capacity},) "
                                 f"(the config's {capacity} slots)")
        # Inclusive ranges, scalars first: the per-slot columns' bounds use them.
        for name, low, high in (("version", 0, LIMIT - 1), ("count", 0, capacity), ("next_seq", 0, LIMIT)):
            check_int(state.get(name), f"state {name!r}", low=low, high=high, error=ValueError)
        # Columns every slot keeps, live or dead (a dead slot's generation and seq live on).
        for name, low, high in (("generation", 0, LIMIT), ("seq", -1, state["next_seq"] - 1), ("reuse", 0, LIMIT)):
            column = table[name]
            if column.numel() and (int(column.min()) < low or int(column.max()) > high):
                bad = int(column.min()) if int(column.min()) < low else int(column.max())
                raise ValueError(f"state table[{name!r}] must lie in [{low}, {high}], got "
                                 f"{'a negative' if bad < 0 else 'a'} {name} {bad}")
        live = table["live"]
        if int(live.sum()) != state["count"]:
            raise ValueError("state: count disagrees with the live mask")
        free = state.get("free")
        if not isinstance(free, torch.Tensor) or free.dtype != torch.int64 or free.dim() != 1:
            raise ValueError("state 'free' must be a 1-D int64 tensor")
        if free.numel() and (int(free.min()) < 0 or int(free.max()) >= capacity or bool(live[free].any())):
            raise ValueError("state 'free' names a slot outside the buffer or a live one")
        if free.numel() + state["count"] != capacity or torch.unique(free).numel() != free.numel():
            raise ValueError("state: free slots + live rollouts != capacity")
        # Values a buffer never holds: accepted, they would break sampling or the caps later.
        if live.any():
            if int(table["seq"][live].min()) < 0:
                raise ValueError("state: a live slot has no sequence number (seq -1)")
            if int(table["prompt_len"][live].min()) < 0 or int(table["prompt_len"][live].max()) > LIMIT:
                raise ValueError(f"state table['prompt_len']: a live slot's prompt length is outside [0, {LIMIT}]")
            if not bool(torch.isfinite(table["advantage"][live]).all()):
                raise ValueError("state: a live slot has a non-finite advantage")
            versions = table["policy_version"][live]
            if int(versions.min()) < 0 or int(versions.max()) > state["version"]:
                raise ValueError(f"state: a live slot's policy_version is outside [0, version {state['version']}]")
            if int(table["shard"][live].min()) < 0 or int(table["row"][live].min()) < 0:
                raise ValueError("state: a live slot names a negative shard or row")
        return cls(MappingProxyType({name: table[name] for name in COLUMNS}), state["version"], state["count"],
                   state["next_seq"], free)


class SlotTable:
    """Per-slot metadata (CPU tensors of `capacity`), the free stack and the two eviction orders.

    A slot's `seq` is its rollout's insertion number (unique for the buffer's lifetime), so an
    `(slot, seq)` pair names one rollout even after the slot is reused. The insertion order and
    the per-version index hold such pairs and skip dead ones lazily; `compact()` drops them.
    `age` of a live rollout is `version - policy_version` (docs/concepts.md).
    """

    TENSORS = tuple(COLUMNS)

    def __init__(self, capacity: int, track_versions: bool) -> None:
        self.capacity = capacity
        self.live = torch.zeros(capacity, dtype=torch.bool)
        self.generation = torch.zeros(capacity, dtype=torch.int64)
        self.seq = torch.full((capacity,), -1, dtype=torch.int64)
        self.reuse = torch.zeros(capacity, dtype=torch.int64)
        self.advantage = torch.zeros(capacity, dtype=torch.float32)
        self.reward = torch.zeros(capacity, dtype=torch.float32)
        self.group_id = torch.zeros(capacity, dtype=torch.int64)
        self.policy_version = torch.zeros(capacity, dtype=torch.int64)
        self.prompt_len = torch.zeros(capacity, dtype=torch.int64)
        self.shard = torch.full((capacity,), -1, dtype=torch.int64)
        self.row = torch.zeros(capacity, dtype=torch.int64)
        self.version = 0
        self.count = 0
        self.next_seq = 0
        # Lowest slot reused first, deterministically.
        self.free: list[int] = list(range(capacity - 1, -1, -1))
        self._fifo: deque[tuple[int, int]] = deque()
        self._by_version: dict[int, list[tuple[int, int]]] = {}
        self._version_entries = 0
        self.track_versions = track_versions

    # -- the SlotView samplers read -------------------------------------------------------------
    @property
    def current_version(self) -> int:
        return self.version

    def live_count(self) -> int:
        return self.count

    def ages(self, slots: torch.Tensor, version: int | None = None) -> torch.Tensor:
        return (self.version if version is None else version) - self.policy_version[slots]

    # -- queries (pure) -------------------------------------------------------------------------
    def _alive(self, pairs: torch.Tensor) -> torch.Tensor:
        return self.live[pairs[:, 0]] & (self.seq[pairs[:, 0]] == pairs[:, 1])

    def oldest(self, k: int) -> torch.Tensor:
        """The k oldest live slots by insertion (fewer if fewer are live). The dead prefix met on
        the way is dropped from the order, which changes nothing observable."""
        found: list[torch.Tensor] = []
        have = position = 0
        while have < k and position < len(self._fifo):
            take = min(len(self._fifo) - position, max(2 * (k - have), 64))
            pairs = torch.tensor(list(islice(self._fifo, position, position + take)), dtype=torch.int64)
            alive = self._alive(pairs)
            if position == 0:
                lead = int(alive.to(torch.int8).argmax()) if bool(alive.any()) else take
                for _ in range(lead):
                    self._fifo.popleft()
                pairs, alive = pairs[lead:], alive[lead:]
                position = take - lead
            else:
                position += take
            slots = pairs[alive, 0][: k - have]
            found.append(slots)
            have += slots.numel()
        return torch.cat(found) if found else torch.empty(0, dtype=torch.int64)

    def older_than(self, version: int) -> torch.Tensor:
        """Live slots whose policy_version < `version`: O(distinct versions + result)."""
        self.track_by_version()
        out = [pairs for v, pairs in self._by_version.items() if v < version]
        if not out:
            return torch.empty(0, dtype=torch.int64)
        pairs = torch.tensor([p for part in out for p in part], dtype=torch.int64).reshape(-1, 2)
        return pairs[self._alive(pairs), 0]

    def live_slots(self) -> torch.Tensor:
        return self.live.nonzero().flatten()

    # -- mutations ------------------------------------------------------------------------------
    def take(self, n: int) -> torch.Tensor:
        """Pop n free slots (the caller made room first; a failed insert restores the free list)."""
        return torch.tensor([self.free.pop() for _ in range(n)], dtype=torch.int64)

    def insert(self, slots: torch.Tensor, meta: Mapping[str, torch.Tensor], shard: int) -> None:
        """Make `slots` live with the given per-rollout metadata, rows 0..n-1 of shard `shard`."""
        n = slots.numel()
        seq = torch.arange(self.next_seq, self.next_seq + n, dtype=torch.int64)
        self.next_seq += n
        self.live[slots] = True
        self.generation[slots] += 1
        self.seq[slots] = seq
        self.reuse[slots] = 0
        for name in TABLE_FIELDS:
            getattr(self, name)[slots] = meta[name]
        self.shard[slots] = shard
        self.row[slots] = torch.arange(n, dtype=torch.int64)
        self.count += n
        pairs = list(zip(slots.tolist(), seq.tolist()))
        self._fifo.extend(pairs)
        if self.track_versions:
            for pair, v in zip(pairs, meta["policy_version"].tolist()):
                self._by_version.setdefault(v, []).append(pair)
            self._version_entries += n
        # Dead entries are skipped lazily; drop them once they outnumber the live ones, so the
        # orders stay O(capacity) whether or not the version ever moves.
        bound = 2 * self.count + 1024
        if len(self._fifo) > bound or self._version_entries > bound:
            self.compact()

    def kill(self, slots: torch.Tensor) -> list[tuple[int, int]]:
        """Mark live slots dead and free them; returns (shard id, rows) released per shard."""
        if slots.numel() == 0:
            return []
        shard_ids, counts = torch.unique(self.shard[slots], return_counts=True)
        self.live[slots] = False
        self.count -= slots.numel()
        self.shard[slots] = -1
        self.free.extend(reversed(slots.tolist()))
        return list(zip(shard_ids.tolist(), counts.tolist()))

    def snapshot_rows(self, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """The table's rows at `slots`, for `restore_rows` (the undo of kill/insert)."""
        return {name: getattr(self, name)[slots].clone() for name in self.TENSORS}

    def restore_rows(self, slots: torch.Tensor, rows: Mapping[str, torch.Tensor]) -> None:
        for name in self.TENSORS:
            getattr(self, name)[slots] = rows[name]

    def compact(self) -> None:
        """Rebuild both orders from the table alone: live slots in insertion (seq) order."""
        live = self.live_slots()
        order = live[torch.argsort(self.seq[live])]
        self._fifo = deque(zip(order.tolist(), self.seq[order].tolist()))
        self._by_version = {}
        if self.track_versions:
            by_version = order[torch.sort(self.policy_version[order], stable=True).indices]
            versions, counts = torch.unique_consecutive(self.policy_version[by_version], return_counts=True)
            for version, part in zip(versions.tolist(), torch.split(by_version, counts.tolist())):
                self._by_version[version] = list(zip(part.tolist(), self.seq[part].tolist()))
        self._version_entries = sum(len(b) for b in self._by_version.values())

    def drop_versions_below(self, version: int) -> None:
        """Forget index buckets below `version` once their slots are dead (after a staleness cut)."""
        for v in [v for v in self._by_version if v < version]:
            self._version_entries -= len(self._by_version.pop(v))

    def order_sizes(self) -> tuple[int, int]:
        """(insertion-order entries, version-index entries), dead ones included: both O(capacity)."""
        return len(self._fifo), self._version_entries

    def track_by_version(self) -> None:
        """Keep the per-version index from now on (a staleness cap needs it)."""
        if not self.track_versions:
            self.track_versions = True
            self.compact()

    # -- state ----------------------------------------------------------------------------------
    def state(self) -> TableState:
        """This table as a value (copies)."""
        return TableState(MappingProxyType({name: getattr(self, name).clone() for name in self.TENSORS}),
                          self.version, self.count, self.next_seq, torch.tensor(self.free, dtype=torch.int64))

    @classmethod
    def from_state(cls, state: TableState, track_versions: bool,
                   shard_ids: Mapping[int, int] | None = None) -> "SlotTable":
        """A table holding copies of `state`'s columns; `shard_ids` renames the shards live slots
        name (a restore stores each shard under a new id)."""
        out = cls(state.capacity, track_versions)
        for name in cls.TENSORS:
            setattr(out, name, state.columns[name].clone())
        out.version, out.count, out.next_seq = state.version, state.count, state.next_seq
        out.free = state.free.tolist()
        out.shard[~out.live] = -1
        if shard_ids is not None:
            live = out.live_slots()
            out.shard[live] = torch.tensor([shard_ids[s] for s in out.shard[live].tolist()], dtype=torch.int64)
        out.compact()
        return out


class SlotTableView:
    """A read-only view of the slot table `holder.slots` holds now (`RolloutBuffer.slots`, over its
    Ledger, which replaces its table on a load): columns come back as copies, so nothing written
    into them reaches the table, and the view has no mutators. It holds the holder, not the
    table, and the holder does not hold it (no reference cycle keeps a ledger alive)."""

    __slots__ = ("_holder",)
    _holder: Any

    def __init__(self, holder: Any) -> None:
        object.__setattr__(self, "_holder", holder)

    def _table_of(self) -> SlotTable:
        return self._holder.slots

    def __getattr__(self, name: str) -> torch.Tensor:
        if name in COLUMNS:
            return getattr(self._table_of(), name).clone()
        if name == "chunk":  # the shard column's name before state format 3
            warnings.warn("buf.slots.chunk is renamed buf.slots.shard", DeprecationWarning, stacklevel=2)
            return self._table_of().shard.clone()
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"the slot table view is read-only ({name!r})")

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(COLUMNS))

    capacity = property(lambda self: self._table_of().capacity)
    version = property(lambda self: self._table_of().version)
    current_version = version
    count = property(lambda self: self._table_of().count)
    next_seq = property(lambda self: self._table_of().next_seq)
    free = property(lambda self: tuple(self._table_of().free), doc="The free slots (the next taken last).")

    def live_count(self) -> int:
        return self._table_of().count

    def live_slots(self) -> torch.Tensor:
        return self._table_of().live_slots()

    def ages(self, slots: torch.Tensor, version: int | None = None) -> torch.Tensor:
        return self._table_of().ages(slots, version)

    def oldest(self, k: int) -> torch.Tensor:
        return self._table_of().oldest(k)

    def order_sizes(self) -> tuple[int, int]:
        return self._table_of().order_sizes()

    def state(self) -> TableState:
        return self._table_of().state()
