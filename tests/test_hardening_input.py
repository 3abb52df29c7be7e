"""Input hardening (issue 24, items 1, 2 and 8): what `add` accepts comes back exactly, what it
cannot store exactly is refused naming the field, and bad arguments are ValueError/TypeError (or
CheckpointError for checkpoint files) naming what is wrong, raised before anything changes.

Each test failed on the code before the fix: values were wrapped (40000 -> -25536 in an int16
field, 2**63 + 5 -> -2**63 + 5 in int64 tokens), rounded to -inf (float64 -1e300 logprobs), or the
call raised RuntimeError/NotImplementedError/TypeError from inside torch, the C++ op or the
checkpoint parsers.
"""

import json
import math
import time
import zlib

import pytest
import torch

import torchreplay as tr
from rollouts import make_batch
from test_hostile_checkpoints import checkpoint_dir
from test_checkpoint_robustness import forge_state
from torchreplay.storage import format as fmt

AUX16 = {"aux": tr.FieldSpec("aux", "token", torch.int16, accept="int")}


def observable(buf):
    """What a refused call must leave as it was: size, version, every metric, the RNG."""
    return len(buf), buf.version, buf.metrics(), buf.generator.get_state()


def assert_unchanged(before, buf):
    length, version, metrics, rng = before
    now_length, now_version, now_metrics, now_rng = observable(buf)
    assert (now_length, now_version) == (length, version)
    assert torch.equal(now_rng, rng)
    assert metrics.keys() == now_metrics.keys()
    for key, value in metrics.items():
        same = value == now_metrics[key] or (math.isnan(value) and math.isnan(now_metrics[key]))
        assert same, (key, value, now_metrics[key])


def refused(buf, batch, *names):
    """`buf.add(batch)` raises SchemaError naming every one of `names`, changing nothing; a twin
    that never saw the call is the reference."""
    before = observable(buf)
    with pytest.raises(tr.SchemaError) as caught:
        buf.add(batch)
    for name in names:
        assert name in str(caught.value), (name, str(caught.value))
    assert_unchanged(before, buf)
    return str(caught.value)


def used_buffer(**kwargs):
    """A buffer with something in it, so that a refused call has state to leave alone."""
    buf = tr.RolloutBuffer(16, seed=0, **kwargs)
    first = make_batch(4, seed=9)
    for name, spec in buf.fields.items():
        if name not in first and spec.required:
            first[name] = fill_like(spec, first, 1)
    buf.add(first)
    return buf


def fill_like(spec, batch, value, dtype=None):
    dtype = dtype if dtype is not None else spec.dtype
    if spec.kind == "token":
        return [torch.full((t.numel(), *spec.shape), value, dtype=dtype) for t in batch["tokens"]]
    return torch.full((len(batch["tokens"]), *spec.shape), value, dtype=dtype)


# ---------------------------------------------------------------------------- item 1: integers
def test_the_issue_repro_int16_extra_field_is_refused_not_wrapped():
    buf = used_buffer(extra_fields=AUX16)
    batch = make_batch(3, seed=1)
    batch["aux"] = [torch.full((t.numel(),), 40000) for t in batch["tokens"]]
    message = refused(buf, batch, "'aux'", "int16")
    assert "40000" in message and "rollout 0" in message


def test_the_issue_repro_uint64_token_id_is_refused_not_wrapped():
    buf = used_buffer()
    batch = make_batch(3, seed=1)
    batch["tokens"] = [t.to(torch.uint64) for t in batch["tokens"]]
    batch["tokens"][2][1:2] = torch.tensor([2**63 + 5], dtype=torch.uint64)
    message = refused(buf, batch, "'tokens'", "rollout 2")
    assert str(2**63 + 5) in message


def int_cases():
    """(buffer kwargs, field, stored dtype, input dtype, a value past the stored range)."""
    aux8 = {"aux": tr.FieldSpec("aux", "token", torch.uint8, accept="int")}
    aux32 = {"aux": tr.FieldSpec("aux", "token", torch.int32, accept="int")}
    kind8 = {"kind": tr.FieldSpec("kind", "rollout", torch.int8, accept="int")}
    pair16 = {"pair": tr.FieldSpec("pair", "rollout", torch.int16, shape=(2,), accept="int")}
    return [
        ({}, "tokens", torch.int64, torch.uint64, 2**64 - 1),
        ({"token_dtype": torch.int32}, "tokens", torch.int32, torch.int64, 2**31),
        ({"token_dtype": torch.int32}, "tokens", torch.int32, torch.uint32, 2**31),
        ({"extra_fields": AUX16}, "aux", torch.int16, torch.int64, -32769),
        ({"extra_fields": AUX16}, "aux", torch.int16, torch.uint16, 2**15),
        ({"extra_fields": aux8}, "aux", torch.uint8, torch.int64, -1),
        ({"extra_fields": aux8}, "aux", torch.uint8, torch.int16, 256),
        ({"extra_fields": aux32}, "aux", torch.int32, torch.uint32, 2**32 - 1),
        ({"extra_fields": kind8}, "kind", torch.int8, torch.int64, 128),
        ({"extra_fields": pair16}, "pair", torch.int16, torch.int32, 2**20),
        ({"routing": (8, 2, 2)}, "routing", torch.uint8, torch.int64, 300),
        ({"routing": (300, 2, 2)}, "routing", torch.int16, torch.int64, 2**16 + 1),
        ({}, "group_id", torch.int64, torch.uint64, 2**63),
        ({}, "prompt_len", torch.int64, torch.uint64, 2**64 - 2),
        ({}, "policy_version", torch.int64, torch.uint64, 2**63 + 1),
    ]


@pytest.mark.parametrize("kwargs, name, stored, given, value", int_cases(),
                         ids=[f"{c[1]}-{c[2]}-from-{c[3]}-{c[4]}" for c in int_cases()])
def test_integers_past_the_stored_range_are_refused(kwargs, name, stored, given, value):
    buf = used_buffer(**kwargs)
    batch = make_batch(3, seed=1)
    spec = buf.fields[name]
    assert spec.dtype == stored
    for other, other_spec in buf.fields.items():
        if other not in batch and other_spec.required:
            batch[other] = fill_like(other_spec, batch, 1)
    batch[name] = fill_like(spec, batch, 1, dtype=given)
    batch[name][1].view(-1)[0:1] = torch.tensor([value], dtype=given)  # rollout 1 holds the bad value
    refused(buf, batch, repr(name), "rollout 1")


def test_a_python_int_policy_version_past_int64_is_a_schema_error():
    """It raised torch's bare ValueError ('Overflow when unpacking long long'), naming no field."""
    buf = used_buffer()
    refused(buf, make_batch(3, seed=1, version=2**63), "'policy_version'", str(2**63))


def test_values_at_the_edges_of_the_stored_range_come_back_exactly():
    """The check refuses only what does not fit: the extremes of each stored dtype round-trip,
    from wider and from unsigned input dtypes alike."""
    buf = tr.RolloutBuffer(8, extra_fields=AUX16)
    batch = make_batch(2, seed=1)
    batch["tokens"] = [t.to(torch.uint64) for t in batch["tokens"]]
    batch["tokens"][0][0:1] = torch.tensor([2**63 - 1], dtype=torch.uint64)
    batch["aux"] = [torch.full((t.numel(),), -32768) for t in batch["tokens"]]
    batch["aux"][1][0] = 32767
    batch["prompt_len"] = batch["prompt_len"].to(torch.uint16)
    batch["group_id"] = torch.tensor([2**63 - 1, 0], dtype=torch.uint64)
    out = buf.gather(buf.add(batch).slot, count_use=False)
    assert int(out.tokens[0, 0]) == 2**63 - 1
    assert out.data["aux"].dtype == torch.int16
    assert int(out.data["aux"][0, 0]) == -32768 and int(out.data["aux"][1, 0]) == 32767
    assert out.group_id.tolist() == [2**63 - 1, 0]


# ---------------------------------------------------------------------------- item 2: floats
def test_the_issue_repro_float64_logprob_past_float32_is_refused_not_stored_as_inf():
    buf = used_buffer()
    batch = make_batch(3, seed=1)
    batch["logprobs"] = [lp.double() for lp in batch["logprobs"]]
    batch["logprobs"][1][2] = -1e300
    message = refused(buf, batch, "'logprobs'", "rollout 1", "float32")
    assert "-1e+300" in message
    before = observable(buf)
    with pytest.raises(tr.SchemaError, match="'logprobs', rollout 1"):
        buf.compose(batch, n_replay=2)  # compose validates its fresh batch the same way, first
    assert_unchanged(before, buf)


def float_cases():
    half = {"h": tr.FieldSpec("h", "token", torch.float16)}
    bhalf = {"b": tr.FieldSpec("b", "rollout", torch.bfloat16, shape=(3,))}
    return [
        ({}, "logprobs", torch.float64, 1e39),
        ({}, "advantage", torch.float64, -1e300),
        ({}, "reward", torch.float64, 3.5e38),
        ({"ref_logprobs": True}, "ref_logprobs", torch.float64, -1e40),
        ({"extra_fields": half}, "h", torch.float32, 65520.0),  # rounds to inf in float16
        ({"extra_fields": half}, "h", torch.float64, -1e6),
        ({"extra_fields": bhalf}, "b", torch.float64, 1e300),
    ]


@pytest.mark.parametrize("kwargs, name, given, value", float_cases(),
                         ids=[f"{c[1]}-from-{c[2]}-{c[3]}" for c in float_cases()])
def test_finite_floats_past_the_stored_dtype_are_refused(kwargs, name, given, value):
    buf = used_buffer(**kwargs)
    batch = make_batch(3, seed=1)
    spec = buf.fields[name]
    for other, other_spec in buf.fields.items():
        if other not in batch and other_spec.required:
            batch[other] = fill_like(other_spec, batch, 0.5)
    batch[name] = fill_like(spec, batch, -0.5, dtype=given)
    batch[name][1].view(-1)[0] = value  # rollout 1 holds the bad value
    refused(buf, batch, repr(name), "rollout 1")


def test_floats_that_round_into_the_stored_range_are_kept():
    """float32's largest value, given in float64 a little above it (still rounding down to it),
    is stored as that value, not refused and not inf; float16's likewise.

    Mutation seen failing: the float check comparing |value| with finfo(stored).max instead of
    converting the extremes (it refuses values that round into range)."""
    half = {"h": tr.FieldSpec("h", "token", torch.float16)}
    buf = tr.RolloutBuffer(8, extra_fields=half)
    batch = make_batch(2, seed=1)
    f32max = torch.finfo(torch.float32).max
    batch["advantage"] = torch.tensor([f32max * (1 + 2**-26), -1.0], dtype=torch.float64)
    batch["h"] = [torch.full((t.numel(),), 65504.0) for t in batch["tokens"]]
    batch["h"][1][0] = 65519.0  # below float16's rounding boundary 65520
    out = buf.gather(buf.add(batch).slot, count_use=False)
    assert float(out.advantage[0]) == f32max
    assert float(out.data["h"][1, 0]) == 65504.0


# ---------------------------------------------------------------------------- item 8: errors
def test_segment_tree_sample_refuses_a_batch_size_past_int64_naming_it():
    tree = tr.SegmentTree(8)
    tree.update(torch.arange(4), torch.ones(4))
    g = torch.Generator().manual_seed(0)
    state = g.get_state()
    with pytest.raises(ValueError, match="batch_size"):
        tree.sample(2**63, generator=g)
    with pytest.raises(TypeError, match="stratified"):
        tree.sample(4, generator=g, stratified="yes")
    with pytest.raises(TypeError, match="stratified"):
        tree.sample(u=torch.rand(4, dtype=torch.float64), stratified=None)
    assert torch.equal(g.get_state(), state)  # refused before the seed was drawn
    assert tree.sample(4, generator=g, stratified=False)[0].numel() == 4


def test_a_batch_with_every_field_empty_is_a_schema_error():
    buf = used_buffer()
    refused(buf, make_batch(0), "no rollouts")
    with pytest.raises(tr.SchemaError, match="no rollouts"):
        buf.compose(make_batch(0), n_replay=2)
    assert len(buf) == 4


@pytest.mark.parametrize("name", ["prompt_len", "policy_version"])
@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_unsigned_prompt_len_and_policy_version_are_accepted_exactly(name, dtype):
    """Accepted, not refused: every uint16/uint32 value fits the stored int64, and a uint64 one
    does up to 2**63 - 1 (what does not is refused, above), so nothing is lost."""
    buf = tr.RolloutBuffer(8)
    batch = make_batch(3, seed=1, version=torch.tensor([5, 6, 7]))
    batch[name] = torch.as_tensor(batch[name]).to(dtype)
    out = buf.gather(buf.add(batch).slot, count_use=False)
    assert out.prompt_len.tolist() == make_batch(3, seed=1)["prompt_len"].tolist()
    assert out.policy_version.tolist() == [5, 6, 7] and buf.version == 7


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_logprobs_and_advantage_are_accepted_exactly(dtype):
    """Accepted: every float8 value is exact in float32, the stored dtype. Their NaN is refused
    as any NaN is."""
    buf = tr.RolloutBuffer(8)
    batch = make_batch(3, seed=1)
    batch["logprobs"] = [lp.to(dtype) for lp in batch["logprobs"]]
    batch["advantage"] = batch["advantage"].to(dtype)
    out = buf.gather(buf.add(batch).slot, count_use=False)
    assert torch.equal(out.advantage, batch["advantage"].float())
    for k, lp in enumerate(batch["logprobs"]):
        assert torch.equal(out.logprobs[k, : lp.numel()], lp.float())
    bad = make_batch(3, seed=2)
    bad["advantage"] = torch.tensor([0.5, float("nan"), 1.0]).to(dtype)
    refused(buf, bad, "'advantage'", "rollout 1")
    bad = make_batch(3, seed=2)
    bad["logprobs"] = [lp.to(dtype) for lp in bad["logprobs"]]
    bad["logprobs"][2][0] = float("nan")
    refused(buf, bad, "'logprobs'", "rollout 2")


def capped_buffer():
    buf = tr.RolloutBuffer(64, max_reuse=3, seed=0)
    buf.add(make_batch(8, seed=0))
    return buf


@pytest.mark.parametrize("ask", [{"n_replay": 2**40}, {"replay_ratio": 1 - 1e-12}, {"n_replay": 2**62}])
def test_compose_past_the_reuse_budget_is_a_truncated_batch_without_a_huge_allocation(ask):
    """docs/api.md: when the caps leave fewer draws than asked, compose (if_short='truncate')
    returns a shorter batch. Eight rollouts with max_reuse=3 have 24 uses left: 4 fresh + 24."""
    buf = capped_buffer()
    start = time.monotonic()
    out = buf.compose(make_batch(4, seed=1, version=1), **ask)
    assert time.monotonic() - start < 5
    assert len(out) == 4 + 24 and int(out.is_fresh.sum()) == 4
    assert len(buf) == 4  # every replayed rollout reached its cap and was evicted


@pytest.mark.parametrize("ask", [{"n_replay": 2**40}, {"replay_ratio": 1 - 1e-12}])
def test_compose_past_the_reuse_budget_with_if_short_raise_changes_nothing(ask):
    buf = capped_buffer()
    before = observable(buf)
    with pytest.raises(ValueError, match="cannot fill"):
        buf.compose(make_batch(4, seed=1, version=1), if_short="raise", **ask)
    assert_unchanged(before, buf)
    with pytest.raises(ValueError, match="cannot fill"):
        buf.sample(2**40)
    assert_unchanged(before, buf)
    assert len(buf.sample(2**40, if_short="truncate")) == 24


def forge_shard_fields(root, manifest, fields):
    """The first shard with its header's `fields` replaced and the header checksum recomputed;
    where the manifest records the header's CRC, it records the forged one (the forger controls
    every file, so the parser is what must meet the header)."""
    path = root / manifest["shards"][0]["key"]
    data = path.read_bytes()
    _, length, _ = fmt.PREAMBLE.unpack_from(data)
    meta = json.loads(data[fmt.PREAMBLE.size : fmt.PREAMBLE.size + length])
    meta["fields"] = fields
    text = json.dumps(meta, separators=(",", ":")).encode()
    assert len(text) <= length  # the header keeps its room; the blocks stay where they were
    text = text.ljust(length)
    path.write_bytes(fmt.PREAMBLE.pack(fmt.MAGIC, length, zlib.crc32(text)) + text
                     + data[fmt.PREAMBLE.size + length :])
    manifest_path = root / json.loads((root / "LATEST").read_text())["manifest"]
    doc = json.loads(manifest_path.read_text())
    if "header_crc32" in doc["shards"][0]:
        doc["shards"][0]["header_crc32"] = zlib.crc32(text)
        manifest_path.write_text(json.dumps(doc))


@pytest.mark.parametrize("fields", [5, None, "offsets", {"name": "offsets"}])
@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_a_shard_header_whose_fields_is_not_a_list_is_a_checkpoint_error(tmp_path, fields, mode):
    root, manifest = checkpoint_dir(tmp_path)
    forge_shard_fields(root, manifest, fields)
    with pytest.raises(tr.StorageError, match="fields"):
        fmt.read_shard_meta(str(root / manifest["shards"][0]["key"]))
    kwargs = {}
    if mode == "lazy":
        kwargs = dict(lazy=True, storage=tr.TieredStorage(hot_bytes=0, spill_dir=tmp_path / "spill", io="posix"))
    with pytest.raises(tr.CheckpointError, match="fields"):
        tr.RolloutBuffer.from_checkpoint(f"file://{root}", progress=False, **kwargs)


@pytest.mark.parametrize("where", ["state", "config"])
@pytest.mark.parametrize("kind", [["PrioritizedSampler"], {"a": 1}, 7, None])
def test_a_state_whose_sampler_type_is_not_a_name_is_a_checkpoint_error(tmp_path, where, kind):
    root, _ = checkpoint_dir(tmp_path)

    def edit(state):
        if where == "state":
            return {**state, "sampler": {**state["sampler"], "type": kind}}
        return {**state, "config": {**state["config"], "sampler": {**state["config"]["sampler"], "type": kind}}}

    forge_state(root, edit)
    with pytest.raises(tr.CheckpointError, match="sampler"):
        tr.RolloutBuffer.from_checkpoint(f"file://{root}", progress=False)
    with pytest.raises(ValueError, match="sampler"):
        tr.samplers.sampler_from_state({"type": kind, "config": {}})
