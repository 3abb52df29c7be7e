"""Tiered rollout storage: a hot tier in (pinned) host RAM under a byte budget, write-through to
shard files on local NVMe, and page-in of just the rows and fields a batch needs.

The storage layer knows nothing of priorities; it stores shards of packed rollouts, addressed by
(shard id, row). TieredStorage composes its parts:

- policies.py: which hot or device copies go first;
- table.py: the shard table, and the frozen ShardView other modules see;
- tiers.py: the tiers, their budgets, spill and lazy downloads;
- reads.py: the cold read planner (host, staged and scan reads; reader_abi.py types its rows);
- gather.py: one sampled batch's rows over pinned shards.

Threads: the trainer thread owns every shard's bookkeeping; the spill thread only writes immutable
shard bytes and completes a future; prefetch and checkpoint threads only read pinned shards. The
table's lock guards pin counts, copy pointers and deferred deletions, the one state those threads
share (see docs/architecture.md).
"""

from __future__ import annotations

import os
from typing import Callable, Iterable

import torch

from torchreplay.checks import check_int
from torchreplay.errors import StorageError
from torchreplay.schema import PackedBatch
from torchreplay.storage import format as fmt
from torchreplay.storage.gather import Gather, PinnedShards, gather_rows
from torchreplay.storage.io import IOBackend, make_io, storage_error
from torchreplay.storage.policies import HotPolicy, make_policy
from torchreplay.storage.reads import ColdReader, ReadCounts
from torchreplay.storage.recycle import HostPool
from torchreplay.storage.table import ShardExport, ShardRecord, ShardTable, ShardView
from torchreplay.storage.tiers import Tiers

COUNTERS = ("hot_hits", "cold_reads", "cold_bytes_read", "cold_requests", "spilled_shards", "spilled_bytes",
            "dropped_hot", "deleted_shards", "corrupt_rows", "compactions", "fetched_shards", "device_hits",
            "device_dropped", "device_staged_bytes")


def resolve_device(device: str | torch.device) -> torch.device:
    """A torch.device with its index filled in, refused (ValueError) where it cannot be used."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must name a torch device, got {device!r}: {exc}") from exc
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={str(device)!r} needs CUDA, and torch.cuda.is_available() is False "
                             "(device='cpu' runs the device tier's code path in host memory)")
        index = torch.cuda.current_device() if resolved.index is None else resolved.index
        if index >= torch.cuda.device_count():
            raise ValueError(f"device={str(device)!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        return torch.device("cuda", index)
    if resolved.type != "cpu":
        raise ValueError(f"device must be a CUDA device or 'cpu', got {device!r}")
    return resolved


def _check_arguments(hot_bytes, spill_dir, device_bytes, compact_below, compact_min_rows) -> None:
    check_int(hot_bytes, "hot_bytes", low=0, allow_none=True, error=ValueError)
    if hot_bytes is not None and spill_dir is None:
        raise ValueError("hot_bytes needs spill_dir: without a cold tier nothing can leave RAM")
    check_int(device_bytes, "device_bytes", low=0, error=ValueError)
    if not 0 <= compact_below < 1:
        raise ValueError(f"compact_below must be in [0, 1), got {compact_below!r}")
    check_int(compact_min_rows, "compact_min_rows", low=1)


def _open_spill_dir(spill_dir: str) -> None:
    try:
        os.makedirs(spill_dir, exist_ok=True)
    except OSError as exc:
        raise storage_error(exc, "cannot create spill_dir", spill_dir) from exc
    if not os.access(spill_dir, os.W_OK | os.X_OK):
        raise StorageError(f"spill_dir {spill_dir}: permission denied")


class TieredStorage:
    """Where rollout bytes live.

    Args:
        hot_bytes: budget for hot token data in host RAM (bytes); None = unbounded (hot-only).
        spill_dir: directory for shard files; None = no cold tier (everything stays hot).
        device_bytes: budget (bytes) of a device tier: copies of the token data of recently added
            shards kept in VRAM, so sampling them to `device` copies nothing from the host. Dropping
            one is free (host RAM or disk still holds it). 0 = no device tier.
        device: where `sample(..., device=device)` assembles batches, and where the device tier
            lives; cold pages then land there straight from disk (kvikio), verified on the device.
            Default "cuda" when device_bytes > 0, else None (batches are assembled in host memory
            and moved). "cpu" runs this code path without a GPU (a second copy in RAM: for tests).
        io: "auto", "kvikio" or "posix".
        policy: "lru" or "newest" (or a HotPolicy), what stays hot.
        device_policy: the same choice for the device tier.
        compact_below: a shard whose live fraction falls below this is rewritten by the buffer.
        compact_min_rows: only shards of at least this many rows are compacted: rewriting a small
            shard's few survivors costs a file per call and frees little.
        direct: open shard files with O_DIRECT (POSIX back end).
        io_threads: threads doing pread/pwrite.
        pin_memory: pin hot copies (default: when CUDA is available).
    """

    def __init__(
        self,
        hot_bytes: int | None = None,
        spill_dir: str | os.PathLike | None = None,
        device_bytes: int = 0,
        io: str = "auto",
        policy: str | HotPolicy = "lru",
        device: str | torch.device | None = None,
        device_policy: str | HotPolicy = "lru",
        compact_below: float = 0.25,
        direct: bool = False,
        io_threads: int = 4,
        pin_memory: bool | None = None,
        compact_min_rows: int = 16,
    ) -> None:
        _check_arguments(hot_bytes, spill_dir, device_bytes, compact_below, compact_min_rows)
        policy = make_policy(policy, "policy")
        device_policy = make_policy(device_policy, "device_policy")
        if device_policy is policy:
            raise ValueError("device_policy must be its own HotPolicy object, not the host tier's")
        if device_bytes and device is None:
            device = "cuda"
        self.device = None if device is None else resolve_device(device)
        self.device_bytes = device_bytes
        self.policy = policy
        self.device_policy = device_policy
        self.compact_below = compact_below
        self.compact_min_rows = compact_min_rows
        self.pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.spill_dir = None if spill_dir is None else os.fspath(spill_dir)
        self.io: IOBackend | None = None
        if self.spill_dir is not None:
            _open_spill_dir(self.spill_dir)
            self.io = make_io(io, threads=io_threads, direct=direct)
        self.io_name = self.io.name if self.io else "none"
        self.host_pool = HostPool(pin=self.pin)
        self.optional_fields: set[str] = set()
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.reads = ReadCounts(self.counters)  # hot hits, cold reads: held back by a call until it succeeds
        self._table = ShardTable()
        self._tiers = Tiers(self._table, self.counters, self.host_pool, hot_bytes=hot_bytes,
                            device_bytes=device_bytes, device=self.device, policy=policy,
                            device_policy=device_policy, spill_dir=self.spill_dir, io=self.io)
        self._reader = ColdReader(self.io, self.reads, self._tiers.ensure_local)

    # ------------------------------------------------------------------------------- lifecycle
    @property
    def tiered(self) -> bool:
        return self.io is not None

    @property
    def hot_budget(self) -> float:
        return self._tiers.hot_budget

    def check(self) -> None:
        """Raise a background (spill) failure on the caller's thread, once."""
        self._tiers.check()

    def flush(self) -> None:
        """Wait until every sealed shard is on disk, then surface any spill failure."""
        self._tiers.flush()
        self.check()

    def close(self) -> None:
        self._tiers.close()
        if self.io is not None:
            self.io.close()

    # ---------------------------------------------------------------------------------- writes
    def copy_in(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of caller data for a shard, in recycled host memory when some fits (HostPool)."""
        return self.host_pool.copy_in(t)

    def concat_in(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Caller tensors concatenated for a shard, in recycled host memory when some fits."""
        return self.host_pool.concat_in(parts)

    def put(self, batch: PackedBatch) -> int:
        """Store a batch as a new sealed shard; returns its id. Hot first, written through if tiered."""
        self.check()
        token = batch.token
        if self.pin:
            token = {k: v if v.is_pinned() else v.pin_memory() for k, v in token.items()}
        token_bytes = sum(t.numel() * t.element_size() for t in token.values())
        record = ShardRecord(id=self._table.new_id(), n=batch.n, offsets=batch.offsets, rollout=dict(batch.rollout),
                             token=token, token_bytes=token_bytes, live_rows=batch.n, token_fields=tuple(token))
        self._table.add(record)
        self.host_pool.stored(batch.token.values())  # the shard holds them now, whatever fails later
        self.optional_fields.update(token, batch.rollout)
        self._tiers.hold(record)
        return record.id

    def adopt(self, path: str) -> int:
        """Register an existing shard file (a restored checkpoint) as a new shard.

        With a cold tier the file is moved into spill_dir and stays cold; hot-only storage reads it
        whole. Every byte read is verified against the shard's checksums."""
        self.check()
        if self.io is None:
            with open(path, "rb") as f:
                shard = fmt.parse_shard(f.read())
            os.unlink(path)
            sid = self.put(PackedBatch(n=shard.header.n, offsets=shard.offsets, token=shard.token,
                                       rollout=shard.rollout))
            self._table[sid].header = shard.header  # its identity, for the checkpoint manifests naming it
            return sid
        meta = fmt.read_shard_meta(path)
        sid = self._table.new_id()
        target = self._tiers.file_for(sid)
        try:
            os.replace(path, target)
        except OSError as exc:
            raise StorageError(f"cannot move restored shard {path} into {self.spill_dir}: {exc}") from exc
        return self._add_cold(sid, meta, target, remote=None)

    def adopt_remote(self, meta: fmt.PackedShard, fetch: Callable[[str], None]) -> int:
        """Register a shard whose file is not here yet (a lazy restore): `meta` holds its header
        and small blocks, `fetch(path)` downloads the whole file. The download happens the first
        time a reader needs the shard's token bytes (`ensure_local`), so resuming a large buffer
        costs its metadata, not its data."""
        self.check()
        if self.io is None:
            raise ValueError("a lazily restored shard needs a cold tier: TieredStorage(spill_dir=...)")
        sid = self._table.new_id()
        return self._add_cold(sid, meta, self._tiers.file_for(sid), remote=fetch)

    def _add_cold(self, sid: int, meta: fmt.PackedShard, path: str, remote: Callable[[str], None] | None) -> int:
        token_fields = tuple(n for n, b in meta.header.blocks.items() if b.kind == "token")
        self._table.add(ShardRecord(
            id=sid, n=meta.header.n, offsets=meta.offsets, rollout=meta.rollout, token=None,
            token_bytes=sum(meta.header.blocks[n].nbytes for n in token_fields), live_rows=meta.header.n,
            path=path, header=meta.header, token_fields=token_fields, remote=remote))
        self.policy.added(sid)
        self.optional_fields.update(token_fields, meta.rollout)
        return sid

    def ensure_local(self, shard_id: int) -> None:
        """Download a lazily restored (live or pinned) shard's file if it is not here yet (any thread)."""
        self._tiers.ensure_local(self._table.held([shard_id])[0])

    # ---------------------------------------------------------------------------------- deaths
    def release(self, shard_id: int, rows: int = 1) -> bool:
        """`rows` rollouts of the shard died. The shard goes when none is left (returns True)."""
        record = self._table[shard_id]
        record.live_rows -= rows
        if record.live_rows > 0:
            return False
        self._tiers.forget(record)
        self._table.remove(shard_id)
        self._tiers.delete_ready()
        return True

    def live_fraction(self, shard_id: int) -> float:
        record = self._table[shard_id]
        return record.live_rows / record.n

    def compaction_candidates(self) -> list[int]:
        if self.compact_below <= 0:
            return []
        return [s.id for s in self._table.live()
                if s.n >= self.compact_min_rows and s.live_rows / s.n < self.compact_below]

    # ----------------------------------------------------------------------------------- reads
    def shard(self, shard_id: int) -> ShardView:
        """A frozen view of a live shard, as of now."""
        return self._table[shard_id].view()

    def row_lengths(self, shard_of: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Token count (int64) of row rows[k] of live shard shard_of[k], from the shards' offsets:
        every tier keeps those in memory, so nothing is read (token budgets, `budget.py`)."""
        ids, inverse = torch.unique(shard_of, return_inverse=True)
        per_shard = [self._table[sid].offsets.diff() for sid in ids.tolist()]
        if not per_shard:
            return torch.empty(0, dtype=torch.int64)
        first = torch.tensor([0] + [p.numel() for p in per_shard[:-1]], dtype=torch.int64).cumsum(0)
        return torch.cat(per_shard)[first[inverse] + rows]

    def pin_shards(self, shard_ids: Iterable[int]) -> None:
        """Keep the shards' files and copies until `unpin_shards`, even if they die meanwhile."""
        self._table.pin(shard_ids)

    def unpin_shards(self, shard_ids: Iterable[int]) -> None:
        """Undo `pin_shards` (any thread)."""
        self._table.unpin(shard_ids)
        # Files that died while pinned go now, on the unpinning thread. Left to the trainer's next
        # call, a checkpoint upload batch (~100 shards on a busy run) unpinned at once cost that
        # call 10-40 ms of unlinks: the p99 of `add` with checkpointing on.
        self._tiers.delete_ready()

    def pinned(self, shard_ids: Iterable[int]) -> PinnedShards:
        """Pin the shards now (trainer thread); the `with` block on the result unpins them (any thread)."""
        return PinnedShards(self._table, list(shard_ids), self._tiers.delete_ready)

    def gather(self, pinned: PinnedShards, shard_of: torch.Tensor, rows: torch.Tensor, fields: list[str],
               device: torch.device | None = None) -> Gather:
        """Rows for a sampled batch from pinned shards: position k wants row rows[k] of shard id
        shard_of[k]. Hot shards come back as themselves, cold rows as freshly read batches (those of
        shards that agree on their fields as one batch, read in one reader call). The result is one
        description over all of them, so the caller pads each field with one op whatever the number
        of shards: per-shard batches cost a handful of tensor ops per shard, and a batch of 64
        rollouts sampled from a busy buffer touches ~64 shards.

        With `device` (the storage's device), device-tier copies are used where they exist, and
        cold rows are read straight into device memory when the I/O back end can (kvikio)."""
        stage = device if device is not None and self.io is not None and self.io.can_stage_on(device) else None
        return gather_rows(pinned, shard_of, rows, fields, self._reader, self.reads, self.policy, self.device_policy,
                           self._table.lock, device, stage)

    def fetch(self, shard_id: int, rows: torch.Tensor, fields: Iterable[str] | None = None
              ) -> tuple[PackedBatch, torch.Tensor]:
        """The requested token `fields` (default: all) and every rollout field for `rows` of a
        (pinned) shard.

        Returns (batch, index) with batch row `index[k]` holding requested row `rows[k]`. Hot
        shards return themselves (no copy); cold shards read only the pages covering those rows.
        Safe to call from a prefetch thread while the shard is pinned."""
        record = self._table.held([shard_id])[0]
        with self._table.lock:
            token = record.token
        if token is not None:
            self.reads.add("hot_hits", 1)
            self.policy.touched(record.id)
            return PackedBatch(n=record.n, offsets=record.offsets, token=token, rollout=record.rollout), rows
        wanted = record.token_fields if fields is None else [f for f in fields if f in record.token_fields]
        return self._reader.read_one(record, rows, list(wanted))

    def read_shard(self, shard_id: int) -> PackedBatch:
        """The whole shard (hot copy, or every block read back and verified)."""
        record = self._table[shard_id]
        if record.token is not None:
            return record.batch()
        batch, _ = self._reader.read_one(record, torch.arange(record.n), list(record.token_fields))
        return batch

    def export_shard(self, shard_id: int) -> ShardExport:
        """A live or pinned shard's bytes for a copy elsewhere (a checkpoint upload; any thread):
        waits for its spill and downloads a lazily restored file, then gives its complete file, or
        where it has none (hot-only storage, a failed spill) its hot copy."""
        record = self._table.held([shard_id])[0]
        write = record.write
        if write is not None:
            try:
                write.result()
            except Exception:  # noqa: BLE001 - the storage reports it; a failed spill keeps its hot copy
                return ShardExport(shard_id, None, None, record.batch())
        if record.path is None:
            return ShardExport(shard_id, None, None, record.batch())
        self._tiers.ensure_local(record)
        return ShardExport(shard_id, record.path, record.header, None)

    # --------------------------------------------------------------------------------- metrics
    @property
    def hot_bytes(self) -> int:
        return self._tiers.hot_bytes

    def total_bytes(self) -> int:
        return sum(s.token_bytes + s.offsets.numel() * 8 + sum(t.numel() * t.element_size() for t in s.rollout.values())
                   for s in self._table.live())

    def metrics(self) -> dict[str, float]:
        live = self._table.live()
        hot = sum(1 for s in live if s.token is not None)
        return {"storage_hot_bytes": self._tiers.hot_bytes, "storage_device_bytes": self._tiers.device_used,
                "storage_shards": len(live), "storage_hot_shards": hot,
                "storage_cold_shards": len(live) - hot, "storage_spare_bytes": self.host_pool.spare_bytes,
                **{f"storage_{k}": v for k, v in self.host_pool.counters.items()},
                **{f"storage_{k}": v for k, v in self.counters.items()}}
