"""The replay contract in every call order: one regression test per reproduction of the contract
issue (hard caps, IS weights, all-or-nothing calls, copies at add, the documented sampler example,
exact counts for trainers). Each test failed on the code before the fix; the docstrings say how."""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path

import pytest
import torch
from faults import FlakyStorage
from rollouts import make_batch

import torchreplay as tr
from torchreplay.errors import StorageError
from torchreplay.storage import TieredStorage

DOCS = Path(__file__).resolve().parent.parent / "docs"


def adv_batch(advantages, version: int, seed: int = 0) -> dict:
    adv = torch.tensor(advantages, dtype=torch.float32)
    return make_batch(adv.numel(), version=version, seed=seed, advantage=adv)


def unchanged_state(buf: tr.RolloutBuffer) -> dict:
    """Everything a failed call must leave as it was (payload bytes are checked by sampling)."""
    state = buf.state_dict()
    # I/O statistics count work done (a failed compose may have read its replayed rows already).
    io_stats = ("_hits", "_bytes_read", "_reads")
    return {"meta": {k: v for k, v in state.items() if k != "shards"}, "len": len(buf),
            "metrics": {k: v for k, v in buf.metrics().items()
                        if not (isinstance(v, float) and math.isnan(v)) and not k.endswith(io_stats)}}


def assert_same(a, b) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b)
    else:
        assert a == b


# ------------------------------------------------------------------------------ 1. IS weights
def test_zero_advantage_rollout_no_longer_mutes_replayed_weights():
    """Repro 1: one A=0 rollout set P_min from eps alone, so replayed |A|=1 rows got weight ~0.063
    against the fresh rows' 1 (old code: weights 0.063). Now A=0 has priority 0: never drawn, never
    the scale; with equal |A| every replayed weight is 1, under every normalization."""
    for norm in ("batch_max", "batch_mean", "buffer_max"):
        buf = tr.RolloutBuffer(64, sampler=tr.PrioritizedSampler(alpha=1, beta=0.4, weight_norm=norm), seed=0)
        zero = buf.add(adv_batch([1, -1, 1, 0], version=0))
        out = buf.compose(adv_batch([1, -1, 1, -1], version=1, seed=1), replay_ratio=0.5)
        replayed = ~out.is_fresh
        assert int(replayed.sum()) == 4
        torch.testing.assert_close(out.weights[replayed], torch.ones(4))
        assert int(zero.slot[3]) not in out.handles.slot[replayed].tolist()
        assert buf.metrics()["replay_weight_mean"] == pytest.approx(1.0)


def test_ess_and_replay_weight_mean_describe_the_returned_batch():
    buf = tr.RolloutBuffer(64, sampler=tr.PrioritizedSampler(alpha=1, beta=1.0), seed=0)
    buf.add(adv_batch([1.0, 2.0, 1.0, 2.0, 1.0, 2.0], version=0))
    out = buf.compose(adv_batch([1, -1], version=1, seed=1), n_replay=6)
    w = out.weights.double()
    m = buf.metrics()
    assert m["ess_fraction"] == pytest.approx(float(w.sum() ** 2 / (w.pow(2).sum() * w.numel())))
    assert m["replay_weight_mean"] == pytest.approx(float(w[~out.is_fresh].mean()))
    assert m["ess_fraction"] < 1.0


def test_zero_priority_rollouts_are_kept_and_can_be_revived():
    buf = tr.RolloutBuffer(8, sampler=tr.PrioritizedSampler(alpha=1, beta=0.4), seed=0)
    h = buf.add(adv_batch([0.0, 0.0], version=0))
    assert len(buf) == 2
    with pytest.raises(ValueError, match="cannot fill|non-zero priority"):
        buf.sample(4)
    buf.update_priorities(h, torch.tensor([0.0, 2.0]))
    assert set(buf.sample(4).handles.slot.tolist()) == {int(h.slot[1])}
    keep = tr.RolloutBuffer(8, sampler=tr.PrioritizedSampler(keep_zero_advantage=True), seed=0)
    keep.add(adv_batch([0.0], version=0))
    assert len(keep.sample(2)) == 2


# ------------------------------------------------------------------------------ 2. reuse cap
def test_reuse_cap_holds_within_one_batch():
    """Repro 2: max_reuse=2 with one stored rollout, sample(5) returned it 5 times."""
    buf = tr.RolloutBuffer(16, sampler=tr.UniformSampler(), max_reuse=2, seed=0)
    buf.add(make_batch(1, seed=1))
    before = unchanged_state(buf)
    with pytest.raises(ValueError, match="cannot fill a batch of 5"):
        buf.sample(5)
    assert_same(unchanged_state(buf), before)  # generator state too: nothing changed
    out = buf.sample(5, if_short="truncate")
    assert len(out) == 2 and len(buf) == 0 and buf.metrics()["evicted_reuse"] == 1


def redraw_misses(counts: torch.Tensor, prio: torch.Tensor, capped: int, budget: int,
                  groups: list[slice]) -> int:
    """How many (call, group) pairs break the per-call bounds of the documented redraw, under the
    model `prio` (per slot). `counts` is [calls, slots]; `groups` are runs of adjacent slots, which
    own one contiguous interval of the tree's priority mass (slot order), so the stratified
    guarantee (an interval of E strata gets floor(E) - 1 .. ceil(E) + 1 draws, every call) holds
    for a run as for one slot, and a run's E is large enough for a few percent to show.

    The draw: pass 1 is stratified over the whole mass M; the capped slot keeps `budget` of its
    c0 in [floor(E0) - 1, ceil(E0) + 1] draws and is set aside; the r = c0 - budget missing rows
    are redrawn, stratified, over M' = M - p[capped]. (The test's sizes keep every other slot far
    from the budget, so there is no third pass.) A run's count is its pass-1 count plus its
    pass-2 count, each within its stratified bounds, with r anywhere in its range."""
    p = prio.double()
    n = int(counts[0].sum())
    mass, rest = float(p.sum()), float(p.sum() - p[capped])
    e0 = n * float(p[capped]) / mass
    r_lo, r_hi = math.floor(e0 - 1e-9) - 1 - budget, math.ceil(e0 + 1e-9) + 1 - budget
    misses = 0
    for g in groups:
        pg = float(p[g].sum())
        e1, e2_lo, e2_hi = n * pg / mass, r_lo * pg / rest, r_hi * pg / rest
        lo = math.floor(e1 - 1e-9) - 1 + math.floor(e2_lo - 1e-9) - 1
        hi = math.ceil(e1 + 1e-9) + 1 + math.ceil(e2_hi + 1e-9) + 1
        c = counts[:, g].sum(1)
        misses += int(((c < lo) | (c > hi)).sum())
    return misses


def test_reuse_cap_redraws_without_biasing_the_others():
    """alpha 1, one large |A| came back 12 times in 16. Now exactly its budget, and the rows
    redrawn in its place keep the others' relative probabilities: per `sample(1024)` call, every
    run of 256 slots lies within the per-call bounds of the documented two-pass draw, and the same
    draws break the bounds of a model that gives the |A| = 1 rows 0.95x their priority (power).

    Mutation seen failing: the redraw setting aside every drawn slot (`set_aside(spent)` in
    TreeSampler.draw instead of only the slots whose budget is spent), which moves the |A| = 1
    rows to about 0.95x their frequency; a chi-square on 200 small stratified calls passed it."""
    budget = 8
    adv = torch.cat([torch.tensor([2304.0]), torch.full((512,), 1.0), torch.full((512,), 0.5)])
    prio = adv.double() + 1e-3  # PrioritizedSampler: (|A| + eps) ** alpha, eps 1e-3
    gen = torch.Generator().manual_seed(3)
    counts = []
    for _ in range(6):  # a fresh buffer per call: a call's uses spend the budgets of the next
        buf = tr.RolloutBuffer(1025, sampler=tr.PrioritizedSampler(alpha=1.0, beta=0.0), max_reuse=budget, seed=0)
        h = buf.add(make_batch(1025, seed=2, advantage=adv, max_len=4))
        assert h.slot.tolist() == list(range(1025))  # slot order = the order of `adv`
        out = buf.sample(1024, generator=gen)
        counts.append(torch.bincount(out.handles.slot, minlength=1025))
    counts = torch.stack(counts)
    assert int(counts.max()) == budget and bool((counts[:, 0] == budget).all())
    runs = [slice(start, start + 256) for start in range(1, 1025, 256)]
    assert redraw_misses(counts, prio, 0, budget, runs) == 0
    off = prio.clone()
    off[1:513] *= 0.95
    assert redraw_misses(counts, off, 0, budget, runs) > 0, "a 5% bias must be caught"


def test_reuse_cap_in_compose_counts_the_fresh_use():
    """max_reuse=1 with compose is on-policy: the fresh use spends the whole budget, so nothing is
    ever replayed (mutation checked: not counting the fresh use replays them)."""
    on_policy = tr.RolloutBuffer(16, sampler=tr.UniformSampler(), max_reuse=1, seed=0)
    for v in range(4):
        out = on_policy.compose(make_batch(2, version=v, seed=v), n_replay=3)
        assert len(out) == 2 and bool(out.is_fresh.all()) and len(on_policy) == 0
    buf = tr.RolloutBuffer(16, sampler=tr.UniformSampler(), max_reuse=2, seed=0)
    for v in range(6):
        out = buf.compose(make_batch(2, version=v, seed=v), n_replay=3, if_short="truncate")
        fresh = out.handles.slot[out.is_fresh]
        assert buf.slots.reuse[fresh].tolist() == [1, 1]
        assert int(torch.bincount(out.handles.slot, minlength=16).max()) <= 2


# ------------------------------------------------------------------------------ 3. staleness cap
def test_staleness_cap_applies_when_add_moves_the_version():
    """Repro 3: adds at versions 0, 1, 5 with max_staleness=2 left versions 0/1 sampleable with age 5
    (342 of 512 draws) and evicted_staleness 0."""
    buf = tr.RolloutBuffer(64, sampler=tr.UniformSampler(), max_staleness=2, seed=0)
    for v in (0, 1, 5):
        buf.add(make_batch(8, version=v, seed=v))
    assert buf.version == 5 and len(buf) == 8
    out = buf.sample(512)
    assert bool((out.policy_version == 5).all()) and int(out.age.max()) == 0
    m = buf.metrics()
    assert m["age_max"] == 0 and m["evicted_staleness"] == 16


def test_staleness_cap_and_ages_in_a_compose_only_loop():
    """A trainer passing versions only through compose replayed arbitrarily old rollouts, with ages
    one short (measured before the fresh batch moved the version)."""
    buf = tr.RolloutBuffer(256, sampler=tr.UniformSampler(), max_staleness=2, seed=0)
    for v in range(12):
        out = buf.compose(make_batch(8, version=v, seed=v), replay_ratio=0.5)
        assert buf.version == v
        assert torch.equal(out.age, v - out.policy_version)
        assert int(out.age.max()) <= 2
        if v >= 1:
            assert int((~out.is_fresh).sum()) == 8
    assert buf.metrics()["age_max"] <= 2


# ------------------------------------------------------------------------------ 4. freshness overflow
@pytest.mark.parametrize("first_version", [5000, 2**62 - 1])
def test_freshness_sampler_at_large_versions(first_version):
    """Repro 4: add at version 5000 raised 'priorities[0] = inf' and left len 10, added 10, version
    5000 and an empty tree behind."""
    buf = tr.RolloutBuffer(64, sampler=tr.FreshnessSampler(tau=4.0), seed=0)
    buf.add(make_batch(10, version=first_version, seed=1))
    assert len(buf) == 10 and buf.version == first_version
    assert len(buf.sample(8)) == 8


def test_freshness_sampler_after_advance_then_older_add():
    buf = tr.RolloutBuffer(64, sampler=tr.FreshnessSampler(tau=1.0), seed=0)
    buf.add(make_batch(4, version=0, seed=0))
    buf.advance(30)
    buf.add(make_batch(4, version=800, seed=1))
    out = buf.sample(64)
    assert bool((out.policy_version == 800).all())  # version 0 is e^-800 behind: effectively never


def test_sampler_overflow_leaves_add_undone():
    """A priority that overflows (|A| ** alpha = inf) fails the sampler hook after the table was
    written: the call is undone, slots and counters included."""
    buf = tr.RolloutBuffer(8, sampler=tr.PrioritizedSampler(alpha=40.0), seed=0)
    buf.add(make_batch(8, seed=0))  # full: the next add evicts the oldest first
    before = unchanged_state(buf)
    with pytest.raises(ValueError):
        buf.add(adv_batch([1e30, 1.0], version=3))
    assert_same(unchanged_state(buf), before)
    assert len(buf.sample(8, generator=torch.Generator().manual_seed(0))) == 8


def test_update_priorities_overflow_changes_nothing():
    buf = tr.RolloutBuffer(8, sampler=tr.PrioritizedSampler(alpha=40.0), seed=0)
    h = buf.add(make_batch(4, seed=0))
    before = unchanged_state(buf)
    with pytest.raises(ValueError):
        buf.update_priorities(h, torch.tensor([1.0, 1e30, 2.0, 3.0]))
    assert_same(unchanged_state(buf), before)


# ------------------------------------------------------------------------------ 5. storage errors
@pytest.mark.parametrize("call", ["add", "compose"])
def test_spill_error_inside_add_or_compose_loses_no_slot(call):
    """Repro 5: the slots were taken (and the oldest evicted) before put() raised: len 56 of 64, an
    empty free list, and every later state_dict failed restore validation."""
    storage = FlakyStorage()
    buf = tr.RolloutBuffer(64, sampler=tr.UniformSampler(), storage=storage, max_staleness=3, seed=0)
    for v in range(8):
        buf.add(make_batch(8, version=v // 2, seed=v))
    before = unchanged_state(buf)
    storage.fail_next = True
    with pytest.raises(StorageError, match="No space"):
        if call == "add":
            buf.add(make_batch(8, version=5, seed=99))
        else:
            buf.compose(make_batch(8, version=5, seed=99), replay_ratio=0.5)
    assert_same(unchanged_state(buf), before)
    twin = tr.RolloutBuffer(64, sampler=tr.UniformSampler(), max_staleness=3)
    twin.load_state_dict(buf.state_dict())
    buf.add(make_batch(8, version=5, seed=99))  # and the buffer carries on
    assert len(buf) == 40  # versions 0 and 1 (32 rollouts) are past the cap at 5; the add took 8


# ------------------------------------------------------------------------------ 6. copies at add
def test_add_copies_the_callers_tensors():
    """Repro 6: with the packed form, values.zero_() after add changed the stored tokens; so did
    writing to a declared per-rollout field's tensor."""
    spec = {"score": tr.FieldSpec("score", "rollout", torch.float32, ())}
    buf = tr.RolloutBuffer(8, sampler=tr.UniformSampler(), extra_fields=spec, seed=0)
    batch = make_batch(2, seed=4)
    lengths = [t.numel() for t in batch["tokens"]]
    offsets = torch.tensor([0, lengths[0], sum(lengths)])
    values = torch.cat(batch["tokens"])
    logprobs = torch.cat(batch["logprobs"])
    score = torch.tensor([1.5, 2.5])
    reward = batch["reward"]
    buf.add(dict(batch, tokens={"values": values, "offsets": offsets},
                 logprobs={"values": logprobs, "offsets": offsets}, score=score))
    expected = values.clone()
    values.zero_()
    logprobs.zero_()
    score.zero_()
    reward.zero_()
    offsets.zero_()
    out = buf.gather(torch.tensor([0, 1]), count_use=False)
    assert torch.equal(out.tokens[out.attention_mask], expected)
    assert bool((out.logprobs[out.attention_mask] != 0).all())
    assert out.score.tolist() == [1.5, 2.5]
    assert bool((out.reward != 0).all())


# ------------------------------------------------------------------------------ 7. the docs example
def _python_blocks(markdown: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", markdown, flags=re.S)


def test_custom_sampler_example_in_docs_runs_as_written():
    """Repro 7: NewestOnly computed priorities only at insert, so after advance(1) half of a 64-row
    batch was still version 0. The snippet is executed from docs/api.md as written."""
    blocks = [b for b in _python_blocks((DOCS / "api.md").read_text()) if "class NewestOnly" in b]
    assert len(blocks) == 1
    scope: dict = {"tr": tr, "torch": torch}
    exec(blocks[0], scope)
    buf = tr.RolloutBuffer(64, sampler=scope["NewestOnly"](), seed=0)
    buf.add(make_batch(16, version=0, seed=0))
    assert len(buf.sample(64)) == 64
    buf.add(make_batch(16, version=1, seed=1))  # add moves the version: version 0 drops to priority 0
    assert bool((buf.sample(64).policy_version == 1).all())
    buf.advance(2)  # nothing is at version 2 yet
    with pytest.raises(ValueError):
        buf.sample(8)
    buf.add(make_batch(4, version=2, seed=2))
    assert bool((buf.sample(64).policy_version == 2).all())


# ------------------------------------------------------------------------------ exact counts
@pytest.mark.parametrize("fresh,kwargs,expected", [
    (8, {"n_replay": 5}, 5),
    (8, {"replay_ratio": 0.5}, 8),
    (6, {"replay_ratio": 0.5, "multiple_of": 4}, 6),  # 6 + 6 = 12 is a multiple of 4
    (6, {"replay_ratio": 0.3, "multiple_of": 4}, 2),  # 6 + 3 -> 8
    (5, {"n_replay": 3, "multiple_of": 8}, 3),
])
def test_compose_exact_counts(fresh, kwargs, expected):
    buf = tr.RolloutBuffer(128, sampler=tr.UniformSampler(), seed=0)
    buf.add(make_batch(32, version=0, seed=0))
    out = buf.compose(make_batch(fresh, version=1, seed=1), **kwargs)
    assert int((~out.is_fresh).sum()) == expected and int(out.is_fresh.sum()) == fresh


def test_compose_short_batches_keep_the_multiple_or_raise():
    buf = tr.RolloutBuffer(64, sampler=tr.UniformSampler(), max_reuse=1, seed=0)
    buf.add(make_batch(3, version=0, seed=0))  # three rollouts with one use each
    with pytest.raises(ValueError, match="multiple_of|not a multiple"):
        buf.compose(make_batch(4, version=1, seed=1), n_replay=3, multiple_of=4)
    before = unchanged_state(buf)
    with pytest.raises(ValueError, match="cannot fill a batch of 4"):
        buf.compose(make_batch(4, version=1, seed=1), n_replay=4, if_short="raise")
    assert_same(unchanged_state(buf), before)
    out = buf.compose(make_batch(4, version=1, seed=1), replay_ratio=0.5, multiple_of=4)  # 4 wanted, 3 there
    assert len(out) == 4 and bool(out.is_fresh.all())  # cut to 0 replayed to keep the multiple
    with pytest.raises(ValueError, match="exactly one"):
        buf.compose(make_batch(4, version=1, seed=1))
    with pytest.raises(ValueError, match="exactly one"):
        buf.compose(make_batch(4, version=1, seed=1), replay_ratio=0.5, n_replay=2)


@pytest.mark.cuda
def test_capped_draws_on_cuda_match_the_cpu():
    """The budgeted draw (set-aside leaves, stratified redraws) on a CUDA tree gives the CPU's batch."""
    def build():
        buf = tr.RolloutBuffer(64, sampler=tr.PrioritizedSampler(alpha=1.0, beta=0.4), max_reuse=2, seed=0)
        adv = torch.full((24,), 0.2)
        adv[3] = 30.0
        buf.add(make_batch(24, seed=5, advantage=adv))
        return buf

    cpu, gpu = build(), build().to("cuda")
    for seed in range(3):
        a = cpu.sample(20, generator=torch.Generator().manual_seed(seed), if_short="truncate")
        b = gpu.sample(20, device="cuda", generator=torch.Generator().manual_seed(seed), if_short="truncate")
        assert torch.equal(a.handles.slot, b.handles.slot)
        torch.testing.assert_close(a.weights, b.weights.cpu())
        assert int(torch.bincount(a.handles.slot).max()) <= 2


def packed(batch: dict) -> dict:
    offsets = torch.tensor([0] + [t.numel() for t in batch["tokens"]]).cumsum(0)
    out = dict(batch)
    for name in ("tokens", "logprobs", "response_mask"):
        out[name] = {"values": torch.cat(batch[name]), "offsets": offsets}
    return out


def test_copies_at_add_reuse_dead_shards_memory_but_never_memory_still_referenced():
    """The copy at add lands in memory recycled from dead shards (HostPool); a dead shard whose
    tensors someone still holds (here a state_dict) is not recycled, so that data never changes.
    Mutation checked: recycling without the use-count check rewrites the saved state's tokens.
    (Compared whole, through a deep copy and a restore: no key of the state's layout is named.)"""
    buf = tr.RolloutBuffer(8, sampler=tr.UniformSampler(), seed=0)
    for i in range(3):  # capacity 8: each add of 8 evicts the previous shard
        buf.add(packed(make_batch(8, seed=i, min_len=200, max_len=200)))
    assert buf.metrics()["storage_recycled_bytes"] > 0
    state = buf.state_dict()
    saved = copy.deepcopy(state)
    stored = buf.gather(torch.arange(8), count_use=False)
    for i in range(3, 6):
        buf.add(packed(make_batch(8, seed=i, min_len=200, max_len=200)))
    assert_same(state, saved)
    twin = tr.RolloutBuffer(8, sampler=tr.UniformSampler())
    twin.load_state_dict(state)
    again = twin.gather(torch.arange(8), count_use=False)
    assert torch.equal(again.tokens, stored.tokens) and torch.equal(again.logprobs, stored.logprobs)



# ------------------------------------------------------------------------------ review findings
def test_a_tighter_staleness_cap_holds_from_the_moment_it_is_set():
    buf = tr.RolloutBuffer(32, sampler=tr.UniformSampler(), seed=0)
    buf.add(make_batch(4, version=0, seed=0))
    buf.add(make_batch(4, version=5, seed=1))
    buf.max_staleness = 2
    assert len(buf) == 4 and int(buf.sample(64).age.max()) == 0
    assert buf.metrics()["evicted_staleness"] == 4


class FailingHook(tr.TreeSampler):
    """Uniform, but its version hook fails at version `fail_at` (a user sampler's bug)."""

    depends_on_version = True
    fail_at = 5

    def priority(self, slots):
        if self.slots.current_version == self.fail_at:
            raise RuntimeError("hook failed")
        return torch.ones(slots.numel(), dtype=torch.float64)


def test_advance_with_a_failing_sampler_hook_changes_nothing():
    buf = tr.RolloutBuffer(16, sampler=FailingHook(), max_staleness=2, seed=0)
    for v in range(4):
        buf.add(make_batch(2, version=v, seed=v))
    before = unchanged_state(buf)
    with pytest.raises(RuntimeError, match="hook failed"):
        buf.advance(5)
    assert_same(unchanged_state(buf), before)
    buf.advance(4)
    assert len(buf) == 4  # versions 2 and 3


def test_load_state_dict_whose_shard_store_fails_changes_nothing():
    """The new table was adopted before the shards were stored: a failing put left old shard ids
    in the new table, so slots returned another rollout's tokens."""
    storage = FlakyStorage()
    buf = tr.RolloutBuffer(16, sampler=tr.UniformSampler(), storage=storage, seed=0)
    buf.add(make_batch(6, version=0, seed=0))
    other = tr.RolloutBuffer(16, sampler=tr.UniformSampler(), seed=1)
    other.add(make_batch(4, version=3, seed=7))
    before = unchanged_state(buf)
    want = buf.gather(torch.arange(6), count_use=False).tokens
    storage.fail_next = True
    with pytest.raises(StorageError):
        buf.load_state_dict(other.state_dict())
    assert_same(unchanged_state(buf), before)
    assert torch.equal(buf.gather(torch.arange(6), count_use=False).tokens, want)
    buf.load_state_dict(other.state_dict())
    assert len(buf) == 4 and buf.version == 3


def test_compose_draws_with_the_new_versions_priorities():
    """NewestOnly at version 1: nothing stored is at version 1 before the insert, so nothing is
    replayed (the draw used version 0's priorities and replayed 4 rows of age 1)."""
    blocks = [b for b in _python_blocks((DOCS / "api.md").read_text()) if "class NewestOnly" in b]
    scope: dict = {"tr": tr, "torch": torch}
    exec(blocks[0], scope)
    buf = tr.RolloutBuffer(64, sampler=scope["NewestOnly"](), seed=0)
    buf.add(make_batch(8, version=0, seed=0))
    out = buf.compose(make_batch(4, version=1, seed=1), n_replay=4)
    assert bool(out.is_fresh.all()) and len(out) == 4


def test_overflow_raise_counts_the_room_that_staleness_makes():
    buf = tr.RolloutBuffer(4, sampler=tr.UniformSampler(), max_staleness=1, overflow="raise", seed=0)
    buf.add(make_batch(4, version=0, seed=0))
    with pytest.raises(tr.SchemaError, match="buffer full"):
        buf.add(make_batch(1, version=1, seed=1))  # version 0 is still within the cap at 1
    buf.add(make_batch(4, version=5, seed=2))  # at 5 every stored rollout is stale: room for 4
    assert len(buf) == 4 and buf.version == 5


class FailingReads(TieredStorage):
    """A storage whose next read fails as a download or I/O error would (not a checksum)."""

    fail_next = False

    def gather(self, *args, **kwargs):
        if self.fail_next:
            self.fail_next = False
            raise StorageError("cannot download shard: connection reset")
        return super().gather(*args, **kwargs)


def test_a_sample_whose_read_fails_charges_no_use():
    """The read fails: the call raises and the buffer is as it was. The uses used to be counted
    before the read, spending budgets (and evicting at max_reuse) for rollouts never returned."""
    storage = FailingReads()
    buf = tr.RolloutBuffer(16, sampler=tr.UniformSampler(), storage=storage, max_reuse=1, seed=0)
    buf.add(make_batch(4, seed=0))
    before = unchanged_state(buf)
    storage.fail_next = True
    with pytest.raises(StorageError, match="connection reset"):
        buf.sample(4)
    assert_same(unchanged_state(buf), before)
    assert len(buf.sample(4)) == 4 and len(buf) == 0
