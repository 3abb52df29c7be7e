"""The published replay rules of the literature as pluggable components over a RolloutBuffer.

Each rule is a `GroupRule`: given the fresh batch grouped by prompt (`FreshGroups`) it returns a
`RulePlan` (which fresh rows train, which stored rollouts join them, the advantages to train with
and the replayed rows' IS weights) and then hears the fresh rows' handles (`observe`). `apply_rule`
runs one step: plan, read the replayed rows (their use counted), compose the fresh rows (stored with
the plan's advantages, their use counted). Every rule draws only rollouts that are live at the
fresh batch's version, within `max_staleness` of it and with reuse budget left (`replayable`), each
at most once a step: the buffer's caps hold even where the original rule had none.

IS weights: none of the three rules reweights (the originals do not), so `replay_weights` are 1.
What corrects for the replayed rows' older behaviour policy is the clipped per-token ratio
`pi_theta / pi_behaviour` against their stored `logprobs`, as for any replayed row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Protocol

import torch

from torchreplay.assembly import Handles
from torchreplay.buffer import RolloutBuffer
from torchreplay.checks import check_int
from torchreplay.ledger import replay_count
from torchreplay.packed import Batch
from torchreplay.rules.prompts import PromptIndex, with_prompt_keys

_EMPTY = torch.empty(0, dtype=torch.int64)


def _check_real(value: Any, name: str, positive: bool = False) -> float:
    """`value` as a float when it is a finite real number (not a bool), > 0 with `positive`;
    otherwise TypeError or ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a finite number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value) or (positive and value <= 0):
        raise ValueError(f"{name} must be a finite number{' > 0' if positive else ''}, got {value!r}")
    return float(value)


def group_advantages(reward: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO's advantages of one group: (r - mean) / (std + eps), std with Bessel's correction; a
    group of one row gets 0."""
    reward = reward.double()
    if reward.numel() < 2:
        return torch.zeros(reward.shape, dtype=torch.float32)
    return ((reward - reward.mean()) / (reward.std() + eps)).to(torch.float32)


@dataclass(frozen=True)
class FreshGroups:
    """The fresh batch as the rules see it: per row its prompt key, GRPO group, reward, advantage,
    and the version the buffer will be at once the batch is stored.

    A rule works on GRPO groups (`groups()`: the rows sharing a `group_id`), and looks up stored
    rollouts by prompt key: one batch may hold two groups of the same prompt (a dataset with
    repeated questions), and each keeps its own statistics."""

    prompt_key: torch.Tensor  # int64 [n]
    group_id: torch.Tensor  # int64 [n]
    reward: torch.Tensor  # float32 [n]
    advantage: torch.Tensor  # float32 [n]
    version: int

    @classmethod
    def of(cls, buffer: RolloutBuffer, fresh: Mapping[str, Any]) -> "FreshGroups":
        reward = fresh.get("reward")
        if reward is None:
            raise ValueError("field 'reward': the replay rules need the fresh rows' rewards")
        reward = torch.as_tensor(reward, dtype=torch.float32).reshape(-1)
        if bool(torch.isnan(reward).any()):
            raise ValueError("field 'reward': the replay rules need every fresh reward (no NaN)")
        if fresh.get("group_id") is None:
            raise ValueError("field 'group_id': the replay rules need the fresh rows' GRPO groups")
        version = torch.as_tensor(fresh["policy_version"]).reshape(-1)
        return cls(torch.as_tensor(fresh["prompt_key"], dtype=torch.int64).reshape(-1),
                   torch.as_tensor(fresh["group_id"], dtype=torch.int64).reshape(-1), reward,
                   torch.as_tensor(fresh["advantage"], dtype=torch.float32).reshape(-1),
                   max(buffer.version, int(version.max())))

    def groups(self) -> list[tuple[int, torch.Tensor]]:
        """(prompt key, row indices) of each GRPO group, in order of first appearance; rows of one
        `group_id` with different prompt keys are separate groups."""
        order: dict[tuple[int, int], list[int]] = {}
        for row, pair in enumerate(zip(self.group_id.tolist(), self.prompt_key.tolist())):
            order.setdefault(pair, []).append(row)
        return [(key, torch.tensor(rows, dtype=torch.int64)) for (_, key), rows in order.items()]


@dataclass(frozen=True)
class RulePlan:
    """What one step trains on: fresh rows where `fresh_train` is True with `fresh_advantage`, and
    the stored rollouts `replay` with `replay_advantage` and IS weights `replay_weights`."""

    fresh_advantage: torch.Tensor  # float32 [n]
    fresh_train: torch.Tensor  # bool [n]
    replay: Handles  # [k]
    replay_advantage: torch.Tensor  # float32 [k]
    replay_weights: torch.Tensor  # float32 [k]

    @classmethod
    def build(cls, groups: FreshGroups, fresh_advantage: torch.Tensor | None = None,
              fresh_train: torch.Tensor | None = None, replay: list[tuple[torch.Tensor, torch.Tensor]] = (),
              replay_advantage: list[torch.Tensor] = ()) -> "RulePlan":
        n = groups.prompt_key.numel()
        slot = torch.cat([s for s, _ in replay]) if replay else _EMPTY
        generation = torch.cat([g for _, g in replay]) if replay else _EMPTY
        advantage = torch.cat(list(replay_advantage)) if replay_advantage else torch.empty(0)
        return cls(groups.advantage.clone() if fresh_advantage is None else fresh_advantage,
                   torch.ones(n, dtype=torch.bool) if fresh_train is None else fresh_train,
                   Handles(slot, generation), advantage.to(torch.float32),
                   torch.ones(slot.numel(), dtype=torch.float32))


class GroupRule(Protocol):
    """A replay rule over prompt groups. `plan` must not change the buffer; `observe` hears the
    fresh rows' handles once they are stored (rules that keep state of their own update it there)."""

    def plan(self, buffer: RolloutBuffer, index: PromptIndex, groups: FreshGroups,
             generator: torch.Generator | None) -> RulePlan: ...

    def observe(self, buffer: RolloutBuffer, groups: FreshGroups, handles: Handles, plan: RulePlan) -> None: ...


def replayable(buffer: RolloutBuffer, handles: Handles, version: int) -> torch.Tensor:
    """bool [k]: which handles may be replayed at `version`: live, within `max_staleness` of it, with
    reuse budget left."""
    table, ledger = buffer.ledger.slots, buffer.ledger
    slot = handles.slot
    ok = table.live[slot] & (table.generation[slot] == handles.generation)
    if ledger.max_staleness is not None:
        ok &= (version - table.policy_version[slot]) <= ledger.max_staleness
    if ledger.max_reuse is not None:
        ok &= table.reuse[slot] < ledger.max_reuse
    return ok


def _newest_first(buffer: RolloutBuffer, handles: Handles) -> Handles:
    order = torch.argsort(buffer.ledger.slots.seq[handles.slot], descending=True, stable=True)
    return Handles(handles.slot[order], handles.generation[order])


class _PromptRetrieval:
    """Shared by ResponseReuse and PromptReplay: stored rollouts of a prompt, filtered by the caps
    (and by `taken`, the slots this step already uses), in the rule's order."""

    def candidates(self, buffer: RolloutBuffer, index: PromptIndex, key: int, version: int,
                   taken: set[int]) -> Handles:
        handles = index.live(key)
        ok = replayable(buffer, handles, version)
        ok &= torch.tensor([s not in taken for s in handles.slot.tolist()], dtype=torch.bool)
        return _newest_first(buffer, Handles(handles.slot[ok], handles.generation[ok]))

    def observe(self, buffer: RolloutBuffer, groups: FreshGroups, handles: Handles, plan: RulePlan) -> None:
        return None


class ResponseReuse(_PromptRetrieval):
    """AR3PO's response reuse (arXiv 2509.25808): a prompt whose fresh group has no correct response
    (every reward below `correct_reward`) gets up to `per_prompt` earlier correct responses to the
    same prompt from the buffer, newest first.

    Advantages: such a group's advantages are recomputed over the fresh rows and the reused ones
    together (`group_advantages` of the pooled rewards), for both; every other group keeps the
    caller's advantages and nothing is reused for it. IS weights: 1 (see the module docstring)."""

    def __init__(self, correct_reward: float = 1.0, per_prompt: int = 1, eps: float = 1e-6) -> None:
        self.correct_reward = _check_real(correct_reward, "correct_reward")
        self.per_prompt = check_int(per_prompt, "per_prompt", low=1)
        self.eps = _check_real(eps, "eps", positive=True)

    def plan(self, buffer: RolloutBuffer, index: PromptIndex, groups: FreshGroups,
             generator: torch.Generator | None = None) -> RulePlan:
        advantage, replay, replay_advantage, taken = groups.advantage.clone(), [], [], set()
        rewards = buffer.ledger.slots.reward
        for key, rows in groups.groups():
            if bool((groups.reward[rows] >= self.correct_reward).any()):
                continue
            found = self.candidates(buffer, index, key, groups.version, taken)
            correct = rewards[found.slot] >= self.correct_reward
            slot, generation = found.slot[correct][:self.per_prompt], found.generation[correct][:self.per_prompt]
            if slot.numel() == 0:
                continue
            taken.update(slot.tolist())
            pooled = group_advantages(torch.cat([groups.reward[rows], rewards[slot]]), self.eps)
            advantage[rows] = pooled[:rows.numel()]
            replay.append((slot, generation))
            replay_advantage.append(pooled[rows.numel():])
        return RulePlan.build(groups, advantage, None, replay, replay_advantage)


class PromptReplay(_PromptRetrieval):
    """RePO's replay-enhanced policy optimization (arXiv 2506.09340): for every prompt of the fresh
    batch, up to `per_prompt` stored rollouts of the same prompt are retrieved (`strategy`:
    "recent", newest first; "reward", highest reward first; "random", uniformly) and trained on
    next to the fresh group.

    Advantages: with `advantage="separate"` (RePO's objective: an on-policy term plus an off-policy
    term, each with its own group-normalized advantages, the paper's Figure 1 and Eq. for
    J_RePO) the fresh rows keep the caller's advantages and the retrieved rows of a prompt get
    `group_advantages` over their own rewards; with `"pooled"` the fresh and retrieved rewards of a
    prompt are normalized together, for both. A prompt with nothing retrievable keeps the caller's
    advantages. IS weights: 1 (see the module docstring)."""

    STRATEGIES = ("recent", "reward", "random")
    ADVANTAGES = ("separate", "pooled")

    def __init__(self, per_prompt: int = 4, strategy: str = "recent", advantage: str = "separate",
                 eps: float = 1e-6) -> None:
        check_int(per_prompt, "per_prompt", low=1)
        _check_real(eps, "eps", positive=True)
        if strategy not in self.STRATEGIES:
            raise ValueError(f"strategy must be one of {self.STRATEGIES}, got {strategy!r}")
        if advantage not in self.ADVANTAGES:
            raise ValueError(f"advantage must be one of {self.ADVANTAGES}, got {advantage!r}")
        self.per_prompt, self.strategy, self.advantage, self.eps = int(per_prompt), strategy, advantage, float(eps)

    def plan(self, buffer: RolloutBuffer, index: PromptIndex, groups: FreshGroups,
             generator: torch.Generator | None = None) -> RulePlan:
        advantage, replay, replay_advantage, taken = groups.advantage.clone(), [], [], set()
        rewards = buffer.ledger.slots.reward
        for key, rows in groups.groups():
            found = self.candidates(buffer, index, key, groups.version, taken)
            if self.strategy == "reward":
                order = torch.argsort(rewards[found.slot], descending=True, stable=True)
            elif self.strategy == "random":
                order = torch.randperm(found.slot.numel(), generator=generator)
            else:
                order = torch.arange(found.slot.numel())
            order = order[:self.per_prompt]
            slot, generation = found.slot[order], found.generation[order]
            if slot.numel() == 0:
                continue
            taken.update(slot.tolist())
            replay.append((slot, generation))
            if self.advantage == "separate":
                replay_advantage.append(group_advantages(rewards[slot], self.eps))
                continue
            pooled = group_advantages(torch.cat([groups.reward[rows], rewards[slot]]), self.eps)
            advantage[rows] = pooled[:rows.numel()]
            replay_advantage.append(pooled[rows.numel():])
        return RulePlan.build(groups, advantage, None, replay, replay_advantage)


class GroupSwap:
    """TRL's GRPOWithReplayBuffer rule: a group-level buffer keeps the `capacity` groups with the
    highest score sum(|A|) * std(reward) (std with Bessel's correction) among the fresh groups with
    non-zero reward variance; each zero-variance group of a fresh batch is replaced by a kept
    group drawn in proportion to its score, without replacement within a step.

    A kept group is drawable only while all of its rollouts are `replayable` (live, within
    `max_staleness`, reuse budget left); one that can no longer be is dropped. A swapped-out fresh
    group is still stored but not trained (`fresh_train` False); when nothing is drawable it trains
    as it is. Advantages: the swapped-in rollouts keep their stored advantages (TRL replays the group
    with the advantages it was scored with); fresh advantages are the caller's. IS weights: 1."""

    def __init__(self, capacity: int = 64) -> None:
        self.capacity = check_int(capacity, "capacity", low=1)
        self.groups: list[tuple[float, Handles]] = []  # (score, the group's rollouts)

    def plan(self, buffer: RolloutBuffer, index: PromptIndex, groups: FreshGroups,
             generator: torch.Generator | None = None) -> RulePlan:
        capacity = buffer.ledger.capacity  # a loaded state may name slots of a smaller buffer
        self.groups = [(s, h) for s, h in self.groups
                       if int(h.slot.max()) < capacity and bool(replayable(buffer, h, groups.version).all())]
        train, replay, replay_advantage = torch.ones(groups.prompt_key.numel(), dtype=torch.bool), [], []
        scores = torch.tensor([s for s, _ in self.groups], dtype=torch.float64)
        # Zero-variance groups are served in prompt-key order (the draw order only matters when kept
        # groups run short; a fixed order keeps a run reproducible across batch layouts).
        for _, rows in sorted(groups.groups(), key=lambda group: group[0]):
            reward = groups.reward[rows]
            if not bool((reward == reward[0]).all()):
                continue
            if not bool((scores > 0).any()):
                break
            pick = int(torch.multinomial(scores, 1, generator=generator))
            scores[pick] = 0  # without replacement: no rollout is read twice in one step
            handles = self.groups[pick][1]
            train[rows] = False
            replay.append((handles.slot, handles.generation))
            replay_advantage.append(buffer.ledger.slots.advantage[handles.slot].clone())
        return RulePlan.build(groups, None, train, replay, replay_advantage)

    def observe(self, buffer: RolloutBuffer, groups: FreshGroups, handles: Handles, plan: RulePlan) -> None:
        for _, rows in groups.groups():
            if rows.numel() < 2 or not bool(plan.fresh_train[rows].all()):
                continue
            score = float(plan.fresh_advantage[rows].abs().sum()) * float(groups.reward[rows].double().std())
            if score > 0:
                self.groups.append((score, Handles(handles.slot[rows], handles.generation[rows])))
        self.groups.sort(key=lambda entry: -entry[0])
        del self.groups[self.capacity:]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The kept groups as tensors (for a trainer checkpoint next to the buffer's): scores,
        group sizes, and the rollouts' slots and generations, concatenated."""
        return {"score": torch.tensor([s for s, _ in self.groups], dtype=torch.float64),
                "size": torch.tensor([len(h) for _, h in self.groups], dtype=torch.int64),
                "slot": torch.cat([h.slot for _, h in self.groups]) if self.groups else _EMPTY.clone(),
                "generation": torch.cat([h.generation for _, h in self.groups]) if self.groups else _EMPTY.clone()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Adopt `state_dict()`'s output, checked first (a bad one is a ValueError and changes nothing).
        Kept groups are handles into the buffer restored with them: one whose rollouts died since is
        dropped at the next `plan`."""
        parts = {}
        for name in ("score", "size", "slot", "generation"):
            if name not in state:
                raise ValueError(f"GroupSwap state: no '{name}'")
            value = state[name]
            if not isinstance(value, torch.Tensor) or value.dim() != 1:
                raise TypeError(f"GroupSwap state: '{name}' must be a 1-D tensor, got {type(value).__name__}")
            floating = name == "score"
            if value.dtype == torch.bool or value.is_floating_point() != floating or value.is_complex():
                raise TypeError(f"GroupSwap state: '{name}' must be a {'float' if floating else 'integer'} tensor, "
                                f"got {value.dtype}")
            parts[name] = value
        score, size, slot, generation = parts["score"], parts["size"], parts["slot"], parts["generation"]
        if score.numel() != size.numel() or score.numel() > self.capacity:
            raise ValueError(f"GroupSwap state: {score.numel()} scores, {size.numel()} sizes, capacity {self.capacity}")
        if bool((size < 1).any()) or int(size.sum()) != slot.numel() or slot.numel() != generation.numel():
            raise ValueError("GroupSwap state: group sizes do not match the slots and generations")
        if not bool(torch.isfinite(score).all()) or bool((score <= 0).any()):
            raise ValueError("GroupSwap state: scores must be finite and > 0")
        if bool((slot < 0).any()) or bool((generation < 0).any()):
            raise ValueError("GroupSwap state: 'slot' and 'generation' must be >= 0")
        parts = zip(slot.to(torch.int64).split(size.tolist()), generation.to(torch.int64).split(size.tolist()))
        self.groups = [(float(sc), Handles(sl, gen)) for sc, (sl, gen) in zip(score.tolist(), parts)]


@dataclass(frozen=True)
class RuleStep:
    """One step of `apply_rule`: the plan, the fresh rows as stored (all of them, advantages from
    the plan) and the replayed rows (None when the plan replays nothing), in the plan's order."""

    plan: RulePlan
    fresh: Batch
    replayed: Batch | None


def apply_rule(buffer: RolloutBuffer, index: PromptIndex, rule: GroupRule, fresh: Mapping[str, Any],
               generator: torch.Generator | None = None, layout: str = "padded",
               replay_ratio: float | None = None) -> RuleStep:
    """Plan with `rule`, read the planned rollouts (their use counted, before the fresh rows can
    evict them), then `compose` the fresh rows (prompt keys filled in, advantages from the plan)
    with the buffer's own sampler drawing `replay_ratio` of the composed batch (none by default),
    note them in `index` and tell the rule. Train on `fresh`'s first rows (the fresh ones) where
    `plan.fresh_train`, with `plan.fresh_advantage`, on the rest of `fresh` (the sampler's draws,
    with their stored advantages and IS weights), and on `replayed` with `plan.replay_advantage`
    and `plan.replay_weights`. The sampler's draw and the rule's are independent: a rollout both
    pick trains twice that step and counts twice towards `max_reuse`. Not all-or-nothing across its
    two calls: a `fresh` that `compose` refuses leaves the planned rows' uses counted (each call by
    itself changes nothing when it fails; a bad `replay_ratio` is refused before either).
    A rule's own state (GroupSwap's kept groups) is not part of the buffer's checkpoints: save its
    `state_dict()` with the trainer's."""
    fresh = with_prompt_keys(fresh)
    groups = FreshGroups.of(buffer, fresh)
    if replay_ratio is not None:  # refused before the rule's reads count any use
        replay_count(groups.prompt_key.numel(), replay_ratio, None, None)
    plan = rule.plan(buffer, index, groups, generator)
    replayed = buffer.gather(plan.replay.slot, layout=layout) if len(plan.replay) else None
    amount = {"n_replay": 0} if replay_ratio is None else {"replay_ratio": replay_ratio}
    batch = buffer.compose(dict(fresh, advantage=plan.fresh_advantage), generator=generator, layout=layout, **amount)
    n = groups.prompt_key.numel()
    stored = Handles(batch.handles.slot[:n], batch.handles.generation[:n])  # the fresh rows come first
    index.note(stored, groups.prompt_key)
    rule.observe(buffer, groups, stored, plan)
    return RuleStep(plan, batch, replayed)
