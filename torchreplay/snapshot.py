"""Buffer state as tensors and plain values (no pickle): what `state_dict`, checkpoints and restores
read and write, and its validation before anything is adopted."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch

from torchreplay.schema import PackedBatch
from torchreplay.slots import SlotTable

if TYPE_CHECKING:
    from torchreplay.buffer import RolloutBuffer

STATE_VERSION = 1


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
