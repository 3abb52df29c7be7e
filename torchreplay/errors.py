"""The exception hierarchy. Messages name the field, the expected and the received value."""


class ReplayError(Exception):
    """Base class for torchreplay errors that are not plain argument errors."""


class SchemaError(ReplayError, ValueError):
    """A rollout batch does not match the buffer's schema (field, rollout index and problem named)."""


class StorageError(ReplayError):
    """Reading or writing rollout storage failed (disk full, permissions, corruption)."""


class CheckpointError(ReplayError):
    """A checkpoint could not be written or read back."""
