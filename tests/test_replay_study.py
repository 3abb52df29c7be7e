"""The replay study's harness (benchmarks/replay_study.py) on a few steps: it records every run
as a JSON line, a rerun skips finished runs (a killed study resumes), the final phase waits for a
complete tuning grid and picks its arms from it, and the report and the docs read the JSON."""

import dataclasses
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import replay_study  # noqa: E402
import study_report  # noqa: E402

GRID = [(3e-4, 4, 4), (1e-3, 4, 4)]


@pytest.fixture
def small_study(monkeypatch):
    """The study at a 2-point grid, a small eval set and a few hundred tokens a run."""
    real = replay_study.task_config

    def small(task, budget):
        cfg = real(task, budget)
        cfg.eval_prompts, cfg.sft_steps, cfg.prompt_pool = 64, 10, 8
        return cfg

    monkeypatch.setattr(replay_study, "TUNING_GRID", GRID)
    monkeypatch.setattr(replay_study, "task_config", small)


def test_the_study_resumes_picks_its_final_arms_and_writes_the_docs(tmp_path, small_study):
    out, report_dir = tmp_path / "study.jsonl", tmp_path / "report"
    args = ["--task", "sort", "--budget", "600", "--out", str(out)]
    assert replay_study.main(["tune", "--arms", "on-policy,prior", *args]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 2 * len(GRID)
    assert {(r["arm"]["lr"], r["arm"]["prompts_per_step"], r["arm"]["group_size"]) for r in records} == set(GRID)
    assert all(r["result"]["generated_tokens"] >= 600 and r["config"]["prompt_pool"] == 8 for r in records)
    # The final phase refuses while any arm lacks part of the grid: its choice must not depend on
    # which tuning runs happen to be done.
    assert replay_study.main(["final", "--seeds", "2", *args]) == 2
    assert replay_study.main(["tune", *args]) == 0
    tuned = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(tuned) == len(replay_study.study_arms()) * len(GRID)  # the first four were not rerun
    assert replay_study.main(["final", "--seeds", "2", *args]) == 0
    final = [json.loads(line) for line in out.read_text().splitlines()][len(tuned):]
    names = list(dict.fromkeys(r["arm"]["name"] for r in final))
    best = replay_study.best_records(tuned, "sort")
    ours = min(replay_study.LIBRARY_ARMS, key=lambda n: replay_study.score(best[n]))
    assert names[:2] == ["on-policy", ours]
    library = list(dict.fromkeys([ours, "prior"]))  # the default sampler runs the finals in any case
    assert names[1:1 + len(library)] == library
    assert names[1 + len(library):-1] == list(replay_study.PEER_ARMS) and "+" in names[-1]
    assert {r["seed"] for r in final} == {0, 1} and len(final) == 2 * len(names)
    for rec in final:  # each at its tuned setting
        assert (rec["arm"]["lr"], rec["arm"]["prompts_per_step"]) == (best[rec["arm"]["name"]]["arm"]["lr"],
                                                                    best[rec["arm"]["name"]]["arm"]["prompts_per_step"])
    assert replay_study.main(["report", "--task", "sort", "--out", str(out), "--report-dir", str(report_dir)]) == 0
    assert "Final comparison (2 seeds)" in (report_dir / "sort.md").read_text()
    assert (report_dir / "sort_accuracy_vs_compute.png").read_bytes()[:4] == b"\x89PNG"

    readme, findings = tmp_path / "README.md", tmp_path / "findings.md"
    for path in (readme, findings):
        path.write_text(f"kept above\n{study_report.BEGIN}\nold table\n{study_report.END}\nkept below\n")
    assert replay_study.main(["docs", "--out", str(out), "--report-dir", str(report_dir), "--budget", "600",
                              "--readme", str(readme), "--findings", str(findings)]) == 0
    summary = json.loads((report_dir / "summary.json").read_text())
    assert [s["task"] for s in summary] == ["sort"] and list(summary[0]["arms"]) == names
    text = readme.read_text()
    assert text.startswith("kept above\n") and text.endswith("kept below\n") and "old table" not in text
    assert study_report.LABELS["prompt-replay"] in text and "R=4" in text
    assert "### Tuning" in findings.read_text()


def _record(task, arm, seed, hits, budget=100_000, trained_per_generated=3.0):
    """A synthetic final-phase record: accuracy 0.1 until generated token `hits`, then 0.9 (never
    when `hits` is None), evaluated every 10K tokens; compute recorded at R = 1/3."""
    curve = [[t, 0.9 if hits is not None and t >= hits else 0.1] for t in range(0, budget + 1, 10_000)]
    compute = [[t / 3 + t * trained_per_generated, a] for t, a in curve]
    return {"task": task, "phase": "final", "seed": seed, "unix_s": 0.0,
            "arm": {"name": arm, "lr": 3e-4, "prompts_per_step": 8, "group_size": 8},
            "config": {"target_acc": 0.5, "budget_tokens": budget, "gen_cost_per_token": 1 / 3,
                       "eval_every_tokens": 10_000},
            "result": {"curve": curve, "compute_curve": compute, "final_acc": curve[-1][1],
                       "tokens_to_target": hits if hits is None else next(t for t, a in curve if a >= 0.5),
                       "generated_tokens": budget, "trained_tokens": budget * trained_per_generated,
                       "uses_per_rollout": 1.0, "wall_s": 10.0}}


def test_study_report_prices_savings_and_goals():
    """Savings of the means with an unreached run counted as its budget, compute re-priced from the
    recorded curve, R_80 = 4 T / G, and the goal verdicts. Mutations caught: leaving unreached runs
    out (on-policy's mean would be 60K, the saving 33%, not 60%); re-pricing without removing the
    recorded price (compute off by t/3); a peer verdict on accuracy alone."""
    records = [_record("sort", "on-policy", s, h) for s, h in ((0, 60_000), (1, None))]
    records += [_record("sort", "prior", s, 40_000) for s in (0, 1)]
    records += [_record("sort", "prompt-replay", s, h) for s, h in ((0, 30_000), (1, 50_000))]
    summary = study_report.summarize_task(records, "sort")
    arms = summary["arms"]
    assert arms["on-policy"]["tokens_to_target"][0] == 80_000 and arms["on-policy"]["reached"] == 1
    assert arms["prior"]["token_saving"] == pytest.approx(0.5)
    assert summary["prices"]["R_80"] == pytest.approx(12.0)
    # prior reaches at 40K generated: 40K * R + 120K trained.
    for label, price in (("R=1/3", 1 / 3), ("R=4", 4.0), ("R_80", 12.0)):
        assert arms["prior"]["compute_to_target"][label][0] == pytest.approx(40_000 * price + 120_000)
    g = summary["goals"]
    assert g["best_arm"] == "prior" and g["saving_goal_met"] and g["library_best"] == "prior"
    assert g["library_vs_peers"]["prompt-replay"]["met"]  # 40K each on average, same accuracy
    # A peer that needs fewer tokens on the means beats the library arm: the verdict says so.
    faster = [r for r in records if r["arm"]["name"] != "prompt-replay"]
    faster += [_record("sort", "prompt-replay", s, 30_000) for s in (0, 1)]
    g = study_report.summarize_task(faster, "sort")["goals"]
    assert not g["library_vs_peers"]["prompt-replay"]["met"] and not g["peer_goal_met"]
    assert g["best_arm"] == "prompt-replay" and g["best_saving"] == pytest.approx(0.625)
    assert "not met" in "\n".join(study_report.goal_lines(study_report.summarize_task(faster, "sort")))


def test_every_study_arm_builds_its_sampler_and_rule():
    from torchreplay.demo.peer_arms import make_rule
    from torchreplay.demo.runner import make_sampler

    arms = replay_study.study_arms()
    names = [a.name for a in arms]
    assert len(names) == len(set(names)) == 9
    assert set(replay_study.LIBRARY_ARMS) | set(replay_study.PEER_ARMS) <= set(names)
    for arm in arms:
        if arm.replay_ratio:
            make_sampler(arm)
        if arm.rule is not None:
            make_rule(arm)
            # A rule looks a prompt up again when it comes back, one epoch later on average: the
            # staleness cap must span an epoch at every batch shape of the grid, and the buffer
            # must hold that many steps of 64 rollouts.
            epoch = replay_study.PROMPT_POOL // min(p for _, p, _ in replay_study.TUNING_GRID)
            assert arm.max_staleness >= epoch and arm.capacity >= arm.max_staleness * 64
        assert dataclasses.asdict(arm)["name"] == arm.name


def test_runs_that_never_reach_the_target_are_ranked_by_final_accuracy():
    """Two tuning runs that both miss the target tie on tokens, whatever each overshot the budget
    by, so the more accurate one is the arm's best setting. Mutation caught: scoring a miss by its
    own generated tokens (the worse run, stopping 10 tokens earlier, won; that chose lr 1e-3 for
    TRL's group swap on arithmetic in the first pass of this study)."""
    def run(lr, generated, acc):
        return {"task": "arithmetic", "phase": "tune", "arm": {"name": "group-swap", "lr": lr},
                "config": {"budget_tokens": 200_000, "eval_every_tokens": 10_000},
                "result": {"tokens_to_target": None, "generated_tokens": generated, "final_acc": acc}}

    better, worse = run(3e-4, 200_100, 0.49), run(1e-3, 200_090, 0.28)
    assert replay_study.score(better) < replay_study.score(worse)
    assert replay_study.best_records([worse, better], "arithmetic")["group-swap"] is better
    reached = dict(better, result=dict(better["result"], tokens_to_target=190_000, final_acc=0.3))
    assert replay_study.score(reached) < replay_study.score(better)


def test_runs_crossing_at_one_evaluation_tie_on_tokens_and_other_budgets_are_left_out(small_study):
    """Tokens to target count at the evaluation that saw it: two runs that crossed at the 100K
    evaluation, 5 tokens of step overshoot apart, tie on tokens and the more accurate one ranks
    first (mutation caught: raw token counts ranked the less accurate run first). A record at
    another budget or pool (a smoke run in the same file) is not this study's."""
    def run(reached, acc, budget=200_000, pool=8):
        return {"task": "arithmetic", "phase": "tune", "arm": {"name": "prior", "lr": 3e-4},
                "config": {"budget_tokens": budget, "eval_every_tokens": 10_000, "prompt_pool": pool},
                "result": {"tokens_to_target": reached, "generated_tokens": budget, "final_acc": acc}}

    early, accurate = run(100_005, 0.55), run(100_010, 0.60)
    assert study_report.tokens_to_target(early) == study_report.tokens_to_target(accurate) == 100_000
    assert replay_study.score(accurate) < replay_study.score(early)
    assert study_report.tokens_to_target(run(None, 0.4)) == 200_000
    cfg = replay_study.task_config("arithmetic", 200_000)
    smoke, other_pool = run(4_000, 0.9, budget=4_000), run(90_000, 0.9, pool=1024)
    assert replay_study.current([early, smoke, other_pool], cfg) == [early]
