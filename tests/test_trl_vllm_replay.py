"""ReplayGRPOTrainer with use_vllm=True, without vLLM: what replay does with vLLM's outputs.

TRL 1.16 generates with vLLM only in `_generate_single_turn`; everything after it (the old log-probs,
the IS ratio in every `vllm_importance_sampling_mode`, the loss) is TRL's own code, keyed on
`trainer.use_vllm`. These tests build the trainer without vLLM, then switch `use_vllm` on and stand
in for the engine: the transformers generation, with "sampling log-probs" that differ from the
trainer's by seeded noise, some of them None as vLLM reports an unscorable token. So the real TRL
code computes every vLLM key, and the checks are that replayed rows carry theirs, and that TRL's
loss with the IS correction is what the hand-written loss says. tests/test_trl_vllm.py runs the
real engine (`make vllm-test`)."""

import math
import os
import sys
from pathlib import Path

import pytest
import torch

from extras import require

require("trl", "pip install 'torchreplay[trl]'; make test installs it from requirements-dev.txt")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from test_trl_integration import train_check_and_resume  # noqa: E402
from trl_grpo_replay import build_trainer  # noqa: E402

from torchreplay import RolloutBuffer, UniformSampler  # noqa: E402
from torchreplay.integrations import trl_vllm  # noqa: E402
from torchreplay.integrations.trl import ReplayGRPOTrainer, from_grpo_outputs, to_grpo_inputs  # noqa: E402

MODES = ("sequence_mask", "sequence_truncate", "token_mask", "token_truncate")
SAMPLING, RATIO = trl_vllm.SAMPLING_KEY, trl_vllm.RATIO_KEY


# ------------------------------------------------------------------------------------ the fields alone
def vllm_outputs(mode, seed=0):
    """A generation output as TRL 1.16 builds it with vLLM: row 1 fully masked (a truncated
    completion), row 2 shorter; NaN sampling log-probs (unscorable tokens); an infinite token ratio
    (a truncate mode without an upper bound can give one)."""
    g = torch.Generator().manual_seed(seed)
    b, p, t = 4, 3, 5
    completion_mask = torch.ones(b, t, dtype=torch.long)
    completion_mask[1] = 0
    completion_mask[2, 3:] = 0
    sampling = -torch.rand(b, t, generator=g) * 3
    sampling[0, 1] = sampling[3, 4] = float("nan")
    sampling = sampling * completion_mask  # TRL pads with 0
    if mode in trl_vllm.SEQUENCE_MODES:
        ratio = torch.rand(b, 1, generator=g) * 2
        ratio[3, 0] = 0.0  # masked out by a *_mask mode
    else:
        ratio = torch.where(completion_mask.bool(), torch.rand(b, t, generator=g) * 2, 1.0)
        ratio[0, 2] = float("inf")
    return {"prompt_ids": torch.randint(3, 20, (b, p), generator=g), "prompt_mask": torch.ones(b, p, dtype=torch.long),
            "completion_ids": torch.randint(3, 20, (b, t), generator=g), "completion_mask": completion_mask,
            "advantages": torch.tensor([1.0, -0.5, 0.25, 0.0]), "old_per_token_logps": -torch.rand(b, t, generator=g),
            SAMPLING: sampling, RATIO: ratio}


@pytest.mark.parametrize("mode", MODES)
def test_vllm_keys_come_back_from_the_buffer_as_stored(mode):
    """Every stored value comes back bit for bit, NaN and inf included, in the layout TRL's mode
    gives ([B, 1] or [B, T]); a token ratio outside the completion mask is TRL's value there.
    Mutation shown: storing the token fields without their `_nonfinite` codes (NaN/inf refused by
    the buffer, or read back as 0) fails here."""
    outputs = vllm_outputs(mode)
    buffer = RolloutBuffer(16, sampler=UniformSampler(), extra_fields=trl_vllm.vllm_fields(True, True, mode))
    buffer.add(from_grpo_outputs(outputs, group_id=torch.zeros(4, dtype=torch.int64), policy_version=0,
                                 vllm_importance_sampling_mode=mode))
    fill = trl_vllm.masked_position_ratio(mode, 0.5, 3.0)
    back = to_grpo_inputs(buffer.gather(torch.arange(4), count_use=False), masked_is_ratio=fill)
    mask = outputs["completion_mask"].bool()
    width = back["completion_ids"].shape[1]
    assert width == 5 and back[SAMPLING].shape == (4, 5)
    torch.testing.assert_close(back[SAMPLING][mask], outputs[SAMPLING][mask], rtol=0, atol=0, equal_nan=True)
    assert bool((back[SAMPLING][~mask] == 0).all())
    if mode in trl_vllm.SEQUENCE_MODES:
        assert back[RATIO].shape == (4, 1)
        assert torch.equal(back[RATIO], outputs[RATIO])
    else:
        assert back[RATIO].shape == (4, 5)
        assert torch.equal(back[RATIO][mask], outputs[RATIO][mask]) and math.isinf(float(back[RATIO][0, 2]))
        assert bool((back[RATIO][~mask] == fill).all())


def test_masked_position_ratio_is_trls_for_a_zero_log_ratio():
    """TRL's own correction code, applied to a log-ratio of 0, for every mode and bound."""
    def trl_ratio(mode, low, high):
        ratio = torch.exp(torch.zeros(1))
        if mode.endswith("truncate"):
            return float(torch.clamp(ratio, min=low, max=high))
        outside = (ratio < (low if low is not None else -math.inf)) | (ratio > (high if high is not None else math.inf))
        return float(ratio.masked_fill(outside, 0.0))

    for mode in MODES:
        for low, high in ((None, 3.0), (0.5, 2.0), (1.5, None), (None, 0.5), (1.5, 3.0), (0.2, 0.8)):
            if mode.endswith("truncate") and low is None and high is None:
                continue
            ours = torch.tensor(trl_vllm.masked_position_ratio(mode, low, high), dtype=torch.float32)  # as stored
            assert float(ours) == trl_ratio(mode, low, high), (mode, low, high)


def test_a_ratio_without_its_mode_or_with_the_wrong_shape_is_refused():
    outputs = vllm_outputs("token_mask")
    group = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode"):
        from_grpo_outputs(outputs, group_id=group, policy_version=0)
    with pytest.raises(ValueError, match=r"importance_sampling_ratio: mode 'sequence_mask' gives one ratio per row"):
        from_grpo_outputs(outputs, group_id=group, policy_version=0, vllm_importance_sampling_mode="sequence_mask")


# ------------------------------------------------------------------------------------ the real trainer
def stand_in_for_vllm(trainer, noise=0.4, unscorable=0.1):
    """Switch `use_vllm` on in a trainer built without it (TRL refuses use_vllm=True without vLLM
    installed) and generate as the transformers path does, returning per-token "vLLM" log-probs:
    the trainer's own, plus noise seeded by the step (so a resumed run draws the same), None for a
    `unscorable` share of tokens."""
    trainer.args.use_vllm = trainer.use_vllm = True
    trainer.replay_buffer.close()
    trainer.replay_buffer = trainer._new_buffer()  # with the vLLM fields use_vllm=True declares
    generate = trainer._generate_single_turn

    def vllm_like(prompt_ids, *args, **kwargs):
        trainer.use_vllm = False
        try:
            completion_ids, _ = generate(prompt_ids, *args, **kwargs)
        finally:
            trainer.use_vllm = True
        g = torch.Generator().manual_seed(1000 + trainer.state.global_step)
        logprobs = []
        with torch.no_grad():
            for prompt, completion in zip(prompt_ids, completion_ids):
                logits = trainer.model(input_ids=torch.tensor([prompt + completion])).logits[0].float()
                own = logits[len(prompt) - 1:-1].log_softmax(-1).gather(1, torch.tensor(completion)[:, None])[:, 0]
                values = own + noise * torch.randn(len(completion), generator=g)
                drop = torch.rand(len(completion), generator=g) < unscorable
                logprobs.append([None if d else float(v) for v, d in zip(values, drop)])
        return completion_ids, logprobs

    trainer._generate_single_turn = vllm_like
    return trainer


def record_vllm_rounds(trainer):
    """Per round: TRL's own generation output (fresh rows, before replay), the batch `compose`
    returned, and the loss inputs built from it (rows in the batch's order)."""
    rounds = []
    base = super(ReplayGRPOTrainer, trainer)._generate_and_score_completions
    with_replay = trainer._with_replay
    compose = trainer.replay_buffer.compose

    def generation(inputs):
        out = base(inputs)
        if not trainer.model.training:
            return out
        rounds.append({"trl": {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in out.items()}})
        mixed = with_replay(out)
        rounds[-1]["mixed"] = {k: v.clone() for k, v in mixed.items()}
        return mixed

    def composing(*args, **kwargs):
        batch = compose(*args, **kwargs)
        rounds[-1]["batch"] = batch
        return batch

    trainer._generate_and_score_completions = generation
    trainer.replay_buffer.compose = composing
    return rounds


def check_rows_carry_their_generation_values(trainer, rounds):
    """Every row of every trained batch, fresh or replayed, carries the sampling log-probs and the IS
    ratio TRL computed for it when it was generated: fresh rows are TRL's own rows, replayed rows
    are found by their buffer handle. Returns how many replayed rows had a ratio other than 1 and
    how many carried a NaN sampling log-prob."""
    a = trainer.args
    fill = trainer._masked_is_ratio
    origin = {}  # (slot, generation) -> (round, row)
    replayed_off_one = replayed_nan = 0
    for r, rnd in enumerate(rounds):
        batch, mixed = rnd["batch"], rnd["mixed"]
        handles = list(zip(batch.handles.slot.tolist(), batch.handles.generation.tolist()))
        n_fresh = int(batch.is_fresh.sum())
        assert bool(batch.is_fresh[:n_fresh].all()) and not bool(batch.is_fresh[n_fresh:].any())
        for i in range(n_fresh):
            origin[handles[i]] = (r, i)
        width = mixed["completion_ids"].shape[1]
        for i, handle in enumerate(handles):
            src_round, src_row = origin[handle]
            src = rounds[src_round]["trl"]
            mask = src["completion_mask"][src_row].bool()
            n = int(mask.sum())
            assert bool(mixed["completion_mask"][i, :n].bool().all()) and not bool(mixed["completion_mask"][i, n:].any())
            torch.testing.assert_close(mixed[SAMPLING][i, :n], src[SAMPLING][src_row, :n], rtol=0, atol=0, equal_nan=True)
            if a.vllm_importance_sampling_correction:
                got = mixed[RATIO][i]
                if a.vllm_importance_sampling_mode in trl_vllm.SEQUENCE_MODES:
                    assert torch.equal(got, src[RATIO][src_row])
                else:
                    want = torch.full((width,), fill)
                    common = min(width, src[RATIO].shape[1])
                    want[:common] = src[RATIO][src_row, :common]
                    assert torch.equal(got, want)  # TRL's own values, masked positions included
            if not batch.is_fresh[i]:
                if a.vllm_importance_sampling_correction:
                    replayed_off_one += int(bool((mixed[RATIO][i][:n] != 1).any()))
                replayed_nan += int(bool(torch.isnan(mixed[SAMPLING][i, :n]).any()))
    return replayed_off_one, replayed_nan


VLLM_CONFIGS = [
    ("sequence_mask", "grpo", {}),
    ("sequence_truncate", "dapo", {"vllm_importance_sampling_clip_min": 0.5}),
    ("token_mask", "vespo", {"vllm_importance_sampling_clip_min": 0.5, "vllm_importance_sampling_clip_max": 2.0}),
    ("token_truncate", "bnpo", {"pad_to_multiple_of": 8, "vllm_importance_sampling_clip_max": 1.5}),
]


@pytest.mark.parametrize("mode,loss_type,extra", VLLM_CONFIGS, ids=[c[0] for c in VLLM_CONFIGS])
def test_replayed_rows_carry_their_vllm_values_to_the_loss_and_resume(tmp_path, mode, loss_type, extra):
    """use_vllm=True, in every vllm_importance_sampling_mode: TRL computes the IS ratio; every trained
    row (replayed ones found by their handle) carries the ratio and sampling log-probs TRL computed
    when it was generated; every loss TRL computes equals the hand-written loss with each row's
    whole contribution times its replay weight and its policy term times its vLLM IS ratio; a run
    resumed from checkpoint-2 ends with the uninterrupted run's buffer, vLLM fields included.
    Mutation shown: `trl_vllm.to_inputs` giving every row a sequence ratio of 1 instead of its
    stored one fails the row check (sequence_mask); without the vLLM keys TRL's loss raises KeyError."""
    settings = dict(use_vllm=False, vllm_importance_sampling_mode=mode, loss_type=loss_type, steps=4,
                    replay_sampler="prioritized", replay_alpha=1.0, replay_beta=1.0, save_strategy="steps", save_steps=2,
                    **extra)

    def make(out):
        return stand_in_for_vllm(build_trainer(out, **settings))

    recorded = {}

    def make_and_record(out):
        trainer = make(out)
        if "rounds" not in recorded:
            recorded["rounds"] = record_vllm_rounds(trainer)
            recorded["trainer"] = trainer
        return trainer

    straight, _, losses = train_check_and_resume(tmp_path, save_at=2, make=make_and_record)
    assert recorded["trainer"] is straight
    off_one, with_nan = check_rows_carry_their_generation_values(straight, recorded["rounds"])
    assert off_one > 0, "no replayed row had an IS ratio other than 1: the check would prove nothing"
    assert with_nan > 0, "no replayed row carried a NaN sampling log-prob"
    assert all(SAMPLING in x and RATIO in x for x in losses)
    stored = trainer_fields(straight)
    assert trl_vllm.SAMPLING_FIELD in stored and trl_vllm.RATIO_FIELD in stored


def trainer_fields(trainer):
    return set(trainer.replay_buffer.fields)


def test_without_the_is_correction_only_sampling_logprobs_are_stored(tmp_path):
    """vllm_importance_sampling_correction=False: TRL computes no ratio; the sampling log-probs (for
    the off-policy mask) are still stored and replayed."""
    trainer = stand_in_for_vllm(build_trainer(str(tmp_path), steps=3, use_vllm=False, replay_sampler="uniform",
                                              vllm_importance_sampling_correction=False,
                                              off_policy_mask_threshold=0.5))
    rounds = record_vllm_rounds(trainer)
    trainer.train()
    assert trainer_fields(trainer) >= {trl_vllm.SAMPLING_FIELD} and trl_vllm.RATIO_FIELD not in trainer_fields(trainer)
    assert trainer.replay_buffer.metrics()["sampled_replay"] > 0
    _, with_nan = check_rows_carry_their_generation_values(trainer, rounds)
    assert with_nan > 0
    assert all(RATIO not in r["mixed"] for r in rounds)


def test_resuming_with_another_vllm_layout_is_refused(tmp_path):
    """A buffer saved with sequence-level ratios cannot feed a token-level run (nor one without vLLM)."""
    first = stand_in_for_vllm(build_trainer(str(tmp_path / "a"), steps=2, use_vllm=False, save_strategy="steps",
                                            save_steps=2, vllm_importance_sampling_mode="sequence_mask"))
    first.train()
    other = stand_in_for_vllm(build_trainer(str(tmp_path / "b"), steps=2, use_vllm=False,
                                            vllm_importance_sampling_mode="token_mask"))
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode='token_mask'"):
        other.load_replay_buffer(str(tmp_path / "a" / "checkpoint-2"))
    plain = build_trainer(str(tmp_path / "c"), steps=2)
    with pytest.raises(ValueError, match="use_vllm=False"):
        plain.load_replay_buffer(str(tmp_path / "a" / "checkpoint-2"))


def test_an_unknown_importance_sampling_mode_is_refused_before_training():
    from torchreplay.integrations.trl import ReplayGRPOConfig

    args = ReplayGRPOConfig("out", use_vllm=True, vllm_importance_sampling_mode="sequence_clip", use_cpu=True,
                            bf16=False, report_to=[])
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode: unknown mode 'sequence_clip'"):
        ReplayGRPOTrainer._check_config(args)
