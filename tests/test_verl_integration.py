"""verl's DataProto in and out of the buffer (torchreplay.integrations.verl): built with verl's own
DataProto and position-id helper, a batch comes back bit for bit, uids map to stable group ids, the
side table of non-tensor columns forgets evicted rollouts, and bad batches are refused first."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from extras import require

# A failure, not a skip, in the environment `make` built, which installs it (see extras.py).
require("verl", "pip install --no-deps 'verl==0.9.1' and torchreplay[test-verl]; make test installs it")

from verl import DataProto  # noqa: E402
from verl.utils.model import compute_position_id_with_mask  # noqa: E402

import torchreplay as tr  # noqa: E402
from torchreplay.integrations.verl import DataProtoAdapter, verl_fields  # noqa: E402

PAD = 151643  # Qwen2's pad id: not 0, so a pad written as 0 would show
PROMPT_WIDTH, RESPONSE_WIDTH = 7, 9


def make_dataproto(n_prompts=3, n=4, seed=0, positions="mask", uid_prefix="", constructor="single",
                   prompt_width=PROMPT_WIDTH, unpadded=False):
    """A verl batch after compute_advantage: GRPO, `n` rollouts per prompt (interleaved, as
    `DataProto.repeat` lays them out), left-padded prompts, right-padded responses (`unpadded`: every
    row full width). `positions` is how position_ids were made: "mask" (compute_position_id_with_mask,
    verl's text rollouts), "hf_rollout" (its response positions count on over the padding), "rope3"
    (get_rope_index's [B, 3, T], 1 at padding), "rope4" (the agent loop's [B, 4, T]: a text row on top)."""
    g = torch.Generator().manual_seed(seed)
    size, width = n_prompts * n, prompt_width + RESPONSE_WIDTH
    prompt_len = torch.randint(1, prompt_width + 1, (n_prompts,), generator=g)
    prompt_len[0] = prompt_width  # one prompt with no padding at all
    prompt_len = prompt_len.repeat_interleave(n)
    response_len = torch.randint(1, RESPONSE_WIDTH + 1, (size,), generator=g)
    response_len[1] = RESPONSE_WIDTH
    response_len[3:4] = RESPONSE_WIDTH - 2
    if unpadded:
        prompt_len[:], response_len[:] = prompt_width, RESPONSE_WIDTH
    prompt_attn = (torch.arange(prompt_width) >= prompt_width - prompt_len.unsqueeze(1)).long()
    response_attn = (torch.arange(RESPONSE_WIDTH) < response_len.unsqueeze(1)).long()
    prompts = torch.randint(3, 150000, (n_prompts, prompt_width), generator=g).repeat_interleave(n, 0)
    prompts = prompts.masked_fill(prompt_attn == 0, PAD)
    responses = torch.randint(3, 150000, (size, RESPONSE_WIDTH), generator=g).masked_fill(response_attn == 0, PAD)
    attention_mask = torch.cat([prompt_attn, response_attn], 1)
    response_mask = response_attn.clone()
    response_mask[2, : max(int(response_len[2]) - 1, 0)] = 0  # a multi-turn row: tool output is not trained on
    # A multi-turn row that ends in tool output: those tokens are kept (attention_mask), not trained on.
    response_mask[3:4, 4:] = 0
    if positions.startswith("rope"):  # 1 at padding; vision tokens set the h/w channels apart
        channels = int(positions[-1])
        position_ids = torch.ones(size, channels, width, dtype=torch.long)
        for i in range(size):
            cols = attention_mask[i].nonzero().flatten()
            base = torch.arange(cols.numel())
            position_ids[i, :, cols] = torch.stack([base, base + i % 3, base + 2 * (i % 2), base][:channels])
    elif positions == "hf_rollout":  # verl/workers/rollout/hf_rollout.py
        prompt_positions = compute_position_id_with_mask(prompt_attn)
        position_ids = torch.cat([prompt_positions, prompt_positions[:, -1:] + torch.arange(1, RESPONSE_WIDTH + 1)], 1)
    else:
        position_ids = compute_position_id_with_mask(attention_mask)
    old_log_probs = -torch.rand(size, RESPONSE_WIDTH, generator=g) * response_attn
    scores = torch.zeros(size, RESPONSE_WIDTH)
    scores[torch.arange(size), response_len - 1] = torch.randint(0, 2, (size,), generator=g).float()
    # verl's GRPO (core_algos.compute_grpo_outcome_advantage): group-normalized outcome, times the mask.
    outcome = scores.sum(-1).view(n_prompts, n)
    normalized = ((outcome - outcome.mean(1, keepdim=True)) / (outcome.std(1, keepdim=True) + 1e-6)).flatten()
    advantages = normalized.unsqueeze(-1) * response_mask
    uids = np.array([f"{uid_prefix}uid-{seed}-{k}" for k in range(n_prompts) for _ in range(n)], dtype=object)
    tensors = {
        "prompts": prompts, "responses": responses, "response_mask": response_mask, "input_ids":
        torch.cat([prompts, responses], 1), "attention_mask": attention_mask, "position_ids": position_ids,
        "rollout_log_probs": (old_log_probs - 0.01 * torch.rand(size, RESPONSE_WIDTH, generator=g)) * response_attn,
        "old_log_probs": old_log_probs, "ref_log_prob": -torch.rand(size, RESPONSE_WIDTH, generator=g) * response_attn,
        "token_level_scores": scores, "token_level_rewards": scores.clone(), "advantages": advantages,
        "returns": advantages.clone(),
        # MoE routing over the whole sequence, as the agent loop records it
        "routed_experts": torch.randint(0, 64, (size, width, 2, 3), generator=g, dtype=torch.int16)
        * attention_mask.view(size, width, 1, 1).to(torch.int16),
    }
    non_tensors = {
        "uid": uids,
        "data_source": np.array(["openai/gsm8k"] * size, dtype=object),
        "reward_model": np.array([{"style": "rule", "ground_truth": str(i // n)} for i in range(size)], dtype=object),
        "extra_info": np.array([{"index": i // n, "split": "train", "tags": [i, "x"]} for i in range(size)],
                               dtype=object),
        "__num_turns__": np.array([2 if i == 2 else 1 for i in range(size)], dtype=np.int32),
        "ability": np.array(["math" + "!" * (5 - seed % 5)] * size),  # fixed-width strings, wider for lower seeds
    }
    meta_info = {"temperature": 1.0, "global_steps": seed, "global_token_num": attention_mask.sum(-1).tolist()}
    if constructor == "single":
        return DataProto.from_single_dict({**tensors, **non_tensors}, meta_info=meta_info)
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta_info)


def assert_same(got, want, rows=None, widened=()):
    """Every tensor bit for bit in the same dtype, every non-tensor value equal (`widened`: string
    columns that may be wider, as replayed rows with longer strings make them)."""
    rows = slice(None) if rows is None else rows
    assert list(got.batch.keys()) == list(want.batch.keys())
    for key in want.batch.keys():  # noqa: SIM118 - iterating a TensorDict yields rows
        a, b = got.batch[key], want.batch[key][rows]
        assert a.dtype == b.dtype, key
        assert torch.equal(a, b), key
    assert list(got.non_tensor_batch) == list(want.non_tensor_batch)
    for key, column in want.non_tensor_batch.items():
        if key in widened:
            assert np.promote_types(got.non_tensor_batch[key].dtype, column.dtype) == got.non_tensor_batch[key].dtype
        else:
            assert got.non_tensor_batch[key].dtype == column.dtype, key
        assert list(got.non_tensor_batch[key]) == list(column[rows]), key


def buffer_for(data, capacity=64, **kwargs):
    return tr.RolloutBuffer(capacity, extra_fields=verl_fields(data), **kwargs)


@pytest.mark.parametrize("positions", ["mask", "hf_rollout", "rope3", "rope4"])
@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_round_trip_is_bit_for_bit(positions, padding_side):
    """Row 3's response ends in untrained tokens: stored to the attention mask's end, not the
    response_mask's last 1 (fails if from_dataproto passes no completion_extent to from_padded)."""
    data = make_dataproto(positions=positions, constructor="single" if padding_side == "right" else "dict")
    buf = buffer_for(data, padding_side=padding_side, token_dtype=torch.int32)
    adapter = DataProtoAdapter(buf)
    handles = adapter.add(data, version=3)
    batch = buf.gather(handles.slot, count_use=False)
    assert_same(adapter.to_dataproto(batch, template=data), data)
    assert adapter.to_dataproto(batch, template=data).meta_info == data.meta_info

    # The rollout-level advantage is the GRPO scalar exactly; reward the summed token scores.
    mask = data.batch["response_mask"].bool()
    scalar = torch.stack([row[m][0] for row, m in zip(data.batch["advantages"], mask)])
    assert torch.equal(batch.advantage, scalar)
    assert torch.equal(batch.reward, data.batch["token_level_scores"].sum(-1))
    assert torch.equal(batch.policy_version, torch.full((len(data),), 3))
    # logprobs: old_log_probs over the response, 0 over the prompt.
    if padding_side == "right":
        over_prompt = torch.arange(batch.tokens.shape[1]) < batch.prompt_len.unsqueeze(1)
        assert not batch.logprobs[over_prompt].any()
        assert torch.equal(batch.logprobs[batch.response_mask], data.batch["old_log_probs"][mask])


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_a_packed_batch_converts_and_is_what_verls_remove_padding_path_unpads(padding_side):
    """to_dataproto takes a packed batch (layout="packed") and gives the DataProto the padded one
    gives, bit for bit; verl's own unpad_input (its actor's use_remove_padding path) of that
    DataProto yields the packed batch's tokens, cu_seqlens and max_seqlen, and its position_ids
    under the mask are the packed position_ids. compose(..., layout="packed") goes through too."""
    from verl.utils.attention_utils import index_first_axis, unpad_input

    data = make_dataproto(positions="mask")
    buf = buffer_for(data, padding_side=padding_side)
    adapter = DataProtoAdapter(buf)
    handles = adapter.add(data, version=3)
    packed = buf.gather(handles.slot, count_use=False, layout="packed")
    out = adapter.to_dataproto(packed, template=data)
    assert_same(out, data)
    ids, indices, cu_seqlens, max_seqlen, _ = unpad_input(out.batch["input_ids"].unsqueeze(-1),
                                                          out.batch["attention_mask"])
    assert torch.equal(ids.squeeze(-1), packed.tokens.to(ids.dtype))
    assert torch.equal(cu_seqlens, packed.cu_seqlens) and max_seqlen == packed.max_seqlen
    positions = index_first_axis(out.batch["position_ids"].reshape(-1, 1), indices).squeeze(-1)
    assert torch.equal(positions, packed.position_ids)

    fresh = make_dataproto(seed=5, uid_prefix="new-")
    mixed = adapter.compose(fresh, version=4, n_replay=4, layout="packed", generator=torch.Generator().manual_seed(0))
    assert isinstance(mixed, tr.PackedReplayBatch) and len(mixed) == len(fresh) + 4
    assert_same(adapter.to_dataproto(mixed, template=fresh)[: len(fresh)], fresh)


def test_round_trip_into_a_template_of_other_rows():
    """Rows come back in another batch's layout, padded with its pad id and position convention."""
    first, second = make_dataproto(seed=1), make_dataproto(seed=2)
    buf = buffer_for(first)
    adapter = DataProtoAdapter(buf)
    handles = adapter.add(first, version=0)
    out = adapter.to_dataproto(buf.gather(handles.slot.flip(0), count_use=False), template=second)
    assert_same(out, first, rows=torch.arange(len(first) - 1, -1, -1).tolist())
    assert out.meta_info["global_steps"] == second.meta_info["global_steps"]
    assert out.meta_info["global_token_num"] == first.batch["attention_mask"].flip(0).sum(-1).tolist()


@pytest.mark.parametrize("positions", ["hf_rollout", "rope4"])
def test_padding_seen_in_the_data_is_used_when_the_template_has_none(positions):
    data, unpadded = make_dataproto(seed=1, positions=positions), make_dataproto(seed=2, positions=positions,
                                                                                 unpadded=True)
    adapter = DataProtoAdapter(buffer_for(data))
    handles = adapter.add(data, version=0)
    assert_same(adapter.to_dataproto(adapter.buffer.gather(handles.slot, count_use=False), template=unpadded), data)


def test_optional_keys():
    """No token_level_scores: no reward (NaN in the buffer). No uid: each row its own group. No
    response_mask: the response's attention mask."""
    data = make_dataproto()
    data.pop(batch_keys=["token_level_scores", "token_level_rewards", "response_mask"], non_tensor_batch_keys=["uid"])
    buf = buffer_for(data)
    adapter = DataProtoAdapter(buf)
    handles = adapter.add(data, version=0)
    adapter.add(data, version=1)
    batch = buf.gather(torch.arange(len(buf)), count_use=False)
    assert batch.reward.isnan().all()
    assert batch.group_id.unique().numel() == len(buf) and (batch.group_id < 0).all()
    assert torch.equal(batch.response_mask, batch.attention_mask.bool() & (
        torch.arange(batch.tokens.shape[1]) >= batch.prompt_len.unsqueeze(1)))
    assert_same(adapter.to_dataproto(buf.gather(handles.slot, count_use=False), template=data), data)
    with pytest.raises(ValueError, match="'token_level_scores': the template has it"):
        adapter.to_dataproto(batch, template=make_dataproto())
    with_uid = make_dataproto()
    with_uid.pop(batch_keys=["token_level_scores", "token_level_rewards", "response_mask"])
    with pytest.raises(ValueError, match="'uid': row 0"):
        adapter.to_dataproto(batch, template=with_uid)


def test_uid_map_is_stable_across_adds_and_adapters():
    data = make_dataproto(n_prompts=4)
    buf = buffer_for(data)
    adapter = DataProtoAdapter(buf)
    first = buf.gather(adapter.add(data, version=0).slot, count_use=False).group_id
    second = buf.gather(adapter.add(data, version=1).slot, count_use=False).group_id
    assert torch.equal(first, second)
    uids = data.non_tensor_batch["uid"]
    for i in range(len(uids)):
        for j in range(len(uids)):
            assert (first[i] == first[j]) == (uids[i] == uids[j])
    other = DataProtoAdapter(buffer_for(data))  # another process or rank maps the same way
    assert torch.equal(other.from_dataproto(data, version=0)["group_id"], first)
    out = adapter.to_dataproto(buf.gather(torch.arange(len(buf)), count_use=False), template=data)
    assert list(out.non_tensor_batch["uid"]) == list(uids) * 2


def test_compose_rounds_to_the_data_parallel_size():
    dp = 8
    old, fresh = make_dataproto(n_prompts=4, seed=0, uid_prefix="old-"), make_dataproto(n_prompts=3, seed=1)
    buf = buffer_for(old)
    adapter = DataProtoAdapter(buf)
    adapter.add(old, version=0)
    mixed = adapter.compose(fresh, version=1, replay_ratio=0.3, multiple_of=dp)
    out = adapter.to_dataproto(mixed, template=fresh, multiple_of=dp)
    assert len(out) % dp == 0 and len(out) > len(fresh)
    chunks = out.chunk(dp)
    assert [len(c) for c in chunks] == [len(out) // dp] * dp
    assert_same(out[: len(fresh)], fresh, widened=("ability",))  # the fresh rows first, exactly
    assert all(u.startswith("old-") for u in out.non_tensor_batch["uid"][len(fresh):])
    assert set(out.non_tensor_batch["ability"][len(fresh):]) == {old.non_tensor_batch["ability"][0]}
    with pytest.raises(ValueError, match="multiple_of"):
        adapter.to_dataproto(mixed, template=fresh, multiple_of=len(out) + 1)


def test_is_weights_go_into_rollout_is_weights_on_request():
    old, fresh = make_dataproto(n_prompts=4, seed=0, uid_prefix="old-"), make_dataproto(n_prompts=3, seed=1)
    buf = buffer_for(old, sampler=tr.PrioritizedSampler(alpha=1.0, beta=1.0, weight_norm="batch_max"), seed=0)
    adapter = DataProtoAdapter(buf)
    adapter.add(old, version=0)
    mixed = adapter.compose(fresh, version=1, n_replay=8)
    assert bool((mixed.weights < 1).any())  # otherwise the test proves nothing
    plain = adapter.to_dataproto(mixed, template=fresh)
    weighted = adapter.to_dataproto(mixed, template=fresh, is_weights=True)
    assert "rollout_is_weights" not in plain.batch.keys()
    width = fresh.batch["responses"].shape[1]
    assert torch.equal(weighted.batch["rollout_is_weights"], mixed.weights[:, None].expand(len(mixed), width))
    assert torch.equal(weighted.batch["advantages"], plain.batch["advantages"])  # advantages untouched


def test_rows_evicted_by_the_reuse_cap_still_convert():
    old, fresh = make_dataproto(seed=0, uid_prefix="old-"), make_dataproto(seed=1)
    buf = buffer_for(old, max_reuse=1)
    adapter = DataProtoAdapter(buf)
    adapter.add(old, version=0)
    mixed = adapter.compose(fresh, version=1, n_replay=4)
    assert len(buf) == len(old) - 4  # every row of `mixed` reached its cap and was evicted
    out = adapter.to_dataproto(mixed, template=fresh)
    assert_same(out[: len(fresh)], fresh, widened=("ability",))
    assert len(out) == len(fresh) + 4


def test_side_table_forgets_evicted_rollouts():
    capacity, per_add = 8, 4
    datas = [make_dataproto(n_prompts=1, n=per_add, seed=s) for s in range(6)]
    buf = buffer_for(datas[0], capacity=capacity)
    adapter = DataProtoAdapter(buf)
    for step, data in enumerate(datas):
        adapter.add(data, version=step)
        assert len(adapter) <= capacity + per_add  # the last add's evictions go at the next sweep
    adapter.prune()
    assert len(adapter) == len(buf) == capacity
    assert adapter.uid_count == 2  # uid strings go with their last rollout (one uid per add here)
    live = buf.slots.live.nonzero().flatten()
    out = adapter.to_dataproto(buf.gather(live, count_use=False), template=datas[-1])
    assert set(out.non_tensor_batch["uid"]) == {datas[-1].non_tensor_batch["uid"][0],
                                                datas[-2].non_tensor_batch["uid"][0]}
    stale = buf.gather(live, count_use=False)
    buf.advance(100)
    buf.max_staleness = 0  # evicts every rollout
    assert adapter.prune() == capacity
    assert len(buf) == 0 and len(adapter) == 0 and adapter.uid_count == 0
    with pytest.raises(ValueError, match="'uid': row 0"):
        adapter.to_dataproto(stale, template=datas[-1])


def mutate(data, key, value):
    data.batch[key] = value
    return data


@pytest.mark.parametrize("case, match", [
    ("no responses", "'responses'"),
    ("no attention_mask", "'attention_mask'"),
    ("short old_log_probs", "'old_log_probs'"),
    ("short response_mask", "'response_mask'"),
    ("wide position_ids", "'position_ids'"),
    ("hole in the prompt mask", "'attention_mask', row 3"),
    ("prompts not in input_ids", "'prompts'"),
    ("undeclared key", "'entropys'"),
    ("no advantages", "'advantages'"),
    ("key named like a padded layout key", "'completion_mask' has the name of a padded layout key"),
])
def test_bad_batches_are_refused_before_anything_changes(case, match):
    data = make_dataproto()
    buf = buffer_for(data)
    adapter = DataProtoAdapter(buf)
    size, width = len(data), PROMPT_WIDTH + RESPONSE_WIDTH
    if case.startswith("no "):
        data.pop(batch_keys=[case[3:]])
    elif case == "short old_log_probs":
        mutate(data, "old_log_probs", data.batch["old_log_probs"][:, :-1])
    elif case == "short response_mask":
        mutate(data, "response_mask", data.batch["response_mask"][:, 1:])
    elif case == "wide position_ids":
        mutate(data, "position_ids", torch.zeros(size, width + 1, dtype=torch.long))
    elif case == "hole in the prompt mask":
        data.batch["attention_mask"][3, PROMPT_WIDTH - 1] = 0
    elif case == "prompts not in input_ids":
        data.batch["prompts"][0, -1] += 1
    elif case == "undeclared key":
        mutate(data, "entropys", torch.rand(size, RESPONSE_WIDTH))
    elif case == "key named like a padded layout key":  # to_dataproto could not read it back
        mutate(data, "completion_mask", torch.ones(size, RESPONSE_WIDTH, dtype=torch.long))
    with pytest.raises(ValueError, match=match):
        adapter.add(data, version=0)
    with pytest.raises(ValueError, match=match):
        adapter.compose(data, version=0, n_replay=0)
    assert len(buf) == 0 and len(adapter) == 0 and buf.version == 0


def test_wrong_types_are_refused():
    data = make_dataproto()
    adapter = DataProtoAdapter(buffer_for(data))
    with pytest.raises(TypeError, match="DataProto"):
        adapter.add([1, 2, 3], version=0)
    with pytest.raises(TypeError, match="'responses'"):
        adapter.add(mutate(data, "responses", data.batch["responses"].float()), version=0)
    with pytest.raises(TypeError, match="RolloutBuffer"):
        DataProtoAdapter(object())


def test_rows_wider_than_the_template_are_refused():
    data = make_dataproto()
    adapter = DataProtoAdapter(buffer_for(data))
    handles = adapter.add(data, version=0)
    narrow = make_dataproto(prompt_width=PROMPT_WIDTH - 2)  # row 0 of `data` has the full prompt width
    with pytest.raises(ValueError, match="'prompts': row 0"):
        adapter.to_dataproto(adapter.buffer.gather(handles.slot[:1], count_use=False), template=narrow)


def test_verl_fields():
    data = make_dataproto(positions="rope3")
    fields = verl_fields(data)
    assert fields["position_ids"].shape == (3,) and fields["position_ids"].kind == "token"
    assert fields["routed_experts"].shape == (2, 3) and fields["routed_experts"].dtype == torch.int16
    assert fields["advantages"].kind == "token" and "old_log_probs" not in fields and "responses" not in fields
    by_name = verl_fields(["position_ids", "rollout_log_probs", "advantages", "responses"], position_channels=4)
    assert by_name["position_ids"].shape == (4,) and by_name["advantages"].dtype == torch.float32
    with pytest.raises(ValueError, match="'routed_experts'"):
        verl_fields(["routed_experts"])


def test_verl_is_imported_only_by_to_dataproto(monkeypatch):
    code = "import sys, torchreplay.integrations.verl; assert 'verl' not in sys.modules, 'verl imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
    data = make_dataproto()
    adapter = DataProtoAdapter(buffer_for(data))
    handles = adapter.add(data, version=0)
    monkeypatch.setitem(sys.modules, "verl", None)  # as if verl were not installed
    with pytest.raises(ImportError, match=r"pip install torchreplay\[verl\]"):
        adapter.to_dataproto(adapter.buffer.gather(handles.slot, count_use=False), template=data)


def test_adapter_state_survives_a_buffer_restore_as_json(tmp_path):
    """The uid map and non-tensor columns saved as JSON beside the buffer's checkpoint: after both
    are restored, rows added before the restore convert back exactly."""
    import json

    data = make_dataproto(positions="rope4")
    buf = buffer_for(data, checkpoint=tr.Checkpointer(f"file://{tmp_path}/ckpt", interval_s=3600), seed=0)
    adapter = DataProtoAdapter(buf)
    handles = adapter.add(data, version=3)
    buf.checkpoint(tag="3")
    saved = json.dumps(adapter.state_dict())
    buf.close()

    restored = tr.RolloutBuffer.from_checkpoint(f"file://{tmp_path}/ckpt", tag="3", progress=False)
    fresh_adapter = DataProtoAdapter(restored)
    batch = restored.gather(handles.slot, count_use=False)
    with pytest.raises(ValueError, match="uid"):  # without the adapter's state: refused, not made up
        fresh_adapter.to_dataproto(batch, template=data)
    fresh_adapter.load_state_dict(json.loads(saved))
    assert_same(fresh_adapter.to_dataproto(batch, template=data), data)
    with pytest.raises(ValueError, match="not a DataProtoAdapter state"):
        fresh_adapter.load_state_dict({"format": 1, "rows": [[0, 0]], "uids": [], "anonymous": 0, "seen": {}})
    assert len(fresh_adapter) == len(data)  # the bad state changed nothing
