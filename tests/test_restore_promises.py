"""What docs/api.md ("Checkpoints") promises about restoring, over file:// checkpoints:

* `from_checkpoint(uri, manifest=KEY)` restores that (older) manifest; the default the newest;
* `lazy=True` downloads a shard's file only when a sample, a prefetch or a compaction first needs
  its tokens (`metrics()["storage_fetched_shards"]` counts them), and the bytes are the ones added;
* a shard missing from the store by then is evicted and counted (`evicted_corrupt`) by the sample
  that needs it, as unreadable rows are (`on_corrupt`), and a missing object is never retried.

Every expected value below comes from the batches the test itself added (not from the library
reading its own files back), and every test names in its docstring a mutation of the library that
it was run against and failed on.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest
import torch
from rollouts import make_batch

import torchreplay as tr
from torchreplay.assembly import Handles
from torchreplay.checkpoint import Checkpointer, open_store, read_manifest
from torchreplay.checkpoint.store import FileStore
from torchreplay.storage import TieredStorage


def remember(origin: dict, handles, batch: dict, advantage: torch.Tensor | None = None) -> None:
    """origin[slot] = what was added there: (tokens, logprobs, reward, advantage)."""
    adv = batch["advantage"] if advantage is None else advantage
    for j, slot in enumerate(handles.slot.tolist()):
        origin[slot] = (batch["tokens"][j], batch["logprobs"][j], batch["reward"][j], adv[j])


def check_rows(out, origin: dict) -> None:
    """Each row of `out` (a ReplayBatch, right-padded with 0) is exactly the rollout added at its slot."""
    slots = out.handles.slot.tolist()
    assert slots, "an empty batch checks nothing"
    for i, slot in enumerate(slots):
        tokens, logprobs, reward, advantage = origin[slot]
        n = tokens.numel()
        assert torch.equal(out.tokens[i, :n], tokens), slot
        assert not out.tokens[i, n:].any(), slot  # padding only (make_batch tokens are >= 1)
        assert int(out.attention_mask[i].sum()) == n, slot
        assert torch.equal(out.logprobs[i, :n], logprobs), slot
        assert torch.equal(out.reward[i], reward) and torch.equal(out.advantage[i], advantage), slot


def live_slots(buf) -> set[int]:
    return set(buf.slots.live.nonzero().flatten().tolist())


def lazy_storage(path) -> TieredStorage:
    return TieredStorage(hot_bytes=0, spill_dir=path, io="posix")


@pytest.fixture
def downloads(monkeypatch):
    """Every whole-object download of a file:// store in this test: [(key, thread name)].
    (A lazy restore reads headers with ranged reads; only a shard's first use downloads it whole.)"""
    calls: list[tuple[str, str]] = []
    real = FileStore.get_to_file

    def counted(self, key, path):
        calls.append((key, threading.current_thread().name))
        return real(self, key, path)

    monkeypatch.setattr(FileStore, "get_to_file", counted)
    return calls


def wait_for(predicate, timeout_s: float = 30.0) -> bool:
    """Poll a state change made by a background thread (the bound only stops a hang)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


# --------------------------------------------------------------------------- manifest=KEY
@pytest.mark.parametrize("lazy", [False, True])
def test_restore_an_older_manifest_by_key(tmp_path, lazy):
    """Two manifests kept by keep_last=2 hold different contents: the older one, named by its key,
    comes back exactly as it was at its moment (8 rollouts of A at their first advantages); the
    default comes back as the newest (4 survivors of A at their new advantages, and B).

    Mutation run: restore.py `manifest = read_manifest(store, None)` (the key ignored): the older
    restore held 12 rollouts, not 8, and failed `len(old) == 8`."""
    uri = f"file://{tmp_path}/ckpt"
    ckpt = Checkpointer(uri, interval_s=3600, keep_last=2)
    buf = tr.RolloutBuffer(12, sampler=tr.PrioritizedSampler(), seed=3, checkpoint=ckpt)
    a = make_batch(8, version=0, seed=11)
    ha = buf.add(a)
    buf.checkpoint()
    older = ckpt.last_manifest
    then = {}
    remember(then, ha, a)

    new_adv = torch.linspace(-2.0, 2.0, 8)
    assert buf.update_priorities(ha, new_adv) == 8
    b = make_batch(8, version=1, seed=12, group_base=10)
    hb = buf.add(b)  # evicts the 4 oldest rollouts of A
    buf.checkpoint()
    newer = ckpt.last_manifest
    kept = (buf.slots.generation[ha.slot] == ha.generation) & buf.slots.live[ha.slot]  # A's survivors
    assert int(kept.sum()) == 4
    now = {}
    remember(now, Handles(ha.slot[kept], ha.generation[kept]),
             {k: [a[k][j] for j in kept.nonzero().flatten().tolist()] for k in ("tokens", "logprobs")}
             | {"reward": a["reward"][kept], "advantage": new_adv[kept]})
    remember(now, hb, b)
    assert older != newer and {older, newer} == set(open_store(uri).list("manifests"))
    assert len(now) == 12 and set(now) == live_slots(buf)

    def restore(**kw):
        storage = lazy_storage(tmp_path / f"spill-{len(os.listdir(tmp_path))}") if lazy else None
        return tr.RolloutBuffer.from_checkpoint(uri, progress=False, lazy=lazy, storage=storage, **kw)

    old = restore(manifest=older)
    assert len(old) == 8 and old.version == 0
    assert live_slots(old) == set(then)
    check_rows(old.gather(torch.tensor(sorted(then)), count_use=False), then)

    new = restore()
    assert len(new) == 12 and new.version == 1
    assert live_slots(new) == set(now)
    check_rows(new.gather(torch.tensor(sorted(now)), count_use=False), now)

    # Naming the newest explicitly is the same as the default.
    same = restore(manifest=newer)
    assert live_slots(same) == set(now)
    check_rows(same.gather(torch.tensor(sorted(now)), count_use=False), now)
    for x in (buf, old, new, same):
        x.close()


# ----------------------------------------------------------------------------- lazy fetches
def three_shard_checkpoint(tmp_path, capacity=64):
    """A buffer of three 16-rollout shards (one per add), checkpointed: (uri, buffer, handles,
    origin: slot -> what was added)."""
    uri = f"file://{tmp_path}/ckpt"
    buf = tr.RolloutBuffer(capacity, sampler=tr.PrioritizedSampler(), seed=5,
                           checkpoint=Checkpointer(uri, interval_s=3600))
    handles, origin = [], {}
    for k in range(3):
        batch = make_batch(16, version=k, seed=40 + k, group_base=10 * k)
        h = buf.add(batch)
        handles.append(h)
        remember(origin, h, batch)
    buf.checkpoint()
    assert len(read_manifest(open_store(uri))["shards"]) == 3
    return uri, buf, handles, origin


def only_drawable(buf, keep: set[int], origin: dict) -> dict:
    """Zero the advantage (so the priority) of every live slot outside `keep`; returns the origin
    with those advantages, so the data check stays exact."""
    live = torch.tensor(sorted(live_slots(buf)))
    adv = torch.stack([origin[s][3] if s in keep else torch.tensor(0.0) for s in live.tolist()])
    buf.update_priorities(Handles(live, buf.slots.generation[live].clone()), adv)
    return {s: origin[s][:3] + (adv[i],) for i, s in enumerate(live.tolist())}


def test_lazy_restore_fetches_on_prefetch_and_on_compaction(tmp_path, downloads):
    """Right after a lazy restore nothing is downloaded; a sample_async whose draw needs shard 1
    downloads it on the prefetch thread before result() is called; prefetching() does the same for
    shard 2; a compaction (advance() with shard 0 at 3/16 live) downloads shard 0; every batch
    read back is the rollouts that were added.

    Mutation runs, each failed here:
    * restore.py store_chunk (today snapshot.py RemoteShardSource.store):
      `buffer.storage.ensure_local(...)` after adopt_remote (an eager fetch under lazy=True):
      fetched_shards was 3 after restore;
    * assembly.py BatchAssembler.start: `inline = True` (materialized on the caller's thread, not
      prefetched): the download ran on MainThread, not on torchreplay-prefetch;
    * tiered.py compaction_candidates: `and s.remote is None` (a not-yet-fetched shard is never
      compacted): advance() left storage_compactions at 0 and fetched_shards at 2."""
    uri, buf, handles, origin = three_shard_checkpoint(tmp_path)
    spill = tmp_path / "lazy"
    lazy = tr.RolloutBuffer.from_checkpoint(uri, lazy=True, progress=False, storage=lazy_storage(spill))
    assert lazy.metrics()["storage_fetched_shards"] == 0 and downloads == []
    assert not list(spill.glob("*.trs"))
    assert len(lazy) == 48 and live_slots(lazy) == set(origin)
    shard_slots = [set(h.slot.tolist()) for h in handles]
    shard_of = {k: int(lazy.slots.shard[h.slot[0]]) for k, h in enumerate(handles)}
    assert len(set(shard_of.values())) == 3

    # (a) sample_async: the draw can only take shard 1's rollouts; the prefetch thread downloads it.
    expect = only_drawable(lazy, shard_slots[1], origin)
    pending = lazy.sample_async(8, generator=torch.Generator().manual_seed(0))
    assert wait_for(lambda: lazy.metrics()["storage_fetched_shards"] == 1), "the prefetch fetched nothing"
    assert len(downloads) == 1
    _, thread = downloads[0]
    assert thread.startswith("torchreplay-prefetch"), thread
    out = pending.result()
    assert set(out.handles.slot.tolist()) <= shard_slots[1]
    check_rows(out, expect)
    assert lazy.metrics()["storage_fetched_shards"] == 1 and len(list(spill.glob("*.trs"))) == 1

    # prefetching(): shard 2 only; still one download per shard, on the prefetch thread.
    expect = only_drawable(lazy, shard_slots[2], origin)
    for out in lazy.prefetching(4, steps=3, generator=torch.Generator().manual_seed(1)):
        assert set(out.handles.slot.tolist()) <= shard_slots[2]
        check_rows(out, expect)
    assert lazy.metrics()["storage_fetched_shards"] == 2
    assert len(downloads) == 2 and downloads[1][1].startswith("torchreplay-prefetch"), downloads
    assert downloads[0][0] != downloads[1][0]

    # (b) compaction: 29 new rollouts evict the 13 oldest (all of shard 0), which leaves 3/16 of
    # shard 0 live, below compact_below=0.25. Adding and evicting read no tokens; advance() then
    # compacts shard 0, and only that downloads it.
    fresh = make_batch(29, version=3, seed=77, group_base=100)
    hf = lazy.add(fresh)
    h0 = handles[0]  # restored slots keep their generations; an evicted one's slot is reused
    survivors = set(h0.slot[(lazy.slots.generation[h0.slot] == h0.generation) & lazy.slots.live[h0.slot]].tolist())
    assert len(survivors) == 3 and (lazy.slots.shard[torch.tensor(sorted(survivors))] == shard_of[0]).all()
    assert lazy.metrics()["storage_fetched_shards"] == 2 and lazy.metrics()["storage_compactions"] == 0
    lazy.advance(3)
    assert lazy.metrics()["storage_compactions"] == 1
    assert lazy.metrics()["storage_fetched_shards"] == 3 and len(downloads) == 3
    assert (lazy.slots.shard[torch.tensor(sorted(survivors))] != shard_of[0]).all()  # moved to a new shard
    assert lazy.storage.live_fraction(int(lazy.slots.shard[min(survivors)])) == 1.0
    origin_now = dict(origin)
    remember(origin_now, hf, fresh)
    expect = only_drawable(lazy, live_slots(lazy), origin_now)  # every advantage as added again
    check_rows(lazy.gather(torch.tensor(sorted(survivors)), count_use=False), expect)
    check_rows(lazy.gather(torch.tensor(sorted(live_slots(lazy))), count_use=False), expect)
    assert lazy.metrics()["storage_fetched_shards"] == 3 and len(downloads) == 3
    lazy.close()
    buf.close()


# ------------------------------------------------------------------- a missing shard object
@pytest.mark.parametrize("on_corrupt", ["raise", "skip"])
def test_missing_shard_object_is_one_attempt_and_evicted(tmp_path, downloads, caplog, on_corrupt):
    """A lazily restored shard whose object is deleted from the store before its first use: the
    sample that needs it evicts its 16 rollouts (`evicted_corrupt`) after exactly one download
    attempt and no retry warning, then raises StorageError ("raise") or draws again ("skip"; here
    nothing else is drawable, so that draw is the usual ValueError); the other shards keep serving
    the rollouts that were added.

    Mutation run: store.py with_retries without `except MissingObject: raise` (a missing object
    retried like a transient error): two attempts were made for the deleted key (the second is
    stopped at once by this test's counter, so the run does not wait out the 60 s budget)."""
    uri, buf, handles, origin = three_shard_checkpoint(tmp_path)
    lazy = tr.RolloutBuffer.from_checkpoint(uri, lazy=True, progress=False, on_corrupt=on_corrupt,
                                            storage=lazy_storage(tmp_path / "lazy"))
    assert lazy.metrics()["storage_fetched_shards"] == 0
    shard_slots = [set(h.slot.tolist()) for h in handles]
    manifest = read_manifest(open_store(uri))
    by_shard = {}  # shard index k -> its object key (the manifest lists the original shard ids)
    for k, h in enumerate(handles):
        by_shard[k] = next(s["key"] for s in manifest["shards"] if s["id"] == int(buf.slots.shard[h.slot[0]]))
    gone = by_shard[1]
    os.unlink(tmp_path / "ckpt" / gone)

    # Stop a second attempt at once (a retry would otherwise back off for up to 60 s).
    real = FileStore.get_to_file
    attempts = []

    def once(self, key, path):
        attempts.append(key)
        if attempts.count(key) > 1:
            raise RuntimeError(f"{key} was retried")
        return real(self, key, path)

    FileStore.get_to_file = once
    try:
        only_drawable(lazy, shard_slots[1], origin)
        error, match = (tr.StorageError, "no longer in") if on_corrupt == "raise" else (ValueError, "cannot fill")
        with caplog.at_level(logging.WARNING, logger="torchreplay.checkpoint"), pytest.raises(error, match=match):
            lazy.sample(4, generator=torch.Generator().manual_seed(2))
    finally:
        FileStore.get_to_file = real
    assert attempts == [gone], attempts
    assert lazy.metrics()["evicted_corrupt"] == 16 and len(lazy) == 32
    assert not live_slots(lazy) & shard_slots[1]
    assert not [r for r in caplog.records if "retrying" in r.getMessage()]
    assert lazy.metrics()["storage_fetched_shards"] == 0

    # The rest of the buffer: shards 0 and 2 still download and read back exactly.
    expect = only_drawable(lazy, shard_slots[0] | shard_slots[2], origin)
    for step in range(3):
        out = lazy.sample(8, generator=torch.Generator().manual_seed(10 + step))
        assert set(out.handles.slot.tolist()) <= shard_slots[0] | shard_slots[2]
        check_rows(out, expect)
    rest = torch.tensor(sorted(shard_slots[0] | shard_slots[2]))
    check_rows(lazy.gather(rest, count_use=False), expect)
    assert lazy.metrics()["storage_fetched_shards"] == 2
    assert sorted(k for k, _ in downloads) == sorted([gone, by_shard[0], by_shard[2]]), downloads
    lazy.close()
    buf.close()
