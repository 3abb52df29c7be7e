"""Injected storage faults for the contract tests."""

from torchreplay.errors import StorageError
from torchreplay.storage import TieredStorage


class FlakyStorage(TieredStorage):
    """A storage whose next `put` raises, as a background spill failure (ENOSPC) surfacing in it."""

    fail_next = False

    def put(self, batch):
        if self.fail_next:
            self.fail_next = False
            raise StorageError("background spill failed: [Errno 28] No space left on device")
        return super().put(batch)
