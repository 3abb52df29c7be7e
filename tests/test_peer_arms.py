"""The demo's peer-rule arms (torchreplay/demo/peer_arms.py): the finite prompt pool, the rows a
rule step trains on, and a rule arm's exact resume."""

from __future__ import annotations

import pytest
import torch

from torchreplay.demo import runner, state
from torchreplay.demo.peer_arms import PromptStream, make_rule
from torchreplay.demo.arms import ArmConfig
from torchreplay.demo.task import SortTask


def test_a_prompt_pool_is_visited_in_epochs_and_its_position_resumes():
    """Every epoch visits each pool prompt exactly once, in a new order; a stream restored from
    `state()` continues exactly. Fails if an epoch repeats or skips a prompt, or the order is not
    redrawn."""
    task = SortTask(6)
    stream = PromptStream(task, 10, seed=3, generator=torch.Generator().manual_seed(1))
    seen = [tuple(p) for _ in range(5) for p in stream.next(4)[0].tolist()]  # 20 draws = 2 epochs
    pool = {tuple(p) for p in stream.prompts.tolist()}
    assert set(seen[:10]) == pool and set(seen[10:]) == pool
    assert seen[:10] != seen[10:]
    saved, generator_state = stream.state(), stream.generator.get_state()
    ahead = stream.next(7)[0]  # crosses into the third epoch: a new order is drawn
    twin = PromptStream(task, 10, seed=3, generator=torch.Generator())
    twin.generator.set_state(generator_state)  # the trainer restores its generator with the stream
    twin.load(saved)
    assert torch.equal(twin.next(7)[0], ahead)
    # The same seed gives every arm the same pool; the endless stream is the task's own draw.
    assert torch.equal(PromptStream(task, 10, 3, torch.Generator()).prompts, stream.prompts)
    free = PromptStream(task, None, 3, torch.Generator().manual_seed(2))
    assert torch.equal(free.next(4)[0], task.prompts(4, torch.Generator().manual_seed(2))[0])
    with pytest.raises(ValueError, match="prompt_pool"):
        PromptStream(task, 0, 3, torch.Generator())
    with pytest.raises(ValueError, match="position"):
        stream.load({"order": torch.arange(3), "position": 4})


def test_make_rule_names_the_three_rules():
    def arm(rule):
        return ArmConfig("x", 3e-4, 4, 4, rule=rule, rule_per_prompt=2, rule_capacity=5)

    assert make_rule(arm(None)) is None
    assert type(make_rule(arm("group-swap"))).__name__ == "GroupSwap" and make_rule(arm("group-swap")).capacity == 5
    assert make_rule(arm("response-reuse")).per_prompt == 2
    assert make_rule(arm("prompt-replay")).strategy == "recent"
    with pytest.raises(ValueError, match="rule"):
        make_rule(arm("hindsight"))


def _quick_arithmetic():
    cfg = runner.default_config(quick=True, task="arithmetic")
    cfg.prompt_pool = 16  # prompts come back every few steps, so the rules find stored rollouts
    cfg.budget_tokens = 3_000
    return cfg


@pytest.mark.parametrize("arm", [
    ArmConfig("reuse", 3e-4, 4, 4, rule="response-reuse", rule_per_prompt=1, max_staleness=64, capacity=2048),
    ArmConfig("fresh+replay", 3e-4, 4, 4, rule="prompt-replay", rule_per_prompt=4, replay_ratio=0.5,
              sampler="freshness", max_staleness=64, capacity=2048),
    ArmConfig("swap", 3e-4, 4, 4, rule="group-swap", rule_capacity=8, max_staleness=64, capacity=2048),
], ids=lambda a: a.name)
def test_a_rule_arm_trains_on_its_replayed_rows_and_resumes_exactly(tmp_path, monkeypatch, arm):
    """A rule arm trains on more rollouts than it generates (the rule's rows join the fresh ones),
    and a run stopped after a checkpoint and resumed gives the uninterrupted run's curve: buffer,
    prompt index, prompt stream and the rule's own state all come back. Fails if the GroupSwap
    state or the prompt stream's position is left out of the trainer checkpoint."""
    cfg = _quick_arithmetic()
    init, _ = runner.warm_start(cfg, 0)
    ev = runner.eval_set(cfg, 0)
    straight = runner.train_arm(arm, cfg, init, 0, ev, checkpoint_uri=f"file://{tmp_path / 'a'}", checkpoint_every=5)
    assert straight["trained_rollouts"] > straight["steps"] * arm.prompts_per_step * arm.group_size * 0.6
    if arm.rule != "group-swap":  # group swap replaces groups one for one
        assert straight["uses_per_rollout"] > 1.0

    class Stop(Exception):
        pass

    saves = {"n": 0}
    real_save = state.TrainerCheckpoint.save

    def save_then_stop(self, saved):
        real_save(self, saved)
        saves["n"] += 1
        if saves["n"] == 3:
            raise Stop

    monkeypatch.setattr(state.TrainerCheckpoint, "save", save_then_stop)
    uri = f"file://{tmp_path / 'b'}"
    with pytest.raises(Stop):
        runner.train_arm(arm, cfg, init, 0, ev, checkpoint_uri=uri, checkpoint_every=5)
    monkeypatch.setattr(state.TrainerCheckpoint, "save", real_save)
    resumed = runner.train_arm(arm, cfg, init, 0, ev, checkpoint_uri=uri, checkpoint_every=5, resume=True)
    assert resumed["curve"] == straight["curve"]
    assert resumed["trained_rollouts"] == straight["trained_rollouts"]
    assert resumed["trained_tokens"] == straight["trained_tokens"]
