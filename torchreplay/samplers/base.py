"""The sampler protocol and a base class for samplers backed by a SegmentTree."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from torchreplay.tree import SegmentTree


class SlotView(Protocol):
    """Read-only per-slot metadata the buffer shares with its sampler (CPU tensors of `capacity`)."""

    capacity: int
    live: torch.Tensor  # bool
    advantage: torch.Tensor  # float32
    policy_version: torch.Tensor  # int64
    group_id: torch.Tensor  # int64
    seq: torch.Tensor  # int64 insertion order, unique per stored rollout
    reuse: torch.Tensor  # int64 times sampled

    @property
    def current_version(self) -> int: ...

    def live_count(self) -> int: ...


@runtime_checkable
class Sampler(Protocol):
    """What a buffer needs from a sampler. Every hook receives CPU int64 slot tensors.

    - `bind(slots)` once, before anything else: the buffer's metadata.
    - `on_insert(slots)`: these slots just became live (their metadata is already written).
    - `on_remove(slots)`: these slots were evicted; never return them again.
    - `on_priority(slots)`: their advantage changed.
    - `on_advance(version)`: the trainer's policy version moved forward.
    - `sample(n, generator)`: `(slots int64 [n], weights float32 [n])`, weights are IS weights
      normalized to max 1 (all ones for samplers that do not reweight). Only live slots.
    - `state_dict()` / `load_state_dict(state)`: tensors and plain Python values only.
    - `to(device)`: move any device state (the priority tree).
    """

    def bind(self, slots: SlotView) -> None: ...

    def on_insert(self, slots: torch.Tensor) -> None: ...

    def on_remove(self, slots: torch.Tensor) -> None: ...

    def on_priority(self, slots: torch.Tensor) -> None: ...

    def on_advance(self, version: int) -> None: ...

    def sample(self, n: int, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def to(self, device: torch.device | str) -> "Sampler": ...


class TreeSampler:
    """Proportional sampling from a SegmentTree whose leaf i is `priority(slots)` for live slots.

    Subclasses define `priority`; this class keeps the tree in step with the buffer and turns tree
    draws into slots and IS weights `(p_i / p_min) ** -beta`, which equals PER's
    `(N P(i)) ** -beta / max_j (N P(j)) ** -beta`.
    """

    tree_dtype = torch.float64
    beta: float = 0.0

    def __init__(self) -> None:
        self.slots: SlotView | None = None
        self.tree: SegmentTree | None = None
        self._device = torch.device("cpu")

    # -- hooks ---------------------------------------------------------------------------------
    def bind(self, slots: SlotView) -> None:
        self.slots = slots
        self.tree = SegmentTree(slots.capacity, device=self._device, dtype=self.tree_dtype)

    def priority(self, slots: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _write(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        device = self.tree.device
        self.tree.update(slots.to(device), values.to(device=device, dtype=self.tree_dtype))

    def on_insert(self, slots: torch.Tensor) -> None:
        self._write(slots, self.priority(slots))

    def on_remove(self, slots: torch.Tensor) -> None:
        self._write(slots, torch.zeros(slots.numel(), dtype=self.tree_dtype))

    def on_priority(self, slots: torch.Tensor) -> None:
        self._write(slots, self.priority(slots))

    def on_advance(self, version: int) -> None:
        pass

    # -- sampling ------------------------------------------------------------------------------
    def sample(self, n: int, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        u = torch.rand(n, dtype=torch.float64, generator=generator)
        slots, prio = self.tree.sample(u=u.to(self.tree.device))
        return slots.cpu(), self.weights(prio).cpu()

    def weights(self, prio: torch.Tensor) -> torch.Tensor:
        if self.beta == 0:
            return torch.ones(prio.shape, dtype=torch.float32, device=prio.device)
        ratio = prio.to(torch.float64) / self.tree.min()
        return ratio.pow(-self.beta).to(torch.float32)

    # -- state ---------------------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {"type": type(self).__name__, "config": self.config(), "tree": self.tree.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("type") != type(self).__name__:
            raise ValueError(f"sampler state is for {state.get('type')!r}, this sampler is {type(self).__name__}")
        if state.get("config") != self.config():
            raise ValueError(f"sampler config differs: saved {state.get('config')}, this sampler {self.config()}")
        self.tree.load_state_dict(state["tree"])

    def to(self, device: torch.device | str) -> "TreeSampler":
        self._device = torch.device(device)
        if self.tree is not None:
            self.tree.to(self._device)
        return self
