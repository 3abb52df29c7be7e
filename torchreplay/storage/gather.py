"""One sampled batch's rows from storage: a `Gather` (sources plus a row map) over pinned shards.

Batch assembly pins the shards a batch needs when it plans the batch (trainer thread), as a
`PinnedShards`; it asks for the gather once, inside a `with` block on that object (any thread),
and the block's exit unpins them. In between the shards' files and copies stay, whatever the
trainer evicts meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from torchreplay.schema import PackedBatch
from torchreplay.storage.policies import HotPolicy
from torchreplay.storage.reads import ColdReader, ReadCounts, row_base, same_layout
from torchreplay.storage.table import CorruptRows, ShardRecord, ShardTable


@dataclass(frozen=True)
class Gather:
    """Where the rows of a sampled batch come from: row k is row index[k] of sources[source[k]];
    its tokens are [starts[k], starts[k] + lengths[k]) of that source's token tensors. A source
    whose token tensors are on the storage's device (device-tier copies, cold rows read straight
    there) has on_device[i] set; the rest are in host memory."""

    sources: list[PackedBatch]
    source: torch.Tensor  # [n] int64
    index: torch.Tensor  # [n] int64
    starts: torch.Tensor  # [n] int64
    lengths: torch.Tensor  # [n] int64
    on_device: list[bool] = field(default_factory=list)

    def rollout_rows(self) -> torch.Tensor:
        """Row k's position in the sources' rollout columns laid end to end."""
        return row_base(self.sources, 0)[self.source] + self.index


class PinnedShards:
    """Shards pinned for one batch, from creation until the `with` block on it exits (or
    `release()`), on whichever thread that is."""

    def __init__(self, table: ShardTable, shard_ids: list[int], released: Callable[[], None]) -> None:
        self.shard_ids = tuple(shard_ids)
        self.records = table.pin(self.shard_ids)
        self._table = table
        self._released = released
        self._open = True

    def __enter__(self) -> "PinnedShards":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        """Unpin (once); files of shards that died meanwhile are deleted now, on this thread."""
        if self._open:
            self._open = False
            self._table.unpin(self.shard_ids)
            self._released()


def gather_rows(pinned: PinnedShards, shard_of: torch.Tensor, rows: torch.Tensor, fields: list[str],
                reader: ColdReader, reads: ReadCounts, policy: HotPolicy, device_policy: HotPolicy,
                lock, device: torch.device | None, stage: torch.device | None) -> Gather:
    """Rows for a sampled batch: position k wants row rows[k] of shard id shard_of[k]. Hot shards
    come back as themselves, cold rows as freshly read batches (those of shards that agree on their
    fields as one batch, read in one reader call). See TieredStorage.gather."""
    records = list(pinned.records)
    with lock:
        tokens = [s.token for s in records]
        device_tokens = [s.device_token if device is not None else None for s in records]
    shard_ids, by_id = torch.sort(torch.tensor([s.id for s in records], dtype=torch.int64))
    position = by_id[torch.searchsorted(shard_ids, shard_of)]  # index into `records` for each row
    sources: list[PackedBatch] = []
    on_device: list[bool] = []
    source_of_shard = [-1] * len(records)
    for i, (record, token, device_token) in enumerate(zip(records, tokens, device_tokens)):
        if device_token is not None:
            source_of_shard[i] = len(sources)
            reads.add("device_hits", 1)
            device_policy.touched(record.id)
            policy.touched(record.id)  # in use: worth keeping hot for when the device copy goes
            if device.type == "cuda":
                # This thread's stream reads the copy; if the trainer drops it meanwhile, its
                # memory must not be reused before these reads are done.
                stream = torch.cuda.current_stream(device)
                for t in device_token.values():
                    t.record_stream(stream)
            sources.append(PackedBatch(n=record.n, offsets=record.offsets, token=device_token, rollout=record.rollout))
            on_device.append(True)
        elif token is not None:
            source_of_shard[i] = len(sources)
            reads.add("hot_hits", 1)
            policy.touched(record.id)
            sources.append(PackedBatch(n=record.n, offsets=record.offsets, token=token, rollout=record.rollout))
            on_device.append(False)
    source = torch.tensor(source_of_shard, dtype=torch.int64)[position]
    index = rows.clone()
    cold = [i for i, token in enumerate(tokens) if token is None and device_tokens[i] is None]
    if cold:
        _add_cold(records, cold, position, rows, fields, reader, stage, sources, on_device, source, index)
    return _with_row_map(sources, source, index, on_device)


def _add_cold(records: list[ShardRecord], cold: list[int], position: torch.Tensor, rows: torch.Tensor,
              fields: list[str], reader: ColdReader, stage: torch.device | None, sources: list[PackedBatch],
              on_device: list[bool], source: torch.Tensor, index: torch.Tensor) -> None:
    """Read the cold shards' rows and point `source`/`index` at them (raises their CorruptRows)."""
    if same_layout([records[i] for i in cold], fields):
        at = (source < 0).nonzero().flatten()
        cold_index = torch.full((len(records),), -1, dtype=torch.int64)
        cold_index[cold] = torch.arange(len(cold))
        which = cold_index[position[at]]  # each cold row's shard, as an index into cold_records
        cold_records = [records[i] for i in cold]
        got = reader.read(cold_records, which, rows[at], fields, stage)
        for i in sorted(got.failures):
            raise got.failures[i]
        where_rows = row_base(cold_records, 0)[which] + rows[at]
        rollout = {name: torch.cat([s.rollout[name] for s in cold_records])[where_rows]
                   for name in cold_records[0].rollout}
        source[at] = len(sources)
        index[at] = torch.arange(at.numel())
        sources.append(PackedBatch(n=at.numel(), offsets=got.offsets, rollout=rollout,
                                   token={name: t for (name, _, _), t in got.values.items()}))
        on_device.append(stage is not None)
        return
    where = [(position == i).nonzero().flatten() for i in cold]
    got_each = reader.read_each([(records[i], rows[at]) for i, at in zip(cold, where)], fields, stage)
    for at, part in zip(where, got_each):
        if isinstance(part, CorruptRows):
            raise part
        batch, batch_index = part
        source[at] = len(sources)
        index[at] = batch_index
        sources.append(batch)
        on_device.append(stage is not None)


def _with_row_map(sources: list[PackedBatch], source: torch.Tensor, index: torch.Tensor,
                  on_device: list[bool]) -> Gather:
    """The Gather, with each row's token start and length from the sources' offsets laid end to
    end (each source has n + 1 of them)."""
    offsets = torch.cat([b.offsets for b in sources]) if sources else torch.zeros(1, dtype=torch.int64)
    at = row_base(sources, 1)[source] + index
    starts = offsets[at]
    return Gather(sources, source, index, starts, offsets[at + 1] - starts, on_device)
