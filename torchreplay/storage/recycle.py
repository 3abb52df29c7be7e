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
from contextlib import contextmanager
from typing import Iterable, Iterator, Sequence

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
        # Copies an open `tentative` block may take back: [buffer, recycled, bytes, held by a shard].
        self._tentative: list[list] | None = None

    @property
    def spare_bytes(self) -> int:
        return sum(b.numel() for b in self._spare)

    def copy_in(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of CPU tensor `t` in memory this pool hands out."""
        need = t.numel() * t.element_size()
        if need == 0:
            return t.clone()
        return self._place(need, t.dtype, t.shape).copy_(t)

    def concat_in(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """CPU tensors `parts` (one dtype, one trailing shape) concatenated along dim 0, in memory
        this pool hands out: the list-of-tensors input, copied once as the packed form is."""
        shape = torch.Size((sum(p.shape[0] for p in parts), *parts[0].shape[1:]))
        need = shape.numel() * parts[0].element_size()
        if need == 0:
            return torch.cat(list(parts))
        return torch.cat(list(parts), out=self._place(need, parts[0].dtype, shape))

    def _place(self, need: int, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
        """An uninitialized contiguous tensor of `need` bytes, on a spare buffer if one fits."""
        with self._lock:
            self._largest = max(self._largest, need)
            fits = [i for i, b in enumerate(self._spare) if need <= b.numel() <= 2 * need + (1 << 20)]
            buf = self._spare.pop(min(fits, key=lambda i: self._spare[i].numel())) if fits else None
        recycled = buf is not None
        if buf is None:
            buf = torch.empty(need + int(need * _SLACK), dtype=torch.uint8, pin_memory=self.pin)
        self.counters["recycled_bytes" if recycled else "fresh_bytes"] += need
        if self._tentative is not None:
            self._tentative.append([buf, recycled, need, False])
        # A tensor set onto the storage, not a view of `buf`: a view would keep `buf` alive as its
        # base, and the use count could no longer tell whether anyone else holds the memory.
        return torch.empty(0, dtype=dtype).set_(buf.untyped_storage(), 0, shape, _contiguous_strides(shape))

    @contextmanager
    def tentative(self) -> Iterator[None]:
        """Copies made inside the block (on the owner thread) are taken back if it raises: their
        spare buffers go back to the spare list and the counters are as before, so a refused
        `add` leaves the pool, and its metrics, as they were. A copy a shard holds (`stored`) is
        the shard's while the shard lives: it is not taken back unless the shard died in the block
        (its deletion `give`s it, and the failed call's memory goes back as if never stored)."""
        outer, largest, self._tentative = self._tentative, self._largest, []
        try:
            yield
        except BaseException:
            with self._lock:
                for buf, recycled, need, held in self._tentative:
                    if not held:
                        self.counters["recycled_bytes" if recycled else "fresh_bytes"] -= need
                        if recycled:
                            self._spare.append(buf)
                self._largest = largest
                self._tentative = outer
            raise
        with self._lock:
            inner, self._tentative = self._tentative, outer
            if outer is not None:
                outer.extend(inner)  # an enclosing block may still be refused

    def _mark(self, tensors: Iterable[torch.Tensor], held: bool) -> set[int]:
        """Mark the open block's copies on these tensors' memory as held by a shard (or let go);
        returns the addresses it marked."""
        with self._lock:
            if not self._tentative:
                return set()
            ptrs = {t.untyped_storage().data_ptr() for t in tensors if t is not None and t.device.type == "cpu"}
            marked = set()
            for copy in self._tentative:
                ptr = copy[0].untyped_storage().data_ptr()
                if ptr in ptrs:
                    copy[3] = held
                    marked.add(ptr)
            return marked

    def stored(self, tensors: Iterable[torch.Tensor]) -> None:
        """These tensors are now held by a shard: a failing `tentative` block keeps their memory."""
        self._mark(tensors, True)

    def give(self, tensors) -> None:
        """Take back the storages of a dead shard's tensors that nothing else references."""
        # (`tensors` is iterated twice: a dict's values() or a list, never copied into a new list,
        # which would add a reference to each and defeat the check below.)
        # A shard that dies inside the `tentative` block that stored it (its call failed): the
        # block takes its copies back, so they are not taken here as well.
        mine = self._mark(tensors, False)
        for t in tensors:
            if t is None or t.device.type != "cpu" or t.is_pinned() != self.pin:
                continue
            if mine and t.untyped_storage().data_ptr() in mine:
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
