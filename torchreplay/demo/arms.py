"""The arms the demo and the replay study train, defined once: each arm's method and caps, and, per
task, the learning rate and batch shape the study's tuning chose and the arms `--full` runs.

The study (benchmarks/replay_study.py) tunes every arm in `study_arms()` on the same grid;
`TUNED` and `FULL` record what it found (docs/demo_findings.md). tests/test_demo_arms.py checks
them against the study's committed summary, so a rerun study that changes its mind fails until
they follow.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass
class ArmConfig:
    """One training arm. ``replay_ratio == 0`` and no ``rule`` means plain on-policy GRPO, no buffer.

    Attributes:
        name: label in the table, plot and JSON.
        lr: AdamW learning rate.
        prompts_per_step: fresh prompts generated per optimizer step.
        group_size: completions per prompt (the GRPO group).
        replay_ratio: fraction of each training batch drawn from the buffer (``buf.compose``).
        sampler: ``"prioritized"`` (|advantage|), ``"freshness"`` (|advantage| decayed by age,
            time constant ``tau`` versions) or ``"uniform"``.
        alpha, beta: prioritization exponent and IS-correction exponent of the prioritized sampler.
        beta_anneal: raise beta linearly to 1 over the generation budget (PER's schedule).
        weight_norm: the IS weights' normalization (``PrioritizedSampler(weight_norm=...)``).
        keep_zero_advantage: give zero-advantage rollouts priority eps instead of 0.
        tau: FreshnessSampler's time constant.
        max_staleness: policy versions a rollout may lag before eviction.
        max_reuse: times a rollout may be sampled before eviction.
        capacity: buffer slots, in rollouts.
        rule: a peer replay rule from `torchreplay.rules` (`peer_arms.RULES`): "group-swap" (TRL's
            GRPOWithReplayBuffer), "response-reuse" (AR3PO), "prompt-replay" (RePO), or None. With
            ``replay_ratio > 0`` as well, the sampler's draws join the rule's (a combination arm).
        rule_per_prompt: stored rollouts a prompt may take per step (response-reuse, prompt-replay).
        rule_strategy: prompt-replay's retrieval order ("recent", "reward" or "random").
        rule_capacity: groups group-swap keeps.
    """

    name: str
    lr: float
    prompts_per_step: int
    group_size: int
    replay_ratio: float = 0.0
    sampler: str = "prioritized"
    alpha: float = 0.6
    beta: float = 0.4
    beta_anneal: bool = False
    weight_norm: str = "batch_mean"
    keep_zero_advantage: bool = False
    tau: float = 4.0
    max_staleness: int | None = 4
    max_reuse: int | None = 4
    capacity: int = 4096
    rule: str | None = None
    rule_per_prompt: int = 4
    rule_strategy: str = "recent"
    rule_capacity: int = 64


# Training prompts: a fixed set of this many per seed, visited in epochs (DemoConfig.prompt_pool).
# The prompt-level rules (AR3PO, RePO) need prompts that come back; a dataset revisited in epochs
# is how RL post-training runs. The sort task then makes ~5 epochs of its budget, arithmetic ~10
# (its generator has only ~240 distinct 2-term questions, so its prompts recur in any case).
PROMPT_POOL = 1024

_SAMPLER_REPLAY = dict(replay_ratio=0.5, max_staleness=4, max_reuse=4)
_PRIOR = dict(sampler="prioritized", alpha=0.6, beta=0.4, weight_norm="batch_mean", keep_zero_advantage=False)
# The peer rules look a prompt up again when it comes back: on the sort task one epoch later on
# average (128 steps at 8 prompts a step, 256 at 4; a return takes 0 to 2 epochs). The staleness
# cap spans the average return at both shapes, all returns at 8 x 8, and the buffer holds that
# many steps of 64 rollouts. Arithmetic prompts come back within ~30 steps.
_RULE = dict(max_staleness=256, max_reuse=4, capacity=16384)
# Our sampler joined to a rule shares its buffer and caps; FreshnessSampler's age decay (tau 4
# versions) keeps the sampler's own draws fresh under the rule's wide staleness cap.
_FRESH_SAMPLER = dict(replay_ratio=0.5, **{**_PRIOR, "sampler": "freshness", "tau": 4.0})

LIBRARY_ARMS = ("uniform-replay", "prior", "freshness")
PEER_ARMS = ("group-swap", "response-reuse", "prompt-replay")


def _arm(name: str, **kw: Any) -> ArmConfig:
    return ArmConfig(name=name, lr=3e-4, prompts_per_step=8, group_size=8, **kw)


_ARMS = {a.name: a for a in (
    _arm("on-policy"),
    _arm("uniform-replay", sampler="uniform", **_SAMPLER_REPLAY),
    _arm("prior", **_SAMPLER_REPLAY, **_PRIOR),
    _arm("freshness", **{**_SAMPLER_REPLAY, **_PRIOR, "sampler": "freshness", "tau": 4.0}),
    # TRL's GRPOWithReplayBuffer keeps 64 groups by default (replay_buffer_size).
    _arm("group-swap", rule="group-swap", rule_capacity=64, **_RULE),
    # AR3PO reuses a correct earlier response for a group with none.
    _arm("response-reuse", rule="response-reuse", rule_per_prompt=1, **_RULE),
    # RePO's headline setting: as many off-policy samples per prompt as on-policy ones (8 and 8).
    _arm("prompt-replay", rule="prompt-replay", rule_per_prompt=8, rule_strategy="recent", **_RULE),
    _arm("freshness+response-reuse", rule="response-reuse", rule_per_prompt=1, **_RULE, **_FRESH_SAMPLER),
    _arm("freshness+prompt-replay", rule="prompt-replay", rule_per_prompt=8, **_RULE, **_FRESH_SAMPLER),
)}


def study_arms() -> list[ArmConfig]:
    """Every arm of the replay study at placeholder lr and batch shape (its tuning grid sets them):
    on-policy, this library's samplers, the three peer rules (torchreplay.rules) and our sampler
    joined to the two prompt-level rules. The prioritized sampler's own factors (alpha, beta, weight
    norm, caps) were studied one at a time in git history (f889b5d, 51286b6); `prior` is their winner."""
    return [copy.deepcopy(a) for a in _ARMS.values()]


# (lr, prompts per step, group size) each arm's tuning chose, per task (the study's summary.json).
# Every arm was best at lr 3e-4 with 8 prompts x 8 rollouts on both tasks (an arm's entry here
# overrides that).
TUNED: dict[str, dict[str, tuple[float, int, int]]] = {"sort": {}, "arithmetic": {}}
# What `torchreplay demo --full` runs per task: on-policy and the study's finalists that won.
# The best arm joined FreshnessSampler to a prompt-level rule on both tasks: AR3PO's response reuse
# on sort, RePO's prompt replay on arithmetic. This library's best sampler arm alone, over the final
# phase's 5 seeds, was PrioritizedSampler on both (tied with FreshnessSampler on sort). The peer
# rules on their own lost to it on tokens and stay in the study.
FULL: dict[str, tuple[str, ...]] = {"sort": ("on-policy", "freshness+response-reuse", "prior"),
                                    "arithmetic": ("on-policy", "freshness+prompt-replay", "prior")}
# `torchreplay demo` (one task, one seed): on-policy against the library's default sampler.
DEFAULT_REPLAY = "prior"
DEFAULT = ("on-policy", DEFAULT_REPLAY)


def arm(name: str, task: str) -> ArmConfig:
    """Arm `name` at the setting the study tuned for `task` (lr 3e-4, 8 x 8 where it has none)."""
    if name not in _ARMS:
        raise ValueError(f"arm must be one of {sorted(_ARMS)}, got {name!r}")
    lr, prompts, group = TUNED.get(task, {}).get(name, (3e-4, 8, 8))
    return dataclasses.replace(copy.deepcopy(_ARMS[name]), lr=lr, prompts_per_step=prompts, group_size=group)
