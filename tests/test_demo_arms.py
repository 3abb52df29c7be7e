"""The evidence sets the defaults: the demo's tuned settings and `--full` arms (torchreplay/demo/arms.py)
are the replay study's, read from its committed JSON (benchmarks/results/)."""

import json
import sys
from pathlib import Path

import pytest

from torchreplay.demo import arms, runner

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import replay_study  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def _records():
    return replay_study.load(RESULTS / "replay_study.jsonl")


@pytest.mark.parametrize("task", ["sort", "arithmetic"])
def test_tuned_settings_are_the_studys(task):
    """Each arm's (lr, prompts, group) is its best tuning run's. Fails when the study is rerun and
    chooses differently, until arms.TUNED follows."""
    best = replay_study.best_records(_records(), task)
    assert set(best) == {a.name for a in arms.study_arms()}
    for name, rec in best.items():
        setting = (rec["arm"]["lr"], rec["arm"]["prompts_per_step"], rec["arm"]["group_size"])
        assert arms.TUNED[task].get(name, (3e-4, 8, 8)) == setting, name
        assert arms.arm(name, task) == replay_study.ArmConfig(**rec["arm"]), name


@pytest.mark.parametrize("task", ["sort", "arithmetic"])
def test_full_runs_on_policy_and_the_studys_winners(task):
    """`--full` runs on-policy, the study's best arm and this library's best sampler arm on each task;
    the peer rules that lost stay in the study only."""
    summary = {s["task"]: s for s in json.loads((RESULTS / "replay_study" / "summary.json").read_text())}[task]
    winners = ["on-policy", summary["goals"]["best_arm"], summary["goals"]["library_best"]]
    assert arms.FULL[task] == tuple(dict.fromkeys(winners))
    cfg = runner.default_config(full=True, task=task)
    assert [a.name for a in cfg.arms] == list(arms.FULL[task])
    assert cfg.prompt_pool == arms.PROMPT_POOL == replay_study.task_config(task, None).prompt_pool
    plain = runner.default_config(task=task)
    assert [a.name for a in plain.arms] == ["on-policy", "prior"]


def test_an_unknown_arm_is_refused_by_name():
    with pytest.raises(ValueError, match="arm must be one of"):
        arms.arm("hindsight", "sort")
