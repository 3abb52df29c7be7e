"""The checkpoint upload helper process: isolation from the trainer, its wire format, its lifetime."""

import io
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import torchreplay as tr
from rollouts import make_batch
from torchreplay.checkpoint import Checkpointer, open_store
from torchreplay.checkpoint import uploader


def wait_for(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it has stopped running though.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_uploads_run_in_a_lower_priority_helper_process(tmp_path):
    uri = f"file://{tmp_path}/ckpt"
    ckpt = Checkpointer(uri, interval_s=3600)
    buf = tr.RolloutBuffer(16, sampler=tr.UniformSampler(), checkpoint=ckpt, seed=0)
    buf.add(make_batch(4, seed=0))
    buf.checkpoint()
    pid = ckpt.helper_pid
    assert pid is not None and pid != os.getpid() and alive(pid)
    assert os.getpriority(os.PRIO_PROCESS, pid) > os.getpriority(os.PRIO_PROCESS, 0)
    # The helper never imported torch: it starts fast and stays small.
    with open(f"/proc/{pid}/maps") as f:
        assert "libtorch" not in f.read()
    assert open_store(uri).exists("LATEST")
    buf.close()
    assert not alive(pid) and ckpt.helper_pid is None, "close() must end the helper"


def test_a_dead_helper_is_counted_and_replaced(tmp_path):
    """The upload that meets a dead helper fails (counted); the next publish starts a new helper
    and uploads that shard again, so nothing added is lost."""
    uri = f"file://{tmp_path}/ckpt"
    ckpt = Checkpointer(uri, interval_s=3600, retry_budget_s=1)
    buf = tr.RolloutBuffer(16, sampler=tr.UniformSampler(), checkpoint=ckpt, seed=0)
    buf.add(make_batch(4, seed=0))
    buf.checkpoint()
    killed = ckpt.helper_pid
    os.kill(killed, signal.SIGKILL)
    assert wait_for(lambda: not alive(killed))
    buf.add(make_batch(4, seed=1))
    buf.checkpoint()
    assert buf.metrics()["checkpoint_failures"] == 1
    assert ckpt.helper_pid not in (None, killed)  # a new helper took over
    buf.close()
    resumed = tr.RolloutBuffer.from_checkpoint(uri, progress=False)
    assert len(resumed) == 8 and torch.equal(resumed.slots.generation, buf.slots.generation)
    resumed.close()


def test_helper_dies_with_a_sigkilled_trainer(tmp_path):
    """An orphaned helper could keep uploading and garbage-collecting under a prefix that a resumed
    run already writes to; it must go down with the trainer."""
    child = textwrap.dedent(f"""
        import sys, time
        import torchreplay as tr
        from torchreplay.checkpoint import Checkpointer
        ckpt = Checkpointer("file://{tmp_path}/ckpt", interval_s=3600)
        buf = tr.RolloutBuffer(16, sampler=tr.UniformSampler(), checkpoint=ckpt, seed=0)
        buf.checkpoint()
        print(ckpt.helper_pid, flush=True)
        time.sleep(600)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), *sys.path]))
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True, env=env)
    helper_pid = int(proc.stdout.readline())
    assert alive(helper_pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert wait_for(lambda: not alive(helper_pid)), "the helper outlived its SIGKILLed trainer"


def test_wire_format_round_trips_and_rejects_garbage():
    stream = io.BytesIO()
    uploader.write_frame(stream, {"op": "put", "key": "LATEST"}, b"\x00payload")
    stream.seek(0)
    header, payload = uploader.read_frame(stream)
    assert header == {"op": "put", "key": "LATEST", "payload_bytes": 8} and payload == b"\x00payload"
    assert uploader.read_frame(stream) is None  # clean end of input
    oversized = io.BytesIO(uploader.FRAME_LENGTH.pack(1 << 40))
    with pytest.raises(ValueError, match="exceeds"):
        uploader.read_frame(oversized)
    truncated = io.BytesIO(uploader.FRAME_LENGTH.pack(100) + b"{}")
    with pytest.raises(EOFError):
        uploader.read_frame(truncated)
    bad_size = io.BytesIO()
    head = b'{"payload_bytes": -1}'
    bad_size.write(uploader.FRAME_LENGTH.pack(len(head)) + head)
    bad_size.seek(0)
    with pytest.raises(ValueError, match="payload_bytes"):
        uploader.read_frame(bad_size)


def test_helper_reports_errors_and_keeps_serving(tmp_path):
    remote = uploader.RemoteStore(f"file://{tmp_path}/ckpt", None, retry_budget_s=0.2)
    try:
        with pytest.raises(tr.CheckpointError, match="not a valid checkpoint key"):
            remote.put("../escape", b"x")
        remote.put("LATEST", b"{}")
        assert remote.get("LATEST") == b"{}"
        assert remote.list("manifests") == []
        remote.put("manifests/000000000001.json", b"m")
        assert remote.list("manifests") == ["manifests/000000000001.json"]
        remote.delete(["manifests/000000000001.json"])
        assert remote.list("manifests") == []
        source = tmp_path / "shard.trs"
        source.write_bytes(b"shard bytes")
        remote.put_files([("shards/a.trs", str(source)), ("shards/b.trs", str(source))])
        assert remote.list("shards") == ["shards/a.trs", "shards/b.trs"]
        # Stops at the first failure and says which object: the ones before it are durable.
        with pytest.raises(tr.CheckpointError, match="c.trs"):
            remote.put_files([("shards/c.trs", str(tmp_path / "missing")), ("shards/d.trs", str(source))])
        assert remote.list("shards") == ["shards/a.trs", "shards/b.trs"]
    finally:
        remote.close()


def test_helper_cpus_places_the_helper_and_the_worker_thread_and_is_validated(tmp_path):
    trainer_cpus = os.sched_getaffinity(0)
    cpu = max(trainer_cpus)
    ckpt = Checkpointer(f"file://{tmp_path}/ckpt", interval_s=3600, helper_cpus=[cpu])
    buf = tr.RolloutBuffer(16, sampler=tr.UniformSampler(), checkpoint=ckpt, seed=0)
    buf.checkpoint()
    assert os.sched_getaffinity(ckpt.helper_pid) == {cpu}
    assert os.sched_getaffinity(ckpt.worker_native_id) == {cpu}
    assert os.sched_getaffinity(0) == trainer_cpus, "the trainer's own placement is left alone"
    buf.close()
    for bad in ([], [-1], ["0"], [True], [10_000]):
        with pytest.raises(ValueError, match="helper_cpus"):
            Checkpointer(f"file://{tmp_path}/never", helper_cpus=bad)
    assert not (tmp_path / "never").exists()  # refused before anything was created
    for bad in (0, 1 << 20, True, 5.5e6, "64MiB"):
        with pytest.raises(ValueError, match="multipart_bytes"):
            Checkpointer(f"file://{tmp_path}/never", multipart_bytes=bad)
    assert not (tmp_path / "never").exists()
