"""SegmentTree: a tensor-backed sum/min priority tree over the torchreplay custom ops."""

from __future__ import annotations

import math
from typing import Any

import torch

from torchreplay._ops import ops
from torchreplay.checks import check_int, is_int

_ARITY = 8
# The overloads themselves: calling them skips the packet's overload resolution on every call.
_tree_update = ops.tree_update.default
_tree_sample = ops.tree_sample.default
_tree_sample_seeded = ops.tree_sample_seeded.default


def _layout(capacity: int) -> tuple[int, int]:
    """(padded leaf count, internal node count); mirrors make_layout in csrc/segment_tree.h."""
    depth, span = 1, _ARITY
    while span < capacity:
        span *= _ARITY
        depth += 1
    internal = 0
    for d in range(depth):
        cover = _ARITY ** (depth - d)
        nodes = -(-capacity // cover)
        internal += -(-nodes // _ARITY) * _ARITY
    return -(-capacity // _ARITY) * _ARITY, internal


class SegmentTree:
    """Sum and live-minimum tree over `capacity` non-negative priorities.

    Leaves are stored in `dtype` (float32 or float64); every internal sum is float64 and recomputed
    from its children on update, so the root never drifts from the sum of the leaves. A leaf with
    priority 0 is never sampled.

    All methods keep their work on the tree's device. Argument values (index ranges, NaN/negative
    priorities, `u` in [0, 1), sampling an empty tree) are checked before anything changes: on the
    CPU inside the ops themselves, always; on CUDA by this class when `validate=True` (the default),
    at the cost of one device-to-host synchronization per call, so a hot loop that already
    guarantees valid input can pass `validate=False`. The CUDA kernels skip invalid entries, so
    they stay memory-safe either way.
    """

    _on_cpu = False  # set per instance; an instance unpickled from before it existed takes the slow paths

    def __init__(
        self,
        capacity: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        validate: bool = True,
    ) -> None:
        check_int(capacity, "capacity", low=1)
        if dtype not in (torch.float32, torch.float64):
            raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
        self.capacity = capacity
        self.dtype = dtype
        self.validate = validate
        padded, internal = _layout(capacity)
        device = torch.device(device)
        self._leaves = torch.zeros(padded, dtype=dtype, device=device)
        self._sums = torch.zeros(internal, dtype=torch.float64, device=device)
        self._mins = torch.full((internal,), math.inf, dtype=torch.float64, device=device)
        self._on_cpu = device.type == "cpu"

    @property
    def _check_values_here(self) -> bool:
        # The CPU ops validate values themselves (cheaply, before writing); only CUDA needs Python to.
        return self.validate and self._leaves.device.type != "cpu"

    # ------------------------------------------------------------------ properties
    @property
    def device(self) -> torch.device:
        return self._leaves.device

    @property
    def priorities(self) -> torch.Tensor:
        """A read-only view of all `capacity` leaf priorities."""
        return self._leaves[: self.capacity]

    def raw_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copies of the tree's storage in the form the `torch.ops.torchreplay.tree_*` ops take:
        (padded leaves, float64 internal sums, float64 internal live minima). For calling those ops
        directly and comparing two trees node for node; changing a copy leaves the tree as it is."""
        return self._leaves.clone(), self._sums.clone(), self._mins.clone()

    def __len__(self) -> int:
        return self.capacity

    # ------------------------------------------------------------------ argument handling
    def _as_indices(self, indices: Any, name: str = "indices") -> torch.Tensor:
        if not isinstance(indices, torch.Tensor):
            try:
                indices = torch.as_tensor(indices)
            except (TypeError, ValueError, RuntimeError) as exc:
                raise TypeError(f"{name} must be a tensor of int64 indices, got {type(indices).__name__}") from exc
        if indices.dtype in (torch.bool,) or indices.is_floating_point() or indices.is_complex():
            raise TypeError(f"{name} must be an integer tensor, got {indices.dtype}")
        if indices.dim() == 0:
            indices = indices.reshape(1)
        if indices.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(indices.shape)}")
        if indices.device != self.device:
            raise ValueError(f"{name} must be on the tree's device {self.device}, got {indices.device}")
        if indices.dtype != torch.int64:
            indices = indices.to(torch.int64)
        if self._check_values_here and indices.numel():
            lo, hi = int(indices.min()), int(indices.max())
            if lo < 0 or hi >= self.capacity:
                bad = lo if lo < 0 else hi
                raise IndexError(f"{name} contains {bad}, outside [0, {self.capacity})")
        return indices

    def _as_priorities(self, priorities: Any, count: int) -> torch.Tensor:
        if not isinstance(priorities, torch.Tensor):
            priorities = torch.as_tensor(priorities, dtype=self.dtype, device=self.device)
        if not priorities.is_floating_point():
            raise TypeError(f"priorities must be a floating-point tensor, got {priorities.dtype}")
        if priorities.device != self.device:
            raise ValueError(f"priorities must be on the tree's device {self.device}, got {priorities.device}")
        if priorities.dim() == 0:
            priorities = priorities.expand(count)
        if priorities.shape != (count,):
            raise ValueError(f"priorities must have shape ({count},) to match indices, got {tuple(priorities.shape)}")
        if priorities.dtype != self.dtype:
            priorities = priorities.to(self.dtype)
        if self._check_values_here and count:
            bad = ~(torch.isfinite(priorities) & (priorities >= 0))
            if bool(bad.any()):
                where = int(bad.nonzero()[0, 0])
                raise ValueError(
                    f"priorities must be finite and >= 0; priorities[{where}] = {float(priorities[where])}"
                )
        return priorities

    # ------------------------------------------------------------------ operations
    def update(self, indices: Any, priorities: Any) -> None:
        """Set leaf priorities. For a repeated index the last occurrence wins."""
        # Fast path for what a training loop passes (sampled indices, a priority tensor): on the CPU
        # the op checks values itself, so only the metadata the op would reject with a less helpful
        # message is looked at here; anything else takes the full conversion below.
        if (
            self._on_cpu
            and type(indices) is torch.Tensor
            and type(priorities) is torch.Tensor
            and indices.dtype is torch.int64
            and priorities.dtype is self.dtype
            and indices.is_cpu
            and priorities.is_cpu
            and indices.dim() == 1
            and priorities.shape == indices.shape
        ):
            _tree_update(self._leaves, self._sums, self._mins, indices, priorities, self.capacity)
            return
        indices = self._as_indices(indices)
        priorities = self._as_priorities(priorities, indices.numel())
        _tree_update(self._leaves, self._sums, self._mins, indices, priorities, self.capacity)

    def sample(
        self,
        batch_size: int | None = None,
        u: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        stratified: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw leaves with probability p_i / sum(p). Returns (indices int64, priorities).

        Either give `batch_size` or the uniforms `u` in [0, 1) themselves. With `batch_size`, the
        uniforms come from `generator` (torch's default when None): on a GPU as torch.rand on the
        device; on the CPU as a counter-based stream (SplitMix64, see `counter_uniform` in
        csrc/segment_tree.h) computed inside the op from one 62-bit seed drawn from `generator`,
        which costs a tenth of torch.rand at B=4096. Either way the same generator state gives the
        same batch. Stratified: sample k uses (k + u_k) / B, so the batch covers the whole range
        evenly and comes back sorted by index.
        """
        if type(stratified) is not bool:
            raise TypeError(f"stratified must be a bool, got {type(stratified).__name__}")
        if u is None and self._on_cpu and type(batch_size) is int and 0 <= batch_size < 1 << 63:
            # The common CPU call: the op validates the tree itself.
            seed = int(torch.randint(0, 1 << 62, (), generator=generator))
            return _tree_sample_seeded(self._leaves, self._sums, seed, batch_size, self.capacity, stratified)
        if u is None:
            if batch_size is None:
                raise ValueError("sample needs batch_size or u")
            check_int(batch_size, "batch_size", low=0, high=2**63 - 1)
            u = torch.rand(batch_size, dtype=torch.float64, device=self.device, generator=generator)
        else:
            if not isinstance(u, torch.Tensor):
                raise TypeError(f"u must be a tensor, got {type(u).__name__}")
            if not u.is_floating_point():
                raise TypeError(f"u must be a floating-point tensor, got {u.dtype}")
            if u.dim() != 1:
                raise ValueError(f"u must be 1-D, got shape {tuple(u.shape)}")
            if batch_size is not None and batch_size != u.numel():
                raise ValueError(f"batch_size={batch_size} disagrees with len(u)={u.numel()}")
            if u.device != self.device:
                raise ValueError(f"u must be on the tree's device {self.device}, got {u.device}")
            u = u.to(torch.float64)
            if self._check_values_here and u.numel() and not bool(((u >= 0) & (u < 1)).all()):
                raise ValueError("u must lie in [0, 1)")
        if self._check_values_here and u.numel():
            total = float(self.total())
            if not total > 0:
                raise ValueError("cannot sample from an empty tree: every priority is 0")
            if total == math.inf:
                raise ValueError("cannot sample: the priorities sum to more than the largest float64; scale them down")
        return _tree_sample(self._leaves, self._sums, u, self.capacity, stratified)

    def total(self) -> torch.Tensor:
        """Sum of all priorities, a float64 0-dim tensor on the tree's device."""
        return ops.tree_total(self._sums)

    def min(self) -> torch.Tensor:
        """Smallest positive priority (float64 0-dim tensor); +inf when no leaf is live."""
        return ops.tree_min(self._mins)

    def __getitem__(self, indices: Any) -> torch.Tensor:
        if is_int(indices):
            return ops.tree_get(self._leaves, self._as_indices(torch.tensor([indices], device=self.device)),
                                self.capacity)[0]
        return ops.tree_get(self._leaves, self._as_indices(indices), self.capacity)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Leaves only (on the CPU): the internal nodes are derived and rebuilt on load."""
        return {"capacity": self.capacity, "dtype": str(self.dtype).removeprefix("torch."),
                "priorities": self.priorities.detach().cpu().clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Validate then rebuild. The tree is unchanged if anything is wrong."""
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict, got {type(state).__name__}")
        for key in ("capacity", "priorities"):
            if key not in state:
                raise ValueError(f"state is missing {key!r}")
        if state["capacity"] != self.capacity:
            raise ValueError(f"state capacity {state['capacity']} != tree capacity {self.capacity}")
        priorities = state["priorities"]
        if not isinstance(priorities, torch.Tensor) or not priorities.is_floating_point():
            raise TypeError("state['priorities'] must be a floating-point tensor")
        if priorities.shape != (self.capacity,):
            raise ValueError(f"state['priorities'] must have shape ({self.capacity},), got {tuple(priorities.shape)}")
        if not bool((torch.isfinite(priorities) & (priorities >= 0)).all()):
            raise ValueError("state['priorities'] must be finite and >= 0")
        leaves = torch.zeros_like(self._leaves)
        leaves[: self.capacity] = priorities.to(device=self.device, dtype=self.dtype)
        ops.tree_rebuild(leaves, self._sums, self._mins, self.capacity)
        self._leaves = leaves

    def to(self, device: torch.device | str) -> "SegmentTree":
        """Move the tree (in place) and return it, like `nn.Module.to`."""
        device = torch.device(device)
        self._leaves = self._leaves.to(device)
        self._sums = self._sums.to(device)
        self._mins = self._mins.to(device)
        self._on_cpu = device.type == "cpu"
        return self

    def __repr__(self) -> str:
        return f"SegmentTree(capacity={self.capacity}, dtype={self.dtype}, device={self.device})"
