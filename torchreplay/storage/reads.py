"""ReadCounts: a TieredStorage's read counters (hot hits, cold reads and bytes), which a caller
may hold back until its call succeeds.

A buffer call reads rows and may still fail afterwards (a compose whose fresh shard cannot be
stored, a sample whose batch cannot be handed over). Such a call changes nothing, its counters
included, so the reads it made are tallied aside (`deferred`) and added (`commit`) only once it
has succeeded. The tally is per thread: a prefetch thread's reads for an earlier batch count as
they happen, whatever the trainer thread's call does meanwhile.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator


class ReadCounts:
    """Adds to `counters` (a storage's dict), or to this thread's open `deferred` tally."""

    def __init__(self, counters: dict[str, int]) -> None:
        self.counters = counters
        self._local = threading.local()

    def add(self, name: str, n: int) -> None:
        tally = getattr(self._local, "tally", None)
        target = self.counters if tally is None else tally
        target[name] = target.get(name, 0) + n

    @contextmanager
    def deferred(self) -> Iterator[dict[str, int]]:
        """Reads on this thread inside the block go to the yielded tally instead of the counters;
        pass it to `commit` when the call has succeeded, or drop it."""
        outer = getattr(self._local, "tally", None)
        tally: dict[str, int] = {}
        self._local.tally = tally
        try:
            yield tally
        finally:
            self._local.tally = outer

    def commit(self, tally: dict[str, int]) -> None:
        """Count a tally (into an enclosing `deferred` block's, if one is open on this thread)."""
        for name, n in tally.items():
            self.add(name, n)
