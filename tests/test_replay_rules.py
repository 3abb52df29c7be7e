"""Prompt identity and the peer replay rules (issue 29 items 1 and 2) on small hand-built batches."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import torchreplay as tr
from torchreplay.rules import (
    GroupSwap,
    PromptIndex,
    PromptReplay,
    ResponseReuse,
    apply_rule,
    group_advantages,
    hash_prompts,
    replayable,
    prompt_key_field,
    with_prompt_keys,
    zero_variance_prompts,
)
from torchreplay.rules.peers import FreshGroups


def group(prompt: list[int], rewards: list[float], version: int = 0, group_id: int = 0) -> dict:
    """One prompt's group: the same prompt tokens, a distinct 2-token response per row."""
    n = len(rewards)
    tokens = [torch.tensor(prompt + [100 + i, 200 + i]) for i in range(n)]
    reward = torch.tensor(rewards, dtype=torch.float32)
    return {
        "tokens": tokens,
        "prompt_len": torch.full((n,), len(prompt)),
        "response_mask": [torch.arange(len(t)) >= len(prompt) for t in tokens],
        "logprobs": [torch.full((len(t),), -0.5) for t in tokens],
        "reward": reward,
        "advantage": group_advantages(reward),
        "group_id": torch.full((n,), group_id),
        "policy_version": version,
    }


def cat(*groups: dict) -> dict:
    out = {}
    for name in groups[0]:
        values = [g[name] for g in groups]
        if isinstance(values[0], list):
            out[name] = [t for v in values for t in v]
        elif isinstance(values[0], int):
            out[name] = values[0]
        else:
            out[name] = torch.cat(values)
    return out


def make_buffer(**kwargs) -> tr.RolloutBuffer:
    return tr.RolloutBuffer(64, sampler=tr.UniformSampler(), extra_fields=prompt_key_field(), seed=0, **kwargs)


A, B = [1, 2, 3], [4, 5, 6]


def key(prompt: list[int]) -> int:
    return int(hash_prompts([torch.tensor(prompt + [9])], torch.tensor([len(prompt)]))[0])


# ------------------------------------------------------------------------------- prompt identity
def test_prompt_key_depends_on_the_prompt_only():
    batch = cat(group(A, [0, 1]), group(B, [0, 1]))
    keys = hash_prompts(batch["tokens"], batch["prompt_len"])
    assert keys[0] == keys[1] and keys[2] == keys[3] and keys[0] != keys[2]
    assert bool((keys >= 0).all())
    # Order, length and the prompt/response boundary all change the key.
    assert key([3, 2, 1]) != key(A) and key([1, 2]) != key(A) and key([1, 2, 3, 9]) != key(A)
    # Every ragged form add accepts gives the same keys.
    values = torch.cat(batch["tokens"])
    offsets = torch.tensor([0, 5, 10, 15, 20])
    assert torch.equal(hash_prompts({"values": values, "offsets": offsets}, batch["prompt_len"]), keys)
    assert torch.equal(hash_prompts(torch.nested.nested_tensor(batch["tokens"]), batch["prompt_len"]), keys)


def test_prompt_key_is_the_same_in_another_process():
    """Not Python's salted hash(): a child with another PYTHONHASHSEED computes the same key."""
    code = ("import torch; from torchreplay.rules import hash_prompts; "
            "print(int(hash_prompts([torch.tensor([1, 2, 3, 9])], torch.tensor([3]))[0]))")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert int(out.stdout) == key(A)


def test_caller_ids_are_kept_and_checked():
    batch = group(A, [0, 1])
    assert with_prompt_keys(dict(batch, prompt_key=torch.tensor([7, 7])))["prompt_key"].tolist() == [7, 7]
    assert with_prompt_keys(batch)["prompt_key"].tolist() == [key(A)] * 2
    with pytest.raises(ValueError, match="prompt_key"):
        with_prompt_keys(dict(batch, prompt_key=torch.tensor([-1, 7])))
    with pytest.raises(TypeError, match="prompt_key"):
        with_prompt_keys(dict(batch, prompt_key=torch.tensor([1.0, 7.0])))


def test_zero_variance_prompts():
    keys = torch.tensor([5, 5, 5, 3, 3, 8])
    reward = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.5])
    assert zero_variance_prompts(keys, reward).tolist() == [5, 8]
    with pytest.raises(ValueError, match="reward"):
        zero_variance_prompts(keys, torch.full((6,), float("nan")))


def test_index_finds_the_live_rollouts_of_a_prompt_and_forgets_the_dead():
    buf = make_buffer(max_reuse=1)
    index = PromptIndex(buf)
    handles = buf.add(with_prompt_keys(cat(group(A, [0, 1]), group(B, [1, 1]))))
    index.note(handles, torch.tensor([key(A)] * 2 + [key(B)] * 2))
    assert sorted(index.live(key(A)).slot.tolist()) == handles.slot[:2].tolist()
    assert sorted(index.live(key(B)).slot.tolist()) == handles.slot[2:].tolist()
    buf.gather(handles.slot[:1])  # max_reuse=1: the first A rollout is evicted
    assert index.live(key(A)).slot.tolist() == handles.slot[1:2].tolist()
    assert len(index.live(12345)) == 0


@pytest.mark.parametrize("stored_field", [True, False])
def test_prompt_keys_survive_a_checkpoint_round_trip(stored_field):
    """The key is a stored rollout field (or, without it, re-hashed from the stored prompt): an index
    rebuilt on a restored buffer names the same rollouts, caller ids included."""
    extra = prompt_key_field() if stored_field else None
    buf = tr.RolloutBuffer(32, extra_fields=extra, seed=0)
    fresh = cat(group(A, [0, 1]), group(B, [1, 0]))
    if stored_field:
        fresh = dict(fresh, prompt_key=torch.tensor([11, 11, 22, 22]))
    handles = buf.add(fresh)
    twin = tr.RolloutBuffer(32, extra_fields=extra, seed=1)
    twin.load_state_dict(buf.state_dict())
    index = PromptIndex(twin)
    index.rebuild()
    first, second = (11, 22) if stored_field else (key(A), key(B))
    assert sorted(index.live(first).slot.tolist()) == handles.slot[:2].tolist()
    assert sorted(index.live(second).slot.tolist()) == handles.slot[2:].tolist()


def seed(buf: tr.RolloutBuffer, index: PromptIndex, *groups: dict) -> tr.Handles:
    """Store earlier rollouts directly (as a previous step would have) and index them."""
    batch = with_prompt_keys(cat(*groups))
    handles = buf.add(batch)
    index.note(handles, batch["prompt_key"])
    return handles


def rows(handles: tr.Handles, *i: int) -> list[int]:
    return [int(handles.slot[k]) for k in i]


# ----------------------------------------------------------------------------- AR3PO: reuse
def test_response_reuse_gives_an_all_wrong_group_the_newest_earlier_correct_response():
    """Fails if the fresh rows keep the caller's advantages instead of the pooled ones."""
    buf = make_buffer()
    index = PromptIndex(buf)
    old = seed(buf, index, group(A, [1, 0], 0, 0), group(B, [1, 1], 0, 1))
    newer = seed(buf, index, group(A, [1, 0], 0, 2))
    fresh = cat(group(A, [0, 0, 0], 1, 3), group(B, [0, 1, 0], 1, 4))
    step = apply_rule(buf, index, ResponseReuse(correct_reward=1.0, per_prompt=1), fresh)
    plan = step.plan
    # A had no correct answer: the newest correct A response joins it; B had one: nothing for B.
    assert plan.replay.slot.tolist() == rows(newer, 0) and rows(newer, 0) != rows(old, 0)
    pooled = group_advantages(torch.tensor([0.0, 0.0, 0.0, 1.0]))
    assert torch.allclose(plan.fresh_advantage[:3], pooled[:3]) and torch.allclose(plan.replay_advantage, pooled[3:])
    assert torch.equal(plan.fresh_advantage[3:], fresh["advantage"][3:])  # the caller's, untouched
    assert plan.replay_weights.tolist() == [1.0] and bool(plan.fresh_train.all())
    assert step.replayed.reward.tolist() == [1.0] and int(buf.ledger.slots.reuse[plan.replay.slot[0]]) == 1
    # The fresh rows are stored with the plan's advantages.
    assert torch.allclose(buf.ledger.slots.advantage[step.fresh.handles.slot], plan.fresh_advantage)


def test_two_groups_of_one_prompt_in_a_batch_keep_their_own_statistics():
    """A dataset with repeated questions puts two GRPO groups of the same prompt in one batch: each
    rule works per group (`group_id`), not per prompt key. Mutation caught: grouping by prompt key
    (the first version) merged them, so ResponseReuse found a correct answer in the merged group and
    reused nothing, and GroupSwap saw variance and swapped nothing."""
    buf = make_buffer()
    index = PromptIndex(buf)
    old = seed(buf, index, group(A, [1, 0], 0, 0))
    dead, alive = group(A, [0, 0], 1, 5), group(A, [1, 0, 0], 1, 6)
    step = apply_rule(buf, index, ResponseReuse(correct_reward=1.0, per_prompt=1), cat(dead, alive))
    assert step.plan.replay.slot.tolist() == rows(old, 0)
    pooled = group_advantages(torch.tensor([0.0, 0.0, 1.0]))
    assert torch.allclose(step.plan.fresh_advantage[:2], pooled[:2])
    assert torch.equal(step.plan.fresh_advantage[2:], alive["advantage"])  # the other group: untouched

    buf2 = make_buffer()
    index2 = PromptIndex(buf2)
    rule = GroupSwap(capacity=4)
    apply_rule(buf2, index2, rule, group(B, [1, 0], 0, 0))
    assert [len(h) for _, h in rule.groups] == [2]
    plan = apply_rule(buf2, index2, rule, cat(group(A, [0, 0], 1, 1), group(A, [1, 0], 1, 2)),
                      generator=torch.Generator().manual_seed(0)).plan
    assert plan.fresh_train.tolist() == [False, False, True, True] and len(plan.replay) == 2
    # Kept groups are GRPO groups: the A group with variance is kept alone, not merged with the dead one.
    assert sorted(len(h) for _, h in rule.groups) == [2, 2]
    with pytest.raises(ValueError, match="group_id"):
        apply_rule(buf2, index2, rule, {k: v for k, v in group(A, [0, 1], 2, 3).items() if k != "group_id"})


def test_response_reuse_respects_staleness_and_reuse_caps():
    """Fails if `replayable` drops its staleness test (the version-0 response is reused at version 2)."""
    buf = make_buffer(max_staleness=1, max_reuse=3)
    index = PromptIndex(buf)
    correct = seed(buf, index, group(A, [1, 0], 0, 0))
    rule = ResponseReuse(per_prompt=2)
    # Reused twice (reuse 1, then 2) ...
    for version in (0, 1):
        plan = apply_rule(buf, index, rule, group(A, [0, 0], version, 10 + version)).plan
        assert plan.replay.slot.tolist() == rows(correct, 0)
    # ... with one use left, but at version 2 it is 2 > max_staleness old: not reused.
    plan = apply_rule(buf, index, rule, group(A, [0, 0], 2, 12)).plan
    assert len(plan.replay) == 0 and torch.equal(plan.fresh_advantage, torch.zeros(2))
    buf2 = make_buffer(max_reuse=2)
    index2 = PromptIndex(buf2)
    correct = seed(buf2, index2, group(A, [1], 0, 0))
    assert apply_rule(buf2, index2, rule, group(A, [0, 0], 0, 1)).plan.replay.slot.tolist() == rows(correct, 0)
    assert apply_rule(buf2, index2, rule, group(A, [0, 0], 0, 2)).plan.replay.slot.tolist() == rows(correct, 0)
    assert not bool(replayable(buf2, correct, 0).any())  # at max_reuse: evicted (its slot may hold another)
    assert len(apply_rule(buf2, index2, rule, group(A, [0, 0], 0, 3)).plan.replay) == 0


# ---------------------------------------------------------------------- RePO: prompt replay
def test_prompt_replay_pooled_joins_stored_rollouts_of_each_prompt_to_its_group():
    """Fails if the fresh rows keep the caller's advantages instead of the pooled ones."""
    buf = make_buffer()
    index = PromptIndex(buf)
    old = seed(buf, index, group(A, [1, 0, 0.5], 0, 0), group(B, [1], 0, 1), group([7, 7], [1], 0, 2))
    fresh = cat(group(A, [1, 0], 1, 3), group(B, [0, 0], 1, 4))
    step = apply_rule(buf, index, PromptReplay(per_prompt=2, strategy="recent", advantage="pooled"), fresh)
    plan = step.plan
    # Newest first within each prompt (A's last two, then B's one); the other prompt is not asked for.
    assert plan.replay.slot.tolist() == rows(old, 2, 1, 3)
    a = group_advantages(torch.tensor([1.0, 0.0, 0.5, 0.0]))
    b = group_advantages(torch.tensor([0.0, 0.0, 1.0]))
    assert torch.allclose(plan.fresh_advantage, torch.cat([a[:2], b[:2]]))
    assert torch.allclose(plan.replay_advantage, torch.cat([a[2:], b[2:]]))
    assert plan.replay_weights.tolist() == [1.0] * 3
    assert step.replayed.reward.tolist() == [0.5, 0.0, 1.0]
    assert buf.ledger.slots.reuse[plan.replay.slot].tolist() == [1, 1, 1]


def test_prompt_replay_separate_normalizes_the_retrieved_rows_among_themselves():
    """RePO's default: an on-policy term with the caller's advantages and an off-policy term with
    the retrieved rows' own group advantages. Fails if the fresh advantages are touched (the pooled
    mode) or the retrieved rows keep their stored advantages."""
    buf = make_buffer()
    index = PromptIndex(buf)
    seed(buf, index, group(A, [1, 0, 0.5], 0, 0), group(B, [1], 0, 1))
    fresh = cat(group(A, [1, 0], 1, 3), group(B, [0, 0], 1, 4))
    caller = torch.tensor([0.7, -0.7, 0.0, 0.0])
    step = apply_rule(buf, index, PromptReplay(per_prompt=2), dict(fresh, advantage=caller))
    assert torch.equal(step.plan.fresh_advantage, caller)
    assert torch.allclose(step.plan.replay_advantage, torch.cat([
        group_advantages(torch.tensor([0.5, 0.0])), group_advantages(torch.tensor([1.0]))]))
    assert step.fresh.advantage.tolist() == pytest.approx(caller.tolist())
    with pytest.raises(ValueError, match="advantage"):
        PromptReplay(advantage="mixed")


def test_group_swap_state_round_trips_and_refuses_a_bad_one():
    """The kept groups survive state_dict -> load_state_dict into a new rule (so a resumed trainer
    swaps in the same groups); a malformed state is refused by name and changes nothing."""
    buf = make_buffer()
    index = PromptIndex(buf)
    rule = GroupSwap(capacity=4)
    apply_rule(buf, index, rule, cat(group(A, [1, 0], 0, 0), group(B, [1, 0.5, 0], 0, 1)))
    assert len(rule.groups) == 2
    twin = GroupSwap(capacity=4)
    twin.load_state_dict(rule.state_dict())
    assert [(s, h.slot.tolist(), h.generation.tolist()) for s, h in twin.groups] == \
        [(s, h.slot.tolist(), h.generation.tolist()) for s, h in rule.groups]
    gen = torch.Generator().manual_seed(3)
    swapped = apply_rule(buf, index, twin, group([9, 9], [0, 0], 1, 2), generator=gen).plan
    assert len(swapped.replay) > 0
    bad = dict(rule.state_dict(), size=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="sizes"):
        twin.load_state_dict(bad)
    with pytest.raises(ValueError, match="scores"):
        twin.load_state_dict(dict(rule.state_dict(), score=torch.tensor([float("nan"), 1.0])))
    assert len(twin.groups) == 2
    # A state naming slots past this buffer's capacity is dropped at the next plan, not an IndexError.
    far = dict(rule.state_dict(), slot=rule.state_dict()["slot"] + 10_000)
    twin.load_state_dict(far)
    assert len(apply_rule(buf, index, twin, group([8, 8], [0, 0], 2, 3)).plan.replay) == 0


def test_prompt_replay_strategies():
    buf = make_buffer()
    index = PromptIndex(buf)
    old = seed(buf, index, group(A, [0.2, 1, 0.5, 0], 0, 0))
    groups = FreshGroups.of(buf, with_prompt_keys(group(A, [1, 0], 1, 1)))
    best = PromptReplay(per_prompt=2, strategy="reward").plan(buf, index, groups)
    assert best.replay.slot.tolist() == rows(old, 1, 2)
    draws = {tuple(PromptReplay(per_prompt=2, strategy="random").plan(
        buf, index, groups, torch.Generator().manual_seed(s)).replay.slot.tolist()) for s in range(40)}
    assert all(len(set(d)) == 2 and set(d) <= set(old.slot.tolist()) for d in draws) and len(draws) > 3
    with pytest.raises(ValueError, match="strategy"):
        PromptReplay(strategy="oldest")


def test_prompt_replay_respects_staleness_and_reuse_caps():
    """Fails if `replayable` drops its staleness test. The reuse cap holds through liveness: the
    ledger evicts a rollout when it reaches max_reuse, and a rule takes a rollout once a step."""
    buf = make_buffer(max_staleness=2, max_reuse=2)
    index = PromptIndex(buf)
    older = seed(buf, index, group(A, [1, 0], 0, 0))
    newer = seed(buf, index, group(A, [1, 0], 1, 1))
    buf.gather(newer.slot[:1])  # one use left for newer[0]; newer[1] still has two
    buf.gather(newer.slot[:1])  # newer[0] at the cap: evicted
    groups = FreshGroups.of(buf, with_prompt_keys(group(A, [0, 1], 3, 2)))
    plan = PromptReplay(per_prompt=4).plan(buf, index, groups)
    # At version 3 the version-0 rollouts are 3 > 2 old; newer[0] is spent: only newer[1] joins.
    assert plan.replay.slot.tolist() == rows(newer, 1) and rows(older, 0) != rows(newer, 1)


# --------------------------------------------------------------------------- TRL: group swap
def score(rewards: list[float]) -> float:
    reward = torch.tensor(rewards)
    return float(group_advantages(reward).abs().sum()) * float(reward.double().std())


def test_group_swap_keeps_the_top_groups_and_swaps_zero_variance_ones():
    buf = make_buffer()
    index = PromptIndex(buf)
    rule = GroupSwap(capacity=2)
    C, D = [7, 7], [8, 8]
    first = apply_rule(buf, index, rule, cat(group(A, [1, 0]), group(B, [1, 0, 0, 0], 0, 1), group(C, [1, 0, 0], 0, 2)))
    assert len(first.plan.replay) == 0  # nothing kept yet: every group trains as it is
    # capacity 2: the two highest of the three scores, highest first.
    expected = sorted([score([1, 0]), score([1, 0, 0, 0]), score([1, 0, 0])], reverse=True)[:2]
    assert [s for s, _ in rule.groups] == pytest.approx(expected)
    top = {tuple(h.slot.tolist()) for _, h in rule.groups}
    fresh = cat(group(D, [0, 0], 1, 3), group(A, [1, 1], 1, 4), group(C, [0, 1], 1, 5))
    step = apply_rule(buf, index, rule, fresh, generator=torch.Generator().manual_seed(0))
    plan = step.plan
    # D and the new A group have zero variance: each is replaced by a different kept group.
    assert plan.fresh_train.tolist() == [False, False, False, False, True, True]
    swapped = plan.replay.slot.tolist()
    assert set(swapped) == {s for g in top for s in g} and len(swapped) == len(set(swapped))
    assert torch.equal(plan.replay_advantage, buf.ledger.slots.advantage[plan.replay.slot])  # stored, as scored
    assert torch.equal(plan.fresh_advantage, fresh["advantage"]) and plan.replay_weights.eq(1).all()


def test_group_swap_draws_in_proportion_to_the_score():
    """Two kept groups with scores s1 < s2 (ratio 1 : 3); 2000 draws with seeds 0..1999: the share of
    the high-score group is 0.75 with sd 0.0097; |share - 0.75| < 0.04 is 4 sd. A uniform draw
    (share 0.5, the mutation `multinomial(scores > 0)`) lies 26 sd away and fails."""
    buf = make_buffer()
    index = PromptIndex(buf)
    rule = GroupSwap(capacity=4)
    apply_rule(buf, index, rule, cat(group(A, [1, 0], 0, 0), group(B, [1, 0], 0, 1)))
    (s1, low), (s2, high) = sorted(rule.groups, key=lambda e: e[0])
    rule.groups = [(1.0, low), (3.0, high)]
    groups = FreshGroups.of(buf, with_prompt_keys(group([9], [0, 0], 0, 2)))
    hits = sum(rule.plan(buf, index, groups, torch.Generator().manual_seed(s)).replay.slot.tolist()
               == high.slot.tolist() for s in range(2000))
    assert abs(hits / 2000 - 0.75) < 0.04


def test_group_swap_respects_staleness_and_reuse_caps():
    """Fails if `replayable` drops its staleness test (the kept group is swapped in 3 versions later)."""
    buf = make_buffer(max_staleness=1, max_reuse=2)
    index = PromptIndex(buf)
    rule = GroupSwap(capacity=4)
    apply_rule(buf, index, rule, group(A, [1, 0], 0, 0))  # stored and used once (fresh)
    kept = rule.groups[0][1]
    step = apply_rule(buf, index, rule, group(B, [0, 0], 1, 1))
    assert step.plan.replay.slot.tolist() == kept.slot.tolist()  # second use: at the cap, evicted
    assert not bool(replayable(buf, kept, 1).any())
    step = apply_rule(buf, index, rule, group(B, [0, 0], 1, 2))
    assert len(step.plan.replay) == 0 and bool(step.plan.fresh_train.all()) and rule.groups == []
    # Staleness: a kept group 2 > max_staleness versions behind the fresh batch is not drawn.
    apply_rule(buf, index, rule, group([7, 7], [1, 0], 2, 3))
    groups = FreshGroups.of(buf, with_prompt_keys(group(B, [0, 0], 4, 4)))
    assert len(rule.groups) == 1 and len(rule.plan(buf, index, groups).replay) == 0 and rule.groups == []


def test_group_advantages_by_hand():
    """Rewards 0, 0, 0, 1: mean 0.25, std with Bessel's correction sqrt(0.75 / 3) = 0.5, so the
    advantages are -0.5, -0.5, -0.5, 1.5 (the population std, 0.433, would give -0.577 ... 1.732)."""
    assert group_advantages(torch.tensor([0.0, 0.0, 0.0, 1.0]), eps=0.0).tolist() == [-0.5, -0.5, -0.5, 1.5]
    assert group_advantages(torch.tensor([3.0])).tolist() == [0.0]


def test_prompt_keys_survive_resharding(tmp_path):
    """Resharding (`DistributedRolloutBuffer.from_checkpoint` on another world size) imports each old
    shard into one new rank with `import_checkpoint(select=...)`: the caller's keys come along."""
    from torchreplay.checkpoint import Checkpointer

    uri = f"file://{tmp_path}/old"
    old = tr.RolloutBuffer(32, extra_fields=prompt_key_field(), checkpoint=Checkpointer(uri, interval_s=3600), seed=0)
    old.add(dict(group(A, [0, 1], 0, 0), prompt_key=torch.tensor([11, 11])))
    old.add(dict(group(B, [1, 0, 1], 0, 1), prompt_key=torch.tensor([22, 22, 22])))
    old.close()
    found = {}
    for rank in (0, 1):
        new = tr.RolloutBuffer(32, extra_fields=prompt_key_field(), seed=rank)
        new.import_checkpoint(uri, select=lambda i, count, rank=rank: i % 2 == rank)
        index = PromptIndex(new)
        index.rebuild()
        for k in (11, 22):
            rewards = new.ledger.slots.reward[index.live(k).slot].tolist()
            if rewards:
                found[k] = (rank, sorted(rewards))
    assert found == {11: (0, [0.0, 1.0]), 22: (1, [0.0, 1.0, 1.0])}


def test_bad_rule_arguments_are_refused_by_name_before_anything_changes():
    """A bad replay_ratio is refused before the rule's reads count any use (mutation caught: the
    check left to compose, after `gather` had counted uses); constructor and state arguments are
    checked by name, never truncated (2.7 rollouts, 0.7 as slot 0)."""
    buf = make_buffer()
    index = PromptIndex(buf)
    old = seed(buf, index, group(A, [1, 0], 0, 0))
    before = buf.ledger.slots.reuse.clone()
    for bad in (1.5, -0.1, float("nan"), "half"):
        with pytest.raises(ValueError, match="replay_ratio"):
            apply_rule(buf, index, PromptReplay(per_prompt=2), group(A, [0, 1], 1, 1), replay_ratio=bad)
        assert torch.equal(buf.ledger.slots.reuse, before) and len(buf) == len(old)
    refused = ((lambda: ResponseReuse(per_prompt=2.7), "per_prompt"),
               (lambda: ResponseReuse(per_prompt=True), "per_prompt"),
               (lambda: PromptReplay(per_prompt="3"), "per_prompt"),
               (lambda: ResponseReuse(eps=-1.0), "eps"),
               (lambda: PromptReplay(eps=float("nan")), "eps"),
               (lambda: ResponseReuse(correct_reward=float("nan")), "correct_reward"),
               (lambda: GroupSwap(capacity=2.5), "capacity"))
    for make, match in refused:
        with pytest.raises((TypeError, ValueError), match=match):
            make()
    rule = GroupSwap(capacity=4)
    good = {"score": torch.tensor([1.0]), "size": torch.tensor([2]), "slot": torch.tensor([0, 1]),
            "generation": torch.tensor([0, 0])}
    for change, error, match in (({"slot": torch.tensor([0.7, 1.0])}, TypeError, "'slot'"),
                                 ({"generation": torch.tensor([-1, 0])}, ValueError, "'generation'"),
                                 ({"score": torch.tensor([True])}, TypeError, "'score'"),
                                 ({"size": torch.tensor([[2]])}, TypeError, "'size'")):
        with pytest.raises(error, match=match):
            rule.load_state_dict(dict(good, **change))
    with pytest.raises(ValueError, match="'generation'"):
        rule.load_state_dict({k: v for k, v in good.items() if k != "generation"})
    assert rule.groups == []
    rule.load_state_dict(good)
    assert [(s, h.slot.tolist()) for s, h in rule.groups] == [(1.0, [0, 1])]
