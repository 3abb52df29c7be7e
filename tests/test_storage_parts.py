"""The seams between storage's parts and the rest (issue 27 item 1): the C++ reader's rows checked
against the extension at import, the frozen shard view other modules get, the export of a shard's
bytes and the pinned gather batch assembly uses."""

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

import torchreplay as tr
from torchreplay._ops import extension_file
from rollouts import make_batch
from torchreplay.storage import ShardView, TieredStorage
from torchreplay.storage import reader_abi
from torchreplay.storage.reader_abi import ReaderLayoutError, check_layout, reported_layout


def test_the_python_rows_match_the_extensions_structs():
    """What the loaded extension reports is exactly what reader_abi declares."""
    reported = reader_abi.parse_layout(reported_layout())
    assert reported["Segment"] == list(reader_abi.Segment._fields)
    assert reported["Row"] == list(reader_abi.RowRange._fields)
    assert reported["Status"] == list(reader_abi.ReadStatus._fields)
    assert reported["Code"] == ["ok:0", "checksum:1", "short_read:2", "open_failed:3", "read_failed:4"]
    assert reported["PageState"] == ["unread:0", "ok:1", "bad:2"]
    check_layout(reported_layout())


@pytest.mark.parametrize("change", ["swap two segment fields", "drop a status field", "renumber a code"])
def test_a_mismatched_layout_is_refused_with_a_clear_error(change):
    """Mutation checked: check_layout comparing only the number of fields (`len(...) != len(...)`)
    lets the swap and the renumbering through."""
    real = reported_layout()
    bad = {
        "swap two segment fields": real.replace("block_offset,block_bytes", "block_bytes,block_offset"),
        "drop a status field": real.replace("Status=code,detail,bytes,reads", "Status=code,detail,bytes"),
        "renumber a code": real.replace("short_read:2", "short_read:5"),
    }[change]
    assert bad != real
    with pytest.raises(ReaderLayoutError, match="csrc/shard_reader.h.*disagree") as info:
        check_layout(bad)
    assert isinstance(info.value, ImportError) and "rebuild" in str(info.value)
    kind = {"swap two segment fields": "Segment", "drop a status field": "Status", "renumber a code": "Code"}[change]
    assert f"{kind}: C++ has" in str(info.value)


def test_importing_storage_against_a_mismatched_extension_fails():
    """The check runs at import: storage does not load against an extension whose reader lays out
    its segments otherwise. Mutation checked: removing the module-level
    `check_layout(reported_layout())` from reader_abi.py lets the import succeed."""
    # The extension is loaded and its op replaced before torchreplay is first imported.
    code = (
        "import sys, torch\n"
        "torch.ops.load_library(sys.argv[1])\n"
        "real = torch.ops.torchreplay.shard_reader_layout()\n"
        "torch.ops.torchreplay.shard_reader_layout = lambda: real.replace('row_begin,row_end', 'row_end,row_begin')\n"
        "import torchreplay\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}

    def child(source: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", source, str(extension_file())], capture_output=True, text=True,
                              env=env, timeout=120)

    control = child(code.replace("'row_end,row_begin'", "'row_begin,row_end'"))  # the same steps, layout intact
    assert control.returncode == 0, control.stderr
    done = child(code)
    assert done.returncode != 0
    assert "ReaderLayoutError" in done.stderr and "Segment: C++ has" in done.stderr


def test_a_shard_view_is_frozen_and_a_snapshot(tmp_path):
    storage = TieredStorage(hot_bytes=None, spill_dir=tmp_path, io="posix")
    sid = storage.put(tr.schema.PackedBatch(n=2, offsets=torch.tensor([0, 3, 5]),
                                            token={"tokens": torch.arange(5)}, rollout={"reward": torch.ones(2)}))
    view = storage.shard(sid)
    assert isinstance(view, ShardView)
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.path = "/elsewhere"
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.live_rows = 0
    storage.flush()
    written = storage.shard(sid)
    assert written.header is not None and written.file_bytes == written.header.file_bytes == os.path.getsize(written.path)
    assert written.n == 2 and written.live_rows == 2 and written.token_fields == ("tokens",) and written.hot
    assert storage.release(sid, 1) is False
    assert written.live_rows == 2 and storage.shard(sid).live_rows == 1  # the old view does not follow
    storage.close()


def test_export_gives_the_file_or_the_hot_copy(tmp_path):
    """Storage hands a shard's bytes out through export_shard: the complete file with its header
    when spilled, the hot copy when there is no file; a pinned shard stays exportable after it
    died, until unpinned."""
    batch = make_batch(4, seed=3)
    for spill in (tmp_path / "spill", None):
        buf = tr.RolloutBuffer(16, sampler=tr.UniformSampler(), max_staleness=0, seed=0,
                               storage=TieredStorage(hot_bytes=0 if spill else None, spill_dir=spill, io="posix"))
        buf.add(batch)
        storage = buf.storage
        sid = int(buf.slots.shard[buf.slots.live][0])
        storage.pin_shards([sid])
        buf.advance(1)  # every rollout goes stale: the shard dies while pinned
        with pytest.raises(KeyError):
            storage.shard(sid)
        export = storage.export_shard(sid)
        if spill is not None:
            assert export.batch is None and os.path.exists(export.path)
            assert export.header.file_bytes == os.path.getsize(export.path)
            whole = tr.storage.format.parse_shard(open(export.path, "rb").read())
            assert torch.equal(whole.token["tokens"].to(torch.int64), export_tokens(batch))
        else:
            assert export.path is None and export.header is None
            assert torch.equal(export.batch.token["tokens"].to(torch.int64), export_tokens(batch))
        storage.unpin_shards([sid])
        with pytest.raises(KeyError):
            storage.export_shard(sid)
        if spill is not None:
            assert not os.path.exists(export.path)
        buf.close()


def export_tokens(batch) -> torch.Tensor:
    return torch.cat(batch["tokens"])


def test_a_gather_maps_every_row_and_unpins_on_exit(tmp_path):
    """One gather over hot and cold shards: each row's tokens sit at starts/lengths of its
    source; the with-block's exit unpins (once), and a shard that died meanwhile goes then."""
    storage = TieredStorage(hot_bytes=0, spill_dir=tmp_path, io="posix")
    offsets = [torch.tensor([0, 2, 5]), torch.tensor([0, 4, 5, 9])]
    ids = [storage.put(tr.schema.PackedBatch(n=o.numel() - 1, offsets=o, token={"tokens": torch.arange(int(o[-1])) + 100 * k},
                                             rollout={})) for k, o in enumerate(offsets)]
    storage.flush()  # spilled and dropped: both cold
    shard_of, rows = torch.tensor([ids[1], ids[0], ids[1]]), torch.tensor([2, 1, 0])
    pinned = storage.pinned(ids)
    assert storage.release(ids[0], 2)  # dies while pinned
    path = tmp_path / f"shard-{ids[0]:010d}.trs"
    assert path.exists()
    with pinned:
        got = storage.gather(pinned, shard_of, rows, ["tokens"])
    for k, (sid, r) in enumerate(zip(shard_of.tolist(), rows.tolist())):
        k_shard = ids.index(sid)
        lo, hi = int(offsets[k_shard][r]), int(offsets[k_shard][r + 1])
        src = got.sources[int(got.source[k])]
        a, n = int(got.starts[k]), int(got.lengths[k])
        assert torch.equal(src.token["tokens"][a : a + n], torch.arange(lo, hi) + 100 * k_shard)
    assert not path.exists()
    pinned.release()  # a second release unpins nothing more
    storage.pin_shards([ids[1]])
    storage.unpin_shards([ids[1]])
    storage.close()
