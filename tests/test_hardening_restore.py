"""Restores that adopted what they should have refused, or broke the buffer after (issue 24,
items 3-5): integers past their documented range, a shard key pointed at another shard's object,
and a lazily restored shard whose object vanished."""

import json

import pytest
import torch

import torchreplay as tr
from rollouts import make_batch
from torchreplay.checkpoint import Checkpointer, open_store, read_manifest
from torchreplay.checkpoint import tensorfile
from torchreplay.checkpoint.restore import load_state
from torchreplay.checkpoint.store import FileStore
from torchreplay.errors import CheckpointError

BIG = 10**30


def write_checkpoint(tmp_path, sampler=None, adds=1, rows=6):
    uri = f"file://{tmp_path}/ckpt"
    buf = tr.RolloutBuffer(16, sampler=sampler, checkpoint=Checkpointer(uri, interval_s=3600), seed=0,
                           max_staleness=8, max_reuse=4)
    for i in range(adds):
        buf.add(make_batch(rows, version=1, seed=i, min_len=5, max_len=5))
    buf.sample(4)
    buf.close()
    return tmp_path / "ckpt", uri


def manifest_path(root):
    return root / json.loads((root / "LATEST").read_text())["manifest"]


def forge_state(root, edit):
    """Rewrite the newest state object through `edit(state)` (in place), keeping the manifest
    consistent: the forger controls every file, so only the restore's own checks stand."""
    store = open_store(f"file://{root}")
    manifest = read_manifest(store)
    state = load_state(store, manifest)
    edit(state)
    text, blob = tensorfile.pack(state)
    (root / manifest["state"]["json"]).write_bytes(text)
    (root / manifest["state"]["blob"]).write_bytes(blob)
    manifest["state"].update(json_bytes=len(text), blob_bytes=len(blob))
    manifest_path(root).write_text(json.dumps(manifest))


def set_path(path, value):
    def edit(state):
        *parents, last = path
        node = state
        for key in parents:
            node = node[key]
        node[last] = value
    return edit


def set_table(name, value, live_only=True):
    def edit(state):
        table = state["table"]
        where = table["live"] if live_only else torch.ones_like(table["live"])
        table[name] = torch.where(where, torch.tensor(value, dtype=table[name].dtype), table[name])
    return edit


# (what is forged, the edit, the field the error must name)
OUT_OF_RANGE = [
    ("version 2**63", set_path(["version"], 2**63), "version"),
    ("version 2**62 (past the documented 2**62 - 1)", set_path(["version"], 2**62), "version"),
    ("next_seq 10**30", set_path(["next_seq"], BIG), "next_seq"),
    ("next_seq 2**63 - 1 (fits int64, overflows the next add)", set_path(["next_seq"], 2**63 - 1), "next_seq"),
    ("max_reuse 10**30", set_path(["config", "max_reuse"], BIG), "max_reuse"),
    ("max_staleness 10**30", set_path(["config", "max_staleness"], BIG), "max_staleness"),
    ("capacity 2**63", set_path(["config", "capacity"], 2**63), "capacity"),
    ("a counter 10**30", set_path(["counters", "added"], BIG), "added"),
    ("a negative counter", set_path(["counters", "evicted_reuse"], -1), "evicted_reuse"),
    ("a counter that is nan", set_path(["counters", "sample_calls"], float("nan")), "sample_calls"),
    ("last_ess 10**400", set_path(["last_ess"], 10**400), "last_ess"),
    ("the sampler's version 2**63", set_path(["sampler", "version"], 2**63), "version"),
    ("generation 2**63 - 1 (wraps at the next insert)", set_table("generation", 2**63 - 1, live_only=False),
     "generation"),
    ("reuse 2**63 - 1", set_table("reuse", 2**63 - 1), "reuse"),
]


@pytest.mark.parametrize("what, edit, field", OUT_OF_RANGE, ids=[case[0] for case in OUT_OF_RANGE])
def test_integers_out_of_range_are_refused_before_adoption(tmp_path, what, edit, field):
    """Each used to restore (`version = 2**63` gave ages of -2**63; `next_seq`/`max_reuse` at
    10**30 made the next add or sample raise OverflowError), or to escape as OverflowError.

    Mutations run: `check_int64` left out of `BufferSnapshot.from_state` (the capacity case is then
    refused only as a slot-count mismatch that does not name the field); SlotTable's per-slot
    column ranges left out (the generation and reuse cases restore)."""
    root, uri = write_checkpoint(tmp_path)
    forge_state(root, edit)
    with pytest.raises(CheckpointError, match=field):
        tr.RolloutBuffer.from_checkpoint(uri, progress=False)
    storage = tr.TieredStorage(hot_bytes=0, spill_dir=tmp_path / "spill", io="posix")
    with pytest.raises(CheckpointError, match=field):
        tr.RolloutBuffer.from_checkpoint(uri, progress=False, lazy=True, storage=storage)


def test_state_dict_integers_out_of_range_are_a_value_error_naming_the_field():
    buf = tr.RolloutBuffer(16, seed=0, max_reuse=4)
    buf.add(make_batch(6, version=1))
    before = buf.state_dict()
    for path, value in ((["version"], 2**63), (["next_seq"], BIG), (["config", "max_reuse"], BIG),
                        (["counters", "added"], BIG)):
        state = buf.state_dict()
        set_path(path, value)(state)
        with pytest.raises(ValueError, match=path[-1]):
            buf.load_state_dict(state)
    after = buf.state_dict()
    assert after["version"] == before["version"] and after["next_seq"] == before["next_seq"]
    assert len(buf) == 6 and len(buf.sample(4)) == 4


@pytest.mark.parametrize("t_ref", [2**63, 2**62])
def test_freshness_sampler_reference_version_is_bounded(tmp_path, t_ref):
    root, uri = write_checkpoint(tmp_path, sampler=tr.FreshnessSampler(tau=4.0))
    forge_state(root, set_path(["sampler", "t_ref"], t_ref))
    with pytest.raises(CheckpointError, match="t_ref"):
        tr.RolloutBuffer.from_checkpoint(uri, progress=False)


def test_integers_at_the_top_of_their_range_still_restore(tmp_path):
    """The bounds are not off by one: the largest documented values restore and keep working."""
    root, uri = write_checkpoint(tmp_path)
    top = 2**62 - 1

    def edit(state):
        state["version"] = top
        state["next_seq"] = 2**62 - 8  # room for the 6-row add below
        state["config"]["max_reuse"] = 2**62
        state["config"]["max_staleness"] = 2**62
        state["counters"]["added"] = 2**62
        table = state["table"]
        table["policy_version"] = torch.where(table["live"], torch.tensor(top - 3), table["policy_version"])
    forge_state(root, edit)
    buf = tr.RolloutBuffer.from_checkpoint(uri, progress=False)
    assert buf.version == top and buf.max_reuse == 2**62
    assert buf.sample(4).age.tolist() == [3, 3, 3, 3]
    buf.add(make_batch(2, version=top, seed=5))
    assert len(buf) == 8
    buf.close()


def test_a_sampler_config_int_past_int64_is_the_samplers_to_judge(tmp_path):
    """The int64 bound covers the buffer's own state; a sampler's config is its constructor's to
    validate, so a buffer that a live constructor accepted restores (GroupSampler takes any
    per_group >= 1)."""
    uri = f"file://{tmp_path}/ckpt"
    buf = tr.RolloutBuffer(16, sampler=tr.GroupSampler(per_group=2**64), checkpoint=Checkpointer(uri), seed=0)
    buf.add(make_batch(6, version=1))
    buf.close()
    restored = tr.RolloutBuffer.from_checkpoint(uri, progress=False)
    assert restored.sampler.per_group == 2**64 and len(restored.sample(4)) == 4
    restored.close()


def test_caps_beyond_the_documented_range_are_refused_at_construction():
    for name in ("max_reuse", "max_staleness"):
        with pytest.raises(ValueError, match=name):
            tr.RolloutBuffer(4, **{name: 2**62 + 1})
        tr.RolloutBuffer(4, **{name: 2**62}).close()


# ------------------------------------------------------------------- item 4: a swapped shard object
def two_shard_checkpoint(tmp_path):
    """Two shards of the same size and layout (~400 KiB each: far more than the 64 KiB first read
    of a header), different tokens: (root, uri, manifest, tokens of each shard's rows by manifest
    position)."""
    uri = f"file://{tmp_path}/ckpt"
    buf = tr.RolloutBuffer(16, checkpoint=Checkpointer(uri, interval_s=3600), seed=0)
    tokens = []
    for k in range(2):
        batch = make_batch(6, version=1, seed=10 + k, min_len=5000, max_len=5000)
        buf.add(batch)
        tokens.append(torch.stack(batch["tokens"]))
    buf.close()
    root = tmp_path / "ckpt"
    manifest = read_manifest(open_store(uri))
    sizes = [(root / s["key"]).stat().st_size for s in manifest["shards"]]
    assert len(manifest["shards"]) == 2 and sizes[0] == sizes[1] > 5 * 64 * 1024
    return root, uri, manifest, tokens


def swap_first_key(root, manifest):
    forged = json.loads(json.dumps(manifest))
    forged["shards"][0]["key"] = forged["shards"][1]["key"]
    manifest_path(root).write_text(json.dumps(forged))
    return forged["shards"][1]["key"]


@pytest.fixture
def reads(monkeypatch):
    """Bytes read from each object of a file:// store, by ranged reads and whole downloads."""
    counted: dict[str, int] = {}
    real_range, real_download = FileStore.get_range, FileStore.get_to_file

    def get_range(self, key, start, length):
        data = real_range(self, key, start, length)
        counted[key] = counted.get(key, 0) + len(data)
        return data

    def get_to_file(self, key, path):
        real_download(self, key, path)
        counted[key] = counted.get(key, 0) + (self.size(key))

    monkeypatch.setattr(FileStore, "get_range", get_range)
    monkeypatch.setattr(FileStore, "get_to_file", get_to_file)
    return counted


@pytest.mark.parametrize("how", ["eager", "lazy", "import", "inspect"])
def test_a_swapped_shard_object_is_refused_unread(tmp_path, reads, how):
    """`shards[0].key` pointed at the other shard's object (same size): refused before adoption,
    having read no more of the object than the first ranged read of its header (64 KiB) for that
    entry, and the header and small blocks for the entry that rightly names it. It used to
    restore, and `gather` returned the other shard's tokens.

    Mutation run: the recorded CRC checked only on the downloaded file (eager restore), not on the
    first ranged read: the object was downloaded whole (the bound on bytes read failed)."""
    from torchreplay.cli import main as cli_main

    root, uri, manifest, _ = two_shard_checkpoint(tmp_path)
    assert all("header_crc32" in s for s in manifest["shards"])
    swapped = swap_first_key(root, manifest)
    reads.clear()
    if how == "inspect":
        assert cli_main(["inspect", uri]) != 0
    else:
        with pytest.raises(CheckpointError, match="header CRC"):
            if how == "eager":
                tr.RolloutBuffer.from_checkpoint(uri, progress=False)
            elif how == "lazy":
                storage = tr.TieredStorage(hot_bytes=0, spill_dir=tmp_path / "spill", io="posix")
                tr.RolloutBuffer.from_checkpoint(uri, progress=False, lazy=True, storage=storage)
            else:
                tr.RolloutBuffer(16).import_checkpoint(uri)
    # Two 64 KiB first reads and the other entry's small blocks; the object is 5x that.
    assert reads.get(swapped, 0) <= 3 * 64 * 1024


def test_a_manifest_without_header_crcs_still_restores(tmp_path):
    """Manifests written before `header_crc32` was recorded are read as before (sizes checked)."""
    root, uri, manifest, tokens = two_shard_checkpoint(tmp_path)
    for s in manifest["shards"]:
        del s["header_crc32"]
    manifest_path(root).write_text(json.dumps(manifest))
    buf = tr.RolloutBuffer.from_checkpoint(uri, progress=False)
    got = buf.gather(torch.arange(12), count_use=False).tokens
    assert torch.equal(got, torch.cat(tokens))
    buf.close()


def test_a_resumed_job_records_carried_shards_identity(tmp_path):
    """Shards carried over from the run a job resumed (not uploaded by this session) get their
    size and header CRC in the resumed job's manifests too, so a swap is refused there as well.

    Mutations run: `Checkpointer.attach` not recording the carried shards' identity, and hot-only
    `TieredStorage.adopt` not keeping the adopted shard's header: each fails the comparison."""
    root, uri, manifest, _ = two_shard_checkpoint(tmp_path)
    for tiered in (False, True):
        storage = tr.TieredStorage(hot_bytes=0, spill_dir=tmp_path / f"spill{tiered}", io="posix") if tiered else None
        resumed = tr.RolloutBuffer.from_checkpoint(uri, progress=False, checkpoint=True, storage=storage)
        resumed.checkpoint()
        resumed.close()
        again = read_manifest(open_store(uri))
        assert again["sequence"] > manifest["sequence"]
        assert [(s["key"], s["bytes"], s["header_crc32"]) for s in again["shards"]] == \
            [(s["key"], s["bytes"], s["header_crc32"]) for s in manifest["shards"]]
    swap_first_key(root, again)
    with pytest.raises(CheckpointError, match="header CRC"):
        tr.RolloutBuffer.from_checkpoint(uri, progress=False)


# ----------------------------------------------------- item 5: a lazily restored shard that vanished
def lazy_buffer_missing_a_shard(tmp_path, on_corrupt, replace_with_other=False):
    """128 rollouts in 8 shards, restored lazily with every token cold; then one shard's object is
    deleted (or overwritten by another shard's object of the same size). Returns (buffer, the
    slots whose shard is gone, tokens by slot)."""
    uri = f"file://{tmp_path}/ckpt"
    buf = tr.RolloutBuffer(128, checkpoint=Checkpointer(uri, interval_s=3600), seed=0)
    tokens = {}
    for k in range(8):
        batch = make_batch(16, version=1, seed=20 + k, min_len=5, max_len=5)
        handles = buf.add(batch)
        tokens.update(zip(handles.slot.tolist(), batch["tokens"]))
    shard_of = buf.slots.shard.clone()
    buf.close()
    root = tmp_path / "ckpt"
    manifest = read_manifest(open_store(uri))
    first, other = manifest["shards"][0], manifest["shards"][1]
    gone_slots = set((shard_of == first["id"]).nonzero().flatten().tolist())
    storage = tr.TieredStorage(hot_bytes=0, spill_dir=tmp_path / "spill", io="posix")
    lazy = tr.RolloutBuffer.from_checkpoint(uri, lazy=True, storage=storage, progress=False, on_corrupt=on_corrupt)
    if replace_with_other:  # after the restore read its header: only the download can tell
        (root / first["key"]).write_bytes((root / other["key"]).read_bytes())
    else:
        (root / first["key"]).unlink()
    return lazy, gone_slots, tokens


@pytest.mark.parametrize("replace_with_other", [False, True], ids=["deleted", "overwritten"])
@pytest.mark.parametrize("on_corrupt", ["skip", "raise"])
def test_a_vanished_lazy_shard_is_evicted_once_and_later_samples_work(tmp_path, on_corrupt, replace_with_other):
    """The issue's repro: 20 x sample(16) after one shard object of a lazy restore is deleted.
    It used to raise `StorageError: cannot fetch restored shard` on all 20 calls, with `len` 128
    and `evicted_corrupt` 0. Now its 16 rollouts are evicted and counted at the first sample that
    needs them: "skip" draws again (no call fails), "raise" raises from that call only. An object
    overwritten by another shard's (same size) is the same loss: its rows are never returned.

    Mutations run: the restore's `fetch` not turning MissingObject into MissingShard (the deleted
    cases fail as before); `ensure_local` without the header-CRC comparison (the overwritten cases
    fail: the other shard's tokens came back for the lost slots)."""
    lazy, gone_slots, tokens = lazy_buffer_missing_a_shard(tmp_path, on_corrupt, replace_with_other)
    generator = torch.Generator().manual_seed(0)
    failures = 0
    for _ in range(20):
        try:
            out = lazy.sample(16, generator=generator)
        except tr.StorageError as exc:
            failures += 1
            assert "evicted" in str(exc)
            continue
        for i, slot in enumerate(out.handles.slot.tolist()):
            assert slot not in gone_slots
            assert torch.equal(out.tokens[i, :5], tokens[slot])
    metrics = lazy.metrics()
    assert failures == (1 if on_corrupt == "raise" else 0)
    assert metrics["evicted_corrupt"] == 16 and len(lazy) == 112
    assert metrics["storage_fetched_shards"] == 7
    lazy.close()


@pytest.mark.parametrize("offset", [2**63 - 1, BIG, -(2**62) - 1])
def test_import_version_offset_that_would_wrap_is_refused(tmp_path, offset):
    """`version_offset=2**63 - 1` used to wrap the imported versions to negative, clamped to 0: the
    rollouts came in at version 0 instead of being refused (10**30 raised OverflowError)."""
    _, uri = write_checkpoint(tmp_path)
    buf = tr.RolloutBuffer(16)
    with pytest.raises(ValueError, match="version_offset"):
        buf.import_checkpoint(uri, version_offset=offset)
    assert len(buf) == 0
    assert len(buf.import_checkpoint(uri, version_offset=-(2**62)).slot) == 6  # clamped at 0, as documented
