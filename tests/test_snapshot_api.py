"""The typed, public snapshot (issue #16, item 1): BufferConfig as the single source of a buffer's
configuration (to_json / from_json / fingerprint), snapshot() / from_snapshot(), the sampler
registry, and the one way to attach a checkpointer."""

import json

import pytest
import torch

import torchreplay as tr
from rollouts import make_batch
from torchreplay.samplers import register_sampler, registered_samplers
from torchreplay.schema import ROLLOUT, TOKEN
from torchreplay.snapshot import BufferConfig, BufferSnapshot, PackedShardSource, ShardInfo

EXTRA = {"value_est": tr.FieldSpec("value_est", TOKEN, torch.float32),
         "difficulty": tr.FieldSpec("difficulty", ROLLOUT, torch.int64, (2,), required=False, accept="int")}


def full_config() -> BufferConfig:
    return BufferConfig(capacity=32, max_staleness=4, max_reuse=3, overflow="raise", padding_side="left",
                        pad_token_id=7, ref_logprobs=True, routing=(8, 2, 2), extra_fields=EXTRA, on_corrupt="skip",
                        token_dtype=torch.int32, sampler={"type": "PrioritizedSampler", "config": {"alpha": 0.6}})


def test_buffer_config_round_trips_through_json_text():
    config = full_config()
    text = json.dumps(config.to_json())
    again = BufferConfig.from_json(json.loads(text))
    assert again == config and again.fields() == config.fields()
    assert again.fingerprint() == config.fingerprint()


@pytest.mark.parametrize("change", [{"capacity": 33}, {"max_reuse": 2}, {"pad_token_id": 0}, {"padding_side": "right"},
                                    {"token_dtype": torch.int64}, {"extra_fields": None},
                                    {"sampler": {"type": "PrioritizedSampler", "config": {"alpha": 0.7}}}])
def test_fingerprint_changes_with_every_setting(change):
    import dataclasses

    assert dataclasses.replace(full_config(), **change).fingerprint() != full_config().fingerprint()


@pytest.mark.parametrize("bad, match", [
    ({"capacity": 0}, "capacity"),
    ({"capacity": 4, "token_dtype": "float32"}, "token_dtype"),
    ({"capacity": 4, "colour": "red"}, "unknown keys"),
    ({"capacity": 4, "extra_fields": {"x": {"kind": "token", "dtype": "complex64"}}}, "extra field 'x'"),
    ({"capacity": 4, "extra_fields": {"x": {"kind": "token", "dtype": "float32", "shape": [0]}}}, "shape"),
    ({"capacity": 4, "extra_fields": ["x"]}, "without their specs"),
    ({"capacity": 4, "routing": "8,2,2"}, "routing"),
])
def test_from_json_names_the_bad_key(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        BufferConfig.from_json(bad)


def test_buffer_config_records_current_caps_and_sampler():
    buf = tr.RolloutBuffer(16, sampler=tr.PrioritizedSampler(alpha=0.5, weight_norm="batch_mean"), max_reuse=4)
    buf.max_reuse = 2
    config = buf.config()
    assert config.max_reuse == 2
    assert config.sampler == {"type": "PrioritizedSampler",
                              "config": {"alpha": 0.5, "eps": 1e-3, "weight_norm": "batch_mean",
                                         "keep_zero_advantage": False}}


def test_settings_and_config_agree_after_a_cap_setter():
    """`buf.settings` and `buf.config()` are one configuration: a cap setter changes both, and a
    refused value changes neither (issue 27). Mutation seen failing: the setters changing only the
    ledger's cap (settings kept the constructor's caps)."""
    buf = tr.RolloutBuffer(16, max_staleness=5, max_reuse=4, seed=0)
    buf.add(make_batch(3, seed=0))
    buf.max_reuse = 2
    buf.max_staleness = None
    assert buf.settings == buf.config()
    assert (buf.settings.max_reuse, buf.settings.max_staleness) == (2, None)
    assert (buf.max_reuse, buf.max_staleness) == (2, None)
    for name, bad in (("max_reuse", 0), ("max_staleness", -1), ("max_reuse", True)):
        with pytest.raises((ValueError, TypeError), match=name):
            setattr(buf, name, bad)
    assert buf.settings == buf.config() and (buf.max_reuse, buf.max_staleness) == (2, None)
    with pytest.raises(AttributeError):
        buf.settings = buf.config().with_caps(1, 1)  # read-only: the setters are the way to change a cap


def test_snapshot_and_from_snapshot_round_trip_exactly():
    buf = tr.RolloutBuffer(32, sampler=tr.PrioritizedSampler(alpha=0.7), max_reuse=5, seed=4, pad_token_id=9)
    for step in range(3):
        buf.add(make_batch(5, seed=step, version=step))
        buf.sample(4)
    snap = buf.snapshot()
    assert isinstance(snap, BufferSnapshot) and sum(s.live_rows for s in snap.shards) == len(buf) == 15
    assert all(isinstance(s, ShardInfo) for s in snap.shards)
    sources = {s.id: PackedShardSource(buf.storage.read_shard(s.id)) for s in snap.shards}
    again = tr.RolloutBuffer.from_snapshot(snap, sources)
    assert again.config() == buf.config() and again.pad_token_id == 9
    for name in ("live", "generation", "reuse", "advantage", "policy_version"):
        assert torch.equal(getattr(again.slots, name), getattr(buf.slots, name)), name
    a, b = buf.sample(8), again.sample(8)  # the generator came back too
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.weights, b.weights)


def test_a_state_is_validated_once_into_typed_parts(monkeypatch):
    """A state is read once (issue 27): `BufferSnapshot.from_state` parses the config, the ledger
    and the slot table into typed values, and adopting them validates the table no second time.
    Mutations seen failing: `persistence.restore` re-parsing the table (`TableState.parse` counted
    twice per load); `BufferSnapshot` accepting a config whose capacity is not its table's."""
    import dataclasses

    from torchreplay.ledger import LedgerState
    from torchreplay.slots import TableState

    buf = tr.RolloutBuffer(16, seed=0, max_reuse=3)
    buf.add(make_batch(5, seed=0))
    buf.sample(4)
    state = buf.state_dict()
    snap = BufferSnapshot.from_state(state)
    assert isinstance(snap.config, BufferConfig) and isinstance(snap.ledger, LedgerState)
    assert isinstance(snap.ledger.table, TableState) and snap.ledger.table.count == 5
    assert snap.shards == buf.snapshot().shards and snap.config == buf.config()
    parses = []
    real_parse = TableState.parse.__func__
    monkeypatch.setattr(TableState, "parse", classmethod(lambda cls, *a: parses.append(1) or real_parse(cls, *a)))
    twin = tr.RolloutBuffer(16, seed=1, max_reuse=3)
    twin.load_state_dict(state)
    assert len(parses) == 1 and twin.state_dict()["table"]["reuse"].sum() == state["table"]["reuse"].sum()
    with pytest.raises(ValueError, match="slot table has 16 slots"):
        dataclasses.replace(snap, config=dataclasses.replace(snap.config, capacity=32))
    bad = dict(state, table=dict(state["table"], reuse=state["table"]["reuse"][:8]))
    with pytest.raises(ValueError, match="table\\['reuse'\\]"):
        BufferSnapshot.from_state(bad)


def test_from_snapshot_refuses_a_missing_shard_before_building_state():
    buf = tr.RolloutBuffer(16, seed=0)
    buf.add(make_batch(3, seed=0))
    with pytest.raises(ValueError, match="no source"):
        tr.RolloutBuffer.from_snapshot(buf.snapshot(), {})


def test_a_checkpoint_with_extra_fields_restores_without_passing_them(tmp_path):
    """The specs are in the checkpoint's config now (they used to be names only, and a restore
    without extra_fields= failed)."""
    uri = f"file://{tmp_path}/ckpt"
    buf = tr.RolloutBuffer(16, extra_fields=EXTRA, seed=0, checkpoint=tr.Checkpointer(uri, interval_s=3600))
    batch = make_batch(3, seed=0)
    batch["value_est"] = [torch.rand(t.numel()) for t in batch["tokens"]]
    batch["difficulty"] = torch.tensor([[1, 2], [3, 4], [5, 6]])
    buf.add(batch)
    buf.checkpoint()
    resumed = tr.RolloutBuffer.from_checkpoint(uri, progress=False)
    assert resumed.fields == buf.fields
    got = resumed.gather(torch.arange(3), count_use=False)
    assert torch.equal(got.difficulty, batch["difficulty"])
    resumed.close()
    buf.close()


class HalfUniform(tr.UniformSampler):
    def __init__(self, label: str = "x") -> None:
        super().__init__()
        self.label = label

    def config(self):
        return {"label": self.label}


def test_a_registered_custom_sampler_restores_by_itself(tmp_path):
    uri = f"file://{tmp_path}/ckpt"
    buf = tr.RolloutBuffer(16, sampler=HalfUniform("mine"), seed=0, checkpoint=tr.Checkpointer(uri, interval_s=3600))
    buf.add(make_batch(3, seed=0))
    buf.checkpoint()
    with pytest.raises(tr.CheckpointError, match="not registered"):
        tr.RolloutBuffer.from_checkpoint(uri, progress=False)
    register_sampler(HalfUniform)
    assert registered_samplers()["HalfUniform"] is HalfUniform
    resumed = tr.RolloutBuffer.from_checkpoint(uri, progress=False)
    assert isinstance(resumed.sampler, HalfUniform) and resumed.sampler.label == "mine"
    resumed.close()
    buf.close()


def test_one_way_to_attach_a_checkpointer(tmp_path):
    buf = tr.RolloutBuffer(16, seed=0)
    buf.add(make_batch(3, seed=0))
    ckpt = tr.Checkpointer(f"file://{tmp_path}/ckpt", interval_s=3600)
    buf.attach_checkpointer(ckpt)  # the shard added before is announced and uploaded
    with pytest.raises(ValueError, match="already has a checkpointer"):
        buf.attach_checkpointer(ckpt)
    with pytest.raises(AttributeError):
        buf.checkpointer = None  # read-only: attach_checkpointer / detach_checkpointer
    buf.checkpoint()
    assert len(tr.RolloutBuffer.from_checkpoint(f"file://{tmp_path}/ckpt", progress=False)) == 3
    assert buf.detach_checkpointer() is ckpt
    ckpt.close(final=False)
    with pytest.raises(TypeError, match="Checkpointer"):
        tr.RolloutBuffer(4, checkpoint="file:///tmp/x")
    buf.close()
