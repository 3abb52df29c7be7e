"""Hostile checkpoints: deeply nested JSON and oversized objects are clear CheckpointError /
StorageError, raised before anything large is read (persistence issue, item 5, first part).

Each case used to raise RecursionError with a traceback, or read gigabytes before a size check.
Mutation checked: `boundedjson.loads` without its RecursionError clause fails every nesting case;
`read_manifest` without its size checks reads the sparse 3 GiB file (caught by the RSS bound)."""

import json
import os
import resource

import pytest

import torchreplay as tr
from rollouts import make_batch
from torchreplay.checkpoint import Checkpointer, open_store, read_manifest
from torchreplay.cli import main as cli_main
from torchreplay.storage import format as fmt

NESTED = b"[" * 100_000


def checkpoint_dir(tmp_path):
    root = tmp_path / "ckpt"
    buf = tr.RolloutBuffer(16, checkpoint=Checkpointer(f"file://{root}", interval_s=3600), seed=0)
    buf.add(make_batch(6, version=1, seed=1))
    buf.close()
    manifest = read_manifest(open_store(f"file://{root}"))
    return root, manifest


def restore_fails(root, error, match):
    uri = f"file://{root}"
    with pytest.raises(error, match=match):
        tr.RolloutBuffer.from_checkpoint(uri, progress=False)
    with pytest.raises(error, match=match):
        storage = tr.TieredStorage(hot_bytes=0, spill_dir=root.parent / "spill", io="posix")
        tr.RolloutBuffer.from_checkpoint(uri, progress=False, lazy=True, storage=storage)
    assert cli_main(["inspect", uri]) != 0


@pytest.mark.parametrize("target", ["LATEST", "manifest", "state"])
def test_deeply_nested_json_is_a_checkpoint_error(tmp_path, target):
    root, manifest = checkpoint_dir(tmp_path)
    path = {"LATEST": root / "LATEST", "manifest": root / json.loads((root / "LATEST").read_text())["manifest"],
            "state": root / manifest["state"]["json"]}[target]
    nested = NESTED if target != "LATEST" else b"[" * 3000  # LATEST must stay under its 4 KiB bound
    path.write_bytes(nested)
    if target == "state":  # keep the recorded size, so the parser is what meets it
        manifest_path = root / json.loads((root / "LATEST").read_text())["manifest"]
        doc = json.loads(manifest_path.read_text())
        doc["state"]["json_bytes"] = len(NESTED)
        manifest_path.write_text(json.dumps(doc))
    restore_fails(root, tr.CheckpointError, "nested too deeply")


def test_deeply_nested_shard_header_is_a_storage_error(tmp_path):
    """A header with a valid checksum whose JSON nests 100k deep."""
    import struct
    import zlib

    path = tmp_path / "bad.trs"
    head = fmt.PREAMBLE.pack(fmt.MAGIC, len(NESTED), zlib.crc32(NESTED)) + NESTED
    path.write_bytes(head + b"\0" * 4096)
    with pytest.raises(tr.StorageError, match="nested too deeply"):
        fmt.read_shard_meta(str(path))
    assert struct  # the preamble is packed with the format's own struct layout


@pytest.mark.parametrize("target", ["LATEST", "manifest", "state blob"])
def test_oversized_objects_are_refused_unread(tmp_path, target):
    """Grown sparsely to 3 GiB: refused by their size (stat), without reading them."""
    root, manifest = checkpoint_dir(tmp_path)
    path = {"LATEST": root / "LATEST", "manifest": root / json.loads((root / "LATEST").read_text())["manifest"],
            "state blob": root / manifest["state"]["blob"]}[target]
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    os.truncate(path, 3 << 30)
    with pytest.raises(tr.CheckpointError, match="bytes"):
        tr.RolloutBuffer.from_checkpoint(f"file://{root}", progress=False)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    assert grown_mib < 200, f"peak RSS grew by {grown_mib:.0f} MiB"


@pytest.mark.parametrize("target", ["LATEST", "manifest", "state", "shard"])
def test_symlinks_out_of_the_root_are_refused(tmp_path, target):
    """An object replaced by a symlink to a file outside the checkpoint root used to restore (and
    `inspect` exited 0). Mutation checked: opening without O_NOFOLLOW restores from the outside file."""
    root, manifest = checkpoint_dir(tmp_path)
    latest = json.loads((root / "LATEST").read_text())["manifest"]
    path = {"LATEST": root / "LATEST", "manifest": root / latest, "state": root / manifest["state"]["json"],
            "shard": root / manifest["shards"][0]["key"]}[target]
    outside = tmp_path / "outside"
    outside.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(outside)
    restore_fails(root, tr.CheckpointError, "symlink")


def test_a_fifo_is_an_error_not_a_hang(tmp_path):
    """A shard replaced by a FIFO hung the restore forever (no writer ever comes)."""
    import threading

    root, manifest = checkpoint_dir(tmp_path)
    path = root / manifest["shards"][0]["key"]
    path.unlink()
    os.mkfifo(path)
    outcome = []

    def attempt():
        try:
            tr.RolloutBuffer.from_checkpoint(f"file://{root}", progress=False)
        except tr.CheckpointError as exc:
            outcome.append(str(exc))

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(60)  # a hang, not slowness, is what this bounds: the error comes in milliseconds
    assert outcome and "not a regular file" in outcome[0]
