"""HostPool: host memory of dead shards, kept to hold the next shards' bytes.

`add` copies the caller's token tensors once, into the shard. Into fresh memory that copy costs
~4x a copy into pages the process already has: the kernel faults in and zeroes every fresh page
(measured here: 0.10 s against 0.025 s for 320 MB, docs/benchmarks.md). A replay buffer at steady
state frees about as many bytes per step as it adds, so the freed shards' memory is kept (up to a
bound) and handed to the next copies.

A dead shard's tensor is taken only if nothing else references it or its storage (a state_dict
or a reader may still hold it, or a view of it).
"""

from __future__ import annotations

import sys
import threading

import torch

_SLACK = 1 / 16  # fresh buffers are this much larger, so a slightly larger next shard still fits


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _refs_of_a_sole_shard_tensor() -> int:
    """What `give` sees for a tensor held by nothing but a shard's dict, measured with the same
    code shape (interpreters differ in which references they count)."""
    held = {"t": torch.empty(0)}
    for t in held.values():
        return sys.getrefcount(t)
    raise AssertionError("unreachable")


_SOLE_REFS = _refs_of_a_sole_shard_tensor()


class HostPool:
    """Recycled byte buffers for shard data (pinned iff `pin`), at most `limit_bytes` of them, or
    twice the largest buffer requested so far when `limit_bytes` is None."""

    def __init__(self, pin: bool, limit_bytes: int | None = None) -> None:
        self.pin = pin
        self.limit_bytes = limit_bytes
        self._spare: list[torch.Tensor] = []  # 1-D uint8 over whole storages
        self._largest = 0
        self._lock = threading.Lock()  # give() runs on whichever thread deletes a shard
        self.counters = {"recycled_bytes": 0, "fresh_bytes": 0}

    @property
    def spare_bytes(self) -> int:
        return sum(b.numel() for b in self._spare)

    def copy_in(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of CPU tensor `t` in memory this pool hands out."""
        need = t.numel() * t.element_size()
        if need == 0:
            return t.clone()
        with self._lock:
            self._largest = max(self._largest, need)
            fits = [i for i, b in enumerate(self._spare) if need <= b.numel() <= 2 * need + (1 << 20)]
            buf = self._spare.pop(min(fits, key=lambda i: self._spare[i].numel())) if fits else None
        if buf is None:
            buf = torch.empty(need + int(need * _SLACK), dtype=torch.uint8, pin_memory=self.pin)
            self.counters["fresh_bytes"] += need
        else:
            self.counters["recycled_bytes"] += need
        # A tensor set onto the storage, not a view of `buf`: a view would keep `buf` alive as its
        # base, and the use count could no longer tell whether anyone else holds the memory.
        out = torch.empty(0, dtype=t.dtype).set_(buf.untyped_storage(), 0, t.shape, _contiguous_strides(t.shape))
        return out.copy_(t)

    def give(self, tensors) -> None:
        """Take back the storages of a dead shard's tensors that nothing else references."""
        for t in tensors:
            if t is None or t.device.type != "cpu" or t.is_pinned() != self.pin:
                continue
            # Nothing but the dying shard may hold the memory: no other Python reference to `t`
            # (a state_dict hands out the shard's own tensor objects) and no other tensor on its
            # storage (the use count: `t` and the temporary storage object made to ask). Extra
            # references only ever make this skip recycling.
            if sys.getrefcount(t) > _SOLE_REFS or torch._C._storage_Use_Count(t.untyped_storage()._cdata) > 2:
                continue
            flat = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
            with self._lock:
                limit = self.limit_bytes if self.limit_bytes is not None else 2 * self._largest
                if self.spare_bytes + flat.numel() <= limit:
                    self._spare.append(flat)
