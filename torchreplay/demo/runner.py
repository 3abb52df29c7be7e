"""`torchreplay demo`: GRPO on a digit-sorting task, on-policy versus replay, at an equal generation budget.

Every arm starts from the same SFT warm start, sees the same prompt stream (same seed) and stops
after the same number of generated tokens. Accuracy is exact match under greedy decoding on a fixed
held-out prompt set, measured against generated tokens (eval generation is not counted: it is the
same for every arm and is not training compute).
"""

from __future__ import annotations

import copy
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import torchreplay as tr
from torchreplay.demo.grpo import group_advantages, grpo_loss
from torchreplay.demo.policy import TinyCausalLM, generate, sft_warm_start
from torchreplay.demo.task import SortTask


@dataclass
class ArmConfig:
    """One training arm. ``replay_ratio == 0`` means plain on-policy GRPO with no buffer.

    Attributes:
        name: label in the table, plot and JSON.
        lr: AdamW learning rate.
        prompts_per_step: fresh prompts generated per optimizer step.
        group_size: completions per prompt (the GRPO group).
        replay_ratio: fraction of each training batch drawn from the buffer (``buf.compose``).
        sampler: ``"prioritized"`` (|advantage|) or ``"uniform"``.
        alpha, beta: prioritization exponent and IS-correction exponent of the prioritized sampler.
        max_staleness: policy versions a rollout may lag before eviction.
        max_reuse: times a rollout may be sampled before eviction.
        capacity: buffer slots, in rollouts.
    """

    name: str
    lr: float
    prompts_per_step: int
    group_size: int
    replay_ratio: float = 0.0
    sampler: str = "prioritized"
    alpha: float = 1.0
    beta: float = 0.4
    max_staleness: int | None = 4
    max_reuse: int | None = 4
    capacity: int = 4096


@dataclass
class DemoConfig:
    """Everything a run needs; the defaults are the documented demo (see docs/demo_findings.md).

    Attributes:
        num_digits: digits to sort per prompt.
        reward: ``"partial"`` (fraction of answer positions right) or ``"exact"`` (1 for an exact match, else 0).
        budget_tokens: generated tokens each arm may spend (the compute being compared).
        target_acc: exact-match accuracy whose first crossing is reported, in [0, 1].
        eval_every_tokens: evaluate after each multiple of this many generated tokens.
        eval_prompts: held-out prompts for greedy evaluation.
        sft_steps, sft_batch, sft_lr: the shared supervised warm start.
        clip_eps: PPO clip range.
        threads: torch intra-op threads (tiny models run best on one or two).
        arms: the arms to train.
    """

    num_digits: int = 6
    reward: str = "partial"
    budget_tokens: int = 400_000
    target_acc: float = 0.8
    eval_every_tokens: int = 10_000
    eval_prompts: int = 512
    sft_steps: int = 30
    sft_batch: int = 64
    sft_lr: float = 3e-3
    clip_eps: float = 0.2
    threads: int = 1
    arms: list[ArmConfig] = field(default_factory=list)


ON_POLICY = ArmConfig(name="on-policy", lr=3e-3, prompts_per_step=16, group_size=8)
REPLAY = ArmConfig(name="replay", lr=3e-3, prompts_per_step=16, group_size=8, replay_ratio=0.5)
UNIFORM = ArmConfig(name="uniform-replay", lr=3e-3, prompts_per_step=16, group_size=8, replay_ratio=0.5,
                    sampler="uniform")


def default_config(full: bool = False, quick: bool = False) -> DemoConfig:
    """The demo's embedded defaults: 2 arms (3 with ``full``), or a few steps with ``quick``."""
    arms = [copy.deepcopy(ON_POLICY), copy.deepcopy(REPLAY)]
    if full:
        arms.append(copy.deepcopy(UNIFORM))
    cfg = DemoConfig(arms=arms)
    if quick:
        cfg.budget_tokens = 4_000
        cfg.eval_every_tokens = 1_000
        cfg.eval_prompts = 128
        cfg.sft_steps = 5
    return cfg


def _make_sampler(arm: ArmConfig) -> Any:
    if arm.sampler == "uniform":
        return tr.UniformSampler()
    return tr.PrioritizedSampler(alpha=arm.alpha, beta=arm.beta, eps=1e-3)


@torch.no_grad()
def evaluate(model: TinyCausalLM, task: SortTask, prompts: torch.Tensor, digits: torch.Tensor) -> float:
    """Greedy exact-match accuracy on a fixed prompt set, in [0, 1]."""
    ro = generate(model, prompts, task.max_new_tokens, task.tok.eos_id, greedy=True)
    _, exact = task.score(digits, ro.tokens[:, task.prompt_len :])
    return float(exact.float().mean())


def _fresh_dict(ro: Any, reward: torch.Tensor, adv: torch.Tensor, gid: torch.Tensor, version: int,
                prompt_len: int) -> dict[str, Any]:
    lengths = ro.lengths.tolist()
    return {
        "tokens": [ro.tokens[i, :n] for i, n in enumerate(lengths)],
        "prompt_len": torch.full((len(lengths),), prompt_len, dtype=torch.int64),
        "response_mask": [ro.response_mask[i, :n] for i, n in enumerate(lengths)],
        "logprobs": [ro.logprobs[i, :n] for i, n in enumerate(lengths)],
        "reward": reward.float(),
        "advantage": adv.float(),
        "group_id": gid,
        "policy_version": version,
    }


def train_arm(
    arm: ArmConfig,
    cfg: DemoConfig,
    init_state: dict[str, torch.Tensor],
    seed: int,
    eval_set: tuple[torch.Tensor, torch.Tensor],
    progress: Any = None,
) -> dict[str, Any]:
    """Train one arm from ``init_state`` until ``cfg.budget_tokens`` generated tokens are spent.

    Returns a JSON-able dict: the accuracy curve (generated tokens, accuracy), tokens to reach
    ``cfg.target_acc`` (None if never), final accuracy, entropy (nats/token), wall time (s), steps,
    rollouts trained on, and the buffer's ``metrics()`` (replay arms).
    """
    task = SortTask(cfg.num_digits)
    model = TinyCausalLM(len(task.tok), max_len=task.prompt_len + task.max_new_tokens)
    model.load_state_dict(init_state)
    opt = torch.optim.AdamW(model.parameters(), lr=arm.lr, weight_decay=0.0)
    # Same prompt stream for every arm with the same seed: differences come from the method alone.
    prompt_gen = torch.Generator().manual_seed(seed * 1000 + 1)
    sample_gen = torch.Generator().manual_seed(seed * 1000 + 2)
    replay_gen = torch.Generator().manual_seed(seed * 1000 + 3)
    buf = None
    if arm.replay_ratio > 0:
        buf = tr.RolloutBuffer(
            capacity=arm.capacity,
            sampler=_make_sampler(arm),
            max_staleness=arm.max_staleness,
            max_reuse=arm.max_reuse,
        )
    start = time.perf_counter()
    tokens_used, version, next_gid, trained_rollouts = 0, 0, 0, 0
    curve = [(0, evaluate(model, task, *eval_set))]
    next_eval = cfg.eval_every_tokens
    entropy, clip_frac = float("nan"), 0.0
    while tokens_used < cfg.budget_tokens:
        prompts, digits = task.prompts(arm.prompts_per_step, prompt_gen)
        prompts = prompts.repeat_interleave(arm.group_size, dim=0)
        digits = digits.repeat_interleave(arm.group_size, dim=0)
        ro = generate(model, prompts, task.max_new_tokens, task.tok.eos_id, sample_gen)
        reward, exact = task.score(digits, ro.tokens[:, task.prompt_len :])
        if cfg.reward == "exact":
            reward = exact.float()
        gid = torch.arange(next_gid, next_gid + arm.prompts_per_step).repeat_interleave(arm.group_size)
        next_gid += arm.prompts_per_step
        adv = group_advantages(reward, gid)
        tokens_used += ro.num_generated
        entropy = ro.entropy
        if buf is None:
            tokens, mask, old_lp = ro.tokens, ro.response_mask, ro.logprobs
            batch_adv, weights = adv, torch.ones_like(adv)
        else:
            fresh = _fresh_dict(ro, reward, adv, gid, version, task.prompt_len)
            batch = buf.compose(fresh, replay_ratio=arm.replay_ratio, generator=replay_gen)
            tokens, mask, old_lp = batch.tokens, batch.response_mask, batch.logprobs
            batch_adv, weights = batch.advantage, batch.weights.float()
        loss, stats = grpo_loss(model, tokens, mask, old_lp, batch_adv, weights, cfg.clip_eps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        version += 1
        trained_rollouts += tokens.shape[0]
        clip_frac = stats["clip_frac"]
        if buf is not None:
            # A group's advantage depends only on its rewards, which don't change; the stored values keep
            # the priorities current for handles that survived this step.
            buf.update_priorities(batch.handles, batch.advantage)
            buf.advance(version)
        if progress is not None:
            progress.update(min(ro.num_generated, cfg.budget_tokens - (tokens_used - ro.num_generated)))
        while tokens_used >= next_eval or tokens_used >= cfg.budget_tokens:
            curve.append((tokens_used, evaluate(model, task, *eval_set)))
            next_eval += cfg.eval_every_tokens
            if tokens_used >= cfg.budget_tokens:
                break
    wall = time.perf_counter() - start
    reached = next((t for t, a in curve if a >= cfg.target_acc), None)
    result: dict[str, Any] = {
        "config": asdict(arm),
        "curve": [[int(t), float(a)] for t, a in curve],
        "tokens_to_target": reached,
        "final_acc": curve[-1][1],
        "best_acc": max(a for _, a in curve),
        "entropy": entropy,
        "clip_frac": clip_frac,
        "wall_s": wall,
        "steps": version,
        "generated_tokens": tokens_used,
        "trained_rollouts": trained_rollouts,
    }
    if buf is not None:
        result["buffer_metrics"] = {k: float(v) for k, v in buf.metrics().items() if _is_number(v)}
    return result


def _is_number(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return v.numel() == 1
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))


def warm_start(cfg: DemoConfig, seed: int) -> tuple[dict[str, torch.Tensor], float]:
    """The shared SFT warm start for ``seed``: (state dict, seconds it took)."""
    task = SortTask(cfg.num_digits)
    torch.manual_seed(seed)
    model = TinyCausalLM(len(task.tok), max_len=task.prompt_len + task.max_new_tokens)
    t0 = time.perf_counter()
    sft_warm_start(model, task, cfg.sft_steps, cfg.sft_batch, cfg.sft_lr, torch.Generator().manual_seed(seed + 7))
    return copy.deepcopy(model.state_dict()), time.perf_counter() - t0


def eval_set(cfg: DemoConfig, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Held-out prompts (disjoint stream from training: its own generator)."""
    return SortTask(cfg.num_digits).prompts(cfg.eval_prompts, torch.Generator().manual_seed(10_000 + seed))
