"""What a checkpoint's objects are called and what its manifest holds: object keys, tags and
their pointers, building, reading and validating a manifest. Shared by the Checkpointer (which
writes them), restores, the distributed generations and `torchreplay inspect` (which read them).

Layout under the run prefix (docs/checkpoints.md)::

    shards/<session>-<shard id>.trs     shard files (storage/format.py), immutable
    state/<sequence>.json + .bin        buffer metadata (slot table, sampler, RNG, counters)
    manifests/<sequence>.json           names the state objects and every shard they need
    tags/<tag>.json                     {"manifest", "sequence", "policy_version"}: a trainer's checkpoint, by name
    LATEST                              {"manifest": "manifests/<sequence>.json"}, written last
"""

from __future__ import annotations

import json
import re
import time
from typing import Any, NamedTuple

from torchreplay import boundedjson
from torchreplay.checkpoint.store import ObjectStore, check_key
from torchreplay.checks import is_int
from torchreplay.errors import CheckpointError
from torchreplay.storage import format as fmt

MANIFEST_VERSION = 1
LATEST = "LATEST"
TAG_PATTERN = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}$")


class ManifestRefs(NamedTuple):
    """The objects a manifest keeps alive: its shards and its two state objects."""

    shards: frozenset[str]
    states: frozenset[str]


# ------------------------------------------------------------------------------------ keys
def shard_key(session: str, shard_id: int) -> str:
    return f"shards/{session}-{shard_id:010d}.trs"


def manifest_key(sequence: int) -> str:
    return f"manifests/{sequence:012d}.json"


def state_keys(sequence: int) -> tuple[str, str]:
    """The state's JSON and blob keys of manifest `sequence`."""
    return f"state/{sequence:012d}.json", f"state/{sequence:012d}.bin"


def check_tag(tag: Any) -> str:
    """A tag as its key-safe string: an int (a trainer step) or a short name."""
    if isinstance(tag, bool) or not isinstance(tag, (int, str)):
        raise TypeError(f"tag must be an int (e.g. a trainer step) or a str, got {type(tag).__name__}")
    text = str(tag)
    if not TAG_PATTERN.match(text):
        raise ValueError(f"tag {text!r} must be 1-100 characters of letters, digits, '.', '_', '-' "
                         f"(not starting with '.')")
    return text


def tag_key(tag: Any) -> str:
    return f"tags/{check_tag(tag)}.json"


def sequence_after_newest(manifest_keys: list[str]) -> int:
    """The sequence after the newest of `manifests/<sequence>.json` (0 when there is none)."""
    stems = [key.split("/")[-1].split(".")[0] for key in manifest_keys]
    return max((int(stem) for stem in stems if stem.isdigit()), default=-1) + 1


# ----------------------------------------------------------------------------- writing
def shard_identity(header: fmt.ShardHeader | None) -> dict[str, int]:
    """What a manifest records of a shard object (docs/storage_format.md): its size and header CRC,
    where its header is known (a shard restored into hot-only storage before it had one: none)."""
    if header is None:
        return {}
    return {"bytes": header.file_bytes, **({"header_crc32": header.crc32} if header.crc32 is not None else {})}


def build_manifest(sequence: int, session: str, state_sizes: tuple[int, int], shards: list[dict[str, Any]],
                   rollouts: int, policy_version: int, tag: str | None) -> dict[str, Any]:
    """Manifest `sequence`: `state_sizes` are the bytes of the state's JSON and blob; `shards` are
    entries {"id", "key", "live_rows", and the shard's identity ("bytes", "header_crc32")}, which
    let a reader refuse a grown or swapped object before reading past its header."""
    state_key, blob_key = state_keys(sequence)
    manifest = {
        "format_version": MANIFEST_VERSION,
        "sequence": sequence,
        "created_unix_s": time.time(),
        "session": session,
        "state": {"json": state_key, "blob": blob_key, "json_bytes": state_sizes[0], "blob_bytes": state_sizes[1]},
        "shards": shards,
        "rollouts": rollouts,
        "policy_version": policy_version,
    }
    if tag is not None:
        manifest["tag"] = tag
    return manifest


def manifest_refs(manifest: dict[str, Any]) -> ManifestRefs:
    """What a validated manifest keeps alive."""
    return ManifestRefs(frozenset(s["key"] for s in manifest["shards"]),
                        frozenset((manifest["state"]["json"], manifest["state"]["blob"])))


def tag_pointer(manifest: dict[str, Any]) -> dict[str, Any]:
    """What tags/<tag>.json holds for `manifest`."""
    return {"manifest": manifest_key(manifest["sequence"]), "sequence": manifest["sequence"],
            "policy_version": manifest["policy_version"]}


def parse_tag_pointer(data: bytes) -> dict[str, Any] | None:
    """A tag object's pointer, or None when it is not one (it then keeps nothing alive)."""
    try:
        pointer = json.loads(data)
    except ValueError:
        return None
    return pointer if isinstance(pointer, dict) else None


# ----------------------------------------------------------------------------- reading
def read_manifest(store: ObjectStore, key: str | None = None, tag: Any = None) -> dict[str, Any]:
    """The manifest `key`, the one tagged `tag`, or the newest one (following LATEST); validated
    before anything is allocated or opened."""
    if key is not None and tag is not None:
        raise ValueError("pass a manifest key or a tag, not both")
    if tag is not None:
        key_of_tag = tag_key(tag)
        if not store.exists(key_of_tag):
            raise CheckpointError(f"no checkpoint tagged {str(tag)!r} under {store.uri}")
        key = read_pointer(store, key_of_tag)
    elif key is None:
        key = read_pointer(store, LATEST)
    key = check_key(key)
    if not key.startswith("manifests/"):
        raise CheckpointError(f"{key!r} is not a manifest key (outside manifests/)")
    boundedjson.check_size(store.size(key), boundedjson.MAX_DOCUMENT_BYTES, f"manifest {key}", CheckpointError)
    manifest = boundedjson.loads(store.get(key), f"manifest {key}", CheckpointError)
    validate_manifest(manifest)
    return manifest


def read_pointer(store: ObjectStore, key: str) -> str:
    """The manifest key that LATEST or a tag object names (size-bounded before it is read)."""
    where = f"{store.uri}/{key}"
    boundedjson.check_size(store.size(key), boundedjson.MAX_POINTER_BYTES, where, CheckpointError)
    pointer = boundedjson.loads(store.get(key), where, CheckpointError)
    if not isinstance(pointer, dict) or not isinstance(pointer.get("manifest"), str):
        raise CheckpointError(f"{where} does not name a manifest")
    return pointer["manifest"]


def _is_size(value: Any, limit_bits: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and 0 <= value < 1 << limit_bits


def validate_manifest(m: Any) -> None:
    """Refuse (CheckpointError, naming the field) a manifest that is not one this version wrote."""
    if not isinstance(m, dict):
        raise CheckpointError("manifest must be a JSON object")
    if m.get("format_version") != MANIFEST_VERSION:
        raise CheckpointError(f"unsupported manifest format_version {m.get('format_version')!r}")
    for name in ("sequence", "rollouts", "policy_version"):
        if not is_int(m.get(name)) or m[name] < 0:
            raise CheckpointError(f"manifest field {name!r} must be a non-negative int, got {m.get(name)!r}")
    state = m.get("state")
    if not isinstance(state, dict):
        raise CheckpointError("manifest 'state' must be an object")
    for name in ("json", "blob"):
        key = state.get(name)
        if not isinstance(key, str) or not check_key(key).startswith("state/"):
            raise CheckpointError(f"manifest state.{name} {key!r} must be a key under state/")
    for name in ("json_bytes", "blob_bytes"):
        if not _is_size(state.get(name), 40):
            raise CheckpointError(f"manifest state.{name} must be a size in bytes, got {state.get(name)!r}")
    shards = m.get("shards")
    if not isinstance(shards, list):
        raise CheckpointError("manifest 'shards' must be a list")
    seen: set[int] = set()
    total_live = 0
    for s in shards:
        total_live += _validate_shard_entry(s, seen)
    if total_live != m["rollouts"]:
        raise CheckpointError(f"manifest: shards hold {total_live} live rollouts, manifest says {m['rollouts']}")


def _validate_shard_entry(s: Any, seen: set[int]) -> int:
    """One entry of a manifest's shards (ids unique across `seen`); returns its live rows."""
    if not isinstance(s, dict):
        raise CheckpointError("manifest shard entries must be objects")
    sid, key, live = s.get("id"), s.get("key"), s.get("live_rows")
    if not is_int(sid) or sid < 0 or sid in seen:
        raise CheckpointError(f"manifest shard id {sid!r} is invalid or repeated")
    seen.add(sid)
    if not isinstance(key, str) or not check_key(key).startswith("shards/") or not key.endswith(".trs"):
        raise CheckpointError(f"manifest shard key {key!r} must be shards/<name>.trs inside the prefix")
    if not is_int(live) or live < 1:
        raise CheckpointError(f"manifest shard {sid}: live_rows must be >= 1, got {live!r}")
    size = s.get("bytes", 0)
    if not _is_size(size, 50):
        raise CheckpointError(f"manifest shard {sid}: bytes must be a size, got {size!r}")
    crc = s.get("header_crc32", 0)
    if not _is_size(crc, 32):
        raise CheckpointError(f"manifest shard {sid}: header_crc32 must be a CRC32 (a u32), got {crc!r}")
    return live
