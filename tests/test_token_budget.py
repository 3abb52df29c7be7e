"""Token-budget batches (issue 28 item 2): `sample(max_tokens=...)` and `compose(fresh, max_tokens=...)`.

The draw (torchreplay/budget.py) is a sequence of stratified blocks, each of as many rows as are sure
to fit in the room left whatever they are, so a row's expected count is E[rows] * P(i) and the
sampler's IS weights stay exact (docs/concepts.md, "Token budgets"). The statistical tests check that
with fixed seeds and stated tolerances, and show they catch a greedy fill and a wrong weight exponent.
"""

from __future__ import annotations

import pytest
import torch
from rollouts import make_batch

import torchreplay as tr
from torchreplay import budget

NONE = torch.empty(0, dtype=torch.int64)


def rollouts(lengths, advantages, version=0) -> dict:
    """One rollout per entry: `lengths[i]` tokens (1 prompt token), advantage `advantages[i]`."""
    n = len(lengths)
    return {
        "tokens": [torch.arange(1, int(k) + 1) for k in lengths],
        "prompt_len": torch.ones(n, dtype=torch.int64),
        "response_mask": [torch.arange(int(k)) >= 1 for k in lengths],
        "logprobs": [-torch.rand(int(k)) for k in lengths],
        "advantage": torch.as_tensor(advantages, dtype=torch.float32),
        "group_id": torch.arange(n),
        "policy_version": version,
    }


def stored_lengths(batch) -> torch.Tensor:
    return batch.attention_mask.sum(1)


# ------------------------------------------------------------------------------------ the rule
def worst_case_fit(lengths, budgets, room) -> int:
    """Reference for budget.sure_to_fit: take the longest rollouts first, each as often as allowed."""
    copies = [length for length, b in sorted(zip(lengths, budgets), reverse=True) for _ in range(min(b, room + 1))]
    fit = spent = 0
    for length in copies:
        if spent + length > room:
            break
        spent, fit = spent + length, fit + 1
    return fit if not lengths or max(lengths) <= room else 0


def test_sure_to_fit_is_the_worst_case_over_budgets():
    """Mutation: `copies = room // lengths` in sure_to_fit (a run of copies that cannot all fit then
    looks complete, and the count goes on to shorter rollouts: rows that may not fit) fails here
    against the brute-force reference."""
    g = torch.Generator().manual_seed(0)
    for _ in range(400):
        n = int(torch.randint(1, 7, (1,), generator=g))
        lengths = sorted(torch.randint(1, 12, (n,), generator=g).tolist(), reverse=True)
        budgets = torch.randint(1, 5, (n,), generator=g).tolist()
        room = int(torch.randint(0, 40, (1,), generator=g))
        got = budget.sure_to_fit(torch.tensor(lengths), torch.tensor(budgets), room)
        assert got == worst_case_fit(lengths, budgets, room), (lengths, budgets, room)
    assert budget.sure_to_fit(torch.tensor([10, 5, 2]), torch.tensor([1, 2, 100]), 23) == 4  # 10 + 5 + 5 + 2


def test_sure_to_fit_stays_exact_at_the_largest_budget():
    """2**40 tokens of one-token rollouts with no reuse cap: no int64 overflow in the worst-case sums."""
    lengths = torch.ones(3, dtype=torch.int64)
    assert budget.sure_to_fit(lengths, torch.full((3,), 2**62), budget.MAX_TOKENS) == budget.MAX_TOKENS
    assert budget.sure_to_fit(torch.tensor([2**40, 1]), torch.tensor([2**62, 2**62]), 2**40) == 1


# ------------------------------------------------------------------------------- sample(max_tokens)
@pytest.mark.parametrize("max_reuse", [None, 2])
def test_token_draw_fits_and_fills_to_within_the_longest_rollout(max_reuse):
    """Every batch holds at most max_tokens stored tokens and leaves less room than the longest
    drawable rollout; no rollout comes back more often than its reuse budget."""
    buf = tr.RolloutBuffer(256, max_reuse=max_reuse, seed=1)
    buf.add(make_batch(200, seed=3, min_len=1, max_len=60))
    g = torch.Generator().manual_seed(2)
    for max_tokens in (60, 61, 97, 250, 1000):
        batch = buf.sample(max_tokens=max_tokens, generator=g)
        used = int(stored_lengths(batch).sum())
        assert used <= max_tokens
        # The draw ended when less room was left than the longest rollout still drawable, which is
        # every live one no longer than the budget (uses of this batch counted, those at the cap evicted).
        live = stored_lengths(buf.gather(buf.slots.live_slots(), count_use=False))
        assert max_tokens - used < int(live[live <= max_tokens].max())
        if max_reuse is not None:
            slots, first = torch.unique(batch.handles.slot, return_inverse=True)
            uses = torch.bincount(first) + torch.zeros(slots.numel(), dtype=torch.int64).index_put_((first,), batch.reuse)
            assert int(uses.max()) <= max_reuse


def test_equal_lengths_make_the_stratified_fixed_size_draw():
    """With every rollout L tokens long, max_tokens = k * L is one block of k rows: the very draw
    `sample(k)` makes from the same seed (stratified, the same IS weights)."""
    buf = tr.RolloutBuffer(64, seed=0)
    buf.add(rollouts([7] * 50, torch.randn(50, generator=torch.Generator().manual_seed(4)).tolist()))
    for k in (1, 5, 16):
        by_tokens = buf.sample(max_tokens=7 * k + 6, generator=torch.Generator().manual_seed(k))
        by_rows = buf.sample(k, generator=torch.Generator().manual_seed(k))
        assert torch.equal(by_tokens.handles.slot, by_rows.handles.slot)
        assert torch.equal(by_tokens.weights, by_rows.weights)


def test_rollouts_longer_than_the_budget_are_never_drawn():
    buf = tr.RolloutBuffer(16, seed=0)
    buf.add(rollouts([5, 50, 5, 50, 9], [1.0, 4.0, 1.0, 4.0, 2.0]))
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        batch = buf.sample(max_tokens=20, generator=g, if_short="truncate")
        assert int(stored_lengths(batch).max()) <= 9
    state, before = g.get_state(), buf.metrics()
    with pytest.raises(ValueError, match="max_tokens=4"):  # nothing fits at all
        buf.sample(max_tokens=4, generator=g)
    assert torch.equal(g.get_state(), state) and buf.metrics() == before


def test_a_short_token_draw_raises_or_truncates():
    """The caps run out before the budget does: 'raise' changes nothing; 'truncate' returns what fits them."""
    buf = tr.RolloutBuffer(16, max_reuse=1, seed=0)
    buf.add(rollouts([4] * 6, [1.0] * 6))
    g = torch.Generator().manual_seed(0)
    state, before = g.get_state(), buf.metrics()
    with pytest.raises(ValueError, match="caps ran out"):
        buf.sample(max_tokens=100, generator=g)
    assert torch.equal(g.get_state(), state) and buf.metrics() == before and len(buf) == 6
    batch = buf.sample(max_tokens=100, generator=g, if_short="truncate")
    assert sorted(batch.handles.slot.tolist()) == sorted(set(batch.handles.slot.tolist())) and len(batch) == 6


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(batch_size=4, max_tokens=100), ValueError, "exactly one of batch_size and max_tokens"),
    (dict(), ValueError, "exactly one of batch_size and max_tokens"),
    (dict(max_tokens=0), ValueError, "max_tokens"),
    (dict(max_tokens=2**40 + 1), ValueError, "max_tokens"),
    (dict(max_tokens=100.0), TypeError, "max_tokens"),
    (dict(max_tokens=True), TypeError, "max_tokens"),
    (dict(max_tokens="100"), TypeError, "max_tokens"),
    (dict(batch_size=2.0), TypeError, "batch_size"),
    (dict(batch_size=0), ValueError, "batch_size"),
])
def test_bad_sizes_are_refused_before_anything_changes(kwargs, error, match):
    buf = tr.RolloutBuffer(16, seed=0)
    buf.add(make_batch(8))
    state, before = buf.generator.get_state(), buf.metrics()
    with pytest.raises(error, match=match):
        buf.sample(**kwargs)
    with pytest.raises(error, match=match):
        buf.sample_async(**kwargs)
    assert torch.equal(buf.generator.get_state(), state) and buf.metrics() == before


# ------------------------------------------------------------------------ IS weights, statistically
# 32 rollouts: 4 lengths (4, 8, 16, 40 tokens) x 4 priorities (|A| 0.5, 1, 2, 4; alpha 1), two per
# cell, so length and priority vary independently. With beta = 1 and weight_norm="buffer_max" a
# row's weight is p_min / p_i whatever else the batch holds, and a slot's weighted count per batch
# has the same expectation for every slot exactly when its expected count is proportional to P(i).
LENGTHS = torch.tensor([4, 8, 16, 40]).repeat(8)
ADVANTAGES = torch.tensor([0.5, 1.0, 2.0, 4.0]).repeat_interleave(8)
LENGTH_CLASS, PRIORITY_CLASS = torch.arange(32) % 4, torch.arange(32) // 8
MAX_TOKENS, BATCHES = 100, 800
Z_LIMIT = 4.0  # |z| of 8 contrasts: a false alarm at most 8 * 6.3e-5 = 5e-4 per seed


def weighted_buffer():
    sampler = tr.PrioritizedSampler(alpha=1.0, beta=1.0, eps=1e-6, weight_norm="buffer_max")
    buf = tr.RolloutBuffer(32, sampler=sampler, seed=0)
    buf.add(rollouts(LENGTHS.tolist(), ADVANTAGES.tolist()))
    return buf, (ADVANTAGES.double().abs() + 1e-6)


def contrast_z(batches) -> torch.Tensor:
    """z of each length class's and each priority class's mean weighted count per slot against the
    mean over all slots, from the spread of the per-batch values (the batches are independent)."""
    out = []
    for classes in (LENGTH_CLASS, PRIORITY_CLASS):
        per_batch = torch.zeros(len(batches), 4, dtype=torch.float64)
        for b, (slots, weights) in enumerate(batches):
            per_batch[b].index_add_(0, classes[slots], weights.double())
        per_batch /= 8  # slots per class
        deviation = per_batch - per_batch.mean(1, keepdim=True)
        out.append(deviation.mean(0) / (deviation.std(0) / len(batches) ** 0.5))
    return torch.cat(out)


def greedy_fill(sampler, priorities, generator, room):
    """The rule the buffer does not use: stratified candidates in random order, kept while they fit."""
    slots, _, _ = sampler.draw(room // 4, generator)
    slots = slots[torch.randperm(slots.numel(), generator=generator)]
    fits = (torch.cumsum(LENGTHS[slots], 0) <= room).to(torch.int64).cumprod(0).bool()
    slots = slots[fits]
    return slots, (priorities.min() / priorities[slots]).float()


def test_token_draw_keeps_the_is_weights_exact():
    """Tolerance: every |z| < 4 over 800 batches of 100 tokens (seeded). Power, on the same number
    of batches: the same weights on a greedy fill (rows kept while they fit) put the long rollouts'
    z below -4, and weights with exponent 0.5 instead of beta = 1 put a priority class past |z| 8.
    Mutation: making budget.py's blocks greedy (n = room // shortest length, rows in random order,
    only the prefix that fits kept) fails here (z of the 40-token class -5.5), in
    test_equal_lengths_make_the_stratified_fixed_size_draw and in
    test_token_budget_calls_have_no_length_bias_in_use_counts."""
    buf, priorities = weighted_buffer()
    g = torch.Generator().manual_seed(11)
    drawn = [budget.draw_tokens(buf.ledger, buf.storage, MAX_TOKENS, g, NONE, "raise") for _ in range(BATCHES)]
    for slots, weights in drawn:
        assert int(LENGTHS[slots].sum()) <= MAX_TOKENS
        assert torch.allclose(weights.double(), priorities.min() / priorities[slots], rtol=1e-6)
    z = contrast_z(drawn)
    assert float(z.abs().max()) < Z_LIMIT, z

    wrong_exponent = [(slots, (priorities.min() / priorities[slots]).pow(0.5).float()) for slots, _ in drawn]
    assert float(contrast_z(wrong_exponent).abs().max()) > 2 * Z_LIMIT
    greedy = [greedy_fill(buf.sampler, priorities, g, MAX_TOKENS) for _ in range(BATCHES)]
    assert float(contrast_z(greedy)[3]) < -Z_LIMIT  # the 40-token class, under-drawn


# -------------------------------------------------------------------------------- compose(max_tokens)
def test_compose_fills_the_budget_after_the_fresh_rows():
    buf = tr.RolloutBuffer(256, max_staleness=3, max_reuse=3, seed=0)
    buf.add(make_batch(40, version=0, seed=1, min_len=2, max_len=30))  # stale from step 4 on
    buf.add(make_batch(150, version=2, seed=2, min_len=2, max_len=30))
    g = torch.Generator().manual_seed(0)
    for step, max_tokens in zip(range(3, 6), (400, 180, 900)):
        fresh = make_batch(8, version=step, seed=10 + step, min_len=2, max_len=30)
        fresh_tokens = sum(len(t) for t in fresh["tokens"])
        batch = buf.compose(fresh, max_tokens=max_tokens, generator=g)
        n = len(batch)
        assert batch.is_fresh[:8].all() and not batch.is_fresh[8:].any()
        assert int(stored_lengths(batch)[:8].sum()) == fresh_tokens
        used = int(stored_lengths(batch).sum())
        assert used <= max_tokens
        assert (batch.age <= 3).all()  # no replayed row past the staleness cap
        assert torch.equal(batch.weights[:8], torch.ones(8))
        if n > 8:  # the replayed part stopped only when less room was left than its longest candidate
            assert max_tokens - used < 30


def test_compose_refuses_fresh_rows_past_the_budget_and_adds_nothing():
    buf = tr.RolloutBuffer(64, seed=0)
    buf.add(make_batch(20, seed=1))
    fresh = make_batch(10, version=1, seed=2, min_len=10, max_len=10)
    state, before, size = buf.generator.get_state(), buf.metrics(), len(buf)
    with pytest.raises(ValueError, match="max_tokens=99: the 10 fresh rollouts alone hold 100 tokens"):
        buf.compose(fresh, max_tokens=99)
    assert len(buf) == size and buf.version == 0 and buf.metrics() == before
    assert torch.equal(buf.generator.get_state(), state)
    batch = buf.compose(fresh, max_tokens=100)  # exactly the fresh rows: nothing left to replay into
    assert len(batch) == 10 and batch.is_fresh.all()


@pytest.mark.parametrize("kwargs", [dict(replay_ratio=0.5), dict(n_replay=3), dict(multiple_of=4)])
def test_compose_max_tokens_is_alone(kwargs):
    buf = tr.RolloutBuffer(64, seed=0)
    buf.add(make_batch(20, seed=1))
    before = buf.metrics()
    with pytest.raises(ValueError, match="max_tokens sizes the batch by tokens"):
        buf.compose(make_batch(4, version=1, seed=2), max_tokens=500, **kwargs)
    assert len(buf) == 20 and buf.metrics() == before


def test_compose_budget_draw_is_the_same_rule():
    """The replayed part of compose(max_tokens=M) is the draw sample(max_tokens=M - fresh tokens)
    makes from the same generator state (stale rows aside; none here)."""
    fresh = make_batch(4, version=0, seed=5, min_len=3, max_len=8)
    room = 300 - sum(len(t) for t in fresh["tokens"])
    a, b = (tr.RolloutBuffer(128, seed=0) for _ in range(2))
    for buf in (a, b):
        buf.add(make_batch(100, seed=1, min_len=2, max_len=40))
    composed = a.compose(fresh, max_tokens=300, generator=torch.Generator().manual_seed(3))
    sampled = b.sample(max_tokens=room, generator=torch.Generator().manual_seed(3))
    assert torch.equal(composed.handles.slot[4:], sampled.handles.slot)
    assert torch.equal(composed.weights[4:], sampled.weights)


def test_token_budget_calls_have_no_length_bias_in_use_counts():
    """End to end through sample(): with equal priorities the 40-token rollouts are drawn as often
    as the 4-token ones (counts within 4 standard errors over 400 batches)."""
    buf = tr.RolloutBuffer(32, sampler=tr.UniformSampler(), seed=0)
    buf.add(rollouts(LENGTHS.tolist(), [1.0] * 32))
    g = torch.Generator().manual_seed(5)
    counts = torch.zeros(400, 4, dtype=torch.float64)
    for b in range(400):
        slots = buf.sample(max_tokens=MAX_TOKENS, generator=g).handles.slot
        counts[b].index_add_(0, LENGTH_CLASS[slots], torch.ones(slots.numel(), dtype=torch.float64))
    deviation = counts - counts.mean(1, keepdim=True)
    z = deviation.mean(0) / (deviation.std(0) / 400 ** 0.5)
    assert float(z.abs().max()) < Z_LIMIT, z


# ------------------------------------------------------------------------------- the packed layout
def test_packed_token_budget_batches_are_the_padded_ones():
    """sample(max_tokens) and compose(fresh, max_tokens) with layout="packed" draw exactly the rows
    the padded layout draws from the same seed, and cu_seqlens[-1] (the batch's tokens) stays within
    the budget: the budget counts the tokens a packed batch holds."""
    pair = [tr.RolloutBuffer(128, max_reuse=3, seed=0) for _ in range(2)]
    for buf in pair:
        buf.add(make_batch(100, seed=1, min_len=2, max_len=40))
    padded_buf, packed_buf = pair
    for step, max_tokens in enumerate((50, 333, 1000), start=1):
        padded = padded_buf.sample(max_tokens=max_tokens, generator=torch.Generator().manual_seed(step))
        packed = packed_buf.sample(max_tokens=max_tokens, generator=torch.Generator().manual_seed(step), layout="packed")
        assert torch.equal(packed.handles.slot, padded.handles.slot) and torch.equal(packed.weights, padded.weights)
        assert int(packed.cu_seqlens[-1]) == int(stored_lengths(padded).sum()) <= max_tokens
        assert torch.equal(packed.tokens, padded.tokens[padded.attention_mask])
        fresh = make_batch(6, version=step, seed=20 + step, min_len=2, max_len=30)
        budget_tokens = sum(len(t) for t in fresh["tokens"]) + max_tokens
        padded = padded_buf.compose(fresh, max_tokens=budget_tokens, generator=torch.Generator().manual_seed(step))
        packed = packed_buf.compose(fresh, max_tokens=budget_tokens, generator=torch.Generator().manual_seed(step),
                                    layout="packed")
        assert torch.equal(packed.is_fresh, padded.is_fresh) and int(packed.is_fresh.sum()) == 6
        assert torch.equal(packed.handles.slot, padded.handles.slot)
        assert int(packed.cu_seqlens[-1]) == int(stored_lengths(padded).sum()) <= budget_tokens
