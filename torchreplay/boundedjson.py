"""JSON from files a checkpoint or shard hands us, parsed under bounds: a hostile document (deeply
nested, or huge) is a clear error of the caller's type, never a RecursionError or a read of
gigabytes."""

from __future__ import annotations

import json
from typing import Any

# LATEST and a tag are one short pointer; a manifest lists shards (~100 B each: 32 MiB is some 300k
# shards); the state JSON is a small tree (its tensors are in the safetensors blob). Parsing a
# hostile document of the maximum size costs ~4x its size in Python objects: under 200 MiB.
MAX_POINTER_BYTES = 4 << 10
MAX_DOCUMENT_BYTES = 32 << 20


def check_size(size: int, limit: int, what: str, error: type[Exception]) -> None:
    """Raise `error` before reading an object whose recorded size exceeds `limit`."""
    if size > limit:
        raise error(f"{what} is {size} bytes, more than the {limit} allowed: refusing to read it")


def loads(data: bytes | str, what: str, error: type[Exception]) -> Any:
    """`json.loads`, with every way it can fail on hostile input turned into `error`."""
    try:
        return json.loads(data)
    except RecursionError as exc:  # e.g. "[" * 100_000: nesting beyond the interpreter's stack
        raise error(f"{what} is nested too deeply to be a torchreplay document") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise error(f"{what} is not valid JSON: {exc}") from exc
