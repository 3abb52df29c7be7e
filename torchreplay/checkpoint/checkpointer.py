"""Background checkpoints: sealed shards are uploaded as they seal, manifests are published every
`interval_s`, on `buffer.checkpoint()` and on `close()`.

Layout under the run prefix::

    shards/<session>-<shard id>.trs     shard files (format.py), immutable
    state/<sequence>.json + .bin        buffer metadata (slot table, sampler, RNG, counters)
    manifests/<sequence>.json           names the state objects and every shard they need
    LATEST                              {"manifest": "manifests/<sequence>.json"}, written last

A manifest is written only after every object it names is durable, manifests are immutable, and
LATEST is replaced last; a reader follows LATEST and so never sees a partial checkpoint. Shards no
retained manifest names are garbage-collected after each publish.

Threads and processes: the trainer thread only snapshots metadata (clones of the slot table) and
enqueues work. One worker thread runs the queue in order (so a manifest always follows the uploads
of the shards it names) and records its first failure, which the trainer sees as CheckpointError on
its next call. The object-store requests themselves run in a helper process (uploader.py): boto3
is Python through and through, and on the worker thread it held the GIL long enough to multiply the
trainer's p99 latency. The worker thread only packs state and waits on a pipe.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torchreplay import boundedjson, snapshot
from torchreplay.checkpoint import tensorfile
from torchreplay.checkpoint.store import ObjectStore, open_store
from torchreplay.checkpoint.uploader import RemoteStore
from torchreplay.errors import CheckpointError
from torchreplay.storage import format as fmt

if TYPE_CHECKING:
    from torchreplay.buffer import RolloutBuffer

log = logging.getLogger("torchreplay.checkpoint")
MANIFEST_VERSION = 1
_COALESCE_S = 0.05  # how long the worker gathers jobs before acting on them


@dataclass
class _Upload:
    shard_id: int
    key: str
    source: Any  # a file path (spilled shard) or a PackedBatch (hot-only storage)
    spill: Any  # the spill's Future, or None
    shard: Any  # pinned storage shard, unpinned after the upload


@dataclass
class _Publish:
    sequence: int
    state: dict[str, Any]
    shard_keys: dict[int, str]
    shard_rows: dict[int, int]
    done: threading.Event


class Checkpointer:
    """Checkpoints a RolloutBuffer to `uri` (s3://bucket/prefix or file:///path).

    Args:
        uri: where checkpoints go.
        interval_s: seconds between automatic manifests (checked on buffer calls).
        keep_last: manifests retained; older ones and shards only they named are deleted.
        endpoint_url: S3 endpoint (else AWS_ENDPOINT_URL / the AWS configuration).
        retry_budget_s: how long one object may keep failing before the error surfaces.
        helper_cpus: CPUs the upload helper process and the checkpoint worker thread may run on
            (default: anywhere, the helper at nice 10), for hosts whose cores are partitioned
            between trainer, data loaders and I/O. Keep the trainer off them: sharing its CPU and
            caches with the uploads is what raises its p99 latency (docs/benchmarks.md).
        multipart_bytes: S3 objects of this size or more are uploaded in parts of this size.
    """

    def __init__(self, uri: str, interval_s: float = 60.0, keep_last: int = 2, endpoint_url: str | None = None,
                 retry_budget_s: float = 60.0, helper_cpus: list[int] | None = None,
                 multipart_bytes: int = 64 << 20) -> None:
        if not (isinstance(interval_s, (int, float)) and interval_s > 0):
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"keep_last must be an int >= 1, got {keep_last!r}")
        if isinstance(multipart_bytes, bool) or not isinstance(multipart_bytes, int) or multipart_bytes < 5 << 20:
            raise ValueError(f"multipart_bytes must be an int >= 5 MiB (S3's smallest part), got {multipart_bytes!r}")
        if helper_cpus is not None:
            if isinstance(helper_cpus, (str, bytes)) or not all(
                    isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in helper_cpus) or not helper_cpus:
                raise ValueError(f"helper_cpus must be a non-empty list of CPU numbers, got {helper_cpus!r}")
            # Not this process's own affinity: the trainer may have pinned itself elsewhere on purpose.
            if max(helper_cpus) >= (os.cpu_count() or 1):
                raise ValueError(f"helper_cpus {sorted(helper_cpus)}: this machine has CPUs 0-{(os.cpu_count() or 1) - 1}")
        self.uri = uri
        self.store: ObjectStore = open_store(uri, endpoint_url, multipart_bytes)  # reads from this process
        self._helper_cpus = set(helper_cpus or [])
        self._remote = RemoteStore(uri, endpoint_url, retry_budget_s, cpus=sorted(self._helper_cpus),
                                   multipart_bytes=multipart_bytes)  # writes, from the helper
        self.interval_s = float(interval_s)
        self.keep_last = keep_last
        self.retry_budget_s = retry_budget_s
        self.session = uuid.uuid4().hex[:12]
        self.buffer: RolloutBuffer | None = None
        self._keys: dict[int, str] = {}  # live shard id -> object key (trainer writes, worker reads)
        self._keys_lock = threading.Lock()
        self._durable: set[str] = set()
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._last_publish = time.monotonic()
        self._sequence = self._next_sequence()
        self._worker = threading.Thread(target=self._run, name="torchreplay-checkpoint", daemon=True)
        self._worker.start()
        self.published: list[str] = []
        self.last_manifest: str | None = None

    def _next_sequence(self) -> int:
        try:
            existing = self.store.list("manifests")
        except CheckpointError:
            return 0
        seqs = [int(k.split("/")[1].split(".")[0]) for k in existing if k.split("/")[1].split(".")[0].isdigit()]
        return max(seqs, default=-1) + 1

    # ------------------------------------------------------------------------ trainer thread
    def attach(self, buffer: "RolloutBuffer", known: dict[int, str] | None = None) -> None:
        """Bind to a buffer. `known` maps shard ids that are already durable here to their keys."""
        self.buffer = buffer
        with self._keys_lock:
            for sid, key in (known or {}).items():
                self._keys[sid] = key
                self._durable.add(key)

    def check(self) -> None:
        if self._error is not None:
            err = self._error
            raise CheckpointError(f"background checkpoint failed: {err}") from err

    def shard_sealed(self, shard_id: int) -> None:
        storage = self.buffer.storage
        shard = storage.shard(shard_id)
        key = f"shards/{self.session}-{shard_id:010d}.trs"
        with self._keys_lock:
            self._keys[shard_id] = key
        storage.pin_shards([shard_id])  # its file must outlive the upload even if its rollouts die
        source = shard.path if shard.path is not None else shard.batch()
        self._queue.put(_Upload(shard_id, key, source, shard.write, shard))

    def shard_released(self, shard_id: int) -> None:
        with self._keys_lock:
            self._keys.pop(shard_id, None)

    def maybe_publish(self) -> None:
        if time.monotonic() - self._last_publish >= self.interval_s:
            self.publish(wait=False)

    def publish(self, wait: bool = True, timeout: float | None = None) -> None:
        """Snapshot the buffer's metadata and publish a manifest; with `wait`, return when durable."""
        self.check()
        buffer = self.buffer
        state = snapshot.metadata_state(buffer)
        live_ids, live_rows = snapshot.live_shards(buffer.slots)
        with self._keys_lock:
            keys = {sid: self._keys[sid] for sid in live_ids}
        job = _Publish(self._sequence, state, keys,
                       dict(zip(live_ids, live_rows)), threading.Event())
        self._sequence += 1
        self._last_publish = time.monotonic()
        self.last_manifest = f"manifests/{job.sequence:012d}.json"
        self._queue.put(job)
        if wait:
            if not job.done.wait(timeout):
                raise CheckpointError(f"checkpoint {job.sequence} not durable within {timeout}s")
            self.check()

    def close(self, final: bool = True) -> None:
        if final and self.buffer is not None and self._error is None:
            self.publish(wait=True)
        self._queue.put(None)
        self._worker.join()
        self.check()

    # ------------------------------------------------------------------------- worker thread
    def _run(self) -> None:
        if self._helper_cpus:
            # This thread only packs state and waits on the helper: it belongs with the helper,
            # away from the trainer's CPU and caches (sched_setaffinity(0) is this thread only).
            try:
                os.sched_setaffinity(0, self._helper_cpus)
            except OSError:
                pass  # a placement hint; checkpoints work anywhere
        try:
            self._remote.start()  # from this thread: the helper lives exactly as long as it does
        except OSError as exc:
            self._error = CheckpointError(f"cannot start the checkpoint upload helper: {exc}")
        try:
            self._drain()
        finally:
            self._remote.close()

    def _drain(self) -> None:
        while True:
            jobs = [self._queue.get()]
            # Gather what arrives within a short window and send consecutive file uploads to the
            # helper in one request: each wake-up of this thread takes the GIL from the trainer,
            # so a handful per window beats several per shard (one shard seals per add).
            time.sleep(_COALESCE_S)
            while True:
                try:
                    jobs.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            files: list[_Upload] = []
            for job in jobs:
                if isinstance(job, _Upload) and self._ready_file(job):
                    files.append(job)
                    continue
                self._run_uploads(files)
                files = []
                if job is None:
                    return
                self._guarded(job, self._upload if isinstance(job, _Upload) else self._publish)
            self._run_uploads(files)

    def _guarded(self, job: Any, work: Any) -> None:
        try:
            if self._error is None:
                work(job)
        except BaseException as exc:  # noqa: BLE001 - surfaced on the trainer's next call
            log.error("torchreplay checkpoint failed: %s", exc)
            self._error = exc
        finally:
            if isinstance(job, _Upload):
                self.buffer.storage.unpin_shards([job.shard])
            elif isinstance(job, _Publish):
                job.done.set()

    def _ready_file(self, job: _Upload) -> bool:
        """Wait for the shard's spill; True when its file is complete and can go up as a file."""
        if job.spill is not None:
            try:
                job.spill.result()
            except Exception:  # noqa: BLE001 - the storage reports it; a failed spill keeps its hot copy
                job.source = job.shard.batch()
        return isinstance(job.source, str)

    def _run_uploads(self, jobs: list[_Upload]) -> None:
        if not jobs:
            return
        try:
            if self._error is None:
                for job in jobs:
                    self.buffer.storage.ensure_local(job.shard)  # a lazily restored shard moving elsewhere
                self._remote.put_files([(job.key, job.source) for job in jobs])
                self._durable.update(job.key for job in jobs)
        except BaseException as exc:  # noqa: BLE001 - surfaced on the trainer's next call
            log.error("torchreplay checkpoint failed: %s", exc)
            self._error = exc
        finally:
            self.buffer.storage.unpin_shards([job.shard for job in jobs])

    def _upload(self, job: _Upload) -> None:
        """A shard with no complete file (hot-only storage, or a failed spill): packed here."""
        header, writes, head = fmt.plan_shard(job.source.offsets, job.source.token, job.source.rollout)
        data = bytearray(header.file_bytes)
        data[: len(head)] = head
        for offset, piece in writes:
            data[offset : offset + len(piece)] = piece
        self._remote.put(job.key, data)
        self._durable.add(job.key)

    def _publish(self, job: _Publish) -> None:
        missing = [k for k in job.shard_keys.values() if k not in self._durable]
        if missing:
            raise CheckpointError(f"manifest {job.sequence} names shards that are not durable: {missing[:3]}")
        text, blob = tensorfile.pack(job.state)
        name = f"{job.sequence:012d}"
        state_key, blob_key = f"state/{name}.json", f"state/{name}.bin"
        self._remote.put(blob_key, blob)
        self._remote.put(state_key, text)
        manifest = {
            "format_version": MANIFEST_VERSION,
            "sequence": job.sequence,
            "created_unix_s": time.time(),
            "session": self.session,
            "state": {"json": state_key, "blob": blob_key, "json_bytes": len(text), "blob_bytes": len(blob)},
            "shards": [{"id": sid, "key": key, "live_rows": job.shard_rows[sid]} for sid, key in
                       sorted(job.shard_keys.items())],
            "rollouts": int(job.state["count"]),
            "policy_version": int(job.state["version"]),
        }
        manifest_key = f"manifests/{name}.json"
        payload = json.dumps(manifest, separators=(",", ":")).encode()
        self._remote.put(manifest_key, payload)
        pointer = json.dumps({"manifest": manifest_key}).encode()
        self._remote.put("LATEST", pointer)
        self.published.append(manifest_key)
        self._collect_garbage()

    def _collect_garbage(self) -> None:
        manifests = self._remote.list("manifests")
        keep, drop = manifests[-self.keep_last :], manifests[: -self.keep_last]
        needed: set[str] = set()
        kept_states: set[str] = set()
        for key in keep:
            m = json.loads(self._remote.get(key))
            needed.update(s["key"] for s in m["shards"])
            kept_states.update((m["state"]["json"], m["state"]["blob"]))
        # Shards sealed after the newest manifest are not named yet but will be: keep this session's
        # durable shards that are still live.
        with self._keys_lock:
            needed.update(self._keys.values())
        stale_shards = [k for k in self._remote.list("shards") if k not in needed]
        stale_states = [k for k in self._remote.list("state") if k not in kept_states]
        self._remote.delete(drop + stale_states + stale_shards)
        self._durable.difference_update(stale_shards)


def read_manifest(store: ObjectStore, key: str | None = None) -> dict[str, Any]:
    """The manifest `key`, or the newest one (following LATEST); validated before anything is
    allocated or opened."""
    from torchreplay.checkpoint.store import check_key

    if key is None:
        boundedjson.check_size(store.size("LATEST"), boundedjson.MAX_POINTER_BYTES, f"{store.uri}/LATEST",
                               CheckpointError)
        pointer = boundedjson.loads(store.get("LATEST"), f"{store.uri}/LATEST", CheckpointError)
        if not isinstance(pointer, dict) or not isinstance(pointer.get("manifest"), str):
            raise CheckpointError(f"{store.uri}/LATEST does not name a manifest")
        key = pointer["manifest"]
    key = check_key(key)
    if not key.startswith("manifests/"):
        raise CheckpointError(f"{key!r} is not a manifest key (outside manifests/)")
    boundedjson.check_size(store.size(key), boundedjson.MAX_DOCUMENT_BYTES, f"manifest {key}", CheckpointError)
    manifest = boundedjson.loads(store.get(key), f"manifest {key}", CheckpointError)
    validate_manifest(manifest)
    return manifest


def validate_manifest(m: Any) -> None:
    from torchreplay.checkpoint.store import check_key

    if not isinstance(m, dict):
        raise CheckpointError("manifest must be a JSON object")
    if m.get("format_version") != MANIFEST_VERSION:
        raise CheckpointError(f"unsupported manifest format_version {m.get('format_version')!r}")
    for field in ("sequence", "rollouts", "policy_version"):
        if isinstance(m.get(field), bool) or not isinstance(m.get(field), int) or m[field] < 0:
            raise CheckpointError(f"manifest field {field!r} must be a non-negative int, got {m.get(field)!r}")
    state = m.get("state")
    if not isinstance(state, dict):
        raise CheckpointError("manifest 'state' must be an object")
    for field in ("json", "blob"):
        key = state.get(field)
        if not isinstance(key, str) or not check_key(key).startswith("state/"):
            raise CheckpointError(f"manifest state.{field} {key!r} must be a key under state/")
    for field in ("json_bytes", "blob_bytes"):
        if isinstance(state.get(field), bool) or not isinstance(state.get(field), int) or not 0 <= state[field] < 1 << 40:
            raise CheckpointError(f"manifest state.{field} must be a size in bytes, got {state.get(field)!r}")
    shards = m.get("shards")
    if not isinstance(shards, list):
        raise CheckpointError("manifest 'shards' must be a list")
    seen: set[int] = set()
    total_live = 0
    for s in shards:
        if not isinstance(s, dict):
            raise CheckpointError("manifest shard entries must be objects")
        sid, key, live = s.get("id"), s.get("key"), s.get("live_rows")
        if isinstance(sid, bool) or not isinstance(sid, int) or sid < 0 or sid in seen:
            raise CheckpointError(f"manifest shard id {sid!r} is invalid or repeated")
        seen.add(sid)
        if not isinstance(key, str) or not check_key(key).startswith("shards/") or not key.endswith(".trs"):
            raise CheckpointError(f"manifest shard key {key!r} must be shards/<name>.trs inside the prefix")
        if isinstance(live, bool) or not isinstance(live, int) or live < 1:
            raise CheckpointError(f"manifest shard {sid}: live_rows must be >= 1, got {live!r}")
        total_live += live
    if total_live != m["rollouts"]:
        raise CheckpointError(f"manifest: shards hold {total_live} live rollouts, manifest says {m['rollouts']}")

