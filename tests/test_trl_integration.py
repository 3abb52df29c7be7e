"""The real TRL GRPOTrainer with replay (torchreplay.integrations.trl), a few steps on a tiny
randomly initialised model built locally (examples/trl_grpo_replay.py), on the CPU."""

import math
import os
import sys
from pathlib import Path

import pytest
import torch

from extras import require

# A failure, not a skip, in the environment `make` built, which installs it (see extras.py).
require("trl", "pip install 'torchreplay[trl]'; make test installs it from requirements-dev.txt")
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


@pytest.fixture
def default_trainer_setup(tmp_path, monkeypatch):
    """What `ReplayGRPOTrainer(model=..., reward_funcs=..., train_dataset=...)` needs, in a working
    directory of its own. GRPOConfig's defaults ask for bf16, which TrainingArguments refuses on a
    CPU-only machine (stock GRPOTrainer too), so this stands in a bf16-capable accelerator."""
    import transformers.training_args
    from trl_grpo_replay import answer_format, arithmetic_dataset, char_tokenizer, make_reward, tiny_model

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(transformers.training_args, "is_torch_bf16_gpu_available", lambda *a, **k: True)
    tokenizer = char_tokenizer()
    tiny_model(tokenizer).save_pretrained(tmp_path / "tiny-qwen")
    dataset, rg = arithmetic_dataset(size=8)
    return dict(reward_funcs=[make_reward(rg), answer_format], train_dataset=dataset, processing_class=tokenizer)


def test_without_args_the_default_config_is_grpo_trainers(default_trainer_setup):
    """Like GRPOTrainer, no `args` builds a default config named after the model (`<name>-GRPO` in the
    working directory): GRPOConfig's defaults plus replay's."""
    from trl import GRPOTrainer

    from torchreplay.integrations.trl import ReplayGRPOConfig, ReplayGRPOTrainer

    stock = GRPOTrainer(model="tiny-qwen", **default_trainer_setup).args.to_dict()
    trainer = ReplayGRPOTrainer(model="tiny-qwen", **default_trainer_setup)
    assert isinstance(trainer.args, ReplayGRPOConfig) and trainer.args.output_dir == "tiny-qwen-GRPO"
    ours = trainer.args.to_dict()
    assert {k: v for k, v in ours.items() if k in stock} == stock
    assert ours["replay_ratio"] == 0.5 and ours["replay_sampler"] == "prioritized"


@pytest.mark.slow
def test_default_config_trains_with_replay_and_resumes(tmp_path, default_trainer_setup):
    """Training at the defaults (prioritized replay, dapo, 512-token completions, bf16) with the
    checks every configuration gets. Slow (about 30 s of CPU): the default completions are long."""
    from torchreplay.integrations.trl import ReplayGRPOTrainer

    def default_trainer(output_dir):
        """The default config; only the run's length and checkpoint steps (read when training) are set."""
        trainer = ReplayGRPOTrainer(model="tiny-qwen", **default_trainer_setup)
        trainer.args.output_dir, trainer.args.max_steps, trainer.args.save_steps = output_dir, 3, 2
        return trainer

    train_check_and_resume(tmp_path, save_at=2, make=default_trainer)


LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A saved tiny model: with beta != 0 TRL loads its reference model from the policy's path."""
    from trl_grpo_replay import char_tokenizer, tiny_model

    path = tmp_path_factory.mktemp("tiny-qwen")
    tiny_model(char_tokenizer()).save_pretrained(path)
    return str(path)


def hand_loss(trainer, inputs, logps, entropies, advantages, weights):
    """TRL 1.16's GRPO loss written out for one batch, each row's whole per-token contribution (policy
    term and KL) and its entropy bonus multiplied by that row's weight; normalizers unchanged. With
    vLLM's IS correction on, the policy term is times `importance_sampling_ratio` (vespo: its log
    joins the sequence log-ratio)."""
    a, m = trainer.args, inputs["completion_mask"].float()
    vllm_ratio = inputs["importance_sampling_ratio"] if trainer.use_vllm and a.vllm_importance_sampling_correction \
        else None
    gas, w, adv = trainer.current_gradient_accumulation_steps, weights[:, None], advantages[:, None]
    log_ratio = logps - inputs["old_per_token_logps"]
    if a.importance_sampling_level == "sequence":
        log_ratio_is = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0))[:, None]
    else:
        log_ratio_is = log_ratio
    ratio = log_ratio_is.exp()
    if a.loss_type == "cispo":
        policy = -ratio.clamp(max=trainer.epsilon_high).detach() * adv * logps
    elif a.loss_type == "sapo":
        tau = torch.where(adv > 0, a.sapo_temperature_pos, a.sapo_temperature_neg)
        policy = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv
    elif a.loss_type == "vespo":
        log_w = (log_ratio.clamp(-20, 20) * m).sum(-1, keepdim=True)
        if vllm_ratio is not None:
            log_w = log_w + vllm_ratio.log().clamp(math.log(1e-8), 20.0).sum(-1, keepdim=True)
        log_w = log_w.clamp(math.log(1e-8), 20.0)
        k = torch.where(adv >= 0, a.vespo_k_pos, a.vespo_k_neg)
        lam = torch.where(adv >= 0, a.vespo_lambda_pos, a.vespo_lambda_neg)
        policy = -(lam + k * log_w - lam * log_w.exp()).exp().detach() * adv * logps
    else:
        clipped = ratio.clamp(1 - trainer.epsilon_low, 1 + trainer.epsilon_high)
        policy = -torch.min(ratio * adv, clipped * adv)
    if vllm_ratio is not None and a.loss_type != "vespo":
        policy = policy * vllm_ratio
    effective = m
    if trainer.top_entropy_quantile < 1.0:  # the policy term and the bonus act on high-entropy tokens only
        effective = m * trainer.get_high_entropy_mask(entropies, m, 1 - trainer.top_entropy_quantile)
        policy = policy * effective
    kl = torch.zeros_like(logps)
    if a.beta != 0.0:
        ref = inputs["ref_per_token_logps"]
        kl = torch.exp(ref - logps) - (ref - logps) - 1
        if a.use_bias_correction_kl:
            kl = kl * ratio
    per_token = w * (policy + a.beta * kl) * m
    if a.loss_type in ("grpo", "sapo"):
        loss = (per_token.sum(-1) / m.sum(-1).clamp(min=1.0)).mean() / gas
    elif a.loss_type == "bnpo":
        loss = per_token.sum() / m.sum().clamp(min=1.0) / gas
    elif a.loss_type == "dr_grpo":
        loss = per_token.sum() / (m.shape[0] * a.max_completion_length) / gas
    elif a.loss_type == "luspo":
        loss = per_token.sum(-1).mean() / gas
    else:  # dapo, cispo, vespo: tokens of the whole generation batch
        loss = per_token.sum() / (inputs["num_items_in_batch"] * gas / a.steps_per_generation)
    coef = trainer.entropy_coef
    if a.use_adaptive_entropy and trainer._last_world_entropy > a.entropy_target:
        coef = 0.0
    return loss - coef * (w * entropies * effective).sum() / effective.sum().clamp(min=1.0) / gas


def fixed_batch(trainer, weights, seed=0):
    """Six rows as `to_grpo_inputs` hands them to TRL: advantages already multiplied by the weights,
    behaviour and reference log-probs off the current policy's so that ratios clip and KL is nonzero."""
    g = torch.Generator().manual_seed(seed)
    b, p, t = len(weights), 5, 4
    vocab = trainer.model.config.vocab_size
    completion_mask = torch.ones(b, t, dtype=torch.long)
    completion_mask[1, 2:] = 0
    completion_mask[4, 1:] = 0
    prompt_mask = torch.ones(b, p, dtype=torch.long)
    prompt_mask[2, :2] = 0
    inputs = {"prompt_ids": torch.randint(3, vocab, (b, p), generator=g), "prompt_mask": prompt_mask,
              "completion_ids": torch.randint(3, vocab, (b, t), generator=g), "completion_mask": completion_mask}
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([prompt_mask, completion_mask], 1), t)
    advantages = torch.tensor([1.0, -0.5, 0.7, -1.2, 0.3, -0.8])
    inputs.update(old_per_token_logps=logps + 0.3 * torch.randn(b, t, generator=g),
                  ref_per_token_logps=logps + 0.5 * torch.randn(b, t, generator=g),
                  advantages=advantages * weights, replay_weights=weights,
                  replay_is_fresh=weights == 1, num_items_in_batch=completion_mask.sum() * 2)
    return inputs, advantages


@pytest.mark.parametrize("loss_type,extra", [(t, {}) for t in LOSS_TYPES] + [
    ("dapo", {"importance_sampling_level": "sequence", "use_adaptive_entropy": True, "entropy_target": 10.0}),
    ("grpo", {"top_entropy_quantile": 0.5, "use_bias_correction_kl": False}),
])
def test_replay_weight_scales_each_rows_whole_loss(tmp_path, tiny_model_dir, loss_type, extra):
    """With a KL term and an entropy bonus on, the trainer's loss on a fixed batch equals the loss
    written out by hand with each row's whole contribution times its IS weight, value and gradient,
    for every TRL 1.16 loss type. At weights 1 the hand loss is stock TRL's (GRPOTrainer._compute_loss),
    which pins the hand formula. Mutation shown: without the KL/entropy correction in
    ReplayGRPOTrainer._compute_loss the weighted case fails for every loss type."""
    from trl import GRPOTrainer

    trainer = build_trainer(str(tmp_path), steps=1, model=tiny_model_dir, loss_type=loss_type, beta=0.1,
                            entropy_coef=0.05, steps_per_generation=2, **extra)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    coef = trainer.entropy_coef
    params = [p for p in trainer.model.parameters() if p.requires_grad]

    def loss_and_grad(fn, inputs):
        # The adaptive controller updates its coefficient inside every loss call: each call starts from
        # the same state, with the gate open (the bonus applies).
        trainer.entropy_coef, trainer._last_world_entropy = coef, 1.0
        trainer.model.zero_grad()
        loss = fn(trainer.model, inputs)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in params]

    def by_hand(inputs, advantages, weights):
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, mask, inputs["completion_ids"].shape[1], compute_entropy=True)
        return hand_loss(trainer, inputs, logps, entropies, advantages, weights)

    ones = torch.ones(6)
    inputs, advantages = fixed_batch(trainer, ones)
    stock, stock_grad = loss_and_grad(lambda m, x: GRPOTrainer._compute_loss(trainer, m, x), inputs)
    hand, hand_grad = loss_and_grad(lambda m, x: by_hand(x, advantages, ones), inputs)
    torch.testing.assert_close(hand, stock, rtol=1e-5, atol=1e-7)
    for h, s in zip(hand_grad, stock_grad):
        torch.testing.assert_close(h, s, rtol=1e-4, atol=1e-7)

    weights = torch.tensor([1.0, 1.0, 0.5, 0.25, 2.0, 0.8])
    inputs, advantages = fixed_batch(trainer, weights)
    got, got_grad = loss_and_grad(trainer._compute_loss, inputs)
    want, want_grad = loss_and_grad(lambda m, x: by_hand(x, advantages, weights), inputs)
    unweighted, _ = loss_and_grad(lambda m, x: by_hand(x, advantages, ones), inputs)
    assert not torch.allclose(want, unweighted, rtol=1e-3)  # the weights matter on this batch
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    for g, w in zip(got_grad, want_grad):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-7)


def buffer_contents(buffer):
    """Every live rollout's stored fields, in slot order, read without counting a use."""
    slots = torch.nonzero(buffer.slots.live).flatten()
    return slots, buffer.gather(slots, count_use=False).data


def train_check_and_resume(tmp_path, steps=4, save_at=2, check_loss=True, make=None, **overrides):
    """One configuration on the real trainer, the three checks every configuration gets:
    - replay happened, and replayed rows with IS weights below 1 reached the loss;
    - every loss TRL computed equals the hand-written loss with each row's whole contribution times
      its weight (`check_loss`: needs the reference log-probs in the inputs when beta != 0);
    - a run resumed from checkpoint-`save_at` ends with the uninterrupted run's buffer, field by field.
    `make(output_dir)`, when given, builds the trainer instead of the example's `build_trainer`.
    Returns the uninterrupted trainer and its recorded rounds and loss inputs."""
    common = dict(replay_sampler="prioritized", replay_alpha=1.0, replay_beta=1.0, save_strategy="steps",
                  save_steps=save_at, **overrides)
    make = make or (lambda out: build_trainer(out, steps=steps, **common))
    straight = make(str(tmp_path / "a"))
    rounds, losses = record_rounds(straight)
    checked = []
    if check_loss:
        trainer_loss = straight._compute_loss

        def compare_with_hand_loss(model, inputs):
            weights = inputs["replay_weights"]
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
            mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
            with torch.no_grad():
                logps, entropies, _ = straight._get_per_token_logps_and_entropies(
                    model, ids, mask, inputs["completion_ids"].shape[1], compute_entropy=True)
                want = hand_loss(straight, inputs, logps, entropies, inputs["advantages"] / weights, weights)
            loss = trainer_loss(model, inputs)
            checked.append(bool((weights != 1).any()))
            torch.testing.assert_close(loss.detach(), want, rtol=1e-5, atol=1e-7)
            return loss

        straight._compute_loss = compare_with_hand_loss
    straight.train()
    assert straight.replay_buffer.metrics()["sampled_replay"] > 0
    assert any(bool((x["replay_weights"][~x["replay_is_fresh"]] < 1).any()) for x in losses)
    for x in losses:  # the IS weight is folded into the advantage the loss sees
        assert bool((x["replay_weights"] > 0).all())
    if check_loss:
        assert any(checked), "no loss with weights other than 1 was checked"
    checkpoint = tmp_path / "a" / f"checkpoint-{save_at}"
    assert (checkpoint / "replay_buffer.json").exists()

    resumed = make(str(tmp_path / "b"))
    resumed.train(resume_from_checkpoint=str(checkpoint))
    a, b = straight.replay_buffer.metrics(), resumed.replay_buffer.metrics()
    for key in ("size", "added", "sampled_fresh", "sampled_replay", "reuse_mean", "age_mean", "evicted_reuse",
                "evicted_staleness", "policy_version"):
        assert a[key] == b[key] or (math.isnan(a[key]) and math.isnan(b[key])), key
    (slots_a, rows_a), (slots_b, rows_b) = buffer_contents(straight.replay_buffer), buffer_contents(resumed.replay_buffer)
    assert torch.equal(slots_a, slots_b) and rows_a.keys() == rows_b.keys()
    for key in rows_a:
        torch.testing.assert_close(rows_a[key], rows_b[key], rtol=0, atol=0, equal_nan=True, msg=key)
    return straight, rounds, losses


def test_kl_and_entropy_with_prioritized_replay_train_and_resume(tmp_path, tiny_model_dir):
    """beta != 0 and a static entropy bonus with the default (prioritized) sampler: replayed rows
    reach the loss with their whole contribution weighted, and resume is exact."""
    straight, _, losses = train_check_and_resume(tmp_path, model=tiny_model_dir, beta=0.04, entropy_coef=0.01,
                                                 loss_type="grpo")
    assert "ref_logprobs" in buffer_contents(straight.replay_buffer)[1]
    assert all("ref_per_token_logps" in x for x in losses)


def test_adaptive_entropy_with_accumulation_and_replay_train_and_resume(tmp_path):
    straight, rounds, losses = train_check_and_resume(
        tmp_path, use_adaptive_entropy=True, entropy_coef=0.01, entropy_target=10.0, gradient_accumulation_steps=2,
        per_device_train_batch_size=4, loss_type="bnpo")
    assert len(losses) == 2 * len(rounds)  # two micro-batches per optimizer step


def test_replay_ratio_zero_refuses_nothing(tmp_path, tiny_model_dir):
    trainer = build_trainer(str(tmp_path), steps=1, model=tiny_model_dir, replay_ratio=0.0, beta=0.04,
                            entropy_coef=0.01, replay_sampler="prioritized")
    trainer.train()
    assert trainer.replay_buffer.metrics()["sampled_replay"] == 0


def test_sync_ref_model_recomputes_stale_reference_logprobs(tmp_path, tiny_model_dir):
    """beta != 0 with sync_ref_model=True: TRL moves the reference model every ref_model_sync_steps.
    Every row the loss sees, replayed ones stored before a sync included, carries the current
    reference model's log-probs. The checkpoint is taken before the first sync: TRL's checkpoints do
    not keep the synced reference model, so only such a resume can match the uninterrupted run.
    Mutation shown: without ReplayGRPOTrainer._refresh_reference_logprobs the stale rows fail."""
    seen = []
    from torchreplay.integrations.trl import ReplayGRPOTrainer

    compute_loss = ReplayGRPOTrainer._compute_loss

    def compare_reference(self, model, inputs):
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        with torch.no_grad():
            ref, _, _ = self._get_per_token_logps_and_entropies(self.ref_model, ids, mask, inputs["completion_ids"].shape[1])
        live = inputs["completion_mask"].bool()
        stale = ~inputs["replay_is_fresh"] & (inputs["replay_policy_version"] < self.state.global_step // 3 * 3)
        seen.append(int(stale.sum()))
        torch.testing.assert_close(inputs["ref_per_token_logps"][live], ref[live], rtol=0, atol=1e-5)
        return compute_loss(self, model, inputs)

    import unittest.mock

    with unittest.mock.patch.object(ReplayGRPOTrainer, "_compute_loss", compare_reference):
        straight, _, _ = train_check_and_resume(tmp_path, steps=5, save_at=2, model=tiny_model_dir, beta=0.04,
                                                sync_ref_model=True, ref_model_sync_steps=3, ref_model_mixup_alpha=1.0)
    assert sum(seen) > 0, "no replayed row stored before a sync reached the loss"


def test_lora_training_with_replay_resumes_exactly(tmp_path):
    """A LoRA adapter (TRL's peft_config) trains with replay. With beta != 0 (the harder case: the
    policy and the reference are one model) TRL takes the reference log-probs from the base model,
    adapter disabled; they are stored and replayed like any other, and the KL weighting holds."""
    peft = require("peft", "pip install peft; make test installs it from requirements-dev.txt")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    straight, _, losses = train_check_and_resume(tmp_path, peft_config=config, beta=0.04, learning_rate=3e-2)
    assert isinstance(straight.model, peft.PeftModel)
    assert (tmp_path / "a" / "checkpoint-2" / "adapter_model.safetensors").exists()
    assert all("ref_per_token_logps" in x for x in losses)
