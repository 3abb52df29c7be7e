"""torchreplay: rollout-level prioritized replay for LLM RL post-training."""

from torchreplay.buffer import Handles, ReplayBatch, RolloutBuffer
from torchreplay.errors import CheckpointError, ReplayError, SchemaError, StorageError
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
from torchreplay.tree import SegmentTree

__all__ = [
    "RolloutBuffer",
    "ReplayBatch",
    "Handles",
    "FieldSpec",
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
