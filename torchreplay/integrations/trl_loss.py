"""Per-row IS weights on TRL 1.16's KL term and entropy bonus.

`ReplayGRPOTrainer` folds a replayed row's IS weight w into its advantage. That weights the policy
term exactly (it is A times a factor that depends on A only through its sign), but TRL adds the KL
term per token and subtracts the entropy bonus after aggregating, with no advantage in either. So
the trainer lets TRL compute its loss as usual, keeps the forward's log-probs and entropies, and
adds what is missing for the rows whose weight is not 1:

    beta * Agg((w - 1) * kl)  -  coef * sum((w - 1) * H * mask) / sum(mask) / accumulation

where `Agg` is the loss type's own aggregation (linear in the per-token loss, normalizers unchanged).
The sum is then TRL's loss with each row's whole contribution (policy, KL, entropy) times w. The
formulas below mirror TRL 1.16's `GRPOTrainer._compute_loss`; tests/test_trl_integration.py checks
them against TRL's own loss at w = 1 and against a loss written out by hand for every loss type.
TRL's private attribute read here: `_last_world_entropy`, the adaptive entropy gate's input, which
TRL exposes no other way.
"""

from __future__ import annotations

from typing import Any

import torch


def entropy_coefficient(trainer: Any) -> float:
    """The entropy coefficient TRL applies to this micro-batch; read before its loss runs, because
    the adaptive controller updates the coefficient inside the loss for the next step."""
    if not (trainer.entropy_coef != 0.0 or trainer.args.use_adaptive_entropy):
        return 0.0
    if trainer.args.use_adaptive_entropy and trainer._last_world_entropy > trainer.args.entropy_target:
        return 0.0
    return float(trainer.entropy_coef)


def _aggregate(trainer: Any, per_token: torch.Tensor, mask: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor:
    """The loss type's reduction of a per-token loss, as TRL's training branch applies it."""
    loss_type = trainer.loss_type
    accumulation = trainer.current_gradient_accumulation_steps
    masked = per_token * mask
    if loss_type in ("grpo", "sapo"):
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0) / accumulation
    if loss_type == "dr_grpo":
        return masked.sum() / (per_token.size(0) * trainer.max_completion_length) / accumulation
    if loss_type == "luspo":
        return masked.sum(-1).mean() / accumulation
    if loss_type in ("cispo", "dapo", "vespo"):
        # num_items_in_batch spans the generation batch: rescaled to one accumulation window, as TRL does.
        normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
        return masked.sum() / (normalizer * accumulation / trainer.args.steps_per_generation)
    raise ValueError(f"loss_type: no replay weighting known for {loss_type!r}")


def _kl(trainer: Any, inputs: dict[str, Any], logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """TRL's per-token KL estimator, with its importance-sampling correction when enabled."""
    ref = inputs["ref_per_token_logps"]
    kl = torch.exp(ref - logps) - (ref - logps) - 1
    if trainer.args.use_bias_correction_kl:
        log_ratio = logps - inputs["old_per_token_logps"]
        if trainer.importance_sampling_level == "sequence":
            log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        kl = kl * torch.exp(log_ratio)
    return kl


def weight_correction(trainer: Any, inputs: dict[str, Any], logps: torch.Tensor, entropies: torch.Tensor,
                      entropy_coef: float) -> torch.Tensor:
    """What to add to TRL's loss so that each row's KL and entropy contributions are times its
    `replay_weights` entry (the policy term already is, through the advantage)."""
    excess = (inputs["replay_weights"].to(logps.dtype) - 1).unsqueeze(-1)  # [B, 1]; 0 for fresh rows
    mask = inputs["completion_mask"].to(logps.dtype)
    correction = logps.new_zeros(())
    if trainer.beta != 0.0:
        correction = correction + trainer.beta * _aggregate(trainer, excess * _kl(trainer, inputs, logps, mask),
                                                            mask, inputs)
    if entropy_coef != 0.0:
        effective = mask
        if trainer.top_entropy_quantile < 1.0:  # the bonus acts on the tokens the policy term keeps
            effective = mask * trainer.get_high_entropy_mask(entropies, mask, 1 - trainer.top_entropy_quantile)
        bonus = (excess * entropies * effective).sum() / effective.sum().clamp(min=1.0)
        correction = correction - entropy_coef * bonus / trainer.current_gradient_accumulation_steps
    return correction
