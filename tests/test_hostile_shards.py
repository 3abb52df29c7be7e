"""Hostile shard files: a header whose lengths lie, or fields that do not match the buffer's schema,
are rejected before anything is allocated or adopted (issue #16).

Each reproduction used to pass through: a header claiming 250M rows made the reader allocate its
~2 GB offsets block (twice: the read, then the decoded copy) before n was checked against anything;
a shard with only an offsets block restored, and samples returned empty rollouts; tokens stored as
float32 restored, and every sample raised RuntimeError. Rejections are CheckpointError naming the
shard key (restore, import) or ValueError naming the shard (load_state_dict), with field and problem."""

import json
import os
import subprocess
import sys
import textwrap
import zlib

import pytest
import torch
from rollouts import make_batch
from test_hostile_checkpoints import checkpoint_dir

import torchreplay as tr
from torchreplay.storage import format as fmt

HUGE_ROWS = 250_000_000


def shard_path(root, manifest):
    return root / manifest["shards"][0]["key"]


def rewrite_shard(path, edit):
    """Replace a shard file by `edit(offsets, token, rollout)`'s blocks, with valid checksums."""
    shard = fmt.parse_shard(path.read_bytes())
    offsets, token, rollout = edit(shard.offsets.clone(), dict(shard.token), dict(shard.rollout))
    header, writes, head = fmt.plan_shard(offsets, token, rollout)
    data = bytearray(header.file_bytes)
    data[: len(head)] = head
    for offset, block in writes:
        data[offset : offset + len(block)] = block
    path.write_bytes(bytes(data))
    forge_manifest_sizes(path.parent.parent)


def forge_manifest_sizes(root):
    """Record every shard's current size and header CRC in the newest manifest, as a forger who
    controls the whole checkpoint would: the checks after the identity checks must hold on their own."""
    key = json.loads((root / "LATEST").read_text())["manifest"]
    manifest = json.loads((root / key).read_text())
    for entry in manifest["shards"]:
        entry["bytes"] = os.path.getsize(root / entry["key"])
        with open(root / entry["key"], "rb") as f:
            entry["header_crc32"] = fmt.PREAMBLE.unpack(f.read(fmt.PREAMBLE.size))[2]
    (root / key).write_text(json.dumps(manifest))


def write_header(path, meta, file_bytes):
    """A shard whose header is `meta` (checksum valid), grown sparsely to `file_bytes`."""
    text = json.dumps(meta, separators=(",", ":")).encode()
    path.write_bytes(fmt.PREAMBLE.pack(fmt.MAGIC, len(text), zlib.crc32(text)) + text)
    os.truncate(path, file_bytes)


def zero_block_crcs(nbytes, page=fmt.PAGE_SIZE):
    full, tail = divmod(nbytes, page)
    return [zlib.crc32(bytes(page))] * full + ([zlib.crc32(bytes(tail))] if tail or not full else [])


def huge_offsets_shard(path, n=HUGE_ROWS):
    """n + 1 zero offsets (every page checksum valid) and the schema's token fields, empty, in a
    sparse file: the header passes every check but the row limit before the offsets are read."""
    nbytes = 8 * (n + 1)
    crcs = zero_block_crcs(nbytes)
    offset = fmt.align_up(fmt.PREAMBLE.size + len(json.dumps(crcs)) + 4096)
    tail = fmt.align_up(offset + nbytes)
    fields = [{"name": "offsets", "kind": "offsets", "dtype": "int64", "shape": [], "offset": offset,
               "nbytes": nbytes, "page_crcs": crcs}]
    fields += [{"name": name, "kind": "token", "dtype": dtype, "shape": [], "offset": tail, "nbytes": 0,
                "page_crcs": [0]} for name, dtype in (("tokens", "int64"), ("response_mask", "bool"),
                                                       ("logprobs", "float32"))]
    write_header(path, {"format_version": 1, "n": n, "page_size": fmt.PAGE_SIZE, "file_bytes": tail + 4096,
                        "fields": fields}, tail + 4096)


CHILD = textwrap.dedent("""
    import json, sys, time
    import torchreplay as tr

    def peak_kib():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))

    mode, uri, spill = sys.argv[1:4]
    storage = tr.TieredStorage(hot_bytes=0, spill_dir=spill, io="posix") if mode == "lazy" else None
    target = tr.RolloutBuffer(16) if mode == "import" else None
    before, start = peak_kib(), time.monotonic()
    try:
        if mode == "import":
            target.import_checkpoint(uri)
        else:
            tr.RolloutBuffer.from_checkpoint(uri, progress=False, lazy=mode == "lazy", storage=storage)
        outcome = "restored"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    print(json.dumps({"outcome": outcome, "grown_mib": (peak_kib() - before) / 1024,
                      "seconds": time.monotonic() - start}))
""")


@pytest.mark.parametrize("mode", ["eager", "lazy", "import"])
def test_a_header_claiming_250m_rows_is_refused_before_allocation(tmp_path, mode):
    """In a fresh process, so its peak RSS is this rejection's alone. Mutation checked: without the
    row limit in parse_header the peak grows by gigabytes (the old reader's offsets block)."""
    root, manifest = checkpoint_dir(tmp_path)
    path = shard_path(root, manifest)
    huge_offsets_shard(path)
    forge_manifest_sizes(root)
    done = subprocess.run([sys.executable, "-c", CHILD, mode, f"file://{root}", str(tmp_path / "spill")],
                          check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["outcome"].startswith("CheckpointError"), result
    assert manifest["shards"][0]["key"] in result["outcome"] and "rows" in result["outcome"], result
    assert result["grown_mib"] < 200, result
    assert result["seconds"] < 20, result


def test_the_row_limit_holds_without_a_capacity(tmp_path):
    """A reader that knows no capacity still refuses 250M rows: the format's own limit."""
    path = tmp_path / "huge.trs"
    huge_offsets_shard(path)
    with pytest.raises(tr.StorageError, match="250000000 rows"):
        fmt.read_shard_meta(str(path))
    with pytest.raises(tr.StorageError, match="more than the 16"):
        fmt.read_shard_meta(str(path), max_rows=16)


def lying_header(case):
    """A two-row shard's header (n, page size, fields), lying as `case` says."""
    n, page = 2, fmt.PAGE_SIZE
    offsets = {"name": "offsets", "kind": "offsets", "dtype": "int64", "shape": [], "offset": 4096, "nbytes": 24}
    reward = {"name": "reward", "kind": "rollout", "dtype": "float32", "shape": [], "offset": 8192, "nbytes": 8}
    fields = [offsets, reward]
    if case == "negative nbytes":
        reward["nbytes"] = -8
    elif case == "rollout rows":
        reward["nbytes"] = 12
    elif case == "token rows":
        reward.update(kind="token", dtype="int64", shape=[3])  # 8 bytes: not one 24-byte row
    elif case == "past the end":
        reward["offset"] = 1 << 40
    elif case == "offsets dtype":
        offsets.update(dtype="float64")
    elif case == "offsets kind":
        offsets.update(kind="token")
    elif case == "zero dim":
        reward.update(shape=[0])
    elif case == "duplicate":
        fields.append(dict(reward))
    elif case == "page size":
        page = 1 << 31
    elif case == "rows over the limit":
        n = 1 << 40
    elif case == "row count a bool":  # JSON true, with blocks sized for one row: only n's type is wrong
        n = True
        offsets["nbytes"], reward["nbytes"] = 16, 4
    elif case == "offset a float":
        reward["offset"] = 8192.5
    elif case == "dim a bool":
        reward.update(kind="token", shape=[True])
    for f in fields:
        f["page_crcs"] = [0] * max(1, -(-max(f["nbytes"], 0) // page))
    return {"format_version": 1, "n": n, "page_size": page, "file_bytes": 3 * 4096, "fields": fields}


@pytest.mark.parametrize("case, match", [
    ("negative nbytes", "nbytes"),
    ("rollout rows", "rows"),
    ("token rows", "whole number of rows"),
    ("past the end", "past the file end"),
    ("offsets dtype", "offsets"),
    ("offsets kind", "offsets"),
    ("zero dim", "shape"),
    ("duplicate", "twice"),
    ("page size", "page_size"),
    ("rows over the limit", "rows"),
    ("row count a bool", "invalid n=True"),  # was read as 1 row (a bool is an int to isinstance)
    ("offset a float", "malformed"),  # was truncated to 8192
    ("dim a bool", "malformed"),  # was read as 1
])
def test_lying_block_lengths_are_storage_errors(tmp_path, case, match):
    """Refused from the header alone: the checksums are never reached (they are all wrong)."""
    path = tmp_path / "lie.trs"
    write_header(path, lying_header(case), 3 * 4096)
    with pytest.raises(tr.StorageError, match=match):
        fmt.read_shard_meta(str(path))


# ------------------------------------------------------------------ fields against the schema
def only_offsets(offsets, token, rollout):
    return offsets, {}, {}


def float_tokens(offsets, token, rollout):
    return offsets, dict(token, tokens=token["tokens"].float()), rollout


def unknown_field(offsets, token, rollout):
    return offsets, dict(token, evil=token["logprobs"].clone()), rollout


def token_field_as_rollout(offsets, token, rollout):
    logprobs = token.pop("logprobs")
    return offsets, token, dict(rollout, logprobs=logprobs.new_zeros(offsets.numel() - 1))


def wrong_row_shape(offsets, token, rollout):
    return offsets, dict(token, logprobs=token["logprobs"][:, None].expand(-1, 2).contiguous()), rollout


def empty_first_rollout(offsets, token, rollout):
    cut = int(offsets[1])
    moved = torch.cat([offsets[:1], offsets[1:] - cut])
    return moved, {k: v[cut:] for k, v in token.items()}, rollout


SCHEMA_CASES = [
    (only_offsets, "tokens", "missing"),
    (float_tokens, "tokens", "dtype"),
    (unknown_field, "evil", "unknown"),
    (token_field_as_rollout, "logprobs", "kind"),
    (wrong_row_shape, "logprobs", "shape"),
    (empty_first_rollout, "offsets", "empty|increasing"),
]
SCHEMA_IDS = [case[0].__name__ for case in SCHEMA_CASES]


def restore(uri, mode, tmp_path):
    """Eager (hot tier) or lazy (cold tier, ranged reads of each shard's header and small blocks)."""
    if mode == "lazy":
        storage = tr.TieredStorage(hot_bytes=0, spill_dir=tmp_path / "spill", io="posix")
        return tr.RolloutBuffer.from_checkpoint(uri, progress=False, lazy=True, storage=storage)
    return tr.RolloutBuffer.from_checkpoint(uri, progress=False)


def assert_names(message, *parts, problem):
    import re

    for part in parts:
        assert part in message, (part, message)
    assert re.search(problem, message), (problem, message)


@pytest.mark.parametrize("mode", ["eager", "lazy", "import", "inspect"])
@pytest.mark.parametrize("edit, field, problem", SCHEMA_CASES, ids=SCHEMA_IDS)
def test_shard_fields_are_checked_against_the_schema(tmp_path, mode, edit, field, problem, capsys):
    root, manifest = checkpoint_dir(tmp_path)
    key = manifest["shards"][0]["key"]
    rewrite_shard(root / key, edit)
    uri = f"file://{root}"
    if mode == "inspect":
        from torchreplay.cli import main as cli_main

        assert cli_main(["inspect", uri]) == 1
        assert_names(capsys.readouterr().err, key, repr(field), problem=problem)
        return
    with pytest.raises(tr.CheckpointError) as caught:
        if mode == "import":
            target = tr.RolloutBuffer(16)
            target.import_checkpoint(uri)
        else:
            restore(uri, mode, tmp_path)
    assert_names(str(caught.value), key, repr(field), problem=problem)
    if mode == "import":
        assert len(target) == 0


@pytest.mark.parametrize("mode", ["eager", "lazy", "inspect"])
def test_a_shard_whose_size_differs_from_the_manifest_is_refused_unread(tmp_path, mode, capsys):
    """Manifests record each shard's size: a grown or swapped shard is refused on its stat/HEAD,
    before a byte of it is read (here grown sparsely to 2 GiB)."""
    root, manifest = checkpoint_dir(tmp_path)
    key = manifest["shards"][0]["key"]
    os.truncate(root / key, 2 << 30)
    uri = f"file://{root}"
    if mode == "inspect":
        from torchreplay.cli import main as cli_main

        assert cli_main(["inspect", uri]) == 1
        message = capsys.readouterr().err
    else:
        with pytest.raises(tr.CheckpointError) as caught:
            restore(uri, mode, tmp_path)
        message = str(caught.value)
    assert key in message and "the manifest records" in message


def test_import_accepts_a_dtype_add_converts(tmp_path):
    """Importing converts through add(): int64 tokens go into an int32 buffer as before."""
    root, _ = checkpoint_dir(tmp_path)
    target = tr.RolloutBuffer(16, token_dtype=torch.int32)
    assert len(target.import_checkpoint(f"file://{root}")) == 6


@pytest.mark.parametrize("mode", ["eager", "lazy", "import"])
def test_a_valid_checkpoint_still_restores(tmp_path, mode):
    root, _ = checkpoint_dir(tmp_path)
    batch = make_batch(6, version=1, seed=1)
    uri = f"file://{root}"
    if mode == "import":
        buf = tr.RolloutBuffer(16)
        slots = buf.import_checkpoint(uri).slot
    else:
        buf = restore(uri, mode, tmp_path)
        slots = torch.arange(6)
    out = buf.gather(slots, count_use=False)
    for k in range(6):
        n = batch["tokens"][k].numel()
        assert torch.equal(out.tokens[k, :n], batch["tokens"][k])
    buf.close()


# ------------------------------------------------------------------ load_state_dict shards
SCORE = {"score": tr.FieldSpec("score", "rollout", torch.float32, ())}


def edited_state(edit):
    """A real state_dict (with a per-rollout extra field, which shards store), one shard edited."""
    buf = tr.RolloutBuffer(16, seed=0, extra_fields=SCORE)
    buf.add(dict(make_batch(6, version=1, seed=1), score=torch.arange(6.0)))
    state = buf.state_dict()
    (sid, shard), = state["shards"].items()
    offsets, token, rollout = edit(shard["offsets"].clone(), dict(shard["token"]), dict(shard["rollout"]))
    shards = {sid: dict(shard, offsets=offsets, token=token, rollout=rollout)}
    return dict(state, shards=shards), sid


def short_rollout_field(offsets, token, rollout):
    return offsets, token, dict(rollout, score=torch.zeros(offsets.numel() - 2))


def short_token_field(offsets, token, rollout):
    return offsets, dict(token, logprobs=token["logprobs"][:-1]), rollout


def not_a_tensor(offsets, token, rollout):
    return offsets, dict(token, logprobs=token["logprobs"].tolist()), rollout


@pytest.mark.parametrize("edit, field, problem", SCHEMA_CASES + [
    (short_rollout_field, "score", "rows"),
    (short_token_field, "logprobs", "rows"),
    (not_a_tensor, "logprobs", "tensor"),
], ids=SCHEMA_IDS + ["short_rollout_field", "short_token_field", "not_a_tensor"])
def test_load_state_dict_shards_are_checked_against_the_schema(edit, field, problem):
    state, sid = edited_state(edit)
    twin = tr.RolloutBuffer(16, seed=0, extra_fields=SCORE)
    with pytest.raises(ValueError) as caught:
        twin.load_state_dict(state)
    assert_names(str(caught.value), f"shard {sid}", repr(field), problem=problem)
    assert len(twin) == 0
    twin.add(dict(make_batch(2, seed=2), score=torch.ones(2)))  # and the buffer carries on
    assert len(twin) == 2
