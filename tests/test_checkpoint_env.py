"""What docs/api.md ("Checkpoints") promises about the checkpoint's environment: the
`AWS_ENDPOINT_URL` fallback (trainer side and upload helper), and the upload helper's niceness
("nice 10") and CPU placement (`helper_cpus=[...]` restricts the helper and the checkpoint worker
thread, never the trainer).

The helper is found the way an operator would find it: a child of this process in /proc whose
command line runs `torchreplay.checkpoint.uploader.serve` for this test's URI.
"""

import os
import threading

import pytest
import torch

import torchreplay as tr
from rollouts import make_batch
from torchreplay.checkpoint import Checkpointer
from torchreplay.checkpoint.uploader import RemoteStore
from torchreplay.storage import TieredStorage

HELPER_NICE = 10  # docs/api.md: "a helper process (no torch, nice 10, ...)"


def helper_pids(uri: str) -> list[int]:
    """PIDs of this process's children that are upload helpers serving `uri` (zombies excluded)."""
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        state, ppid = fields[0], int(fields[1])
        if ppid != me or state == "Z":
            continue
        if any(b"torchreplay.checkpoint.uploader import serve" in a for a in argv) and uri.encode() in argv:
            found.append(int(entry))
    return found


def the_helper(uri: str) -> int:
    pids = helper_pids(uri)
    assert len(pids) == 1, f"expected one upload helper child for {uri}, found {pids}"
    return pids[0]


def expected_helper_nice() -> int:
    """The helper adds 10 to the niceness it inherits (os.nice), capped at Linux's 19."""
    parent = os.getpriority(os.PRIO_PROCESS, 0)
    if parent + HELPER_NICE > 19:
        pytest.skip(f"this test process already runs at nice {parent}: nice+10 would be capped at 19")
    return parent + HELPER_NICE


def helper_cpu() -> tuple[set[int], int]:
    """The trainer's CPUs and one of them for the helper; the trainer keeps the others."""
    trainer = os.sched_getaffinity(0)
    if len(trainer) < 2:
        pytest.skip(f"needs 2+ CPUs to tell the helper's placement from the trainer's; this process may use {trainer}")
    usable = [c for c in sorted(trainer) if c < (os.cpu_count() or 1)]  # Checkpointer checks against cpu_count
    return trainer, usable[-1]


def checkpoint_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("torchreplay-checkpoint") and t.is_alive()}


# ------------------------------------------------------------------------------ AWS_ENDPOINT_URL
@pytest.mark.s3
def test_aws_endpoint_url_is_the_fallback_for_uploads_and_restore(s3_server, s3_bucket, tmp_path, monkeypatch):
    """No `endpoint_url` anywhere: AWS_ENDPOINT_URL alone sends the helper's uploads and the
    restore's downloads to the loopback server.

    Mutation check: uploader.RemoteStore.start launching the helper with
    `env={k: v for k, v in os.environ.items() if k != "AWS_ENDPOINT_URL"}` (the helper no longer
    inherits it) fails here: the helper's requests go to the default AWS endpoint, which is
    unreachable, and `buf.checkpoint()` raises CheckpointError ("upload ... gave up after N
    attempts"). Dropping only store.open_store's `or os.environ.get("AWS_ENDPOINT_URL")` survives:
    boto3 >= 1.28 reads AWS_ENDPOINT_URL itself, so with the installed boto3 that fallback is
    redundant (an equivalent mutant); it matters only with an older boto3.
    """
    import boto3

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint_url)
    for shadowing in ("AWS_ENDPOINT_URL_S3", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS"):
        monkeypatch.delenv(shadowing, raising=False)
    uri = f"s3://{s3_bucket}/envrun"
    # A short budget: a helper that lost the endpoint fails in seconds, not a minute.
    ckpt = Checkpointer(uri, interval_s=3600, retry_budget_s=3.0)
    buf = tr.RolloutBuffer(32, sampler=tr.UniformSampler(), seed=0, checkpoint=ckpt,
                           storage=TieredStorage(hot_bytes=1 << 20, spill_dir=tmp_path / "spill", io="posix"))
    s3_server.faults.seen.clear()
    buf.add(make_batch(12, seed=1))
    buf.add(make_batch(8, seed=2))
    buf.checkpoint()

    # The objects are on the loopback server, read back with an explicit endpoint.
    client = boto3.client("s3", endpoint_url=s3_server.endpoint_url)
    listing = client.list_objects_v2(Bucket=s3_bucket, Prefix="envrun/")
    keys = [o["Key"] for o in listing.get("Contents", [])]
    assert "envrun/LATEST" in keys, keys
    for room in ("manifests", "state", "shards"):
        assert any(k.startswith(f"envrun/{room}/") for k in keys), (room, keys)
    pointer = client.get_object(Bucket=s3_bucket, Key="envrun/LATEST")["Body"].read()
    assert ckpt.last_manifest.encode() in pointer
    # ... and they got there through that endpoint: the proxy relayed the helper's PUTs.
    assert any(m == "PUT" and f"/{s3_bucket}/envrun/LATEST" in p for m, p in s3_server.faults.seen)

    # The restore, also without an endpoint_url, reads them back through the same endpoint.
    s3_server.faults.seen.clear()
    resumed = tr.RolloutBuffer.from_checkpoint(uri, progress=False,
                                               storage=TieredStorage(hot_bytes=0, spill_dir=tmp_path / "r", io="posix"))
    assert any(m == "GET" and f"/{s3_bucket}/envrun/" in p for m, p in s3_server.faults.seen)
    assert len(resumed) == len(buf) == 20
    assert torch.equal(resumed.slots.live, buf.slots.live)
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    a, b = buf.sample(8, generator=g1), resumed.sample(8, generator=g2)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)
    resumed.close()
    buf.close()


# ------------------------------------------------------------------------------ niceness and placement
def test_helper_runs_at_nice_10_anywhere_by_default(tmp_path):
    """Without helper_cpus: the helper is a child process at exactly the trainer's nice + 10, and
    neither it nor the worker thread is restricted (both keep the trainer's CPUs).

    Mutation checks: removing `os.nice(int(nice))` from uploader.serve fails (nice 0 != 10);
    so does RemoteStore's default `nice=10` changed to `nice=1` (tests/test_uploader.py, which only
    asserts "lower than the trainer", passes on that one). Pinning the helper or the worker to a
    CPU when helper_cpus is None (e.g. `self._helper_cpus = set(helper_cpus or [0])`) fails the
    affinity assertions.
    """
    nice = expected_helper_nice()
    trainer_cpus = os.sched_getaffinity(0)
    before = checkpoint_threads()
    uri = f"file://{tmp_path}/ckpt"
    ckpt = Checkpointer(uri, interval_s=3600)
    buf = tr.RolloutBuffer(16, sampler=tr.UniformSampler(), checkpoint=ckpt, seed=0)
    buf.add(make_batch(4, seed=0))
    buf.checkpoint()  # answered by the helper, so it has set its niceness and placement by now
    (worker,) = checkpoint_threads() - before
    pid = the_helper(uri)
    assert os.getpriority(os.PRIO_PROCESS, pid) == nice
    assert os.sched_getaffinity(pid) == trainer_cpus
    assert os.sched_getaffinity(worker.native_id) == trainer_cpus
    assert os.getpriority(os.PRIO_PROCESS, 0) == nice - HELPER_NICE, "the trainer's niceness is left alone"
    buf.close()
    assert helper_pids(uri) == [], "close() must end the helper"


def test_helper_cpus_restrict_the_helper_and_the_worker_thread_only(tmp_path):
    """helper_cpus=[c]: the helper process and the checkpoint worker thread run only on CPU c, the
    helper still at nice 10; the trainer thread (and the process's main thread) keep their CPUs.

    Mutation checks: Checkpointer ignoring helper_cpus (`self._helper_cpus = set()` and no cpus to
    RemoteStore) fails on the helper's affinity; removing the `os.sched_setaffinity(0, ...)` from
    Checkpointer._run fails on the worker thread's affinity; the worker also pinning the trainer's
    thread (adding `os.sched_setaffinity(os.getpid(), ...)` there) fails on the trainer's
    affinity; removing os.nice from uploader.serve fails on the niceness.
    """
    nice = expected_helper_nice()
    trainer_cpus, cpu = helper_cpu()
    main_cpus = os.sched_getaffinity(threading.main_thread().native_id)
    before = checkpoint_threads()
    uri = f"file://{tmp_path}/ckpt"
    ckpt = Checkpointer(uri, interval_s=3600, helper_cpus=[cpu])
    buf = tr.RolloutBuffer(16, sampler=tr.UniformSampler(), checkpoint=ckpt, seed=0)
    buf.add(make_batch(4, seed=0))
    buf.checkpoint()
    (worker,) = checkpoint_threads() - before
    pid = the_helper(uri)
    assert os.sched_getaffinity(pid) == {cpu}
    assert os.sched_getaffinity(worker.native_id) == {cpu}
    assert os.getpriority(os.PRIO_PROCESS, pid) == nice
    assert os.sched_getaffinity(0) == trainer_cpus, "the trainer thread's placement is left alone"
    assert os.sched_getaffinity(threading.main_thread().native_id) == main_cpus
    buf.add(make_batch(4, seed=1))  # the trainer keeps working with its CPUs while the helper is pinned
    buf.checkpoint()
    assert os.sched_getaffinity(0) == trainer_cpus
    buf.close()
    assert helper_pids(uri) == []


def test_the_helper_places_itself_when_started_from_an_unpinned_thread(tmp_path):
    """The helper applies its CPUs and niceness itself, not only by inheriting them from the
    pinned worker thread that starts it: RemoteStore(cpus=[c]) started from this (unpinned) thread.

    Mutation check: removing `os.sched_setaffinity(0, ...)` from uploader.serve fails here
    ({all CPUs} != {c}), while the Checkpointer-level test above still passes because a child
    inherits the affinity of the thread that forked it. Removing os.nice from serve fails too.
    """
    nice = expected_helper_nice()
    trainer_cpus, cpu = helper_cpu()
    uri = f"file://{tmp_path}/remote"
    remote = RemoteStore(uri, None, 5.0, cpus=[cpu])
    remote.start()
    try:
        assert remote.list("manifests") == []  # a round trip: serve() has run its set-up
        pid = the_helper(uri)
        assert os.sched_getaffinity(pid) == {cpu}
        assert os.getpriority(os.PRIO_PROCESS, pid) == nice
        assert os.sched_getaffinity(0) == trainer_cpus
    finally:
        remote.close()
    assert helper_pids(uri) == []
