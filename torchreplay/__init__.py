"""torchreplay: rollout-level prioritized replay for LLM RL post-training."""

from torchreplay.errors import CheckpointError, ReplayError, SchemaError, StorageError
from torchreplay.tree import SegmentTree

__all__ = ["SegmentTree", "ReplayError", "SchemaError", "StorageError", "CheckpointError"]
__version__ = "0.1.0"
