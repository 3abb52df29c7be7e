"""Prompt identity and the peer replay rules (TRL's group swap, AR3PO's response reuse, RePO's
prompt replay) as components over a RolloutBuffer: docs/api.md, "Replay rules"."""

from torchreplay.rules.peers import (
    FreshGroups,
    GroupRule,
    GroupSwap,
    PromptReplay,
    ResponseReuse,
    RulePlan,
    RuleStep,
    apply_rule,
    group_advantages,
    replayable,
)
from torchreplay.rules.prompts import (
    PROMPT_KEY,
    PromptIndex,
    hash_prompts,
    prompt_key_field,
    with_prompt_keys,
    zero_variance_prompts,
)

__all__ = ["FreshGroups", "GroupRule", "GroupSwap", "PromptReplay", "ResponseReuse", "RulePlan", "RuleStep",
           "apply_rule", "group_advantages", "replayable", "PROMPT_KEY", "PromptIndex", "hash_prompts",
           "prompt_key_field", "with_prompt_keys", "zero_variance_prompts"]
