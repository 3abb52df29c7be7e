"""RolloutBuffer: rollout-level, advantage-prioritized, staleness-bounded replay."""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import torch

from concurrent.futures import Future, ThreadPoolExecutor

from torchreplay._ops import ops
from torchreplay.errors import SchemaError, StorageError
from torchreplay.samplers import PrioritizedSampler, Sampler
from torchreplay.schema import ROLLOUT, TOKEN, FieldSpec, PackedBatch, default_fields, validate_batch
from torchreplay.storage import CorruptRows, TieredStorage
from torchreplay.storage.tiered import ranges, row_base

if TYPE_CHECKING:
    from torchreplay.checkpoint import Checkpointer

# Per-rollout fields the slot table holds for samplers and metrics; everything else lives in chunks.
_TABLE_FIELDS = ("advantage", "reward", "group_id", "policy_version", "prompt_len")
EVICTION_REASONS = ("staleness", "reuse", "capacity", "corrupt")
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
class _Plan:
    """What a batch will hold, snapshotted on the trainer thread so that materializing it (padding,
    cold reads) can run on a prefetch thread while the buffer moves on."""

    slots: torch.Tensor
    weights: torch.Tensor
    is_fresh: torch.Tensor
    shard_of: torch.Tensor
    rows: torch.Tensor
    meta: dict[str, torch.Tensor]
    generation: torch.Tensor
    age: torch.Tensor
    reuse: torch.Tensor
    shards: list
    fields: list[str]
    reuse_output: bool = False
    device: torch.device | None = None  # assemble on the storage's device (see TieredStorage(device=))
    ready: Any = None  # CUDA event recorded after a device batch's last kernel (see PendingBatch)


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
        storage: where rollout bytes live (default: hot-only, in host RAM). See TieredStorage.
        checkpoint: a Checkpointer: shards and manifests go to object storage in the background.
        token_dtype: torch.int64 (default) or torch.int32, the dtype token ids are stored and
            returned in; int32 halves the bytes of the largest field.
        seed: seeds the buffer's own generator, used when `sample`/`compose` get none (its state
            is part of state_dict and checkpoints).
        on_corrupt: when stored rollouts cannot be read back intact (checksum mismatch, vanished
            file), they are evicted and counted (`evicted_corrupt`) and never returned; then
            "raise" raises StorageError from that `sample` call, "skip" redraws the batch.
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
        storage: TieredStorage | None = None,
        on_corrupt: str = "raise",
        checkpoint: "Checkpointer | None" = None,
        seed: int | None = None,
        token_dtype: torch.dtype = torch.int64,
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
        if on_corrupt not in ("raise", "skip"):
            raise ValueError(f"on_corrupt must be 'raise' or 'skip', got {on_corrupt!r}")
        if storage is not None and not isinstance(storage, TieredStorage):
            raise TypeError(f"storage must be a TieredStorage, got {type(storage).__name__}")
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
        self.capacity = capacity
        self.max_staleness = max_staleness
        self.max_reuse = max_reuse
        self.overflow = overflow
        self.padding_side = padding_side
        self.pad_token_id = int(pad_token_id)
        self.fields: dict[str, FieldSpec] = default_fields(ref_logprobs, routing, extra_fields, token_dtype)
        self._schema_args = {"ref_logprobs": ref_logprobs, "routing": list(routing) if routing else None,
                             "token_dtype": str(token_dtype).removeprefix("torch."),
                             "extra_fields": sorted(extra_fields or {})}
        self.sampler: Sampler = sampler if sampler is not None else PrioritizedSampler()
        if not isinstance(self.sampler, Sampler):
            raise TypeError(f"sampler must implement the Sampler protocol, got {type(self.sampler).__name__}")
        self._table = _SlotTable(capacity)
        self.sampler.bind(self._table)
        self.storage = storage if storage is not None else TieredStorage()
        self.generator = torch.Generator()
        self.generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,))))
        self.on_corrupt = on_corrupt
        self._prefetcher: ThreadPoolExecutor | None = None
        self._prefetch_stream: torch.cuda.Stream | None = None  # see _materialize_ahead
        self._arenas: dict[str, torch.Tensor] = {}
        self._next_seq = 0
        # Free slots as a stack: the lowest slot is reused first, deterministically.
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self._fifo: deque[tuple[int, int]] = deque()  # (slot, seq) in insertion order
        self._by_version: dict[int, list[tuple[int, int]]] = {}
        self._version_heap: list[int] = []
        self._version_entries = 0  # entries across all _by_version buckets, dead ones included
        # Version buckets serve staleness eviction only; without a staleness cap they are not kept
        # (and are built from the slot table if a cap is set later).
        self._tracking_versions = max_staleness is not None
        self._counters: dict[str, float] = {f"evicted_{r}": 0 for r in EVICTION_REASONS}
        self._counters.update(stale_handle_updates=0, sampled_fresh=0, sampled_replay=0, added=0, sample_calls=0)
        self._last_ess = math.nan
        self.checkpointer = None
        if checkpoint is not None:
            from torchreplay.checkpoint import Checkpointer

            if not isinstance(checkpoint, Checkpointer):
                raise TypeError(f"checkpoint must be a Checkpointer, got {type(checkpoint).__name__}")
            self.checkpointer = checkpoint
            checkpoint.attach(self)

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
        self._tick()
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
        # Table-held per-rollout fields are not kept twice.
        chunk_id = self._put_shard(PackedBatch(
            n=n, offsets=packed.offsets, token=packed.token,
            rollout={k: v for k, v in packed.rollout.items() if k not in _TABLE_FIELDS},
        ))
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
        if self._tracking_versions:
            for slot, s, v in zip(slots.tolist(), seq.tolist(), packed.rollout["policy_version"].tolist()):
                bucket = self._by_version.get(v)
                if bucket is None:
                    bucket = self._by_version[v] = []
                    heapq.heappush(self._version_heap, v)
                bucket.append((slot, s))
            self._version_entries += n
        # Evicted entries are skipped lazily; drop them once they outnumber the live ones, so the
        # orders stay O(capacity) whether or not advance() is ever called.
        bound = 2 * t.count + 1024
        if len(self._fifo) > bound or self._version_entries > bound:
            self._rebuild_orders()
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
        shard_ids, counts = torch.unique(t.chunk[slots], return_counts=True)
        for shard_id, count in zip(shard_ids.tolist(), counts.tolist()):
            self._release_shard(shard_id, count)
        t.chunk[slots] = -1
        self._free.extend(reversed(slots.tolist()))
        self._counters[f"evicted_{reason}"] += slots.numel()

    def _evict_oldest(self, k: int) -> None:
        victims: list[torch.Tensor] = []
        found = 0
        t = self._table
        while found < k:
            # Check FIFO entries in vectorized chunks; dead entries (evicted earlier) are dropped.
            take = min(len(self._fifo), max(2 * (k - found), 64))
            chunk = torch.tensor([self._fifo.popleft() for _ in range(take)], dtype=torch.int64)
            alive = t.live[chunk[:, 0]] & (t.seq[chunk[:, 0]] == chunk[:, 1])
            alive_rows = alive.nonzero().flatten()
            need = k - found
            if alive_rows.numel() > need:
                cut = int(alive_rows[need])
                self._fifo.extendleft(reversed([tuple(p) for p in chunk[cut:].tolist()]))
                alive_rows = alive_rows[:need]
            victims.append(chunk[alive_rows, 0])
            found += alive_rows.numel()
        self._evict(torch.cat(victims), "capacity")

    def advance(self, policy_version: int) -> int:
        """Set the current policy version; evict rollouts older than `max_staleness` versions.

        Costs O(evicted + distinct versions dropped). Returns the number evicted.
        """
        if isinstance(policy_version, bool) or not isinstance(policy_version, int):
            raise TypeError(f"policy_version must be an int, got {type(policy_version).__name__}")
        if policy_version < self.version:
            raise ValueError(f"policy_version must not go backwards: {policy_version} < current {self.version}")
        self._tick()
        self._table.version = policy_version
        evicted = 0
        if self.max_staleness is not None:
            if not self._tracking_versions:
                self._tracking_versions = True
                self._rebuild_orders()
            floor = policy_version - self.max_staleness
            victims: list[int] = []
            while self._version_heap and self._version_heap[0] < floor:
                version = heapq.heappop(self._version_heap)
                bucket = self._by_version.pop(version)
                self._version_entries -= len(bucket)
                victims.extend(slot for slot, seq in bucket if self._alive(slot, seq))
            evicted = len(victims)
            self._evict(torch.tensor(victims, dtype=torch.int64), "staleness")
        self.sampler.on_advance(policy_version)
        for shard_id in self.storage.compaction_candidates():
            self._compact(shard_id)
        return evicted

    def _rebuild_orders(self) -> None:
        """The insertion FIFO and the per-version buckets, from the slot table alone: live slots in
        insertion (seq) order. Lazily skipped dead entries are all they ever add, so this is how
        they are compacted, and how a restored buffer gets them back without checkpointing them
        (converting millions of tuples on the trainer thread made every snapshot slow)."""
        t = self._table
        live = t.live.nonzero().flatten()
        order = live[torch.argsort(t.seq[live])]
        self._fifo = deque(zip(order.tolist(), t.seq[order].tolist()))
        self._by_version = {}
        if self._tracking_versions:
            # Group by version with tensor ops (a stable sort keeps seq order inside each version).
            by_version = order[torch.sort(t.policy_version[order], stable=True).indices]
            versions, counts = torch.unique_consecutive(t.policy_version[by_version], return_counts=True)
            for version, part in zip(versions.tolist(), torch.split(by_version, counts.tolist())):
                self._by_version[version] = list(zip(part.tolist(), t.seq[part].tolist()))
        self._version_heap = sorted(self._by_version)
        self._version_entries = sum(len(b) for b in self._by_version.values())

    def _compact(self, shard_id: int) -> None:
        """Rewrite a mostly dead shard's live rows into a new shard, so its file and memory go."""
        t = self._table
        slots = ((t.chunk == shard_id) & t.live).nonzero().flatten()
        shard = self.storage.shard(shard_id)
        self.storage.pin_shards([shard_id])
        try:
            batch, index = self.storage.fetch(shard, t.row[slots], list(shard.token_fields))
        except CorruptRows as exc:
            self.storage.unpin_shards([shard])
            self._evict_corrupt_quietly(exc)
            return
        self.storage.unpin_shards([shard])
        new_id = self._put_shard(_subset(batch, index))
        t.chunk[slots] = new_id
        t.row[slots] = torch.arange(slots.numel())
        self._release_shard(shard_id, slots.numel())
        self.storage.counters["compactions"] += 1

    def _evict_corrupt_quietly(self, exc: CorruptRows) -> None:
        try:
            self._evict_corrupt(exc)
        except StorageError:
            pass

    # ---------------------------------------------------------------------------------- sampling
    def _check_batch_size(self, batch_size: int) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if self._table.count == 0:
            raise ValueError("cannot sample: the buffer is empty")

    def sample(
        self,
        batch_size: int,
        device: torch.device | str | None = None,
        generator: torch.Generator | None = None,
        reuse_output: bool = False,
    ) -> ReplayBatch:
        """Draw `batch_size` rollouts (with replacement) through the sampler; padded, on `device`.

        `reuse_output=True` writes the padded token fields into buffers kept across calls (much
        faster for large batches); the returned tensors are then valid only until the next
        `sample(..., reuse_output=True)`: copy or consume them first (moving to a device copies)."""
        return self.sample_async(batch_size, device, generator, _inline=True, _reuse=reuse_output).result()

    def sample_async(
        self,
        batch_size: int,
        device: torch.device | str | None = None,
        generator: torch.Generator | None = None,
        _inline: bool = False,
        _reuse: bool = False,
    ) -> "PendingBatch":
        """Like `sample`, but cold rollouts are paged in and padded on a prefetch thread while the
        caller trains on the previous batch. Which rollouts are drawn (and their reuse counts) is
        decided now, on the calling thread, so results match `sample` for the same generator.
        Call `.result()` on the returned object from the thread that owns the buffer."""
        self._check_batch_size(batch_size)
        self._tick()
        generator = generator if generator is not None else self.generator
        slots, weights = self.sampler.sample(batch_size, generator)
        plan = self._plan(slots, weights, torch.zeros(batch_size, dtype=torch.bool))
        plan.reuse_output = _reuse
        plan.device = self._assembly_device(device)
        self._counters["sampled_replay"] += batch_size
        self._counters["sample_calls"] += 1
        self._record_use(slots, weights)
        if _inline:
            future: Future = Future()
            try:
                future.set_result(self._materialize(plan))
            except BaseException as exc:  # noqa: BLE001 - handed to PendingBatch.result
                future.set_exception(exc)
        else:
            if self._prefetcher is None:
                self._prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchreplay-prefetch")
            future = self._prefetcher.submit(self._materialize_ahead, plan)
        return PendingBatch(self, future, device, (batch_size, generator), plan)

    def gather(self, slots: torch.Tensor, count_use: bool = True, weights: torch.Tensor | None = None,
               device: torch.device | str | None = None) -> ReplayBatch:
        """Read the given live slots as a padded batch (e.g. slots chosen by another rank's draw).

        With `count_use` their reuse counts go up and the reuse cap applies, as for `sample`.
        Unreadable rollouts are evicted and raise StorageError."""
        if not isinstance(slots, torch.Tensor) or slots.dtype != torch.int64 or slots.dim() != 1:
            raise TypeError("slots must be a 1-D int64 tensor")
        slots = slots.cpu()
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= self.capacity):
            raise ValueError(f"slots outside [0, {self.capacity})")
        if not bool(self._table.live[slots].all()):
            raise ValueError("slots must name live rollouts")
        n = slots.numel()
        w = torch.ones(n) if weights is None else weights
        plan = self._plan(slots, w, torch.zeros(n, dtype=torch.bool))
        plan.device = self._assembly_device(device)
        try:
            batch = self._materialize(plan)
        except CorruptRows as exc:
            self._evict_corrupt(exc, always_raise=True)
        if count_use:
            self._record_use(slots, weights)
        return batch if device is None else batch.to(device)

    def prefetching(
        self, batch_size: int, steps: int | None = None, device: torch.device | str | None = None,
        generator: torch.Generator | None = None,
    ) -> Iterator[ReplayBatch]:
        """Iterate batches with the next one always in flight (sample-ahead)."""
        pending = self.sample_async(batch_size, device, generator)
        taken = 0
        while steps is None or taken < steps:
            batch = pending.result()
            taken += 1
            if steps is None or taken < steps:
                pending = self.sample_async(batch_size, device, generator)
            yield batch

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
        Fresh rollouts get IS weight 1. If replayed rollouts turn out unreadable (see `on_corrupt`)
        and the error is raised, `fresh` has not been added."""
        if isinstance(replay_ratio, bool) or not isinstance(replay_ratio, (int, float)) or not (
            0 <= replay_ratio < 1
        ):
            raise ValueError(f"replay_ratio must be a number in [0, 1), got {replay_ratio!r}")
        packed = validate_batch(fresh, self.fields)
        self._check_admissible(packed)
        self._tick()
        generator = generator if generator is not None else self.generator
        replayed = None
        replay_slots = torch.empty(0, dtype=torch.int64)
        n_replay = round(packed.n * replay_ratio / (1 - replay_ratio))
        while n_replay and self._table.count and replayed is None:
            replay_slots, replay_weights = self.sampler.sample(n_replay, generator)
            plan = self._plan(replay_slots, replay_weights, torch.zeros(n_replay, dtype=torch.bool))
            try:
                replayed = self._materialize(plan)
            except CorruptRows as exc:
                self._evict_corrupt(exc)  # then redraw ("skip") or raise
                continue
            self._record_use(replay_slots, replay_weights, evict=False)
        if replayed is None:
            replay_slots = torch.empty(0, dtype=torch.int64)
        handles = self._store(packed)
        fresh_batch = self._materialize(
            self._plan(handles.slot, torch.ones(packed.n), torch.ones(packed.n, dtype=torch.bool)))
        self._record_use(handles.slot, None, evict=False)
        # Reuse eviction after both parts are gathered: a replayed slot freed now could otherwise
        # have been handed to a fresh rollout in the same call.
        self._evict_overused(torch.cat([replay_slots, handles.slot]))
        self._counters["sampled_fresh"] += packed.n
        self._counters["sample_calls"] += 1
        self._counters["sampled_replay"] += replay_slots.numel()
        out = fresh_batch if replayed is None else _concat(fresh_batch, replayed, self)
        return out if device is None else out.to(device)

    def _evict_corrupt(self, exc: CorruptRows, always_raise: bool = False) -> None:
        """Evict the live rollouts stored in the unreadable rows; raise unless on_corrupt='skip'
        (a caller that asked for specific slots always gets the error)."""
        t = self._table
        in_shard = (t.chunk == exc.shard_id) & t.live
        hit = in_shard.nonzero().flatten()
        hit = hit[torch.isin(t.row[hit], torch.tensor(exc.rows, dtype=torch.int64))]
        self._evict(hit, "corrupt")
        self.storage.counters["corrupt_rows"] += hit.numel()
        if always_raise or self.on_corrupt == "raise" or self._table.count == 0:
            raise StorageError(f"{exc}; {hit.numel()} rollout(s) evicted, the rest of the buffer is intact") from exc

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

    def _plan(self, slots: torch.Tensor, weights: torch.Tensor, is_fresh: torch.Tensor) -> _Plan:
        """Snapshot what the batch needs and pin its shards (trainer thread)."""
        t = self._table
        shard_of = t.chunk[slots]
        shard_ids = torch.unique(shard_of).tolist()
        self.storage.pin_shards(shard_ids)
        fields = [name for name, spec in self.fields.items()
                  if spec.required or name in self.storage.optional_fields]
        return _Plan(
            slots=slots.clone(), weights=weights.to(torch.float32), is_fresh=is_fresh, shard_of=shard_of,
            rows=t.row[slots], meta={name: getattr(t, name)[slots].clone() for name in _TABLE_FIELDS},
            generation=t.generation[slots].clone(), age=t.version - t.policy_version[slots],
            reuse=t.reuse[slots].clone(), shards=[self.storage.shard(s) for s in shard_ids], fields=fields,
        )

    def _assembly_device(self, device: torch.device | str | None) -> torch.device | None:
        """The storage's device if a batch bound for `device` should be put together there (device
        tier copies and staged cold reads land there); None to assemble in host memory."""
        home = self.storage.device
        if device is None or home is None:
            return None
        wanted = torch.device(device)
        if wanted.type == "cuda" and wanted.index is None:
            wanted = torch.device("cuda", torch.cuda.current_device())
        return home if wanted == home else None

    def _materialize(self, plan: _Plan) -> ReplayBatch:
        """Page in and pad (any thread; touches only the plan and pinned, immutable shards)."""
        try:
            batch = self._pad(plan)
            if plan.device is not None and plan.device.type == "cuda":
                plan.ready = torch.cuda.Event()
                plan.ready.record(torch.cuda.current_stream(plan.device))
            return batch
        finally:
            self.storage.unpin_shards(plan.shards)

    def _materialize_ahead(self, plan: _Plan) -> ReplayBatch:
        """`_materialize` on the prefetch thread. A CUDA batch is built on a stream of its own: on
        the default stream its kernels (and the sync before a staged read) would queue behind the
        trainer's whole step; PendingBatch.result hands it over with an event."""
        if plan.device is None or plan.device.type != "cuda":
            return self._materialize(plan)
        if self._prefetch_stream is None:
            self._prefetch_stream = torch.cuda.Stream(plan.device)
        with torch.cuda.stream(self._prefetch_stream):
            return self._materialize(plan)

    def _output(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, reuse: bool) -> torch.Tensor:
        """An uninitialized padded output (every element is written by pad_rows). With `reuse`, a
        view of a per-field arena kept across calls: writing into warm memory instead of freshly
        faulted pages is most of the cost of a large batch."""
        if not reuse:
            return torch.empty(shape, dtype=dtype)
        need = math.prod(shape)
        arena = self._arenas.get(name)
        if arena is None or arena.numel() < need or arena.dtype != dtype:
            arena = torch.empty(need, dtype=dtype, pin_memory=self.storage.pin)
            self._arenas[name] = arena
        return arena[:need].view(shape)

    def _pad(self, plan: _Plan) -> ReplayBatch:
        n = plan.slots.numel()
        token_fields = [f for f in plan.fields if self.fields[f].kind == TOKEN]
        gather = self.storage.fetch_slots(plan.shards, plan.shard_of, plan.rows, token_fields, plan.device)
        sources, source, index = gather.sources, gather.source, gather.index
        # Per row: where its tokens start in its source and how many there are, from the sources'
        # offsets laid end to end (each source has n + 1 of them).
        offsets = torch.cat([b.offsets for b in sources]) if sources else torch.zeros(1, dtype=torch.int64)
        at = row_base(sources, 1)[source] + index
        starts = offsets[at]
        lengths = offsets[at + 1] - starts
        width = int(lengths.max()) if n else 0
        left = self.padding_side == "left"
        if plan.device is not None:
            data = self._pad_on_device(plan.device, gather, starts, lengths, width, token_fields)
            return self._finish(plan, sources, source, index, data)
        dest = torch.arange(n)
        # The mask is a padded copy of an all-True row: the same one-pass op, into a reusable arena.
        valid = self._output("attention_mask", (n, width), torch.bool, plan.reuse_output)
        ops.pad_rows([torch.ones(width, dtype=torch.bool)], torch.zeros(n, dtype=torch.int64),
                     torch.zeros(n, dtype=torch.int64), lengths, dest, valid, left, False)
        data: dict[str, torch.Tensor] = {}
        for name in token_fields:
            spec = self.fields[name]
            fill = self.pad_token_id if name == "tokens" else 0
            out = self._output(name, (n, width, *spec.shape), spec.dtype, plan.reuse_output)
            values = [b.token.get(name) for b in sources]
            field_starts, field_lengths = starts, lengths
            if any(v is None for v in values):  # shards stored before this optional field existed: all padding
                missing = torch.tensor([v is None for v in values])[source]
                field_starts, field_lengths = starts.masked_fill(missing, 0), lengths.masked_fill(missing, 0)
                values = [torch.empty((0, *spec.shape), dtype=spec.dtype) if v is None else v for v in values]
            if n:
                ops.pad_rows(values, source, field_starts, field_lengths, dest, out, left, fill)
            data[name] = out
        data["attention_mask"] = valid
        return self._finish(plan, sources, source, index, data)

    def _finish(self, plan: _Plan, sources: list, source: torch.Tensor, index: torch.Tensor,
                data: dict[str, torch.Tensor]) -> ReplayBatch:
        """The padded token fields in `data`, plus rollout-level fields and the plan's bookkeeping."""
        n = plan.slots.numel()
        extra_rollout = [f for f in plan.fields if self.fields[f].kind == ROLLOUT and f not in _TABLE_FIELDS]
        rollout_rows = row_base(sources, 0)[source] + index if extra_rollout else None
        for name in extra_rollout:
            spec = self.fields[name]
            columns = [b.rollout.get(name) for b in sources]
            columns = [torch.zeros((b.n, *spec.shape), dtype=spec.dtype) if c is None else c
                       for b, c in zip(sources, columns)]
            data[name] = torch.cat(columns)[rollout_rows] if n else torch.zeros((0, *spec.shape), dtype=spec.dtype)
        data.update(plan.meta)
        return ReplayBatch(
            data=data,
            handles=Handles(plan.slots, plan.generation),
            weights=plan.weights,
            age=plan.age,
            reuse=plan.reuse,
            is_fresh=plan.is_fresh,
        )

    def _pad_on_device(self, device: torch.device, gather, starts: torch.Tensor, lengths: torch.Tensor, width: int,
                       token_fields: list[str]) -> dict[str, torch.Tensor]:
        """Padded token fields and the mask, on `device`. Rows whose source is on the device (tier
        copies, staged cold reads) are gathered there with index ops; the rest are padded in host
        memory by pad_rows, as without a device, and copied over in one transfer per field."""
        sources, source = gather.sources, gather.source
        n = source.numel()
        left = self.padding_side == "left"
        on_device = torch.tensor(gather.on_device, dtype=torch.bool)[source] if sources else torch.zeros(0, dtype=torch.bool)
        host_rows, device_rows = (~on_device).nonzero().flatten(), on_device.nonzero().flatten()
        pin = device.type == "cuda"
        column = torch.arange(width, device=device)
        lengths_there = lengths.to(device)
        pad = (width - lengths_there)[:, None] if left else None
        data = {"attention_mask": column >= pad if left else column < lengths_there[:, None]}
        device_row_there = device_rows.to(device)
        for name in token_fields:
            spec = self.fields[name]
            fill = self.pad_token_id if name == "tokens" else 0
            out = torch.full((n, width, *spec.shape), fill, dtype=spec.dtype, device=device)
            values = [b.token.get(name) for b in sources]
            missing = torch.tensor([v is None for v in values], dtype=torch.bool)[source] if sources else on_device
            field_lengths = lengths.masked_fill(missing, 0)
            if host_rows.numel():
                host_values = [torch.empty((0, *spec.shape), dtype=spec.dtype) if v is None or there else v
                               for v, there in zip(values, gather.on_device)]
                staged = torch.empty((host_rows.numel(), width, *spec.shape), dtype=spec.dtype, pin_memory=pin)
                ops.pad_rows(host_values, source[host_rows], starts[host_rows].masked_fill(missing[host_rows], 0),
                             field_lengths[host_rows], torch.arange(host_rows.numel()), staged, left, fill)
                out[host_rows.to(device)] = staged.to(device, non_blocking=pin)
            if device_rows.numel():
                # Only the sampled tokens move: one view per row, one cat, one scatter into place.
                # (Concatenating whole device shards would briefly double their VRAM per field.)
                src, first, count = (source[device_rows].tolist(), starts[device_rows].tolist(),
                                     field_lengths[device_rows].tolist())
                views = [values[i][a : a + c] for i, a, c in zip(src, first, count) if c]
                if views:
                    flat = torch.cat(views)
                    counts = field_lengths[device_rows].to(device)
                    total = flat.shape[0]
                    row = torch.repeat_interleave(device_row_there, counts, output_size=total)
                    first_col = width - counts if left else torch.zeros_like(counts)
                    out[row, ranges(first_col, first_col + counts, total)] = flat.to(spec.dtype)
            data[name] = out
        return data

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
            "bytes": self.storage.total_bytes(),
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
        out.update(self.storage.metrics())
        return out

    # ------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: tensors and plain Python values (no pickle)."""
        return {**self._metadata_state(), "chunks": self._chunk_states()}

    def _metadata_state(self) -> dict[str, Any]:
        """All state except rollout payloads: what a checkpoint snapshots on the trainer thread."""
        t = self._table
        return {
            "format_version": _STATE_VERSION,
            "config": self._config(),
            "table": {name: getattr(t, name).clone() for name in _SlotTable.TENSORS},
            "version": t.version,
            "count": t.count,
            "next_seq": self._next_seq,
            "free": torch.tensor(self._free, dtype=torch.int64),
            "counters": dict(self._counters),
            "last_ess": self._last_ess,
            "rng": self.generator.get_state(),
            "sampler": self.sampler.state_dict(),
        }

    def _live_shards(self) -> tuple[list[int], list[int]]:
        t = self._table
        ids, rows = torch.unique(t.chunk[t.live], return_counts=True)
        return ids.tolist(), rows.tolist()

    def _chunk_states(self) -> dict[str, Any]:
        out = {}
        for sid, live in zip(*self._live_shards()):
            b = self.storage.read_shard(sid)
            out[str(sid)] = {"offsets": b.offsets, "token": dict(b.token), "rollout": dict(b.rollout),
                             "live_rows": live}
        return out

    def _config(self) -> dict[str, Any]:
        return {"capacity": self.capacity, "max_staleness": self.max_staleness, "max_reuse": self.max_reuse,
                "overflow": self.overflow, "padding_side": self.padding_side, **self._schema_args}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from `state_dict()`. Validates before changing anything."""
        if not isinstance(state, Mapping) or not isinstance(state.get("chunks"), Mapping):
            raise TypeError("state must be a mapping from state_dict() (with 'chunks')")
        sizes = {}
        for cid, c in state["chunks"].items():
            offsets = c.get("offsets") if isinstance(c, Mapping) else None
            if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1 or offsets.dtype != torch.int64:
                raise ValueError(f"state chunk {cid}: offsets must be a 1-D int64 tensor")
            sizes[int(cid)] = offsets.numel() - 1

        def store_chunk(cid: int) -> int:
            c = state["chunks"][str(cid)]
            return self._put_shard(PackedBatch(n=sizes[cid], offsets=c["offsets"], token=dict(c["token"]),
                                               rollout=dict(c["rollout"])))

        self._load(state, sizes, store_chunk)

    def _load(self, state: Mapping[str, Any], chunk_rows: dict[int, int], store_chunk) -> None:
        """Validate `state` against this buffer and the stored chunks' row counts, then adopt it.
        `store_chunk(old id) -> new shard id` brings one chunk into storage."""
        if state.get("format_version") != _STATE_VERSION:
            raise ValueError(f"state format_version {state.get('format_version')!r} != {_STATE_VERSION}")
        if state.get("config") != self._config():
            raise ValueError(f"state config {state.get('config')} does not match this buffer {self._config()}")
        table = state.get("table")
        if not isinstance(table, Mapping):
            raise ValueError("state 'table' must be a mapping")
        for name in _SlotTable.TENSORS:
            ref = getattr(self._table, name)
            value = table.get(name)
            if not isinstance(value, torch.Tensor) or value.shape != ref.shape or value.dtype != ref.dtype:
                raise ValueError(f"state table[{name!r}] must be a {ref.dtype} tensor of shape {tuple(ref.shape)}")
        live = table["live"]
        if int(live.sum()) != int(state["count"]):
            raise ValueError("state: count disagrees with the live mask")
        live_chunks = table["chunk"][live]
        if not set(live_chunks.tolist()) <= set(chunk_rows):
            raise ValueError("state: a live slot names a chunk that is not stored")
        for cid, n in chunk_rows.items():
            rows_used = table["row"][live][live_chunks == cid]
            if rows_used.numel() and (int(rows_used.min()) < 0 or int(rows_used.max()) >= n):
                raise ValueError(f"state chunk {cid}: a live slot names a row outside its {n} rows")
        if not isinstance(state.get("free"), torch.Tensor) or state["free"].dtype != torch.int64:
            raise ValueError("state 'free' must be an int64 tensor")
        free = state["free"]
        if free.numel() and (int(free.min()) < 0 or int(free.max()) >= self.capacity or bool(live[free].any())):
            raise ValueError("state 'free' names a slot outside the buffer or a live one")
        if free.numel() + int(state["count"]) != self.capacity:
            raise ValueError("state: free slots + live rollouts != capacity")
        rng = state.get("rng")
        if not isinstance(rng, torch.Tensor) or rng.dtype != torch.uint8:
            raise ValueError("state 'rng' must be a uint8 generator state tensor")
        new_table = _SlotTable(self.capacity)
        for name in _SlotTable.TENSORS:
            setattr(new_table, name, table[name].clone())
        new_table.version = int(state["version"])
        new_table.count = int(state["count"])
        old_table, old_sampler_state = self._table, self.sampler.state_dict()
        self._table = new_table
        try:
            self.sampler.bind(new_table)
            self.sampler.load_state_dict(state["sampler"])
            self.generator.set_state(rng)
        except Exception:
            self._table = old_table
            self.sampler.bind(old_table)
            self.sampler.load_state_dict(old_sampler_state)
            raise
        # Committed: release what the buffer held, then store the chunks under new shard ids.
        for sid, count in zip(*torch.unique(old_table.chunk[old_table.live], return_counts=True)):
            self._release_shard(int(sid), int(count))
        remap: dict[int, int] = {}
        live_per_chunk = dict(zip(*(x.tolist() for x in torch.unique(live_chunks, return_counts=True))))
        for cid in sorted(set(live_chunks.tolist())):
            remap[cid] = store_chunk(cid)
            dead = chunk_rows[cid] - live_per_chunk[cid]
            if dead:
                self._release_shard(remap[cid], dead)
        live_slots = new_table.live.nonzero().flatten()
        new_table.chunk[live_slots] = torch.tensor([remap[c] for c in new_table.chunk[live_slots].tolist()],
                                                   dtype=torch.int64)
        new_table.chunk[~new_table.live] = -1
        self._next_seq = int(state["next_seq"])
        self._free = state["free"].tolist()
        self._rebuild_orders()
        self._counters = dict(state["counters"])
        self._last_ess = float(state["last_ess"])

    # -------------------------------------------------------------------------------- durability
    def _put_shard(self, batch: PackedBatch) -> int:
        sid = self.storage.put(batch)
        if self.checkpointer is not None:
            self.checkpointer.shard_sealed(sid)
        return sid

    def _release_shard(self, shard_id: int, rows: int) -> None:
        if self.storage.release(shard_id, rows) and self.checkpointer is not None:
            self.checkpointer.shard_released(shard_id)

    def _tick(self) -> None:
        """Surface background failures, and publish a manifest when one is due."""
        self.storage.check()
        if self.checkpointer is not None:
            self.checkpointer.check()
            self.checkpointer.maybe_publish()

    def checkpoint(self, timeout: float | None = None) -> None:
        """Publish a manifest now and return once it is durable."""
        if self.checkpointer is None:
            raise ValueError("this buffer has no checkpointer: pass checkpoint=Checkpointer(uri) to RolloutBuffer")
        self.checkpointer.publish(wait=True, timeout=timeout)

    @classmethod
    def from_checkpoint(
        cls,
        uri: str,
        *,
        endpoint_url: str | None = None,
        sampler: Sampler | None = None,
        storage: TieredStorage | None = None,
        checkpoint: "Checkpointer | bool" = False,
        lazy: bool = False,
        progress: bool = True,
        manifest: str | None = None,
        **kwargs: Any,
    ) -> "RolloutBuffer":
        """Restore a buffer from the last published manifest under `uri`.

        Slots, generations, advantages (priorities are recomputed from them), policy versions,
        reuse counts, sampler and RNG state come back exactly. Shards are fetched eagerly (with a
        progress bar) or, with `lazy=True` and a cold tier, on demand: only each shard's header
        and per-rollout fields are read at restore, its file is downloaded the first time a
        sample (or prefetch) needs its tokens.
        `checkpoint=True` keeps checkpointing to `uri` (a resumed job), or pass a Checkpointer.
        Built-in samplers are rebuilt from the manifest; a custom one must be passed as `sampler`.
        `manifest` names a specific manifest key (default: the newest, via LATEST).
        """
        from torchreplay.checkpoint.restore import restore

        return restore(cls, uri, endpoint_url=endpoint_url, sampler=sampler, storage=storage,
                       checkpoint=checkpoint, lazy=lazy, progress=progress, manifest_key=manifest, **kwargs)

    def import_checkpoint(self, uri: str, *, endpoint_url: str | None = None, version_offset: int = 0,
                          reprioritize=None, progress: bool = False, select=None,
                          keep_reuse: bool = False) -> Handles:
        """Seed this buffer with another run's rollouts (read-only: nothing there is changed).

        Policy versions are shifted by `version_offset`; `reprioritize(batch: dict) -> advantages`
        may replace their advantages (e.g. rescored by the current critic). `select(i, n)` takes
        only some of the checkpoint's n shards (e.g. one rank's share); `keep_reuse` carries use
        counts over. Returns the new rollouts' handles."""
        from torchreplay.checkpoint.restore import import_rollouts

        return import_rollouts(self, uri, endpoint_url=endpoint_url, version_offset=version_offset,
                               reprioritize=reprioritize, progress=progress, select=select, keep_reuse=keep_reuse)

    def close(self) -> None:
        """Finish background work (spills, prefetch), publish a final checkpoint, release files."""
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=True)
        try:
            if self.checkpointer is not None:
                self.checkpointer.close()
        finally:
            self.storage.close()

    def __enter__(self) -> "RolloutBuffer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def to(self, device: torch.device | str) -> "RolloutBuffer":
        """Move the sampler's priority tree to `device` (CPU or CUDA). Payloads stay where the
        storage keeps them (host RAM, disk, and a VRAM tier with TieredStorage(device_bytes=...));
        `sample(device=...)` puts each batch together there."""
        self.sampler.to(device)
        return self


class PendingBatch:
    """A batch being paged in. `result()` waits for it; if its rollouts turned out unreadable, they
    are evicted here (on the owner's thread) and, with on_corrupt='skip', a new batch is drawn."""

    def __init__(self, buffer: RolloutBuffer, future: Future, device, redraw: tuple, plan: _Plan) -> None:
        self._buffer, self._future, self._device, self._redraw, self._plan = buffer, future, device, redraw, plan

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> ReplayBatch:
        try:
            batch = self._future.result()
        except CorruptRows as exc:
            self._buffer._evict_corrupt(exc)  # raises unless on_corrupt == "skip"
            batch_size, generator = self._redraw
            return self._buffer.sample(batch_size, self._device, generator)
        ready = self._plan.ready
        if ready is not None:
            # The batch was put together on the prefetch thread's stream: the caller's stream waits
            # for it, and its memory is not reused while the caller's kernels may still read it.
            stream = torch.cuda.current_stream(self._plan.device)
            stream.wait_event(ready)
            for t in batch.data.values():
                if t.is_cuda:
                    t.record_stream(stream)
        return batch if self._device is None else batch.to(self._device)


def _subset(batch: PackedBatch, index: torch.Tensor) -> PackedBatch:
    """Rows `index` of a packed batch, as a new packed batch (row k = batch row index[k])."""
    starts, ends = batch.offsets[index], batch.offsets[index + 1]
    lengths = ends - starts
    offsets = torch.zeros(index.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    token_rows = ranges(starts, ends, int(offsets[-1]))
    return PackedBatch(n=index.numel(), offsets=offsets, token={k: v[token_rows] for k, v in batch.token.items()},
                       rollout={k: v[index] for k, v in batch.rollout.items()})


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
