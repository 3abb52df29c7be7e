"""Checkpoints under failure: an outage never stops training, the next publish recovers everything,
and errors a retry cannot fix fail at once (issue #16, items 2 and 3)."""

import logging
import math
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch

import torchreplay as tr
from rollouts import make_batch
from torchreplay.checkpoint import Checkpointer, open_store, read_manifest
from torchreplay.storage import TieredStorage


def assert_same_buffer(resumed, buf):
    assert len(resumed) == len(buf)
    for name in ("live", "generation", "reuse", "advantage", "policy_version"):
        assert torch.equal(getattr(resumed.slots, name), getattr(buf.slots, name)), name
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    a, b = buf.sample(8, generator=g1), resumed.sample(8, generator=g2)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)


def break_room(root, room="shards"):
    """Make `room` unwritable in a way that also holds for root: a file where the directory was
    (what it held is set aside, as an outage would leave it)."""
    (root / room).rename(root / f"{room}-away")
    (root / room).write_text("not a directory")


def mend_room(root, room="shards"):
    (root / room).unlink()
    (root / f"{room}-away").rename(root / room)


def test_file_outage_then_recovery_keeps_training_and_loses_nothing(tmp_path, caplog):
    """The repro: one failure used to disable the buffer for good (every later call raised)."""
    root = tmp_path / "ckpt"
    uri = f"file://{root}"
    ckpt = Checkpointer(uri, interval_s=0.05, retry_budget_s=0.2)
    buf = tr.RolloutBuffer(64, checkpoint=ckpt, seed=0)
    buf.add(make_batch(4, seed=1, version=0))
    buf.checkpoint()
    assert ckpt.metrics()["checkpoint_failures"] == 0
    caplog.set_level(logging.DEBUG, logger="torchreplay.checkpoint")
    break_room(root)
    try:
        with pytest.raises(tr.CheckpointError, match="failed"):
            buf.add(make_batch(4, seed=2, version=1))
            buf.checkpoint()  # the synchronous publish reports its own failure
        for step in range(2, 8):  # background publishes keep failing; training does not notice
            time.sleep(0.06)
            buf.add(make_batch(4, seed=step + 1, version=step))
            buf.sample(4)
        failures = buf.metrics()["checkpoint_failures"]
        assert failures >= 2
        assert buf.metrics()["checkpoint_lag_s"] > 0.3
    finally:
        mend_room(root)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and r.name == "torchreplay.checkpoint"]
    assert len(errors) == 1, [r.getMessage() for r in errors]  # one incident, logged once

    buf.add(make_batch(4, seed=20, version=8))
    buf.checkpoint()  # re-uploads the shards that failed during the outage
    metrics = buf.metrics()
    assert metrics["checkpoint_lag_s"] < 5 and metrics["checkpoint_last_success_s"] > time.time() - 60
    assert read_manifest(open_store(uri))["rollouts"] == len(buf) == 36
    resumed = tr.RolloutBuffer.from_checkpoint(uri, progress=False)
    assert_same_buffer(resumed, buf)
    assert any("recovered" in r.getMessage() for r in caplog.records)
    resumed.close()
    buf.close()


def test_on_error_raise_raises_once_per_incident(tmp_path):
    root = tmp_path / "ckpt"
    ckpt = Checkpointer(f"file://{root}", interval_s=0.05, retry_budget_s=0.1, on_error="raise")
    buf = tr.RolloutBuffer(64, checkpoint=ckpt, seed=0)
    buf.add(make_batch(4, seed=1))
    break_room(root)
    try:
        raised = 0
        deadline = time.monotonic() + 20
        while raised == 0 and time.monotonic() < deadline:
            time.sleep(0.06)
            try:
                buf.add(make_batch(2, seed=2))
            except tr.CheckpointError as exc:
                assert "keeps working" in str(exc)
                raised += 1
        assert raised == 1
        for seed in range(3, 8):  # the same incident is not raised again
            time.sleep(0.06)
            buf.add(make_batch(2, seed=seed))
        assert len(buf) >= 4 + 2 * 5
    finally:
        mend_room(root)
    buf.checkpoint()
    buf.close()


def test_close_raises_when_its_final_publish_fails(tmp_path):
    root = tmp_path / "ckpt"
    buf = tr.RolloutBuffer(16, checkpoint=Checkpointer(f"file://{root}", interval_s=3600, retry_budget_s=0.1), seed=0)
    buf.add(make_batch(4, seed=1))
    break_room(root, "manifests")
    try:
        with pytest.raises(tr.CheckpointError):
            buf.close()
    finally:
        mend_room(root, "manifests")


def test_unwritable_root_fails_at_construction(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    start = time.monotonic()
    with pytest.raises(tr.CheckpointError, match="a-file"):
        Checkpointer(f"file://{blocker}/ckpt", retry_budget_s=60)
    assert time.monotonic() - start < 5


def test_permanent_file_error_is_not_retried(tmp_path):
    """ENOTDIR writing a manifest cannot go away by waiting: the publish fails at once, not after
    the 60 s budget."""
    root = tmp_path / "ckpt"
    buf = tr.RolloutBuffer(16, checkpoint=Checkpointer(f"file://{root}", interval_s=3600, retry_budget_s=60), seed=0)
    buf.add(make_batch(4, seed=1))
    buf.checkpoint()
    break_room(root, "manifests")
    start = time.monotonic()
    try:
        with pytest.raises(tr.CheckpointError, match="Not a directory"):
            buf.checkpoint()
        assert time.monotonic() - start < 10
    finally:
        mend_room(root, "manifests")
    buf.close()


# ------------------------------------------------------------------------------------------- S3
@pytest.mark.s3
def test_s3_outage_longer_than_the_budget_then_recovery(s3_server, s3_bucket, tmp_path):
    """The issue's repro: retry_budget_s=2, the endpoint down for 6 s. Training goes on through
    it, and soon after the endpoint is back a checkpoint holds everything added meanwhile."""
    uri = f"s3://{s3_bucket}/run"
    ckpt = Checkpointer(uri, interval_s=1.0, endpoint_url=s3_server.endpoint_url, retry_budget_s=2.0)
    buf = tr.RolloutBuffer(256, sampler=tr.PrioritizedSampler(alpha=0.7), max_reuse=50, seed=3, checkpoint=ckpt,
                           storage=TieredStorage(hot_bytes=1 << 20, spill_dir=tmp_path / "spill", io="posix"))
    buf.add(make_batch(8, seed=0, version=0))
    buf.checkpoint()
    s3_server.stop_moto()
    step = 1
    try:
        down_until = time.monotonic() + 6
        while time.monotonic() < down_until:
            buf.add(make_batch(4, seed=step, version=step))
            buf.sample(8)
            buf.advance(step)
            step += 1
            time.sleep(0.2)
        assert buf.metrics()["checkpoint_failures"] >= 1
    finally:
        s3_server.start_moto()
    # Back up: training keeps going, and the background publish recovers on its own.
    deadline = time.monotonic() + 30
    while buf.metrics()["checkpoint_lag_s"] > 3 and time.monotonic() < deadline:
        buf.add(make_batch(2, seed=step, version=step))
        buf.sample(4)
        step += 1
        time.sleep(0.2)
    assert buf.metrics()["checkpoint_lag_s"] <= 3, buf.metrics()
    buf.checkpoint()
    resumed = tr.RolloutBuffer.from_checkpoint(uri, endpoint_url=s3_server.endpoint_url, progress=False,
                                               storage=TieredStorage(hot_bytes=0, spill_dir=tmp_path / "r", io="posix"))
    assert_same_buffer(resumed, buf)
    resumed.close()
    buf.close()


@pytest.mark.s3
def test_missing_bucket_fails_fast_naming_the_bucket(s3_server):
    start = time.monotonic()
    with pytest.raises(tr.CheckpointError, match=r"tr-no-such-bucket.*NoSuchBucket"):
        Checkpointer("s3://tr-no-such-bucket/run", endpoint_url=s3_server.endpoint_url, retry_budget_s=60)
    assert time.monotonic() - start < 10


@pytest.mark.s3
def test_a_failed_multipart_part_is_retried_alone(s3_server, s3_bucket, tmp_path):
    uri = f"s3://{s3_bucket}/run"
    ckpt = Checkpointer(uri, interval_s=3600, endpoint_url=s3_server.endpoint_url, multipart_bytes=5 << 20)
    buf = tr.RolloutBuffer(64, checkpoint=ckpt, seed=0,
                           storage=TieredStorage(hot_bytes=1 << 20, spill_dir=tmp_path / "spill", io="posix"))
    s3_server.faults.seen.clear()
    injected_before = s3_server.faults.injected
    s3_server.faults.fail_only = "partNumber=2"
    s3_server.faults.fail_next = 2  # botocore once made 1 retry per request: 2 failures restarted the file
    buf.add(make_batch(40, seed=1, min_len=20_000, max_len=30_000))  # ~12 MB shard: 3 parts
    buf.checkpoint()
    seen = list(s3_server.faults.seen)
    started = [p for m, p in seen if m == "POST" and "/shards/" in p and p.endswith("uploads")]
    parts = [p for m, p in seen if m == "PUT" and "/shards/" in p and "partNumber=" in p]
    assert s3_server.faults.injected - injected_before == 2
    assert len(started) == 1, started  # the file was not restarted
    assert len(parts) == 5, parts  # three parts, one of them three times
    resumed = tr.RolloutBuffer.from_checkpoint(uri, endpoint_url=s3_server.endpoint_url, progress=False)
    assert_same_buffer(resumed, buf)
    resumed.close()
    buf.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def authenticating_s3():
    """A moto server that checks credentials (INITIAL_NO_AUTH_ACTION_COUNT=0), as S3 does."""
    port = free_port()
    moto = shutil.which("moto_server") or os.path.join(os.path.dirname(sys.executable), "moto_server")
    proc = subprocess.Popen([moto, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0"})
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "moto_server did not start"
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.s3
def test_refused_credentials_fail_fast_with_the_s3_code(authenticating_s3, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAREFUSEDREFUSED00")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "refused")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    start = time.monotonic()
    with pytest.raises(tr.CheckpointError, match=r"tr-bucket.*InvalidAccessKeyId"):
        Checkpointer("s3://tr-bucket/run", endpoint_url=authenticating_s3, retry_budget_s=60)
    assert time.monotonic() - start < 10


@pytest.mark.s3
def test_unreachable_endpoint_at_start_is_not_fatal(caplog):
    """A store that is down when the job starts is an outage, not a misconfiguration: warned
    about, and the background retries."""
    dead = f"http://127.0.0.1:{free_port()}"
    ckpt = Checkpointer("s3://tr-later/run", endpoint_url=dead, retry_budget_s=0.5, interval_s=3600)
    assert any("not reachable" in r.getMessage() for r in caplog.records)
    assert math.isnan(ckpt.metrics()["checkpoint_last_success_s"])
    ckpt.close(final=False)
