"""A checkpoint written in state format 2 (tests/fixtures/state_v2, committed; README.md there says
how it was made) restores with exactly the contents recorded when it was written: eager, lazy, by
tag and by import_checkpoint. A format-3 checkpoint round-trips; a format this code does not know
is refused with a CheckpointError naming it.

Mutations seen failing: `current_state` returning an old state unrenamed (every v2 restore, the
import, the v3 round trip from v2 and the format-2 state_dict); only its "chunks" -> "shards"
rename dropped (the format-2 state_dict); `persistence.restore` not setting the snapshot's
generator state (eager, lazy and round trip: the next sample differs)."""

import json
import math
import pathlib
import shutil

import pytest
import torch

import torchreplay as tr
from rollouts import make_batch
from torchreplay.errors import CheckpointError
from torchreplay.schema import ROLLOUT
from torchreplay.storage import TieredStorage

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "state_v2"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())
EXTRA = {"difficulty": tr.FieldSpec("difficulty", ROLLOUT, torch.int64, (2,), required=False, accept="int")}


@pytest.fixture
def uri(tmp_path):
    """A copy of the fixture checkpoint (nothing a test does reaches the committed files)."""
    shutil.copytree(FIXTURE / "ckpt", tmp_path / "ckpt")
    return f"file://{tmp_path / 'ckpt'}"


def as_tensor(values, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype)


def same(actual: torch.Tensor, recorded, what: str) -> None:
    assert torch.equal(actual, as_tensor(recorded, actual)), what


def check_metrics(buf) -> None:
    metrics = buf.metrics()
    for name, recorded in EXPECTED["metrics"].items():
        if recorded == "nan":
            assert math.isnan(metrics[name]), name
        else:
            assert metrics[name] == recorded, name


def check_batch(batch, rows: list[int], with_age: bool = True) -> None:
    """`batch` holds the recorded gather's rows `rows` (indices into the live slots), in order."""
    assert set(batch.data) == set(EXPECTED["gather"])
    index = torch.tensor(rows)
    for name, recorded in EXPECTED["gather"].items():
        same(batch.data[name], as_tensor(recorded, batch.data[name])[index].tolist(), name)
    same(batch.reuse, as_tensor(EXPECTED["gather_reuse"], batch.reuse)[index].tolist(), "reuse")
    if with_age:
        same(batch.age, as_tensor(EXPECTED["gather_age"], batch.age)[index].tolist(), "age")


def check_contents(buf) -> None:
    """Everything expected.json records of the buffer at its publish, then its next draw."""
    assert len(buf) == EXPECTED["len"] == 22 and buf.version == EXPECTED["version"] == 2
    assert buf.config().to_json() == EXPECTED["config"]
    check_metrics(buf)
    slots = buf.slots
    for name, recorded in EXPECTED["table"].items():
        same(getattr(slots, name), recorded, name)
    assert list(slots.free) == EXPECTED["free"] and slots.next_seq == EXPECTED["next_seq"]
    live = slots.live.nonzero().flatten()
    assert live.tolist() == EXPECTED["live_slots"]
    # Shard ids are renamed on restore; which live slots share a shard is not.
    shard_of = slots.shard
    groups = sorted(live[shard_of[live] == s].tolist() for s in shard_of[live].unique().tolist())
    assert groups == sorted(EXPECTED["same_shard_groups"]) and len(groups) == 2
    check_batch(buf.gather(live, count_use=False), list(range(live.numel())))
    nxt = buf.sample(8)
    recorded = EXPECTED["next_sample"]
    same(nxt.handles.slot, recorded["slots"], "next sample's slots")
    same(nxt.handles.generation, recorded["generations"], "next sample's generations")
    same(nxt.weights, recorded["weights"], "next sample's weights")
    same(nxt.data["tokens"], recorded["tokens"], "next sample's tokens")


def test_the_v2_fixture_is_format_2_with_the_old_slot_table_key():
    """Guards the fixture itself: rewritten in the new format, the tests below would test nothing."""
    text = json.loads((FIXTURE / "ckpt" / "state" / "000000000000.json").read_text())
    assert text["tree"]["format_version"] == 2
    assert "chunk" in text["tree"]["table"] and "shard" not in text["tree"]["table"]


@pytest.mark.parametrize("tag", [None, "fixture"])
def test_a_v2_checkpoint_restores_eagerly_with_its_recorded_contents(uri, tag):
    buf = tr.RolloutBuffer.from_checkpoint(uri, tag=tag, progress=False)
    try:
        check_contents(buf)
    finally:
        buf.close()


def test_a_v2_checkpoint_restores_lazily_with_its_recorded_contents(uri, tmp_path):
    buf = tr.RolloutBuffer.from_checkpoint(uri, lazy=True, progress=False,
                                           storage=TieredStorage(spill_dir=tmp_path / "spill", io="posix"))
    try:
        assert buf.metrics()["storage_fetched_shards"] == 0  # nothing downloaded before a read
        check_contents(buf)
    finally:
        buf.close()


def test_a_v2_checkpoint_imports_its_live_rollouts(uri):
    buf = tr.RolloutBuffer(32, sampler=tr.PrioritizedSampler(alpha=0.6, beta=0.4), max_reuse=3, extra_fields=EXTRA)
    try:
        buf.advance(EXPECTED["version"])  # the source's version: ages compare equal
        handles = buf.import_checkpoint(uri, keep_reuse=True, progress=False)
        assert len(buf) == len(handles) == EXPECTED["len"]
        position = {slot: i for i, slot in enumerate(EXPECTED["live_slots"])}
        check_batch(buf.gather(handles.slot, count_use=False), [position[s] for s in EXPECTED["import_order"]])
    finally:
        buf.close()


def test_a_v3_checkpoint_round_trips(uri, tmp_path):
    """Restored from v2 and checkpointed again, the state is written as format 3 (the slot table's
    shard column named `shard`) and restores with the same contents."""
    again = f"file://{tmp_path / 'again'}"
    buf = tr.RolloutBuffer.from_checkpoint(uri, progress=False)
    buf.attach_checkpointer(tr.Checkpointer(again, interval_s=3600))
    buf.checkpoint()
    buf.detach_checkpointer().close(final=False)
    buf.close()
    (state_json,) = (tmp_path / "again" / "state").glob("*.json")
    tree = json.loads(state_json.read_text())["tree"]
    assert tree["format_version"] == 3 and "shard" in tree["table"] and "chunk" not in tree["table"]
    resumed = tr.RolloutBuffer.from_checkpoint(again, progress=False)
    try:
        check_contents(resumed)
    finally:
        resumed.close()


def test_state_dict_of_format_2_loads():
    """An in-memory state_dict of format 2 (slot-table column `chunk`, payloads under `chunks`)
    loads as one of format 3 does."""
    src = tr.RolloutBuffer.from_checkpoint(f"file://{FIXTURE / 'ckpt'}", progress=False)
    state = src.state_dict()
    src.close()
    assert state["format_version"] == 3
    table = dict(state["table"])
    table["chunk"] = table.pop("shard")
    old = {**{k: v for k, v in state.items() if k != "shards"}, "format_version": 2, "table": table,
           "chunks": state["shards"]}
    buf = tr.RolloutBuffer(32, sampler=tr.PrioritizedSampler(alpha=0.6, beta=0.4), max_reuse=3, extra_fields=EXTRA)
    try:
        buf.load_state_dict(old)
        check_contents(buf)
    finally:
        buf.close()


@pytest.mark.parametrize("how", ["restore", "lazy", "import"])
def test_an_unknown_state_format_is_refused_naming_it(uri, tmp_path, how):
    """Format 4 (same byte length as the 2 it replaces, so the manifest's sizes still hold)."""
    path = pathlib.Path(uri[len("file://"):]) / "state" / "000000000000.json"
    text = path.read_text()
    assert text.count('"format_version":2') == 1
    path.write_text(text.replace('"format_version":2', '"format_version":4'))
    with pytest.raises(CheckpointError, match="format_version 4"):
        if how == "import":
            tr.RolloutBuffer(32, extra_fields=EXTRA).import_checkpoint(uri, progress=False)
        else:
            storage = TieredStorage(spill_dir=tmp_path / "spill", io="posix") if how == "lazy" else None
            tr.RolloutBuffer.from_checkpoint(uri, lazy=how == "lazy", storage=storage, progress=False)


def test_an_unknown_state_dict_format_is_refused_naming_it():
    src = tr.RolloutBuffer(32, extra_fields=EXTRA)
    src.add(make_batch(3, seed=0))
    state = dict(src.state_dict(), format_version=4)
    buf = tr.RolloutBuffer(32, extra_fields=EXTRA)
    with pytest.raises(ValueError, match="format_version 4"):
        buf.load_state_dict(state)
    assert len(buf) == 0


def test_slots_chunk_still_reads_the_shard_column_with_a_deprecation_warning():
    buf = tr.RolloutBuffer(8)
    buf.add(make_batch(3, seed=0))
    with pytest.warns(DeprecationWarning, match="slots.shard"):
        old = buf.slots.chunk
    assert torch.equal(old, buf.slots.shard) and int(buf.slots.shard[0]) >= 0
