"""Buffer state as tensors and plain values (no pickle): what `state_dict`, checkpoints and restores
read and write, and its validation before anything is adopted."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

import torch

from torchreplay.errors import SchemaError
from torchreplay.ledger import check_cap
from torchreplay.schema import (
    ROLLOUT,
    TOKEN,
    FieldSpec,
    PackedBatch,
    check_stored_fields,
    check_stored_offsets,
    default_fields,
)
from torchreplay.samplers import sampler_from_state
from torchreplay.shards import ShardKeeper, ShardListener
from torchreplay.slots import TABLE_FIELDS, SlotTable
from torchreplay.storage.format import DTYPE_NAMES, DTYPES

if TYPE_CHECKING:
    from torchreplay.assembly import Handles
    from torchreplay.buffer import RolloutBuffer
    from torchreplay.samplers import Sampler
    from torchreplay.storage import TieredStorage

STATE_VERSION = 2  # 2: the config records extra fields' specs and the sampler spec
READABLE_STATE_VERSIONS = (1, 2)


@dataclass(frozen=True)
class BufferConfig:
    """The arguments that shape a buffer's behaviour, validated once (ValueError/TypeError naming
    the argument): the single source of a buffer's configuration. `buffer.config()` gives it with
    the caps as they are now; checkpoints record `to_json()`, restores rebuild the buffer from
    `from_json(...)`, and distributed ranks compare `fingerprint()`s."""

    capacity: int
    max_staleness: int | None = None
    max_reuse: int | None = None
    overflow: str = "evict_oldest"
    padding_side: str = "right"
    pad_token_id: int = 0
    ref_logprobs: bool = False
    routing: tuple[int, int, int] | None = None
    extra_fields: Mapping[str, FieldSpec] | None = None
    on_corrupt: str = "raise"
    token_dtype: torch.dtype = torch.int64
    sampler: Mapping[str, Any] | None = None  # {"type", "config"} (samplers.sampler_spec), None if unknown

    def __post_init__(self) -> None:
        if isinstance(self.capacity, bool) or not isinstance(self.capacity, int) or self.capacity < 1:
            raise ValueError(f"capacity must be an int >= 1, got {self.capacity!r}")
        check_cap("max_staleness", self.max_staleness)
        check_cap("max_reuse", self.max_reuse)
        for name, allowed in (("overflow", ("evict_oldest", "raise")), ("on_corrupt", ("raise", "skip")),
                              ("padding_side", ("left", "right"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if isinstance(self.pad_token_id, bool) or not isinstance(self.pad_token_id, int):
            raise TypeError(f"pad_token_id must be an int, got {self.pad_token_id!r}")
        if self.token_dtype in (torch.int32, torch.int64):
            info = torch.iinfo(self.token_dtype)
            if not info.min <= self.pad_token_id <= info.max:
                raise ValueError(f"pad_token_id {self.pad_token_id} does not fit token_dtype {self.token_dtype}")
        if not isinstance(self.ref_logprobs, bool):
            raise TypeError(f"ref_logprobs must be a bool, got {self.ref_logprobs!r}")
        # Copies of the caller's containers: changing them later must not change this buffer.
        if self.routing is not None:
            routing = tuple(self.routing)
            if len(routing) != 3 or not all(isinstance(v, int) and not isinstance(v, bool) for v in routing):
                raise ValueError(f"routing must be (num_experts, layers, top_k) ints, got {self.routing!r}")
            object.__setattr__(self, "routing", routing)
        if self.extra_fields is not None:
            if not isinstance(self.extra_fields, Mapping):
                raise TypeError(f"extra_fields must be a mapping name -> FieldSpec, got {type(self.extra_fields).__name__}")
            object.__setattr__(self, "extra_fields", MappingProxyType(dict(self.extra_fields)))
        if self.sampler is not None:
            if not isinstance(self.sampler, Mapping) or not isinstance(self.sampler.get("type"), str):
                raise TypeError(f"sampler must be a sampler spec {{'type', 'config'}}, got {self.sampler!r}")
            config = self.sampler.get("config")
            object.__setattr__(self, "sampler", MappingProxyType(
                {"type": self.sampler["type"], "config": MappingProxyType(dict(config)) if config is not None else None}))
        self.fields()  # the schema itself is validated here too (token_dtype, routing, extra names)

    def __hash__(self) -> int:
        return hash(self.fingerprint())

    def fields(self) -> dict[str, FieldSpec]:
        return default_fields(self.ref_logprobs, self.routing, self.extra_fields, self.token_dtype)

    def with_caps(self, max_staleness: int | None, max_reuse: int | None) -> "BufferConfig":
        return dataclasses.replace(self, max_staleness=max_staleness, max_reuse=max_reuse)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON values, extra fields' specs included (a restore needs nothing passed in)."""
        return {
            "capacity": self.capacity, "max_staleness": self.max_staleness, "max_reuse": self.max_reuse,
            "overflow": self.overflow, "padding_side": self.padding_side, "pad_token_id": self.pad_token_id,
            "ref_logprobs": self.ref_logprobs, "routing": list(self.routing) if self.routing else None,
            "extra_fields": {name: {"kind": spec.kind, "dtype": DTYPE_NAMES[spec.dtype], "shape": list(spec.shape),
                                    "required": spec.required, "accept": spec.accept}
                             for name, spec in sorted((self.extra_fields or {}).items())},
            "on_corrupt": self.on_corrupt, "token_dtype": DTYPE_NAMES[self.token_dtype],
            "sampler": {"type": self.sampler["type"], "config": None if self.sampler["config"] is None
                        else dict(self.sampler["config"])} if self.sampler is not None else None,
        }

    @classmethod
    def from_json(cls, data: Any, extra_fields: Mapping[str, FieldSpec] | None = None) -> "BufferConfig":
        """The inverse of `to_json`, validated (ValueError/TypeError naming the key). Configs
        written before extra fields' specs were recorded (a list of names) need `extra_fields`."""
        if not isinstance(data, Mapping):
            raise TypeError(f"buffer config must be a JSON object, got {type(data).__name__}")
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"buffer config has unknown keys {sorted(unknown)}")
        kwargs = dict(data)
        if kwargs.get("routing") is not None:
            if not isinstance(kwargs["routing"], list):
                raise TypeError(f"buffer config routing must be a list, got {kwargs['routing']!r}")
            kwargs["routing"] = tuple(kwargs["routing"])
        if "token_dtype" in kwargs:
            if kwargs["token_dtype"] not in ("int32", "int64"):
                raise ValueError(f"buffer config token_dtype {kwargs['token_dtype']!r} is not int32/int64")
            kwargs["token_dtype"] = DTYPES[kwargs["token_dtype"]]
        recorded = kwargs.pop("extra_fields", None)
        if isinstance(recorded, list):  # names only (format_version 1)
            if sorted(extra_fields or {}) != sorted(recorded):
                raise ValueError(f"the config declares extra fields {recorded} without their specs: pass extra_fields=...")
            kwargs["extra_fields"] = extra_fields
        elif recorded:
            if not isinstance(recorded, Mapping):
                raise TypeError("buffer config extra_fields must map names to field specs")
            kwargs["extra_fields"] = {name: _field_from_json(name, spec) for name, spec in recorded.items()}
        return cls(**kwargs)

    def fingerprint(self) -> str:
        """A digest of `to_json()`: equal exactly when two configurations are."""
        text = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def constructor_kwargs(self) -> dict[str, Any]:
        """Keyword arguments that rebuild a buffer with this configuration (the sampler aside)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "sampler"}

    def layout(self) -> dict[str, Any]:
        """What stored state depends on: the slot count and the schema. A state can be loaded into
        a buffer whose layout matches, whatever its caps, padding or sampler settings."""
        as_json = self.to_json()
        return {k: as_json[k] for k in ("capacity", "ref_logprobs", "routing", "extra_fields", "token_dtype")}


def check_int64(state: Mapping[str, Any]) -> None:
    """ValueError naming the first plain int (JSON number) of a buffer state that does not fit
    int64.

    Every integer a restore reads outside the tensors passes here first, whatever part of the
    buffer's state it sits in: once adopted it meets int64 arithmetic, where it would wrap or raise
    OverflowError calls later. Fields with a narrower documented range (versions, sequence numbers,
    caps, counters) are then held to it where they are checked (`SlotTable.check_state`,
    `Ledger.check_state`, `BufferConfig`). The sampler's config and state are the sampler's own
    to validate (its constructor and `load_state_dict`): a live sampler may hold any int its
    constructor accepts, and its checkpoint must restore."""
    parts = {k: v for k, v in state.items() if k not in ("sampler", "chunks")}
    if isinstance(parts.get("config"), Mapping):
        parts["config"] = {k: v for k, v in parts["config"].items() if k != "sampler"}
    stack: list[tuple[Any, str]] = [(parts, "state")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, Mapping):
            stack.extend((value, f"{path}[{key!r}]") for key, value in node.items())
        elif isinstance(node, (list, tuple)):
            stack.extend((value, f"{path}[{i}]") for i, value in enumerate(node))
        elif isinstance(node, int) and not isinstance(node, bool) and not -(2**63) <= node < 2**63:
            raise ValueError(f"{path} = {node} does not fit int64")


def _field_from_json(name: str, spec: Any) -> FieldSpec:
    if not isinstance(spec, Mapping) or spec.get("dtype") not in DTYPES or spec.get("kind") not in (TOKEN, ROLLOUT):
        raise ValueError(f"buffer config extra field {name!r}: malformed spec {spec!r}")
    shape = spec.get("shape", [])
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in shape):
        raise ValueError(f"buffer config extra field {name!r}: shape must be a list of ints >= 1, got {shape!r}")
    if not isinstance(spec.get("required", True), bool) or spec.get("accept", "float") not in ("float", "int", "bool"):
        raise ValueError(f"buffer config extra field {name!r}: malformed required/accept in {spec!r}")
    return FieldSpec(name, spec["kind"], DTYPES[spec["dtype"]], tuple(shape), spec.get("required", True),
                     spec.get("accept", "float"))


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
    """A shard in memory (a `state_dict` chunk)."""

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
    """A buffer's state without its rollout payloads: the configuration, the slot table,
    counters, generator and sampler state (`state`: tensors and plain values, what a checkpoint's
    state object holds), and the shards it needs. `RolloutBuffer.snapshot()` takes one,
    `RolloutBuffer.from_snapshot(snapshot, shards)` builds a buffer back from it."""

    config: BufferConfig
    state: Mapping[str, Any]
    shards: tuple[ShardInfo, ...]

    @classmethod
    def from_state(cls, state: Any, extra_fields: Mapping[str, FieldSpec] | None = None) -> "BufferSnapshot":
        """The snapshot a `state_dict()` or checkpoint state describes (ValueError/TypeError if
        its config or slot table cannot be read; `adopt` validates the rest)."""
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a mapping, got {type(state).__name__}")
        check_int64(state)
        config = BufferConfig.from_json(state.get("config"), extra_fields=extra_fields)
        # The table must hold exactly `capacity` slots before anything is built for that capacity:
        # a config may claim any capacity, the tensors are what the state really carries.
        table = state.get("table")
        if not isinstance(table, Mapping):
            raise ValueError("state 'table' must be a mapping of slot tensors")
        for name in SlotTable.TENSORS:
            t = table.get(name)
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() != config.capacity:
                raise ValueError(f"state table[{name!r}] must be a 1-D tensor of the config's {config.capacity} slots")
        if table["live"].dtype != torch.bool or table["chunk"].dtype != torch.int64:
            raise ValueError("state table: 'live' must be bool and 'chunk' int64")
        ids, rows = torch.unique(table["chunk"][table["live"]], return_counts=True)
        return cls(config, state, tuple(ShardInfo(i, r) for i, r in zip(ids.tolist(), rows.tolist())))


class Persistence:
    """The persistence half of RolloutBuffer: its configuration, `state_dict` / `load_state_dict`,
    checkpoints and restores, and importing another run's rollouts. Kept apart from the replay
    orchestration (buffer.py), which it reaches only through the buffer's public parts: `settings`,
    `ledger`, `shards`, `generator`, `storage`, `checkpointer`."""

    def carry_reuse(self, handles: Handles, reuse: torch.Tensor) -> None:
        """Set use counts carried over from another run (`import_checkpoint(keep_reuse=True)`);
        rollouts already at max_reuse are evicted."""
        self.shards.release_all(self.ledger.carry_reuse(handles.slot, reuse.to(torch.int64)))

    def attach_checkpointer(self, checkpointer: ShardListener, durable: dict[int, str] | None = None) -> None:
        """Checkpoint this buffer through `checkpointer` from now on (the one way to attach one).
        `durable` maps shard ids already stored at the checkpointer's location to their keys;
        every other live shard is announced as sealed, so the next manifest waits for its upload."""
        if not isinstance(checkpointer, ShardListener):
            raise TypeError(f"checkpoint must be a Checkpointer (a ShardListener), got {type(checkpointer).__name__}")
        if self.shards.checkpointer is not None:
            raise ValueError("this buffer already has a checkpointer: detach_checkpointer() first")
        self.shards.checkpointer = checkpointer
        checkpointer.attach(self, known=durable or {})
        for sid in live_shards(self.slots)[0]:
            if sid not in (durable or {}):
                checkpointer.shard_sealed(sid)

    def detach_checkpointer(self) -> ShardListener | None:
        """Stop checkpointing; returns the checkpointer (not closed) or None."""
        checkpointer, self.shards.checkpointer = self.shards.checkpointer, None
        return checkpointer

    def config(self) -> BufferConfig:
        """This buffer's configuration, with the caps as they are now (checkpoints record its
        `to_json()`; `from_snapshot`/`from_checkpoint` rebuild a buffer from it)."""
        return self.settings.with_caps(self.max_staleness, self.max_reuse)

    def snapshot(self) -> BufferSnapshot:
        """This buffer's state without payloads (what a checkpoint publishes with its shards)."""
        ids, rows = live_shards(self.slots)
        return BufferSnapshot(self.config(), metadata_state(self),
                              tuple(ShardInfo(i, r) for i, r in zip(ids, rows)))

    @classmethod
    def from_snapshot(cls, snapshot: BufferSnapshot, shards: Mapping[int, ShardSource],
                      sampler: Sampler | None = None, storage: TieredStorage | None = None,
                      **overrides: Any) -> "RolloutBuffer":
        """A buffer rebuilt from `snapshot` and its shards (id -> ShardSource): the one way back,
        used by `from_checkpoint` (eager and lazy). The buffer is configured by `snapshot.config`;
        `overrides` replace behaviour settings (the caps, `overflow`, padding, `on_corrupt`); the
        layout (capacity and schema) must match the snapshot's. The sampler is rebuilt from the
        registry unless one is passed."""
        if sampler is None:
            sampler = sampler_from_state(snapshot.state.get("sampler"))
        buffer = cls(sampler=sampler, storage=storage, **{**snapshot.config.constructor_kwargs(), **overrides})
        try:
            buffer.restore_snapshot(snapshot, shards)
        except BaseException:
            buffer.close()
            raise
        return buffer

    def restore_snapshot(self, snapshot: BufferSnapshot, shards: Mapping[int, ShardSource]) -> None:
        """Replace this buffer's state by `snapshot` in place (`load_state_dict`, `from_snapshot`).
        Everything is validated against this buffer and the shards' row counts before anything
        changes; the shards are stored first and released again if adoption fails."""
        missing = [info.id for info in snapshot.shards if info.id not in shards]
        if missing:
            raise ValueError(f"snapshot shards {missing[:5]} have no source")
        self.shards.tick()  # a pending spill error surfaces now, not halfway through storing the chunks
        rows = {sid: source.rows for sid, source in shards.items()}
        self.shards.release_all(adopt(self, snapshot.state, rows, lambda sid: shards[sid].store(self.shards),
                                      self.shards.release))
        self.shards.release_all(self.ledger.advance(self.version)[1])  # a state past the cap loses those rollouts now
        self.shards.release_all(self.ledger.set_max_reuse(self.max_reuse))  # and those at this buffer's reuse cap

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: tensors and plain Python values (no pickle)."""
        return full_state(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from `state_dict()`. Validates everything before changing anything."""
        sizes = chunk_sizes(state, self.settings.fields())
        snapshot = BufferSnapshot.from_state(state, self.settings.extra_fields)
        self.restore_snapshot(snapshot, {cid: PackedShardSource(chunk_batch(state, cid, n)) for cid, n in sizes.items()})

    def checkpoint(self, tag: int | str | None = None, timeout: float | None = None) -> None:
        """Publish a manifest now and return once it is durable; raises CheckpointError if this
        publish fails. `tag` (e.g. the trainer's step) names it, so that `from_checkpoint(uri,
        tag=step)` restores exactly this state alongside the trainer's own checkpoint of that step."""
        if self.checkpointer is None:
            raise ValueError("this buffer has no checkpointer: pass checkpoint=Checkpointer(uri) to RolloutBuffer")
        self.checkpointer.publish(wait=True, timeout=timeout, tag=tag)

    @classmethod
    def from_checkpoint(
        cls,
        uri: str,
        *,
        endpoint_url: str | None = None,
        sampler: Sampler | None = None,
        storage: TieredStorage | None = None,
        checkpoint: ShardListener | bool = False,
        lazy: bool = False,
        progress: bool = True,
        manifest: str | None = None,
        tag: int | str | None = None,
        **kwargs: Any,
    ) -> "RolloutBuffer":
        """Restore a buffer from the last published manifest under `uri`.

        Slots, generations, advantages (priorities are recomputed from them), policy versions,
        reuse counts, sampler and RNG state come back exactly. Shards are fetched eagerly (with a
        progress bar) or, with `lazy=True` and a cold tier, on demand: only each shard's header
        and per-rollout fields are read at restore, its file is downloaded the first time a
        sample (or prefetch) needs its tokens.
        `checkpoint=True` keeps checkpointing to `uri` (a resumed job), or pass a Checkpointer.
        Built-in samplers are rebuilt from the manifest; a custom one must be passed as `sampler`.
        `manifest` names a specific manifest key, `tag` the one published by
        `checkpoint(tag=...)` (default: the newest, via LATEST).
        """
        return _reader().restore(cls, uri, endpoint_url=endpoint_url, sampler=sampler, storage=storage,
                       checkpoint=checkpoint, lazy=lazy, progress=progress, manifest_key=manifest, tag=tag, **kwargs)

    def import_checkpoint(self, uri: str, *, endpoint_url: str | None = None, version_offset: int = 0,
                          reprioritize=None, progress: bool = False, select=None,
                          keep_reuse: bool = False, tag: int | str | None = None) -> Handles:
        """Seed this buffer with another run's rollouts (read-only: nothing there is changed).

        Policy versions are shifted by `version_offset`; `reprioritize(batch: dict) -> advantages`
        may replace their advantages (e.g. rescored by the current critic). `select(i, n)` takes
        only some of the checkpoint's n shards (e.g. one rank's share); `keep_reuse` carries use
        counts over; `tag` reads the checkpoint published under that tag instead of LATEST.
        Returns the new rollouts' handles."""
        return _reader().import_rollouts(self, uri, endpoint_url=endpoint_url, version_offset=version_offset,
                               reprioritize=reprioritize, progress=progress, select=select, keep_reuse=keep_reuse,
                                          tag=tag)


class CheckpointReader(Protocol):
    """Reads checkpoints back (torchreplay.checkpoint.restore registers itself at import), so
    that `from_checkpoint` lives on the buffer while the buffer imports nothing of persistence."""

    def restore(self, cls: type, uri: str, **kwargs: Any) -> Any: ...

    def import_rollouts(self, buffer: Any, uri: str, **kwargs: Any) -> Any: ...


_checkpoint_reader: CheckpointReader | None = None


def use_checkpoint_reader(reader: CheckpointReader) -> None:
    global _checkpoint_reader
    _checkpoint_reader = reader


def _reader() -> CheckpointReader:
    if _checkpoint_reader is None:
        raise RuntimeError("no checkpoint reader registered: import torchreplay (or torchreplay.checkpoint)")
    return _checkpoint_reader


def live_shards(slots: SlotTable) -> tuple[list[int], list[int]]:
    """The shards holding live rollouts and how many each holds."""
    ids, rows = torch.unique(slots.chunk[slots.live], return_counts=True)
    return ids.tolist(), rows.tolist()


def metadata_state(buffer: "RolloutBuffer") -> dict[str, Any]:
    """All state except rollout payloads: what a checkpoint snapshots on the trainer thread."""
    return {"format_version": STATE_VERSION, "config": buffer.config().to_json(), **buffer.ledger.state(),
            "rng": buffer.generator.get_state()}


def full_state(buffer: "RolloutBuffer") -> dict[str, Any]:
    chunks = {}
    for sid, live in zip(*live_shards(buffer.slots)):
        b = buffer.storage.read_shard(sid)
        chunks[str(sid)] = {"offsets": b.offsets, "token": dict(b.token), "rollout": dict(b.rollout), "live_rows": live}
    return {**metadata_state(buffer), "chunks": chunks}


def chunk_sizes(state: Any, fields: Mapping[str, FieldSpec] | None = None) -> dict[int, int]:
    """Rows per chunk of a `full_state`, every chunk checked against the schema before anything is
    stored: chunks are adopted as they are, without add()'s validation, so a chunk missing a field
    or holding float tokens would load and break every sample after. `fields` is the buffer's
    schema; without it, the one the state's config describes (adopt refuses a config that is not
    the buffer's before it stores a chunk), where extra fields' specs are not recorded, so those
    are held to their row counts only. Raises ValueError naming the chunk, field and problem."""
    if not isinstance(state, Mapping) or not isinstance(state.get("chunks"), Mapping):
        raise TypeError("state must be a mapping from state_dict() (with 'chunks')")
    unchecked: set[str] = set()
    if fields is None:
        config = state.get("config")
        try:
            fields = BufferConfig(capacity=1, ref_logprobs=config["ref_logprobs"], routing=config["routing"],
                                  token_dtype=getattr(torch, config["token_dtype"])).fields()
            unchecked = set(config.get("extra_fields") or ())
        except (KeyError, TypeError, ValueError, AttributeError):
            fields = None  # a malformed config is not this buffer's: adopt refuses it before storing a chunk
    shard_fields = {k: v for k, v in (fields or {}).items() if k not in TABLE_FIELDS}
    sizes = {}
    for cid, c in state["chunks"].items():
        offsets = c.get("offsets") if isinstance(c, Mapping) else None
        if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1 or offsets.dtype != torch.int64:
            raise ValueError(f"state chunk {cid}: offsets must be a 1-D int64 tensor")
        if not str(cid).isdigit():
            raise ValueError(f"state chunk id {cid!r} is not a non-negative integer")
        if not isinstance(c.get("token"), Mapping) or not isinstance(c.get("rollout"), Mapping):
            raise ValueError(f"state chunk {cid}: 'token' and 'rollout' must be mappings of field name -> tensor")
        stored = {}
        for kind, group in ((TOKEN, c["token"]), (ROLLOUT, c["rollout"])):
            for name, t in group.items():
                if not isinstance(t, torch.Tensor) or t.dim() < 1:
                    raise ValueError(f"state chunk {cid}: field {name!r} must be a tensor of rows, "
                                     f"got {type(t).__name__}")
                if name in stored:
                    raise ValueError(f"state chunk {cid}: field {name!r} is both a token and a rollout field")
                stored[name] = (kind, t.dtype, tuple(t.shape[1:]), t.shape[0])
        try:
            if fields is not None:
                check_stored_fields(shard_fields, {k: v for k, v in stored.items() if k not in unchecked})
            check_stored_offsets(offsets, stored)
        except SchemaError as exc:
            raise ValueError(f"state chunk {cid}: {exc}") from exc
        sizes[int(cid)] = offsets.numel() - 1
    return sizes


def chunk_batch(state: Mapping[str, Any], cid: int, rows: int) -> PackedBatch:
    c = state["chunks"][str(cid)]
    return PackedBatch(n=rows, offsets=c["offsets"], token=dict(c["token"]), rollout=dict(c["rollout"]))


def adopt(buffer: "RolloutBuffer", state: Mapping[str, Any], chunk_rows: dict[int, int],
          store_chunk: Callable[[int], int], release_shard: Callable[[int, int], None]) -> list[tuple[int, int]]:
    """Validate `state` against `buffer` and the stored chunks' row counts, then adopt it.
    `store_chunk(old id) -> new shard id` brings one chunk into storage; `release_shard(id, rows)`
    gives rows back. All-or-nothing: the chunks are stored before anything else changes, and
    released again if a later step fails. Returns the (shard, rows) the buffer held before, and
    the stored chunks' rows that no live slot names, for the caller to release."""
    if state.get("format_version") not in READABLE_STATE_VERSIONS:
        raise ValueError(f"state format_version {state.get('format_version')!r} is not one of {READABLE_STATE_VERSIONS}")
    check_int64(state)  # a snapshot built by hand has not been through from_state
    try:
        layout = BufferConfig.from_json(state.get("config"), extra_fields=buffer.settings.extra_fields).layout()
    except (TypeError, ValueError) as exc:
        raise ValueError(f"state config is malformed: {exc}") from exc
    if layout != buffer.settings.layout():
        raise ValueError(f"state config (layout {layout}) does not match this buffer's {buffer.settings.layout()}")
    table = buffer.ledger.check_state(state)
    live_chunks = table.chunk[table.live]
    if not set(live_chunks.tolist()) <= set(chunk_rows):
        raise ValueError("state: a live slot names a chunk that is not stored")
    for cid, n in chunk_rows.items():
        rows_used = table.row[table.live][live_chunks == cid]
        if rows_used.numel() and (int(rows_used.min()) < 0 or int(rows_used.max()) >= n):
            raise ValueError(f"state chunk {cid}: a live slot names a row outside its {n} rows")
    rng = state.get("rng")
    if not isinstance(rng, torch.Tensor) or rng.dtype != torch.uint8:
        raise ValueError("state 'rng' must be a uint8 generator state tensor")
    live_per_chunk = dict(zip(*(x.tolist() for x in torch.unique(live_chunks, return_counts=True))))
    remap: dict[int, int] = {}
    old_rng = buffer.generator.get_state()
    try:
        for cid in sorted(live_per_chunk):
            remap[cid] = store_chunk(cid)
        buffer.generator.set_state(rng)
        old_table = buffer.ledger.adopt(table, state)
    except BaseException:
        buffer.generator.set_state(old_rng)
        for cid, sid in remap.items():
            release_shard(sid, chunk_rows[cid])
        raise
    live_slots = table.live_slots()
    table.chunk[live_slots] = torch.tensor([remap[c] for c in table.chunk[live_slots].tolist()], dtype=torch.int64)
    released = list(zip(*live_shards(old_table)))
    released += [(remap[cid], chunk_rows[cid] - live) for cid, live in live_per_chunk.items() if chunk_rows[cid] > live]
    return released
