"""GRPO pieces: group-normalized advantages and the clipped, importance-weighted policy loss."""

from __future__ import annotations

import torch

from torchreplay.demo.policy import TinyCausalLM, token_logprobs


def group_advantages(reward: torch.Tensor, group_id: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """``(r - mean_group) / (std_group + eps)`` for each rollout; 0 where a group's rewards are all equal.

    Args:
        reward: ``[n]`` float rewards.
        group_id: ``[n]`` int64; rollouts answering the same prompt share an id.
        eps: added to the std so single-valued groups give 0, not NaN (reward units).
    """
    _, inverse = torch.unique(group_id, return_inverse=True)
    k = int(inverse.max()) + 1
    count = torch.zeros(k).index_add_(0, inverse, torch.ones_like(reward))
    mean = torch.zeros(k).index_add_(0, inverse, reward) / count
    centered = reward - mean[inverse]
    var = torch.zeros(k).index_add_(0, inverse, centered**2) / count.clamp(min=2).sub(1)
    return centered / (var.sqrt()[inverse] + eps)


def grpo_loss(
    model: TinyCausalLM,
    tokens: torch.Tensor,
    response_mask: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantage: torch.Tensor,
    weights: torch.Tensor,
    clip_eps: float = 0.2,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped-ratio policy loss over a padded batch.

    The ratio is taken against the stored behaviour log-probs, so a replayed rollout is corrected for
    the policy having moved since it was generated; the clip bounds how far one stale sample can push.
    Each rollout's per-token loss is scaled by its sampling IS weight (from the buffer; 1 on-policy),
    then averaged over every response token in the batch (token-level mean).

    Args:
        tokens, response_mask, behaviour_logprobs: ``[B, T]``, right padded.
        advantage, weights: ``[B]``.
        clip_eps: PPO clip range on the probability ratio.

    Returns:
        ``(loss, stats)`` with stats ``clip_frac`` (fraction of response tokens clipped), ``entropy``
        (mean policy entropy over response tokens, nats) and ``ratio_mean``.
    """
    logp, ent = token_logprobs(model, tokens)
    mask = response_mask.float()
    log_ratio = (logp - behaviour_logprobs) * mask
    ratio = log_ratio.exp()
    adv = advantage[:, None]
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * adv
    per_token = -torch.minimum(unclipped, clipped) * weights[:, None]
    n_tok = mask.sum().clamp(min=1.0)
    loss = (per_token * mask).sum() / n_tok
    with torch.no_grad():
        stats = {
            "clip_frac": float((((ratio - 1.0).abs() > clip_eps).float() * mask).sum() / n_tok),
            "entropy": float((ent * mask).sum() / n_tok),
            "ratio_mean": float((ratio * mask).sum() / n_tok),
        }
    return loss, stats
