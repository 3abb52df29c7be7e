"""The replay study (issue #17): does |A|-prioritized replay save generation compute, where, and
with which settings? Resumable: every finished run is one JSON line appended to `--out`, and a
rerun skips what is there, so a killed study continues where it stopped.

Arms (same tiny policy, SFT warm start, prompt stream and generation budget as `torchreplay demo`):
- on-policy GRPO;
- uniform FIFO replay (Arnal et al., arXiv 2604.08706);
- |A|-prioritized replay, fresh-anchored, with age eviction (arXiv 2606.04560): a base arm and one
  factor changed at a time: alpha {0.3, 0.6, 1.0}, beta fixed 0.4 or annealed to 1, weight norm
  {batch_max, batch_mean, buffer_max}, zero-advantage rollouts left out or kept, reuse cap
  {2, 4, 8}, staleness cap {2, 4, 8};
- FreshnessSampler (|A| decayed by age).
A full factorial of the prioritized factors is 324 arms; one factor at a time around the base is
what two cores can run, and it answers which setting matters.

Phases:
- `tune`: every arm on seed 0 over the same grid of learning rate x batch shape (TUNING_GRID);
- `final`: on-policy, uniform, the best prioritized arm and the freshness arm, each at its best
  tuned setting, over `--seeds` (default 5);
- `report`: a markdown table and PNG plots (accuracy against generated tokens and against total
  compute) from the JSON lines.

    python benchmarks/replay_study.py tune   --task arithmetic
    python benchmarks/replay_study.py final  --task arithmetic
    python benchmarks/replay_study.py report --task arithmetic
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from torchreplay.demo import report, runner
from torchreplay.demo.runner import ArmConfig, DemoConfig

# Learning rate x (fresh prompts per step, group size): the same tuning budget for every arm.
TUNING_GRID = [(lr, prompts, group) for lr in (3e-4, 1e-3) for prompts, group in ((8, 8), (4, 16))]
BASE = dict(replay_ratio=0.5, max_staleness=4, max_reuse=4)
PRIOR_BASE = dict(sampler="prioritized", alpha=0.6, beta=0.4, weight_norm="batch_max", keep_zero_advantage=False)


def study_arms() -> list[ArmConfig]:
    """Every arm of the study, at placeholder lr and batch shape (the tuning grid sets them)."""
    def arm(name: str, **kw: Any) -> ArmConfig:
        return ArmConfig(name=name, lr=3e-4, prompts_per_step=8, group_size=8, **kw)

    arms = [arm("on-policy"), arm("uniform-replay", sampler="uniform", **BASE),
            arm("prior-base", **BASE, **PRIOR_BASE)]
    variations: list[tuple[str, dict[str, Any]]] = [
        ("prior-alpha0.3", {"alpha": 0.3}), ("prior-alpha1.0", {"alpha": 1.0}),
        ("prior-beta-anneal", {"beta_anneal": True}),
        ("prior-norm-batch_mean", {"weight_norm": "batch_mean"}), ("prior-norm-buffer_max", {"weight_norm": "buffer_max"}),
        ("prior-keep-zero-adv", {"keep_zero_advantage": True}),
        ("prior-reuse2", {"max_reuse": 2}), ("prior-reuse8", {"max_reuse": 8}),
        ("prior-stale2", {"max_staleness": 2}), ("prior-stale8", {"max_staleness": 8}),
    ]
    for name, change in variations:
        arms.append(arm(name, **{**BASE, **PRIOR_BASE, **change}))
    arms.append(arm("freshness", **{**BASE, **PRIOR_BASE, "sampler": "freshness", "tau": 4.0}))
    return arms


def task_config(task: str, budget: int | None) -> DemoConfig:
    cfg = runner.default_config()
    cfg.task = task
    if task == "arithmetic":
        cfg.num_terms, cfg.reward, cfg.target_acc, cfg.sft_steps = 2, "exact", 0.5, 150
        cfg.budget_tokens = 200_000
    if budget is not None:
        cfg.budget_tokens = budget
    cfg.eval_every_tokens = max(cfg.budget_tokens // 20, 1)
    return cfg


def run_key(task: str, phase: str, arm: ArmConfig, seed: int, budget: int) -> str:
    return f"{task}|{phase}|{arm.name}|lr={arm.lr:g}|{arm.prompts_per_step}x{arm.group_size}|seed={seed}|{budget}"


def load(out: Path) -> list[dict[str, Any]]:
    if not out.exists():
        return []
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def score(record: dict[str, Any]) -> tuple[float, float]:
    """Lower is better: tokens to target (the budget and more if never), then -final accuracy."""
    r = record["result"]
    reached = r["tokens_to_target"] if r["tokens_to_target"] is not None else 2 * r["generated_tokens"]
    return float(reached), -float(r["final_acc"])


def best_settings(records: list[dict[str, Any]], task: str) -> dict[str, ArmConfig]:
    best: dict[str, dict[str, Any]] = {}
    for rec in records:
        if rec["task"] == task and rec["phase"] == "tune":
            name = rec["arm"]["name"]
            if name not in best or score(rec) < score(best[name]):
                best[name] = rec
    return {name: ArmConfig(**rec["arm"]) for name, rec in best.items()}


def execute(task: str, phase: str, arms: list[ArmConfig], seeds: list[int], out: Path, budget: int | None,
            append_to: Path | None = None) -> None:
    """Run what `out` (and `append_to`) do not hold yet, appending each record to `append_to`
    (default `out`): two processes can share the work, each appending to its own file."""
    cfg = task_config(task, budget)
    append_to = append_to or out
    done = {rec["key"] for rec in load(out) + (load(append_to) if append_to != out else [])}
    torch.set_num_threads(cfg.threads)
    for seed in seeds:
        init, _ = runner.warm_start(cfg, seed)
        evaluation = runner.eval_set(cfg, seed)
        for arm in arms:
            key = run_key(task, phase, arm, seed, cfg.budget_tokens)
            if key in done:
                continue
            start = time.perf_counter()
            result = runner.train_arm(arm, cfg, init, seed, evaluation)
            record = {"key": key, "task": task, "phase": phase, "seed": seed, "arm": dataclasses.asdict(arm),
                      "config": dataclasses.asdict(dataclasses.replace(cfg, arms=[])), "result": result,
                      "unix_s": time.time()}
            with append_to.open("a") as f:
                f.write(json.dumps(record) + "\n")
            print(f"{key}: final acc {result['final_acc']:.3f}, tokens to target {result['tokens_to_target']}, "
                  f"{time.perf_counter() - start:.0f}s", flush=True)


def _thousands(value: float | None) -> str:
    return "not reached" if value is None else f"{value / 1e3:.0f}K"


def write_report(task: str, out: Path, report_dir: Path) -> None:
    records = [r for r in load(out) if r["task"] == task]
    report_dir.mkdir(parents=True, exist_ok=True)
    lines = [f"# Replay study: {task}", ""]
    tuned = [r for r in records if r["phase"] == "tune"]
    if tuned:
        lines += ["## Tuning (seed 0): best setting per arm", "",
                  "| arm | lr | prompts x group | tokens to target | final acc | compute to target | trained tokens "
                  "| wall s |", "|---|---|---|---|---|---|---|---|"]
        cfg = DemoConfig(**{**tuned[0]["config"], "arms": []})
        for name, arm in best_settings(records, task).items():
            rec = min((r for r in tuned if r["arm"]["name"] == name), key=score)
            res = rec["result"]
            compute = report.compute_to_target(res, cfg)
            lines.append(f"| {name} | {arm.lr:g} | {arm.prompts_per_step}x{arm.group_size} | "
                         f"{_thousands(res['tokens_to_target'])} | {res['final_acc']:.3f} | {_thousands(compute)} | "
                         f"{_thousands(res['trained_tokens'])} | {res['wall_s']:.0f} |")
    final = [r for r in records if r["phase"] == "final"]
    if final:
        cfg = DemoConfig(**{**final[0]["config"], "arms": []})
        names = list(dict.fromkeys(r["arm"]["name"] for r in final))
        cfg.arms = [ArmConfig(**next(r["arm"] for r in final if r["arm"]["name"] == n)) for n in names]
        results: dict[int, dict[str, Any]] = {}
        for r in final:
            results.setdefault(r["seed"], {})[r["arm"]["name"]] = r["result"]
        complete = {s: v for s, v in results.items() if set(v) == set(names)}
        if complete:
            summary = report.summarize(complete, cfg)
            lines += ["", f"## Final comparison ({len(complete)} seeds)", "", "```",
                      report.format_table(summary, cfg), "```"]
            report.plot(complete, cfg, report_dir / f"{task}_accuracy_vs_tokens.png")
            report.plot(complete, cfg, report_dir / f"{task}_accuracy_vs_compute.png", x="compute")
            (report_dir / f"{task}_summary.json").write_text(json.dumps(summary, indent=2))
    (report_dir / f"{task}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("phase", choices=("tune", "final", "report"))
    parser.add_argument("--task", choices=("sort", "arithmetic"), default="arithmetic")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/replay_study.jsonl"))
    parser.add_argument("--report-dir", type=Path, default=Path("benchmarks/results/replay_study"))
    parser.add_argument("--budget", type=int, default=None, help="generated tokens per run (default: the task's)")
    parser.add_argument("--seeds", type=int, default=5, help="seeds of the final comparison: first-seed .. seeds-1")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--append-to", type=Path, default=None,
                        help="append new records here instead of --out (to split a phase over processes)")
    parser.add_argument("--arms", default=None, help="comma-separated arm names (default: all)")
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.phase == "report":
        write_report(args.task, args.out, args.report_dir)
        return 0
    if args.phase == "tune":
        arms = [a for a in study_arms() if args.arms is None or a.name in args.arms.split(",")]
        grid = [dataclasses.replace(a, lr=lr, prompts_per_step=p, group_size=g) for a in arms
                for lr, p, g in TUNING_GRID]
        execute(args.task, "tune", grid, [0], args.out, args.budget, args.append_to)
        return 0
    best = best_settings(load(args.out), args.task)
    priors = [n for n in best if n.startswith("prior")]
    if not priors or "on-policy" not in best:
        print("run the tune phase first (on-policy and at least one prioritized arm)", file=sys.stderr)
        return 2
    best_prior = min(priors, key=lambda n: score(min(
        (r for r in load(args.out) if r["task"] == args.task and r["phase"] == "tune" and r["arm"]["name"] == n),
        key=score)))
    chosen = [best[n] for n in ("on-policy", "uniform-replay", best_prior, "freshness") if n in best]
    execute(args.task, "final", [copy.deepcopy(a) for a in chosen], list(range(args.first_seed, args.seeds)),
            args.out, args.budget, args.append_to)
    return 0


if __name__ == "__main__":
    sys.exit(main())
