"""torchreplay: rollout-level prioritized replay for LLM RL post-training."""

from torchreplay.buffer import Handles, PendingBatch, ReplayBatch, RolloutBuffer
from torchreplay.checkpoint import Checkpointer
from torchreplay.distributed import DistributedRolloutBuffer
from torchreplay.errors import CheckpointError, ReplayError, SchemaError, StorageError
from torchreplay.packed import PackedReplayBatch, to_packed
from torchreplay.padded import from_padded
from torchreplay.samplers import (
    FreshnessSampler,
    GroupSampler,
    PNewestSampler,
    PrioritizedSampler,
    Sampler,
    TreeSampler,
    UniformSampler,
)
from torchreplay.schema import FieldSpec
from torchreplay.storage import LRUPolicy, NewestFirstPolicy, TieredStorage
from torchreplay.tree import SegmentTree

__all__ = [
    "RolloutBuffer",
    "DistributedRolloutBuffer",
    "PendingBatch",
    "TieredStorage",
    "LRUPolicy",
    "NewestFirstPolicy",
    "Checkpointer",
    "ReplayBatch",
    "PackedReplayBatch",
    "to_packed",
    "Handles",
    "FieldSpec",
    "from_padded",
    "SegmentTree",
    "Sampler",
    "TreeSampler",
    "UniformSampler",
    "PrioritizedSampler",
    "FreshnessSampler",
    "PNewestSampler",
    "GroupSampler",
    "ReplayError",
    "SchemaError",
    "StorageError",
    "CheckpointError",
]
__version__ = "0.1.0"
