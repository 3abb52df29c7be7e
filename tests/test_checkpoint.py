"""Checkpoints: file:// round trips, atomic publish, garbage collection, hostile manifests, reuse."""

import json
import os

import pytest
import torch

import torchreplay as tr
from rollouts import make_batch
from torchreplay.checkpoint import Checkpointer, read_manifest, open_store
from torchreplay.snapshot import live_shards
from torchreplay.storage import TieredStorage


def fill(buf, steps=4, n=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for v in range(steps):
        buf.compose(make_batch(n, version=v, seed=seed * 100 + v, group_base=v * 10), replay_ratio=0.5, generator=gen)
        buf.advance(v + 1)


def same_future(a, b, steps=3):
    for step in range(steps):
        x = a.compose(make_batch(6, version=10 + step, seed=900 + step), replay_ratio=0.5)
        y = b.compose(make_batch(6, version=10 + step, seed=900 + step), replay_ratio=0.5)
        assert torch.equal(x.handles.slot, y.handles.slot) and torch.equal(x.handles.generation, y.handles.generation)
        assert torch.equal(x.tokens, y.tokens) and torch.equal(x.weights, y.weights)
        assert torch.equal(x.reuse, y.reuse) and torch.equal(x.age, y.age)


@pytest.mark.parametrize("tiered", [False, True])
def test_resume_is_exact(tmp_path, tiered):
    uri = f"file://{tmp_path}/ckpt"

    def storage(name):
        return TieredStorage(hot_bytes=2000, spill_dir=tmp_path / name, io="posix") if tiered else None

    buf = tr.RolloutBuffer(40, sampler=tr.PrioritizedSampler(alpha=0.6, beta=0.4), max_staleness=3, max_reuse=3,
                           seed=7, storage=storage("a"), checkpoint=Checkpointer(uri, interval_s=3600),
                           token_dtype=torch.int32 if tiered else torch.int64)
    fill(buf)
    buf.checkpoint()
    resumed = tr.RolloutBuffer.from_checkpoint(uri, storage=storage("b"), progress=False)
    assert len(resumed) == len(buf)
    for name in ("live", "generation", "reuse", "advantage", "policy_version", "seq"):
        assert torch.equal(getattr(resumed.slots, name), getattr(buf.slots, name)), name
    assert torch.equal(resumed.sampler.tree.priorities, buf.sampler.tree.priorities)
    same_future(buf, resumed)
    buf.close()
    resumed.close()


def test_manifest_only_names_durable_objects_and_gc(tmp_path):
    """Each manifest names exactly the live shards, every one of them durable; after the last
    checkpoint the store holds exactly the shards the kept manifests name (dead ones collected).

    Checked through the store and the public slot table only (it used `checkpointer._keys`).
    Mutation checked: garbage collection that keeps stale shards (`stale_shards = []` in
    `Checkpointer._collect_garbage`) fails the final equality."""
    uri = f"file://{tmp_path}/ckpt"
    buf = tr.RolloutBuffer(24, sampler=tr.UniformSampler(), max_staleness=1,
                           checkpoint=Checkpointer(uri, interval_s=3600, keep_last=2), seed=1)
    store = open_store(uri)
    for v in range(6):
        buf.add(make_batch(8, version=v, seed=v))
        buf.advance(v)
        buf.checkpoint()
        manifest = read_manifest(store)
        for entry in manifest["shards"]:
            assert store.exists(entry["key"])
        assert manifest["rollouts"] == len(buf)
        ids, rows = live_shards(buf.slots)
        assert [(e["id"], e["live_rows"]) for e in manifest["shards"]] == list(zip(ids, rows))
    assert len(store.list("manifests")) == 2
    named = set()
    for key in store.list("manifests"):
        named |= {s["key"] for s in json.loads(store.get(key))["shards"]}
    # Right after a checkpoint every live shard is named by the newest manifest, so nothing
    # outside the kept manifests may remain: the shards of versions 0-2 are named by no kept
    # manifest and must be gone (3 of the 6 shards remain).
    assert set(store.list("shards")) == named and len(named) == 3
    assert not [p for p in os.listdir(tmp_path / "ckpt" / "shards") if "partial" in p]
    buf.close()


def test_background_publish_by_interval_and_close(tmp_path):
    uri = f"file://{tmp_path}/ckpt"
    ckpt = Checkpointer(uri, interval_s=0.05)
    buf = tr.RolloutBuffer(16, checkpoint=ckpt, seed=0)
    buf.add(make_batch(4, seed=1))
    import time

    time.sleep(0.1)
    buf.add(make_batch(4, seed=2))  # a call after the interval enqueues a manifest
    # Written unless a newer publish is queued behind it (then superseded): wait for it before close.
    deadline = time.monotonic() + 30
    while not ckpt.published and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ckpt.published, "no background manifest after the interval"
    buf.close()  # and close publishes the final one
    assert read_manifest(open_store(uri))["rollouts"] == 8
    assert len(ckpt.published) >= 2


def published_checkpoint(tmp_path):
    """A small buffer checkpointed once: (uri, buffer, store, its manifest)."""
    uri = f"file://{tmp_path}/ckpt"
    buf = tr.RolloutBuffer(16, checkpoint=Checkpointer(uri, interval_s=3600), seed=0)
    buf.add(make_batch(4, seed=1))
    buf.checkpoint()
    store = open_store(uri)
    return uri, buf, store, read_manifest(store)


def write_manifest(store, manifest):
    store.put("manifests/000000000099.json", json.dumps(manifest).encode())
    store.put("LATEST", json.dumps({"manifest": "manifests/000000000099.json"}).encode())


HOSTILE = [
    ("version", lambda m: m.update(format_version=99), "format_version"),
    ("traversal", lambda m: m["shards"][0].update(key="shards/../../etc/passwd.trs"), "key"),
    ("absolute", lambda m: m["shards"][0].update(key="/etc/passwd"), "key"),
    ("outside", lambda m: m["shards"][0].update(key="state/x.trs"), "shards/"),
    ("negative", lambda m: m.update(rollouts=-1), "rollouts"),
    ("count", lambda m: m.update(rollouts=m["rollouts"] + 5), "live rollouts"),
    ("state key", lambda m: m["state"].update(blob="../blob"), "confined"),
    ("huge", lambda m: m["state"].update(blob_bytes=1 << 60), "blob_bytes"),
    ("repeat", lambda m: m["shards"].append(dict(m["shards"][0])), "repeated"),
    ("not a list", lambda m: m.update(shards={"a": 1}), "list"),
]


@pytest.mark.parametrize("label, corrupt, match", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_manifest_is_rejected_before_anything_is_opened(tmp_path, label, corrupt, match):
    uri, buf, store, manifest = published_checkpoint(tmp_path)
    corrupt(manifest)
    write_manifest(store, manifest)
    with pytest.raises(tr.CheckpointError, match=match):
        tr.RolloutBuffer.from_checkpoint(uri, progress=False)
    buf.checkpointer.close(final=False)


def test_hostile_state_and_shard_are_rejected(tmp_path):
    uri, buf, store, manifest = published_checkpoint(tmp_path)
    blob = bytearray(store.get(manifest["state"]["blob"]))
    blob[10] ^= 0xFF
    store.put(manifest["state"]["blob"], bytes(blob))
    with pytest.raises(tr.CheckpointError, match="checksum"):
        tr.RolloutBuffer.from_checkpoint(uri, progress=False)
    buf.checkpoint()  # a fresh, good checkpoint
    manifest = read_manifest(store)
    shard_key = manifest["shards"][0]["key"]
    data = bytearray(store.get(shard_key))
    from torchreplay.storage import format as fmt

    block = fmt.parse_header(bytes(data[:65536]), len(data)).blocks["tokens"]
    data[block.offset + block.nbytes // 2] ^= 0xFF
    store.put(shard_key, bytes(data))
    with pytest.raises((tr.CheckpointError, tr.StorageError), match="checksum|truncated"):
        tr.RolloutBuffer.from_checkpoint(uri, progress=False)
    buf.checkpointer.close(final=False)


def test_cross_run_import_shifts_versions_and_reprioritizes(tmp_path):
    uri = f"file://{tmp_path}/old"
    old = tr.RolloutBuffer(32, checkpoint=Checkpointer(uri, interval_s=3600), seed=0)
    batch = make_batch(10, version=3, seed=5)
    old.add(batch)
    old.close()
    new = tr.RolloutBuffer(32, sampler=tr.UniformSampler(), seed=1)
    handles = new.import_checkpoint(uri, version_offset=-3, reprioritize=lambda b: b["advantage"] * 0 + 2.0)
    assert len(handles) == 10 and len(new) == 10
    assert bool((new.slots.policy_version[handles.slot] == 0).all())
    assert bool((new.slots.advantage[handles.slot] == 2.0).all())
    out = new.sample(10, generator=torch.Generator().manual_seed(0))
    for k, slot in enumerate(out.handles.slot.tolist()):
        src = (handles.slot == slot).nonzero()[0, 0]
        assert torch.equal(out.tokens[k, : batch["tokens"][src].numel()], batch["tokens"][src])
    assert read_manifest(open_store(uri))["rollouts"] == 10, "the source run is read-only"


def test_inspect_cli(tmp_path, capsys):
    from torchreplay.cli import main

    uri = f"file://{tmp_path}/ckpt"
    buf = tr.RolloutBuffer(16, checkpoint=Checkpointer(uri, interval_s=3600), seed=0)
    buf.add(make_batch(6, version=2, seed=1))
    buf.close()
    assert main(["inspect", uri]) == 0
    out = capsys.readouterr().out
    assert "rollouts: 6" in out and "manifests/" in out and "advantage" in out
    # `python -m torchreplay` is the same command (it used to fail: no torchreplay.__main__).
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "torchreplay", "inspect", uri], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout == out


def test_lazy_restore_then_checkpoint_elsewhere_carries_every_rollout(tmp_path):
    """A lazily restored shard that has never been sampled must still reach a new prefix whole."""
    first, second = f"file://{tmp_path}/a", f"file://{tmp_path}/b"
    buf = tr.RolloutBuffer(40, sampler=tr.PrioritizedSampler(), seed=2, checkpoint=Checkpointer(first, interval_s=3600))
    fill(buf)
    buf.checkpoint()
    lazy = tr.RolloutBuffer.from_checkpoint(first, lazy=True, progress=False, checkpoint=Checkpointer(second, interval_s=3600),
                                            storage=TieredStorage(hot_bytes=0, spill_dir=tmp_path / "lazy", io="posix"))
    lazy.checkpoint()
    assert lazy.metrics()["storage_fetched_shards"] == len(read_manifest(open_store(first))["shards"])
    again = tr.RolloutBuffer.from_checkpoint(second, progress=False)
    live = buf.slots.live.nonzero().flatten()
    a, b = buf.gather(live, count_use=False), again.gather(live, count_use=False)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs) and torch.equal(a.reward, b.reward)
    for x in (buf, lazy, again):
        x.close()


def test_restore_keeps_pad_token_id_and_sampler_settings(tmp_path):
    """pad_token_id was missing from the checkpoint config: a restored buffer padded with 0
    ([1, 2, 7, 7, 7] came back as [1, 2, 0, 0, 0]); an annealed beta came back as 0.4."""
    uri = f"file://{tmp_path}/ckpt"
    sampler = tr.PrioritizedSampler(alpha=0.5, beta=0.4, weight_norm="batch_mean")
    buf = tr.RolloutBuffer(8, sampler=sampler, pad_token_id=7, checkpoint=Checkpointer(uri, interval_s=3600))
    batch = make_batch(2, seed=3)
    batch["tokens"] = [torch.tensor([1, 2]), torch.tensor([3, 4, 5, 6, 8])]
    batch["logprobs"] = [torch.zeros(2), torch.zeros(5)]
    batch["response_mask"] = [torch.tensor([False, True]), torch.tensor([False, False, True, True, True])]
    buf.add(batch)
    sampler.beta = 0.9
    buf.checkpoint()
    resumed = tr.RolloutBuffer.from_checkpoint(uri, progress=False)
    assert resumed.pad_token_id == 7
    assert resumed.gather(torch.tensor([0, 1]), count_use=False).tokens[0].tolist() == [1, 2, 7, 7, 7]
    assert resumed.sampler.beta == 0.9 and resumed.sampler.weight_norm == "batch_mean"
    buf.close()
    resumed.close()
