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
