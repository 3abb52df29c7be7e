"""Synthetic rollout batches for the tests."""

from __future__ import annotations

import torch


def make_batch(n: int, version: int | torch.Tensor = 0, seed: int = 0, group_base: int = 0,
               advantage: torch.Tensor | None = None, min_len: int = 3, max_len: int = 12) -> dict:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g)
    prompt_len = torch.minimum(torch.full((n,), 2), lengths)
    return {
        "tokens": [torch.randint(1, 100, (int(length),), generator=g) for length in lengths],
        "prompt_len": prompt_len,
        "response_mask": [torch.arange(int(length)) >= int(p) for length, p in zip(lengths, prompt_len)],
        "logprobs": [-torch.rand(int(length), generator=g) for length in lengths],
        "reward": torch.rand(n, generator=g),
        "advantage": torch.randn(n, generator=g) if advantage is None else advantage,
        "group_id": group_base + torch.arange(n) // 4,
        "policy_version": version,
    }
