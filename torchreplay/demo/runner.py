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
from torchreplay import rules
from torchreplay.demo import arms, report
from torchreplay.demo.arms import ArmConfig
from torchreplay.demo.grpo import group_advantages, grpo_loss
from torchreplay.demo.peer_arms import PromptStream, make_rule, rule_rows
from torchreplay.demo.policy import TinyCausalLM, generate, sft_warm_start
from torchreplay.demo.state import TrainerCheckpoint, load_optimizer_state, optimizer_state
from torchreplay.demo.task import SortTask


@dataclass
class DemoConfig:
    """Everything a run needs; the defaults are the documented demo (see docs/demo_findings.md).

    Attributes:
        task: ``"sort"`` (sort digits, partial credit available) or ``"arithmetic"`` (reasoning-gym's
            basic_arithmetic with its own scoring: a sparse 0/1 reward).
        num_digits: digits to sort per prompt (sort task).
        num_terms: single-digit terms per question (arithmetic task).
        reward: ``"partial"`` (fraction of answer positions right) or ``"exact"`` (1 for an exact match, else 0).
        budget_tokens: generated tokens each arm may spend (the compute being compared).
        target_acc: exact-match accuracy whose first crossing is reported, in [0, 1].
        eval_every_tokens: evaluate after each multiple of this many generated tokens.
        eval_prompts: held-out prompts for greedy evaluation.
        sft_steps, sft_batch, sft_lr: the shared supervised warm start.
        clip_eps: PPO clip range.
        threads: torch intra-op threads (tiny models run best on one or two).
        gen_cost_per_token: cost of one generated token relative to one trained token (forward +
            backward), for the total-compute column. The default 1/3 is the FLOP ratio: a forward
            pass costs ~2N FLOPs per token and a training step ~6N (Kaplan et al. 2020, "Scaling
            Laws for Neural Language Models", sec. 2.1). Memory-bound decoding makes generation
            dearer per token in wall time on real hardware; pass your own measured ratio.
        checkpoint_every: optimizer steps between checkpoints (buffer + trainer).
        prompt_pool: train on a fixed set of this many prompts (drawn once per seed, a new random
            order each epoch), as RL post-training makes epochs over a dataset; None draws every
            training prompt fresh.
        arms: the arms to train.
    """

    task: str = "sort"
    num_digits: int = 6
    num_terms: int = 3
    reward: str = "partial"
    budget_tokens: int = 300_000
    target_acc: float = 0.7
    eval_every_tokens: int = 10_000
    eval_prompts: int = 512
    sft_steps: int = 30
    sft_batch: int = 64
    sft_lr: float = 3e-3
    clip_eps: float = 0.2
    threads: int = 1
    gen_cost_per_token: float = 1 / 3
    checkpoint_every: int = 25
    prompt_pool: int | None = None
    arms: list[ArmConfig] = field(default_factory=list)


def default_config(full: bool = False, quick: bool = False, task: str = "sort") -> DemoConfig:
    """The demo's embedded defaults for `task`: on-policy and the library's prioritized replay, or
    with ``full`` the study's winning arms for the task (`arms.FULL`), each at its tuned setting,
    on the study's fixed prompt set; a few steps with ``quick``."""
    if task not in ("sort", "arithmetic"):
        raise ValueError(f"task must be 'sort' or 'arithmetic', got {task!r}")
    chosen = [arms.arm(name, task) for name in (arms.FULL[task] if full else arms.DEFAULT)]
    if task == "arithmetic":
        cfg = DemoConfig(task="arithmetic", num_terms=2, reward="exact", budget_tokens=200_000, target_acc=0.5,
                         sft_steps=150, arms=chosen)
    else:
        cfg = DemoConfig(arms=chosen)
    cfg.prompt_pool = arms.PROMPT_POOL
    if quick:
        cfg.budget_tokens = 4_000
        cfg.eval_every_tokens = 1_000
        cfg.eval_prompts = 128
        cfg.sft_steps = 10
        cfg.checkpoint_every = 3
    return cfg


def make_task(cfg: DemoConfig) -> Any:
    """The task a config names (the sampled problems differ by seed, the task itself does not)."""
    if cfg.task == "sort":
        return SortTask(cfg.num_digits)
    if cfg.task == "arithmetic":
        from torchreplay.demo.rg_task import ArithmeticTask

        return ArithmeticTask(cfg.num_terms)
    raise ValueError(f"task must be 'sort' or 'arithmetic', got {cfg.task!r}")


def make_sampler(arm: ArmConfig) -> Any:
    if arm.sampler == "uniform":
        return tr.UniformSampler()
    common = dict(alpha=arm.alpha, beta=arm.beta, eps=1e-3, weight_norm=arm.weight_norm,
                  keep_zero_advantage=arm.keep_zero_advantage)
    if arm.sampler == "freshness":
        return tr.FreshnessSampler(tau=arm.tau, **common)
    if arm.sampler == "prioritized":
        return tr.PrioritizedSampler(**common)
    raise ValueError(f"arm {arm.name}: sampler must be prioritized, freshness or uniform, got {arm.sampler!r}")


@torch.no_grad()
def evaluate(model: TinyCausalLM, task: Any, prompts: torch.Tensor, digits: torch.Tensor) -> float:
    """Greedy exact-match accuracy on a fixed prompt set, in [0, 1]."""
    ro = generate(model, prompts, task.max_new_tokens, task.eos_id, greedy=True)
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
    checkpoint_uri: str | None = None,
    endpoint_url: str | None = None,
    spill_dir: str | os.PathLike[str] | None = None,
    resume: bool = False,
    checkpoint_every: int = 25,
) -> dict[str, Any]:
    """Train one arm from ``init_state`` until ``cfg.budget_tokens`` generated tokens are spent.

    With ``checkpoint_uri`` the replay buffer checkpoints there (``/buffer``; shards spilled to
    ``spill_dir`` first) and so does the trainer (``/trainer``: model, optimizer, generators,
    progress), together every ``checkpoint_every`` steps; ``resume`` continues from the last pair.

    Returns a JSON-able dict: the accuracy curve (generated tokens, accuracy), tokens to reach
    ``cfg.target_acc`` (None if never), final accuracy, entropy (nats/token), wall time (s), steps,
    rollouts trained on, and the buffer's ``metrics()`` (replay arms).
    """
    task = make_task(cfg)
    model = TinyCausalLM(len(task), max_len=task.prompt_len + task.max_new_tokens)
    model.load_state_dict(init_state)
    opt = torch.optim.AdamW(model.parameters(), lr=arm.lr, weight_decay=0.0)
    # Same prompt stream for every arm with the same seed: differences come from the method alone.
    prompt_gen = torch.Generator().manual_seed(seed * 1000 + 1)
    sample_gen = torch.Generator().manual_seed(seed * 1000 + 2)
    replay_gen = torch.Generator().manual_seed(seed * 1000 + 3)
    stream = PromptStream(task, cfg.prompt_pool, seed, prompt_gen)
    rule = make_rule(arm)
    uses_buffer = arm.replay_ratio > 0 or rule is not None
    # The rules find a prompt's stored rollouts by its key, a field every rollout then carries.
    extra_fields = rules.prompt_key_field() if rule is not None else None

    def new_buffer() -> tr.RolloutBuffer:
        return tr.RolloutBuffer(
            capacity=arm.capacity,
            sampler=make_sampler(arm),
            max_staleness=arm.max_staleness,
            max_reuse=arm.max_reuse,
            extra_fields=extra_fields,
            storage=storage(),
            checkpoint=tr.Checkpointer(f"{checkpoint_uri}/buffer", interval_s=3600, endpoint_url=endpoint_url)
            if checkpoint_uri else None,
        )

    def storage() -> tr.TieredStorage | None:
        # The demo's live buffer is only ~50 KB (8 policy versions of 32 short rollouts): a 16 KiB hot
        # budget keeps just the newest shards hot, so sampling really pages older ones in from disk.
        return tr.TieredStorage(hot_bytes=16 << 10, spill_dir=spill_dir, io="posix") if spill_dir else None

    trainer_ckpt = TrainerCheckpoint(checkpoint_uri, endpoint_url) if checkpoint_uri else None
    saved = trainer_ckpt.load() if (trainer_ckpt is not None and resume) else None
    buf = None
    start = time.perf_counter()
    if saved is None:
        buf = new_buffer() if uses_buffer else None
        tokens_used, version, next_gid, trained_rollouts, trained_tokens = 0, 0, 0, 0, 0
        curve = [(0, evaluate(model, task, *eval_set))]
        compute_curve = [(0.0, curve[0][1])]
        next_eval = cfg.eval_every_tokens
        entropy, clip_frac, elapsed = float("nan"), 0.0, 0.0
    else:
        model.load_state_dict(saved["model"])
        load_optimizer_state(opt, saved["optimizer"])
        for gen, key in ((prompt_gen, "prompt_gen"), (sample_gen, "sample_gen"), (replay_gen, "replay_gen")):
            gen.set_state(saved[key])
        tokens_used, version, next_gid = saved["tokens_used"], saved["version"], saved["next_gid"]
        trained_rollouts, next_eval = saved["trained_rollouts"], saved["next_eval"]
        trained_tokens = saved["trained_tokens"]
        curve = [tuple(p) for p in saved["curve"]]
        compute_curve = [tuple(p) for p in saved["compute_curve"]]
        entropy, clip_frac, elapsed = saved["entropy"], saved["clip_frac"], saved["elapsed"]
        if "prompt_stream" in saved:
            stream.load(saved["prompt_stream"])
        if rule is not None and "rule" in saved:
            rule.load_state_dict(saved["rule"])
        if uses_buffer:
            buf = tr.RolloutBuffer.from_checkpoint(
                f"{checkpoint_uri}/buffer", endpoint_url=endpoint_url, tag=saved["version"],
                storage=storage(), checkpoint=True, progress=False, sampler=make_sampler(arm))
        if progress is not None:
            progress.update(tokens_used)

    index = rules.PromptIndex(buf) if rule is not None else None
    if index is not None and saved is not None:
        index.rebuild()

    def save_checkpoint() -> None:
        if buf is not None:
            buf.checkpoint(tag=version)  # the buffer state that matches this trainer checkpoint
        trainer_ckpt.save({
            "model": model.state_dict(), "optimizer": optimizer_state(opt),
            "prompt_gen": prompt_gen.get_state(), "sample_gen": sample_gen.get_state(),
            "replay_gen": replay_gen.get_state(), "tokens_used": tokens_used, "version": version,
            "next_gid": next_gid, "trained_rollouts": trained_rollouts, "trained_tokens": trained_tokens,
            "next_eval": next_eval,
            "curve": [list(p) for p in curve], "compute_curve": [list(p) for p in compute_curve], "entropy": entropy, "clip_frac": clip_frac,
            "elapsed": elapsed + time.perf_counter() - start,
            **({"prompt_stream": stream.state()} if cfg.prompt_pool is not None else {}),
            **({"rule": rule.state_dict()} if hasattr(rule, "state_dict") else {}),
        })

    while tokens_used < cfg.budget_tokens:
        prompts, digits = stream.next(arm.prompts_per_step)
        prompts = prompts.repeat_interleave(arm.group_size, dim=0)
        digits = digits.repeat_interleave(arm.group_size, dim=0)
        ro = generate(model, prompts, task.max_new_tokens, task.eos_id, sample_gen)
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
            step_tokens = int(ro.lengths.sum())
        elif rule is not None:
            fresh = _fresh_dict(ro, reward, adv, gid, version, task.prompt_len)
            step = rules.apply_rule(buf, index, rule, fresh, generator=replay_gen,
                                       replay_ratio=arm.replay_ratio if arm.replay_ratio > 0 else None)
            rows = rule_rows(step, len(reward))
            tokens, mask, old_lp = rows.tokens, rows.response_mask, rows.logprobs
            batch_adv, weights, step_tokens = rows.advantage, rows.weights, rows.trained_tokens
            batch = step.fresh
        else:
            if arm.beta_anneal and arm.sampler != "uniform":
                buf.sampler.beta = arm.beta + (1.0 - arm.beta) * min(tokens_used / cfg.budget_tokens, 1.0)
            fresh = _fresh_dict(ro, reward, adv, gid, version, task.prompt_len)
            batch = buf.compose(fresh, replay_ratio=arm.replay_ratio, generator=replay_gen)
            tokens, mask, old_lp = batch.tokens, batch.response_mask, batch.logprobs
            batch_adv, weights = batch.advantage, batch.weights.float()
            step_tokens = int(batch.attention_mask.sum())
        loss, stats = grpo_loss(model, tokens, mask, old_lp, batch_adv, weights, cfg.clip_eps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        version += 1
        trained_rollouts += tokens.shape[0]
        # Forward + backward runs over every real (unpadded) position of the batch, prompt included.
        trained_tokens += step_tokens
        clip_frac = stats["clip_frac"]
        if buf is not None:
            # A group's advantage depends only on its rewards, which don't change; the stored values keep
            # the priorities current for handles that survived this step.
            buf.update_priorities(batch.handles, batch.advantage)  # the rule's own rows keep theirs
            buf.advance(version)
        if progress is not None:
            progress.update(min(ro.num_generated, cfg.budget_tokens - (tokens_used - ro.num_generated)))
        while tokens_used >= next_eval or tokens_used >= cfg.budget_tokens:
            curve.append((tokens_used, evaluate(model, task, *eval_set)))
            compute_curve.append((tokens_used * cfg.gen_cost_per_token + trained_tokens, curve[-1][1]))
            next_eval += cfg.eval_every_tokens
            if tokens_used >= cfg.budget_tokens:
                break
        if trainer_ckpt is not None and version % checkpoint_every == 0 and tokens_used < cfg.budget_tokens:
            save_checkpoint()
    wall = elapsed + time.perf_counter() - start
    reached = next((t for t, a in curve if a >= cfg.target_acc), None)
    result: dict[str, Any] = {
        "config": asdict(arm),
        "curve": [[int(t), float(a)] for t, a in curve],
        "compute_curve": [[float(c), float(a)] for c, a in compute_curve],
        "tokens_to_target": reached,
        "final_acc": curve[-1][1],
        "best_acc": max(a for _, a in curve),
        "entropy": entropy,
        "clip_frac": clip_frac,
        "wall_s": wall,
        "steps": version,
        "generated_tokens": tokens_used,
        "trained_rollouts": trained_rollouts,
        "trained_tokens": trained_tokens,
        # In trained-token units: generated tokens at their relative cost, plus trained tokens.
        "compute": tokens_used * cfg.gen_cost_per_token + trained_tokens,
        # Rollouts trained on per rollout generated: 1 on-policy; the average reuse of a replay arm.
        "uses_per_rollout": trained_rollouts / max(next_gid * arm.group_size, 1),
    }
    if buf is not None:
        result["buffer_metrics"] = {k: float(v) for k, v in buf.metrics().items() if _is_number(v)}
        buf.close()  # publishes a final checkpoint
    return result


def _is_number(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return v.numel() == 1
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))


def warm_start(cfg: DemoConfig, seed: int) -> tuple[dict[str, torch.Tensor], float]:
    """The shared SFT warm start for ``seed``: (state dict, seconds it took)."""
    task = make_task(cfg)
    torch.manual_seed(seed)
    model = TinyCausalLM(len(task), max_len=task.prompt_len + task.max_new_tokens)
    t0 = time.perf_counter()
    sft_warm_start(model, task, cfg.sft_steps, cfg.sft_batch, cfg.sft_lr, torch.Generator().manual_seed(seed + 7))
    return copy.deepcopy(model.state_dict()), time.perf_counter() - t0


def eval_set(cfg: DemoConfig, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Held-out prompts (disjoint stream from training: its own generator)."""
    return make_task(cfg).prompts(cfg.eval_prompts, torch.Generator().manual_seed(10_000 + seed))


def run(
    out: str | os.PathLike[str] = "demo_output",
    seed: int = 0,
    full: bool = False,
    quick: bool = False,
    resume: bool = False,
    s3: str | None = None,
    endpoint_url: str | None = None,
    gen_cost_per_token: float | None = None,
    task: str = "sort",
) -> int:
    """Run the demo and write ``results.json``, ``accuracy_vs_tokens.png``,
    ``accuracy_vs_compute.png`` and ``table.txt`` under ``out``.

    Args:
        out: output directory (created).
        seed: base seed; ``full`` uses ``seed, seed + 1, seed + 2``.
        full: 3 seeds of on-policy and the replay study's winning arms for each task
            (`arms.FULL`), on both tasks: the sort task's outputs in ``out``, the arithmetic
            task's in ``out/arithmetic``.
        task: ``"sort"`` or ``"arithmetic"`` (without ``full``).
        quick: a few steps only, for tests (well under a minute).
        resume: continue a killed demo: finished arms are read back from ``out/progress.json``, the
            interrupted one continues from its last checkpoint.
        s3: checkpoint to ``s3://bucket/prefix`` instead of ``file://<out>/checkpoints``.
        endpoint_url: S3 endpoint (else AWS_ENDPOINT_URL / the AWS configuration).
        gen_cost_per_token: a generated token's cost relative to a trained one, for the compute
            columns (default: DemoConfig's FLOP ratio, 1/3).

    Returns:
        0 (a process exit code).
    """
    if endpoint_url is not None and s3 is None:
        raise ValueError("--endpoint-url only applies with --s3")
    if s3 is not None and not s3.startswith("s3://"):
        raise ValueError(f"--s3 must be an s3://bucket/prefix URI, got {s3!r}")
    if gen_cost_per_token is not None and not (isinstance(gen_cost_per_token, (int, float))
                                               and math.isfinite(gen_cost_per_token) and gen_cost_per_token >= 0):
        raise ValueError(f"--gen-cost must be a number >= 0, got {gen_cost_per_token!r}")
    tasks = ["sort", "arithmetic"] if full else [task]
    for name in tasks:
        cfg = default_config(full=full, quick=quick, task=name)
        if gen_cost_per_token is not None:
            cfg.gen_cost_per_token = float(gen_cost_per_token)
        where = Path(out) / name if (full and name != "sort") else Path(out)
        prefix = s3 if (s3 is None or name == "sort") else f"{s3.rstrip('/')}/{name}"
        _run_task(cfg, where, seed, full, quick, resume, prefix, endpoint_url)
    return 0


def _run_task(cfg: DemoConfig, out: Path, seed: int, full: bool, quick: bool, resume: bool, s3: str | None,
              endpoint_url: str | None) -> None:
    from tqdm.auto import tqdm

    seeds = [seed, seed + 1, seed + 2] if full else [seed]
    out_dir = Path(out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    base_uri = s3.rstrip("/") if s3 else f"file://{out_dir / 'checkpoints'}"
    progress_path = out_dir / "progress.json"
    done: dict[str, Any] = json.loads(progress_path.read_text()) if (resume and progress_path.exists()) else {}
    if not resume:
        import shutil

        for stale in ("checkpoints", "spill"):
            shutil.rmtree(out_dir / stale, ignore_errors=True)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    t0 = time.perf_counter()
    results: dict[int, dict[str, dict[str, Any]]] = {}
    warm: dict[int, dict[str, float]] = {}
    try:
        for s in seeds:
            init, sft_s = warm_start(cfg, s)
            ev = eval_set(cfg, s)
            results[s] = {}
            for arm in cfg.arms:
                label = f"seed {s} {arm.name}"
                key = f"{s}/{arm.name}"
                if key in done:
                    results[s][arm.name] = done[key]
                    print(f"{label}: finished before the interruption, results read back")
                    continue
                with tqdm(total=cfg.budget_tokens, desc=f"{label:<22}", unit="tok", unit_scale=True,
                          leave=True, dynamic_ncols=True) as bar:
                    results[s][arm.name] = train_arm(
                        arm, cfg, init, s, ev, progress=bar, checkpoint_uri=f"{base_uri}/seed{s}-{arm.name}",
                        endpoint_url=endpoint_url, spill_dir=out_dir / "spill" / f"seed{s}-{arm.name}",
                        resume=resume, checkpoint_every=cfg.checkpoint_every)
                    bar.set_postfix(acc=f"{results[s][arm.name]['final_acc']:.3f}")
                done[key] = results[s][arm.name]
                progress_path.write_text(json.dumps(done))
            warm[s] = {"sft_seconds": sft_s, "start_acc": results[s][cfg.arms[0].name]["curve"][0][1]}
    finally:
        torch.set_num_threads(old_threads)
    summary = report.summarize(results, cfg)
    table = report.format_table(summary, cfg)
    total = time.perf_counter() - t0
    what = (f"sort {cfg.num_digits} digits" if cfg.task == "sort"
            else f"reasoning-gym arithmetic, {cfg.num_terms} terms, 0/1 reward")
    header = (
        f"torchreplay demo: GRPO, {what}, {cfg.budget_tokens:,} generated tokens per arm, "
        f"seeds {seeds}, target {cfg.target_acc:.0%} exact match, a generated token costs "
        f"{cfg.gen_cost_per_token:.2f} trained tokens"
    )
    print("\n" + header + "\n" + table + f"\n\ntotal wall time {total:.0f}s; outputs in {out_dir}/")
    (out_dir / "table.txt").write_text(header + "\n" + table + "\n")
    report.plot(results, cfg, out_dir / "accuracy_vs_tokens.png")
    report.plot(results, cfg, out_dir / "accuracy_vs_compute.png", x="compute")
    payload = {
        "config": asdict(cfg),
        "mode": "quick" if quick else ("full" if full else "default"),
        "seeds": seeds,
        "torch_threads": cfg.threads,
        "total_wall_s": total,
        "warm_start": {str(s): v for s, v in warm.items()},
        "summary": summary,
        "runs": {str(s): r for s, r in results.items()},
    }
    (out_dir / "results.json").write_text(json.dumps(payload, indent=2))
