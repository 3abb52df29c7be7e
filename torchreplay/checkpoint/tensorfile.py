"""Nested state (dicts, lists, numbers, strings, tensors) <-> JSON text + one safetensors blob.

The JSON holds the structure, with each tensor replaced by {"__tensor__": i}; tensor i is the entry
named str(i) in the blob. safetensors is a maintained format that cannot run code on load (no
pickle) and that other tools can read. It carries no checksum and trusts its header, so `unpack`
checks the blob's CRC32 (recorded in the JSON) and validates the header (its length, dtypes from
the shard format's closed list, shapes, byte ranges, names) before safetensors sees a byte.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from torchreplay import boundedjson
from torchreplay.errors import CheckpointError

FORMAT = "safetensors"
_TENSOR = "__tensor__"
_FLOAT = "__float__"
# safetensors refuses headers over 100 MB itself; saying so first keeps the error ours.
MAX_HEADER_BYTES = 16 << 20  # ~100 B per tensor: a state holds a few dozen
# Real states nest a handful of levels (config, sampler, optimizer groups); the bound keeps walking a
# hostile tree far from the interpreter's recursion limit.
MAX_DEPTH = 64
# The shard format's closed dtype list (storage/format.py DTYPES), spelled as safetensors spells it.
DTYPE_CODES: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
}
_ITEMSIZE = {code: torch.empty(0, dtype=dtype).element_size() for dtype, code in DTYPE_CODES.items()}
_HEADER_LEN = struct.Struct("<Q")


def flatten(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """Replace every tensor in `state` by {"__tensor__": i}; return (json-able tree, tensors)."""
    tensors: list[torch.Tensor] = []
    storages: set[int] = set()

    def walk(x: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise ValueError(f"state nests deeper than {MAX_DEPTH} levels, which unpack would refuse")
        if isinstance(x, torch.Tensor):
            if x.dtype not in DTYPE_CODES:
                raise TypeError(f"state tensor of dtype {x.dtype} is not one a checkpoint stores")
            t = x.detach().cpu().contiguous()
            # safetensors refuses two entries over the same memory (e.g. one tensor reached twice).
            ptr = t.untyped_storage().data_ptr()
            if ptr in storages:
                t = t.clone()
            elif t.numel():
                storages.add(ptr)
            tensors.append(t)
            return {_TENSOR: len(tensors) - 1}
        if isinstance(x, dict):
            if not all(isinstance(k, str) for k in x):
                raise TypeError(f"state dict keys must be str, got {[type(k).__name__ for k in x]}")
            return {k: walk(v, depth + 1) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [walk(v, depth + 1) for v in x]
        if isinstance(x, float) and not math.isfinite(x):
            return {_FLOAT: repr(x)}
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        raise TypeError(f"cannot serialize {type(x).__name__} without pickle")

    return walk(state, 0), tensors


def pack(state: Any) -> tuple[bytes, bytes]:
    """(JSON bytes, safetensors blob)."""
    tree, tensors = flatten(state)
    blob = st_save({str(i): t for i, t in enumerate(tensors)})
    text = json.dumps({"format": FORMAT, "tree": tree, "blob_crc32": zlib.crc32(blob)},
                      separators=(",", ":")).encode()
    return text, blob


def _header(blob: bytes) -> dict[str, tuple[str, list[int]]]:
    """The blob's tensor entries {name: (dtype code, shape)}, validated against the blob's bytes so
    that safetensors allocates nothing the blob does not hold."""
    if len(blob) < _HEADER_LEN.size:
        raise CheckpointError(f"state blob is {len(blob)} bytes, too short for a safetensors header")
    (n,) = _HEADER_LEN.unpack_from(blob)
    if n > MAX_HEADER_BYTES:
        raise CheckpointError(f"state blob header length {n} is more than the {MAX_HEADER_BYTES} allowed")
    if _HEADER_LEN.size + n > len(blob):
        raise CheckpointError(f"state blob header length {n} runs past the blob's end ({len(blob)} bytes)")
    header = boundedjson.loads(blob[_HEADER_LEN.size : _HEADER_LEN.size + n], "state blob header",
                               CheckpointError)
    if not isinstance(header, dict):
        raise CheckpointError("state blob header is not a JSON object")
    data_bytes = len(blob) - _HEADER_LEN.size - n
    entries = {}
    extents = []
    for name, entry in header.items():
        if name == "__metadata__":  # free-form strings in the format; safetensors checks their form
            continue
        try:
            code, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"state tensor {name!r}: malformed header entry") from exc
        if not isinstance(code, str) or code not in _ITEMSIZE:
            raise CheckpointError(f"state tensor {name!r}: dtype {code!r} is not allowed")
        ints = [*shape, begin, end] if isinstance(shape, list) else None
        if ints is None or not all(type(v) is int and v >= 0 for v in ints) or len(shape) > MAX_DEPTH:
            raise CheckpointError(f"state tensor {name!r}: shape {shape!r} or offsets are not non-negative ints")
        if end > data_bytes or begin > end:
            raise CheckpointError(f"state tensor {name!r}: bytes [{begin}, {end}) are outside the blob's "
                                  f"{data_bytes} data bytes")
        if math.prod(shape) * _ITEMSIZE[code] != end - begin:
            raise CheckpointError(f"state tensor {name!r}: shape {shape} of {code} is not {end - begin} bytes")
        entries[name] = (code, shape)
        extents.append((begin, end))
    # safetensors wants the data tiled exactly; checked here so the error names the problem.
    covered = 0
    for begin, end in sorted(extents):
        if begin != covered:
            raise CheckpointError("state blob tensors overlap or leave gaps in the data")
        covered = end
    if covered != data_bytes:
        raise CheckpointError(f"state blob tensors cover {covered} of its {data_bytes} data bytes")
    return entries


def _references(tree: Any) -> set[str]:
    """Names of the tensors `tree` refers to; refuses trees nested beyond MAX_DEPTH."""
    names: set[str] = set()
    stack = [(tree, 0)]
    while stack:
        x, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise CheckpointError(f"state JSON is nested too deeply (more than {MAX_DEPTH} levels)")
        if isinstance(x, dict):
            if set(x) == {_TENSOR}:
                i = x[_TENSOR]
                if type(i) is not int or i < 0:
                    raise CheckpointError(f"state names tensor {i!r}, which is not a tensor index")
                names.add(str(i))
                continue
            stack.extend((v, depth + 1) for v in x.values())
        elif isinstance(x, list):
            stack.extend((v, depth + 1) for v in x)
    return names


def peek(text: bytes, path: tuple[str, ...]) -> Any:
    """The plain value at `path` in a packed state's tree, read from its JSON alone (for checks
    to make before the blob is read); CheckpointError if it is not there."""
    doc = boundedjson.loads(text, "state JSON", CheckpointError)
    node = doc.get("tree") if isinstance(doc, dict) else None
    for name in path:
        if not isinstance(node, dict) or name not in node:
            raise CheckpointError(f"state JSON has no {'.'.join(path)}")
        node = node[name]
    return node


def unpack(text: bytes, blob: bytes) -> Any:
    """Inverse of `pack`. Every way hostile or corrupt input can fail is a CheckpointError."""
    doc = boundedjson.loads(text, "state JSON", CheckpointError)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or "tree" not in doc:
        raise CheckpointError(f"state JSON is not a {FORMAT} state (no 'format': {FORMAT!r} and 'tree')")
    crc = doc.get("blob_crc32")
    if type(crc) is not int:
        raise CheckpointError("state JSON has no integer 'blob_crc32'")
    if zlib.crc32(blob) != crc:
        raise CheckpointError("state blob checksum mismatch")
    entries = _header(blob)
    tree = doc["tree"]
    names = _references(tree)
    if names != set(entries):
        missing, extra = sorted(names - set(entries)), sorted(set(entries) - names)
        raise CheckpointError(f"state JSON names tensors the blob lacks {missing[:5]}, "
                              f"or the blob holds tensors nothing names {extra[:5]}")
    try:
        tensors = st_load(blob)
    except (SafetensorError, ValueError, KeyError, RuntimeError) as exc:
        raise CheckpointError(f"state blob is not valid safetensors: {exc}") from exc

    def walk(x: Any) -> Any:  # depth already bounded by _references
        if isinstance(x, dict):
            if set(x) == {_TENSOR}:
                return tensors[str(x[_TENSOR])]
            if set(x) == {_FLOAT}:
                if x[_FLOAT] not in ("inf", "-inf", "nan"):
                    raise CheckpointError(f"bad float literal {x[_FLOAT]!r}")
                return float(x[_FLOAT])
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x

    return walk(tree)
