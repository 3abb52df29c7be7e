"""RolloutBuffer: storage, sampling, samplers, staleness/reuse, atomicity, round trip."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

import torchreplay as tr
from extras import require
from rollouts import make_batch

P_MIN = 1e-3  # chi-square tests (independent draws only) reject below this p-value; seeds are fixed


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit. Only for independent draws (GroupSampler's); stratified draws are
    far more even than independent ones, so a chi-square on them passes wrong models too."""
    probs, counts = probs.double(), counts.double()
    expected = (probs / probs.sum() * counts.sum()).numpy()
    return stats.chisquare(counts.double().numpy(), expected).pvalue


def counts_per_call(buf: tr.RolloutBuffer, calls: int, batch: int, seed: int) -> torch.Tensor:
    """[calls, capacity]: how often each slot was drawn in each `sample(batch)` call."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.bincount(buf.sample(batch, generator=gen).handles.slot, minlength=buf.capacity)
                        for _ in range(calls)])


def stratified_misses(counts: torch.Tensor, probs: torch.Tensor) -> int:
    """How many (call, slot) pairs break the stratified guarantee under the model `probs` (per slot,
    unnormalized, 0 for slots that must never be drawn).

    A stratified draw of B puts one uniform in each of B equal strata of the priority mass, and
    rollout i owns one interval of length E = B P(i) strata, so it is drawn between floor(E) - 1
    and ceil(E) + 1 times in every call, and never when P(i) = 0. That holds deterministically, per
    call, unlike a chi-square, whose independence assumption stratified draws break. The bounds are
    widened by 1e-9 strata for rounding (only ever loosening them)."""
    p = probs.double() / probs.double().sum()
    expected = counts.sum(1, keepdim=True).double() * p
    lo = torch.floor(expected - 1e-9) - 1
    hi = torch.where(p > 0, torch.ceil(expected + 1e-9) + 1, torch.zeros_like(expected))
    c = counts.double()
    return int(((c < lo) | (c > hi)).sum())


def state_equal(a: dict, b: dict) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(state_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b) or
                                                                   (a.is_floating_point() and torch.allclose(a, b, equal_nan=True)))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


# ------------------------------------------------------------------------------------ storage
@pytest.mark.parametrize("side", ["right", "left"])
def test_sample_returns_the_stored_rollouts_padded(side):
    buf = tr.RolloutBuffer(32, sampler=tr.UniformSampler(), padding_side=side, pad_token_id=-1)
    batch = make_batch(10, seed=1)
    handles = buf.add(batch)
    assert handles.slot.tolist() == list(range(10)) and handles.generation.tolist() == [1] * 10
    out = buf.sample(64, generator=torch.Generator().manual_seed(0))
    width = out.tokens.shape[1]
    assert width == int(out.attention_mask.sum(1).max())
    for k, slot in enumerate(out.handles.slot.tolist()):
        length = batch["tokens"][slot].numel()
        cols = slice(0, length) if side == "right" else slice(width - length, width)
        assert torch.equal(out.tokens[k, cols], batch["tokens"][slot])
        assert torch.equal(out.logprobs[k, cols], batch["logprobs"][slot])
        assert torch.equal(out.response_mask[k, cols], batch["response_mask"][slot])
        assert int(out.attention_mask[k].sum()) == length
        assert bool((out.tokens[k][~out.attention_mask[k]] == -1).all())
        assert out.advantage[k] == batch["advantage"][slot]
        assert out.group_id[k] == batch["group_id"][slot]


def test_reused_output_buffers_give_the_same_batches():
    buf = tr.RolloutBuffer(64, sampler=tr.UniformSampler(), padding_side="left", pad_token_id=-7)
    buf.add(make_batch(40, seed=3, max_len=30))
    fresh = [buf.sample(16, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    pointers = set()
    for s, expected in enumerate(fresh):
        got = buf.sample(16, generator=torch.Generator().manual_seed(s), reuse_output=True)
        pointers.add(got.tokens.untyped_storage().data_ptr())
        for name in ("tokens", "logprobs", "response_mask", "attention_mask"):
            assert torch.equal(got.data[name], expected.data[name]), name
    assert len(pointers) == 1, "the arena is reused across calls"


def test_int32_token_storage():
    buf = tr.RolloutBuffer(16, sampler=tr.UniformSampler(), token_dtype=torch.int32)
    batch = make_batch(6, seed=12)
    buf.add(batch)
    out = buf.sample(12, generator=torch.Generator().manual_seed(0))
    assert out.tokens.dtype == torch.int32
    for k, slot in enumerate(out.handles.slot.tolist()):
        n = batch["tokens"][slot].numel()
        assert torch.equal(out.tokens[k, :n].long(), batch["tokens"][slot])
    bad = make_batch(2, seed=13)
    bad["tokens"][1][0] = 2**40
    before = buf.state_dict()
    with pytest.raises(tr.SchemaError, match="int32"):
        buf.add(bad)
    assert state_equal(buf.state_dict(), before)
    with pytest.raises(ValueError, match="token_dtype"):
        tr.RolloutBuffer(4, token_dtype=torch.float32)


def test_ragged_input_formats_store_the_same_data():
    batch = make_batch(6, seed=2)
    as_offsets = dict(batch)
    for name in ("tokens", "response_mask", "logprobs"):
        parts = batch[name]
        offsets = torch.tensor([0] + np.cumsum([p.numel() for p in parts]).tolist())
        as_offsets[name] = {"values": torch.cat(parts), "offsets": offsets}
    as_nested = dict(batch)
    for name in ("tokens", "logprobs"):
        as_nested[name] = torch.nested.nested_tensor(batch[name], layout=torch.jagged)
    results = []
    for variant in (batch, as_offsets, as_nested):
        buf = tr.RolloutBuffer(8, sampler=tr.UniformSampler())
        buf.add(variant)
        results.append(buf.sample(6, generator=torch.Generator().manual_seed(5)))
    for other in results[1:]:
        for name in ("tokens", "logprobs", "response_mask", "attention_mask"):
            assert torch.equal(results[0].data[name], other.data[name])


def test_tensordict_input_when_installed():
    """A TensorDict batch (nested token fields, per-rollout tensors) is stored as given: read back
    with `gather(count_use=False)`, every token field and per-rollout field matches the input.

    Mutation seen failing: schema._ragged unbinding a nested tensor in reverse order (all nested
    fields reversed alike, so counts and lengths still agree and the old count-only test passed)."""
    tensordict = require("tensordict", "pip install tensordict; make test installs it from requirements-dev.txt")
    batch = make_batch(4, seed=3)
    batch["policy_version"] = torch.tensor([2, 0, 1, 2])
    td = tensordict.TensorDict(
        {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
        | {k: torch.nested.nested_tensor(batch[k], layout=torch.jagged) for k in ("tokens", "logprobs", "response_mask")},
        batch_size=[4],
    )
    buf = tr.RolloutBuffer(8, pad_token_id=-1)
    handles = buf.add(td)
    assert len(handles) == 4 and buf.version == 2
    out = buf.gather(handles.slot, count_use=False)
    assert out.handles.slot.tolist() == handles.slot.tolist()
    for k in range(4):
        n = batch["tokens"][k].numel()
        assert torch.equal(out.tokens[k, :n], batch["tokens"][k])
        assert torch.equal(out.logprobs[k, :n], batch["logprobs"][k])
        assert torch.equal(out.response_mask[k, :n], batch["response_mask"][k])
        assert int(out.attention_mask[k].sum()) == n and bool((out.tokens[k, n:] == -1).all())
    for name in ("prompt_len", "reward", "advantage", "group_id", "policy_version"):
        assert torch.equal(out.data[name], batch[name]), name
    assert out.age.tolist() == [0, 2, 1, 0]
    assert out.reuse.tolist() == [0] * 4 and buf.slots.reuse[handles.slot].tolist() == [0] * 4  # not counted


def test_moe_routing_ids_use_the_narrowest_dtype():
    for experts, dtype in ((8, torch.uint8), (256, torch.uint8), (257, torch.int16), (40000, torch.int32)):
        buf = tr.RolloutBuffer(4, routing=(experts, 2, 2))
        assert buf.fields["routing"].dtype == dtype
    buf = tr.RolloutBuffer(4, routing=(64, 3, 2))
    batch = make_batch(2, seed=4)
    batch["routing"] = [torch.randint(0, 64, (t.numel(), 3, 2)) for t in batch["tokens"]]
    buf.add(batch)
    out = buf.sample(4, generator=torch.Generator().manual_seed(0))
    assert out.routing.dtype == torch.uint8 and out.routing.shape[2:] == (3, 2)
    for k, slot in enumerate(out.handles.slot.tolist()):
        n = batch["tokens"][slot].numel()
        assert torch.equal(out.routing[k, :n].long(), batch["routing"][slot])
    bad = make_batch(1, seed=5)
    bad["routing"] = [torch.full((bad["tokens"][0].numel(), 3, 2), 300)]
    with pytest.raises(tr.SchemaError, match="routing"):
        buf.add(bad)


def test_extra_and_reference_fields():
    buf = tr.RolloutBuffer(8, ref_logprobs=True, extra_fields={
        "values": tr.FieldSpec("values", "token", torch.float32),
        "difficulty": tr.FieldSpec("difficulty", "rollout", torch.float32),
    })
    batch = make_batch(3, seed=6)
    batch["ref_logprobs"] = [x - 0.5 for x in batch["logprobs"]]
    batch["values"] = [torch.rand(t.numel()) for t in batch["tokens"]]
    batch["difficulty"] = torch.tensor([0.1, 0.2, 0.3])
    buf.add(batch)
    out = buf.sample(8, generator=torch.Generator().manual_seed(0))
    for k, slot in enumerate(out.handles.slot.tolist()):
        n = batch["tokens"][slot].numel()
        assert torch.equal(out.ref_logprobs[k, :n], batch["ref_logprobs"][slot])
        assert torch.equal(out.values[k, :n], batch["values"][slot])
        assert out.difficulty[k] == batch["difficulty"][slot]


# ------------------------------------------------------------------------------ bad input
BAD_BATCHES = [
    ("length mismatch", lambda b: b.__setitem__("logprobs", [x[:-1] for x in b["logprobs"]]), "logprobs"),
    ("tokens dtype", lambda b: b.__setitem__("tokens", [x.float() for x in b["tokens"]]), "tokens"),
    ("NaN advantage", lambda b: b["advantage"].__setitem__(2, float("nan")), "advantage.*rollout 2"),
    ("inf reward", lambda b: b["reward"].__setitem__(1, float("inf")), "reward.*rollout 1"),
    ("negative version", lambda b: b.__setitem__("policy_version", torch.tensor([0, 0, -1, 0, 0, 0])),
     "policy_version.*rollout 2"),
    ("missing field", lambda b: b.pop("group_id"), "group_id"),
    ("unknown field", lambda b: b.__setitem__("surprise", torch.zeros(6)), "surprise"),
    ("prompt too long", lambda b: b["prompt_len"].__setitem__(3, 100), "prompt_len.*rollout 3"),
    ("count mismatch", lambda b: b.__setitem__("reward", torch.zeros(5)), "reward"),
    ("NaN logprob", lambda b: b["logprobs"][4].__setitem__(0, float("nan")), "logprobs.*rollout 4"),
    ("mask dtype", lambda b: b.__setitem__("response_mask", [m.int() for m in b["response_mask"]]), "response_mask"),
    ("not a tensor", lambda b: b.__setitem__("tokens", [[1, 2, 3]] * 6), "tokens.*rollout 0"),
    ("empty rollout", lambda b: [b[k].__setitem__(0, b[k][0][:0]) for k in ("tokens", "logprobs", "response_mask")],
     "rollout 0"),
]


@pytest.mark.parametrize("label, corrupt, match", BAD_BATCHES, ids=[b[0] for b in BAD_BATCHES])
def test_invalid_batch_raises_schema_error_and_changes_nothing(label, corrupt, match):
    buf = tr.RolloutBuffer(16, max_reuse=5)
    buf.add(make_batch(6, seed=7))
    before = buf.state_dict()
    batch = make_batch(6, seed=8)
    corrupt(batch)
    # Caught as a plain ValueError (what callers without torchreplay's types catch), and it is the
    # SchemaError that names the field. Mutation seen failing: SchemaError not deriving from ValueError.
    with pytest.raises(ValueError, match=match) as raised:
        buf.add(batch)
    assert type(raised.value) is tr.SchemaError
    with pytest.raises(ValueError, match=match) as raised:
        buf.compose(batch, replay_ratio=0.5)
    assert type(raised.value) is tr.SchemaError
    assert state_equal(buf.state_dict(), before)


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_fuzz_malformed_batches_never_crash_or_change_state(data):
    buf = tr.RolloutBuffer(16, max_staleness=3)
    buf.add(make_batch(5, seed=9))
    before = buf.state_dict()
    batch = make_batch(data.draw(st.integers(1, 6)), seed=data.draw(st.integers(0, 100)))
    key = data.draw(st.sampled_from(sorted(batch)))
    mutation = data.draw(st.sampled_from(["drop", "scalar", "float", "nan", "truncate", "wrong_len", "string", "neg"]))
    value = batch[key]
    if mutation == "drop":
        del batch[key]
    elif mutation == "scalar":
        batch[key] = torch.tensor(1.5)
    elif mutation == "float":
        batch[key] = [v.double() for v in value] if isinstance(value, list) else torch.as_tensor(value).double() + 0.5
    elif mutation == "nan":
        batch[key] = [v.float() * float("nan") for v in value] if isinstance(value, list) else \
            torch.full_like(torch.as_tensor(value).float(), float("nan"))
    elif mutation == "truncate":
        batch[key] = value[:-1] if isinstance(value, list) and len(value) > 1 else []
    elif mutation == "wrong_len":
        batch[key] = [v[:0] for v in value] if isinstance(value, list) else torch.as_tensor(value).reshape(-1)[:0]
    elif mutation == "string":
        batch[key] = "oops"
    elif mutation == "neg":
        batch[key] = [-v.long() - 1 for v in value] if isinstance(value, list) else -torch.as_tensor(value).long() - 10
    try:
        buf.add(batch)
    except (tr.SchemaError, ValueError, TypeError):
        assert state_equal(buf.state_dict(), before)


# ------------------------------------------------------------------------------ samplers
def filled(sampler, n=40, seed=11, capacity=48, **kw) -> tuple[tr.RolloutBuffer, dict]:
    buf = tr.RolloutBuffer(capacity, sampler=sampler, **kw)
    batch = make_batch(n, seed=seed)
    buf.add(batch)
    return buf, batch


def test_uniform_sampler_is_uniform_over_live():
    """Per `sample(4096)` call, each of the 40 live rollouts is drawn floor(E)-1..ceil(E)+1 times
    (E = 4096 / 40) and no free slot ever. Mutation seen failing: UniformSampler.priority returning
    `1 + 0.1 * (slots % 2)` (odd slots 10% likelier)."""
    buf, _ = filled(tr.UniformSampler())
    live = torch.zeros(48)
    live[:40] = 1
    counts = counts_per_call(buf, 6, 4096, seed=1)
    assert stratified_misses(counts, live) == 0
    skewed = live.clone()
    skewed[1:40:2] = 1.1  # the check has power: 10% off for half the rollouts is caught on the same draws
    assert stratified_misses(counts, skewed) > 0


@pytest.mark.parametrize("alpha", [0.6, 1.0])
@pytest.mark.parametrize("weight_norm", ["buffer_max", "batch_max", "batch_mean"])
def test_prioritized_sampler_frequencies_and_weights(alpha, weight_norm):
    """Frequencies: per `sample(4096)` call, every rollout is drawn within the stratified bounds of
    p = (|A| + eps) ** alpha, and the same draws break the bounds of alpha - 0.05 (0.55 when the
    truth is 0.6). Mutation seen failing: PrioritizedSampler.base_priority using
    `pow(self.alpha - 0.05)`."""
    sampler = tr.PrioritizedSampler(alpha=alpha, beta=0.5, eps=0.01, weight_norm=weight_norm)
    buf, batch = filled(sampler)

    def model(a: float) -> torch.Tensor:
        p = torch.zeros(48, dtype=torch.float64)
        p[:40] = (batch["advantage"].double().abs() + 0.01) ** a
        return p

    counts = counts_per_call(buf, 6, 4096, seed=2)
    assert stratified_misses(counts, model(alpha)) == 0
    assert stratified_misses(counts, model(alpha - 0.05)) > 0, "a wrong alpha must be caught"
    p = model(alpha)[:40]
    out = buf.sample(64, generator=torch.Generator().manual_seed(3))
    raw = (40 * p[out.handles.slot] / p.sum()) ** -0.5  # (N P_i)^-beta
    scale = {"buffer_max": (40 * p.min() / p.sum()) ** -0.5, "batch_max": raw.max(), "batch_mean": raw.mean()}
    torch.testing.assert_close(out.weights.double(), raw / scale[weight_norm], rtol=1e-5, atol=0)
    assert buf.metrics()["replay_weight_mean"] == pytest.approx(float(out.weights.double().mean()))


def test_freshness_sampler_decays_with_age_and_survives_rebase():
    """p ~ (|A| + eps) * exp(-age / tau), before and across a rebase of the reference version,
    checked per `sample(4096)` call against the stratified bounds; the same draws break the bounds
    of tau * 1.1. Mutation seen failing: FreshnessSampler.priority dividing by `1.1 * self.tau`."""
    tau = 2.0
    sampler = tr.FreshnessSampler(alpha=1.0, beta=0.0, eps=0.01, tau=tau)
    buf = tr.RolloutBuffer(64, sampler=sampler)
    adv = torch.linspace(0.5, 2.0, 8)
    versions = []
    for v in (58, 60, 62):
        buf.add(make_batch(8, version=v, seed=v, advantage=adv))
        versions += [v] * 8
    buf.advance(63)
    assert sampler.rebases == 0

    def expected(now, tau=tau):
        p = torch.zeros(64, dtype=torch.float64)
        base = (adv.double().abs() + 0.01).repeat(len(versions) // 8)
        p[:len(versions)] = base * torch.exp(-(now - torch.tensor(versions)).double() / tau)
        return p

    counts = counts_per_call(buf, 4, 4096, seed=1)
    assert stratified_misses(counts, expected(63)) == 0
    assert stratified_misses(counts, expected(63, tau=1.1 * tau)) > 0, "a wrong tau must be caught"
    buf.advance(65)  # 65 - 0 > rebase_after * tau = 64: the reference moves, live leaves are rewritten
    assert sampler.rebases == 1 and sampler.t_ref == 64  # 65 rounded down to a multiple of 32 * tau
    buf.add(make_batch(8, version=65, seed=65, advantage=adv))
    versions += [65] * 8
    counts = counts_per_call(buf, 4, 4096, seed=2)
    assert stratified_misses(counts, expected(65)) == 0
    assert stratified_misses(counts, expected(65, tau=1.1 * tau)) > 0


def test_pnewest_sampler_takes_the_newest_then_uniform():
    """The newest quarter heads every batch; the rest is a stratified uniform draw over the others
    (checked per call against the stratified bounds). Mutation seen failing: PNewestSampler.sample
    not excluding the newest from the uniform part (dropping `others[newest_t] = 0`)."""
    buf = tr.RolloutBuffer(64, sampler=tr.PNewestSampler(p=0.25))
    buf.add(make_batch(24, seed=14))
    newest = buf.add(make_batch(8, seed=15, version=1))
    gen = torch.Generator().manual_seed(4)
    counts = []
    for _ in range(200):
        out = buf.sample(32, generator=gen)
        head = out.handles.slot[:8]
        assert sorted(head.tolist()) == sorted(newest.slot.tolist())
        counts.append(torch.bincount(out.handles.slot[8:], minlength=64))
    # The uniform part (a stratified draw of 24 over the other 24) must exclude the newest.
    others = torch.zeros(64)
    others[:24] = 1
    assert stratified_misses(torch.stack(counts), others) == 0


def test_group_sampler_picks_groups_then_members():
    buf = tr.RolloutBuffer(64, sampler=tr.GroupSampler(per_group=2))
    batch = make_batch(40, seed=16)  # 10 groups of 4
    buf.add(batch)
    gen = torch.Generator().manual_seed(5)
    group_counts = torch.zeros(10)
    member_counts = torch.zeros(40)
    for _ in range(400):
        out = buf.sample(8, generator=gen)
        groups = out.group_id.view(4, 2)
        assert bool((groups[:, 0] == groups[:, 1]).all()), "pairs come from one group"
        assert bool((out.handles.slot.view(4, 2)[:, 0] != out.handles.slot.view(4, 2)[:, 1]).all())
        group_counts += torch.bincount(groups[:, 0], minlength=10).float()
        member_counts += torch.bincount(out.handles.slot, minlength=40).float()
    assert chi_square_p(group_counts, torch.ones(10)) > P_MIN
    assert chi_square_p(member_counts, torch.ones(40)) > P_MIN


def test_custom_sampler_plugs_in():
    """A TreeSampler subclass whose priority really filters: 0 for every rollout behind the
    buffer's current version. Those are never drawn, whether they fell behind when the version
    moved or were added behind it; when nothing has a non-zero priority, sample raises.

    Mutations seen failing: TreeSampler.changed_by_version returning no slots (rollouts keep
    priority 1 after the version moves); TreeSampler.on_insert writing ones instead of
    `priority(slots)`."""

    class NewestOnly(tr.TreeSampler):
        """Only rollouts at the buffer's current version."""

        depends_on_version = True

        def priority(self, slots):
            return (self.slots.policy_version[slots] == self.slots.current_version).double()

    buf = tr.RolloutBuffer(32, sampler=NewestOnly())
    assert isinstance(buf.sampler, tr.Sampler)
    old = buf.add(make_batch(8, version=0, seed=17))
    latest = buf.add(make_batch(8, version=1, seed=18))  # the version moves to 1: `old` falls to priority 0
    late = buf.add(make_batch(4, version=0, seed=19))  # stored behind the version: priority 0 from the start
    assert len(buf) == 20 and bool(buf.slots.live[torch.cat([old.slot, late.slot])].all())  # stored, not drawable
    gen = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(10):
        out = buf.sample(64, generator=gen)
        assert set(out.handles.slot.tolist()) <= set(latest.slot.tolist())
        seen |= set(out.handles.slot.tolist())
    assert seen == set(latest.slot.tolist())
    assert buf.sampler.tree[torch.cat([old.slot, late.slot])].tolist() == [0.0] * 12
    newest = buf.add(make_batch(4, version=2, seed=20))  # now `latest` is behind too
    out = buf.sample(64, generator=gen)
    assert set(out.handles.slot.tolist()) == set(newest.slot.tolist())
    buf.advance(3)  # everything is behind: nothing is drawable
    with pytest.raises(ValueError, match="non-zero priority"):
        buf.sample(1, if_short="truncate")
    assert len(buf) == 24


# ---------------------------------------------------------------------- staleness and reuse
def test_staleness_eviction_is_exact_and_evicted_never_sampled():
    buf = tr.RolloutBuffer(64, sampler=tr.UniformSampler(), max_staleness=2)
    for v in range(4):
        buf.add(make_batch(8, version=v, seed=20 + v))
    assert len(buf) == 24  # adding version 3 already evicted version 0 (age 3 > 2)
    assert buf.advance(4) == 8  # then version 1 is older than 4 - 2
    assert len(buf) == 16
    out = buf.sample(500, generator=torch.Generator().manual_seed(0))
    assert bool((out.policy_version >= 2).all())
    assert bool((out.age <= 2).all())
    assert buf.metrics()["evicted_staleness"] == 16
    with pytest.raises(tr.SchemaError, match="staleness"):
        buf.add(make_batch(2, version=1, seed=30))
    with pytest.raises(ValueError, match="backwards"):
        buf.advance(3)


def test_reuse_cap_evicts_after_k_uses():
    buf = tr.RolloutBuffer(16, sampler=tr.UniformSampler(), max_reuse=3)
    handles = buf.add(make_batch(1, seed=31))
    gen = torch.Generator().manual_seed(0)
    for expected_reuse in range(3):
        out = buf.sample(1, generator=gen)
        assert out.reuse.item() == expected_reuse
    assert len(buf) == 0 and buf.metrics()["evicted_reuse"] == 1
    with pytest.raises(ValueError, match="empty"):
        buf.sample(1)
    assert buf.update_priorities(handles, torch.tensor([1.0])) == 0


def test_reuse_counts_duplicates_within_a_batch():
    buf = tr.RolloutBuffer(16, sampler=tr.UniformSampler(), max_reuse=4)
    buf.add(make_batch(1, seed=32))
    buf.sample(3, generator=torch.Generator().manual_seed(0))
    assert buf.metrics()["reuse_hist_2_3"] == 1
    buf.sample(1, generator=torch.Generator().manual_seed(0))
    assert len(buf) == 0


def test_capacity_overflow_evicts_oldest_or_raises():
    buf = tr.RolloutBuffer(10, sampler=tr.UniformSampler())
    first = buf.add(make_batch(6, seed=33))
    second = buf.add(make_batch(6, seed=34))
    assert len(buf) == 10 and buf.metrics()["evicted_capacity"] == 2
    live_first = buf.slots.live[first.slot] & (buf.slots.generation[first.slot] == first.generation)
    assert live_first.tolist() == [False, False, True, True, True, True]
    assert set(second.slot.tolist()) == {0, 1, 6, 7, 8, 9}
    strict = tr.RolloutBuffer(10, overflow="raise")
    strict.add(make_batch(6, seed=35))
    before = strict.state_dict()
    with pytest.raises(tr.SchemaError, match="full"):
        strict.add(make_batch(6, seed=36))
    assert state_equal(strict.state_dict(), before)


@pytest.mark.parametrize("max_staleness", [None, 1000])
def test_eviction_orders_stay_bounded_without_advance(max_staleness):
    """Capacity and reuse evictions leave dead entries in the FIFO and version buckets; without
    advance() they must still be compacted, and eviction must still take the oldest live first."""
    buf = tr.RolloutBuffer(64, sampler=tr.UniformSampler(), max_reuse=1, seed=0, max_staleness=max_staleness)
    added = []
    for step in range(300):
        added.append(buf.add(make_batch(16, version=step % 3, seed=step)))
        buf.sample(8)  # reuse cap 1: these die at once, out of insertion order
        bound = 2 * buf.capacity + 1024 + 16  # O(capacity), whatever the history
        fifo_entries, version_entries = buf.slots.order_sizes()
        assert fifo_entries <= bound and version_entries <= bound
    live = buf.slots.live.nonzero().flatten()
    oldest = live[torch.argmin(buf.slots.seq[live])]
    assert int(buf.slots.oldest(1)) == int(oldest)  # compaction kept insertion order
    # The state carries no order lists: they are rebuilt from the slot table on load.
    state = buf.state_dict()
    assert "fifo" not in state and "by_version" not in state
    twin = tr.RolloutBuffer(64, sampler=tr.UniformSampler(), max_reuse=1, seed=0, max_staleness=max_staleness)
    twin.load_state_dict(state)
    for step in range(5):
        a, b = buf.add(make_batch(40, seed=900 + step)), twin.add(make_batch(40, seed=900 + step))
        assert torch.equal(a.slot, b.slot)
        assert torch.equal(buf.slots.live, twin.slots.live) and torch.equal(buf.slots.seq, twin.slots.seq)
    # A staleness cap set after the fact still sees every live rollout's version.
    buf.max_staleness = 0
    live_versions = buf.slots.policy_version[buf.slots.live]
    expected = int((live_versions < 5).sum())
    assert buf.advance(5) == expected and bool((buf.slots.policy_version[buf.slots.live] >= 5).all())


def test_stale_handles_are_ignored_and_counted():
    """Handles whose slot was reused are ignored and counted; the live ones' new priorities drive the
    draws (per-call stratified bounds). Mutation seen failing: TreeSampler.on_priority not writing
    the tree (draws stay uniform while the table says [1, 1, 5, 5])."""
    buf = tr.RolloutBuffer(4, sampler=tr.PrioritizedSampler(alpha=1.0, beta=0.0, eps=1e-6))
    old = buf.add(make_batch(4, seed=37, advantage=torch.ones(4)))
    buf.add(make_batch(2, seed=38, advantage=torch.ones(2)))  # evicts and reuses slots 0, 1
    applied = buf.update_priorities(old, torch.tensor([100.0, 100.0, 5.0, 5.0]))
    assert applied == 2
    assert buf.metrics()["stale_handle_updates"] == 2
    assert buf.slots.advantage.tolist() == [1.0, 1.0, 5.0, 5.0]
    counts = counts_per_call(buf, 50, 200, seed=6)  # p = |A| + eps (alpha 1, eps 1e-6)
    assert stratified_misses(counts, torch.tensor([1.0, 1.0, 5.0, 5.0], dtype=torch.float64) + 1e-6) == 0
    assert stratified_misses(counts, torch.tensor([100.0, 100.0, 5.0, 5.0], dtype=torch.float64)) > 0


def test_update_priorities_validation():
    buf = tr.RolloutBuffer(4)
    h = buf.add(make_batch(2, seed=39))
    with pytest.raises(ValueError, match="finite"):
        buf.update_priorities(h, torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="2 handles"):
        buf.update_priorities(h, torch.tensor([1.0]))
    with pytest.raises(TypeError):
        buf.update_priorities((0, 1), torch.tensor([1.0]))


# ------------------------------------------------------------------------ composition
def test_compose_is_fresh_anchored_at_the_replay_ratio():
    buf = tr.RolloutBuffer(128, sampler=tr.UniformSampler(), max_reuse=2)
    first = buf.compose(make_batch(16, seed=40), replay_ratio=0.5)
    assert len(first) == 16 and bool(first.is_fresh.all())  # nothing to replay yet
    fresh = make_batch(16, seed=41, version=1)
    out = buf.compose(fresh, replay_ratio=0.5, generator=torch.Generator().manual_seed(0))
    assert len(out) == 32 and int(out.is_fresh.sum()) == 16
    fresh_slots = set(out.handles.slot[out.is_fresh].tolist())
    assert not fresh_slots & set(out.handles.slot[~out.is_fresh].tolist()), "replayed must not be the fresh ones"
    for k in range(16):
        n = fresh["tokens"][k].numel()
        assert torch.equal(out.tokens[k, :n], fresh["tokens"][k])
    assert bool((out.weights[out.is_fresh] == 1).all())
    assert len(buf) <= 32 and buf.metrics()["sampled_fresh"] == 32
    quarter = buf.compose(make_batch(12, seed=42, version=2), replay_ratio=0.25)
    assert len(quarter) == 16


# ------------------------------------------------------------------------------ round trip
@pytest.mark.parametrize("make_sampler", [
    lambda: tr.PrioritizedSampler(alpha=0.7, beta=0.4),
    lambda: tr.UniformSampler(),
    lambda: tr.FreshnessSampler(tau=3.0),
    lambda: tr.PNewestSampler(p=0.3),
    lambda: tr.GroupSampler(per_group=3),
])
def test_state_dict_round_trip_gives_the_same_samples(make_sampler):
    def build():
        return tr.RolloutBuffer(40, sampler=make_sampler(), max_staleness=3, max_reuse=4)

    buf = build()
    gen = torch.Generator().manual_seed(0)
    for v in range(5):
        buf.compose(make_batch(10, version=v, seed=50 + v), replay_ratio=0.4, generator=gen)
        buf.advance(v + 1)
    state = buf.state_dict()
    twin = build()
    twin.load_state_dict(state)
    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    for step in range(4):
        a = buf.compose(make_batch(6, version=5 + step, seed=60 + step), replay_ratio=0.5, generator=g1)
        b = twin.compose(make_batch(6, version=5 + step, seed=60 + step), replay_ratio=0.5, generator=g2)
        assert torch.equal(a.handles.slot, b.handles.slot)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.weights, b.weights)
        buf.advance(6 + step)
        twin.advance(6 + step)
    # storage_* figures are this process's I/O statistics, not buffer state.
    def state_metrics(b):
        return {k: v for k, v in b.metrics().items() if not k.startswith("storage_")}

    assert state_metrics(buf) == pytest.approx(state_metrics(twin), nan_ok=True)


def test_load_state_dict_rejects_mismatched_config():
    buf = tr.RolloutBuffer(8, max_reuse=2)
    buf.add(make_batch(3, seed=70))
    other = tr.RolloutBuffer(9, max_reuse=2)
    with pytest.raises(ValueError, match="config"):
        other.load_state_dict(buf.state_dict())
    assert len(other) == 0


def test_metrics_report_everything():
    buf = tr.RolloutBuffer(32, max_staleness=1, max_reuse=2)
    buf.add(make_batch(8, seed=71))
    buf.sample(4, generator=torch.Generator().manual_seed(0))
    m = buf.metrics()
    for key in ("size", "bytes", "capacity", "age_hist_0", "reuse_hist_1", "ess_fraction", "evicted_staleness",
                "evicted_reuse", "evicted_capacity", "stale_handle_updates", "sampled_fresh", "sampled_replay"):
        assert key in m
    assert m["size"] == 8 and m["bytes"] > 0 and 0 < m["ess_fraction"] <= 1
    assert all(isinstance(v, (int, float)) for v in m.values())


def test_constructor_validation():
    with pytest.raises(ValueError, match="capacity"):
        tr.RolloutBuffer(0)
    with pytest.raises(ValueError, match="overflow"):
        tr.RolloutBuffer(4, overflow="drop")
    with pytest.raises(ValueError, match="max_reuse"):
        tr.RolloutBuffer(4, max_reuse=0)
    with pytest.raises(TypeError, match="sampler"):
        tr.RolloutBuffer(4, sampler=object())
    with pytest.raises(ValueError, match="alpha"):
        tr.PrioritizedSampler(alpha=-1)
    with pytest.raises(ValueError, match="per_group must be an int >= 1, got 0"):
        tr.GroupSampler(per_group=0)
    with pytest.raises(TypeError, match="per_group must be an int >= 1, got 2.0"):  # checks.check_int
        tr.GroupSampler(per_group=2.0)


@pytest.mark.cuda
def test_buffer_on_cuda_samples_like_cpu():
    def build():
        buf = tr.RolloutBuffer(64, sampler=tr.PrioritizedSampler(alpha=0.8, beta=0.3))
        buf.add(make_batch(40, seed=80))
        return buf

    cpu, gpu = build(), build().to("cuda")
    a = cpu.sample(32, generator=torch.Generator().manual_seed(1))
    b = gpu.sample(32, device="cuda", generator=torch.Generator().manual_seed(1))
    assert b.tokens.device.type == "cuda"
    assert torch.equal(a.handles.slot, b.handles.slot)
    torch.testing.assert_close(a.weights, b.weights.cpu())
