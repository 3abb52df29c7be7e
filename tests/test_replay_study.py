"""The replay study's harness (benchmarks/replay_study.py) on a few steps: it records every run
as a JSON line, a rerun skips finished runs (a killed study resumes), and the report reads them."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import replay_study  # noqa: E402


def test_the_study_resumes_and_reports(tmp_path):
    out, report_dir = tmp_path / "study.jsonl", tmp_path / "report"
    args = ["--task", "arithmetic", "--budget", "1500", "--out", str(out)]
    assert replay_study.main(["tune", "--arms", "on-policy,prior-base", *args]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 2 * len(replay_study.TUNING_GRID)
    assert {(r["arm"]["lr"], r["arm"]["prompts_per_step"], r["arm"]["group_size"]) for r in records} == \
        set(replay_study.TUNING_GRID)
    assert all(r["result"]["generated_tokens"] >= 1500 and "compute" in r["result"] for r in records)
    assert replay_study.main(["tune", "--arms", "on-policy,prior-base", *args]) == 0  # nothing left to run
    assert len(out.read_text().splitlines()) == len(records)
    assert replay_study.main(["final", "--seeds", "2", *args]) == 0
    final = [json.loads(line) for line in out.read_text().splitlines()][len(records):]
    assert {(r["arm"]["name"], r["seed"]) for r in final} == {(n, s) for n in ("on-policy", "prior-base")
                                                                for s in (0, 1)}
    assert replay_study.main(["report", "--task", "arithmetic", "--out", str(out),
                              "--report-dir", str(report_dir)]) == 0
    text = (report_dir / "arithmetic.md").read_text()
    assert "Final comparison (2 seeds)" in text and "prior-base" in text
    assert (report_dir / "arithmetic_accuracy_vs_compute.png").read_bytes()[:4] == b"\x89PNG"


def test_every_study_arm_builds_its_sampler():
    from torchreplay.demo.runner import make_sampler

    names = [a.name for a in replay_study.study_arms()]
    assert len(names) == len(set(names)) == 14
    for arm in replay_study.study_arms():
        if arm.replay_ratio:
            make_sampler(arm)
