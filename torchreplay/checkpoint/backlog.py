"""What may wait for a background upload: `Checkpointer(max_pending_bytes=...)`.

A shard queued for upload is pinned: its file (or hot copy) stays even after its last rollout
dies, until the checkpoint worker has stored it. A store slower than the buffer seals shards
would otherwise let pinned dead shards pile up in spill_dir (a soak held 214 MB of them against
2 MiB live). So:

- a sealed shard is queued only while the bytes queued stay within `max_pending_bytes`; one that
  does not fit is *deferred*: not pinned (its file goes as soon as its rollouts do), and uploaded
  by the next publish that names it, if it is still live then;
- a queued shard whose rollouts all died before its turn is not uploaded (*skipped*);
- a background publish with a newer publish queued behind it is dropped (*superseded*): the newer
  one writes the newer state.

A slow store then costs staleness of the checkpoint (`checkpoint_lag_s`), never unbounded disk or
memory. A publish itself holds the shards its snapshot names until it has uploaded them: at most
the live set at the snapshot.
"""

from __future__ import annotations

import threading
from typing import Any

from torchreplay.checks import check_int

DEFAULT_MAX_PENDING_BYTES = 1 << 30


def check_limit(max_pending_bytes: Any) -> int:
    check_int(max_pending_bytes, "max_pending_bytes (bytes)", low=0)
    return max_pending_bytes


class UploadBacklog:
    """The bytes queued for background upload against the limit, and what was left out.
    The trainer thread admits, the checkpoint worker settles: one lock between them."""

    def __init__(self, max_pending_bytes: int) -> None:
        self.limit = check_limit(max_pending_bytes)
        self._lock = threading.Lock()
        self._bytes = 0
        self._counts = {"deferred_shards": 0, "skipped_uploads": 0, "superseded_publishes": 0}

    def admit(self, nbytes: int) -> bool:
        """Queue `nbytes` more if they fit under the limit; else count the shard as deferred."""
        with self._lock:
            if self._bytes + nbytes > self.limit:
                self._counts["deferred_shards"] += 1
                return False
            self._bytes += nbytes
            return True

    def settle(self, nbytes: int) -> None:
        """Queued bytes the worker is done with (uploaded, skipped or dropped)."""
        with self._lock:
            self._bytes -= nbytes

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def metrics(self) -> dict[str, float]:
        with self._lock:
            return {"checkpoint_pending_bytes": float(self._bytes),
                    **{f"checkpoint_{k}": float(v) for k, v in self._counts.items()}}
