"""Hostile documents at the largest size the reader accepts: rejected within seconds, growing RSS by
less than 200 MiB (issue #16, item 4). Each rejection runs in a fresh process, so its peak RSS
(VmHWM) is its own."""

import json
import os
import subprocess
import sys
import zlib

import pytest
from test_hostile_checkpoints import checkpoint_dir
from test_hostile_shards import CHILD

from torchreplay import boundedjson
from torchreplay.storage import format as fmt

def reject(tmp_path, root, mode="eager"):
    done = subprocess.run([sys.executable, "-c", CHILD, mode, f"file://{root}", str(tmp_path / "spill")],
                          check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["outcome"].startswith(("CheckpointError", "StorageError")), result
    assert result["grown_mib"] < 200, result
    assert result["seconds"] < 20, result
    return result["outcome"]


def flat_list(nbytes: int) -> bytes:
    """A valid JSON document of `nbytes`: the most Python objects per byte a parser can be made to build."""
    count = (nbytes - 2) // 2
    return b"[" + b"0," * (count - 1) + b"0]"


def test_a_manifest_at_the_size_limit_is_rejected_in_bounded_memory(tmp_path):
    root, _ = checkpoint_dir(tmp_path)
    key = json.loads((root / "LATEST").read_text())["manifest"]
    (root / key).write_bytes(flat_list(boundedjson.MAX_DOCUMENT_BYTES))
    assert "must be a JSON object" in reject(tmp_path, root)


def test_a_manifest_past_the_size_limit_is_refused_unread(tmp_path):
    root, _ = checkpoint_dir(tmp_path)
    key = json.loads((root / "LATEST").read_text())["manifest"]
    with open(root / key, "ab") as f:
        f.truncate(boundedjson.MAX_DOCUMENT_BYTES + 1)
    assert "refusing to read it" in reject(tmp_path, root)


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_a_shard_header_at_the_size_limit_is_rejected_in_bounded_memory(tmp_path, mode):
    root, manifest = checkpoint_dir(tmp_path)
    entry = manifest["shards"][0]
    crcs = json.dumps([0] * ((fmt.MAX_HEADER_BYTES - 400) // 2)).replace(" ", "").encode()
    text = (b'{"format_version":1,"n":1,"page_size":65536,"file_bytes":%d,"fields":[{"name":"offsets",'
            b'"kind":"offsets","dtype":"int64","shape":[],"offset":0,"nbytes":16,"page_crcs":' % (32 << 20))
    text += crcs[: fmt.MAX_HEADER_BYTES - len(text) - 3].rsplit(b",", 1)[0] + b"]}]}"
    path = root / entry["key"]
    path.write_bytes(fmt.PREAMBLE.pack(fmt.MAGIC, len(text), zlib.crc32(text)) + text)
    os.truncate(path, 32 << 20)
    key = json.loads((root / "LATEST").read_text())["manifest"]
    m = json.loads((root / key).read_text())
    m["shards"][0]["bytes"] = 32 << 20  # the forger keeps the manifest consistent
    (root / key).write_text(json.dumps(m))
    assert entry["key"] in reject(tmp_path, root, mode)
