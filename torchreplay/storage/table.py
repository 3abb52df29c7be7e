"""The shard table: every shard a TieredStorage holds, by id, and what other modules may see of one.

`ShardRecord` is the storage's own mutable record of a shard (its copies, file, pins); it never
leaves the storage package. Other modules get a `ShardView`, a frozen snapshot of the facts they
need (rows, fields, file and its header), and ask the storage for the bytes (`export_shard`).

Threads: the trainer thread adds and removes shards. Prefetch and checkpoint threads only pin,
read and unpin: `lock` guards the pin counts, the copy pointers a reader takes and the move of a
dead shard into `dying`, where it stays (files and copies intact) while pinned or being written.
"""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from torchreplay.errors import StorageError
from torchreplay.schema import PackedBatch
from torchreplay.storage import format as fmt


class CorruptRows(StorageError):
    """Rows of a shard could not be read back intact (checksum mismatch, vanished or truncated file)."""

    def __init__(self, shard_id: int, rows: list[int], reason: str) -> None:
        super().__init__(f"shard {shard_id}: {len(rows)} rollout(s) unreadable: {reason}")
        self.shard_id = shard_id
        self.rows = rows
        self.reason = reason


class MissingShard(StorageError):
    """What a lazily restored shard's `fetch` raises when its object no longer exists: its rows
    are lost for good, and are evicted as unreadable ones are (CorruptRows)."""


@dataclass(frozen=True)
class ShardView:
    """What other modules may know of a stored shard, as of the call that returned it.

    `path` is where its file is (or will be: while its spill runs, or before a lazily restored
    shard is fetched); None without a file (hot-only storage, or a failed spill). `header` is known
    once the file is written. `file_bytes`: the file's size, exact once the header is known, else
    an upper bound from its tensors."""

    id: int
    n: int
    live_rows: int
    token_fields: tuple[str, ...]
    token_bytes: int
    file_bytes: int
    path: str | None
    header: fmt.ShardHeader | None
    hot: bool  # a copy of its token data in host memory
    on_device: bool  # a device-tier copy
    remote: bool  # lazily restored, its file not downloaded yet


@dataclass(frozen=True)
class ShardExport:
    """A pinned shard's bytes for a copy elsewhere (a checkpoint upload): its complete, verified
    `path` with its `header`, or, where it has no file (hot-only storage, a failed spill), the
    hot copy as a `batch` (header None: the caller lays the file out)."""

    shard_id: int
    path: str | None
    header: fmt.ShardHeader | None
    batch: PackedBatch | None


@dataclass
class ShardRecord:
    id: int
    n: int
    offsets: torch.Tensor
    rollout: dict[str, torch.Tensor]
    token: dict[str, torch.Tensor] | None  # hot copy; None once dropped
    token_bytes: int
    live_rows: int
    path: str | None = None
    header: fmt.ShardHeader | None = None
    write: Future | None = None  # the spill writing `path`, until the trainer settles it (Tiers.poll)
    pins: int = 0
    dead: bool = False
    token_fields: tuple[str, ...] = field(default_factory=tuple)
    # Set for a shard restored lazily: downloads its file to `path` on first use.
    remote: Callable[[str], None] | None = None
    fetch_lock: threading.Lock = field(default_factory=threading.Lock)
    crc_table: tuple[torch.Tensor, dict[str, int]] | None = None  # see ColdReader.crc_table
    device_token: dict[str, torch.Tensor] | None = None  # device-tier copy of `token`, if any

    def batch(self) -> PackedBatch:
        assert self.token is not None
        return PackedBatch(n=self.n, offsets=self.offsets, token=self.token, rollout=self.rollout)

    def file_bytes(self) -> int:
        """Exact once the header is known, else an upper bound from the tensors (every block and
        the header start on a 4 KiB boundary, and the header holds one checksum of at most 12
        bytes per 64 KiB page, which data // 4096 covers)."""
        if self.header is not None:
            return int(self.header.file_bytes)
        data = self.token_bytes + self.offsets.numel() * self.offsets.element_size()
        data += sum(t.numel() * t.element_size() for t in self.rollout.values())
        blocks = 1 + len(self.token_fields) + len(self.rollout)
        return data + (blocks + 2) * fmt.ALIGN + data // 4096

    def view(self) -> ShardView:
        return ShardView(id=self.id, n=self.n, live_rows=self.live_rows, token_fields=self.token_fields,
                         token_bytes=self.token_bytes, file_bytes=self.file_bytes(), path=self.path,
                         header=self.header, hot=self.token is not None, on_device=self.device_token is not None,
                         remote=self.remote is not None)


class ShardTable:
    """Live shards by id, plus the dead ones that must wait (pinned, or their spill running)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._live: dict[int, ShardRecord] = {}
        self._dying: dict[int, ShardRecord] = {}
        self._ids = itertools.count()

    def new_id(self) -> int:
        return next(self._ids)

    def add(self, record: ShardRecord) -> None:
        self._live[record.id] = record

    def __getitem__(self, shard_id: int) -> ShardRecord:
        """A live shard (trainer thread)."""
        return self._live[shard_id]

    def get(self, shard_id: int) -> ShardRecord | None:
        return self._live.get(shard_id)

    def __len__(self) -> int:
        return len(self._live)

    def live(self) -> list[ShardRecord]:
        return list(self._live.values())

    def with_dying(self) -> list[ShardRecord]:
        """Live and dying shards (trainer thread: settling spills)."""
        with self.lock:
            return list(self._live.values()) + list(self._dying.values())

    def held(self, shard_ids: Iterable[int]) -> list[ShardRecord]:
        """Live or dying shards, any thread: a pinned shard is one of them until unpinned."""
        with self.lock:
            return [self._held(sid) for sid in shard_ids]

    def _held(self, shard_id: int) -> ShardRecord:
        record = self._live.get(shard_id)
        if record is None:
            record = self._dying.get(shard_id)
        if record is None:
            raise KeyError(f"shard {shard_id} is neither live nor pinned")
        return record

    def pin(self, shard_ids: Iterable[int]) -> list[ShardRecord]:
        """Pin live shards: their files and copies stay until unpinned, even if they die."""
        with self.lock:
            records = [self._live[sid] for sid in shard_ids]
            for record in records:
                record.pins += 1
        return records

    def unpin(self, shard_ids: Iterable[int]) -> None:
        with self.lock:
            for sid in shard_ids:
                self._held(sid).pins -= 1

    def remove(self, shard_id: int) -> ShardRecord:
        """A shard died (trainer thread): it leaves the live set and waits in `dying`."""
        with self.lock:
            record = self._live.pop(shard_id)
            record.dead = True
            record.device_token = None
            self._dying[shard_id] = record
        return record

    def deletable(self) -> list[ShardRecord]:
        """Take the dying shards that nothing holds any more (neither a pin nor a running spill)."""
        with self.lock:
            ready = [r for r in self._dying.values() if r.pins == 0 and r.write is None]
            for record in ready:
                del self._dying[record.id]
        return ready
