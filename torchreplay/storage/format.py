"""The shard file format: one sealed, immutable file per shard, readable field by field.

Layout (all integers little-endian)::

    0      8 bytes   magic b"TRSHARD1"
    8      8 bytes   header length H (u64)
    16     4 bytes   CRC32 of the header bytes (u32)
    20     H bytes   JSON header (UTF-8)
    ...    zero padding to the next 4 KiB boundary
    blocks           one per field, each starting on a 4 KiB boundary, zero padded to 4 KiB

The header is self-describing: format version, rollout count, page size, and a field table
(name, kind "offsets" | "token" | "rollout", dtype, per-row shape, block offset, byte size, and a
CRC32 per page of the block). Pages are `page_size` bytes (a multiple of 4 KiB), so a reader
fetching one rollout's tokens reads and verifies only the pages that hold them, and every read is
4 KiB aligned: the same file serves O_DIRECT, GPUDirect Storage (kvikio) and plain reads.

Readers validate the header before trusting any length: magic, version, header CRC, field names
and dtypes from a closed list, n within a row limit (the buffer's capacity where known), block
extents inside the file, block sizes that are whole rows (n of them for rollout blocks), and offsets
that are monotone and end at the token block's row count. Given the buffer's field specs, a reader
also checks the fields against them (`check_schema`) before the shard is adopted.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from concurrent.futures import Executor
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np
import torch

from torchreplay import boundedjson
from torchreplay.checks import is_int
from torchreplay.errors import SchemaError, StorageError
from torchreplay.schema import FieldSpec, StoredField, check_stored_fields, check_stored_offsets

MAGIC = b"TRSHARD1"
FORMAT_VERSION = 1
ALIGN = 4096
PAGE_SIZE = 64 * 1024
PREAMBLE = struct.Struct("<8sQI")
MAX_HEADER_BYTES = 16 * 1024 * 1024  # a 1.2 GiB shard's header is ~214 KiB (its page CRCs)
# A shard is one add() (or a compaction of live rows), so its rows never exceed a buffer's capacity;
# readers that know the capacity pass it. Without one, no real batch comes near this, and the
# offsets block it allows (128 MiB) is the most a lying header can make a reader allocate.
MAX_ROWS = 1 << 24
MAX_PAGE_SIZE = 1 << 30  # the C++ reader's bound (csrc/shard_reader.h)

DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
KINDS = ("offsets", "token", "rollout")


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


@dataclass(frozen=True)
class BlockInfo:
    name: str
    kind: str
    dtype: torch.dtype
    shape: tuple[int, ...]  # per-row trailing shape
    offset: int  # byte offset of the block in the file (4 KiB aligned)
    nbytes: int  # payload bytes (before padding)
    page_crcs: tuple[int, ...]

    @property
    def row_bytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class ShardHeader:
    n: int
    page_size: int
    blocks: dict[str, BlockInfo]
    file_bytes: int
    # CRC32 of the header's bytes, as the preamble stores it. The header lists every page's CRC,
    # so this identifies the whole shard: checkpoint manifests record it (`header_crc32`).
    crc32: int | None = field(default=None, compare=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "n": self.n,
            "page_size": self.page_size,
            "file_bytes": self.file_bytes,
            "fields": [
                {"name": b.name, "kind": b.kind, "dtype": DTYPE_NAMES[b.dtype], "shape": list(b.shape),
                 "offset": b.offset, "nbytes": b.nbytes, "page_crcs": list(b.page_crcs)}
                for b in self.blocks.values()
            ],
        }


def _as_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return memoryview(t.numpy()).cast("B")


def page_crcs(data: memoryview, page_size: int, pool: Executor | None = None) -> list[int]:
    """CRC32 of each page (zlib's CRC-32). Writable buffers (tensor bytes: every block of a shard
    being written) go to the C++ op, ~3-4x zlib's speed here (PCLMULQDQ), without the GIL;
    read-only ones (small headers) to zlib, where a pool spreads runs of 64 pages over threads."""
    view = memoryview(data).cast("B")
    if not view.readonly and len(view) and page_size % 4096 == 0:
        return torch.ops.torchreplay.page_crc32(torch.frombuffer(view, dtype=torch.uint8), page_size).tolist()
    starts = range(0, len(data), page_size)
    if pool is None or len(starts) < 128:
        return [zlib.crc32(data[i : i + page_size]) for i in starts] or [zlib.crc32(b"")]
    run = 64 * page_size

    def crcs(begin: int) -> list[int]:
        return [zlib.crc32(data[i : i + page_size]) for i in range(begin, min(begin + run, len(data)), page_size)]

    return [c for part in pool.map(crcs, range(0, len(data), run)) for c in part]


@dataclass(frozen=True)
class ShardLayout:
    """Where every block of a shard goes, before its checksums are known."""

    n: int
    page_size: int
    blocks: list[tuple[str, str, torch.dtype, tuple[int, ...], int, memoryview]]  # name, kind, dtype, shape, offset, bytes
    file_bytes: int
    header_room: int  # bytes reserved for preamble + header

    def writes(self) -> list[tuple[int, memoryview]]:
        return [(offset, data) for _, _, _, _, offset, data in self.blocks]

    def header(self, crcs: dict[str, list[int]]) -> tuple[ShardHeader, bytes]:
        """The final header given each block's page checksums; fits the reserved room."""
        blocks = {name: BlockInfo(name, kind, dtype, shape, offset, len(data), tuple(crcs[name]))
                  for name, kind, dtype, shape, offset, data in self.blocks}
        header = ShardHeader(n=self.n, page_size=self.page_size, blocks=blocks, file_bytes=self.file_bytes)
        text = json.dumps(header.to_json(), separators=(",", ":")).encode()
        crc = zlib.crc32(text)
        head = PREAMBLE.pack(MAGIC, len(text), crc) + text
        assert len(head) <= self.header_room, "header outgrew its reservation"
        return dataclasses.replace(header, crc32=crc), head


def layout_shard(
    offsets: torch.Tensor,
    token: dict[str, torch.Tensor],
    rollout: dict[str, torch.Tensor],
    page_size: int = PAGE_SIZE,
) -> ShardLayout:
    """Place every block. The header goes first in the file but is written last, once checksums
    are known, so its room is reserved for the largest possible checksums (10 digits each)."""
    n = offsets.numel() - 1
    pieces: list[tuple[str, str, torch.Tensor]] = [("offsets", "offsets", offsets.to(torch.int64))]
    pieces += [(name, "token", t) for name, t in token.items()]
    pieces += [(name, "rollout", t) for name, t in rollout.items()]
    datas = [(name, kind, t, _as_bytes(t)) for name, kind, t in pieces]
    worst = {name: [0xFFFFFFFF] * max(1, -(-len(data) // page_size)) for name, _, _, data in datas}
    header_room = ALIGN
    while True:
        cursor = align_up(PREAMBLE.size + header_room)
        blocks = []
        for name, kind, t, data in datas:
            blocks.append((name, kind, t.dtype, tuple(t.shape[1:]), cursor, data))
            cursor = align_up(cursor + len(data))
        layout = ShardLayout(n, page_size, blocks, max(cursor, ALIGN), align_up(PREAMBLE.size + header_room))
        _, head = ShardLayout(n, page_size, blocks, layout.file_bytes, 1 << 62).header(worst)
        if len(head) <= layout.header_room:
            return layout
        header_room = len(head) + ALIGN


def plan_shard(
    offsets: torch.Tensor,
    token: dict[str, torch.Tensor],
    rollout: dict[str, torch.Tensor],
    page_size: int = PAGE_SIZE,
    pool: Executor | None = None,
) -> tuple[ShardHeader, list[tuple[int, memoryview]], bytes]:
    """A whole shard in one go: (header, [(file offset, bytes)] for every block, preamble + header)."""
    layout = layout_shard(offsets, token, rollout, page_size)
    crcs = {name: page_crcs(data, page_size, pool) for name, _, _, _, _, data in layout.blocks}
    header, head = layout.header(crcs)
    return header, layout.writes(), head


def parse_header(head: bytes, file_bytes: int, max_rows: int = MAX_ROWS) -> ShardHeader:
    """Validate and decode the preamble + header. `head` must hold at least the whole header.

    Every length a reader will act on is checked here, before anything proportional to it is read
    or allocated: n against `max_rows`, each block inside the file, and each block's size against
    its dtype, per-row shape and (rollout blocks) n. Token blocks' row counts are checked against
    the offsets once those are read (`validate_offsets`)."""
    if len(head) < PREAMBLE.size:
        raise StorageError("shard file is truncated: no header")
    magic, length, crc = PREAMBLE.unpack_from(head)
    if magic != MAGIC:
        raise StorageError(f"not a torchreplay shard (magic {magic!r})")
    if length > MAX_HEADER_BYTES or PREAMBLE.size + length > len(head):
        raise StorageError(f"shard header length {length} exceeds what was read ({len(head)} bytes)")
    text = head[PREAMBLE.size : PREAMBLE.size + length]
    if zlib.crc32(text) != crc:
        raise StorageError("shard header checksum mismatch")
    meta = boundedjson.loads(text, "shard header", StorageError)
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        raise StorageError(f"unsupported shard format_version {meta.get('format_version') if isinstance(meta, dict) else meta!r}")
    n, page_size = meta.get("n"), meta.get("page_size")
    if not is_int(n) or n < 0 or not is_int(page_size) or page_size <= 0 or page_size % ALIGN \
            or page_size > MAX_PAGE_SIZE:
        raise StorageError(f"shard header has invalid n={n!r} or page_size={page_size!r}")
    if n > max_rows:
        raise StorageError(f"shard header claims {n} rows, more than the {max_rows} allowed")
    if meta.get("file_bytes") != file_bytes:
        raise StorageError(f"shard file is {file_bytes} bytes, header says {meta.get('file_bytes')!r}")
    entries = meta.get("fields")
    if not isinstance(entries, list):
        raise StorageError(f"shard header 'fields' must be a list of field entries, got {entries!r:.80}")
    blocks: dict[str, BlockInfo] = {}
    for f in entries:
        try:
            name, kind, dtype = str(f["name"]), f["kind"], DTYPES[f["dtype"]]
            shape, offset, nbytes, crcs = tuple(f["shape"]), f["offset"], f["nbytes"], tuple(f["page_crcs"])
            if not all(map(is_int, (*shape, offset, nbytes, *crcs))):  # int() would truncate 4096.5, read true as 1
                raise TypeError("shape, offset, nbytes and page_crcs must be ints")
        except (KeyError, TypeError, ValueError) as exc:
            raise StorageError(f"shard header field entry is malformed: {f!r}") from exc
        # A zero in the shape makes rows of no bytes: any row count fits them, none can be decoded.
        if kind not in KINDS or any(d < 1 for d in shape) or offset % ALIGN or offset < ALIGN:
            raise StorageError(f"shard field {name!r}: invalid kind/shape/offset")
        if nbytes < 0:
            raise StorageError(f"shard field {name!r}: negative nbytes {nbytes}")
        if name in blocks:
            raise StorageError(f"shard field {name!r} appears twice in the header")
        if (kind == "offsets") != (name == "offsets") or (name == "offsets" and (dtype, shape) != (torch.int64, ())):
            raise StorageError(f"shard field {name!r}: only the block named 'offsets' is one, of int64 scalars")
        if offset + nbytes > file_bytes:
            raise StorageError(f"shard field {name!r}: block [{offset}, {offset + nbytes}) runs past the file end")
        if len(crcs) != max(1, -(-nbytes // page_size)):
            raise StorageError(f"shard field {name!r}: {len(crcs)} page checksums for {nbytes} bytes")
        blocks[name] = BlockInfo(name, kind, dtype, shape, offset, nbytes, crcs)
    if "offsets" not in blocks or blocks["offsets"].nbytes != 8 * (n + 1):
        raise StorageError("shard has no valid offsets block")
    header = ShardHeader(n=n, page_size=page_size, blocks=blocks, file_bytes=file_bytes, crc32=crc)
    for b in blocks.values():
        if b.nbytes % b.row_bytes:
            raise StorageError(f"shard field {b.name!r}: {b.nbytes} bytes is not a whole number of rows")
        if b.kind == "rollout" and b.nbytes != n * b.row_bytes:
            raise StorageError(f"shard field {b.name!r}: {b.nbytes // b.row_bytes} rows for {n} rollouts")
    return header


def stored_fields(header: ShardHeader) -> dict[str, StoredField]:
    """Each field block's (kind, dtype, per-row shape, rows), as `schema.check_stored_*` take them."""
    return {b.name: (b.kind, b.dtype, b.shape, b.nbytes // b.row_bytes)
            for b in header.blocks.values() if b.kind != "offsets"}


def check_schema(header: ShardHeader, offsets: torch.Tensor | None, fields: Mapping[str, FieldSpec],
                 convertible: bool = False) -> None:
    """A shard's fields (and, once read, its offsets) against the specs of what a shard of the
    buffer holds, as a StorageError (see `schema.check_stored_fields`)."""
    stored = stored_fields(header)
    try:
        check_stored_fields(fields, stored, convertible)
        if offsets is not None:
            check_stored_offsets(offsets, stored)
    except SchemaError as exc:
        raise StorageError(f"shard does not match the buffer's schema: {exc}") from exc


def decode(data: bytes | bytearray | memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Bytes -> tensor of rows with trailing `shape` (copying, so the result owns its memory)."""
    raw = np.frombuffer(data, dtype=np.uint8).copy()
    if dtype == torch.bfloat16:
        t = torch.from_numpy(raw).view(torch.int16).view(torch.bfloat16)
    else:
        t = torch.from_numpy(raw).view(dtype)
    return t.reshape(-1, *shape)


def validate_offsets(offsets: torch.Tensor, header: ShardHeader) -> None:
    if int(offsets[0]) != 0 or bool((offsets[1:] < offsets[:-1]).any()):
        raise StorageError("shard offsets are not monotone from 0")
    total = int(offsets[-1])
    for b in header.blocks.values():
        if b.kind == "token" and b.row_bytes and b.nbytes // b.row_bytes != total:
            raise StorageError(f"shard field {b.name!r} has {b.nbytes // b.row_bytes} token rows, offsets say {total}")


def header_span(head: bytes) -> int:
    """Bytes needed to hold the preamble and header, from the first 20 bytes."""
    if len(head) < PREAMBLE.size:
        raise StorageError("shard file is truncated: no header")
    magic, length, _ = PREAMBLE.unpack_from(head)
    if magic != MAGIC:
        raise StorageError(f"not a torchreplay shard (magic {magic!r})")
    if length > MAX_HEADER_BYTES:
        raise StorageError(f"shard header length {length} is implausible")
    return PREAMBLE.size + length


def read_block(data: bytes | memoryview, block: BlockInfo, page_size: int, base: int = 0) -> torch.Tensor:
    """Decode a whole block from `data` (file bytes starting at file offset `base`), every page verified."""
    start = block.offset - base
    view = memoryview(data)[start : start + block.nbytes]
    if len(view) != block.nbytes:
        raise StorageError(f"shard field {block.name!r}: truncated block")
    for p, crc in enumerate(block.page_crcs):
        if zlib.crc32(view[p * page_size : (p + 1) * page_size]) != crc:
            raise StorageError(f"shard field {block.name!r}: checksum mismatch in page {p}")
    return decode(view, block.dtype, block.shape)


def parse_shard(data: bytes, max_rows: int = MAX_ROWS) -> PackedShard:
    """A whole shard file in memory -> validated header and every block decoded."""
    header = parse_header(data[: header_span(data)], len(data), max_rows)
    offsets = read_block(data, header.blocks["offsets"], header.page_size).reshape(-1)
    validate_offsets(offsets, header)
    token, rollout = {}, {}
    for b in header.blocks.values():
        if b.kind == "token":
            token[b.name] = read_block(data, b, header.page_size)
        elif b.kind == "rollout":
            rollout[b.name] = read_block(data, b, header.page_size)
    return PackedShard(header, offsets, token, rollout)


def read_shard_meta(path: str, max_rows: int = MAX_ROWS, fields: Mapping[str, FieldSpec] | None = None,
                    convertible: bool = False, header_crc32: int | None = None) -> PackedShard:
    """Header, offsets and per-rollout fields of a shard file; token blocks are left on disk.
    `max_rows`, `fields` and `header_crc32` as for `read_meta`."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            def read(offset: int, length: int) -> bytes:
                f.seek(offset)
                return f.read(length)

            return read_meta(read, size, max_rows=max_rows, fields=fields, convertible=convertible,
                             header_crc32=header_crc32)
    except OSError as exc:
        raise StorageError(f"cannot read shard {path}: {exc}") from exc


def read_meta(read: Callable[[int, int], bytes], file_bytes: int, first_read: int = 1 << 20,
              max_rows: int = MAX_ROWS, fields: Mapping[str, FieldSpec] | None = None,
              convertible: bool = False, header_crc32: int | None = None) -> PackedShard:
    """`read_shard_meta` over any random-access source (`read(offset, length)`: a file, or ranged
    GETs of an object that has not been downloaded). Reads only the header and the small blocks,
    coalescing blocks that lie close together into one read (the per-rollout blocks sit together
    at the end of the file), so a remote source answers in a handful of requests.

    `max_rows` bounds n (a buffer's capacity, where the caller knows it). With `fields` (the specs
    of what a shard of the buffer holds) the header's fields are checked against them before any
    block is read, and the offsets once read (`check_schema`). With `header_crc32` (what a
    manifest recorded of the shard it names), a file whose header CRC differs is another shard's
    and is refused from its first read, before its header is parsed."""
    head = read(0, min(file_bytes, first_read))
    span = header_span(head)
    if header_crc32 is not None and PREAMBLE.unpack_from(head)[2] != header_crc32:
        raise StorageError(f"shard header CRC {PREAMBLE.unpack_from(head)[2]} is not the {header_crc32} recorded "
                           "for it: the object holds another shard")
    if span > len(head):
        head = read(0, span)
    header = parse_header(head, file_bytes, max_rows)
    if fields is not None:
        check_schema(header, None, fields, convertible)
    small = sorted((b for b in header.blocks.values() if b.kind != "token"), key=lambda b: b.offset)
    runs: list[list] = []  # [begin, end, blocks]
    for b in small:
        if b.offset + b.nbytes <= len(head):
            continue
        if runs and b.offset - runs[-1][1] <= 64 * 1024:
            runs[-1][1] = max(runs[-1][1], b.offset + b.nbytes)
            runs[-1][2].append(b)
        else:
            runs.append([b.offset, b.offset + b.nbytes, [b]])
    datas: dict[str, bytes | memoryview] = {}
    for b in small:
        if b.offset + b.nbytes <= len(head):
            datas[b.name] = memoryview(head)[b.offset : b.offset + b.nbytes]
    for begin, end, blocks in runs:
        data = memoryview(read(begin, end - begin))
        for b in blocks:
            datas[b.name] = data[b.offset - begin : b.offset - begin + b.nbytes]
    parts = {}
    for b in small:
        if len(datas[b.name]) != b.nbytes:
            raise StorageError(f"shard block {b.name!r} is truncated ({len(datas[b.name])} of {b.nbytes} bytes)")
        parts[b.name] = read_block(datas[b.name], b, header.page_size, base=b.offset)
    offsets = parts.pop("offsets").reshape(-1)
    validate_offsets(offsets, header)
    if fields is not None:
        check_schema(header, offsets, fields, convertible)
    return PackedShard(header, offsets, {}, parts)


@dataclass
class PackedShard:
    header: ShardHeader
    offsets: torch.Tensor
    token: dict[str, torch.Tensor]
    rollout: dict[str, torch.Tensor]
