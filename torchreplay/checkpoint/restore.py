"""Resume a buffer from a checkpoint, or import another run's rollouts into a live buffer.

Every read goes through one retry layer (store.open_reader): each object read may keep failing
transiently for `retry_budget_s` before the restore fails. The functions here that take a store
expect such a reader and do not retry again (nested retries multiply the budget).
"""

from __future__ import annotations

import dataclasses
import os
from functools import partial
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable

import torch

from torchreplay import boundedjson, samplers, snapshot
from torchreplay.assembly import Handles
from torchreplay.checkpoint import tensorfile
from torchreplay.checkpoint.checkpointer import Checkpointer
from torchreplay.checkpoint.manifest import read_manifest
from torchreplay.checkpoint.store import MissingObject, ObjectStore, check_retry_budget, open_reader
from torchreplay.checks import check_int, is_int
from torchreplay.errors import CheckpointError, StorageError
from torchreplay.shards import ShardListener
from torchreplay.slots import TABLE_FIELDS
from torchreplay.storage import MissingShard, TieredStorage
from torchreplay.storage import format as fmt

if TYPE_CHECKING:
    from torchreplay.buffer import RolloutBuffer

# The slot table, counters and sampler tree: some 90 B per slot (measured for every built-in
# sampler) and a few KiB more; 8 GiB is ~80M slots.
MAX_STATE_BLOB_BYTES = 8 << 30
STATE_BYTES_PER_SLOT = 256
STATE_FIXED_BYTES = 1 << 20

def load_state(store: ObjectStore, manifest: dict[str, Any]) -> dict[str, Any]:
    state_info = manifest["state"]
    boundedjson.check_size(state_info["json_bytes"], boundedjson.MAX_DOCUMENT_BYTES, f"state {state_info['json']}",
                           CheckpointError)
    boundedjson.check_size(state_info["blob_bytes"], MAX_STATE_BLOB_BYTES, f"state {state_info['blob']}",
                           CheckpointError)
    # Sizes first (stat / HEAD): an object grown past what the manifest records is refused unread.
    for name, recorded in (("json", state_info["json_bytes"]), ("blob", state_info["blob_bytes"])):
        size = store.size(state_info[name])
        if size != recorded:
            raise CheckpointError(f"checkpoint state object {state_info[name]} is {size} bytes, the manifest "
                                  f"records {recorded}")
    text = store.get(state_info["json"])
    # The blob holds ~90 bytes per slot: one far larger than the capacity it describes is refused
    # before it is read.
    capacity = tensorfile.peek(text, ("config", "capacity"))
    if not is_int(capacity) or capacity < 1:
        raise CheckpointError(f"checkpoint state config capacity {capacity!r} is not a slot count")
    boundedjson.check_size(state_info["blob_bytes"], STATE_FIXED_BYTES + STATE_BYTES_PER_SLOT * capacity,
                           f"state {state_info['blob']} of a {capacity}-slot buffer", CheckpointError)
    blob = store.get(state_info["blob"])
    if len(text) != state_info["json_bytes"] or len(blob) != state_info["blob_bytes"]:
        raise CheckpointError("checkpoint state objects do not have the sizes the manifest records")
    state = tensorfile.unpack(text, blob)
    if not isinstance(state, dict) or not isinstance(state.get("config"), dict):
        raise CheckpointError("checkpoint state has no buffer config")
    return state


def sampler_from_state(state: dict[str, Any]):
    """The checkpoint's sampler, rebuilt through the sampler registry."""
    try:
        return samplers.sampler_from_state(state.get("sampler"))
    except ValueError as exc:
        raise CheckpointError(f"checkpoint sampler: {exc}") from exc


def buffer_kwargs_from_config(config: dict[str, Any], overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Constructor arguments from a checkpoint's recorded BufferConfig (`overrides` may supply
    extra fields' specs for checkpoints that recorded only their names)."""
    try:
        recorded = snapshot.BufferConfig.from_json(config, extra_fields=(overrides or {}).get("extra_fields"))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint buffer config: {exc}") from exc
    return recorded.constructor_kwargs()


def _fetch_shards(store: ObjectStore, manifest: dict[str, Any], progress: bool, desc: str,
                  into: str | None = None) -> tuple[str, dict[int, str]]:
    """Download every shard the manifest names into a new temp dir (inside `into`, e.g. the cold
    tier's directory, so adopting a file is a rename on one file system); returns the dir, which
    the caller removes, and id -> local path."""
    tmp = tempfile.mkdtemp(prefix="torchreplay-restore-", dir=into)
    shards = manifest["shards"]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(shards), desc=desc, unit="shard")

    def one(entry: dict[str, Any]) -> tuple[int, str]:
        path = os.path.join(tmp, f"{entry['id']}.trs")
        store.get_to_file(entry["key"], path)
        if bar is not None:
            bar.update(1)
        return entry["id"], path

    try:
        with ThreadPoolExecutor(max_workers=4) as pool:
            paths = dict(pool.map(one, shards))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if bar is not None:
            bar.close()
    return tmp, paths


def fetch_shard_metas(store: ObjectStore, manifest: dict[str, Any], max_rows: int = fmt.MAX_ROWS,
                      fields: dict[str, Any] | None = None, convertible: bool = False) -> dict[int, fmt.PackedShard]:
    """Header and small blocks of every shard the manifest names, by ranged reads (no token data),
    checked as `fmt.read_meta` checks them with `max_rows` and `fields`: what is known of a shard
    before any of its token data is read or downloaded. An object whose size or header CRC is not
    the one the manifest records (`bytes`, `header_crc32`) holds another shard, or another
    version of it: refused by its size, or from the first read of its header. `store` is a
    reader (open_reader): its reads are retried there, not here."""

    def one(entry: dict[str, Any]) -> tuple[int, fmt.PackedShard]:
        key = entry["key"]
        size = store.size(key)
        if "bytes" in entry and size != entry["bytes"]:
            raise CheckpointError(f"checkpoint shard {key} is {size} bytes, the manifest records {entry['bytes']}")

        try:
            # A small first read: the header room is a few KiB, and every byte counts over a network.
            return entry["id"], fmt.read_meta(partial(store.get_range, key), size, first_read=64 * 1024, max_rows=max_rows, fields=fields,
                                              convertible=convertible, header_crc32=entry.get("header_crc32"))
        except StorageError as exc:
            raise CheckpointError(f"checkpoint shard {key}: {exc}") from exc

    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(pool.map(one, manifest["shards"]))


class _Recorded:
    """A ShardSource that remembers the shard id it was stored under, so a resumed checkpointer
    knows which of the buffer's shards are already durable (and under which key)."""

    def __init__(self, source: snapshot.ShardSource, key: str, stored: dict[int, str]) -> None:
        self.source, self.key, self.stored = source, key, stored
        self.rows = source.rows

    def store(self, keeper) -> int:
        shard_id = self.source.store(keeper)
        self.stored[shard_id] = self.key
        return shard_id


def restore(cls, uri: str, *, endpoint_url: str | None, sampler, storage: TieredStorage | None,
            checkpoint: Checkpointer | bool, lazy: bool, progress: bool, manifest_key: str | None = None,
            tag: Any = None, retry_budget_s: float = 60.0, **kwargs: Any) -> "RolloutBuffer":
    if checkpoint is not True and checkpoint is not False and not isinstance(checkpoint, ShardListener):
        raise TypeError(f"checkpoint must be True, False or a Checkpointer, got {type(checkpoint).__name__}")
    store = open_reader(uri, endpoint_url, retry_budget_s)
    manifest = read_manifest(store, manifest_key, tag=tag)
    state = load_state(store, manifest)
    if lazy and (storage is None or not storage.tiered):
        raise ValueError("lazy=True needs storage=TieredStorage(spill_dir=...): shards land in the cold tier")
    try:
        recorded = snapshot.BufferSnapshot.from_state(state, extra_fields=kwargs.get("extra_fields"))
        config_overrides = {k: v for k, v in kwargs.items() if k in recorded.config.constructor_kwargs()}
        config = dataclasses.replace(recorded.config, **config_overrides)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {uri}: {exc}") from exc
    if sampler is None:
        sampler = sampler_from_state(state)
    by_id = {s["id"]: s for s in manifest["shards"]}
    if {info.id: info.live_rows for info in recorded.shards} != {sid: s["live_rows"] for sid, s in by_id.items()}:
        raise CheckpointError(f"checkpoint {uri}: the manifest's shards disagree with the slot table's live rows")
    # Row counts come from the shard headers themselves, so the state is checked against the data.
    # Eager: every shard file is downloaded now and read whole into the hot tier. Lazy: only each
    # shard's header and small blocks are read now (ranged reads); its file is downloaded into the
    # cold tier the first time a sample needs its tokens.
    # Each shard is checked against the schema before it is adopted: adopted rows skip add()'s
    # validation, so a shard missing a field, or holding tokens as floats, would restore and break
    # every sample after. No shard holds more rows than the buffer has slots.
    shard_fields = {k: v for k, v in config.fields().items() if k not in TABLE_FIELDS}
    durable: dict[int, str] = {}
    sources: dict[int, snapshot.ShardSource] = {}
    if lazy:
        metas = fetch_shard_metas(store, manifest, max_rows=config.capacity, fields=shard_fields)
        for sid, meta in metas.items():
            key = by_id[sid]["key"]

            def fetch(path: str, key: str = key) -> None:
                try:
                    store.get_to_file(key, path)
                except MissingObject as exc:  # gone for good: the storage evicts its rows
                    raise MissingShard(f"{key} is no longer in {store.uri}: {exc}") from exc

            sources[sid] = _Recorded(snapshot.RemoteShardSource(meta, fetch, meta.header.n), key, durable)
    else:
        # Headers first, by ranged reads: a hostile shard is refused before its bytes are downloaded.
        expected = {sid: meta.header
                    for sid, meta in fetch_shard_metas(store, manifest, config.capacity, shard_fields).items()}
        into = storage.spill_dir if storage is not None and storage.tiered else None
        download_dir, paths = _fetch_shards(store, manifest, progress, desc=f"restoring {uri}", into=into)
        try:
            for sid, path in paths.items():
                try:
                    if os.path.getsize(path) != expected[sid].file_bytes:
                        raise StorageError(f"changed during the restore: {os.path.getsize(path)} bytes, "
                                           f"its header says {expected[sid].file_bytes}")
                    rows = fmt.read_shard_meta(path, max_rows=config.capacity, fields=shard_fields,
                                               header_crc32=expected[sid].crc32).header.n
                except StorageError as exc:
                    raise CheckpointError(f"checkpoint shard {by_id[sid]['key']}: {exc}") from exc
                sources[sid] = _Recorded(snapshot.FileShardSource(path, rows), by_id[sid]["key"], durable)
        except BaseException:
            shutil.rmtree(download_dir, ignore_errors=True)
            raise
    try:
        buffer = cls.from_snapshot(recorded, sources, sampler=sampler, storage=storage, **kwargs)
    except (ValueError, TypeError, KeyError, StorageError) as exc:
        raise CheckpointError(f"checkpoint {uri} failed validation: {exc}") from exc
    finally:
        if not lazy:
            shutil.rmtree(download_dir, ignore_errors=True)  # adopted files were moved out (or read)
    if checkpoint is not False:
        ckpt = Checkpointer(uri, endpoint_url=endpoint_url, retry_budget_s=store.budget_s) if checkpoint is True \
            else checkpoint
        same_place = getattr(getattr(ckpt, "store", None), "uri", None) == store.uri
        buffer.attach_checkpointer(ckpt, durable=durable if same_place else {})
    return buffer


def import_rollouts(buffer: "RolloutBuffer", uri: str, *, endpoint_url: str | None, version_offset: int,
                    reprioritize: Callable[[dict[str, torch.Tensor]], torch.Tensor] | None,
                    progress: bool, select: Callable[[int, int], bool] | None = None,
                    keep_reuse: bool = False, tag: Any = None, retry_budget_s: float = 60.0) -> "Handles":
    """Add another run's live rollouts as new rollouts of this buffer (nothing is written there).

    `select(index, count)` picks which of the checkpoint's shards (by position in its manifest)
    to take, e.g. `lambda i, n: i % world == rank` to split a checkpoint over ranks. `keep_reuse`
    carries the rollouts' use counts over. Each read may keep failing for `retry_budget_s`."""

    check_retry_budget(retry_budget_s)
    check_int(version_offset, "version_offset")
    if not -(2**62) <= version_offset <= 2**62:
        # Versions lie in [0, 2**62): a larger shift would wrap in int64 (to a version that looks valid).
        raise ValueError(f"version_offset must lie in [-2**62, 2**62], got {version_offset}")
    store = open_reader(uri, endpoint_url, retry_budget_s)
    manifest = read_manifest(store, tag=tag)
    state = load_state(store, manifest)
    try:
        # The same checks as a restore's, before any of the table is used to index anything.
        table = snapshot.BufferSnapshot.from_state(state).ledger.table.columns
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {uri}: {exc}") from exc
    if select is not None:
        count = len(manifest["shards"])
        manifest = dict(manifest, shards=[s for i, s in enumerate(manifest["shards"]) if select(i, count)])
    keys = {s["id"]: s["key"] for s in manifest["shards"]}
    # Rows go through add(), which converts dtypes, so a convertible dtype is fine; the rest of the
    # schema is checked from the header before the file is read whole. No shard of the source holds
    # more rows than its slot table has slots.
    shard_fields = {k: v for k, v in buffer.settings.fields().items() if k not in TABLE_FIELDS}
    max_rows = int(table["shard"].numel())
    # Sizes and headers first (stat/HEAD and ranged reads): a hostile shard is refused before it
    # is downloaded.
    metas = fetch_shard_metas(store, manifest, max_rows, shard_fields, convertible=True)
    download_dir, paths = _fetch_shards(store, manifest, progress, desc=f"importing {uri}")
    handles = []
    try:
        for sid, path in sorted(paths.items()):
            try:
                fmt.read_shard_meta(path, max_rows=max_rows, fields=shard_fields, convertible=True,
                                    header_crc32=metas[sid].header.crc32)  # the object read at first
                with open(path, "rb") as f:
                    shard = fmt.parse_shard(f.read(), max_rows=max_rows)
            except StorageError as exc:
                raise CheckpointError(f"imported checkpoint shard {keys[sid]}: {exc}") from exc
            slots = ((table["shard"] == sid) & table["live"]).nonzero().flatten()
            if buffer.max_staleness is not None and slots.numel():
                # Rollouts already past this buffer's staleness cap would be evicted on arrival:
                # they are not imported (add() would refuse the whole shard for them).
                versions = (table["policy_version"][slots] + version_offset).clamp(min=0)
                slots = slots[versions >= max(buffer.version, int(versions.max())) - buffer.max_staleness]
            rows = table["row"][slots]
            if rows.numel() and int(rows.max()) >= shard.header.n:
                raise CheckpointError(f"imported shard {sid}: slot table names rows past its {shard.header.n}")
            starts, ends = shard.offsets[rows], shard.offsets[rows + 1]
            batch: dict[str, Any] = {
                name: [values[s:e] for s, e in zip(starts.tolist(), ends.tolist())]
                for name, values in shard.token.items()
            }
            batch.update({name: values[rows] for name, values in shard.rollout.items()})
            for name in TABLE_FIELDS:
                batch[name] = table[name][slots].clone()
            batch["policy_version"] = (batch["policy_version"] + version_offset).clamp(min=0)
            if reprioritize is not None:
                new_adv = reprioritize(batch)
                if not isinstance(new_adv, torch.Tensor) or new_adv.shape != batch["advantage"].shape:
                    raise ValueError("reprioritize must return one advantage per imported rollout")
                batch["advantage"] = new_adv.to(torch.float32)
            if slots.numel():
                added = buffer.add(batch)
                if keep_reuse:
                    buffer.carry_reuse(added, table["reuse"][slots])
                handles.append(added)
    finally:
        shutil.rmtree(download_dir, ignore_errors=True)
    if not handles:
        return Handles(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))
    return Handles(torch.cat([h.slot for h in handles]), torch.cat([h.generation for h in handles]))


def live_rows_from_version(store: ObjectStore, manifest: dict[str, Any], oldest_version: int) -> list[int]:
    """Per shard of `manifest` (in its order), its live rollouts of policy version >= `oldest_version`:
    what `import_rollouts` takes of it into a buffer whose staleness cap cuts below that version.
    The state is validated as an import validates it before its table is used."""
    state = load_state(store, manifest)
    try:
        table = snapshot.BufferSnapshot.from_state(state).ledger.table.columns
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {store.uri}: {exc}") from exc
    keep = table["live"] & (table["policy_version"] >= oldest_version)
    ids, counts = torch.unique(table["shard"][keep], return_counts=True)
    fresh = dict(zip(ids.tolist(), counts.tolist()))
    return [fresh.get(s["id"], 0) for s in manifest["shards"]]
