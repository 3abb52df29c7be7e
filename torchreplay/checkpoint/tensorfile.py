"""Nested state (dicts, lists, numbers, strings, tensors) <-> JSON + one binary tensor blob.

No pickle: the JSON names each tensor's dtype, shape, byte range and CRC32, and loading checks all
of them against the blob before building a single tensor.
"""

from __future__ import annotations

import json
import math
import zlib
from typing import Any

import numpy as np
import torch

from torchreplay import boundedjson
from torchreplay.errors import CheckpointError
from torchreplay.storage.format import DTYPE_NAMES, DTYPES

_TENSOR = "__tensor__"
MAX_TENSOR_BYTES = 1 << 40


def flatten(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """Replace every tensor in `state` by {"__tensor__": i}; return (json-able tree, tensors)."""
    tensors: list[torch.Tensor] = []

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            tensors.append(x.detach().cpu().contiguous())
            return {_TENSOR: len(tensors) - 1}
        if isinstance(x, dict):
            if not all(isinstance(k, str) for k in x):
                raise TypeError(f"state dict keys must be str, got {[type(k).__name__ for k in x]}")
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [walk(v) for v in x]
        if isinstance(x, float) and not math.isfinite(x):
            return {"__float__": repr(x)}
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        raise TypeError(f"cannot serialize {type(x).__name__} without pickle")

    return walk(state), tensors


def pack(state: Any) -> tuple[bytes, bytes]:
    """(JSON bytes, tensor blob). The JSON holds the tensor table."""
    tree, tensors = flatten(state)
    table = []
    blobs = []
    offset = 0
    for t in tensors:
        data = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()
        table.append({"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "offset": offset,
                      "nbytes": len(data), "crc32": zlib.crc32(data)})
        blobs.append(data)
        offset += len(data)
    text = json.dumps({"tree": tree, "tensors": table}, separators=(",", ":")).encode()
    return text, b"".join(blobs)


def unpack(text: bytes, blob: bytes) -> Any:
    """Inverse of `pack`, validating every tensor entry against the blob."""
    doc = boundedjson.loads(text, "state JSON", CheckpointError)
    try:
        tree, table = doc["tree"], doc["tensors"]
    except (KeyError, TypeError) as exc:
        raise CheckpointError(f"state JSON is malformed: {exc}") from exc
    if not isinstance(table, list):
        raise CheckpointError("state JSON: 'tensors' must be a list")
    tensors = []
    for i, entry in enumerate(table):
        try:
            dtype = DTYPES[entry["dtype"]]
            shape = [int(d) for d in entry["shape"]]
            offset, nbytes, crc = int(entry["offset"]), int(entry["nbytes"]), int(entry["crc32"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"state tensor {i}: malformed entry {entry!r}") from exc
        if any(d < 0 for d in shape) or offset < 0 or nbytes < 0 or nbytes > MAX_TENSOR_BYTES:
            raise CheckpointError(f"state tensor {i}: negative or oversized shape/offset")
        itemsize = torch.tensor([], dtype=dtype).element_size()
        if math.prod(shape) * itemsize != nbytes:
            raise CheckpointError(f"state tensor {i}: shape {shape} of {entry['dtype']} is not {nbytes} bytes")
        if offset + nbytes > len(blob):
            raise CheckpointError(f"state tensor {i}: bytes [{offset}, {offset + nbytes}) past the blob's end")
        data = blob[offset : offset + nbytes]
        if zlib.crc32(data) != crc:
            raise CheckpointError(f"state tensor {i}: checksum mismatch")
        if nbytes == 0:
            tensors.append(torch.empty(shape, dtype=dtype))
            continue
        raw = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())
        t = raw.view(torch.int16).view(torch.bfloat16) if dtype == torch.bfloat16 else raw.view(dtype)
        tensors.append(t.reshape(shape))

    def walk(x: Any) -> Any:
        if isinstance(x, dict):
            if set(x) == {_TENSOR}:
                i = x[_TENSOR]
                if not isinstance(i, int) or not 0 <= i < len(tensors):
                    raise CheckpointError(f"state names tensor {i!r}, which does not exist")
                return tensors[i]
            if set(x) == {"__float__"}:
                if x["__float__"] not in ("inf", "-inf", "nan"):
                    raise CheckpointError(f"bad float literal {x['__float__']!r}")
                return float(x["__float__"])
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x

    return walk(tree)
