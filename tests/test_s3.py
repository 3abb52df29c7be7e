"""Checkpoints against a real S3-compatible HTTP server on loopback (moto), with injected faults."""

import json
import time

import pytest
import torch

import torchreplay as tr
from rollouts import make_batch
from torchreplay.checkpoint import Checkpointer, open_store, read_manifest
from torchreplay.storage import TieredStorage

pytestmark = pytest.mark.s3


def s3_buffer(s3_server, bucket, tmp_path, retry_budget_s=30.0, multipart_bytes=64 << 20, **kw):
    uri = f"s3://{bucket}/run1"
    ckpt = Checkpointer(uri, interval_s=3600, endpoint_url=s3_server.endpoint_url, retry_budget_s=retry_budget_s,
                        multipart_bytes=multipart_bytes)
    buf = tr.RolloutBuffer(64, sampler=tr.PrioritizedSampler(alpha=0.7), max_reuse=4, seed=3, checkpoint=ckpt,
                           storage=TieredStorage(hot_bytes=1 << 20, spill_dir=tmp_path / "spill", io="posix"), **kw)
    return uri, buf


def assert_resume_matches(buf, uri, s3_server, tmp_path):
    resumed = tr.RolloutBuffer.from_checkpoint(uri, endpoint_url=s3_server.endpoint_url, progress=False,
                                               storage=TieredStorage(hot_bytes=0, spill_dir=tmp_path / "r", io="posix"))
    assert len(resumed) == len(buf)
    for name in ("live", "generation", "reuse", "advantage", "policy_version"):
        assert torch.equal(getattr(resumed.slots, name), getattr(buf.slots, name)), name
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    a, b = buf.sample(32, generator=g1), resumed.sample(32, generator=g2)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)
    resumed.close()


def test_s3_round_trip_with_multipart_shards(s3_server, s3_bucket, tmp_path):
    # The uploads run in the helper process: the part size must reach it through the Checkpointer.
    uri, buf = s3_buffer(s3_server, s3_bucket, tmp_path, multipart_bytes=5 << 20)
    s3_server.faults.seen.clear()
    buf.add(make_batch(40, seed=1, min_len=20_000, max_len=30_000))  # ~12 MB shard: 3 parts
    buf.add(make_batch(16, seed=2))
    buf.checkpoint()
    seen = list(s3_server.faults.seen)
    shard_parts = [p for m, p in seen if m == "PUT" and "/shards/" in p and "partNumber=" in p]
    assert any(m == "POST" and "/shards/" in p and "uploads" in p for m, p in seen), "no multipart upload started"
    assert len(shard_parts) >= 3, shard_parts
    store = open_store(uri, s3_server.endpoint_url)
    assert read_manifest(store)["rollouts"] == 56
    assert_resume_matches(buf, uri, s3_server, tmp_path)
    buf.close()


def test_injected_500_and_503_are_retried(s3_server, s3_bucket, tmp_path):
    uri, buf = s3_buffer(s3_server, s3_bucket, tmp_path)
    s3_server.faults.fail_status = 503
    s3_server.faults.fail_next = 4
    buf.add(make_batch(16, seed=3))
    buf.sample(8)
    buf.checkpoint()
    s3_server.faults.fail_status = 500
    s3_server.faults.fail_next = 3
    buf.add(make_batch(16, seed=4))
    buf.checkpoint()
    assert s3_server.faults.injected >= 7
    assert_resume_matches(buf, uri, s3_server, tmp_path)
    buf.close()


def test_training_calls_do_not_wait_on_slow_uploads(s3_server, s3_bucket, tmp_path):
    """Every S3 request takes 1 s. Training calls go on until the proxy has seen the checkpoint's
    uploads start (so the slowdown really hit them), and at that point its manifest is still not
    published (read straight from the S3 server, past the slow proxy): it was in flight during
    the calls. No call took as long as one request, so none waited on an upload.
    Mutation checked: Checkpointer.check() draining the upload queue (every buffer call waits for
    pending uploads) fails the latency bound."""
    uri, buf = s3_buffer(s3_server, s3_bucket, tmp_path)
    direct = open_store(uri, f"http://127.0.0.1:{s3_server.moto_port}")
    delay = 1.0
    s3_server.faults.delay_s = delay
    seen_before = len(s3_server.faults.seen)
    buf.add(make_batch(16, seed=5))
    buf.checkpointer.publish(wait=False)
    in_flight = buf.checkpointer.last_manifest

    def uploads_started() -> bool:
        with s3_server.faults.lock:
            return any(method == "PUT" for method, _ in s3_server.faults.seen[seen_before:])

    latencies = []
    deadline = time.monotonic() + 30
    while (len(latencies) < 20 or not uploads_started()) and time.monotonic() < deadline:
        start = time.perf_counter()
        buf.add(make_batch(4, version=0, seed=100 + len(latencies)))
        buf.sample(8)
        latencies.append(time.perf_counter() - start)
    assert uploads_started(), "the checkpoint never started uploading"
    published = json.loads(direct.get("LATEST"))["manifest"] if direct.exists("LATEST") else None
    assert published != in_flight, "the manifest was already durable: the calls did not overlap the upload"
    assert max(latencies) < delay, f"a training call took {max(latencies):.2f} s: it waited on an upload"
    s3_server.faults.delay_s = 0.0
    buf.checkpoint()
    assert read_manifest(open_store(uri, s3_server.endpoint_url))["rollouts"] == len(buf)
    assert_resume_matches(buf, uri, s3_server, tmp_path)
    buf.close()


def test_server_stopped_mid_upload_and_restarted(s3_server, s3_bucket, tmp_path):
    uri, buf = s3_buffer(s3_server, s3_bucket, tmp_path)
    buf.add(make_batch(16, seed=6))
    buf.checkpoint()
    s3_server.faults.delay_s = 0.2
    for i in range(4):
        buf.add(make_batch(8, version=1, seed=200 + i))
    buf.checkpointer.publish(wait=False)
    time.sleep(0.3)
    s3_server.stop_moto()  # uploads now fail at the connection
    for i in range(5):
        buf.add(make_batch(4, version=1, seed=300 + i))  # training goes on during the outage
        buf.sample(4)
    time.sleep(1.0)
    s3_server.start_moto()
    s3_server.faults.delay_s = 0.0
    buf.checkpoint()
    assert read_manifest(open_store(uri, s3_server.endpoint_url))["rollouts"] == len(buf)
    assert_resume_matches(buf, uri, s3_server, tmp_path)
    buf.close()


def test_persistent_outage_surfaces_after_the_retry_budget(s3_server, s3_bucket, tmp_path):
    uri, buf = s3_buffer(s3_server, s3_bucket, tmp_path, retry_budget_s=1.0)
    buf.add(make_batch(8, seed=7))
    buf.checkpoint()
    s3_server.stop_moto()
    try:
        buf.add(make_batch(8, seed=8))
        start = time.monotonic()
        with pytest.raises(tr.CheckpointError, match="gave up"):
            buf.checkpoint(timeout=60)
        # The point is that it gives up (on its 1 s retry budget) instead of retrying forever; 30 s
        # only separates "gave up" from "hung until the 60 s timeout", whatever the machine's load.
        assert time.monotonic() - start < 30
        buf.sample(4)  # training goes on through the outage (test_checkpoint_outages.py)
    finally:
        s3_server.start_moto()


def test_lazy_restore_downloads_a_shard_only_when_a_sample_needs_it(s3_server, s3_bucket, tmp_path):
    uri, buf = s3_buffer(s3_server, s3_bucket, tmp_path)
    for step in range(6):  # six shards of ~0.5 MB of tokens each
        buf.add(make_batch(8, version=step, seed=step, min_len=8_000, max_len=9_000))
    buf.checkpoint()
    store = open_store(uri, s3_server.endpoint_url)
    shard_bytes = sum(store.size(s["key"]) for s in read_manifest(store)["shards"])
    before = s3_server.faults.get_bytes
    spill = tmp_path / "lazy"
    resumed = tr.RolloutBuffer.from_checkpoint(uri, endpoint_url=s3_server.endpoint_url, progress=False, lazy=True,
                                               storage=TieredStorage(hot_bytes=0, spill_dir=spill, io="posix"))
    restore_bytes = s3_server.faults.get_bytes - before
    # Headers, offsets and per-rollout fields only: a few pages per shard, not the token blocks.
    assert restore_bytes < 0.1 * shard_bytes, (restore_bytes, shard_bytes)
    assert not list(spill.glob("*.trs")) and resumed.metrics()["storage_fetched_shards"] == 0
    for name in ("live", "generation", "reuse", "advantage", "policy_version"):
        assert torch.equal(getattr(resumed.slots, name), getattr(buf.slots, name)), name

    # Sample the rollouts of two shards only: exactly those two files come down, bit-identical.
    wanted = ((buf.slots.shard == 1) | (buf.slots.shard == 4)).nonzero().flatten()
    original, restored = buf.gather(wanted, count_use=False), resumed.gather(wanted, count_use=False)
    assert torch.equal(original.tokens, restored.tokens) and torch.equal(original.logprobs, restored.logprobs)
    assert resumed.metrics()["storage_fetched_shards"] == 2 and len(list(spill.glob("*.trs"))) == 2
    assert s3_server.faults.get_bytes - before < restore_bytes + 0.5 * shard_bytes

    # A shard that vanished from the store after the restore (S3 answers 404): a clear StorageError
    # on first use, its rollouts evicted and counted (they can never be served).
    others = ((resumed.slots.shard != resumed.slots.shard[wanted[0]])
              & (resumed.slots.shard != resumed.slots.shard[wanted[-1]]) & resumed.slots.live).nonzero().flatten()
    lost = int((resumed.slots.live & (resumed.slots.shard == resumed.slots.shard[others[0]])).sum())
    store.delete([s["key"] for s in read_manifest(store)["shards"]])
    with pytest.raises(tr.StorageError, match="is no longer in s3://"):
        resumed.gather(others[:1], count_use=False)
    assert resumed.metrics()["evicted_corrupt"] == lost and not bool(resumed.slots.live[others[0]])
    resumed.gather(wanted, count_use=False)  # what is here keeps serving
    resumed.close()
    buf.close()
