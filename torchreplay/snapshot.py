"""Buffer state as values: what `state_dict`, snapshots, checkpoints and restores carry.

A state is read once (`BufferSnapshot.from_state`): its config by `BufferConfig.from_json`, its
slot table and ledger by `LedgerState.parse`, so that everything that adopts a snapshot
(`persistence.restore`) works on validated, typed parts. States are written in format 3
(`STATE_VERSION`); formats 1 and 2 are still read, their older key names mapped to today's in one
place (`current_state`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

import torch

from torchreplay.checks import is_int
from torchreplay.config import BufferConfig
from torchreplay.ledger import LedgerState
from torchreplay.schema import FieldSpec, PackedBatch
from torchreplay.shards import ShardKeeper

if TYPE_CHECKING:
    from torchreplay.buffer import RolloutBuffer

__all__ = ["BufferConfig", "BufferSnapshot", "ShardInfo", "ShardSource", "PackedShardSource", "FileShardSource",
           "RemoteShardSource", "STATE_VERSION", "READABLE_STATE_VERSIONS", "current_state"]

# 3: the slot table's shard column is "shard" and a state_dict's shard payloads "shards" (both
# were "chunk"/"chunks"); 2: the config records extra fields' specs and the sampler spec.
STATE_VERSION = 3
READABLE_STATE_VERSIONS = (1, 2, 3)
RNG_STATE_BYTES = torch.Generator().get_state().numel()  # a CPU generator's state


def check_int64(state: Mapping[str, Any]) -> None:
    """ValueError naming the first plain int (JSON number) of a buffer state that does not fit
    int64.

    Every integer a restore reads outside the tensors passes here first, whatever part of the
    buffer's state it sits in: once adopted it meets int64 arithmetic, where it would wrap or raise
    OverflowError calls later. Fields with a narrower documented range (versions, sequence numbers,
    caps, counters) are then held to it where they are checked (`TableState.parse`,
    `LedgerState.parse`, `BufferConfig`). The sampler's config and state are the sampler's own
    to validate (its constructor and `load_state_dict`): a live sampler may hold any int its
    constructor accepts, and its checkpoint must restore."""
    parts = {k: v for k, v in state.items() if k not in ("sampler", "shards")}
    if isinstance(parts.get("config"), Mapping):
        parts["config"] = {k: v for k, v in parts["config"].items() if k != "sampler"}
    stack: list[tuple[Any, str]] = [(parts, "state")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, Mapping):
            stack.extend((value, f"{path}[{key!r}]") for key, value in node.items())
        elif isinstance(node, (list, tuple)):
            stack.extend((value, f"{path}[{i}]") for i, value in enumerate(node))
        elif is_int(node) and not -(2**63) <= node < 2**63:
            raise ValueError(f"{path} = {node} does not fit int64")


def current_state(state: Any) -> Mapping[str, Any]:
    """`state` (a `state_dict()` or checkpoint state) under the key names of format
    `STATE_VERSION`: the one place where older formats' names are mapped to today's. Formats 1 and
    2 named the slot table's shard column "chunk" and a state_dict's shard payloads "chunks"; the
    mapping renames only, so everything else is checked as in a format-3 state (a format-1 config
    still records extra fields by name, `BufferConfig.from_json`). TypeError for a non-mapping,
    ValueError naming a format_version this code does not read (one a newer torchreplay wrote)."""
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a mapping, got {type(state).__name__}")
    version = state.get("format_version")
    if not is_int(version) or version not in READABLE_STATE_VERSIONS:
        raise ValueError(f"state format_version {version!r} is not one this torchreplay reads "
                         f"{READABLE_STATE_VERSIONS} (a newer torchreplay may have written it)")
    if version == STATE_VERSION:
        return state
    renamed = dict(state)
    if isinstance(state.get("table"), Mapping) and "chunk" in state["table"]:
        table = state["table"]
        renamed["table"] = {**{k: v for k, v in table.items() if k not in ("chunk", "shard")}, "shard": table["chunk"]}
    if "chunks" in state:
        renamed["shards"] = renamed.pop("chunks")
    return renamed


@dataclass(frozen=True)
class ShardInfo:
    """A stored shard that a snapshot needs: its id in the buffer, and how many of its rows are
    live (the rest died after it was written)."""

    id: int
    live_rows: int


class ShardSource(Protocol):
    """Where a snapshot's shard comes from when a buffer is rebuilt: `rows` is how many rows it
    stores, `store(keeper)` brings it into a buffer's storage and returns its new shard id."""

    rows: int

    def store(self, keeper: ShardKeeper) -> int: ...


@dataclass
class PackedShardSource:
    """A shard in memory (one of a `state_dict`'s "shards")."""

    batch: PackedBatch

    @property
    def rows(self) -> int:
        return self.batch.n

    def store(self, keeper: ShardKeeper) -> int:
        return keeper.put(self.batch)


@dataclass
class FileShardSource:
    """A shard file on local disk (a downloaded checkpoint shard), checked already."""

    path: str
    rows: int

    def store(self, keeper: ShardKeeper) -> int:
        return keeper.adopt(self.path)


@dataclass
class RemoteShardSource:
    """A shard whose header and small blocks are read (`meta`); `fetch(path)` downloads its file
    on first use (a lazy restore)."""

    meta: Any
    fetch: Callable[[str], None]
    rows: int

    def store(self, keeper: ShardKeeper) -> int:
        return keeper.adopt_remote(self.meta, self.fetch)


@dataclass(frozen=True)
class BufferSnapshot:
    """A buffer's state without its rollout payloads, as typed values: the configuration, the
    ledger (slot table, counters, sampler state) and the generator state; `shards` (derived from
    the table) names the stored shards live slots need. `RolloutBuffer.snapshot()` takes one,
    `BufferSnapshot.from_state` reads one from a state, `RolloutBuffer.from_snapshot(snapshot,
    shards)` builds a buffer back from it; `state` is its plain form (what a checkpoint records)."""

    config: BufferConfig
    ledger: LedgerState
    rng: torch.Tensor
    shards: tuple[ShardInfo, ...] = field(init=False)

    def __post_init__(self) -> None:
        if self.ledger.table.capacity != self.config.capacity:
            raise ValueError(f"snapshot: the slot table has {self.ledger.table.capacity} slots, the config "
                             f"{self.config.capacity}")
        ids, rows = self.ledger.table.live_shards()
        object.__setattr__(self, "shards", tuple(ShardInfo(i, r) for i, r in zip(ids, rows)))

    @property
    def state(self) -> dict[str, Any]:
        """Tensors and plain values, in format `STATE_VERSION`: what a checkpoint's state object holds."""
        return {"format_version": STATE_VERSION, "config": self.config.to_json(), **self.ledger.to_state(),
                "rng": self.rng}

    @classmethod
    def from_state(cls, state: Any, extra_fields: Mapping[str, FieldSpec] | None = None) -> "BufferSnapshot":
        """The snapshot a `state_dict()` or checkpoint state describes, every part checked
        (ValueError/TypeError naming the key) except the sampler's own state, which the sampler
        checks when a buffer adopts it. `extra_fields` supplies the specs a format-1 config lacks."""
        state = current_state(state)
        check_int64(state)
        config = BufferConfig.from_json(state.get("config"), extra_fields=extra_fields)
        # The table must hold exactly `capacity` slots before anything is built for that capacity:
        # a config may claim any capacity, the tensors are what the state really carries.
        ledger = LedgerState.parse(state, config.capacity)
        rng = state.get("rng")
        if not isinstance(rng, torch.Tensor) or rng.dtype != torch.uint8 or rng.shape != (RNG_STATE_BYTES,):
            raise ValueError(f"state 'rng' must be a CPU generator's state ({RNG_STATE_BYTES} uint8 values)")
        return cls(config, ledger, rng)


def live_shards(slots: Any) -> tuple[list[int], list[int]]:
    """The shards holding live rollouts of a slot table (or `RolloutBuffer.slots`) and how many each holds."""
    ids, rows = torch.unique(slots.shard[slots.live], return_counts=True)
    return ids.tolist(), rows.tolist()


def metadata_state(buffer: "RolloutBuffer") -> dict[str, Any]:
    """All of a buffer's state except rollout payloads: `buffer.snapshot().state`."""
    return buffer.snapshot().state


class CheckpointReader(Protocol):
    """Reads checkpoints back (torchreplay.checkpoint.restore registers itself at import), so
    that `from_checkpoint` lives on the buffer while the buffer imports nothing of persistence."""

    def restore(self, cls: type, uri: str, **kwargs: Any) -> Any: ...

    def import_rollouts(self, buffer: Any, uri: str, **kwargs: Any) -> Any: ...


_checkpoint_reader: CheckpointReader | None = None


def use_checkpoint_reader(reader: CheckpointReader) -> None:
    global _checkpoint_reader
    _checkpoint_reader = reader


def checkpoint_reader() -> CheckpointReader:
    if _checkpoint_reader is None:
        raise RuntimeError("no checkpoint reader registered: import torchreplay (or torchreplay.checkpoint)")
    return _checkpoint_reader
