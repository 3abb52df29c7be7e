"""The tiers a shard's bytes live in, their budgets, and spill.

- Host RAM: a shard's hot copy, under `hot_budget` bytes; copies beyond it are dropped in policy
  order once their file is written (free: the file has every byte).
- Device memory: a copy of a new shard's token data while the device tier is under its budget.
- Disk: every shard written through to a file in spill_dir by the spill thread
  (`torchreplay-spill`), which only writes immutable bytes and completes a future; the trainer
  thread settles finished spills (`poll`).
- An object store, for a lazily restored shard until a reader first needs its file
  (`ensure_local`, any thread).
"""

from __future__ import annotations

import logging
import math
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from torchreplay.errors import StorageError
from torchreplay.storage import format as fmt
from torchreplay.storage.io import IOBackend
from torchreplay.storage.policies import HotPolicy
from torchreplay.storage.recycle import HostPool
from torchreplay.storage.table import CorruptRows, MissingShard, ShardRecord, ShardTable

log = logging.getLogger("torchreplay.storage")


def not_the_shard(path: str, header: fmt.ShardHeader) -> str | None:
    """Why a downloaded file is not the shard whose `header` was read at restore, or None."""
    size = os.path.getsize(path)
    if size != header.file_bytes:
        return f"downloaded {size} bytes, its header says {header.file_bytes}"
    with open(path, "rb") as f:
        head = f.read(fmt.PREAMBLE.size)
    if header.crc32 is not None and (len(head) < fmt.PREAMBLE.size or fmt.PREAMBLE.unpack_from(head)[2] != header.crc32):
        return "its header CRC is not the one read at restore (the object was replaced)"
    return None


class Tiers:
    """Places shards' bytes in the tiers and keeps each tier within its budget (trainer thread,
    except `ensure_local` and `delete_ready`). `counters` is the storage's metrics dict."""

    def __init__(self, table: ShardTable, counters: dict[str, int], host_pool: HostPool, *, hot_bytes: int | None,
                 device_bytes: int, device: torch.device | None, policy: HotPolicy, device_policy: HotPolicy,
                 spill_dir: str | None, io: IOBackend | None) -> None:
        self.table = table
        self.counters = counters
        self.host_pool = host_pool
        self.hot_budget = math.inf if hot_bytes is None else hot_bytes
        self.device_bytes = device_bytes
        self.device = device
        self.policy = policy
        self.device_policy = device_policy
        self.spill_dir = spill_dir
        self.io = io
        self.hot_bytes = 0
        self.device_used = 0
        self._background_error: BaseException | None = None
        self._spill = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchreplay-spill") if io else None

    def file_for(self, shard_id: int) -> str:
        return os.path.join(self.spill_dir, f"shard-{shard_id:010d}.trs")

    # ----------------------------------------------------------------------------- placement
    def hold(self, record: ShardRecord) -> None:
        """A new shard with a hot copy: account it, copy it to the device tier if it fits, and
        write it through to its file if there is a cold tier."""
        token = record.token
        self.hot_bytes += record.token_bytes
        self.policy.added(record.id)
        if self.device_bytes and record.token_bytes <= self.device_bytes:
            # An explicit copy even for device='cpu', so the tier holds what its budget says. Blocking:
            # prefetch threads read these copies on their own streams, so the copy must be complete
            # (from pinned memory this is one DMA per field, ~0.3 ms for a 7 MB shard on PCIe 5).
            record.device_token = {k: v.to(self.device, copy=True) for k, v in token.items()}
            self.device_used += record.token_bytes
            self.device_policy.added(record.id)
            self._enforce_device_budget()
        if self.io is not None:
            record.path = self.file_for(record.id)
            # Checksums and layout are computed on the spill thread, off the caller's path.
            record.write = self._spill.submit(self._write, record, record.path, record.offsets, token, record.rollout)
            self._enforce_budget()

    def forget(self, record: ShardRecord) -> None:
        """A shard died: its copies no longer count against the budgets."""
        self.policy.removed(record.id)
        if record.token is not None:
            self.hot_bytes -= record.token_bytes
        if record.device_token is not None:
            self.device_used -= record.token_bytes
            self.device_policy.removed(record.id)

    def _write(self, record: ShardRecord, path: str, offsets, token, rollout) -> None:
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
        record.header = holder["header"]  # read by others only once this write's future is done

    # ------------------------------------------------------------------------- spill results
    def check(self) -> None:
        """Raise a background (spill) failure on the caller's thread, once."""
        self.poll()
        if self._background_error is not None:
            err, self._background_error = self._background_error, None
            raise err if isinstance(err, StorageError) else StorageError(f"background spill failed: {err}") from err

    def flush(self) -> None:
        if self._spill is not None:
            self._spill.submit(lambda: None).result()  # the spill thread runs writes in order

    def close(self) -> None:
        if self._spill is not None:
            self._spill.shutdown(wait=True)
            self.poll()

    def poll(self) -> None:
        """Settle finished spills (trainer thread), then delete the dead shards nothing holds."""
        for record in self.table.with_dying():
            fut = record.write
            if fut is None or not fut.done():
                continue
            exc = fut.exception()
            if exc is not None:
                # The hot copy stays (no accepted data is lost); the shard is simply not cold-capable.
                # `path` goes before `write`: a reader that sees the write settled sees no path.
                record.path = None
                if self._background_error is None:
                    self._background_error = exc
                log.error("torchreplay: spilling shard %d failed: %s", record.id, exc)
            else:
                self.counters["spilled_shards"] += 1
                self.counters["spilled_bytes"] += record.header.file_bytes
            record.write = None
        self.delete_ready()

    # ------------------------------------------------------------------------------- budgets
    def _enforce_budget(self) -> None:
        self.poll()
        if self.hot_bytes <= self.hot_budget:
            return
        for shard_id in self.policy.drop_order():
            if self.hot_bytes <= self.hot_budget:
                return
            record = self.table.get(shard_id)
            if record is None or record.token is None or record.path is None:
                continue
            if record.write is not None:
                # Backpressure: a hot copy may only go once its bytes are on disk.
                try:
                    record.write.result()
                except Exception:  # noqa: BLE001 - surfaced through poll/check
                    pass
                self.poll()
                if record.path is None:
                    continue
            # Write-through means the file already has every byte: dropping is free.
            with self.table.lock:
                record.token = None
            self.hot_bytes -= record.token_bytes
            self.counters["dropped_hot"] += 1

    def _enforce_device_budget(self) -> None:
        for shard_id in self.device_policy.drop_order():
            if self.device_used <= self.device_bytes:
                return
            record = self.table.get(shard_id)
            if record is None or record.device_token is None:
                continue
            # A reader that took the copy before this keeps its reference until it is done.
            with self.table.lock:
                record.device_token = None
            self.device_used -= record.token_bytes
            self.device_policy.removed(record.id)
            self.counters["device_dropped"] += 1

    # ------------------------------------------------------------------------------- deaths
    def delete_ready(self) -> None:
        """Delete the dead shards nothing holds: memory back to the pool, files unlinked (any thread)."""
        for record in self.table.deletable():
            if record.token is not None:
                self.host_pool.give(record.token.values())
            record.token = None
            if record.path is not None:
                try:
                    os.unlink(record.path)
                    with self.table.lock:  # two threads may be deleting (see TieredStorage.unpin_shards)
                        self.counters["deleted_shards"] += 1
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    log.warning("torchreplay: cannot delete shard file %s: %s", record.path, exc)

    # ------------------------------------------------------------------------- remote shards
    def ensure_local(self, record: ShardRecord) -> None:
        """Download a lazily restored shard's file if it is not here yet (any thread)."""
        if record.remote is None:
            return
        with record.fetch_lock:
            if record.remote is None:
                return
            partial = f"{record.path}.partial"
            try:
                try:
                    record.remote(partial)
                    lost = not_the_shard(partial, record.header)
                except MissingShard as exc:
                    lost = str(exc)
                if lost is not None:  # never comes back: its rows are lost, as a corrupt file's are
                    raise CorruptRows(record.id, list(range(record.n)), f"restored shard's object: {lost}")
                os.replace(partial, record.path)
            except Exception as exc:
                try:
                    os.unlink(partial)
                except OSError:
                    pass
                if isinstance(exc, StorageError):
                    raise
                raise StorageError(f"cannot fetch restored shard {record.id} into {record.path}: {exc}") from exc
            record.remote = None
            self.counters["fetched_shards"] += 1
