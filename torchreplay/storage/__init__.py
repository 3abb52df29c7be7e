"""Where rollout bytes live: hot tier, cold shard files, I/O back ends. Knows nothing of priorities."""

from torchreplay.storage.gather import Gather, PinnedShards
from torchreplay.storage.io import KvikioIO, PosixIO, cuda_driver_present, make_io
from torchreplay.storage.policies import HotPolicy, LRUPolicy, NewestFirstPolicy
from torchreplay.storage.table import CorruptRows, MissingShard, ShardExport, ShardView
from torchreplay.storage.tiered import TieredStorage

__all__ = ["TieredStorage", "HotPolicy", "LRUPolicy", "NewestFirstPolicy", "CorruptRows", "MissingShard", "ShardView",
           "ShardExport", "Gather", "PinnedShards", "PosixIO", "KvikioIO", "make_io", "cuda_driver_present"]
