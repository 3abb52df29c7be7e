"""Issue 24, durability items: bounded checkpoint uploads (item 7) and the compaction threshold on
shard size (item 13). The resharding of a cut with ranks at different versions (item 6) is in
tests/test_distributed.py, which has the multi-process harness."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import torchreplay as tr
from rollouts import make_batch
from torchreplay.storage import TieredStorage


# ------------------------------------------------------------------------------ item 13
@pytest.mark.parametrize("min_rows", [None, 8])
def test_compaction_takes_shards_from_compact_min_rows_up(tmp_path, min_rows):
    """Two shards 1/4 live or less under compact_below=0.5: one of exactly `compact_min_rows` rows is
    rewritten by advance(), one a row smaller is not. `None` checks the documented default, 16.
    Mutations checked: `s.n > self.compact_min_rows` (the shard at the threshold stays) and the
    old hard-coded `s.n >= 16` with min_rows=8 (neither shard is compacted)."""
    kwargs = {} if min_rows is None else {"compact_min_rows": min_rows}
    threshold = 16 if min_rows is None else min_rows
    storage = TieredStorage(hot_bytes=0, spill_dir=tmp_path, io="posix", compact_below=0.5, **kwargs)
    assert storage.compact_min_rows == threshold
    buf = tr.RolloutBuffer(64, sampler=tr.UniformSampler(), max_reuse=1, storage=storage)
    at, below = make_batch(threshold, seed=1), make_batch(threshold - 1, seed=2)
    h_at, h_below = buf.add(at), buf.add(below)
    keep = 2  # survivors per shard: 2/threshold and 2/(threshold - 1) are both below 0.5
    buf.gather(h_at.slot[keep:])  # max_reuse=1: one use each evicts them
    buf.gather(h_below.slot[keep:])
    shard_at, shard_below = buf.slots.shard[h_at.slot[:keep]].clone(), buf.slots.shard[h_below.slot[:keep]].clone()
    storage.flush()
    buf.advance(1)
    assert buf.metrics()["storage_compactions"] == 1
    assert not torch.equal(buf.slots.shard[h_at.slot[:keep]], shard_at)  # rewritten into a new shard
    assert torch.equal(buf.slots.shard[h_below.slot[:keep]], shard_below)  # left as it was
    storage.flush()
    assert len(list(tmp_path.glob("*.trs"))) == 2
    # The compacted rollouts read back exactly.
    out = buf.gather(torch.cat([h_at.slot[:keep], h_below.slot[:keep]]), count_use=False)
    for k, (batch, i) in enumerate([(at, 0), (at, 1), (below, 0), (below, 1)]):
        n = batch["tokens"][i].numel()
        assert torch.equal(out.tokens[k, :n], batch["tokens"][i])
        assert torch.equal(out.logprobs[k, :n], batch["logprobs"][i])
    buf.close()


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-3, ValueError), (2.5, TypeError), (True, TypeError),
                                        ("8", TypeError), (None, TypeError)])
def test_compact_min_rows_is_validated(tmp_path, bad, error):
    with pytest.raises(error, match="compact_min_rows"):
        TieredStorage(hot_bytes=0, spill_dir=tmp_path, compact_min_rows=bad)
    assert not list(tmp_path.iterdir())  # refused before the spill directory is used


# ------------------------------------------------------------------------------ item 7
def held_dead_bytes(buf, storage, spill_dir) -> int:
    """Bytes of shard files in spill_dir whose rollouts are all gone: what something still holds."""
    live = buf.slots.shard[buf.slots.live].unique().tolist()
    live_paths = {storage.shard(sid).path for sid in live}
    return sum(f.stat().st_size for f in spill_dir.glob("*.trs") if str(f) not in live_paths)


def assert_restores_exactly(buf, uri, tmp_path, name, endpoint_url=None, tag=None):
    """The checkpoint holds exactly the buffer's live rollouts, slot for slot."""
    resumed = tr.RolloutBuffer.from_checkpoint(uri, endpoint_url=endpoint_url, progress=False, tag=tag,
                                               storage=TieredStorage(hot_bytes=0, spill_dir=tmp_path / name,
                                                                     io="posix"))
    try:
        for field in ("live", "generation", "reuse", "advantage", "policy_version"):
            assert torch.equal(getattr(resumed.slots, field), getattr(buf.slots, field)), field
        slots = buf.slots.live.nonzero().flatten()
        a, b = buf.gather(slots, count_use=False), resumed.gather(slots, count_use=False)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)
    finally:
        resumed.close()


def test_with_no_room_for_background_uploads_only_live_shards_reach_the_store(tmp_path):
    """max_pending_bytes=0: no shard waits pinned for a background upload. Shards whose rollouts
    die before the next publish are deleted at once and never uploaded; the publish uploads
    exactly the live ones, and the checkpoint restores exactly.
    Mutations checked: admitting every shard (`UploadBacklog.admit` ignoring the limit) leaves dead
    files held; a publish that pins and uploads nothing it names fails with "not durable"."""
    from torchreplay.checkpoint import Checkpointer, open_store

    uri = f"file://{tmp_path}/ckpt"
    spill = tmp_path / "spill"
    storage = TieredStorage(hot_bytes=0, spill_dir=spill, io="posix")
    ckpt = Checkpointer(uri, interval_s=3600, max_pending_bytes=0)
    buf = tr.RolloutBuffer(16, sampler=tr.UniformSampler(), seed=0, checkpoint=ckpt, storage=storage)
    for step in range(6):
        buf.add(make_batch(8, version=step, seed=step))  # capacity 16: the last two adds' shards live
    storage.flush()
    assert held_dead_bytes(buf, storage, spill) == 0 and len(list(spill.glob("*.trs"))) == 2
    metrics = buf.metrics()
    assert metrics["checkpoint_pending_bytes"] == 0 and metrics["checkpoint_deferred_shards"] == 6
    buf.checkpoint()
    assert len(open_store(uri).list("shards")) == 2
    assert_restores_exactly(buf, uri, tmp_path, "restored")
    buf.close()


@pytest.mark.s3
def test_a_slow_store_costs_checkpoint_staleness_not_disk(s3_server, s3_bucket, tmp_path):
    """Issue 24 item 7: every S3 request takes 0.1 s while the buffer keeps adding (each add's
    shard dies four adds later). What dead shards hold in spill_dir, and the pending-upload bytes,
    stay within max_pending_bytes at every step; shards that died waiting were never uploaded.
    A tagged checkpoint taken while the store is slow, and the last one, both restore exactly.
    Before the fix every sealed shard stayed pinned in spill_dir until its (slow) upload: dead
    shards held 344 KB of it by the 7th add, past the 256 KiB limit, and the backlog kept growing.
    Mutation checked: `UploadBacklog.admit` ignoring the limit fails the bound the same way."""
    from torchreplay.checkpoint import Checkpointer

    limit = 256 << 10
    uri = f"s3://{s3_bucket}/slow"
    spill = tmp_path / "spill"
    storage = TieredStorage(hot_bytes=1 << 20, spill_dir=spill, io="posix")
    ckpt = Checkpointer(uri, interval_s=3600, endpoint_url=s3_server.endpoint_url, max_pending_bytes=limit)
    buf = tr.RolloutBuffer(32, sampler=tr.PrioritizedSampler(), seed=0, checkpoint=ckpt, storage=storage)
    s3_server.faults.delay_s = 0.1
    shard_puts_before = len([p for m, p in s3_server.faults.seen if m == "PUT" and "/shards/" in p])
    peak = 0
    for step in range(40):
        buf.add(make_batch(8, version=step, seed=step, min_len=500, max_len=1500))  # ~100 KB shards
        buf.sample(8)
        storage.flush()  # settles spills, so a dead file still here is held by something
        peak = max(peak, held_dead_bytes(buf, storage, spill))
        assert peak <= limit, f"step {step}: dead shards hold {peak} bytes of spill_dir, limit {limit}"
        assert buf.metrics()["checkpoint_pending_bytes"] <= limit
        if step == 20:
            buf.checkpoint(tag="mid")  # while the store is slow: uploads the live shards it lacks
            mid = {k: v.clone() for k, v in buf.state_dict().items() if isinstance(v, torch.Tensor)}
            mid_len = len(buf)
    metrics = buf.metrics()
    shard_puts = len([p for m, p in s3_server.faults.seen if m == "PUT" and "/shards/" in p]) - shard_puts_before
    assert metrics["checkpoint_skipped_uploads"] + metrics["checkpoint_deferred_shards"] > 0
    assert shard_puts < 40  # dead shards were not uploaded
    s3_server.faults.delay_s = 0.0
    buf.checkpoint()
    assert_restores_exactly(buf, uri, tmp_path, "latest", endpoint_url=s3_server.endpoint_url)
    tagged = tr.RolloutBuffer.from_checkpoint(uri, endpoint_url=s3_server.endpoint_url, progress=False, tag="mid")
    assert len(tagged) == mid_len
    del mid
    tagged.close()
    buf.close()


def shard_puts(s3_server) -> int:
    with s3_server.faults.lock:
        return len([p for m, p in s3_server.faults.seen if m == "PUT" and "/shards/" in p])


@pytest.mark.s3
def test_queued_shards_that_die_before_their_turn_are_not_uploaded(s3_server, s3_bucket, tmp_path):
    """Every request takes 0.3 s; capacity 16 and 8 rollouts per add, so each shard dies two adds
    after it sealed. With room for every shard in the backlog, each one is either uploaded once
    or, dead by its turn, skipped (never uploaded); none is deferred. Before the fix all 20 were
    uploaded, the dead ones included. Mutations checked: no liveness check before the upload
    (skipped stays 0), and counting the dead as skipped but uploading them anyway (20 PUTs)."""
    from torchreplay.checkpoint import Checkpointer

    uri = f"s3://{s3_bucket}/skip"
    ckpt = Checkpointer(uri, interval_s=3600, endpoint_url=s3_server.endpoint_url)
    storage = TieredStorage(hot_bytes=0, spill_dir=tmp_path / "spill", io="posix")
    buf = tr.RolloutBuffer(16, sampler=tr.UniformSampler(), seed=0, checkpoint=ckpt, storage=storage)
    before = shard_puts(s3_server)
    s3_server.faults.delay_s = 0.3
    for step in range(20):
        buf.add(make_batch(8, version=step, seed=step))
    s3_server.faults.delay_s = 0.0
    buf.checkpoint()  # after every queued upload
    metrics = buf.metrics()
    skipped = metrics["checkpoint_skipped_uploads"]
    assert skipped >= 1 and metrics["checkpoint_deferred_shards"] == 0 and metrics["checkpoint_pending_bytes"] == 0
    assert shard_puts(s3_server) - before == 20 - skipped
    assert_restores_exactly(buf, uri, tmp_path, "restored", endpoint_url=s3_server.endpoint_url)
    buf.close()


@pytest.mark.s3
def test_background_publishes_superseded_in_the_queue_are_not_written(s3_server, s3_bucket, tmp_path):
    """While the worker uploads a shard against a slow store, two background publishes and a
    tagged checkpoint() queue up behind it: only the tagged one is written (one manifest and one
    state), the two it supersedes are dropped and counted. Before the fix all three were written
    (the mutation that never supersedes: 4 manifests)."""
    from torchreplay.checkpoint import Checkpointer, open_store

    uri = f"s3://{s3_bucket}/coalesce"
    ckpt = Checkpointer(uri, interval_s=3600, endpoint_url=s3_server.endpoint_url, keep_last=10)
    buf = tr.RolloutBuffer(64, sampler=tr.UniformSampler(), seed=0, checkpoint=ckpt,
                           storage=TieredStorage(hot_bytes=0, spill_dir=tmp_path / "spill", io="posix"))
    buf.add(make_batch(8, seed=1))
    buf.checkpoint()
    store = open_store(uri, s3_server.endpoint_url)
    assert len(store.list("manifests")) == 1
    s3_server.faults.delay_s = 1.0
    # The shard's upload, delayed, ends after ~1.05 s; the publishes (queued by ~0.25 s) need no delay.
    fast_again = threading.Timer(0.8, setattr, (s3_server.faults, "delay_s", 0.0))
    fast_again.start()
    buf.add(make_batch(8, seed=2))
    time.sleep(0.2)  # past the worker's 50 ms gathering window: it is uploading that shard now
    ckpt.publish(wait=False)
    buf.add(make_batch(8, seed=3))
    ckpt.publish(wait=False)
    buf.checkpoint(tag="last")
    fast_again.join()
    assert len(store.list("manifests")) == 2
    assert buf.metrics()["checkpoint_superseded_publishes"] == 2
    assert_restores_exactly(buf, uri, tmp_path, "restored", endpoint_url=s3_server.endpoint_url, tag="last")
    buf.close()


@pytest.mark.parametrize("bad, error", [(-1, ValueError), (1.5, TypeError), (True, TypeError), (None, TypeError),
                                        ("1GiB", TypeError)])
def test_max_pending_bytes_is_validated(tmp_path, bad, error):
    from torchreplay.checkpoint import Checkpointer

    with pytest.raises(error, match="max_pending_bytes"):
        Checkpointer(f"file://{tmp_path}/ckpt", max_pending_bytes=bad)
    assert not (tmp_path / "ckpt").exists()  # refused before the store is touched
