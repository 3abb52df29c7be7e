"""The demo end to end in quick mode, plus its task and GRPO pieces."""

from __future__ import annotations

import json

import pytest
import torch

from torchreplay.demo import run
from torchreplay.demo.grpo import group_advantages
from torchreplay.demo.policy import TinyCausalLM, generate, token_logprobs
from torchreplay.demo.task import SortTask


@pytest.fixture(scope="module")
def quick_out(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("demo")
    assert run(out=str(out), quick=True) == 0
    return out


def test_quick_outputs_exist_and_are_sane(quick_out) -> None:
    res = json.loads((quick_out / "results.json").read_text())
    assert {"config", "summary", "runs", "seeds", "total_wall_s"} <= res.keys()
    runs = res["runs"][str(res["seeds"][0])]
    assert set(runs) == {"on-policy", "prior"}
    budget = res["config"]["budget_tokens"]
    for r in runs.values():
        assert {"curve", "tokens_to_target", "final_acc", "entropy", "wall_s", "generated_tokens"} <= r.keys()
        assert all(0.0 <= acc <= 1.0 for _, acc in r["curve"])
        assert 0.0 <= r["final_acc"] <= 1.0
        assert r["entropy"] >= 0.0
        # Each arm stops at the first step that reaches the shared budget.
        c = r["config"]
        per_step = c["prompts_per_step"] * c["group_size"] * (res["config"]["num_digits"] + 1)
        assert budget <= r["generated_tokens"] < budget + per_step
        tokens = [t for t, _ in r["curve"]]
        assert tokens == sorted(tokens) and tokens[0] == 0 and tokens[-1] == r["generated_tokens"]
    assert runs["on-policy"]["config"]["replay_ratio"] == 0.0
    assert runs["prior"]["config"]["replay_ratio"] > 0.0
    metrics = runs["prior"]["buffer_metrics"]
    assert metrics["sampled_replay"] > 0 and metrics["reuse_mean"] >= 0.0
    # Replay trains on more rollouts for the same generated tokens: that is the whole point.
    assert runs["prior"]["trained_rollouts"] > runs["on-policy"]["trained_rollouts"]
    for r in runs.values():
        # Compute accounting: every trained token counted once per step it is trained on.
        assert r["trained_tokens"] >= r["trained_rollouts"] * (res["config"]["num_digits"] + 2)
        assert r["compute"] == pytest.approx(r["generated_tokens"] * res["config"]["gen_cost_per_token"]
                                             + r["trained_tokens"])
        assert len(r["compute_curve"]) == len(r["curve"]) and r["compute_curve"][-1][0] == pytest.approx(r["compute"])
    # Replay trains on more tokens per generated token, so it costs more compute per generated token.
    assert runs["prior"]["trained_tokens"] > runs["on-policy"]["trained_tokens"]
    for png in ("accuracy_vs_tokens.png", "accuracy_vs_compute.png"):
        assert (quick_out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (quick_out / "accuracy_vs_tokens.png").stat().st_size > 1000
    assert (quick_out / "accuracy_vs_tokens.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "on-policy" in (quick_out / "table.txt").read_text()


def test_killed_demo_resumes_to_the_same_result(tmp_path, quick_out) -> None:
    """SIGKILL the demo while the replay arm trains; --resume finishes it with exactly the results
    of the uninterrupted run (model, optimizer, generators and buffer all restored)."""
    import os
    import signal
    import subprocess
    import sys

    out = tmp_path / "killed"
    # The child kills itself right after the replay arm's first checkpoint (demo_kill_child.py):
    # polling for the checkpoint and killing from here raced the demo's own end.
    child = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "demo_kill_child.py"),
                            "--quick", "--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           timeout=600)
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()[-2000:]
    assert (out / "checkpoints" / "seed0-prior" / "trainer" / "LATEST").exists()
    assert not (out / "results.json").exists()
    assert run(out=str(out), quick=True, resume=True) == 0
    resumed = json.loads((out / "results.json").read_text())["runs"]["0"]
    straight = json.loads((quick_out / "results.json").read_text())["runs"]["0"]
    for arm in ("on-policy", "prior"):
        assert resumed[arm]["curve"] == straight[arm]["curve"], arm
        assert resumed[arm]["trained_rollouts"] == straight[arm]["trained_rollouts"]
    assert os.path.exists(out / "accuracy_vs_tokens.png")


@pytest.mark.s3
def test_demo_checkpoints_to_s3(tmp_path, s3_server, s3_bucket) -> None:
    from torchreplay.checkpoint import open_store, read_manifest

    assert run(out=str(tmp_path), quick=True, s3=f"s3://{s3_bucket}/demo", endpoint_url=s3_server.endpoint_url) == 0
    store = open_store(f"s3://{s3_bucket}/demo/seed0-prior/buffer", s3_server.endpoint_url)
    assert read_manifest(store)["rollouts"] > 0
    assert not (tmp_path / "checkpoints").exists()


def test_task_scoring() -> None:
    task = SortTask(4)
    digits = torch.tensor([[3, 1, 2, 1], [0, 0, 9, 5]])
    target = task.target(digits)
    reward, exact = task.score(digits, target)
    assert exact.all() and torch.equal(reward, torch.ones(2))
    eos = task.tok.eos_id
    # Row 0: first two digits right then an early EOS; row 1: all wrong.
    bad = torch.tensor([[1, 1, eos, eos, eos], [9, 9, 0, 0, 1]])
    reward, exact = task.score(digits, bad)
    assert not exact.any()
    assert reward.tolist() == pytest.approx([2 / 5, 0.0])


def test_generation_logprobs_match_a_full_forward() -> None:
    task = SortTask(4)
    torch.manual_seed(0)
    model = TinyCausalLM(len(task.tok), max_len=task.prompt_len + task.max_new_tokens)
    g = torch.Generator().manual_seed(0)
    prompts, _ = task.prompts(16, g)
    ro = generate(model, prompts, task.max_new_tokens, task.tok.eos_id, g)
    lp, _ = token_logprobs(model, ro.tokens)
    m = ro.response_mask
    assert torch.allclose(lp[m], ro.logprobs[m], atol=1e-5)
    assert ro.num_generated == int(m.sum()) and not m[:, : task.prompt_len].any()


def test_group_advantages() -> None:
    reward = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    gid = torch.tensor([7, 7, 7, 7, 9, 9])
    adv = group_advantages(reward, gid)
    assert adv[:4].sum().abs() < 1e-5 and adv[0] > 0 > adv[1]
    assert torch.equal(adv[4:], torch.zeros(2))


def test_arithmetic_task_uses_reasoning_gyms_generator_and_scoring() -> None:
    """The sparse-reward task's questions are reasoning-gym's own, and so is its verdict: a right
    answer scores 1, a wrong or malformed one 0."""
    import reasoning_gym

    from torchreplay.demo.rg_task import ArithmeticTask

    task = ArithmeticTask(num_terms=2)
    prompts, indices = task.prompts(64, torch.Generator().manual_seed(3))
    assert prompts.shape == (64, task.prompt_len)
    reference = reasoning_gym.create_dataset("basic_arithmetic", size=1_000_000, seed=0, min_terms=2, max_terms=2,
                                             min_digits=1, max_digits=1, operators=("+", "-"),
                                             allow_parentheses=False, allow_negation=False)
    for row, index in zip(prompts[:8], indices[:8].tolist()):
        text = "".join(task.vocab[i] for i in row.tolist()).lstrip("_")
        assert text == reference[index]["question"] + ">"
    right = task.target(indices)
    reward, exact = task.score(indices, right)
    assert bool(exact.all()) and bool((reward == 1).all())
    wrong = right.roll(1, dims=0)  # another question's answer: mostly wrong
    reward, exact = task.score(indices, wrong)
    expected = torch.tensor([reference[i]["answer"] == reference[j]["answer"]
                             for i, j in zip(indices.tolist(), indices.roll(1).tolist())])
    assert torch.equal(exact, expected) and set(reward.tolist()) <= {0.0, 1.0}
    garbage = torch.full_like(right, task.stoi["+"])
    assert float(task.score(indices, garbage)[0].sum()) == 0.0


def test_a_few_grpo_steps_on_the_arithmetic_task(tmp_path) -> None:
    from torchreplay.demo import runner

    cfg = runner.default_config(quick=True)
    cfg.task, cfg.num_terms = "arithmetic", 2
    init, _ = runner.warm_start(cfg, 0)
    res = runner.train_arm(cfg.arms[1], cfg, init, 0, runner.eval_set(cfg, 0))
    assert res["generated_tokens"] >= cfg.budget_tokens and res["trained_tokens"] > res["generated_tokens"]
    assert res["buffer_metrics"]["sampled_replay"] > 0


def test_the_arithmetic_demo_writes_its_own_results(tmp_path) -> None:
    assert run(out=str(tmp_path), quick=True, task="arithmetic") == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["config"]["task"] == "arithmetic" and res["config"]["target_acc"] == 0.5
    runs = res["runs"][str(res["seeds"][0])]
    assert set(runs) == {"on-policy", "prior"}
    assert all(len(r["curve"]) == len(r["compute_curve"]) for r in runs.values())
    assert "reasoning-gym arithmetic" in (tmp_path / "table.txt").read_text()
