"""RolloutBuffer: rollout-level, advantage-prioritized, staleness-bounded replay."""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import torch

from torchreplay.errors import SchemaError
from torchreplay.samplers import PrioritizedSampler, Sampler
from torchreplay.schema import ROLLOUT, TOKEN, FieldSpec, PackedBatch, default_fields, validate_batch

# Per-rollout fields the slot table holds for samplers and metrics; everything else lives in chunks.
_TABLE_FIELDS = ("advantage", "reward", "group_id", "policy_version", "prompt_len")
EVICTION_REASONS = ("staleness", "reuse", "capacity")
_STATE_VERSION = 1


@dataclass(frozen=True)
class Handles:
    """Identifies stored rollouts across slot reuse: a handle is live while its generation matches."""

    slot: torch.Tensor  # int64 [n]
    generation: torch.Tensor  # int64 [n]

    def __len__(self) -> int:
        return self.slot.numel()

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return zip(self.slot.tolist(), self.generation.tolist())


@dataclass
class ReplayBatch:
    """A padded training batch. `data` holds every field as [B, T, ...] (token) or [B] (rollout)
    tensors: tokens, attention_mask, response_mask, logprobs, reward, advantage, group_id,
    policy_version, prompt_len, plus optional/declared fields. Bookkeeping: handles, IS `weights`
    (max 1), `age` (policy versions), `reuse` (times used before this batch), `is_fresh`."""

    data: dict[str, torch.Tensor]
    handles: Handles
    weights: torch.Tensor
    age: torch.Tensor
    reuse: torch.Tensor
    is_fresh: torch.Tensor

    def __getattr__(self, name: str) -> torch.Tensor:
        data = self.__dict__.get("data", {})
        if name in data:
            return data[name]
        raise AttributeError(f"ReplayBatch has no field {name!r}; fields: {sorted(data)}")

    def __len__(self) -> int:
        return self.weights.numel()

    def to(self, device: torch.device | str) -> "ReplayBatch":
        """Move every tensor. From the CPU to CUDA this goes through pinned memory, non-blocking."""
        device = torch.device(device)

        def move(t: torch.Tensor) -> torch.Tensor:
            if t.device == device:
                return t
            if device.type == "cuda" and t.device.type == "cpu":
                return t.pin_memory().to(device, non_blocking=True)
            return t.to(device)

        return ReplayBatch(
            data={k: move(v) for k, v in self.data.items()},
            handles=self.handles,
            weights=move(self.weights),
            age=move(self.age),
            reuse=move(self.reuse),
            is_fresh=move(self.is_fresh),
        )


@dataclass
class _Chunk:
    """The packed rollouts of one add() call. Immutable once stored; dropped when no row is live."""

    batch: PackedBatch
    live_rows: int

    def nbytes(self) -> int:
        return self.batch.nbytes()


class _SlotTable:
    """Per-slot metadata (CPU tensors), shared read-only with the sampler."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.live = torch.zeros(capacity, dtype=torch.bool)
        self.generation = torch.zeros(capacity, dtype=torch.int64)
        self.seq = torch.full((capacity,), -1, dtype=torch.int64)
        self.reuse = torch.zeros(capacity, dtype=torch.int64)
        self.advantage = torch.zeros(capacity, dtype=torch.float32)
        self.reward = torch.zeros(capacity, dtype=torch.float32)
        self.group_id = torch.zeros(capacity, dtype=torch.int64)
        self.policy_version = torch.zeros(capacity, dtype=torch.int64)
        self.prompt_len = torch.zeros(capacity, dtype=torch.int64)
        self.chunk = torch.full((capacity,), -1, dtype=torch.int64)
        self.row = torch.zeros(capacity, dtype=torch.int64)
        self.version = 0
        self.count = 0

    TENSORS = ("live", "generation", "seq", "reuse", "advantage", "reward", "group_id", "policy_version",
               "prompt_len", "chunk", "row")

    @property
    def current_version(self) -> int:
        return self.version

    def live_count(self) -> int:
        return self.count


class RolloutBuffer:
    """Stores rollouts individually and samples them for replay.

    Args:
        capacity: number of rollout slots.
        sampler: a `Sampler` (default `PrioritizedSampler()`: p = (|A| + eps) ** alpha).
        max_staleness: evict rollouts more than this many policy versions older than the current
            version (set by `advance`). None: no cap.
        max_reuse: evict a rollout once it has been used this many times (a fresh use in `compose`
            counts). None: no cap.
        overflow: "evict_oldest" (insertion order) or "raise" when `add` finds no free slot.
        padding_side: "right" or "left" padding of token fields in sampled batches.
        pad_token_id: value of padded `tokens` positions.
        ref_logprobs: store per-token reference log-probs too.
        routing: (num_experts, layers, top_k) to store MoE routing ids per token (Rollout Routing
            Replay), in the narrowest integer dtype that holds the expert ids.
        extra_fields: user-declared fields, name -> FieldSpec.
    """

    def __init__(
        self,
        capacity: int,
        sampler: Sampler | None = None,
        max_staleness: int | None = None,
        max_reuse: int | None = None,
        overflow: str = "evict_oldest",
        padding_side: str = "right",
        pad_token_id: int = 0,
        ref_logprobs: bool = False,
        routing: tuple[int, int, int] | None = None,
        extra_fields: Mapping[str, FieldSpec] | None = None,
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
        for name, value in (("max_staleness", max_staleness), ("max_reuse", max_reuse)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be None or an int >= 0, got {value!r}")
        if max_reuse == 0:
            raise ValueError("max_reuse must be >= 1 (0 would evict every rollout before it is used)")
        if overflow not in ("evict_oldest", "raise"):
            raise ValueError(f"overflow must be 'evict_oldest' or 'raise', got {overflow!r}")
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
        self.capacity = capacity
        self.max_staleness = max_staleness
        self.max_reuse = max_reuse
        self.overflow = overflow
        self.padding_side = padding_side
        self.pad_token_id = int(pad_token_id)
        self.fields: dict[str, FieldSpec] = default_fields(ref_logprobs, routing, extra_fields)
        self._schema_args = {"ref_logprobs": ref_logprobs, "routing": list(routing) if routing else None,
                             "extra_fields": sorted(extra_fields or {})}
        self.sampler: Sampler = sampler if sampler is not None else PrioritizedSampler()
        if not isinstance(self.sampler, Sampler):
            raise TypeError(f"sampler must implement the Sampler protocol, got {type(self.sampler).__name__}")
        self._table = _SlotTable(capacity)
        self.sampler.bind(self._table)
        self._chunks: dict[int, _Chunk] = {}
        self._next_chunk = 0
        self._next_seq = 0
        # Free slots as a stack: the lowest slot is reused first, deterministically.
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self._fifo: deque[tuple[int, int]] = deque()  # (slot, seq) in insertion order
        self._by_version: dict[int, list[tuple[int, int]]] = {}
        self._version_heap: list[int] = []
        self._counters: dict[str, float] = {f"evicted_{r}": 0 for r in EVICTION_REASONS}
        self._counters.update(stale_handle_updates=0, sampled_fresh=0, sampled_replay=0, added=0, sample_calls=0)
        self._last_ess = math.nan
        self._bytes = 0

    # ------------------------------------------------------------------------------------ adding
    def __len__(self) -> int:
        return self._table.count

    @property
    def version(self) -> int:
        """The current policy version: the highest passed to `advance` or seen in `add`."""
        return self._table.version

    def add(self, batch: Any) -> Handles:
        """Validate and store a batch of rollouts; returns their handles.

        `batch` is a dict (or TensorDict) with, per rollout: `tokens` (prompt + response),
        `response_mask`, `logprobs` (ragged: a list of 1-D tensors, a nested tensor, or
        {"values", "offsets"}), and `prompt_len`, `reward`, `advantage`, `group_id` ([n] tensors),
        `policy_version` ([n] tensor or one int). Nothing changes unless the whole batch is valid.
        """
        packed = validate_batch(batch, self.fields)
        self._check_admissible(packed)
        return self._store(packed)

    def _check_admissible(self, packed: PackedBatch) -> None:
        if packed.n > self.capacity:
            raise SchemaError(f"batch of {packed.n} rollouts exceeds the buffer capacity {self.capacity}")
        if self.overflow == "raise" and packed.n > len(self._free):
            raise SchemaError(
                f"buffer full: {packed.n} rollouts to add, {len(self._free)} free slots (overflow='raise')"
            )
        if self.max_staleness is not None:
            floor = max(self.version, int(packed.rollout["policy_version"].max())) - self.max_staleness
            stale = packed.rollout["policy_version"] < floor
            if bool(stale.any()):
                i = int(stale.nonzero()[0, 0])
                raise SchemaError(
                    f"field 'policy_version', rollout {i}: version {int(packed.rollout['policy_version'][i])} is "
                    f"older than the staleness cap allows (current {self.version}, max_staleness {self.max_staleness})"
                )

    def _store(self, packed: PackedBatch) -> Handles:
        n = packed.n
        if n > len(self._free):
            self._evict_oldest(n - len(self._free))
        slots = torch.tensor([self._free.pop() for _ in range(n)], dtype=torch.int64)
        t = self._table
        chunk_id = self._next_chunk
        self._next_chunk += 1
        # Table-held per-rollout fields are not kept twice.
        chunk_batch = PackedBatch(
            n=n, offsets=packed.offsets, token=packed.token,
            rollout={k: v for k, v in packed.rollout.items() if k not in _TABLE_FIELDS},
        )
        self._chunks[chunk_id] = _Chunk(chunk_batch, n)
        self._bytes += chunk_batch.nbytes()
        seq = torch.arange(self._next_seq, self._next_seq + n, dtype=torch.int64)
        self._next_seq += n
        t.live[slots] = True
        t.generation[slots] += 1
        t.seq[slots] = seq
        t.reuse[slots] = 0
        for name in _TABLE_FIELDS:
            getattr(t, name)[slots] = packed.rollout[name]
        t.chunk[slots] = chunk_id
        t.row[slots] = torch.arange(n, dtype=torch.int64)
        t.count += n
        t.version = max(t.version, int(packed.rollout["policy_version"].max()))
        self._fifo.extend(zip(slots.tolist(), seq.tolist()))
        for slot, s, v in zip(slots.tolist(), seq.tolist(), packed.rollout["policy_version"].tolist()):
            bucket = self._by_version.get(v)
            if bucket is None:
                bucket = self._by_version[v] = []
                heapq.heappush(self._version_heap, v)
            bucket.append((slot, s))
        self._counters["added"] += n
        self.sampler.on_insert(slots)
        return Handles(slots, t.generation[slots].clone())

    # ---------------------------------------------------------------------------------- eviction
    def _alive(self, slot: int, seq: int) -> bool:
        return bool(self._table.live[slot]) and int(self._table.seq[slot]) == seq

    def _evict(self, slots: torch.Tensor, reason: str) -> None:
        if slots.numel() == 0:
            return
        t = self._table
        self.sampler.on_remove(slots)
        t.live[slots] = False
        t.count -= slots.numel()
        for chunk_id in t.chunk[slots].tolist():
            chunk = self._chunks[chunk_id]
            chunk.live_rows -= 1
            if chunk.live_rows == 0:
                self._bytes -= chunk.nbytes()
                del self._chunks[chunk_id]
        t.chunk[slots] = -1
        self._free.extend(reversed(slots.tolist()))
        self._counters[f"evicted_{reason}"] += slots.numel()

    def _evict_oldest(self, k: int) -> None:
        victims: list[int] = []
        while len(victims) < k:
            slot, seq = self._fifo.popleft()
            if self._alive(slot, seq):
                victims.append(slot)
        self._evict(torch.tensor(victims, dtype=torch.int64), "capacity")

    def advance(self, policy_version: int) -> int:
        """Set the current policy version; evict rollouts older than `max_staleness` versions.

        Costs O(evicted + distinct versions dropped). Returns the number evicted.
        """
        if isinstance(policy_version, bool) or not isinstance(policy_version, int):
            raise TypeError(f"policy_version must be an int, got {type(policy_version).__name__}")
        if policy_version < self.version:
            raise ValueError(f"policy_version must not go backwards: {policy_version} < current {self.version}")
        self._table.version = policy_version
        evicted = 0
        if self.max_staleness is not None:
            floor = policy_version - self.max_staleness
            victims: list[int] = []
            while self._version_heap and self._version_heap[0] < floor:
                version = heapq.heappop(self._version_heap)
                victims.extend(slot for slot, seq in self._by_version.pop(version) if self._alive(slot, seq))
            evicted = len(victims)
            self._evict(torch.tensor(victims, dtype=torch.int64), "staleness")
        self.sampler.on_advance(policy_version)
        # Keep the FIFO from growing without bound when most evictions are by age or reuse.
        if len(self._fifo) > 2 * self._table.count + 1024:
            self._fifo = deque((s, q) for s, q in self._fifo if self._alive(s, q))
        return evicted

    # ---------------------------------------------------------------------------------- sampling
    def sample(
        self,
        batch_size: int,
        device: torch.device | str | None = None,
        generator: torch.Generator | None = None,
    ) -> ReplayBatch:
        """Draw `batch_size` rollouts (with replacement) through the sampler; padded, on `device`."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if self._table.count == 0:
            raise ValueError("cannot sample: the buffer is empty")
        slots, weights = self.sampler.sample(batch_size, generator)
        batch = self._gather(slots, weights, torch.zeros(batch_size, dtype=torch.bool))
        self._counters["sampled_replay"] += batch_size
        self._counters["sample_calls"] += 1
        self._record_use(slots, weights)
        return batch if device is None else batch.to(device)

    def compose(
        self,
        fresh: Any,
        replay_ratio: float,
        device: torch.device | str | None = None,
        generator: torch.Generator | None = None,
    ) -> ReplayBatch:
        """Fresh-anchored batch: all of `fresh`, plus replayed rollouts making up `replay_ratio` of
        the result (0 <= replay_ratio < 1). Replayed rollouts are drawn before `fresh` is added, so
        they are never the fresh ones; `fresh` is then stored, and its use counts towards max_reuse.
        Fresh rollouts get IS weight 1."""
        if isinstance(replay_ratio, bool) or not isinstance(replay_ratio, (int, float)) or not (
            0 <= replay_ratio < 1
        ):
            raise ValueError(f"replay_ratio must be a number in [0, 1), got {replay_ratio!r}")
        packed = validate_batch(fresh, self.fields)
        self._check_admissible(packed)
        n_replay = round(packed.n * replay_ratio / (1 - replay_ratio)) if self._table.count else 0
        replay_slots, replay_weights = (
            self.sampler.sample(n_replay, generator) if n_replay else (torch.empty(0, dtype=torch.int64),
                                                                       torch.empty(0))
        )
        replayed = self._gather(replay_slots, replay_weights, torch.zeros(n_replay, dtype=torch.bool)) if n_replay \
            else None
        if replayed is not None:
            self._record_use(replay_slots, replay_weights, evict=False)
        handles = self._store(packed)
        fresh_batch = self._gather(handles.slot, torch.ones(packed.n), torch.ones(packed.n, dtype=torch.bool))
        self._record_use(handles.slot, None, evict=False)
        # Reuse eviction after both parts are gathered: a replayed slot freed now could otherwise
        # have been handed to a fresh rollout in the same call.
        self._evict_overused(torch.cat([replay_slots, handles.slot]))
        self._counters["sampled_fresh"] += packed.n
        self._counters["sample_calls"] += 1
        self._counters["sampled_replay"] += n_replay
        out = fresh_batch if replayed is None else _concat(fresh_batch, replayed, self)
        return out if device is None else out.to(device)

    def _record_use(self, slots: torch.Tensor, weights: torch.Tensor | None, evict: bool = True) -> None:
        if weights is not None and weights.numel():
            w = weights.double()
            self._last_ess = float(w.sum() ** 2 / (w.pow(2).sum() * w.numel()))
        self._table.reuse.index_put_((slots,), torch.ones_like(slots), accumulate=True)
        if evict:
            self._evict_overused(slots)

    def _evict_overused(self, slots: torch.Tensor) -> None:
        if self.max_reuse is None or slots.numel() == 0:
            return
        unique = torch.unique(slots)
        over = unique[(self._table.reuse[unique] >= self.max_reuse) & self._table.live[unique]]
        self._evict(over, "reuse")

    def _gather(self, slots: torch.Tensor, weights: torch.Tensor, is_fresh: torch.Tensor) -> ReplayBatch:
        t = self._table
        n = slots.numel()
        lengths = torch.empty(n, dtype=torch.int64)
        chunk_of = t.chunk[slots]
        rows = t.row[slots]
        for chunk_id in torch.unique(chunk_of).tolist():
            at = (chunk_of == chunk_id).nonzero().flatten()
            offsets = self._chunks[chunk_id].batch.offsets
            lengths[at] = offsets[rows[at] + 1] - offsets[rows[at]]
        width = int(lengths.max()) if n else 0
        positions = torch.arange(width)
        if self.padding_side == "right":
            valid = positions[None, :] < lengths[:, None]
            shift = torch.zeros(n, dtype=torch.int64)
        else:
            shift = width - lengths
            valid = positions[None, :] >= shift[:, None]
        data: dict[str, torch.Tensor] = {}
        for name, spec in self.fields.items():
            if spec.kind != TOKEN or (not spec.required and not self._stored(name)):
                continue
            fill = self.pad_token_id if name == "tokens" else 0
            data[name] = torch.full((n, width, *spec.shape), fill, dtype=spec.dtype)
        extra_rollout = {name: spec for name, spec in self.fields.items()
                         if spec.kind == ROLLOUT and name not in _TABLE_FIELDS and self._stored(name)}
        for name, spec in extra_rollout.items():
            data[name] = torch.zeros((n, *spec.shape), dtype=spec.dtype)
        for chunk_id in torch.unique(chunk_of).tolist():
            at = (chunk_of == chunk_id).nonzero().flatten()
            batch = self._chunks[chunk_id].batch
            starts = batch.offsets[rows[at]]
            src = starts[:, None] + positions[None, :] - shift[at][:, None]
            ok = valid[at]
            src = torch.where(ok, src, starts[:, None])  # any in-bounds index; masked out below
            for name, values in batch.token.items():
                if name not in data:
                    continue
                picked = values[src]
                mask = ok.reshape(*ok.shape, *([1] * (picked.dim() - 2)))
                data[name][at] = torch.where(mask, picked, data[name][at])
            for name in extra_rollout:
                if name in batch.rollout:
                    data[name][at] = batch.rollout[name][rows[at]]
        data["attention_mask"] = valid
        for name in _TABLE_FIELDS:
            data[name] = getattr(t, name)[slots].clone()
        return ReplayBatch(
            data=data,
            handles=Handles(slots.clone(), t.generation[slots].clone()),
            weights=weights.to(torch.float32),
            age=t.version - t.policy_version[slots],
            reuse=t.reuse[slots].clone(),
            is_fresh=is_fresh,
        )

    def _stored(self, name: str) -> bool:
        """Whether any live chunk holds the optional field `name`."""
        return any(name in c.batch.token or name in c.batch.rollout for c in self._chunks.values())

    # -------------------------------------------------------------------------------- priorities
    def update_priorities(self, handles: Handles, advantages: torch.Tensor) -> int:
        """Set new advantages for still-live handles. Handles whose rollout was evicted or whose slot
        was reused are ignored and counted (`stale_handle_updates`). Returns how many applied."""
        if not isinstance(handles, Handles):
            raise TypeError(f"handles must be Handles (from add/sample), got {type(handles).__name__}")
        if not isinstance(advantages, torch.Tensor) or not advantages.is_floating_point():
            raise TypeError("advantages must be a floating-point tensor")
        advantages = advantages.detach().cpu().to(torch.float32).reshape(-1)
        if advantages.numel() != len(handles):
            raise ValueError(f"advantages has {advantages.numel()} values for {len(handles)} handles")
        bad = ~torch.isfinite(advantages)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"advantages[{i}] must be finite, got {float(advantages[i])}")
        slot = handles.slot.cpu()
        if slot.numel() and (int(slot.min()) < 0 or int(slot.max()) >= self.capacity):
            raise ValueError(f"handles.slot outside [0, {self.capacity})")
        t = self._table
        current = t.live[slot] & (t.generation[slot] == handles.generation.cpu())
        self._counters["stale_handle_updates"] += int((~current).sum())
        slot, advantages = slot[current], advantages[current]
        t.advantage[slot] = advantages  # last occurrence wins for repeated handles
        if slot.numel():
            self.sampler.on_priority(torch.unique(slot))
        return int(current.sum())

    # ----------------------------------------------------------------------------------- metrics
    def metrics(self) -> dict[str, float]:
        """A flat dict of numbers for a logger: size, bytes, capacity, age and reuse histograms,
        the effective sample size of the last IS weights (fraction of the batch), evictions by
        reason, stale-handle updates, sampled fresh/replay counts."""
        t = self._table
        live = t.live
        ages = (t.version - t.policy_version[live]).clamp(min=0)
        reuse = t.reuse[live]
        out: dict[str, float] = {
            "size": t.count,
            "capacity": self.capacity,
            "bytes": self._bytes,
            "policy_version": t.version,
            "ess_fraction": self._last_ess,
            "age_mean": float(ages.double().mean()) if ages.numel() else 0.0,
            "age_max": int(ages.max()) if ages.numel() else 0,
            "reuse_mean": float(reuse.double().mean()) if reuse.numel() else 0.0,
        }
        for lo, hi in ((0, 0), (1, 1), (2, 3), (4, 7), (8, None)):
            key = f"age_hist_{lo}" if lo == hi else (f"age_hist_{lo}_{hi}" if hi else f"age_hist_{lo}_plus")
            sel = (ages >= lo) if hi is None else ((ages >= lo) & (ages <= hi))
            out[key] = int(sel.sum())
        for lo, hi in ((0, 0), (1, 1), (2, 3), (4, None)):
            key = f"reuse_hist_{lo}" if lo == hi else (f"reuse_hist_{lo}_{hi}" if hi else f"reuse_hist_{lo}_plus")
            sel = (reuse >= lo) if hi is None else ((reuse >= lo) & (reuse <= hi))
            out[key] = int(sel.sum())
        out.update(self._counters)
        return out

    # ------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: tensors and plain Python values (no pickle)."""
        t = self._table
        return {
            "format_version": _STATE_VERSION,
            "config": self._config(),
            "table": {name: getattr(t, name).clone() for name in _SlotTable.TENSORS},
            "version": t.version,
            "count": t.count,
            "chunks": {
                str(cid): {"offsets": c.batch.offsets, "token": dict(c.batch.token),
                           "rollout": dict(c.batch.rollout), "live_rows": c.live_rows}
                for cid, c in self._chunks.items()
            },
            "next_chunk": self._next_chunk,
            "next_seq": self._next_seq,
            "free": torch.tensor(self._free, dtype=torch.int64),
            "fifo": torch.tensor(list(self._fifo), dtype=torch.int64).reshape(-1, 2),
            "by_version": {str(v): torch.tensor(b, dtype=torch.int64).reshape(-1, 2)
                           for v, b in self._by_version.items()},
            "counters": dict(self._counters),
            "last_ess": self._last_ess,
            "sampler": self.sampler.state_dict(),
        }

    def _config(self) -> dict[str, Any]:
        return {"capacity": self.capacity, "max_staleness": self.max_staleness, "max_reuse": self.max_reuse,
                "overflow": self.overflow, "padding_side": self.padding_side, **self._schema_args}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from `state_dict()`. Validates before changing anything."""
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a mapping, got {type(state).__name__}")
        if state.get("format_version") != _STATE_VERSION:
            raise ValueError(f"state format_version {state.get('format_version')!r} != {_STATE_VERSION}")
        if state.get("config") != self._config():
            raise ValueError(f"state config {state.get('config')} does not match this buffer {self._config()}")
        table = state["table"]
        for name in _SlotTable.TENSORS:
            ref = getattr(self._table, name)
            value = table.get(name)
            if not isinstance(value, torch.Tensor) or value.shape != ref.shape or value.dtype != ref.dtype:
                raise ValueError(f"state table[{name!r}] must be a {ref.dtype} tensor of shape {tuple(ref.shape)}")
        live = table["live"]
        chunk_ids = {int(c) for c in state["chunks"]}
        if not set(table["chunk"][live].tolist()) <= chunk_ids:
            raise ValueError("state: a live slot names a chunk that is not in the state")
        if int(live.sum()) != int(state["count"]):
            raise ValueError("state: count disagrees with the live mask")
        new_table = _SlotTable(self.capacity)
        for name in _SlotTable.TENSORS:
            setattr(new_table, name, table[name].clone())
        new_table.version = int(state["version"])
        new_table.count = int(state["count"])
        chunks = {}
        for cid, c in state["chunks"].items():
            batch = PackedBatch(n=c["offsets"].numel() - 1, offsets=c["offsets"], token=dict(c["token"]),
                                rollout=dict(c["rollout"]))
            chunks[int(cid)] = _Chunk(batch, int(c["live_rows"]))
        old = (self._table, self._chunks)
        self._table, self._chunks = new_table, chunks
        try:
            self.sampler.bind(new_table)
            self.sampler.load_state_dict(state["sampler"])
        except Exception:
            self._table, self._chunks = old
            self.sampler.bind(self._table)
            raise
        self._next_chunk = int(state["next_chunk"])
        self._next_seq = int(state["next_seq"])
        self._free = state["free"].tolist()
        self._fifo = deque(tuple(p) for p in state["fifo"].tolist())
        self._by_version = {int(v): [tuple(p) for p in b.tolist()] for v, b in state["by_version"].items()}
        self._version_heap = sorted(self._by_version)
        self._counters = dict(state["counters"])
        self._last_ess = float(state["last_ess"])
        self._bytes = sum(c.nbytes() for c in self._chunks.values())

    def to(self, device: torch.device | str) -> "RolloutBuffer":
        """Move the sampler's priority tree to `device` (CPU or CUDA); payloads stay in host memory
        and are moved per batch by `sample(device=...)`."""
        self.sampler.to(device)
        return self


def _concat(first: ReplayBatch, second: ReplayBatch, buffer: RolloutBuffer) -> ReplayBatch:
    """Stack two padded batches, re-padding token fields to the wider of the two."""
    width = max(first.tokens.shape[1], second.tokens.shape[1])
    data = {}
    for name, a in first.data.items():
        b = second.data[name]
        if a.dim() >= 2 and name in buffer.fields and buffer.fields[name].kind == TOKEN or name == "attention_mask":
            fill = buffer.pad_token_id if name == "tokens" else 0
            a, b = (_pad_to(x, width, fill, buffer.padding_side) for x in (a, b))
        data[name] = torch.cat([a, b])
    return ReplayBatch(
        data=data,
        handles=Handles(torch.cat([first.handles.slot, second.handles.slot]),
                        torch.cat([first.handles.generation, second.handles.generation])),
        weights=torch.cat([first.weights, second.weights]),
        age=torch.cat([first.age, second.age]),
        reuse=torch.cat([first.reuse, second.reuse]),
        is_fresh=torch.cat([first.is_fresh, second.is_fresh]),
    )


def _pad_to(x: torch.Tensor, width: int, fill: int, side: str) -> torch.Tensor:
    extra = width - x.shape[1]
    if extra == 0:
        return x
    pad = torch.full((x.shape[0], extra, *x.shape[2:]), fill, dtype=x.dtype)
    return torch.cat([x, pad] if side == "right" else [pad, x], dim=1)
