"""Tiered rollout storage: a hot tier in (pinned) host RAM under a byte budget, write-through to
shard files on local NVMe, and page-in of just the rows and fields a batch needs.

The storage layer knows nothing of priorities; it stores shards of packed rollouts, addressed by
(shard id, row). Threads: the trainer thread owns every shard's bookkeeping; the spill thread only
writes immutable shard bytes and completes a future; prefetch threads only read. `_lock` guards
pin counts and deferred deletions, the one state those threads share (see docs/architecture.md).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

import torch

from torchreplay._ops import ops
from torchreplay.errors import StorageError
from torchreplay.schema import PackedBatch
from torchreplay.storage import format as fmt
from torchreplay.storage.io import PAGE_BAD, READ_CHECKSUM, READ_OPEN, READ_SHORT, IOBackend, make_io, storage_error
from torchreplay.storage.reads import ReadCounts
from torchreplay.storage.recycle import HostPool

log = logging.getLogger("torchreplay.storage")


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


def _not_the_shard(path: str, header: fmt.ShardHeader) -> str | None:
    """Why a downloaded file is not the shard whose `header` was read at restore, or None."""
    size = os.path.getsize(path)
    if size != header.file_bytes:
        return f"downloaded {size} bytes, its header says {header.file_bytes}"
    with open(path, "rb") as f:
        head = f.read(fmt.PREAMBLE.size)
    if header.crc32 is not None and (len(head) < fmt.PREAMBLE.size or fmt.PREAMBLE.unpack_from(head)[2] != header.crc32):
        return "its header CRC is not the one read at restore (the object was replaced)"
    return None


def _read_failure(path: str, field_name: str, status: list[int]) -> str:
    code, detail = status[0], status[1]
    if code == READ_SHORT:
        return (f"short read from {path} (field {field_name!r}): {detail} bytes where a whole page run was "
                "expected (truncated file?)")
    what = "cannot open shard" if code == READ_OPEN else "cannot read shard"
    return str(storage_error(OSError(detail, os.strerror(detail)), what, path))


def _layout(shard: _Shard, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
    block = shard.header.blocks[name]
    return block.dtype, block.shape


def _token_blocks(shard: _Shard, fields: Iterable[str]):
    """(block, (name, dtype, shape)) for each requested token field the shard stores."""
    for name in fields:
        if name in shard.token_fields:
            block = shard.header.blocks[name]
            yield block, (name, block.dtype, block.shape)


def _same_layout(shards: list[_Shard], fields: list[str]) -> bool:
    """Whether the shards store the same requested token fields in the same dtypes and shapes, and
    the same rollout fields: then their rows can share one packed batch."""
    first = shards[0]
    names = [name for name in fields if name in first.token_fields]
    layouts = [_layout(first, name) for name in names]
    return all([name for name in fields if name in s.token_fields] == names
               and [_layout(s, name) for name in names] == layouts
               and s.rollout.keys() == first.rollout.keys() for s in shards[1:])


def row_base(batches: list, extra: int) -> torch.Tensor:
    """Where each shard's (or batch's) rows start in the concatenation of per-item tensors of
    n + extra rows (extra=1 for offsets)."""
    sizes = torch.tensor([0] + [s.n + extra for s in batches[:-1]], dtype=torch.int64)
    return torch.cumsum(sizes, 0)


def ranges(begin: torch.Tensor, end: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """Every integer of [begin[k], end[k]) for each k, in order, as one tensor (on begin's device).
    Pass `total` (the sum of the lengths) when it is known, to spare a device sync."""
    counts = end - begin
    if total is None:
        total = int(counts.sum()) if counts.numel() else 0
    run_start = torch.cumsum(counts, 0) - counts
    return (torch.repeat_interleave(begin - run_start, counts, output_size=total)
            + torch.arange(total, device=begin.device))


# ------------------------------------------------------------------------------- hot policies
class HotPolicy(Protocol):
    """Decides which hot copies to drop first when the hot tier is over budget."""

    def added(self, shard_id: int) -> None: ...

    def touched(self, shard_id: int) -> None: ...

    def removed(self, shard_id: int) -> None: ...

    def drop_order(self) -> Iterable[int]: ...


class LRUPolicy:
    """Drop the least recently sampled (or added) shard first."""

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def added(self, shard_id: int) -> None:
        self._order[shard_id] = None

    def touched(self, shard_id: int) -> None:
        if shard_id in self._order:
            self._order.move_to_end(shard_id)

    def removed(self, shard_id: int) -> None:
        self._order.pop(shard_id, None)

    def drop_order(self) -> Iterable[int]:
        return list(self._order)


class NewestFirstPolicy(LRUPolicy):
    """Keep the most recently added shards hot, whatever was sampled: fresh data is what an
    on-policy-leaning sampler reads most."""

    def touched(self, shard_id: int) -> None:
        pass


POLICIES = {"lru": LRUPolicy, "newest": NewestFirstPolicy}


def _make_policy(policy: str | HotPolicy, name: str) -> HotPolicy:
    if isinstance(policy, str):
        if policy not in POLICIES:
            raise ValueError(f"{name} must be one of {sorted(POLICIES)} or a HotPolicy, got {policy!r}")
        return POLICIES[policy]()
    missing = [m for m in ("added", "touched", "removed", "drop_order") if not callable(getattr(policy, m, None))]
    if missing:
        raise TypeError(f"{name} must be a policy name or a HotPolicy; {type(policy).__name__} lacks {missing}")
    return policy


# ------------------------------------------------------------------------------------ shards
@dataclass
class Gather:
    """Where the rows of a sampled batch come from: row k is row index[k] of sources[source[k]].
    A source whose token tensors are on the storage's device (device-tier copies, cold rows read
    straight there) has on_device[i] set; the rest are in host memory."""

    sources: list[PackedBatch]
    source: torch.Tensor  # [n] int64
    index: torch.Tensor  # [n] int64
    on_device: list[bool] = field(default_factory=list)


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


@dataclass
class _Shard:
    id: int
    n: int
    offsets: torch.Tensor
    rollout: dict[str, torch.Tensor]
    token: dict[str, torch.Tensor] | None  # hot copy; None once dropped
    token_bytes: int
    live_rows: int
    path: str | None = None
    header: fmt.ShardHeader | None = None
    write: Future | None = None
    pins: int = 0
    dead: bool = False
    token_fields: tuple[str, ...] = field(default_factory=tuple)
    # Set for a shard restored lazily: downloads its file to `path` on first use.
    remote: Callable[[str], None] | None = None
    fetch_lock: threading.Lock = field(default_factory=threading.Lock)
    crc_table: tuple[torch.Tensor, dict[str, int]] | None = None  # see TieredStorage._crc_table
    device_token: dict[str, torch.Tensor] | None = None  # device-tier copy of `token`, if any

    def batch(self) -> PackedBatch:
        assert self.token is not None
        return PackedBatch(n=self.n, offsets=self.offsets, token=self.token, rollout=self.rollout)


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
        if hot_bytes is not None and (isinstance(hot_bytes, bool) or not isinstance(hot_bytes, int) or hot_bytes < 0):
            raise ValueError(f"hot_bytes must be None or an int >= 0, got {hot_bytes!r}")
        if hot_bytes is not None and spill_dir is None:
            raise ValueError("hot_bytes needs spill_dir: without a cold tier nothing can leave RAM")
        if isinstance(device_bytes, bool) or not isinstance(device_bytes, int) or device_bytes < 0:
            raise ValueError(f"device_bytes must be an int >= 0, got {device_bytes!r}")
        if not 0 <= compact_below < 1:
            raise ValueError(f"compact_below must be in [0, 1), got {compact_below!r}")
        if isinstance(compact_min_rows, bool) or not isinstance(compact_min_rows, int):
            raise TypeError(f"compact_min_rows must be an int, got {type(compact_min_rows).__name__}")
        if compact_min_rows < 1:
            raise ValueError(f"compact_min_rows must be >= 1, got {compact_min_rows}")
        policy = _make_policy(policy, "policy")
        device_policy = _make_policy(device_policy, "device_policy")
        if device_policy is policy:
            raise ValueError("device_policy must be its own HotPolicy object, not the host tier's")
        if device_bytes and device is None:
            device = "cuda"
        self.device = None if device is None else resolve_device(device)
        self.hot_budget = math.inf if hot_bytes is None else hot_bytes
        self.device_bytes = device_bytes
        self.policy = policy
        self.device_policy = device_policy
        self._device_used = 0
        self.compact_below = compact_below
        self.compact_min_rows = compact_min_rows
        self.pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.spill_dir = None if spill_dir is None else os.fspath(spill_dir)
        self.io: IOBackend | None = None
        if self.spill_dir is not None:
            try:
                os.makedirs(self.spill_dir, exist_ok=True)
            except OSError as exc:
                raise storage_error(exc, "cannot create spill_dir", self.spill_dir) from exc
            if not os.access(self.spill_dir, os.W_OK | os.X_OK):
                raise StorageError(f"spill_dir {self.spill_dir}: permission denied")
            self.io = make_io(io, threads=io_threads, direct=direct)
            self._spill = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchreplay-spill")
        self.io_name = self.io.name if self.io else "none"
        self._shards: dict[int, _Shard] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._hot_bytes = 0
        self._background_error: BaseException | None = None
        self._pending_deletes: list[_Shard] = []
        self.host_pool = HostPool(pin=self.pin)
        self.optional_fields: set[str] = set()
        self.counters = {"hot_hits": 0, "cold_reads": 0, "cold_bytes_read": 0, "cold_requests": 0, "spilled_shards": 0,
                         "spilled_bytes": 0, "dropped_hot": 0, "deleted_shards": 0, "corrupt_rows": 0,
                         "compactions": 0, "fetched_shards": 0, "device_hits": 0, "device_dropped": 0,
                         "device_staged_bytes": 0}
        self.reads = ReadCounts(self.counters)  # hot hits, cold reads: held back by a call until it succeeds

    # ------------------------------------------------------------------------------- lifecycle
    @property
    def tiered(self) -> bool:
        return self.io is not None

    def check(self) -> None:
        """Raise a background (spill) failure on the caller's thread, once."""
        self._poll()
        if self._background_error is not None:
            err, self._background_error = self._background_error, None
            raise err if isinstance(err, StorageError) else StorageError(f"background spill failed: {err}") from err

    def flush(self) -> None:
        """Wait until every sealed shard is on disk, then surface any spill failure."""
        if self.io is not None:
            self._spill.submit(lambda: None).result()  # the spill thread runs writes in order
        self.check()

    def close(self) -> None:
        if self.io is not None:
            self._spill.shutdown(wait=True)
            self._poll()
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
        shard = _Shard(id=next(self._ids), n=batch.n, offsets=batch.offsets, rollout=dict(batch.rollout),
                       token=token, token_bytes=token_bytes, live_rows=batch.n, token_fields=tuple(token))
        self._shards[shard.id] = shard
        self.host_pool.stored(batch.token.values())  # the shard holds them now, whatever fails later
        self._hot_bytes += token_bytes
        self.policy.added(shard.id)
        self.optional_fields.update(token, batch.rollout)
        if self.device_bytes and token_bytes <= self.device_bytes:
            # An explicit copy even for device='cpu', so the tier holds what its budget says. Blocking:
            # prefetch threads read these copies on their own streams, so the copy must be complete
            # (from pinned memory this is one DMA per field, ~0.3 ms for a 7 MB shard on PCIe 5).
            shard.device_token = {k: v.to(self.device, copy=True) for k, v in token.items()}
            self._device_used += token_bytes
            self.device_policy.added(shard.id)
            self._enforce_device_budget()
        if self.io is not None:
            shard.path = os.path.join(self.spill_dir, f"shard-{shard.id:010d}.trs")
            # Checksums and layout are computed on the spill thread, off the caller's path.
            shard.write = self._spill.submit(self._write, shard, shard.path, batch.offsets, token, batch.rollout)
            self._enforce_budget()
        return shard.id

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
            self._shards[sid].header = shard.header  # its identity, for the checkpoint manifests naming it
            return sid
        meta = fmt.read_shard_meta(path)
        sid = next(self._ids)
        target = os.path.join(self.spill_dir, f"shard-{sid:010d}.trs")
        try:
            os.replace(path, target)
        except OSError as exc:
            raise StorageError(f"cannot move restored shard {path} into {self.spill_dir}: {exc}") from exc
        token_fields = tuple(n for n, b in meta.header.blocks.items() if b.kind == "token")
        shard = _Shard(id=sid, n=meta.header.n, offsets=meta.offsets, rollout=meta.rollout, token=None,
                       token_bytes=sum(meta.header.blocks[n].nbytes for n in token_fields), live_rows=meta.header.n,
                       path=target, header=meta.header, token_fields=token_fields)
        self._shards[sid] = shard
        self.policy.added(sid)
        self.optional_fields.update(token_fields, meta.rollout)
        return sid

    def adopt_remote(self, meta: fmt.PackedShard, fetch: Callable[[str], None]) -> int:
        """Register a shard whose file is not here yet (a lazy restore): `meta` holds its header
        and small blocks, `fetch(path)` downloads the whole file. The download happens the first
        time a reader needs the shard's token bytes (`ensure_local`), so resuming a large buffer
        costs its metadata, not its data."""
        self.check()
        if self.io is None:
            raise ValueError("a lazily restored shard needs a cold tier: TieredStorage(spill_dir=...)")
        sid = next(self._ids)
        token_fields = tuple(n for n, b in meta.header.blocks.items() if b.kind == "token")
        shard = _Shard(id=sid, n=meta.header.n, offsets=meta.offsets, rollout=meta.rollout, token=None,
                       token_bytes=sum(meta.header.blocks[n].nbytes for n in token_fields), live_rows=meta.header.n,
                       path=os.path.join(self.spill_dir, f"shard-{sid:010d}.trs"), header=meta.header,
                       token_fields=token_fields, remote=fetch)
        self._shards[sid] = shard
        self.policy.added(sid)
        self.optional_fields.update(token_fields, meta.rollout)
        return sid

    def ensure_local(self, shard: _Shard) -> None:
        """Download a lazily restored shard's file if it is not here yet (any thread)."""
        if shard.remote is None:
            return
        with shard.fetch_lock:
            if shard.remote is None:
                return
            partial = f"{shard.path}.partial"
            try:
                try:
                    shard.remote(partial)
                    lost = _not_the_shard(partial, shard.header)
                except MissingShard as exc:
                    lost = str(exc)
                if lost is not None:  # never comes back: its rows are lost, as a corrupt file's are
                    raise CorruptRows(shard.id, list(range(shard.n)), f"restored shard's object: {lost}")
                os.replace(partial, shard.path)
            except Exception as exc:
                try:
                    os.unlink(partial)
                except OSError:
                    pass
                if isinstance(exc, StorageError):
                    raise
                raise StorageError(f"cannot fetch restored shard {shard.id} into {shard.path}: {exc}") from exc
            shard.remote = None
            self.counters["fetched_shards"] += 1

    def _write(self, shard: _Shard, path: str, offsets, token, rollout) -> None:
        layout = fmt.layout_shard(offsets, token, rollout)
        names = [b[0] for b in layout.blocks]
        page = layout.page_size
        holder: dict[str, fmt.ShardHeader] = {}

        def header(results: list[list[list[int]]]) -> list[tuple[int, bytes]]:
            # Each block was written in page-aligned parts whose checksums were taken alongside.
            crcs = {name: [c for part in parts for c in part] for name, parts in zip(names, results)}
            holder["header"], head = layout.header(crcs)
            return [(0, head)]

        self.io.write_file(path, layout.writes(), layout.file_bytes,
                           digest=lambda part: fmt.page_crcs(part, page), finalize=header)
        shard.header = holder["header"]  # read by others only once this write's future is done

    def _poll(self) -> None:
        """Settle finished spills (trainer thread)."""
        for shard in list(self._shards.values()) + self._pending_deletes:
            fut = shard.write
            if fut is None or not fut.done():
                continue
            shard.write = None
            exc = fut.exception()
            if exc is not None:
                # The hot copy stays (no accepted data is lost); the shard is simply not cold-capable.
                shard.path = None
                if self._background_error is None:
                    self._background_error = exc
                log.error("torchreplay: spilling shard %d failed: %s", shard.id, exc)
            else:
                self.counters["spilled_shards"] += 1
                self.counters["spilled_bytes"] += shard.header.file_bytes
        self._flush_deletes()

    def _enforce_budget(self) -> None:
        self._poll()
        if self._hot_bytes <= self.hot_budget:
            return
        for shard_id in self.policy.drop_order():
            if self._hot_bytes <= self.hot_budget:
                return
            shard = self._shards.get(shard_id)
            if shard is None or shard.token is None or shard.path is None:
                continue
            if shard.write is not None:
                # Backpressure: a hot copy may only go once its bytes are on disk.
                try:
                    shard.write.result()
                except Exception:  # noqa: BLE001 - surfaced through _poll/check
                    pass
                self._poll()
                if shard.path is None:
                    continue
            self._drop_hot(shard)

    def _enforce_device_budget(self) -> None:
        for shard_id in self.device_policy.drop_order():
            if self._device_used <= self.device_bytes:
                return
            shard = self._shards.get(shard_id)
            if shard is None or shard.device_token is None:
                continue
            self._drop_device(shard)

    def _drop_device(self, shard: _Shard) -> None:
        # A reader that took the copy before this keeps its reference until it is done.
        with self._lock:
            shard.device_token = None
        self._device_used -= shard.token_bytes
        self.device_policy.removed(shard.id)
        self.counters["device_dropped"] += 1

    def _drop_hot(self, shard: _Shard) -> None:
        # Write-through means the file already has every byte: dropping is free.
        with self._lock:
            shard.token = None
        self._hot_bytes -= shard.token_bytes
        self.counters["dropped_hot"] += 1

    # ---------------------------------------------------------------------------------- deaths
    def release(self, shard_id: int, rows: int = 1) -> bool:
        """`rows` rollouts of the shard died. The shard goes when none is left (returns True)."""
        shard = self._shards[shard_id]
        shard.live_rows -= rows
        if shard.live_rows > 0:
            return False
        del self._shards[shard_id]
        self.policy.removed(shard_id)
        if shard.token is not None:
            self._hot_bytes -= shard.token_bytes
        if shard.device_token is not None:
            self._device_used -= shard.token_bytes
            self.device_policy.removed(shard_id)
        with self._lock:
            shard.dead = True
            shard.device_token = None
            self._pending_deletes.append(shard)
        self._flush_deletes()
        return True

    def _flush_deletes(self) -> None:
        with self._lock:
            ready = [s for s in self._pending_deletes if s.pins == 0 and s.write is None]
            self._pending_deletes = [s for s in self._pending_deletes if s not in ready]
        for shard in ready:
            if shard.token is not None:
                self.host_pool.give(shard.token.values())
            shard.token = None
            if shard.path is not None:
                try:
                    os.unlink(shard.path)
                    with self._lock:  # two threads may be deleting (see unpin_shards)
                        self.counters["deleted_shards"] += 1
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    log.warning("torchreplay: cannot delete shard file %s: %s", shard.path, exc)

    def live_fraction(self, shard_id: int) -> float:
        shard = self._shards[shard_id]
        return shard.live_rows / shard.n

    def compaction_candidates(self) -> list[int]:
        if self.compact_below <= 0:
            return []
        return [s.id for s in self._shards.values()
                if s.n >= self.compact_min_rows and s.live_rows / s.n < self.compact_below]

    # ----------------------------------------------------------------------------------- reads
    def pin_shards(self, shard_ids: Iterable[int]) -> None:
        with self._lock:
            for sid in shard_ids:
                self._shards[sid].pins += 1

    def unpin_shards(self, shards: Iterable[_Shard]) -> None:
        with self._lock:
            for shard in shards:
                shard.pins -= 1
        # Files that died while pinned go now, on the unpinning thread. Left to the trainer's next
        # call, a checkpoint upload batch (~100 shards on a busy run) unpinned at once cost that
        # call 10-40 ms of unlinks: the p99 of `add` with checkpointing on.
        self._flush_deletes()

    def shard(self, shard_id: int) -> _Shard:
        return self._shards[shard_id]

    def fetch(self, shard: _Shard, rows: torch.Tensor, fields: Iterable[str]) -> tuple[PackedBatch, torch.Tensor]:
        """The requested token `fields` and every rollout field for `rows` of a (pinned) shard.

        Returns (batch, index) with batch row `index[k]` holding requested row `rows[k]`. Hot
        shards return themselves (no copy); cold shards read only the pages covering those rows.
        Safe to call from a prefetch thread while the shard is pinned."""
        with self._lock:
            token = shard.token
        if token is not None:
            return self._hot_batch(shard, token), rows
        return self._read_cold(shard, rows, [f for f in fields if f in shard.token_fields])

    def _hot_batch(self, shard: _Shard, token: dict[str, torch.Tensor]) -> PackedBatch:
        """A hot shard as a batch of itself (no copy), counted as a hit and touched for the policy."""
        self.reads.add("hot_hits", 1)
        self.policy.touched(shard.id)
        return PackedBatch(n=shard.n, offsets=shard.offsets, token=token, rollout=shard.rollout)

    def fetch_slots(self, shards: list[_Shard], shard_of: torch.Tensor, rows: torch.Tensor, fields: list[str],
                    device: torch.device | None = None) -> Gather:
        """Rows for a sampled batch from pinned shards: position k wants row rows[k] of shard id
        shard_of[k]. Hot shards come back as themselves, cold rows as freshly read batches (those of
        shards that agree on their fields as one batch, read in one reader call). The result is one
        description over all of them, so the caller pads each field with one op whatever the number
        of shards: per-shard batches cost a handful of tensor ops per shard, and a batch of 64
        rollouts sampled from a busy buffer touches ~64 shards.

        With `device` (the storage's device), device-tier copies are used where they exist, and
        cold rows are read straight into device memory when the I/O back end can (kvikio)."""
        with self._lock:
            tokens = [s.token for s in shards]
            device_tokens = [s.device_token if device is not None else None for s in shards]
        stage = device if device is not None and self.io is not None and self.io.can_stage_on(device) else None
        shard_ids, by_id = torch.sort(torch.tensor([s.id for s in shards], dtype=torch.int64))
        position = by_id[torch.searchsorted(shard_ids, shard_of)]  # index into `shards` for each row
        sources: list[PackedBatch] = []
        on_device: list[bool] = []
        source_of_shard = [-1] * len(shards)
        for i, (shard, token, device_token) in enumerate(zip(shards, tokens, device_tokens)):
            if device_token is not None:
                source_of_shard[i] = len(sources)
                self.reads.add("device_hits", 1)
                self.device_policy.touched(shard.id)
                self.policy.touched(shard.id)  # in use: worth keeping hot for when the device copy goes
                if device.type == "cuda":
                    # This thread's stream reads the copy; if the trainer drops it meanwhile, its
                    # memory must not be reused before these reads are done.
                    stream = torch.cuda.current_stream(device)
                    for t in device_token.values():
                        t.record_stream(stream)
                sources.append(PackedBatch(n=shard.n, offsets=shard.offsets, token=device_token, rollout=shard.rollout))
                on_device.append(True)
            elif token is not None:
                source_of_shard[i] = len(sources)
                sources.append(self._hot_batch(shard, token))
                on_device.append(False)
        source = torch.tensor(source_of_shard, dtype=torch.int64)[position]
        index = rows.clone()
        cold = [i for i, token in enumerate(tokens) if token is None and device_tokens[i] is None]
        if cold and _same_layout([shards[i] for i in cold], fields):
            is_cold = source < 0
            at = is_cold.nonzero().flatten()
            cold_index = torch.full((len(shards),), -1, dtype=torch.int64)
            cold_index[cold] = torch.arange(len(cold))
            which = cold_index[position[at]]  # each cold row's shard, as an index into cold_shards
            cold_shards = [shards[i] for i in cold]
            offsets, values, failures = self._read_cold_rows(cold_shards, which, rows[at], fields, stage)
            for i in sorted(failures):
                raise failures[i]
            where_rows = row_base(cold_shards, 0)[which] + rows[at]
            rollout = {name: torch.cat([s.rollout[name] for s in cold_shards])[where_rows]
                       for name in cold_shards[0].rollout}
            source[at] = len(sources)
            index[at] = torch.arange(at.numel())
            sources.append(PackedBatch(n=at.numel(), offsets=offsets, rollout=rollout,
                                       token={name: t for (name, _, _), t in values.items()}))
            on_device.append(stage is not None)
        elif cold:
            where = [(position == i).nonzero().flatten() for i in cold]
            got = self._read_cold_many([(shards[i], rows[at]) for i, at in zip(cold, where)], fields, stage)
            for at, part in zip(where, got):
                if isinstance(part, CorruptRows):
                    raise part
                batch, batch_index = part
                source[at] = len(sources)
                index[at] = batch_index
                sources.append(batch)
                on_device.append(stage is not None)
        return Gather(sources, source, index, on_device)

    def _read_cold(self, shard: _Shard, rows: torch.Tensor, fields: list[str]) -> tuple[PackedBatch, torch.Tensor]:
        got = self._read_cold_many([(shard, rows)], fields)[0]
        if isinstance(got, CorruptRows):
            raise got
        return got

    def _crc_table(self, shard: _Shard) -> tuple[torch.Tensor, dict[str, int]]:
        """Every page checksum of the shard as one tensor, and where each block's pages start in it."""
        table = shard.crc_table
        if table is None:  # the header is immutable, so a racing duplicate computes the same table
            base, crcs = {}, []
            for name, block in shard.header.blocks.items():
                base[name] = len(crcs)
                crcs.extend(block.page_crcs)
            table = shard.crc_table = (torch.tensor(crcs, dtype=torch.int64), base)
        return table

    def _read_cold_many(self, requests: list[tuple[_Shard, torch.Tensor]], fields: list[str],
                        stage: torch.device | None = None) -> list[tuple[PackedBatch, torch.Tensor] | CorruptRows]:
        """Per shard: (batch, index) as `fetch` returns, or the CorruptRows to raise for it."""
        shards = [shard for shard, _ in requests]
        counts = [rows.numel() for _, rows in requests]
        which = torch.repeat_interleave(torch.arange(len(shards)), torch.tensor(counts))
        offsets, values, failures = self._read_cold_rows(shards, which, torch.cat([r for _, r in requests]), fields,
                                                         stage)
        results: list[tuple[PackedBatch, torch.Tensor] | CorruptRows] = []
        first = 0
        for i, (shard, rows) in enumerate(requests):
            if i in failures:
                results.append(failures[i])
            else:
                # This shard's rows are one contiguous stretch of the packed result: views, no copy.
                lo, hi = int(offsets[first]), int(offsets[first + counts[i]])
                token = {name: t[lo:hi] for (name, dtype, shape), t in values.items()
                         if name in shard.token_fields and _layout(shard, name) == (dtype, shape)}
                results.append((PackedBatch(n=counts[i], offsets=offsets[first : first + counts[i] + 1] - lo,
                                            token=token, rollout={k: v[rows] for k, v in shard.rollout.items()}),
                                torch.arange(counts[i])))
            first += counts[i]
        return results

    def _read_cold_rows(self, shards: list[_Shard], which: torch.Tensor, rows: torch.Tensor, fields: list[str],
                        stage: torch.device | None = None
                        ) -> tuple[torch.Tensor, dict[tuple, torch.Tensor], dict[int, CorruptRows]]:
        """Row rows[k] of shards[which[k]] for every k, packed in that order, in one C++ reader call
        (csrc/shard_reader.h): it reads the pages covering the rows from every shard file, verifies
        each page's CRC32 and copies the rows into the packed tensors, on io_threads threads
        without the GIL. Returns (offsets [K + 1], {(field, dtype, shape): values}, {shard position:
        CorruptRows}); a shard lacking a field (or storing it in another layout) leaves its rows
        of that tensor unwritten. With `stage` (a device), the values are on that device: see
        _read_staged."""
        remote = [s for s in shards if s.remote is not None]
        if len(remote) > 1:
            # First use of several lazily restored shards: download them side by side.
            with ThreadPoolExecutor(max_workers=min(len(remote), 8), thread_name_prefix="torchreplay-fetch") as pool:
                list(pool.map(self.ensure_local, remote))
        elif remote:
            self.ensure_local(remote[0])
        if rows.numel():
            limit = torch.tensor([s.n for s in shards])[which]
            if bool((rows < 0).any()) or bool((rows >= limit).any()):
                raise StorageError("cold read of rows outside their shard")
        starts_ends = torch.cat([s.offsets for s in shards])
        g = row_base(shards, 1)[which] + rows
        starts, ends = starts_ends[g], starts_ends[g + 1]
        offsets = torch.zeros(rows.numel() + 1, dtype=torch.int64)
        torch.cumsum(ends - starts, 0, out=offsets[1:])
        if stage is not None:
            values, failures = self._read_staged(shards, which, starts, ends, offsets, fields, stage)
            return offsets, values, failures
        order = torch.argsort(which, stable=True)  # the reader takes each shard's rows as one stretch
        row_table = torch.stack([starts[order], ends[order], offsets[:-1][order]], 1)
        counts = torch.bincount(which, minlength=len(shards)).tolist()
        total = int(offsets[-1])
        values: dict[tuple, torch.Tensor] = {}
        dest_of: dict[tuple, int] = {}
        segments: list[tuple[int, ...]] = []
        owners: list[tuple[int, str]] = []
        crc_parts = []
        n_crcs = first = 0
        for i, shard in enumerate(shards):
            crcs, base = self._crc_table(shard)
            header = shard.header
            for block, key in _token_blocks(shard, fields):
                if key not in values:
                    values[key] = torch.empty((total, *block.shape), dtype=block.dtype)
                    dest_of[key] = len(dest_of)
                # The reader checks these rows against the block and the block against the file.
                segments.append((i, block.offset, block.nbytes, block.row_bytes, header.page_size,
                                 n_crcs + base[block.name], dest_of[key], first, first + counts[i]))
                owners.append((i, block.name))
            crc_parts.append(crcs)
            n_crcs += crcs.numel()
            first += counts[i]
        status = self._read_rows([s.path for s in shards], segments, [row_table], crc_parts, list(values.values()))
        mine: dict[int, list[tuple[str, list[int]]]] = {}
        for (i, name), st in zip(owners, status):
            mine.setdefault(i, []).append((name, st))
        failures: dict[int, CorruptRows] = {}
        for i, shard in enumerate(shards):
            got = mine.get(i, [])
            self.reads.add("cold_reads", 1)
            self.reads.add("cold_bytes_read", sum(st[2] for _, st in got))
            self.reads.add("cold_requests", sum(st[3] for _, st in got))
            failed = next(((name, st) for name, st in got if st[0] >= READ_SHORT), None)
            if failed is not None:
                # A vanished, unreadable or truncated file takes every rollout in it.
                failures[i] = CorruptRows(shard.id, list(range(shard.n)), _read_failure(shard.path, *failed))
            elif any(st[0] == READ_CHECKSUM for _, st in got):
                name = next(name for name, st in got if st[0] == READ_CHECKSUM)
                # One bad page rarely travels alone: verify the whole shard once, so every affected
                # rollout goes now rather than one failed batch at a time.
                failures[i] = CorruptRows(shard.id, self._scan_bad_rows(shard), f"checksum mismatch in field {name!r}")
        return offsets, values, failures

    def _read_staged(self, shards: list[_Shard], which: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor,
                     offsets: torch.Tensor, fields: list[str], device: torch.device
                     ) -> tuple[dict[tuple, torch.Tensor], dict[int, CorruptRows]]:
        """Cold rows straight into `device` memory: the page runs covering the rows are read into
        one staging tensor there (kvikio preads, all in flight together; on the host, preads), each
        page is checksummed where it landed (span_crc32), then the token rows are gathered into
        the packed tensors by device indexing. The host plans from the shard headers and sees only
        the mismatch flags, so the bytes never round-trip through host memory.

        Row k (of shards[which[k]]) holds tokens [starts[k], ends[k]) and goes to packed rows
        [offsets[k], offsets[k + 1]). Returns ({(field, dtype, shape): values}, {shard position:
        CorruptRows}), like the host reader."""
        total = int(offsets[-1])
        values: dict[tuple, torch.Tensor] = {}
        spans: list[tuple[str, int, int, int]] = []  # (path, file offset, bytes, staging offset)
        span_owner: list[int] = []
        page_spans, page_expect, page_owner = [], [], []  # per page: (staging offset, bytes), crc, shard
        gathers = []  # (shard position, key, staging byte offset per token, packed row per token, row bytes)
        staged = 0
        by_shard = torch.split(torch.argsort(which, stable=True), torch.bincount(which, minlength=len(shards)).tolist())
        for i, (shard, mine) in enumerate(zip(shards, by_shard)):
            s_tok, e_tok, dest = starts[mine], ends[mine], offsets[:-1][mine]
            keep = e_tok > s_tok
            s_tok, e_tok, dest = s_tok[keep], e_tok[keep], dest[keep]
            crcs, base = self._crc_table(shard)
            header = shard.header
            page = header.page_size
            for block, key in _token_blocks(shard, fields):
                if key not in values:
                    values[key] = torch.empty((total, *block.shape), dtype=block.dtype, device=device)
                rb = block.row_bytes
                if not rb or not s_tok.numel():
                    continue
                first, last = s_tok * rb // page, (e_tok * rb - 1) // page
                pages = torch.unique(ranges(first, last + 1))
                is_start = torch.ones(pages.numel(), dtype=torch.bool)
                is_start[1:] = pages[1:] != pages[:-1] + 1
                run_first = pages[is_start]
                run_pages = torch.diff(torch.cat([is_start.nonzero().flatten(), torch.tensor([pages.numel()])]))
                run_bytes = torch.minimum((run_first + run_pages) * page, torch.tensor(block.nbytes)) - run_first * page
                aligned = (run_bytes + page - 1) // page * page  # runs start page-aligned in staging too
                run_at = staged + torch.cumsum(aligned, 0) - aligned
                staged += int(aligned.sum())
                for p0, nbytes, at in zip(run_first.tolist(), run_bytes.tolist(), run_at.tolist()):
                    spans.append((shard.path, block.offset + p0 * page, nbytes, at))
                    span_owner.append(i)
                run_of_page = torch.cumsum(is_start.to(torch.int64), 0) - 1
                page_at = run_at[run_of_page] + (pages - run_first[run_of_page]) * page
                page_spans.append(torch.stack([page_at, torch.clamp(block.nbytes - pages * page, max=page)], 1))
                page_expect.append(crcs[base[block.name] + pages])
                page_owner.append(torch.full((pages.numel(),), i, dtype=torch.int64))
                tokens = ranges(s_tok, e_tok)
                token_byte = tokens * rb
                run = torch.searchsorted(run_first, token_byte // page, right=True) - 1
                gathers.append((i, key, run_at[run] + token_byte - run_first[run] * page, ranges(dest, dest + (e_tok - s_tok)),
                                rb))
        failures: dict[int, CorruptRows] = {}
        staging = torch.empty(max(staged, fmt.ALIGN), dtype=torch.uint8, device=device)
        if device.type == "cuda":
            # cuFile writes from the host side, outside stream order, while the caching allocator
            # may have handed out memory that kernels queued on this stream still read (the last
            # batch's gathers, the trainer's freed tensors): let them finish first.
            torch.cuda.current_stream(device).synchronize()
        got = self.io.read_spans(spans, staging) if spans else []
        self.reads.add("cold_reads", len(shards))
        for (path, _, nbytes, _), owner, result in zip(spans, span_owner, got):
            self.reads.add("cold_requests", 1)
            if isinstance(result, OSError):
                reason = str(storage_error(result, "cannot read shard", path))
            elif result != nbytes:
                reason = f"short read from {path}: {result} of {nbytes} bytes (truncated file?)"
            else:
                self.reads.add("cold_bytes_read", nbytes)
                self.reads.add("device_staged_bytes", nbytes)
                continue
            failures.setdefault(owner, CorruptRows(shards[owner].id, list(range(shards[owner].n)), reason))
        if page_spans:
            page_table = torch.cat(page_spans)
            if int((page_table[:, 0] + page_table[:, 1]).max()) > staging.numel():
                # The CUDA checksum would report this as a mismatch (and evict); it is a planning bug.
                raise StorageError("staged read: a page span runs past the staging buffer (internal error)")
            page_table = page_table.to(device)
            expect = torch.cat(page_expect).to(device)
            # The one host sync of the read: which pages, if any, failed their checksum.
            bad_pages = (ops.span_crc32(staging, page_table) != expect).nonzero().flatten().cpu()
            for i in torch.unique(torch.cat(page_owner)[bad_pages]).tolist():
                if i not in failures:
                    failures[i] = CorruptRows(shards[i].id, self._scan_bad_rows(shards[i]), "checksum mismatch")
        for i, key, byte_at, packed_rows, rb in gathers:
            if i in failures:
                continue
            _, dtype, shape = key
            # Runs start page-aligned and rows are whole elements, so every token row starts on an
            # element boundary of the staging bytes: index elements, not bytes.
            elements = staging.view(dtype)
            first = byte_at.to(device) // dtype.itemsize
            per_row = rb // dtype.itemsize
            picked = elements[first] if per_row == 1 else elements[first[:, None] + torch.arange(per_row, device=device)]
            values[key].index_copy_(0, packed_rows.to(device), picked.reshape(-1, *shape))
        return values, failures

    def _read_rows(self, paths: list[str], segments: list[tuple[int, ...]], row_parts: list[torch.Tensor],
                   crc_parts: list[torch.Tensor], dests: list[torch.Tensor],
                   page_state: torch.Tensor | None = None) -> list[list[int]]:
        crcs = torch.cat(crc_parts) if crc_parts else torch.zeros(0, dtype=torch.int64)
        if page_state is None:
            page_state = torch.empty(crcs.numel(), dtype=torch.uint8)
        status = self.io.read_rows(
            paths, torch.tensor(segments, dtype=torch.int64).reshape(-1, 9),
            torch.cat(row_parts) if row_parts else torch.zeros((0, 3), dtype=torch.int64), crcs, dests, page_state)
        return status.tolist()

    def _scan_bad_rows(self, shard: _Shard) -> list[int]:
        header = shard.header
        page = header.page_size
        crcs, base = self._crc_table(shard)
        blocks = [header.blocks[name] for name in shard.token_fields]
        # Verify-only segments (destination -1) over every token row of each token block.
        segments = [(0, b.offset, b.nbytes, b.row_bytes, page, base[b.name], -1, k, k + 1)
                    for k, b in enumerate(blocks)]
        whole = torch.tensor([[0, b.nbytes // b.row_bytes if b.row_bytes else 0, 0] for b in blocks],
                             dtype=torch.int64).reshape(-1, 3)
        page_state = torch.empty(crcs.numel(), dtype=torch.uint8)
        status = self._read_rows([shard.path], segments, [whole], [crcs], [], page_state)
        if any(s[0] >= READ_SHORT for s in status):
            return list(range(shard.n))
        bad: set[int] = set()
        starts, ends = shard.offsets[:-1], shard.offsets[1:]
        for block in blocks:
            rb = block.row_bytes or 1
            first = base[block.name]
            states = page_state[first : first + len(block.page_crcs)]
            for p in (states == PAGE_BAD).nonzero().flatten().tolist():
                lo, hi = p * page // rb, ((p + 1) * page + rb - 1) // rb
                bad.update(((starts < hi) & (ends > lo)).nonzero().flatten().tolist())
        return sorted(bad)

    def read_shard(self, shard_id: int) -> PackedBatch:
        """The whole shard (hot copy, or every block read back and verified)."""
        shard = self._shards[shard_id]
        if shard.token is not None:
            return shard.batch()
        all_rows = torch.arange(shard.n)
        batch, _ = self._read_cold(shard, all_rows, list(shard.token_fields))
        return batch

    # --------------------------------------------------------------------------------- metrics
    @property
    def hot_bytes(self) -> int:
        return self._hot_bytes

    def total_bytes(self) -> int:
        return sum(s.token_bytes + s.offsets.numel() * 8 + sum(t.numel() * t.element_size() for t in s.rollout.values())
                   for s in self._shards.values())

    def metrics(self) -> dict[str, float]:
        hot = sum(1 for s in self._shards.values() if s.token is not None)
        return {"storage_hot_bytes": self._hot_bytes, "storage_device_bytes": self._device_used,
                "storage_shards": len(self._shards), "storage_hot_shards": hot,
                "storage_cold_shards": len(self._shards) - hot, "storage_spare_bytes": self.host_pool.spare_bytes,
                **{f"storage_{k}": v for k, v in self.host_pool.counters.items()},
                **{f"storage_{k}": v for k, v in self.counters.items()}}
