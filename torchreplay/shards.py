"""ShardKeeper: a buffer's shards in TieredStorage, and the Checkpointer that follows them.

Every shard the buffer writes, adopts or lets go passes through here, so the checkpointer (any
ShardListener) hears of each one: it uploads sealed shards and forgets released ones. On every
buffer call `tick` surfaces a storage failure and lets the checkpointer raise its own, if its
policy says so, and publish when one is due.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

import torch

from torchreplay.assembly import subset
from torchreplay.schema import PackedBatch
from torchreplay.slots import SlotTable
from torchreplay.storage import CorruptRows, TieredStorage


@runtime_checkable
class ShardListener(Protocol):
    """What follows a buffer's shards: the Checkpointer implements it. The buffer calls it and
    never imports it, so persistence depends on the buffer and not the other way round."""

    def attach(self, buffer: Any, known: dict[int, str] | None = None) -> None:
        """Bound to `buffer`; `known` maps shard ids already durable to their object keys."""

    def shard_sealed(self, shard_id: int) -> None:
        """A shard was written (or adopted) and will not change."""

    def shard_released(self, shard_id: int) -> None:
        """A shard holds no live rollout any more."""

    def check(self) -> None:
        """Raise a background failure the caller should see now (or nothing)."""

    def maybe_publish(self) -> None:
        """Persist the buffer's state if one is due (called on buffer calls)."""

    def publish(self, wait: bool = True, timeout: float | None = None, tag: Any = None) -> None:
        """Persist the buffer's state now."""

    def metrics(self) -> dict[str, float]:
        """Numbers merged into the buffer's metrics()."""

    def close(self, final: bool = True) -> None:
        """Stop; with `final`, persist once more first."""


class ShardKeeper:
    """Puts and releases shards, tells the checkpointer, compacts mostly dead shards."""

    def __init__(self, storage: TieredStorage) -> None:
        self.storage = storage
        self.checkpointer: ShardListener | None = None

    def put(self, batch: PackedBatch) -> int:
        return self._sealed(self.storage.put(batch))

    def adopt(self, path: str) -> int:
        """A shard file written elsewhere (a downloaded checkpoint shard) becomes a shard here."""
        return self._sealed(self.storage.adopt(path))

    def adopt_remote(self, meta: Any, fetch: Callable[[str], None]) -> int:
        """A shard whose header and small blocks are read (`meta`); `fetch(path)` downloads its
        file the first time its tokens are needed."""
        return self._sealed(self.storage.adopt_remote(meta, fetch))

    def _sealed(self, shard_id: int) -> int:
        if self.checkpointer is not None:
            self.checkpointer.shard_sealed(shard_id)
        return shard_id

    def release(self, shard_id: int, rows: int) -> None:
        if self.storage.release(shard_id, rows) and self.checkpointer is not None:
            self.checkpointer.shard_released(shard_id)

    def release_all(self, released: list[tuple[int, int]]) -> None:
        for shard_id, rows in released:
            self.release(shard_id, rows)

    def tick(self) -> None:
        """Surface background failures, and publish a manifest when one is due."""
        self.storage.check()
        if self.checkpointer is not None:
            self.checkpointer.check()
            self.checkpointer.maybe_publish()

    def compact(self, slots: SlotTable, on_corrupt: Callable[[CorruptRows], None]) -> None:
        """Rewrite each mostly dead shard's live rows into a new shard, so its file and memory go.
        The slots keep their rollouts: nothing a caller can see changes."""
        for shard_id in self.storage.compaction_candidates():
            live = ((slots.shard == shard_id) & slots.live).nonzero().flatten()
            try:
                with self.storage.pinned([shard_id]):
                    batch, index = self.storage.fetch(shard_id, slots.row[live])
            except CorruptRows as exc:
                on_corrupt(exc)
                continue
            new_id = self.put(subset(batch, index))
            slots.shard[live] = new_id
            slots.row[live] = torch.arange(live.numel())
            self.release(shard_id, live.numel())
            self.storage.counters["compactions"] += 1

    def close(self) -> None:
        try:
            if self.checkpointer is not None:
                self.checkpointer.close()
        finally:
            self.storage.close()
