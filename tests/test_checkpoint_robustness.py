"""Checkpoint defects found in review (issue #16), each a regression test: a session that could not
list the store at start must not reuse an earlier run's manifest numbers; retention never loses a
tagged manifest to a failed read; a publish is not failed by its clean-up; a closed checkpointer
refuses instead of hanging; hostile states are refused before allocation; temp files go away."""

import dataclasses
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
import torch

import torchreplay as tr
from rollouts import make_batch
from torchreplay.checkpoint import Checkpointer, open_store, read_manifest
from torchreplay.checkpoint.store import FileStore, MissingObject, PermanentError, s3_error_class
from torchreplay.errors import CheckpointError
from torchreplay.storage import TieredStorage


def run_with_tags(uri, steps=4, tagged=(1,)):
    buf = tr.RolloutBuffer(64, checkpoint=Checkpointer(uri, interval_s=3600, keep_last=2), seed=0)
    for step in range(steps):
        buf.add(make_batch(4, seed=step, version=step))
        buf.checkpoint(tag=step if step in tagged else None)
    buf.close()


def flaky_once(monkeypatch, method: str, room_or_key: str):
    """FileStore.<method> fails once for a key or room starting with `room_or_key`."""
    original = getattr(FileStore, method)
    state = {"failed": False}

    def flaky(self, arg, *rest):
        if not state["failed"] and str(arg).startswith(room_or_key):
            state["failed"] = True
            raise CheckpointError("endpoint down (simulated)")
        return original(self, arg, *rest)

    monkeypatch.setattr(FileStore, method, flaky)
    return state


def test_a_session_that_could_not_list_the_store_does_not_reuse_manifest_numbers(tmp_path, monkeypatch):
    """It used to start again at sequence 0, and GC then deleted its own newest manifest."""
    uri = f"file://{tmp_path}/ckpt"
    run_with_tags(uri)
    newest = read_manifest(open_store(uri))["sequence"]
    resumed = tr.RolloutBuffer.from_checkpoint(uri, progress=False)
    state = flaky_once(monkeypatch, "list", "manifests")
    ckpt = Checkpointer(uri, interval_s=3600, keep_last=2)
    assert state["failed"]
    resumed.attach_checkpointer(ckpt)
    resumed.add(make_batch(4, seed=9, version=5))
    resumed.checkpoint()
    assert read_manifest(open_store(uri))["sequence"] == newest + 1  # not 0, which GC then deleted
    assert len(tr.RolloutBuffer.from_checkpoint(uri, progress=False)) == 20
    assert tr.RolloutBuffer.from_checkpoint(uri, tag=1, progress=False).version == 1
    resumed.close()


def test_a_tag_that_cannot_be_read_keeps_everything_this_time(tmp_path, caplog):
    """It used to be cached as naming nothing, and the manifest it names was deleted."""
    root = tmp_path / "ckpt"
    uri = f"file://{root}"
    buf = tr.RolloutBuffer(64, checkpoint=Checkpointer(uri, interval_s=3600, keep_last=1), seed=0)
    buf.add(make_batch(4, seed=0, version=0))
    buf.checkpoint(tag=0)
    buf.close()
    # A new session reads tags afresh; while it cannot read tags/0.json (a directory stands in
    # its place: refused, like an object that cannot be fetched), nothing may be deleted.
    resumed = tr.RolloutBuffer.from_checkpoint(uri, progress=False)
    (root / "tags" / "0.json").rename(root / "tags" / "0.away")
    (root / "tags" / "0.json").mkdir()
    resumed.attach_checkpointer(Checkpointer(uri, interval_s=3600, keep_last=1))
    for step in (1, 2):
        resumed.add(make_batch(4, seed=step, version=step))
        resumed.checkpoint()
    assert any("garbage collection skipped" in r.getMessage() for r in caplog.records)
    (root / "tags" / "0.json").rmdir()
    (root / "tags" / "0.away").rename(root / "tags" / "0.json")
    assert tr.RolloutBuffer.from_checkpoint(uri, tag=0, progress=False).version == 0
    resumed.add(make_batch(4, seed=3, version=3))
    resumed.checkpoint()  # readable again: collected, and the tagged manifest still kept
    assert tr.RolloutBuffer.from_checkpoint(uri, tag=0, progress=False).version == 0
    assert len(open_store(uri).list("manifests")) == 2
    resumed.close()


def test_keep_last_counts_untagged_manifests(tmp_path):
    uri = f"file://{tmp_path}/ckpt"
    buf = tr.RolloutBuffer(64, checkpoint=Checkpointer(uri, interval_s=3600, keep_last=2), seed=0)
    for step, tag in enumerate((None, None, "a", None, "b")):
        buf.add(make_batch(2, seed=step, version=step))
        buf.checkpoint(tag=tag)
    manifests = open_store(uri).list("manifests")
    # Untagged 1 and 3 (the newest two), tagged 2 and 4; untagged 0 is gone.
    assert [int(m.split("/")[1][:12]) for m in manifests] == [1, 2, 3, 4]
    buf.close()


def test_a_failed_clean_up_does_not_fail_a_durable_publish(tmp_path, caplog):
    uri = f"file://{tmp_path}/ckpt"
    buf = tr.RolloutBuffer(64, checkpoint=Checkpointer(uri, interval_s=3600, keep_last=2), seed=0)
    buf.add(make_batch(2, seed=0))
    buf.checkpoint(tag="keep")  # this manifest stays retained by its tag
    first = buf.checkpointer.last_manifest
    buf.close()
    (tmp_path / "ckpt" / first).write_text("{}")  # corrupt, yet retained
    buf2 = tr.RolloutBuffer(64, checkpoint=Checkpointer(uri, interval_s=3600, keep_last=2), seed=1)
    buf2.add(make_batch(2, seed=1))
    buf2.checkpoint()  # durable: LATEST names it, even though GC cannot read the tagged manifest
    assert read_manifest(open_store(uri))["sequence"] == 2  # after the tagged one and close()'s
    assert buf2.metrics()["checkpoint_failures"] == 0
    assert any("garbage collection skipped" in r.getMessage() for r in caplog.records)
    buf2.close()


def test_a_closed_checkpointer_refuses_instead_of_hanging(tmp_path):
    ckpt = Checkpointer(f"file://{tmp_path}/ckpt", interval_s=3600)
    buf = tr.RolloutBuffer(16, checkpoint=ckpt, seed=0)
    buf.add(make_batch(2, seed=0))
    ckpt.close(final=False)
    ckpt.close()  # twice is fine
    start = time.monotonic()
    with pytest.raises(CheckpointError, match="closed"):
        buf.checkpoint()
    buf.add(make_batch(2, seed=1))  # a shard sealed after close is not pinned for an upload that never comes
    assert time.monotonic() - start < 5
    buf.detach_checkpointer()
    buf.close()


def test_a_shard_sealed_after_close_is_not_pinned(tmp_path):
    """No upload comes for a shard sealed after the checkpointer closed, so nothing may pin it: its
    spill file goes when its rollouts die. Mutation seen failing: Checkpointer.shard_sealed
    without its `if self._closed: return` (pinned for that upload, the file outlives them)."""
    spill = tmp_path / "spill"
    ckpt = Checkpointer(f"file://{tmp_path}/ckpt", interval_s=3600)
    buf = tr.RolloutBuffer(4, checkpoint=ckpt, storage=TieredStorage(hot_bytes=0, spill_dir=spill, io="posix"), seed=0)
    buf.add(make_batch(2, seed=0))
    ckpt.close(final=False)
    buf.storage.flush()
    before_close = set(os.listdir(spill))
    buf.add(make_batch(2, seed=1))  # sealed after close
    buf.storage.flush()
    sealed_after = set(os.listdir(spill)) - before_close
    assert len(sealed_after) == 1
    deleted = buf.metrics()["storage_deleted_shards"]
    buf.add(make_batch(4, seed=2))  # capacity 4: every earlier rollout dies, and both shards with them
    assert buf.metrics()["storage_deleted_shards"] == deleted + 2
    assert not sealed_after & set(os.listdir(spill))
    buf.detach_checkpointer()
    buf.close()


@pytest.mark.parametrize("code, status, expected", [
    ("RequestTimeout", 400, CheckpointError), ("BadDigest", 400, CheckpointError),
    ("SlowDown", 503, CheckpointError), ("InternalError", 500, CheckpointError),
    ("NoSuchBucket", 404, PermanentError), ("InvalidAccessKeyId", 403, PermanentError),
    ("AccessDenied", 403, PermanentError), ("403", 403, PermanentError), ("NoSuchKey", 404, MissingObject),
])
def test_s3_errors_are_classified_by_code(code, status, expected):
    assert s3_error_class(code, status) is expected


def forge_state(root, edit):
    """Rewrite the newest state object through `edit(state) -> state`, keeping the manifest
    consistent (the forger controls every file)."""
    from torchreplay.checkpoint import tensorfile
    from torchreplay.checkpoint.restore import load_state

    store = open_store(f"file://{root}")
    manifest = read_manifest(store)
    text, blob = tensorfile.pack(edit(load_state(store, manifest)))
    (root / manifest["state"]["json"]).write_bytes(text)
    (root / manifest["state"]["blob"]).write_bytes(blob)
    manifest["state"].update(json_bytes=len(text), blob_bytes=len(blob))
    (root / json.loads((root / "LATEST").read_text())["manifest"]).write_text(json.dumps(manifest))


def small_checkpoint(tmp_path):
    uri = f"file://{tmp_path}/ckpt"
    buf = tr.RolloutBuffer(16, checkpoint=Checkpointer(uri, interval_s=3600), seed=0)
    buf.add(make_batch(3, seed=0))
    buf.close()
    return tmp_path / "ckpt", uri


# Restores in a fresh process, so that its peak RSS (VmHWM, reset per checkpoint through
# /proc/self/clear_refs) and bytes read (/proc/self/io rchar, every thread's reads) are the
# refusal's own: an exception alone cannot tell "refused before allocating / reading" from "read
# or allocated it all, then refused". One child serves every checkpoint of this module (a child
# spends seconds importing torch).
REFUSAL_CHILD = textwrap.dedent("""
    import json, sys, time
    import torchreplay as tr

    def proc(path, key):
        with open(path) as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key))

    target = tr.RolloutBuffer(16)
    report = {}
    for uri in sys.argv[1:]:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # peak RSS := current RSS
        start_peak_kib, results = proc("/proc/self/status", "VmHWM:"), []
        for mode in ("from_checkpoint", "import_checkpoint"):
            read_before, start = proc("/proc/self/io", "rchar:"), time.monotonic()
            try:
                if mode == "import_checkpoint":
                    target.import_checkpoint(uri)
                else:
                    tr.RolloutBuffer.from_checkpoint(uri, progress=False)
                outcome = "restored"
            except Exception as exc:
                outcome = f"{type(exc).__name__}: {exc}"
            results.append({"mode": mode, "outcome": outcome, "seconds": time.monotonic() - start,
                            "read_mib": (proc("/proc/self/io", "rchar:") - read_before) / 2**20})
        grown_mib = (proc("/proc/self/status", "VmHWM:") - start_peak_kib) / 1024
        report[uri] = {"grown_mib": grown_mib, "results": results}
    print(json.dumps(report))
""")


def forged_capacity(root, capacity: int) -> None:
    forge_state(root, lambda state: {**state, "config": {**state["config"], "capacity": capacity}})


def forged_blob_size(root, nbytes: int) -> None:
    """The state blob grown (sparse) to `nbytes`, and the manifest agreeing with it."""
    manifest = read_manifest(open_store(f"file://{root}"))
    os.truncate(root / manifest["state"]["blob"], nbytes)
    manifest["state"]["blob_bytes"] = nbytes
    (root / json.loads((root / "LATEST").read_text())["manifest"]).write_text(json.dumps(manifest))


FORGERIES = {"capacity 2**24": lambda root: forged_capacity(root, 1 << 24),
             "capacity 2**40": lambda root: forged_capacity(root, 1 << 40),
             "3 GiB blob": lambda root: forged_blob_size(root, 3 << 30)}


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    """Per forgery, both restore paths' outcomes, bytes read and time, and the peak RSS growth."""
    uris = {}
    for name, forge in FORGERIES.items():
        root, uris[name] = small_checkpoint(tmp_path_factory.mktemp("forged"))
        forge(root)
    done = subprocess.run([sys.executable, "-c", REFUSAL_CHILD, *uris.values()], check=False,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    return {name: report[uri] for name, uri in uris.items()}


def assert_refused_cheaply(report: dict, match: str) -> None:
    """Both restore paths refused with a CheckpointError matching `match`, having read under
    32 MiB (the checkpoint's own objects are KiBs) and grown the peak RSS by under 200 MiB, fast."""
    for result in report["results"]:
        assert result["outcome"].startswith("CheckpointError") and re.search(match, result["outcome"]), result
        assert result["read_mib"] < 32, result
        assert result["seconds"] < 20, result
    assert report["grown_mib"] < 200, report


@pytest.mark.parametrize("forgery", ["capacity 2**24", "capacity 2**40"])
def test_a_claimed_capacity_the_table_does_not_carry_is_refused_before_allocation(refusals, forgery):
    """Peak RSS measured in a fresh process. Mutation seen failing: BufferSnapshot.from_state
    building a SlotTable of the claimed capacity before checking the table's tensors (the peak
    grows by ~1.8 GiB at 2**24 slots; at 2**40 the allocation itself fails)."""
    assert_refused_cheaply(refusals[forgery], "slots")


def test_a_state_blob_larger_than_its_capacity_needs_is_refused_unread(refusals):
    """Bytes read and peak RSS measured in a fresh process. Mutation seen failing: load_state
    reading the blob (`store.get(state_info["blob"])`) before its size check against the capacity:
    3 GiB read and held, then the same CheckpointError."""
    assert_refused_cheaply(refusals["3 GiB blob"], "16-slot buffer")


@pytest.mark.parametrize("edit, match", [
    (lambda t: {**t, "shard": t["shard"][:3]}, "shard"),
    (lambda t: {**t, "reuse": torch.where(t["live"], -5, t["reuse"])}, "negative reuse"),
    (lambda t: {**t, "advantage": torch.where(t["live"], float("nan"), t["advantage"])}, "non-finite"),
    (lambda t: {**t, "policy_version": torch.where(t["live"], 99, t["policy_version"])}, "policy_version"),
])
def test_a_malformed_slot_table_is_a_clear_error_everywhere(tmp_path, edit, match):
    root, uri = small_checkpoint(tmp_path)
    forge_state(root, lambda state: {**state, "table": edit(dict(state["table"]))})
    with pytest.raises(CheckpointError, match=match):
        tr.RolloutBuffer.from_checkpoint(uri, progress=False)
    with pytest.raises(CheckpointError, match=match):
        tr.RolloutBuffer(16).import_checkpoint(uri)
    buf = tr.RolloutBuffer(16, seed=0)
    buf.add(make_batch(3, seed=0))
    state = buf.state_dict()
    state["table"] = edit(dict(state["table"]))
    with pytest.raises(ValueError, match=match):
        buf.load_state_dict(state)
    assert len(buf) == 3


def test_restores_leave_no_temp_files(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    os.makedirs(tmp_path / "tmp")
    _, uri = small_checkpoint(tmp_path)
    tr.RolloutBuffer.from_checkpoint(uri, progress=False).close()
    tr.RolloutBuffer(16).import_checkpoint(uri)
    manifest = read_manifest(open_store(uri))
    os.unlink(tmp_path / "ckpt" / manifest["shards"][0]["key"])  # a vanished shard fails the download
    with pytest.raises(CheckpointError):
        tr.RolloutBuffer.from_checkpoint(uri, progress=False)
    assert glob.glob(str(tmp_path / "tmp" / "torchreplay-restore-*")) == []


def test_pad_token_id_must_fit_the_token_dtype():
    with pytest.raises(ValueError, match="pad_token_id"):
        tr.RolloutBuffer(4, token_dtype=torch.int32, pad_token_id=1 << 40)


def test_buffer_config_is_immutable_and_hashable():
    """docs/api.md: BufferConfig is a frozen dataclass whose fingerprint is equal exactly when two
    configurations are. So configs built apart from equal arguments (and one rebuilt from JSON)
    are equal, hash equal and act as one dict key; a config differing in any one argument is
    unequal and has another fingerprint. Mutations seen failing: `__hash__` by identity
    (`hash(id(self))`), and `to_json` leaving out `max_reuse` (a config rebuilt from it differs)."""
    def build(**overrides):
        kwargs = dict(capacity=8, max_staleness=2, max_reuse=3,
                      extra_fields={"x": tr.FieldSpec("x", "rollout", torch.float32)})
        return tr.RolloutBuffer(**{**kwargs, **overrides}).config()

    base = build()
    twin, rebuilt = build(), type(base).from_json(base.to_json())
    for same in (twin, rebuilt):
        assert same is not base and same == base and hash(same) == hash(base)
        assert same.fingerprint() == base.fingerprint()
    assert len({base: 1, twin: 2, rebuilt: 3}) == 1
    variants = [build(capacity=9), build(max_staleness=None), build(max_reuse=4), build(overflow="raise"),
                build(padding_side="left"), build(pad_token_id=7), build(ref_logprobs=True), build(on_corrupt="skip"),
                build(token_dtype=torch.int32), build(sampler=tr.UniformSampler()),
                build(extra_fields={"x": tr.FieldSpec("x", "rollout", torch.float64)}),
                build(extra_fields={"y": tr.FieldSpec("y", "rollout", torch.float32)})]
    for other in variants:
        assert other != base and other.fingerprint() != base.fingerprint(), other
    assert len({c.fingerprint() for c in variants}) == len(variants)
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.capacity = 9
    with pytest.raises(TypeError):
        base.extra_fields["y"] = None
