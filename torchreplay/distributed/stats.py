"""What the ranks tell each other about their rank buffers (the `RolloutBuffer` each rank holds).

Every `sample` (and `rank_stats`, and a global `update_priorities`'s argument check) starts with
one all_reduce of a [world, 8] float64 table: every rank fills its own row, `rank_row`, with its
buffer's count, total and smallest positive priority, its sampler's beta, the batch size, whether
its arguments were good, on rank 0 the shared random shift, and its policy version. The sampling
protocol (`torchreplay.distributed.buffer`) reads the columns by the names below.
`metrics(global_=True)` gathers every rank's metrics the same way and combines them
(`job_metrics`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from torchreplay.buffer import RolloutBuffer
from torchreplay.samplers import ProportionalSampler

# Columns of the per-call rank table.
COUNT, TOTAL, MIN, BETA, BATCH, OK, SHIFT, VERSION = range(8)


@dataclass(frozen=True)
class RankStats:
    """Every rank buffer's figures as of one collective: `count` (rollouts, int64 [W]), `total` and
    `min` (sum and smallest positive priority, float64 [W]; min is +inf for an empty buffer)."""

    count: torch.Tensor
    total: torch.Tensor
    min: torch.Tensor

    @property
    def global_count(self) -> int:
        return int(self.count.sum())

    @property
    def global_total(self) -> float:
        return float(self.total.sum())

    @property
    def global_min(self) -> float:
        return float(self.min.min())


ShardStats = RankStats  # its name before the rank buffers stopped being called shards


def rank_row(buffer: RolloutBuffer, batch_size: int, ok: bool, shift: float) -> torch.Tensor:
    """This rank's row of the per-call rank table (module docstring, step 1)."""
    sampler = buffer.sampler
    count = len(buffer)
    weighted = isinstance(sampler, ProportionalSampler)
    if weighted and sampler.proportional:
        total, pmin = sampler.mass()
    else:  # samplers without priorities: weights are all ones, only count matters
        total, pmin = float(count), (1.0 if count else math.inf)
    beta = float(sampler.beta) if weighted else 0.0  # the protocol's default outside it
    return torch.tensor([count, total, pmin, beta, batch_size, 1.0 if ok else 0.0, shift, buffer.version],
                        dtype=torch.float64)


def job_metrics(keys: list[str], rows: torch.Tensor) -> dict[str, float]:
    """Job-wide figures from every rank's metrics (`rows[r, i]` is rank r's `keys[i]`): counts,
    bytes and histograms summed; ages, versions and call counts maxed; means weighted by rank
    buffer size; ESS fractions averaged over the ranks that have one."""
    col = {k: rows[:, i] for i, k in enumerate(keys)}
    size = col["size"]
    result: dict[str, float] = {}
    for k in keys:
        c = col[k]
        if k in ("age_max", "policy_version", "sample_calls", "dist_sample_calls"):
            result[k] = float(c.max())
        elif k in ("age_mean", "reuse_mean"):
            result[k] = float((c * size).sum() / size.sum()) if float(size.sum()) else 0.0
        elif k in ("ess_fraction", "dist_ess_fraction"):
            result[k] = float(c.nanmean()) if bool((~c.isnan()).any()) else math.nan
        else:
            result[k] = float(c.sum())
    return result
