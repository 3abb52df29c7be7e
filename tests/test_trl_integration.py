"""The real TRL GRPOTrainer with replay (torchreplay.integrations.trl), a few steps on a tiny
randomly initialised model built locally (examples/trl_grpo_replay.py), on the CPU."""

import math
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from trl_grpo_replay import build_trainer  # noqa: E402



def record_rounds(trainer):
    """Capture, per generation round, the batch `compose` returned and every loss input built from it."""
    rounds, losses = [], []
    buffer_compose = trainer.replay_buffer.compose

    def compose(*args, **kwargs):
        batch = buffer_compose(*args, **kwargs)
        rounds.append(batch)
        return batch

    trainer.replay_buffer.compose = compose
    compute_loss = trainer._compute_loss

    def recording_loss(model, inputs):
        losses.append({k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()})
        return compute_loss(model, inputs)

    trainer._compute_loss = recording_loss
    return rounds, losses


def test_replay_happens_and_is_logged(tmp_path):
    trainer = build_trainer(str(tmp_path), steps=6, replay_sampler="uniform")
    trainer.train()
    m = trainer.replay_buffer.metrics()
    assert m["sampled_replay"] > 0 and m["reuse_mean"] > 1
    logged = [h for h in trainer.state.log_history if "replay/sampled_replay" in h]
    assert len(logged) == 6 and logged[-1]["replay/sampled_replay"] == m["sampled_replay"]


def test_replayed_rows_reach_the_loss_with_their_weights(tmp_path):
    trainer = build_trainer(str(tmp_path), steps=8, replay_sampler="prioritized", replay_alpha=1.0, replay_beta=1.0)
    rounds, losses = record_rounds(trainer)
    trainer.train()
    assert len(rounds) == len(losses) == 8  # steps_per_generation 1: one loss call per round
    weighted = 0
    for batch, inputs in zip(rounds, losses):
        assert inputs["prompt_ids"].shape[0] == len(batch)  # no row dropped
        expected = (batch.advantage * batch.weights)
        # TRL shuffles rows: match them by their (is_fresh, weight, advantage) triples.
        got = sorted(zip(inputs["replay_is_fresh"].tolist(), inputs["replay_weights"].tolist(),
                         inputs["advantages"].tolist()))
        want = sorted(zip(batch.is_fresh.tolist(), batch.weights.tolist(), expected.tolist()))
        assert got == want
        replayed = ~batch.is_fresh
        weighted += int((batch.weights[replayed] < 1).sum())
        # The loss sees the behaviour log-probs stored with each row, not the current policy's.
        assert inputs["old_per_token_logps"].shape == inputs["completion_ids"].shape
    assert weighted > 0, "no replayed row had an IS weight below 1: the test would prove nothing"


def test_accumulation_steps_per_generation_and_iterations_lose_no_row(tmp_path):
    trainer = build_trainer(str(tmp_path), steps=4, replay_sampler="uniform", per_device_train_batch_size=4,
                            gradient_accumulation_steps=2, steps_per_generation=4, num_iterations=2,
                            loss_type="dapo")
    rounds, losses = record_rounds(trainer)
    trainer.train()
    assert rounds
    per_round = 4 * 2  # steps_per_generation micro-batches, each seen num_iterations times
    assert len(losses) == len(rounds) * per_round
    for i, batch in enumerate(rounds):
        assert len(batch) % 4 == 0
        chunk = losses[i * per_round:(i * per_round) + 4]
        assert sum(x["prompt_ids"].shape[0] for x in chunk) == len(batch)
        # dapo's normalizer spans the mixed generation batch, fresh and replayed tokens alike.
        tokens = int(batch.split()["completion_mask"].sum())
        assert all(int(x["num_items_in_batch"]) == tokens for x in chunk)


def test_resume_from_checkpoint_restores_the_buffer(tmp_path):
    common = dict(replay_sampler="prioritized", save_strategy="steps", save_steps=3)
    straight = build_trainer(str(tmp_path / "a"), steps=6, **common)
    straight.train()
    assert (tmp_path / "a" / "checkpoint-3" / "replay_buffer.json").exists()

    resumed = build_trainer(str(tmp_path / "b"), steps=6, **common)
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-3"))
    a, b = straight.replay_buffer.metrics(), resumed.replay_buffer.metrics()
    for key in ("size", "added", "sampled_fresh", "sampled_replay", "reuse_mean", "age_mean", "evicted_reuse",
                "evicted_staleness", "policy_version"):
        assert a[key] == b[key] or (math.isnan(a[key]) and math.isnan(b[key])), key
    assert torch.equal(straight.replay_buffer.slots.advantage, resumed.replay_buffer.slots.advantage)


def test_kl_term_with_weighted_sampler_is_refused(tmp_path):
    with pytest.raises(ValueError, match="KL term.*replay_sampler='uniform'"):
        build_trainer(str(tmp_path), steps=1, beta=0.04, replay_sampler="prioritized")


def test_kl_term_with_uniform_replay_stores_reference_logprobs(tmp_path):
    from trl_grpo_replay import char_tokenizer, tiny_model

    model_dir = tmp_path / "model"
    tokenizer = char_tokenizer()
    tiny_model(tokenizer).save_pretrained(model_dir)  # TRL loads its reference model from a path
    trainer = build_trainer(str(tmp_path / "out"), steps=4, model=str(model_dir), beta=0.04, replay_sampler="uniform")
    rounds, losses = record_rounds(trainer)
    trainer.train()
    assert trainer.replay_buffer.metrics()["sampled_replay"] > 0
    assert all("ref_per_token_logps" in x for x in losses)
    assert any(bool((x["ref_per_token_logps"] != 0).any()) for x in losses)


def test_unsupported_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="replay_ratio"):
        build_trainer(str(tmp_path), steps=1, replay_ratio=1.0)
    with pytest.raises(ValueError, match="entropy bonus"):
        build_trainer(str(tmp_path), steps=1, entropy_coef=0.01, replay_sampler="prioritized")


def test_resume_with_a_checkpoint_uri_keeps_the_store_consistent(tmp_path):
    """The resumed trainer's empty buffer must not publish over the store (its final manifest would
    become the newest), and the restored buffer's manifests must not reuse numbers."""
    import json

    common = dict(replay_sampler="prioritized", save_strategy="steps", save_steps=3, save_total_limit=2)
    store = tmp_path / "store"
    straight = build_trainer(str(tmp_path / "a"), steps=6, replay_checkpoint_uri=f"file://{store}", **common)
    straight.train()
    pointer = json.loads((tmp_path / "a" / "checkpoint-3" / "replay_buffer.json").read_text())
    assert pointer["uri"] == f"file://{store}" and pointer["tag"] == "3"

    import torchreplay as tr

    resumed = build_trainer(str(tmp_path / "b"), steps=6, replay_checkpoint_uri=f"file://{store}", **common)
    before = tr.RolloutBuffer.from_checkpoint(f"file://{store}", progress=False)
    resumed.load_replay_buffer(str(tmp_path / "a" / "checkpoint-3"))
    # The store still names the uninterrupted run's newest state, not the resumed trainer's empty buffer.
    latest = tr.RolloutBuffer.from_checkpoint(f"file://{store}", progress=False)
    assert len(latest) == len(before) > 0
    assert torch.equal(latest.slots.advantage, before.slots.advantage)

    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-3"))
    resumed.replay_buffer.checkpoint()
    a, b = straight.replay_buffer.metrics(), resumed.replay_buffer.metrics()
    assert a["size"] == b["size"] and a["sampled_replay"] == b["sampled_replay"]
    latest = tr.RolloutBuffer.from_checkpoint(f"file://{store}", progress=False)
    assert torch.equal(latest.slots.advantage, resumed.replay_buffer.slots.advantage)


def test_resume_from_a_checkpoint_without_a_buffer_warns_and_starts_empty(tmp_path, caplog):
    folder = tmp_path / "checkpoint-0"
    folder.mkdir()
    trainer = build_trainer(str(tmp_path / "out"), steps=1)
    with caplog.at_level("WARNING"):
        assert trainer.load_replay_buffer(str(folder)) is False
    assert "holds no replay buffer" in caplog.text and len(trainer.replay_buffer) == 0


def test_fully_masked_completions_train_and_are_never_prioritized(tmp_path):
    # Two tokens never reach EOS here, so TRL masks every completion out.
    trainer = build_trainer(str(tmp_path), steps=3, max_completion_length=2, mask_truncated_completions=True)
    trainer.train()
    live = trainer.replay_buffer.slots.live
    assert live.any() and bool((trainer.replay_buffer.slots.advantage[live] == 0).all())


def test_a_sampler_object_in_the_config_serializes(tmp_path):
    import torchreplay as tr

    trainer = build_trainer(str(tmp_path), steps=1, replay_sampler=tr.PrioritizedSampler(alpha=0.8))
    assert '"replay_sampler": "PrioritizedSampler"' in trainer.args.to_json_string()
    assert trainer.replay_buffer.sampler.alpha == 0.8


@pytest.mark.distributed
def test_two_processes_keep_a_buffer_each_and_resume_it(tmp_path):
    """A real 2-process run under torchrun (gloo): each rank trains on fresh + replayed rows with
    equal row counts (TRL gathers per-row metrics), saves its own buffer with every checkpoint-N,
    and a run resumed from checkpoint-2 ends where the uninterrupted one did, rank by rank."""
    import json
    import subprocess

    child = Path(__file__).with_name("trl_multiprocess_child.py")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]

    def run(out, *extra):
        done = subprocess.run([*torchrun, str(child), str(out), *extra], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]

    straight = run(tmp_path / "a")
    for rank, report in enumerate(straight):
        assert report["sampled_replay"] > 0
        assert (tmp_path / "a" / "checkpoint-2" / f"replay_buffer.rank{rank}.json").exists()
    resumed = run(tmp_path / "b", str(tmp_path / "a" / "checkpoint-2"))
    assert resumed == straight


def test_pad_to_multiple_of_holds_for_mixed_batches(tmp_path):
    trainer = build_trainer(str(tmp_path), steps=4, replay_sampler="uniform", pad_to_multiple_of=8)
    rounds, losses = record_rounds(trainer)
    trainer.train()
    assert any(not bool(b.is_fresh.all()) for b in rounds)  # replayed rows were in the batches checked
    for inputs in losses:
        assert inputs["prompt_ids"].shape[1] % 8 == 0 and inputs["completion_ids"].shape[1] % 8 == 0
        assert inputs["old_per_token_logps"].shape == inputs["completion_mask"].shape == inputs["completion_ids"].shape


def test_without_args_the_default_config_is_grpo_trainers(tmp_path, monkeypatch):
    """Like GRPOTrainer, no `args` builds a default config named after the model (`<name>-GRPO` in the
    working directory): GRPOConfig's defaults plus replay's. Those defaults ask for bf16, which
    TrainingArguments refuses on a CPU-only machine (stock GRPOTrainer too), so the test stands in a
    bf16-capable accelerator."""
    import transformers.training_args
    from trl import GRPOTrainer
    from trl_grpo_replay import arithmetic_dataset, char_tokenizer, make_reward, tiny_model

    from torchreplay.integrations.trl import ReplayGRPOConfig, ReplayGRPOTrainer

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(transformers.training_args, "is_torch_bf16_gpu_available", lambda *a, **k: True)
    tokenizer = char_tokenizer()
    tiny_model(tokenizer).save_pretrained(tmp_path / "tiny-qwen")
    dataset, rg = arithmetic_dataset(size=8)
    common = dict(reward_funcs=make_reward(rg), train_dataset=dataset, processing_class=tokenizer)
    stock = GRPOTrainer(model="tiny-qwen", **common).args.to_dict()
    trainer = ReplayGRPOTrainer(model="tiny-qwen", **common)
    assert isinstance(trainer.args, ReplayGRPOConfig) and trainer.args.output_dir == "tiny-qwen-GRPO"
    ours = trainer.args.to_dict()
    assert {k: v for k, v in ours.items() if k in stock} == stock
    assert ours["replay_ratio"] == 0.5 and ours["replay_sampler"] == "prioritized"
