"""Durable checkpoints of a RolloutBuffer to S3 or a local directory."""

from torchreplay import snapshot
from torchreplay.checkpoint import restore
from torchreplay.checkpoint.checkpointer import Checkpointer
from torchreplay.checkpoint.manifest import read_manifest, validate_manifest
from torchreplay.checkpoint.store import FileStore, ObjectStore, S3Store, open_store

# RolloutBuffer.from_checkpoint / import_checkpoint read through this package; the buffer itself
# imports nothing from it (imports point one way: checkpoint -> buffer).
snapshot.use_checkpoint_reader(restore)

__all__ = ["Checkpointer", "FileStore", "ObjectStore", "S3Store", "open_store", "read_manifest", "validate_manifest"]
