"""What RolloutBuffer's persistence methods do, as functions of the parts they use.

`RolloutBuffer.snapshot`, `state_dict`, `load_state_dict`, `restore_snapshot`, `from_snapshot`
and `attach_checkpointer` delegate here, passing their configuration, ledger, shard keeper and
generator explicitly: nothing here reaches into a buffer. A state is parsed and validated once
(snapshot.py), then adopted all-or-nothing (`restore`).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from torchreplay.config import BufferConfig
from torchreplay.ledger import Ledger
from torchreplay.samplers import Sampler, sampler_from_state
from torchreplay.errors import SchemaError
from torchreplay.schema import ROLLOUT, TOKEN, FieldSpec, PackedBatch, check_stored_fields, check_stored_offsets
from torchreplay.shards import ShardKeeper, ShardListener
from torchreplay.slots import TABLE_FIELDS
from torchreplay.snapshot import BufferSnapshot, PackedShardSource, ShardSource, current_state, live_shards
from torchreplay.storage import TieredStorage


def snapshot_of(config: BufferConfig, ledger: Ledger, generator: torch.Generator) -> BufferSnapshot:
    """The state of a buffer with this configuration, ledger and generator, as a value (copies)."""
    return BufferSnapshot(config, ledger.state(), generator.get_state())


def full_state(snapshot: BufferSnapshot, storage: TieredStorage) -> dict[str, Any]:
    """`snapshot`'s state with the live shards' payloads read from `storage` (`state_dict()`)."""
    shards = {}
    for info in snapshot.shards:
        b = storage.read_shard(info.id)
        shards[str(info.id)] = {"offsets": b.offsets, "token": dict(b.token), "rollout": dict(b.rollout),
                                "live_rows": info.live_rows}
    return {**snapshot.state, "shards": shards}


def parse_full_state(state: Any, config: BufferConfig) -> tuple[BufferSnapshot, dict[int, ShardSource]]:
    """A `full_state` read for a buffer configured by `config`: the snapshot and one in-memory
    source per shard, every part checked (the shards against the buffer's schema) before anything
    is stored. ValueError/TypeError naming the part."""
    if not isinstance(state, Mapping):
        raise TypeError("state must be a mapping from state_dict() (with 'shards')")
    state = current_state(state)
    if not isinstance(state.get("shards"), Mapping):
        raise TypeError("state must be a mapping from state_dict() (with 'shards')")
    snapshot = BufferSnapshot.from_state(state, config.extra_fields)
    check_layout(snapshot.config, config)
    sizes = shard_sizes(state["shards"], config.fields())
    return snapshot, {sid: PackedShardSource(shard_batch(state["shards"][str(sid)], n)) for sid, n in sizes.items()}


def shard_sizes(shards: Mapping[Any, Any], fields: Mapping[str, FieldSpec]) -> dict[int, int]:
    """Rows per shard of a `full_state`, every shard checked against the schema `fields` before
    anything is stored: shards are adopted as they are, without add()'s validation, so a shard
    missing a field or holding float tokens would load and break every sample after. Raises
    ValueError naming the shard, field and problem."""
    shard_fields = {k: v for k, v in fields.items() if k not in TABLE_FIELDS}
    sizes = {}
    for sid, c in shards.items():
        offsets = c.get("offsets") if isinstance(c, Mapping) else None
        if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1 or offsets.dtype != torch.int64:
            raise ValueError(f"state shard {sid}: offsets must be a 1-D int64 tensor")
        if not str(sid).isdigit():
            raise ValueError(f"state shard id {sid!r} is not a non-negative integer")
        if not isinstance(c.get("token"), Mapping) or not isinstance(c.get("rollout"), Mapping):
            raise ValueError(f"state shard {sid}: 'token' and 'rollout' must be mappings of field name -> tensor")
        stored = {}
        for kind, group in ((TOKEN, c["token"]), (ROLLOUT, c["rollout"])):
            for name, t in group.items():
                if not isinstance(t, torch.Tensor) or t.dim() < 1:
                    raise ValueError(f"state shard {sid}: field {name!r} must be a tensor of rows, "
                                     f"got {type(t).__name__}")
                if name in stored:
                    raise ValueError(f"state shard {sid}: field {name!r} is both a token and a rollout field")
                stored[name] = (kind, t.dtype, tuple(t.shape[1:]), t.shape[0])
        try:
            check_stored_fields(shard_fields, stored)
            check_stored_offsets(offsets, stored)
        except SchemaError as exc:
            raise ValueError(f"state shard {sid}: {exc}") from exc
        sizes[int(sid)] = offsets.numel() - 1
    return sizes


def shard_batch(shard: Mapping[str, Any], rows: int) -> PackedBatch:
    return PackedBatch(n=rows, offsets=shard["offsets"], token=dict(shard["token"]), rollout=dict(shard["rollout"]))


def check_layout(recorded: BufferConfig, config: BufferConfig) -> None:
    """ValueError unless a state recorded under `recorded` fits a buffer configured by `config`
    (the same capacity and schema; caps, padding and sampler settings may differ)."""
    if recorded.layout() != config.layout():
        raise ValueError(f"state config (layout {recorded.layout()}) does not match this buffer's {config.layout()}")


def restore(snapshot: BufferSnapshot, sources: Mapping[int, ShardSource], config: BufferConfig, ledger: Ledger,
            keeper: ShardKeeper, generator: torch.Generator) -> None:
    """Replace the state of the buffer made of `ledger`, `keeper` and `generator` (configured by
    `config`) by `snapshot`, whose shards come from `sources` (old id -> source). Everything is
    checked against the configuration and the sources' row counts first; the shards are stored
    next and released again if adoption fails; then the buffer's own caps hold (what they put
    past a cap is evicted)."""
    check_layout(snapshot.config, config)
    missing = [info.id for info in snapshot.shards if info.id not in sources]
    if missing:
        raise ValueError(f"snapshot shards {missing[:5]} have no source")
    keeper.tick()  # a pending spill error surfaces now, not halfway through storing the shards
    rows = {sid: source.rows for sid, source in sources.items()}
    columns = snapshot.ledger.table.columns
    live = columns["live"]
    for info in snapshot.shards:
        used = columns["row"][live & (columns["shard"] == info.id)]
        if int(used.max()) >= rows[info.id]:
            raise ValueError(f"state shard {info.id}: a live slot names a row outside its {rows[info.id]} rows")
    new_ids: dict[int, int] = {}
    old_rng = generator.get_state()
    try:
        for info in snapshot.shards:
            new_ids[info.id] = sources[info.id].store(keeper)
        generator.set_state(snapshot.rng)
        old_table = ledger.adopt(snapshot.ledger, new_ids)
    except BaseException:
        generator.set_state(old_rng)
        for old, new in new_ids.items():
            keeper.release(new, rows[old])
        raise
    keeper.release_all(list(zip(*live_shards(old_table))))
    keeper.release_all([(new_ids[i.id], rows[i.id] - i.live_rows) for i in snapshot.shards if rows[i.id] > i.live_rows])
    keeper.release_all(ledger.advance(ledger.version)[1])  # a state past the cap loses those rollouts now
    keeper.release_all(ledger.set_max_reuse(ledger.max_reuse))  # and those at this buffer's reuse cap


def rebuild(cls: Callable[..., Any], snapshot: BufferSnapshot, sources: Mapping[int, ShardSource],
            sampler: Sampler | None, storage: TieredStorage | None, overrides: Mapping[str, Any]) -> Any:
    """A new buffer (`cls(...)`) configured by `snapshot.config` with `overrides`, holding
    `snapshot`'s state; the sampler is rebuilt through the registry unless one is passed. A
    buffer whose restore fails is closed."""
    if sampler is None:
        sampler = sampler_from_state(snapshot.ledger.sampler)
    buffer = cls(sampler=sampler, storage=storage, **{**snapshot.config.constructor_kwargs(), **overrides})
    try:
        buffer.restore_snapshot(snapshot, sources)
    except BaseException:
        buffer.close()
        raise
    return buffer


def attach_checkpointer(keeper: ShardKeeper, checkpointer: ShardListener, owner: Any, live_shard_ids: list[int],
                        durable: dict[int, str] | None) -> None:
    """Make `checkpointer` the listener of `keeper`'s shards for `owner` (a buffer). `durable` maps
    shard ids already stored at the checkpointer's location to their keys; every other shard in
    `live_shard_ids` is announced as sealed, so the next manifest waits for its upload."""
    if not isinstance(checkpointer, ShardListener):
        raise TypeError(f"checkpoint must be a Checkpointer (a ShardListener), got {type(checkpointer).__name__}")
    if keeper.checkpointer is not None:
        raise ValueError("this buffer already has a checkpointer: detach_checkpointer() first")
    keeper.checkpointer = checkpointer
    checkpointer.attach(owner, known=durable or {})
    for sid in live_shard_ids:
        if sid not in (durable or {}):
            checkpointer.shard_sealed(sid)


def detach_checkpointer(keeper: ShardKeeper) -> ShardListener | None:
    """Stop `keeper`'s shards reaching its checkpointer; returns that checkpointer (not closed) or None."""
    checkpointer, keeper.checkpointer = keeper.checkpointer, None
    return checkpointer


def publish(checkpointer: ShardListener | None, tag: int | str | None, timeout: float | None) -> None:
    """Publish a manifest through `checkpointer` now and wait until it is durable."""
    if checkpointer is None:
        raise ValueError("this buffer has no checkpointer: pass checkpoint=Checkpointer(uri) to RolloutBuffer")
    checkpointer.publish(wait=True, timeout=timeout, tag=tag)
