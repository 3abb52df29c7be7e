"""The demo's pieces for the peer replay rules (torchreplay.rules) and for a finite training set.

A prompt-level rule (RePO's prompt replay, AR3PO's response reuse) can only help when prompts come
back, as they do when RL post-training makes epochs over a dataset. `PromptStream` gives the demo
both protocols: an endless i.i.d. stream (``pool=None``) or a fixed set of ``pool`` prompts drawn
once per seed and visited in a fresh random order each epoch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from torchreplay import rules

RULES = ("group-swap", "response-reuse", "prompt-replay")


class PromptStream:
    """Training prompts for one arm: `task.prompts` drawn fresh each step, or a fixed pool."""

    def __init__(self, task: Any, pool: int | None, seed: int, generator: torch.Generator) -> None:
        self.task, self.generator = task, generator
        self.prompts = self.problems = None
        self.order = torch.empty(0, dtype=torch.int64)
        self.position = 0
        if pool is not None:
            if pool < 1:
                raise ValueError(f"prompt_pool must be >= 1 or None, got {pool}")
            # Its own generator: every arm of a seed trains on the same set, whatever it draws later.
            self.prompts, self.problems = task.prompts(pool, torch.Generator().manual_seed(seed * 1000 + 4))

    def next(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`n` prompts and their problems (digits or dataset indices)."""
        if self.prompts is None:
            return self.task.prompts(n, self.generator)
        picks = []
        while len(picks) < n:
            if self.position == self.order.numel():
                self.order, self.position = torch.randperm(self.prompts.shape[0], generator=self.generator), 0
            take = min(n - len(picks), self.order.numel() - self.position)
            picks += self.order[self.position:self.position + take].tolist()
            self.position += take
        index = torch.tensor(picks, dtype=torch.int64)
        return self.prompts[index], self.problems[index]

    def state(self) -> dict[str, Any]:
        return {"order": self.order.clone(), "position": self.position}

    def load(self, state: dict[str, Any]) -> None:
        order, position = torch.as_tensor(state["order"], dtype=torch.int64), int(state["position"])
        if not 0 <= position <= order.numel():
            raise ValueError(f"prompt stream position {position} outside its order of {order.numel()}")
        self.order, self.position = order, position


def make_rule(arm: Any) -> Any:
    """The `torchreplay.rules` rule an arm names (None for a plain sampler arm)."""
    if arm.rule is None:
        return None
    if arm.rule == "group-swap":
        return rules.GroupSwap(capacity=arm.rule_capacity)
    if arm.rule == "response-reuse":
        return rules.ResponseReuse(correct_reward=1.0, per_prompt=arm.rule_per_prompt)
    if arm.rule == "prompt-replay":
        return rules.PromptReplay(per_prompt=arm.rule_per_prompt, strategy=arm.rule_strategy)
    raise ValueError(f"arm {arm.name}: rule must be one of {RULES} or None, got {arm.rule!r}")


@dataclass
class TrainRows:
    """What one optimizer step trains on, padded to a common width."""

    tokens: torch.Tensor
    response_mask: torch.Tensor
    logprobs: torch.Tensor
    advantage: torch.Tensor
    weights: torch.Tensor
    trained_tokens: int


def _pad_cat(parts: list[torch.Tensor]) -> torch.Tensor:
    width = max(p.shape[1] for p in parts)
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])


def rule_rows(step: rules.RuleStep, n_fresh: int) -> TrainRows:
    """The rows a rule step trains on: the fresh rows the plan keeps (with its advantages), the
    sampler's draws composed after them (stored advantages, IS weights) and the rule's retrieved
    rows (with the plan's advantages and weights)."""
    batch, plan = step.fresh, step.plan
    keep = torch.cat([plan.fresh_train, torch.ones(len(batch) - n_fresh, dtype=torch.bool)])
    parts = [(batch.tokens[keep], batch.response_mask[keep], batch.logprobs[keep], batch.advantage[keep],
              batch.weights[keep].float(), batch.attention_mask[keep])]
    if step.replayed is not None:
        r = step.replayed
        parts.append((r.tokens, r.response_mask, r.logprobs, plan.replay_advantage, plan.replay_weights,
                      r.attention_mask))
    tokens, mask, logprobs, advantage, weights, attention = zip(*parts)
    return TrainRows(_pad_cat(list(tokens)), _pad_cat(list(mask)), _pad_cat(list(logprobs)),
                     torch.cat(advantage).float(), torch.cat(weights), int(sum(int(a.sum()) for a in attention)))
