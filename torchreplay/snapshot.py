"""Buffer state as tensors and plain values (no pickle): what `state_dict`, checkpoints and restores
read and write, and its validation before anything is adopted."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch

from torchreplay.ledger import check_cap
from torchreplay.schema import FieldSpec, PackedBatch, default_fields
from torchreplay.slots import SlotTable

if TYPE_CHECKING:
    from torchreplay.assembly import Handles
    from torchreplay.buffer import RolloutBuffer
    from torchreplay.checkpoint import Checkpointer
    from torchreplay.samplers import Sampler
    from torchreplay.storage import TieredStorage

STATE_VERSION = 1


@dataclass(frozen=True)
class BufferConfig:
    """The arguments that shape a buffer's behaviour, validated once (ValueError/TypeError naming
    the argument). Checkpoints record `as_dict()`; the caps may later change on the buffer."""

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
        # Copies of the caller's containers: changing them later must not change this buffer.
        if self.routing is not None:
            object.__setattr__(self, "routing", tuple(self.routing))
        if self.extra_fields is not None:
            if not isinstance(self.extra_fields, Mapping):
                raise TypeError(f"extra_fields must be a mapping name -> FieldSpec, got {type(self.extra_fields).__name__}")
            object.__setattr__(self, "extra_fields", dict(self.extra_fields))

    def fields(self) -> dict[str, FieldSpec]:
        return default_fields(self.ref_logprobs, self.routing, self.extra_fields, self.token_dtype)

    def as_dict(self, max_staleness: int | None, max_reuse: int | None) -> dict[str, Any]:
        """Plain values for a checkpoint, with the caps as they are now. Extra fields' specs are
        not recorded (only their names): a restore needs `extra_fields=` passed in."""
        return {"capacity": self.capacity, "max_staleness": max_staleness, "max_reuse": max_reuse,
                "overflow": self.overflow, "padding_side": self.padding_side, "pad_token_id": self.pad_token_id,
                "ref_logprobs": self.ref_logprobs, "routing": list(self.routing) if self.routing else None,
                "token_dtype": str(self.token_dtype).removeprefix("torch."),
                "extra_fields": sorted(self.extra_fields or {})}


class Persistence:
    """The persistence half of RolloutBuffer: its configuration, `state_dict` / `load_state_dict`,
    checkpoints and restores, and importing another run's rollouts. Kept apart from the replay
    orchestration (buffer.py), which it reaches only through the buffer's public parts: `settings`,
    `ledger`, `shards`, `generator`, `storage`, `checkpointer`."""

    def carry_reuse(self, handles: Handles, reuse: torch.Tensor) -> None:
        """Set use counts carried over from another run (`import_checkpoint(keep_reuse=True)`);
        rollouts already at max_reuse are evicted."""
        self.shards.release_all(self.ledger.carry_reuse(handles.slot, reuse.to(torch.int64)))

    def config(self) -> dict[str, Any]:
        """The arguments that shape this buffer's behaviour, as plain values (checkpoints record it)."""
        return self.settings.as_dict(self.max_staleness, self.max_reuse)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: tensors and plain Python values (no pickle)."""
        return full_state(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from `state_dict()`. Validates everything before changing anything."""
        sizes = chunk_sizes(state)
        self.load_state(state, sizes, lambda cid: self.shards.put(chunk_batch(state, cid, sizes[cid])))

    def load_state(self, state: Mapping[str, Any], chunk_rows: dict[int, int], store_chunk) -> None:
        """`load_state_dict` for a state whose chunks live elsewhere (a checkpoint): `chunk_rows`
        gives each chunk's row count, `store_chunk(old id) -> new shard id` brings one in."""
        self.shards.tick()  # a pending spill error surfaces now, not halfway through storing the chunks
        self.shards.release_all(adopt(self, state, chunk_rows, store_chunk, self.shards.release))
        self.shards.release_all(self.ledger.advance(self.version)[1])  # a state past the cap loses those rollouts now

    def checkpoint(self, timeout: float | None = None) -> None:
        """Publish a manifest now and return once it is durable."""
        if self.checkpointer is None:
            raise ValueError("this buffer has no checkpointer: pass checkpoint=Checkpointer(uri) to RolloutBuffer")
        self.checkpointer.publish(wait=True, timeout=timeout)

    @classmethod
    def from_checkpoint(
        cls,
        uri: str,
        *,
        endpoint_url: str | None = None,
        sampler: Sampler | None = None,
        storage: TieredStorage | None = None,
        checkpoint: "Checkpointer | bool" = False,
        lazy: bool = False,
        progress: bool = True,
        manifest: str | None = None,
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
        `manifest` names a specific manifest key (default: the newest, via LATEST).
        """
        from torchreplay.checkpoint.restore import restore

        return restore(cls, uri, endpoint_url=endpoint_url, sampler=sampler, storage=storage,
                       checkpoint=checkpoint, lazy=lazy, progress=progress, manifest_key=manifest, **kwargs)

    def import_checkpoint(self, uri: str, *, endpoint_url: str | None = None, version_offset: int = 0,
                          reprioritize=None, progress: bool = False, select=None,
                          keep_reuse: bool = False) -> Handles:
        """Seed this buffer with another run's rollouts (read-only: nothing there is changed).

        Policy versions are shifted by `version_offset`; `reprioritize(batch: dict) -> advantages`
        may replace their advantages (e.g. rescored by the current critic). `select(i, n)` takes
        only some of the checkpoint's n shards (e.g. one rank's share); `keep_reuse` carries use
        counts over. Returns the new rollouts' handles."""
        from torchreplay.checkpoint.restore import import_rollouts

        return import_rollouts(self, uri, endpoint_url=endpoint_url, version_offset=version_offset,
                               reprioritize=reprioritize, progress=progress, select=select, keep_reuse=keep_reuse)


def live_shards(slots: SlotTable) -> tuple[list[int], list[int]]:
    """The shards holding live rollouts and how many each holds."""
    ids, rows = torch.unique(slots.chunk[slots.live], return_counts=True)
    return ids.tolist(), rows.tolist()


def metadata_state(buffer: "RolloutBuffer") -> dict[str, Any]:
    """All state except rollout payloads: what a checkpoint snapshots on the trainer thread."""
    return {"format_version": STATE_VERSION, "config": buffer.config(), **buffer.ledger.state(),
            "rng": buffer.generator.get_state()}


def full_state(buffer: "RolloutBuffer") -> dict[str, Any]:
    chunks = {}
    for sid, live in zip(*live_shards(buffer.slots)):
        b = buffer.storage.read_shard(sid)
        chunks[str(sid)] = {"offsets": b.offsets, "token": dict(b.token), "rollout": dict(b.rollout), "live_rows": live}
    return {**metadata_state(buffer), "chunks": chunks}


def chunk_sizes(state: Any) -> dict[int, int]:
    """Rows per chunk of a `full_state`, validated enough to size them."""
    if not isinstance(state, Mapping) or not isinstance(state.get("chunks"), Mapping):
        raise TypeError("state must be a mapping from state_dict() (with 'chunks')")
    sizes = {}
    for cid, c in state["chunks"].items():
        offsets = c.get("offsets") if isinstance(c, Mapping) else None
        if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1 or offsets.dtype != torch.int64:
            raise ValueError(f"state chunk {cid}: offsets must be a 1-D int64 tensor")
        if not str(cid).isdigit():
            raise ValueError(f"state chunk id {cid!r} is not a non-negative integer")
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
    if state.get("format_version") != STATE_VERSION:
        raise ValueError(f"state format_version {state.get('format_version')!r} != {STATE_VERSION}")
    if state.get("config") != buffer.config():
        raise ValueError(f"state config {state.get('config')} does not match this buffer {buffer.config()}")
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
