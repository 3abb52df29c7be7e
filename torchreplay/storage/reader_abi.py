"""The rows the C++ shard reader (csrc/shard_reader.h, op `read_shard_rows`) takes and returns, typed.

The op takes its request as int64 tensors, one row per segment and per row range, and returns one
status row per segment: positional integers that the C++ side reads through structs. Here they are
NamedTuples with the C++ field names, and the status codes and page states are enums. At import,
the field lists and code values are checked against what the loaded extension reports
(`torchreplay::shard_reader_layout`): a struct changed on one side only is refused then with a
clear error, instead of every cold read being misread.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Iterable, NamedTuple

import torch

from torchreplay._ops import REBUILD_HINT, ops


class Segment(NamedTuple):
    """Rows of one field block of one file (C++ `Segment`)."""

    file: int  # index into the file list
    block_offset: int  # byte offset of the block in the file (4 KiB aligned)
    block_bytes: int  # payload bytes of the block
    row_bytes: int  # bytes per token row
    page_size: int  # checksum page size
    crc_begin: int  # index of the block's page 0 in the checksum list
    dest: int  # destination index; VERIFY_ONLY = verify the pages only
    row_begin: int  # this segment's row ranges in the row list: [row_begin, row_end)
    row_end: int


class RowRange(NamedTuple):
    """Token rows [start, end) of a block go to destination rows [dest, dest + end - start) (C++ `Row`)."""

    start: int
    end: int
    dest: int


class ReadStatus(NamedTuple):
    """What the reader did for one segment (C++ `Status`): the first failure (code + detail: the
    block's page index for CHECKSUM, bytes got for SHORT_READ, errno otherwise), bytes read and
    pread calls made."""

    code: int
    detail: int
    bytes: int
    reads: int


class ReadCode(IntEnum):
    """Per-segment status codes (C++ `Code`); from SHORT_READ up the file itself failed."""

    OK = 0
    CHECKSUM = 1
    SHORT_READ = 2
    OPEN_FAILED = 3
    READ_FAILED = 4


class PageState(IntEnum):
    """What the read found per checksum page (C++ `PageState`)."""

    UNREAD = 0
    OK = 1
    BAD = 2


VERIFY_ONLY = -1  # Segment.dest of a segment whose pages are checked but copied nowhere

ROW_TYPES = {"Segment": Segment, "Row": RowRange, "Status": ReadStatus}
CODE_TYPES = {"Code": ReadCode, "PageState": PageState}


class ReaderLayoutError(ImportError):
    """The Python rows here and the loaded extension's C++ structs disagree."""


def parse_layout(text: str) -> dict[str, list[str]]:
    """{"Segment": [field, ...], ..., "Code": ["ok:0", ...]} from the op's description."""
    parsed: dict[str, list[str]] = {}
    for part in text.split(";"):
        kind, sep, names = part.partition("=")
        if not sep or not kind:
            raise ReaderLayoutError(f"the extension's shard reader layout {text!r} cannot be read; {REBUILD_HINT}")
        parsed[kind] = names.split(",") if names else []
    return parsed


def check_layout(reported: str) -> None:
    """Raise ReaderLayoutError unless every row type and code here matches `reported` (the text of
    `torchreplay::shard_reader_layout`), field by field and value by value."""
    parsed = parse_layout(reported)
    wrong = []
    for kind, row in ROW_TYPES.items():
        ours = list(row._fields)
        if parsed.get(kind) != ours:
            wrong.append(f"{kind}: C++ has ({', '.join(parsed.get(kind, []))}), Python {row.__name__} has "
                         f"({', '.join(ours)})")
    for kind, enum in CODE_TYPES.items():
        ours = [f"{member.name.lower()}:{member.value}" for member in enum]
        if parsed.get(kind) != ours:
            wrong.append(f"{kind}: C++ has ({', '.join(parsed.get(kind, []))}), Python {enum.__name__} has "
                         f"({', '.join(ours)})")
    if wrong:
        raise ReaderLayoutError(
            "torchreplay's C++ shard reader (csrc/shard_reader.h) and torchreplay/storage/reader_abi.py disagree on "
            f"the rows they exchange: {'; '.join(wrong)}. The extension and the Python package come from different "
            f"sources; {REBUILD_HINT}")


def reported_layout() -> str:
    """What the loaded extension reports (an extension from before the op existed is stale)."""
    try:
        op = ops.shard_reader_layout
    except (AttributeError, RuntimeError) as exc:
        raise ReaderLayoutError(f"torchreplay's extension does not report its shard reader layout: it predates "
                                f"this source tree; {REBUILD_HINT}") from exc
    return op()


check_layout(reported_layout())


def segment_table(segments: Iterable[Segment]) -> torch.Tensor:
    """int64 [S, fields]: the op's `segments` argument."""
    return torch.tensor(list(segments), dtype=torch.int64).reshape(-1, len(Segment._fields))


def row_table(starts: torch.Tensor, ends: torch.Tensor, dests: torch.Tensor) -> torch.Tensor:
    """int64 [R, fields]: the op's `rows` argument, one RowRange per element of the columns."""
    columns = {"start": starts, "end": ends, "dest": dests}
    return torch.stack([columns[name] for name in RowRange._fields], 1).reshape(-1, len(RowRange._fields))


def statuses(table: torch.Tensor) -> list[ReadStatus]:
    """The op's result as one ReadStatus per segment."""
    return [ReadStatus(*row) for row in table.tolist()]
