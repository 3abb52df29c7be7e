"""Durable checkpoints of a RolloutBuffer to S3 or a local directory."""

from torchreplay.checkpoint.checkpointer import Checkpointer, read_manifest, validate_manifest
from torchreplay.checkpoint.store import FileStore, ObjectStore, S3Store, open_store

__all__ = ["Checkpointer", "read_manifest", "validate_manifest", "ObjectStore", "FileStore", "S3Store", "open_store"]
