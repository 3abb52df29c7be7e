"""Background checkpoints: sealed shards are uploaded as they seal, manifests are published every
`interval_s`, on `buffer.checkpoint()` and on `close()`.

The layout under the run prefix, keys, tags and manifests are manifest.py's. A manifest is
written only after every object it names is durable, manifests are immutable, and LATEST (and a
tag) is replaced last; a reader follows LATEST or a tag and so never sees a partial checkpoint.
After each publish, what the retention policy no longer keeps is deleted (retention.py plans it).

Failures: a background upload or publish that fails (after its retry budget, or at once for an
error a retry cannot fix) never stops training. It is counted (`metrics()`), logged once per
incident, and the next publish tries again, re-uploading the shards that did not make it; the
first publish that succeeds closes the incident. With `on_error="raise"` the trainer's next buffer
call raises CheckpointError once per incident. A synchronous `checkpoint()` always raises when its
own publish fails.

Threads and processes: the trainer thread only snapshots metadata (clones of the slot table) and
enqueues work. One worker thread runs the queue in order (so a manifest always follows the uploads
of the shards it names). What may wait in it is bounded (`max_pending_bytes`, backlog.py). The object-store requests themselves run in a helper process
(uploader.py): boto3 is Python through and through, and on the worker thread it held the GIL long
enough to multiply the trainer's p99 latency. The worker thread only packs state and waits on a
pipe.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torchreplay import boundedjson, snapshot
from torchreplay.checkpoint import manifest as mf
from torchreplay.checkpoint import retention, tensorfile
from torchreplay.checkpoint.backlog import DEFAULT_MAX_PENDING_BYTES, UploadBacklog, check_limit
from torchreplay.checkpoint.store import ObjectStore, PermanentError, check_retry_budget, open_store
from torchreplay.checkpoint.uploader import RemoteStore
from torchreplay.checks import check_int, is_int
from torchreplay.errors import CheckpointError
from torchreplay.storage import format as fmt

if TYPE_CHECKING:
    from torchreplay.buffer import RolloutBuffer

log = logging.getLogger("torchreplay.checkpoint")
_COALESCE_S = 0.05  # how long the worker gathers jobs before acting on them


class _SkipCollection(Exception):
    """Garbage collection cannot tell safely what to keep this time (a tag or manifest could not
    be read): it deletes nothing and tries again after the next publish."""


def _check_helper_cpus(helper_cpus: list[int] | None) -> None:
    if helper_cpus is None:
        return
    if isinstance(helper_cpus, (str, bytes)) or not all(
            is_int(c) and c >= 0 for c in helper_cpus) or not helper_cpus:
        raise ValueError(f"helper_cpus must be a non-empty list of CPU numbers, got {helper_cpus!r}")
    # Not this process's own affinity: the trainer may have pinned itself elsewhere on purpose.
    if max(helper_cpus) >= (os.cpu_count() or 1):
        raise ValueError(f"helper_cpus {sorted(helper_cpus)}: this machine has CPUs 0-{(os.cpu_count() or 1) - 1}")


@dataclass
class _Upload:
    shard_id: int  # pinned in storage, unpinned once the worker is done with this upload
    key: str
    size: int = 0  # bytes held against max_pending_bytes (0: held by a publish, see backlog.py)


@dataclass
class _Publish:
    sequence: int | None  # None until the worker knows the store's newest sequence
    state: dict[str, Any]
    shard_keys: dict[int, str]
    shard_rows: dict[int, int]
    tag: str | None
    taken_at: float  # time.monotonic() of the snapshot: how old the durable state is, once published
    background: bool
    uploads: list[_Upload] = field(default_factory=list)  # pinned: named shards not stored at the snapshot
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class Checkpointer:
    """Checkpoints a RolloutBuffer to `uri` (s3://bucket/prefix or file:///path).

    The store is checked on construction: a missing bucket, refused credentials or a directory
    that cannot be written raise CheckpointError at once (an unreachable endpoint only logs a
    warning: the background retries).

    Args:
        uri: where checkpoints go.
        interval_s: seconds between automatic manifests (checked on buffer calls).
        keep_last: untagged manifests retained; older ones and shards only they named are deleted.
        keep_tags: tagged manifests retained (`buf.checkpoint(tag=step)`), newest first; None
            (the default) keeps every tagged manifest until its tag is overwritten.
        endpoint_url: S3 endpoint (else AWS_ENDPOINT_URL / the AWS configuration).
        retry_budget_s: how long one object may keep failing before the attempt counts as failed.
        on_error: "warn" (default): a failed background checkpoint is logged once per incident,
            counted in `metrics()`, and retried by the next publish; training goes on. "raise":
            also raise CheckpointError from the next buffer call, once per incident.
        helper_cpus: CPUs the upload helper process and the checkpoint worker thread may run on
            (default: anywhere, the helper at nice 10), for hosts whose cores are partitioned
            between trainer, data loaders and I/O. Keep the trainer off them: sharing its CPU and
            caches with the uploads is what raises its p99 latency (docs/benchmarks.md).
        multipart_bytes: S3 objects of this size or more are uploaded in parts of this size.
        max_pending_bytes: shard bytes that may wait, pinned, for a background upload (default
            1 GiB; 0: none, every shard goes up with the next publish). A sealed shard beyond it
            waits unpinned for the next publish, which uploads it if still live: a slow store
            costs checkpoint staleness, not disk (backlog.py, docs/checkpoints.md).
    """

    def __init__(self, uri: str, interval_s: float = 60.0, keep_last: int = 2, endpoint_url: str | None = None,
                 retry_budget_s: float = 60.0, helper_cpus: list[int] | None = None,
                 multipart_bytes: int = 64 << 20, on_error: str = "warn", keep_tags: int | None = None,
                 max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES) -> None:
        if not (isinstance(interval_s, (int, float)) and interval_s > 0):
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        policy = retention.RetentionPolicy(keep_last, keep_tags)
        if on_error not in ("warn", "raise"):
            raise ValueError(f"on_error must be 'warn' or 'raise', got {on_error!r}")
        retry_budget_s = check_retry_budget(retry_budget_s)
        check_int(multipart_bytes, "multipart_bytes (S3's smallest part is 5 MiB)", low=5 << 20, error=ValueError)
        check_limit(max_pending_bytes)
        _check_helper_cpus(helper_cpus)
        self.uri = uri
        self.store: ObjectStore = open_store(uri, endpoint_url, multipart_bytes,  # reads from this process
                                             retry_budget_s=retry_budget_s)
        self._probe()
        self._helper_cpus = set(helper_cpus or [])
        self._remote = RemoteStore(uri, endpoint_url, retry_budget_s, cpus=sorted(self._helper_cpus),
                                   multipart_bytes=multipart_bytes)  # writes, from the helper
        self.interval_s = float(interval_s)
        self.retention = policy
        self.on_error = on_error
        self.retry_budget_s = retry_budget_s
        self.session = uuid.uuid4().hex[:12]
        self.buffer: RolloutBuffer | None = None
        self._keys: dict[int, str] = {}  # live shard id -> object key (trainer writes, worker reads)
        self._keys_lock = threading.Lock()
        self._durable: set[str] = set()
        # Per durable shard key, what identifies its object in manifests ({"bytes", "header_crc32"}):
        # the shards uploaded here, and those a resumed job carried over.
        self._shard_ids: dict[str, dict[str, int]] = {}
        self._backlog = UploadBacklog(max_pending_bytes)
        self._manifest_refs: dict[str, mf.ManifestRefs] = {}  # worker only: manifests are immutable
        self._tag_pointers: dict[str, dict[str, Any]] = {}  # worker only: tags/<tag>.json -> its pointer
        self._queue: queue.Queue = queue.Queue()
        # Incident bookkeeping: written by the worker, read by the trainer (plain values under the GIL).
        self.failures = 0
        self._incident: str | None = None
        self._incident_raised = False
        self._last_success_unix: float | None = None
        self._durable_taken_at = time.monotonic()  # before any publish: everything since attach is at risk
        self._background_publish: _Publish | None = None
        self._last_publish = time.monotonic()
        self._closed = False
        self._sequence_lock = threading.Lock()
        # None when the store could not be listed now: the worker lists it before the first publish,
        # so a session never reuses (and then garbage-collects) an earlier run's manifest numbers.
        self._sequence: int | None = self._next_sequence() if self._reachable else None
        self._worker = threading.Thread(target=self._run, name="torchreplay-checkpoint", daemon=True)
        self._worker.start()
        self.published: list[str] = []
        self.last_manifest: str | None = None

    def _probe(self) -> None:
        self._reachable = True
        try:
            self.store.probe()
        except PermanentError as exc:
            raise CheckpointError(f"cannot checkpoint to {self.uri}: {exc}") from exc
        except CheckpointError as exc:
            self._reachable = False
            log.warning("torchreplay checkpoint: %s is not reachable now (%s); background checkpoints will retry",
                        self.uri, exc)

    def _next_sequence(self) -> int | None:
        try:
            return mf.sequence_after_newest(self.store.list("manifests"))
        except CheckpointError:
            return None

    # ------------------------------------------------------------------------ trainer thread
    def attach(self, buffer: "RolloutBuffer", known: dict[int, str] | None = None) -> None:
        """Bind to a buffer. `known` maps shard ids that are already durable here to their keys."""
        self.buffer = buffer
        with self._keys_lock:
            for sid, key in (known or {}).items():
                self._keys[sid] = key
                self._durable.add(key)
                self._shard_ids[key] = mf.shard_identity(buffer.storage.shard(sid).header)

    def check(self) -> None:
        """With on_error="raise", raise CheckpointError once for an open incident."""
        incident = self._incident
        if self.on_error == "raise" and incident is not None and not self._incident_raised:
            self._incident_raised = True
            raise CheckpointError(f"background checkpoint failed ({self.failures} failures so far; the buffer "
                                  f"keeps working and the next publish retries): {incident}")

    def metrics(self) -> dict[str, float]:
        """checkpoint_failures: failed background uploads and publishes so far;
        checkpoint_last_success_s: Unix time of the last durable manifest (nan before the first);
        checkpoint_lag_s: age of the newest durable state (what a crash now would lose)."""
        last = self._last_success_unix
        return {"checkpoint_failures": float(self.failures),
                "checkpoint_last_success_s": math.nan if last is None else last,
                "checkpoint_lag_s": time.monotonic() - self._durable_taken_at, **self._backlog.metrics()}

    # Read-only views of where the background work runs (placement and lifetime checks).
    @property
    def helper_pid(self) -> int | None:
        """The upload helper process's pid while it runs (None before it started and after close)."""
        return self._remote.helper_pid

    @property
    def worker_native_id(self) -> int | None:
        """The worker thread's native (kernel) thread id, e.g. for `os.sched_getaffinity`."""
        return self._worker.native_id

    def shard_sealed(self, shard_id: int) -> None:
        if self._closed:
            return  # nothing uploads any more: pinning the shard would keep it forever
        storage = self.buffer.storage
        key = mf.shard_key(self.session, shard_id)
        with self._keys_lock:
            self._keys[shard_id] = key
        size = storage.shard(shard_id).file_bytes
        if not self._backlog.admit(size):
            return  # no room: it waits, unpinned, for the next publish that names it
        storage.pin_shards([shard_id])  # its file must outlive the upload even if its rollouts die
        self._queue.put(_Upload(shard_id, key, size))

    def shard_released(self, shard_id: int) -> None:
        with self._keys_lock:
            self._keys.pop(shard_id, None)

    def maybe_publish(self) -> None:
        """Publish in the background when one is due and none is still on its way."""
        outstanding = self._background_publish
        if outstanding is not None and not outstanding.done.is_set():
            return  # during an outage, piling up publishes would only lengthen the queue
        if time.monotonic() - self._last_publish >= self.interval_s:
            self._background_publish = self._enqueue_publish(tag=None, background=True)

    def publish(self, wait: bool = True, timeout: float | None = None, tag: Any = None) -> None:
        """Snapshot the buffer's metadata and publish a manifest (under `tag`, if given); with
        `wait`, return when it is durable, or raise CheckpointError if this publish failed."""
        tag = None if tag is None else mf.check_tag(tag)
        if self._closed:
            raise CheckpointError(f"the checkpointer for {self.uri} is closed")
        job = self._enqueue_publish(tag, background=not wait)
        if wait:
            if not job.done.wait(timeout):
                raise CheckpointError(f"checkpoint {job.sequence} not durable within {timeout}s")
            if job.error is not None:
                raise CheckpointError(f"checkpoint {job.sequence}{f' (tag {tag})' if tag else ''} failed: "
                                      f"{job.error}") from job.error

    def _enqueue_publish(self, tag: str | None, background: bool) -> _Publish:
        buffer = self.buffer
        state = snapshot.metadata_state(buffer)
        live_ids, live_rows = snapshot.live_shards(buffer.slots)
        with self._keys_lock:
            keys = {sid: self._keys[sid] for sid in live_ids}
        # The named shards not stored yet (deferred, or queued but skipped if they die first) are
        # pinned for this publish, which uploads them.
        owed = [sid for sid, key in keys.items() if key not in self._durable]
        buffer.storage.pin_shards(owed)
        uploads = [_Upload(sid, keys[sid]) for sid in owed]
        with self._sequence_lock:
            sequence = self._sequence
            if sequence is not None:
                self._sequence += 1
        job = _Publish(sequence, state, keys, dict(zip(live_ids, live_rows)), tag, time.monotonic(), background,
                       uploads)
        self._last_publish = time.monotonic()
        self.last_manifest = None if sequence is None else mf.manifest_key(sequence)
        self._queue.put(job)
        return job

    def close(self, final: bool = True) -> None:
        """Stop the worker; with `final`, publish once more first and raise if that fails. Calling
        it again does nothing."""
        if self._closed:
            return
        final_error: BaseException | None = None
        try:
            if final and self.buffer is not None:
                try:
                    self.publish(wait=True)
                except CheckpointError as exc:
                    final_error = exc
        finally:
            self._closed = True
            self._queue.put(None)
            self._worker.join()
        if final_error is not None:
            raise final_error

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
            self._failed(f"cannot start the checkpoint upload helper: {exc}")
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
            uploads: list[_Upload] = []
            last_publish = max((i for i, job in enumerate(jobs) if isinstance(job, _Publish)), default=-1)
            for i, job in enumerate(jobs):
                if isinstance(job, _Upload):
                    uploads.append(job)
                    continue
                self._upload_all(uploads)
                uploads = []
                if job is None:
                    return
                if job.background and job.tag is None and i < last_publish:
                    self._supersede(job)  # a newer publish is queued behind it
                    continue
                self._run_publish(job)
            self._upload_all(uploads)

    def _failed(self, reason: str) -> None:
        self.failures += 1
        if self._incident is None:
            log.error("torchreplay checkpoint failed (training continues; the next publish retries): %s", reason)
            self._incident_raised = False
            self._incident = reason
        else:
            log.debug("torchreplay checkpoint still failing: %s", reason)

    def _unpin(self, shard_ids: list[int]) -> None:
        if shard_ids:
            self.buffer.storage.unpin_shards(shard_ids)

    def _upload_all(self, jobs: list[_Upload]) -> None:
        """Upload the queued shards still live (the dead ones are skipped). During an incident, or
        when this fails, they are left to the next publish, which uploads those it names, instead
        of each spending the retry budget against a store that is down."""
        if not jobs:
            return
        with self._keys_lock:
            live = [job for job in jobs if self._keys.get(job.shard_id) == job.key]
        self._backlog.count("skipped_uploads", len(jobs) - len(live))
        try:
            if self._incident is not None:
                self._backlog.count("deferred_shards", len(live))
            elif live:
                self._put_shards(live)
        except Exception as exc:  # noqa: BLE001 - counted and retried, never fatal to training
            self._failed(str(exc))
        finally:
            self._unpin([job.shard_id for job in jobs])
            self._backlog.settle(sum(job.size for job in jobs))

    def _put_shards(self, jobs: list[_Upload]) -> None:
        files = []
        for job in jobs:
            # Waits for the shard's spill (and downloads a lazily restored file moving elsewhere):
            # its complete file, or without one its hot copy.
            export = self.buffer.storage.export_shard(job.shard_id)
            if export.path is not None:
                files.append((job.key, export))
            else:
                self._put_packed(job.key, export.batch)
        if files:
            self._remote.put_files([(key, export.path) for key, export in files])
            self._durable.update(key for key, _ in files)
            self._shard_ids.update((key, mf.shard_identity(export.header)) for key, export in files)

    def _put_packed(self, key: str, batch: Any) -> None:
        """A shard with no complete file (hot-only storage, or a failed spill): packed here."""
        header, writes, head = fmt.plan_shard(batch.offsets, batch.token, batch.rollout)
        data = bytearray(header.file_bytes)
        data[: len(head)] = head
        for offset, piece in writes:
            data[offset : offset + len(piece)] = piece
        self._remote.put(key, data)
        self._durable.add(key)
        self._shard_ids[key] = mf.shard_identity(header)

    def _run_publish(self, job: _Publish) -> None:
        try:
            self._publish(job)
        except Exception as exc:  # noqa: BLE001 - counted; a synchronous caller also gets it raised
            job.error = exc
            if job.background:
                self._failed(str(exc))
            else:
                self.failures += 1  # raised to its caller, and logged in case the caller timed out waiting
                log.warning("torchreplay checkpoint %s failed: %s", job.sequence, exc)
        else:
            if job.taken_at >= self._durable_taken_at or self._last_success_unix is None:
                self._durable_taken_at = job.taken_at
            self._last_success_unix = time.time()
            if self._incident is not None:
                log.warning("torchreplay checkpoint recovered: %s is durable after %d failures",
                            self.published[-1], self.failures)
                self._incident = None
        finally:
            self._unpin([up.shard_id for up in job.uploads])
            job.uploads = []
            job.done.set()

    def _supersede(self, job: _Publish) -> None:
        """Drop a background publish: a newer one queued behind it writes a newer state."""
        self._unpin([up.shard_id for up in job.uploads])
        job.uploads = []
        self._backlog.count("superseded_publishes")
        job.done.set()

    def _publish(self, job: _Publish) -> None:
        # The shards this manifest needs that were not stored at its snapshot (deferred ones, and
        # queued ones skipped or failed since) go up now.
        owed = [up for up in job.uploads if up.key not in self._durable]
        if owed:
            self._put_shards(owed)
        named = set(job.shard_keys.values())
        missing = [k for k in named if k not in self._durable]
        if missing:
            raise CheckpointError(f"manifest {job.sequence} names shards that are not durable: {missing[:3]}")
        self._assign_sequence(job)
        text, blob = tensorfile.pack(job.state)
        state_key, blob_key = mf.state_keys(job.sequence)
        self._remote.put(blob_key, blob)
        self._remote.put(state_key, text)
        shards = [{"id": sid, "key": key, "live_rows": job.shard_rows[sid], **self._shard_ids.get(key, {})}
                  for sid, key in sorted(job.shard_keys.items())]
        manifest = mf.build_manifest(job.sequence, self.session, (len(text), len(blob)), shards,
                                     rollouts=int(job.state["count"]), policy_version=int(job.state["version"]),
                                     tag=job.tag)
        manifest_key = mf.manifest_key(job.sequence)
        self._remote.put(manifest_key, json.dumps(manifest, separators=(",", ":")).encode())
        self._manifest_refs[manifest_key] = mf.manifest_refs(manifest)
        if job.tag is not None:
            pointer = mf.tag_pointer(manifest)
            self._remote.put(mf.tag_key(job.tag), json.dumps(pointer).encode())
            self._tag_pointers[mf.tag_key(job.tag)] = pointer
        self._remote.put(mf.LATEST, json.dumps({"manifest": manifest_key}).encode())
        self.published.append(manifest_key)
        self.last_manifest = manifest_key
        # The publish is durable now: a failed clean-up is only logged (the next publish retries it).
        try:
            self._collect_garbage()
        except (_SkipCollection, CheckpointError) as exc:
            log.warning("torchreplay checkpoint: garbage collection skipped this time: %s", exc)

    def _assign_sequence(self, job: _Publish) -> None:
        """A sequence after every manifest in the store, if the trainer thread could not know it."""
        if job.sequence is not None:
            return
        newest = mf.sequence_after_newest(self._remote.list("manifests"))
        with self._sequence_lock:
            job.sequence = max(newest, self._sequence or 0)
            self._sequence = job.sequence + 1

    def _refs(self, manifest_key: str) -> mf.ManifestRefs:
        """The shard and state keys a retained manifest needs (cached: manifests are immutable)."""
        if manifest_key not in self._manifest_refs:
            try:
                m = boundedjson.loads(self._remote.get(manifest_key), f"manifest {manifest_key}", CheckpointError)
                mf.validate_manifest(m)
            except CheckpointError as exc:
                raise _SkipCollection(f"cannot read retained {manifest_key}: {exc}") from exc
            self._manifest_refs[manifest_key] = mf.manifest_refs(m)
        return self._manifest_refs[manifest_key]

    def _collect_garbage(self) -> None:
        manifests = self._remote.list("manifests")
        tags = _read_tag_pointers(self._remote, self._tag_pointers)
        refs = {key: self._refs(key) for key in retention.retained_manifests(manifests, tags, self.retention)}
        # Shards sealed after the newest manifest are not named yet but will be: this session's
        # durable shards that are still live stay.
        with self._keys_lock:
            live = set(self._keys.values())
        listing = retention.Listing(manifests, self._remote.list("shards"), self._remote.list("state"))
        plan = retention.plan(listing, tags, refs, live, self.retention)
        self._remote.delete(plan.tags)  # first: a tag never names a manifest that is gone
        for key in plan.tags:
            del self._tag_pointers[key]
        self._remote.delete(plan.manifests + plan.states + plan.shards)
        for key in plan.manifests:
            self._manifest_refs.pop(key, None)
        self._durable.difference_update(plan.shards)
        for key in plan.shards:
            self._shard_ids.pop(key, None)


def _read_tag_pointers(remote: RemoteStore, known: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every tag object's pointer ({} for one that is not a pointer); `known` caches them (a
    tag's object is replaced only by this writer, which updates the cache)."""
    for key in remote.list("tags"):
        if key not in known:
            try:
                data = remote.get(key)
            except CheckpointError as exc:
                # Which manifest it names is unknown: deleting anything now might delete that one.
                raise _SkipCollection(f"cannot read {key}: {exc}") from exc
            pointer = mf.parse_tag_pointer(data)
            if pointer is None:
                log.warning("torchreplay checkpoint: %s is not a tag pointer; it keeps nothing alive", key)
            known[key] = pointer or {}
    return dict(known)
