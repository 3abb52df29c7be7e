"""The replay study (issues #17 and #29): does replay save generation compute, which of this
library's samplers does it best, and how do they fare against the replay rules of the literature?
Resumable: every finished run is one JSON line appended to `--out`, and a rerun skips what is
there, so a killed study continues where it stopped.

Arms (`torchreplay.demo.arms.study_arms()`; the same tiny policy, SFT warm start, fixed prompt set
and generation budget as `torchreplay demo`):
- on-policy GRPO;
- this library's samplers: uniform FIFO replay (Arnal et al., arXiv 2604.08706), |A|-prioritized
  replay (PrioritizedSampler's defaults, the winners of the one-factor-at-a-time study in git
  history), FreshnessSampler (|A| decayed by age);
- the peer rules (torchreplay.rules): TRL's group swap, AR3PO's response reuse (arXiv 2509.25808),
  RePO's prompt replay (arXiv 2506.09340);
- FreshnessSampler joined to each prompt-level rule.

Phases:
- `tune`: every arm on seed 0 over the same grid of learning rate x batch shape (TUNING_GRID);
- `final`: once every arm has run the whole grid: on-policy, the best library sampler arm, the
  three peer rules and the better combination, each at its best tuned setting, over `--seeds`
  (default 5);
- `report`: a markdown table and PNG plots (accuracy against generated tokens and against total
  compute) from the JSON lines;
- `docs`: benchmarks/results/replay_study/summary.json, and the generated sections of README.md and
  docs/demo_findings.md, from the JSON lines (benchmarks/study_report.py).

    python benchmarks/replay_study.py tune   --task arithmetic
    python benchmarks/replay_study.py final  --task arithmetic
    python benchmarks/replay_study.py report --task arithmetic
    python benchmarks/replay_study.py docs
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

import study_report
from torchreplay.demo import arms, report, runner
from torchreplay.demo.arms import ArmConfig
from torchreplay.demo.runner import DemoConfig

# Learning rate x (fresh prompts per step, group size): the same tuning budget for every arm.
TUNING_GRID = [(lr, prompts, group) for lr in (3e-4, 1e-3) for prompts, group in ((8, 8), (4, 16))]
PROMPT_POOL = arms.PROMPT_POOL
LIBRARY_ARMS, PEER_ARMS = arms.LIBRARY_ARMS, arms.PEER_ARMS
study_arms = arms.study_arms


def task_config(task: str, budget: int | None) -> DemoConfig:
    cfg = runner.default_config()
    cfg.task = task
    if task == "arithmetic":
        cfg.num_terms, cfg.reward, cfg.target_acc, cfg.sft_steps = 2, "exact", 0.5, 150
        cfg.budget_tokens = 200_000
    if budget is not None:
        cfg.budget_tokens = budget
    cfg.eval_every_tokens = max(cfg.budget_tokens // 20, 1)
    cfg.prompt_pool = PROMPT_POOL
    return cfg


def run_key(task: str, phase: str, arm: ArmConfig, seed: int, cfg: DemoConfig) -> str:
    return (f"{task}|{phase}|{arm.name}|lr={arm.lr:g}|{arm.prompts_per_step}x{arm.group_size}|seed={seed}"
            f"|{cfg.budget_tokens}|pool={cfg.prompt_pool}")


def append_record(path: Path, record: dict[str, Any]) -> None:
    """One line, one write(2) on an O_APPEND descriptor: processes sharing `path` never interleave."""
    data = (json.dumps(record) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        if os.write(fd, data) != len(data):
            raise OSError(f"short append to {path}")
    finally:
        os.close(fd)


def load(out: Path) -> list[dict[str, Any]]:
    if not out.exists():
        return []
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def score(record: dict[str, Any]) -> tuple[float, float]:
    """Lower is better: tokens to target, then -final accuracy. Tokens are counted at the evaluation
    that first saw the target (`study_report.tokens_to_target`: runs overshoot each evaluation point
    by different fractions of a step), and every run that misses the target ties at twice the
    budget, so final accuracy ranks runs that cross at the same evaluation, and misses."""
    r = record["result"]
    return float(study_report.tokens_to_target(record)), -float(r["final_acc"])


def current(records: list[dict[str, Any]], cfg: DemoConfig) -> list[dict[str, Any]]:
    """The records run at `cfg`'s budget and prompt pool (a smoke run at another budget, written to
    the same file, must not count towards this study's grid or its tables)."""
    return [r for r in records if r["task"] == cfg.task and r["config"]["budget_tokens"] == cfg.budget_tokens
            and r["config"].get("prompt_pool") == cfg.prompt_pool]


def best_records(records: list[dict[str, Any]], task: str) -> dict[str, dict[str, Any]]:
    """Each arm's best tuning run (lowest `score`) on `task`."""
    best: dict[str, dict[str, Any]] = {}
    for rec in records:
        if rec["task"] == task and rec["phase"] == "tune":
            name = rec["arm"]["name"]
            if name not in best or score(rec) < score(best[name]):
                best[name] = rec
    return best


def best_settings(records: list[dict[str, Any]], task: str) -> dict[str, ArmConfig]:
    return {name: ArmConfig(**rec["arm"]) for name, rec in best_records(records, task).items()}


def final_arms(records: list[dict[str, Any]], task: str) -> list[ArmConfig]:
    """The final phase's arms, each at its tuned setting: on-policy, this library's best sampler arm
    and its default one (PrioritizedSampler), every peer rule, and the best of our sampler joined to
    a rule. ValueError until every arm has
    run the whole tuning grid (the choice must not depend on which runs happen to be done)."""
    names = [a.name for a in study_arms()]
    runs = {(r["arm"]["name"], r["key"]) for r in records if r["task"] == task and r["phase"] == "tune"}
    missing = [n for n in names if sum(1 for name, _ in runs if name == n) < len(TUNING_GRID)]
    if missing:
        raise ValueError(f"{task}: tune phase incomplete for {', '.join(missing)}")
    best = best_records(records, task)
    combos = [n for n in names if "+" in n]
    ours = min(LIBRARY_ARMS, key=lambda n: score(best[n]))
    # The library's default sampler is what a user gets without choosing: it runs the final phase
    # whether or not seed 0's tuning ranked it first.
    chosen = ["on-policy", ours, *([arms.DEFAULT_REPLAY] if ours != arms.DEFAULT_REPLAY else []), *PEER_ARMS,
              min(combos, key=lambda n: score(best[n]))]
    return [ArmConfig(**best[n]["arm"]) for n in chosen]


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
            key = run_key(task, phase, arm, seed, cfg)
            if key in done:
                continue
            start = time.perf_counter()
            result = runner.train_arm(arm, cfg, init, seed, evaluation)
            record = {"key": key, "task": task, "phase": phase, "seed": seed, "arm": dataclasses.asdict(arm),
                      "config": dataclasses.asdict(dataclasses.replace(cfg, arms=[])), "result": result,
                      "unix_s": time.time()}
            append_record(append_to, record)
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


def write_docs(records: list[dict[str, Any]], report_dir: Path, readme: Path, findings: Path,
               budget: int | None = None) -> None:
    """Both tasks' summaries to `report_dir/summary.json`, and the README's and the findings page's
    generated sections rewritten from them (the date is the newest final run's)."""
    tasks = [t for t in ("arithmetic", "sort") if any(r["task"] == t and r["phase"] == "final" for r in records)]
    summaries = [study_report.summarize_task(current(records, task_config(task, budget)), task) for task in tasks]
    newest = max(r["unix_s"] for r in records if r["phase"] == "final")
    date = time.strftime("%Y-%m-%d", time.gmtime(newest))
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / "summary.json").write_text(json.dumps(summaries, indent=2) + "\n")
    study_report.replace_generated(readme, study_report.readme_section(summaries, date))
    study_report.replace_generated(findings, study_report.findings_section(summaries, records, date))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("phase", choices=("tune", "final", "report", "docs"))
    parser.add_argument("--task", choices=("sort", "arithmetic"), default="arithmetic")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/replay_study.jsonl"))
    parser.add_argument("--report-dir", type=Path, default=Path("benchmarks/results/replay_study"))
    parser.add_argument("--budget", type=int, default=None, help="generated tokens per run (default: the task's)")
    parser.add_argument("--seeds", type=int, default=5, help="seeds of the final comparison: first-seed .. seeds-1")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--append-to", type=Path, default=None,
                        help="append new records here instead of --out (to split a phase over processes)")
    parser.add_argument("--arms", default=None, help="comma-separated arm names (default: all)")
    parser.add_argument("--readme", type=Path, default=Path("README.md"), help="docs phase: README to regenerate")
    parser.add_argument("--findings", type=Path, default=Path("docs/demo_findings.md"),
                        help="docs phase: findings page to regenerate")
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.phase == "report":
        write_report(args.task, args.out, args.report_dir)
        return 0
    if args.phase == "docs":
        write_docs(load(args.out), args.report_dir, args.readme, args.findings, args.budget)
        return 0
    if args.phase == "tune":
        arms = [a for a in study_arms() if args.arms is None or a.name in args.arms.split(",")]
        grid = [dataclasses.replace(a, lr=lr, prompts_per_step=p, group_size=g) for a in arms
                for lr, p, g in TUNING_GRID]
        execute(args.task, "tune", grid, [0], args.out, args.budget, args.append_to)
        return 0
    try:
        chosen = final_arms(current(load(args.out), task_config(args.task, args.budget)), args.task)
    except ValueError as exc:
        print(f"run the tune phase first: {exc}", file=sys.stderr)
        return 2
    execute(args.task, "final", [copy.deepcopy(a) for a in chosen], list(range(args.first_seed, args.seeds)),
            args.out, args.budget, args.append_to)
    return 0


if __name__ == "__main__":
    sys.exit(main())
