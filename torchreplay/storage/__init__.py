"""Where rollout bytes live: hot tier, cold shard files, I/O back ends. Knows nothing of priorities."""

from torchreplay.storage.io import KvikioIO, PosixIO, cuda_driver_present, make_io
from torchreplay.storage.tiered import (
    CorruptRows,
    HotPolicy,
    LRUPolicy,
    MissingShard,
    NewestFirstPolicy,
    TieredStorage,
)

__all__ = ["TieredStorage", "HotPolicy", "LRUPolicy", "NewestFirstPolicy", "CorruptRows", "MissingShard", "PosixIO",
           "KvikioIO", "make_io", "cuda_driver_present"]
