"""Cold reads: the one planner of what to read from shard files, for host, staged and scan reads.

- Host reads (`ColdReader.read`): the rows of many shards, every page they touch verified, copied
  into packed host tensors by one call of the C++ reader (reader_abi.Segment per shard and field).
- Staged reads (`stage=device`): the page runs covering the rows land in one staging tensor on
  the device (kvikio), are checksummed there and gathered into packed device tensors.
- Scans (`scan_bad_rows`): after a checksum mismatch, every page of a shard verified, to evict
  every affected rollout at once.

Failures come back as CorruptRows per shard, never half-filled rows. ReadCounts tallies the reads
(see its docstring for why a call may hold them back).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, NamedTuple

import torch

from torchreplay._ops import ops
from torchreplay.errors import StorageError
from torchreplay.schema import PackedBatch
from torchreplay.storage import format as fmt
from torchreplay.storage.io import IOBackend, storage_error
from torchreplay.storage.reader_abi import (VERIFY_ONLY, PageState, ReadCode, ReadStatus, Segment, row_table,
                                            segment_table, statuses)
from torchreplay.storage.table import CorruptRows, ShardRecord


class ReadCounts:
    """A TieredStorage's read counters (hot hits, cold reads and bytes): adds to `counters` (the
    storage's dict), or to this thread's open `deferred` tally.

    A buffer call reads rows and may still fail afterwards (a compose whose fresh shard cannot be
    stored, a sample whose batch cannot be handed over). Such a call changes nothing, its counters
    included, so the reads it made are tallied aside (`deferred`) and added (`commit`) only once
    it has succeeded. The tally is per thread: a prefetch thread's reads for an earlier batch
    count as they happen, whatever the trainer thread's call does meanwhile."""

    def __init__(self, counters: dict[str, int]) -> None:
        self.counters = counters
        self._local = threading.local()

    def add(self, name: str, n: int) -> None:
        tally = getattr(self._local, "tally", None)
        target = self.counters if tally is None else tally
        target[name] = target.get(name, 0) + n

    @contextmanager
    def deferred(self) -> Iterator[dict[str, int]]:
        """Reads on this thread inside the block go to the yielded tally instead of the counters;
        pass it to `commit` when the call has succeeded, or drop it."""
        outer = getattr(self._local, "tally", None)
        tally: dict[str, int] = {}
        self._local.tally = tally
        try:
            yield tally
        finally:
            self._local.tally = outer

    def commit(self, tally: dict[str, int]) -> None:
        """Count a tally (into an enclosing `deferred` block's, if one is open on this thread)."""
        for name, n in tally.items():
            self.add(name, n)


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


def block_layout(record: ShardRecord, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
    block = record.header.blocks[name]
    return block.dtype, block.shape


def token_blocks(record: ShardRecord, fields: Iterable[str]):
    """(block, (name, dtype, shape)) for each requested token field the shard stores."""
    for name in fields:
        if name in record.token_fields:
            block = record.header.blocks[name]
            yield block, (name, block.dtype, block.shape)


def same_layout(records: list[ShardRecord], fields: list[str]) -> bool:
    """Whether the shards store the same requested token fields in the same dtypes and shapes, and
    the same rollout fields: then their rows can share one packed batch."""
    first = records[0]
    names = [name for name in fields if name in first.token_fields]
    layouts = [block_layout(first, name) for name in names]
    return all([name for name in fields if name in s.token_fields] == names
               and [block_layout(s, name) for name in names] == layouts
               and s.rollout.keys() == first.rollout.keys() for s in records[1:])


def _read_failure(path: str, field_name: str, status: ReadStatus) -> str:
    if status.code == ReadCode.SHORT_READ:
        return (f"short read from {path} (field {field_name!r}): {status.detail} bytes where a whole page run "
                "was expected (truncated file?)")
    what = "cannot open shard" if status.code == ReadCode.OPEN_FAILED else "cannot read shard"
    return str(storage_error(OSError(status.detail, os.strerror(status.detail)), what, path))


class FileSpan(NamedTuple):
    """Bytes [offset, offset + nbytes) of a file, read to `at` in a staging tensor (IOBackend.read_spans)."""

    path: str
    offset: int
    nbytes: int
    at: int


class ColdRows(NamedTuple):
    """Rows read from shard files, packed: `offsets` [K + 1], {(field, dtype, shape): values},
    and {shard position: CorruptRows} for the shards that failed."""

    offsets: torch.Tensor
    values: dict[tuple, torch.Tensor]
    failures: dict[int, CorruptRows]


@dataclass
class _StagedPlan:
    """What a staged read reads, checks and gathers (see ColdReader._read_staged)."""

    spans: list[FileSpan] = field(default_factory=list)
    span_owner: list[int] = field(default_factory=list)  # shard position per span
    page_spans: list[torch.Tensor] = field(default_factory=list)  # per page: (staging offset, bytes)
    page_expect: list[torch.Tensor] = field(default_factory=list)  # per page: its recorded CRC
    page_owner: list[torch.Tensor] = field(default_factory=list)  # per page: shard position
    # (shard position, key, staging byte offset per token, packed row per token, row bytes)
    gathers: list[tuple] = field(default_factory=list)
    staged: int = 0  # staging bytes planned so far


class ColdReader:
    """Reads rows of shard files through `io`; `ensure_local(record)` downloads a lazily restored
    shard first. Any thread, for pinned shards."""

    def __init__(self, io: IOBackend | None, reads: ReadCounts, ensure_local: Callable[[ShardRecord], None]) -> None:
        self.io = io
        self.reads = reads
        self.ensure_local = ensure_local

    @staticmethod
    def crc_table(record: ShardRecord) -> tuple[torch.Tensor, dict[str, int]]:
        """Every page checksum of the shard as one tensor, and where each block's pages start in it."""
        table = record.crc_table
        if table is None:  # the header is immutable, so a racing duplicate computes the same table
            base, crcs = {}, []
            for name, block in record.header.blocks.items():
                base[name] = len(crcs)
                crcs.extend(block.page_crcs)
            table = record.crc_table = (torch.tensor(crcs, dtype=torch.int64), base)
        return table

    def read_one(self, record: ShardRecord, rows: torch.Tensor, fields: list[str]) -> tuple[PackedBatch, torch.Tensor]:
        """(batch, index) for rows of one shard, as TieredStorage.fetch returns; raises CorruptRows."""
        got = self.read_each([(record, rows)], fields)[0]
        if isinstance(got, CorruptRows):
            raise got
        return got

    def read_each(self, requests: list[tuple[ShardRecord, torch.Tensor]], fields: list[str],
                  stage: torch.device | None = None) -> list[tuple[PackedBatch, torch.Tensor] | CorruptRows]:
        """Per shard: (batch, index) as `read_one` returns, or the CorruptRows to raise for it."""
        records = [record for record, _ in requests]
        counts = [rows.numel() for _, rows in requests]
        which = torch.repeat_interleave(torch.arange(len(records)), torch.tensor(counts))
        got = self.read(records, which, torch.cat([r for _, r in requests]), fields, stage)
        results: list[tuple[PackedBatch, torch.Tensor] | CorruptRows] = []
        first = 0
        for i, (record, rows) in enumerate(requests):
            if i in got.failures:
                results.append(got.failures[i])
            else:
                # This shard's rows are one contiguous stretch of the packed result: views, no copy.
                lo, hi = int(got.offsets[first]), int(got.offsets[first + counts[i]])
                token = {name: t[lo:hi] for (name, dtype, shape), t in got.values.items()
                         if name in record.token_fields and block_layout(record, name) == (dtype, shape)}
                results.append((PackedBatch(n=counts[i], offsets=got.offsets[first : first + counts[i] + 1] - lo,
                                            token=token, rollout={k: v[rows] for k, v in record.rollout.items()}),
                                torch.arange(counts[i])))
            first += counts[i]
        return results

    def read(self, records: list[ShardRecord], which: torch.Tensor, rows: torch.Tensor, fields: list[str],
             stage: torch.device | None = None) -> ColdRows:
        """Row rows[k] of records[which[k]] for every k, packed in that order, in one C++ reader call
        (csrc/shard_reader.h): it reads the pages covering the rows from every shard file, verifies
        each page's CRC32 and copies the rows into the packed tensors, on io_threads threads
        without the GIL. A shard lacking a field (or storing it in another layout) leaves its rows
        of that tensor unwritten. With `stage` (a device), the values are on that device: see
        _read_staged."""
        self._download(records)
        if rows.numel():
            limit = torch.tensor([s.n for s in records])[which]
            if bool((rows < 0).any()) or bool((rows >= limit).any()):
                raise StorageError("cold read of rows outside their shard")
        starts_ends = torch.cat([s.offsets for s in records])
        g = row_base(records, 1)[which] + rows
        starts, ends = starts_ends[g], starts_ends[g + 1]
        offsets = torch.zeros(rows.numel() + 1, dtype=torch.int64)
        torch.cumsum(ends - starts, 0, out=offsets[1:])
        if stage is not None:
            values, failures = self._read_staged(records, which, starts, ends, offsets, fields, stage)
        else:
            values, failures = self._read_host(records, which, starts, ends, offsets, fields)
        return ColdRows(offsets, values, failures)

    def _download(self, records: list[ShardRecord]) -> None:
        remote = [s for s in records if s.remote is not None]
        if len(remote) > 1:
            # First use of several lazily restored shards: download them side by side.
            with ThreadPoolExecutor(max_workers=min(len(remote), 8), thread_name_prefix="torchreplay-fetch") as pool:
                list(pool.map(self.ensure_local, remote))
        elif remote:
            self.ensure_local(remote[0])

    # ---------------------------------------------------------------------------- host reads
    def _read_host(self, records: list[ShardRecord], which: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor,
                   offsets: torch.Tensor, fields: list[str]
                   ) -> tuple[dict[tuple, torch.Tensor], dict[int, CorruptRows]]:
        order = torch.argsort(which, stable=True)  # the reader takes each shard's rows as one stretch
        rows = row_table(starts[order], ends[order], offsets[:-1][order])
        counts = torch.bincount(which, minlength=len(records)).tolist()
        total = int(offsets[-1])
        values: dict[tuple, torch.Tensor] = {}
        dest_of: dict[tuple, int] = {}
        segments: list[Segment] = []
        owners: list[tuple[int, str]] = []
        crc_parts = []
        n_crcs = first = 0
        for i, record in enumerate(records):
            crcs, base = self.crc_table(record)
            for block, key in token_blocks(record, fields):
                if key not in values:
                    values[key] = torch.empty((total, *block.shape), dtype=block.dtype)
                    dest_of[key] = len(dest_of)
                # The reader checks these rows against the block and the block against the file.
                segments.append(Segment(file=i, block_offset=block.offset, block_bytes=block.nbytes,
                                        row_bytes=block.row_bytes, page_size=record.header.page_size,
                                        crc_begin=n_crcs + base[block.name], dest=dest_of[key], row_begin=first,
                                        row_end=first + counts[i]))
                owners.append((i, block.name))
            crc_parts.append(crcs)
            n_crcs += crcs.numel()
            first += counts[i]
        status = self._call_reader([s.path for s in records], segments, rows, crc_parts, list(values.values()))
        mine: dict[int, list[tuple[str, ReadStatus]]] = {}
        for (i, name), st in zip(owners, status):
            mine.setdefault(i, []).append((name, st))
        return values, self._host_failures(records, mine)

    def _host_failures(self, records: list[ShardRecord], mine: dict[int, list[tuple[str, ReadStatus]]]
                       ) -> dict[int, CorruptRows]:
        """Count each shard's reads; a failed shard's CorruptRows by position."""
        failures: dict[int, CorruptRows] = {}
        for i, record in enumerate(records):
            got = mine.get(i, [])
            self.reads.add("cold_reads", 1)
            self.reads.add("cold_bytes_read", sum(st.bytes for _, st in got))
            self.reads.add("cold_requests", sum(st.reads for _, st in got))
            failed = next(((name, st) for name, st in got if st.code >= ReadCode.SHORT_READ), None)
            if failed is not None:
                # A vanished, unreadable or truncated file takes every rollout in it.
                failures[i] = CorruptRows(record.id, list(range(record.n)), _read_failure(record.path, *failed))
            elif any(st.code == ReadCode.CHECKSUM for _, st in got):
                name = next(name for name, st in got if st.code == ReadCode.CHECKSUM)
                # One bad page rarely travels alone: verify the whole shard once, so every affected
                # rollout goes now rather than one failed batch at a time.
                failures[i] = CorruptRows(record.id, self.scan_bad_rows(record), f"checksum mismatch in field {name!r}")
        return failures

    def _call_reader(self, paths: list[str], segments: list[Segment], rows: torch.Tensor,
                     crc_parts: list[torch.Tensor], dests: list[torch.Tensor],
                     page_state: torch.Tensor | None = None) -> list[ReadStatus]:
        crcs = torch.cat(crc_parts) if crc_parts else torch.zeros(0, dtype=torch.int64)
        if page_state is None:
            page_state = torch.empty(crcs.numel(), dtype=torch.uint8)
        return statuses(self.io.read_rows(paths, segment_table(segments), rows, crcs, dests, page_state))

    def scan_bad_rows(self, record: ShardRecord) -> list[int]:
        """Every row of the shard that a page failing its checksum touches (all rows if the file
        itself cannot be read)."""
        header = record.header
        page = header.page_size
        crcs, base = self.crc_table(record)
        blocks = [header.blocks[name] for name in record.token_fields]
        # Verify-only segments over every token row of each token block.
        segments = [Segment(file=0, block_offset=b.offset, block_bytes=b.nbytes, row_bytes=b.row_bytes,
                            page_size=page, crc_begin=base[b.name], dest=VERIFY_ONLY, row_begin=k, row_end=k + 1)
                    for k, b in enumerate(blocks)]
        block_rows = torch.tensor([b.nbytes // b.row_bytes if b.row_bytes else 0 for b in blocks], dtype=torch.int64)
        whole = row_table(torch.zeros_like(block_rows), block_rows, torch.zeros_like(block_rows))
        page_state = torch.empty(crcs.numel(), dtype=torch.uint8)
        status = self._call_reader([record.path], segments, whole, [crcs], [], page_state)
        if any(s.code >= ReadCode.SHORT_READ for s in status):
            return list(range(record.n))
        bad: set[int] = set()
        starts, ends = record.offsets[:-1], record.offsets[1:]
        for block in blocks:
            rb = block.row_bytes or 1
            first = base[block.name]
            states = page_state[first : first + len(block.page_crcs)]
            for p in (states == PageState.BAD).nonzero().flatten().tolist():
                lo, hi = p * page // rb, ((p + 1) * page + rb - 1) // rb
                bad.update(((starts < hi) & (ends > lo)).nonzero().flatten().tolist())
        return sorted(bad)

    # -------------------------------------------------------------------------- staged reads
    def _read_staged(self, records: list[ShardRecord], which: torch.Tensor, starts: torch.Tensor,
                     ends: torch.Tensor, offsets: torch.Tensor, fields: list[str], device: torch.device
                     ) -> tuple[dict[tuple, torch.Tensor], dict[int, CorruptRows]]:
        """Cold rows straight into `device` memory: the page runs covering the rows are read into
        one staging tensor there (kvikio preads, all in flight together; on the host, preads), each
        page is checksummed where it landed (span_crc32), then the token rows are gathered into
        the packed tensors by device indexing. The host plans from the shard headers and sees only
        the mismatch flags, so the bytes never round-trip through host memory.

        Row k (of records[which[k]]) holds tokens [starts[k], ends[k]) and goes to packed rows
        [offsets[k], offsets[k + 1])."""
        total = int(offsets[-1])
        values: dict[tuple, torch.Tensor] = {}
        plan = _StagedPlan()
        by_shard = torch.split(torch.argsort(which, stable=True),
                               torch.bincount(which, minlength=len(records)).tolist())
        for i, (record, mine) in enumerate(zip(records, by_shard)):
            s_tok, e_tok, dest = starts[mine], ends[mine], offsets[:-1][mine]
            keep = e_tok > s_tok
            s_tok, e_tok, dest = s_tok[keep], e_tok[keep], dest[keep]
            for block, key in token_blocks(record, fields):
                if key not in values:
                    values[key] = torch.empty((total, *block.shape), dtype=block.dtype, device=device)
                if block.row_bytes and s_tok.numel():
                    self._plan_block(plan, i, record, block, key, s_tok, e_tok, dest)
        staging = torch.empty(max(plan.staged, fmt.ALIGN), dtype=torch.uint8, device=device)
        if device.type == "cuda":
            # cuFile writes from the host side, outside stream order, while the caching allocator
            # may have handed out memory that kernels queued on this stream still read (the last
            # batch's gathers, the trainer's freed tensors): let them finish first.
            torch.cuda.current_stream(device).synchronize()
        failures = self._read_spans(records, plan, staging)
        self._verify_staged(records, plan, staging, failures)
        self._gather_staged(plan, staging, values, failures)
        return values, failures

    def _plan_block(self, plan: _StagedPlan, i: int, record: ShardRecord, block, key: tuple,
                    s_tok: torch.Tensor, e_tok: torch.Tensor, dest: torch.Tensor) -> None:
        """The page runs of one block that hold token rows [s_tok, e_tok), the pages to check and
        where each token lands."""
        crcs, base = self.crc_table(record)
        page, rb = record.header.page_size, block.row_bytes
        first, last = s_tok * rb // page, (e_tok * rb - 1) // page
        pages = torch.unique(ranges(first, last + 1))
        is_start = torch.ones(pages.numel(), dtype=torch.bool)
        is_start[1:] = pages[1:] != pages[:-1] + 1
        run_first = pages[is_start]
        run_pages = torch.diff(torch.cat([is_start.nonzero().flatten(), torch.tensor([pages.numel()])]))
        run_bytes = torch.minimum((run_first + run_pages) * page, torch.tensor(block.nbytes)) - run_first * page
        aligned = (run_bytes + page - 1) // page * page  # runs start page-aligned in staging too
        run_at = plan.staged + torch.cumsum(aligned, 0) - aligned
        plan.staged += int(aligned.sum())
        for p0, nbytes, at in zip(run_first.tolist(), run_bytes.tolist(), run_at.tolist()):
            plan.spans.append(FileSpan(record.path, block.offset + p0 * page, nbytes, at))
            plan.span_owner.append(i)
        run_of_page = torch.cumsum(is_start.to(torch.int64), 0) - 1
        page_at = run_at[run_of_page] + (pages - run_first[run_of_page]) * page
        plan.page_spans.append(torch.stack([page_at, torch.clamp(block.nbytes - pages * page, max=page)], 1))
        plan.page_expect.append(crcs[base[block.name] + pages])
        plan.page_owner.append(torch.full((pages.numel(),), i, dtype=torch.int64))
        token_byte = ranges(s_tok, e_tok) * rb
        run = torch.searchsorted(run_first, token_byte // page, right=True) - 1
        plan.gathers.append((i, key, run_at[run] + token_byte - run_first[run] * page,
                             ranges(dest, dest + (e_tok - s_tok)), rb))

    def _read_spans(self, records: list[ShardRecord], plan: _StagedPlan, staging: torch.Tensor
                    ) -> dict[int, CorruptRows]:
        """Read every planned span; a shard whose read failed or came up short loses every row."""
        failures: dict[int, CorruptRows] = {}
        got = self.io.read_spans(plan.spans, staging) if plan.spans else []
        self.reads.add("cold_reads", len(records))
        for span, owner, result in zip(plan.spans, plan.span_owner, got):
            self.reads.add("cold_requests", 1)
            if isinstance(result, OSError):
                reason = str(storage_error(result, "cannot read shard", span.path))
            elif result != span.nbytes:
                reason = f"short read from {span.path}: {result} of {span.nbytes} bytes (truncated file?)"
            else:
                self.reads.add("cold_bytes_read", span.nbytes)
                self.reads.add("device_staged_bytes", span.nbytes)
                continue
            failures.setdefault(owner, CorruptRows(records[owner].id, list(range(records[owner].n)), reason))
        return failures

    def _verify_staged(self, records: list[ShardRecord], plan: _StagedPlan, staging: torch.Tensor,
                       failures: dict[int, CorruptRows]) -> None:
        """Checksum every staged page where it landed; shards with a bad page join `failures`."""
        if not plan.page_spans:
            return
        device = staging.device
        page_table = torch.cat(plan.page_spans)
        if int((page_table[:, 0] + page_table[:, 1]).max()) > staging.numel():
            # The CUDA checksum would report this as a mismatch (and evict); it is a planning bug.
            raise StorageError("staged read: a page span runs past the staging buffer (internal error)")
        page_table = page_table.to(device)
        expect = torch.cat(plan.page_expect).to(device)
        # The one host sync of the read: which pages, if any, failed their checksum.
        bad_pages = (ops.span_crc32(staging, page_table) != expect).nonzero().flatten().cpu()
        for i in torch.unique(torch.cat(plan.page_owner)[bad_pages]).tolist():
            if i not in failures:
                failures[i] = CorruptRows(records[i].id, self.scan_bad_rows(records[i]), "checksum mismatch")

    @staticmethod
    def _gather_staged(plan: _StagedPlan, staging: torch.Tensor, values: dict[tuple, torch.Tensor],
                       failures: dict[int, CorruptRows]) -> None:
        device = staging.device
        for i, key, byte_at, packed_rows, rb in plan.gathers:
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
