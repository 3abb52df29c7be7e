"""DistributedRolloutBuffer: one `RolloutBuffer` per rank (its rank buffer) over `torch.distributed`.

The parts (each module's docstring has the details):

- `buffer`: `DistributedRolloutBuffer` itself, its handles and rank statistics, and the protocol
  of a local or global `sample` (the collectives in order, IS weights across ranks).
- `comm`: the collectives over one process group, failures turned into `ReplayError`, and the
  agreement that makes a rank's local failure raise on every rank instead of leaving the others
  waiting.
- `stats`: the per-call table of every rank buffer's count, priority mass, beta and version, and the
  job-wide metrics.
- `wire`: how rollouts travel between ranks in a global sample (raw bytes, a layout derived once
  from the buffer's fields).
- `generations`: the checkpoint layout under a run prefix (rank URIs, generation records) and
  resuming on another world size (reshard planning, each rank's import share).
"""

from torchreplay.distributed.buffer import MODES, DistributedHandles, DistributedRolloutBuffer, RankStats, ShardStats
from torchreplay.distributed.generations import newest_complete_generation, plan_reshard, rank_uri

__all__ = ["DistributedRolloutBuffer", "DistributedHandles", "RankStats", "ShardStats", "MODES",
           "newest_complete_generation", "plan_reshard", "rank_uri"]
