"""The padded trainer layout (TRL, verl) in and out of the buffer: `add_padded`/`from_padded` and
`ReplayBatch.split` round-trip rollouts exactly, and bad layouts are refused before any change."""

import pytest
import torch

import torchreplay as tr
from torchreplay.padded import split_padded


def padded_batch(n, tp, tc, seed, prompt_side="left", holes=False):
    """Random trainer-style tensors: prompts padded on `prompt_side`, completions right-padded,
    int masks; `holes` puts 0s inside completions (masked tool output)."""
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(1, tp + 1, (n,), generator=g)
    clen = torch.randint(0, tc + 1, (n,), generator=g)
    cols_p, cols_c = torch.arange(tp), torch.arange(tc)
    if prompt_side == "left":
        prompt_mask = (cols_p.unsqueeze(0) >= (tp - plen).unsqueeze(1)).long()
    else:
        prompt_mask = (cols_p.unsqueeze(0) < plen.unsqueeze(1)).long()
    completion_mask = (cols_c.unsqueeze(0) < clen.unsqueeze(1)).long()
    if holes:
        inner = (torch.rand(n, tc, generator=g) < 0.2) & (cols_c.unsqueeze(0) < (clen - 1).unsqueeze(1))
        completion_mask = completion_mask.masked_fill(inner, 0)
    prompt_ids = torch.randint(3, 1000, (n, tp), generator=g) * prompt_mask
    completion_ids = torch.randint(3, 1000, (n, tc), generator=g) * (cols_c.unsqueeze(0) < clen.unsqueeze(1))
    logprobs = -torch.rand(n, tc, generator=g) * (cols_c.unsqueeze(0) < clen.unsqueeze(1))
    return dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                completion_mask=completion_mask, logprobs=logprobs,
                advantage=torch.randn(n, generator=g), group_id=torch.arange(n) // 4, policy_version=3)


def trimmed(x, mask_cols, side):
    """Drop all-padding columns, so widths compare with the batch's own."""
    keep = mask_cols.nonzero().flatten()
    if keep.numel() == 0:
        return x[:, :0]
    lo, hi = (int(keep.min()), int(keep.max()) + 1) if side == "right" else (int(keep.min()), x.shape[1])
    return x[:, lo:hi] if side == "left" else x[:, :hi]


@pytest.mark.parametrize("prompt_side", ["left", "right"])
@pytest.mark.parametrize("buffer_side", ["left", "right"])
@pytest.mark.parametrize("token_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("holes", [False, True])
def test_round_trip_is_exact(prompt_side, buffer_side, token_dtype, holes):
    for seed in range(5):
        b = padded_batch(12, 7, 9, seed, prompt_side, holes)
        buf = tr.RolloutBuffer(32, padding_side=buffer_side, token_dtype=token_dtype, seed=seed,
                               ref_logprobs=True)
        ref = b["logprobs"] - 0.5
        handles = buf.add_padded(b["prompt_ids"], b["prompt_mask"], b["completion_ids"], b["completion_mask"],
                                 b["logprobs"], advantage=b["advantage"], group_id=b["group_id"],
                                 policy_version=b["policy_version"], prompt_side=prompt_side, ref_logprobs=ref)
        out = buf.gather(handles.slot, count_use=False).split(prompt_side=prompt_side)
        # The batch pads to its own widest prompt and completion: compare on those widths.
        pm = trimmed(b["prompt_mask"], b["prompt_mask"].any(0), "left" if prompt_side == "left" else "right")
        clen_cols = (b["completion_ids"] != 0).any(0) | b["completion_mask"].bool().any(0)
        cm = trimmed(b["completion_mask"], clen_cols, "right")
        assert torch.equal(out["prompt_mask"], pm)
        assert torch.equal(out["prompt_ids"], trimmed(b["prompt_ids"], b["prompt_mask"].any(0),
                                                      "left" if prompt_side == "left" else "right"))
        assert out["prompt_ids"].dtype == token_dtype
        width = cm.shape[1]
        assert torch.equal(out["completion_mask"], cm)
        assert torch.equal(out["completion_ids"], b["completion_ids"][:, :width].to(token_dtype))
        assert torch.equal(out["logprobs"], b["logprobs"][:, :width])
        assert torch.equal(out["ref_logprobs"], (ref * (b["completion_ids"] != 0))[:, :width])
        assert torch.equal(out["advantage"], b["advantage"])
        assert torch.equal(out["group_id"], b["group_id"])
        assert bool(out["reward"].isnan().all())  # not given: stored as NaN
        assert torch.equal(out["weights"], torch.ones(12))


def test_full_width_logprobs_keep_their_prompt_positions():
    b = padded_batch(6, 5, 4, 0)
    tp = b["prompt_ids"].shape[1]
    full = torch.cat([-torch.rand(6, tp) * b["prompt_mask"], b["logprobs"]], dim=1)
    buf = tr.RolloutBuffer(8, seed=0)
    handles = buf.add_padded(b["prompt_ids"], b["prompt_mask"], b["completion_ids"], b["completion_mask"], full,
                             advantage=b["advantage"], group_id=b["group_id"], policy_version=0)
    batch = buf.gather(handles.slot, count_use=False)
    for i in range(6):
        plen = int(b["prompt_mask"][i].sum())
        stored = batch.logprobs[i][batch.attention_mask[i]]
        assert torch.equal(stored[:plen], full[i, tp - plen:tp])


def test_from_padded_feeds_compose_with_exact_counts():
    buf = tr.RolloutBuffer(64, sampler=tr.UniformSampler(), seed=0)
    for step in range(3):
        b = padded_batch(8, 5, 6, step)
        fresh = tr.from_padded(**{**b, "policy_version": step, "group_id": b["group_id"] + 10 * step})
        batch = buf.compose(fresh, n_replay=4 if step else 0, multiple_of=4)
        assert len(batch) == (12 if step else 8)
        out = batch.split()
        width = out["completion_ids"].shape[1]  # the widest completion of fresh and replayed rows
        fresh_ids = torch.nn.functional.pad(b["completion_ids"], (0, max(0, width - 6)))[:, :width]
        assert torch.equal(out["completion_ids"][:8], fresh_ids)
        assert out["is_fresh"][:8].all() and not out["is_fresh"][8:].any()


def test_explicit_reward_is_kept_and_must_be_finite():
    b = padded_batch(4, 3, 3, 1)
    buf = tr.RolloutBuffer(8, seed=0)
    h = buf.add_padded(b["prompt_ids"], b["prompt_mask"], b["completion_ids"], b["completion_mask"], b["logprobs"],
                       advantage=b["advantage"], group_id=b["group_id"], policy_version=0,
                       reward=torch.tensor([1.0, 0.0, 0.5, 0.25]))
    assert torch.equal(buf.gather(h.slot, count_use=False).reward, torch.tensor([1.0, 0.0, 0.5, 0.25]))
    with pytest.raises(tr.SchemaError, match="reward"):
        buf.add_padded(b["prompt_ids"], b["prompt_mask"], b["completion_ids"], b["completion_mask"], b["logprobs"],
                       advantage=b["advantage"], group_id=b["group_id"], policy_version=0,
                       reward=torch.tensor([1.0, float("nan"), 0.5, 0.25]))
    assert len(buf) == 4


@pytest.mark.parametrize("change, error, match", [
    (lambda b: b.update(prompt_mask=b["prompt_mask"].float()), TypeError, "prompt_mask.*int or bool"),
    (lambda b: b.update(completion_mask=b["completion_mask"] * 2), ValueError, "completion_mask.*0 and 1"),
    (lambda b: b.update(prompt_mask=b["prompt_mask"].flip(1)), ValueError, "prompt_mask, row .*one run"),
    (lambda b: b.update(prompt_ids=b["prompt_ids"].float()), TypeError, "prompt_ids.*integer"),
    (lambda b: b.update(prompt_ids=b["prompt_ids"][0]), ValueError, "prompt_ids.*\\[B, T\\]"),
    (lambda b: b.update(logprobs=b["logprobs"][:, :-1]), ValueError, "logprobs: width"),
    (lambda b: b.update(completion_mask=b["completion_mask"][:2]), ValueError, "completion_mask: shape"),
    (lambda b: b.update(logprobs=[1.0]), TypeError, "logprobs"),
    (lambda b: b.update(completion_extent=torch.tensor([[1, 0, 1, 0]] * 4)), ValueError,
     "completion_extent, row 0: .*one run"),
    (lambda b: b.update(completion_extent=torch.zeros(4, 4, dtype=torch.long),
                        completion_mask=torch.ones(4, 4, dtype=torch.long)),
     ValueError, "completion_mask, row 0: .*outside completion_extent"),
    (lambda b: b.update(completion_extent=torch.ones(4, 4)), TypeError, "completion_extent.*int or bool"),
    (lambda b: b.update(completion_extent=torch.ones(4, 3, dtype=torch.long)), ValueError, "completion_extent: shape"),
])
def test_bad_layouts_are_refused_before_any_change(change, error, match):
    b = padded_batch(4, 5, 4, 2)
    b["prompt_mask"][:, -1] = 1  # every prompt non-empty and left-padded
    change(b)
    buf = tr.RolloutBuffer(8, seed=0)
    with pytest.raises(error, match=match):
        buf.add_padded(b.pop("prompt_ids"), b.pop("prompt_mask"), b.pop("completion_ids"),
                       b.pop("completion_mask"), b.pop("logprobs"), **b)
    assert len(buf) == 0 and buf.version == 0


def extent_batch(seed):
    """A padded batch whose completions end in tokens the training mask leaves out (a tool's output,
    a forced end marker): the extent mask says what the completion is, the training mask what trains."""
    b = padded_batch(8, 5, 6, seed, holes=True)
    clen = torch.randint(0, 7, (8,), generator=torch.Generator().manual_seed(seed + 100))
    clen[0], clen[1] = 6, 2
    extent = (torch.arange(6).unsqueeze(0) < clen.unsqueeze(1)).long()
    b["completion_ids"] = torch.randint(3, 1000, (8, 6), generator=torch.Generator().manual_seed(seed)) * extent
    b["completion_mask"] = b["completion_mask"] * extent
    b["completion_mask"][:, -2:] = 0  # the last two positions never train
    b["completion_mask"][1] = 0  # a row with nothing to train on still keeps its tokens
    b["logprobs"] = b["logprobs"] * extent
    b["prompt_mask"][:, -1] = 1  # every rollout has a token even when its completion is empty
    return b, extent


@pytest.mark.parametrize("buffer_side", ["left", "right"])
def test_completion_extent_keeps_untrained_tail_tokens(buffer_side):
    """With `completion_extent`, a completion is its extent, not its training mask up to the last 1:
    untrained tail tokens are stored, and `split` gives back ids, extent and training mask exactly."""
    for seed in range(3):
        b, extent = extent_batch(seed)
        buf = tr.RolloutBuffer(16, padding_side=buffer_side, seed=seed)
        handles = buf.add_padded(b.pop("prompt_ids"), b.pop("prompt_mask"), b["completion_ids"], b["completion_mask"],
                                 b["logprobs"], completion_extent=extent,
                                 **{k: v for k, v in b.items() if k.startswith(("adv", "group", "policy"))})
        batch = buf.gather(handles.slot, count_use=False)
        assert torch.equal(batch.attention_mask.sum(1), batch.prompt_len + extent.sum(1))
        out = batch.split()
        width = int(extent.sum(1).max())
        assert torch.equal(out["completion_extent"], extent[:, :width])
        assert torch.equal(out["completion_mask"], b["completion_mask"][:, :width])
        assert torch.equal(out["completion_ids"], b["completion_ids"][:, :width])
        assert torch.equal(out["logprobs"], b["logprobs"][:, :width])


def test_without_an_extent_the_training_mask_bounds_the_completion():
    """The default extent: every completion position up to the training mask's last 1."""
    b = padded_batch(6, 4, 5, 0, holes=True)
    buf = tr.RolloutBuffer(8, seed=0)
    handles = buf.add_padded(b.pop("prompt_ids"), b.pop("prompt_mask"), b.pop("completion_ids"),
                             b.pop("completion_mask"), b.pop("logprobs"), **b)
    out = buf.gather(handles.slot, count_use=False).split()
    assert torch.equal(out["completion_extent"].sum(1), out["completion_mask"].fliplr().cummax(1).values.sum(1))


def test_split_to_given_widths_with_full_width_fields():
    """`widths` pads to the caller's (Tp, Tc) rather than the batch's widest row; a `full_width`
    field comes back over prompt + completion, its prompt part laid out like `prompt_ids`."""
    b, extent = extent_batch(4)
    tp, tc = b["prompt_ids"].shape[1], extent.shape[1]
    full = torch.cat([-torch.rand(8, tp) * b["prompt_mask"], b["logprobs"]], dim=1)
    buf = tr.RolloutBuffer(16, seed=0, pad_token_id=7)
    handles = buf.add_padded(b["prompt_ids"], b["prompt_mask"], b["completion_ids"],
                             b["completion_mask"], full, completion_extent=extent, advantage=b["advantage"],
                             group_id=b["group_id"], policy_version=0)
    batch = buf.gather(handles.slot, count_use=False)
    for side in ("left", "right"):
        out = split_padded(batch.data, batch.token_fields, 7, side, widths=(tp + 2, tc + 3), full_width=("logprobs",))
        prompt_mask = torch.nn.functional.pad(b["prompt_mask"], (2, 0))
        if side == "right":  # each prompt's run moved to the start of its row
            prompt_mask = (torch.arange(tp + 2) < b["prompt_mask"].sum(1, keepdim=True)).long()
        completion_extent = torch.nn.functional.pad(extent, (0, 3))
        assert torch.equal(out["prompt_mask"], prompt_mask)
        assert torch.equal(out["completion_extent"], completion_extent)
        assert torch.equal(out["completion_mask"], torch.nn.functional.pad(b["completion_mask"], (0, 3)))
        assert torch.equal(out["prompt_ids"][prompt_mask.bool()], b["prompt_ids"][b["prompt_mask"].bool()])
        assert bool((out["prompt_ids"][~prompt_mask.bool()] == 7).all())
        assert bool((out["completion_ids"][~completion_extent.bool()] == 7).all())
        assert out["logprobs"].shape == (8, tp + 2 + tc + 3)
        assert torch.equal(out["logprobs"][:, : tp + 2][prompt_mask.bool()], full[:, :tp][b["prompt_mask"].bool()])
        assert torch.equal(out["logprobs"][:, tp + 2:], torch.nn.functional.pad(b["logprobs"], (0, 3)))
        assert not out["logprobs"][:, : tp + 2][~prompt_mask.bool()].any()
    with pytest.raises(ValueError, match="widths: row 0 has 6 completion tokens, more than 5"):
        split_padded(batch.data, batch.token_fields, 7, widths=(tp, tc - 1))
    with pytest.raises(ValueError, match="widths: row .* prompt tokens, more than 4"):
        split_padded(batch.data, batch.token_fields, 7, widths=(tp - 1, tc))
    with pytest.raises(ValueError, match="full_width: 'advantage' is not a token field"):
        split_padded(batch.data, batch.token_fields, 7, full_width=("advantage",))


def test_split_refuses_a_field_named_like_a_layout_key():
    """A declared field called `prompt_mask` would overwrite split's own prompt_mask: refused."""
    b = padded_batch(4, 3, 3, 0)
    clash = tr.FieldSpec("prompt_mask", "rollout", torch.float32)
    buf = tr.RolloutBuffer(8, seed=0, extra_fields={"prompt_mask": clash})
    handles = buf.add({**tr.from_padded(**b), "prompt_mask": torch.zeros(4)})
    batch = buf.gather(handles.slot, count_use=False)
    with pytest.raises(ValueError, match="field 'prompt_mask' has the name of a layout key"):
        batch.split()
