"""RolloutBuffer: rollout-level, advantage-prioritized, staleness-bounded replay.

The buffer orchestrates: the SlotTable keeps slots and eviction orders, the sampler chooses,
the BatchAssembler pads, TieredStorage holds bytes. Every public call validates, then decides
everything it will change, then commits, so an exception leaves the buffer as it was.
"""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import torch

from torchreplay.assembly import (BatchAssembler, Handles, Plan, ReplayBatch, concat, effective_sample_size,
                                  subset)
from torchreplay.errors import SchemaError, StorageError
from torchreplay.samplers import PrioritizedSampler, Sampler
from torchreplay.schema import FieldSpec, PackedBatch, default_fields, validate_batch
from torchreplay.slots import TABLE_FIELDS, SlotTable
from torchreplay.storage import CorruptRows, TieredStorage

if TYPE_CHECKING:
    from torchreplay.checkpoint import Checkpointer

__all__ = ["RolloutBuffer", "PendingBatch", "Handles", "ReplayBatch"]

EVICTION_REASONS = ("staleness", "reuse", "capacity", "corrupt")
SHORT_POLICIES = ("raise", "truncate")
_STATE_VERSION = 1


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
        if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int):
            raise TypeError(f"pad_token_id must be an int, got {pad_token_id!r}")
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
        self.slots = SlotTable(capacity, track_versions=max_staleness is not None)
        self.sampler.bind(self.slots)
        self.sampler.on_advance(self.slots.version)
        self.storage = storage if storage is not None else TieredStorage()
        self.assembler = BatchAssembler(self.storage, self.fields, padding_side, self.pad_token_id)
        self.generator = torch.Generator()
        self.generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,))))
        self.on_corrupt = on_corrupt
        self._prefetcher: ThreadPoolExecutor | None = None
        self._counters: dict[str, float] = {f"evicted_{r}": 0 for r in EVICTION_REASONS}
        self._counters.update(stale_handle_updates=0, sampled_fresh=0, sampled_replay=0, added=0, sample_calls=0)
        self._last_ess = math.nan
        self._last_replay_weight_mean = math.nan
        self.checkpointer = None
        if checkpoint is not None:
            from torchreplay.checkpoint import Checkpointer

            if not isinstance(checkpoint, Checkpointer):
                raise TypeError(f"checkpoint must be a Checkpointer, got {type(checkpoint).__name__}")
            self.checkpointer = checkpoint
            checkpoint.attach(self)

    def __len__(self) -> int:
        return self.slots.count

    @property
    def version(self) -> int:
        """The current policy version: the highest passed to `advance`/`compose` or seen in `add`."""
        return self.slots.version

    # -------------------------------------------------------------------------------- the caps
    def _stale(self, version: int) -> torch.Tensor:
        """Live slots past the staleness cap at `version` (age = version - policy_version)."""
        if self.max_staleness is None:
            return torch.empty(0, dtype=torch.int64)
        return self.slots.older_than(version - self.max_staleness)

    def _remaining(self, excluded: torch.Tensor) -> torch.Tensor | None:
        """Per slot, how many more times it may be returned (None: no limit anywhere)."""
        if self.max_reuse is None and excluded.numel() == 0:
            return None
        t = self.slots
        if self.max_reuse is None:
            remaining = torch.full((self.capacity,), 2**62, dtype=torch.int64)
        else:
            remaining = (self.max_reuse - t.reuse).clamp(min=0)
        remaining[~t.live] = 0
        remaining[excluded] = 0
        return remaining

    def _draw(self, n: int, generator: torch.Generator, excluded: torch.Tensor, if_short: str,
              n_fresh: int = 0, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Up to n slots within every cap; all-or-nothing on the generator. A short draw raises
        with if_short='raise', else is cut so that n_fresh + its length stays a multiple of `multiple`."""
        state = generator.get_state()
        try:
            slots, weights = self.sampler.sample(n, generator, self._remaining(excluded))
            if slots.numel() < n:
                if if_short == "raise":
                    raise ValueError(
                        f"cannot fill a batch of {n}: only {slots.numel()} draws fit the caps (live rollouts "
                        f"{len(self)}, non-zero priority and reuse budget left); pass if_short='truncate' "
                        "for a shorter batch")
                keep = max(0, slots.numel() - (n_fresh + slots.numel()) % multiple)
                slots, weights = slots[:keep], weights[:keep]
        except BaseException:
            generator.set_state(state)
            raise
        return slots, weights

    # ------------------------------------------------------------------------------ inserting
    def add(self, batch: Any) -> Handles:
        """Validate and store a batch of rollouts; returns their handles.

        `batch` is a dict (or TensorDict) with, per rollout: `tokens` (prompt + response),
        `response_mask`, `logprobs` (ragged: a list of 1-D tensors, a nested tensor, or
        {"values", "offsets"}), and `prompt_len`, `reward`, `advantage`, `group_id` ([n] tensors),
        `policy_version` ([n] tensor or one int). The data is copied once, into the buffer's shard.
        A newer policy_version moves the buffer's version (and evicts what that makes stale).
        Nothing changes unless the whole call succeeds.
        """
        packed = validate_batch(batch, self.fields)
        self._check_admissible(packed)
        self._tick()
        return self._insert(packed)

    def _check_admissible(self, packed: PackedBatch) -> None:
        if packed.n > self.capacity:
            raise SchemaError(f"batch of {packed.n} rollouts exceeds the buffer capacity {self.capacity}")
        if self.overflow == "raise" and packed.n > len(self.slots.free):
            raise SchemaError(
                f"buffer full: {packed.n} rollouts to add, {len(self.slots.free)} free slots (overflow='raise')"
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

    def _insert(self, packed: PackedBatch) -> Handles:
        """Store `packed` all-or-nothing: decide the victims, write the shard (the step that can
        fail on I/O), then commit the table and sampler, undoing them if a hook raises."""
        t, n = self.slots, packed.n
        version = max(self.version, int(packed.rollout["policy_version"].max()))
        stale = self._stale(version)
        short = n - len(t.free) - stale.numel()
        crowded = torch.empty(0, dtype=torch.int64)
        if short > 0:
            oldest = t.oldest(short + stale.numel())
            crowded = oldest[~torch.isin(oldest, stale)][:short]
        victims = torch.cat([stale, crowded])
        shard = self._put_shard(PackedBatch(n=n, offsets=packed.offsets, token=packed.token,
                                            rollout={k: v for k, v in packed.rollout.items() if k not in TABLE_FIELDS}))
        undo = (t.snapshot_rows(victims), list(t.free), t.count, t.next_seq, t.version)
        slots = torch.empty(0, dtype=torch.int64)
        released: list[tuple[int, int]] = []
        try:
            released = self._kill(victims)
            self._set_version(version)
            slots = t.take(n)
            taken_rows = t.snapshot_rows(slots)
            t.insert(slots, packed.rollout, shard)
            self.sampler.on_insert(slots)
        except BaseException:
            self._undo_insert(victims, slots, undo, taken_rows if slots.numel() else None)
            self._release_shard(shard, n)
            raise
        for shard_id, rows in released:
            self._release_shard(shard_id, rows)
        self._counters["evicted_staleness"] += stale.numel()
        self._counters["evicted_capacity"] += crowded.numel()
        self._counters["added"] += n
        return Handles(slots, t.generation[slots].clone())

    def _undo_insert(self, victims, slots, undo, taken_rows) -> None:
        t = self.slots
        victim_rows, free, count, next_seq, version = undo
        if slots.numel():
            self.sampler.on_remove(slots)
            t.restore_rows(slots, taken_rows)
        t.restore_rows(victims, victim_rows)
        t.free, t.count, t.next_seq = free, count, next_seq
        t.compact()
        self._set_version(version)
        if victims.numel():
            self.sampler.on_insert(victims)

    def _kill(self, slots: torch.Tensor) -> list[tuple[int, int]]:
        """Remove live slots from the sampler and the table; returns the (shard, rows) to release
        once the call commits (until then an undo can bring them back)."""
        if slots.numel() == 0:
            return []
        self.sampler.on_remove(slots)
        return self.slots.kill(slots)

    def _set_version(self, version: int, force: bool = False) -> None:
        if version != self.slots.version or force:
            self.slots.version = version
            self.sampler.on_advance(version)

    def _evict(self, slots: torch.Tensor, reason: str) -> None:
        """Evict now (no undo): for the commit step of a call, after everything that can fail."""
        if slots.numel():
            for shard_id, rows in self._kill(slots):
                self._release_shard(shard_id, rows)
            self._counters[f"evicted_{reason}"] += slots.numel()

    def advance(self, policy_version: int) -> int:
        """Set the current policy version; evict rollouts older than `max_staleness` versions.

        Costs O(evicted + distinct live versions). Returns the number evicted.
        """
        if isinstance(policy_version, bool) or not isinstance(policy_version, int):
            raise TypeError(f"policy_version must be an int, got {type(policy_version).__name__}")
        if policy_version < self.version:
            raise ValueError(f"policy_version must not go backwards: {policy_version} < current {self.version}")
        if policy_version >= 2**62:
            raise ValueError(f"policy_version must be < 2**62, got {policy_version}")
        self._tick()
        # Compaction first: it moves rows between shards but changes nothing a caller can see, so
        # an I/O error from it leaves the version where it was.
        for shard_id in self.storage.compaction_candidates():
            self._compact(shard_id)
        stale = self._stale(policy_version)
        self._evict(stale, "staleness")
        self._set_version(policy_version)
        if self.max_staleness is not None:
            self.slots.drop_versions_below(policy_version - self.max_staleness)
        return stale.numel()

    def _compact(self, shard_id: int) -> None:
        """Rewrite a mostly dead shard's live rows into a new shard, so its file and memory go."""
        t = self.slots
        slots = ((t.chunk == shard_id) & t.live).nonzero().flatten()
        shard = self.storage.shard(shard_id)
        self.storage.pin_shards([shard_id])
        try:
            batch, index = self.storage.fetch(shard, t.row[slots], list(shard.token_fields))
        except CorruptRows as exc:
            self.storage.unpin_shards([shard])
            try:
                self._evict_corrupt(exc)
            except StorageError:
                pass
            return
        self.storage.unpin_shards([shard])
        new_id = self._put_shard(subset(batch, index))
        t.chunk[slots] = new_id
        t.row[slots] = torch.arange(slots.numel())
        self._release_shard(shard_id, slots.numel())
        self.storage.counters["compactions"] += 1

    # ---------------------------------------------------------------------------------- sampling
    def sample(self, batch_size: int, device: torch.device | str | None = None,
               generator: torch.Generator | None = None, reuse_output: bool = False,
               if_short: str = "raise") -> ReplayBatch:
        """Draw `batch_size` rollouts through the sampler (with replacement, but no rollout more
        often than its reuse budget allows); padded, on `device`.

        `if_short`: when the caps leave fewer than `batch_size` draws, "raise" (ValueError, nothing
        changes) or "truncate" (a shorter batch). `reuse_output=True` writes the padded token fields
        into buffers kept across calls (much faster for large batches); the returned tensors are
        then valid only until the next `sample(..., reuse_output=True)`."""
        return self.sample_async(batch_size, device, generator, if_short=if_short,
                                 _inline=True, _reuse=reuse_output).result()

    def sample_async(self, batch_size: int, device: torch.device | str | None = None,
                     generator: torch.Generator | None = None, if_short: str = "raise",
                     _inline: bool = False, _reuse: bool = False) -> "PendingBatch":
        """Like `sample`, but cold rollouts are paged in and padded on a prefetch thread while the
        caller trains on the previous batch. Which rollouts are drawn (and their reuse counts) is
        decided now, on the calling thread, so results match `sample` for the same generator.
        Call `.result()` on the returned object from the thread that owns the buffer."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        _check_short(if_short)
        if self.slots.count == 0:
            raise ValueError("cannot sample: the buffer is empty")
        self._tick()
        generator = generator if generator is not None else self.generator
        slots, weights = self._draw(batch_size, generator, torch.empty(0, dtype=torch.int64), if_short)
        if slots.numel() == 0:
            raise ValueError("cannot sample: no live rollout has a non-zero priority and reuse budget left")
        plan = self.assembler.plan(self.slots, slots, weights, torch.zeros(slots.numel(), dtype=torch.bool),
                                   self.version, self._assembly_device(device), _reuse)
        self._counters["sampled_replay"] += slots.numel()
        self._counters["sample_calls"] += 1
        self._record_use(slots, weights, weights)
        if _inline:
            future: Future = Future()
            try:
                future.set_result(self.assembler.materialize(plan))
            except BaseException as exc:  # noqa: BLE001 - handed to PendingBatch.result
                future.set_exception(exc)
        else:
            if self._prefetcher is None:
                self._prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchreplay-prefetch")
            future = self._prefetcher.submit(self.assembler.materialize_ahead, plan)
        return PendingBatch(self, future, device, (batch_size, generator, if_short), plan)

    def gather(self, slots: torch.Tensor, count_use: bool = True, weights: torch.Tensor | None = None,
               device: torch.device | str | None = None) -> ReplayBatch:
        """Read the given live slots as a padded batch (e.g. slots chosen by another rank's draw).

        With `count_use` their reuse counts go up; a slot named more often than its reuse budget
        allows is a ValueError (nothing changes). Unreadable rollouts are evicted and raise
        StorageError."""
        if not isinstance(slots, torch.Tensor) or slots.dtype != torch.int64 or slots.dim() != 1:
            raise TypeError("slots must be a 1-D int64 tensor")
        slots = slots.cpu()
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= self.capacity):
            raise ValueError(f"slots outside [0, {self.capacity})")
        if not bool(self.slots.live[slots].all()):
            raise ValueError("slots must name live rollouts")
        if count_use and self.max_reuse is not None and slots.numel():
            uses = torch.bincount(slots, minlength=self.capacity)
            if bool((uses > self.max_reuse - self.slots.reuse).any()):
                raise ValueError(f"slots name a rollout more often than its reuse budget (max_reuse {self.max_reuse})")
        n = slots.numel()
        w = torch.ones(n) if weights is None else weights
        plan = self.assembler.plan(self.slots, slots, w, torch.zeros(n, dtype=torch.bool), self.version,
                                   self._assembly_device(device))
        try:
            batch = self.assembler.materialize(plan)
        except CorruptRows as exc:
            self._evict_corrupt(exc, always_raise=True)
        if count_use:
            self._record_use(slots, weights, weights)
        return batch if device is None else batch.to(device)

    def prefetching(self, batch_size: int, steps: int | None = None, device: torch.device | str | None = None,
                    generator: torch.Generator | None = None) -> Iterator[ReplayBatch]:
        """Iterate batches with the next one always in flight (sample-ahead)."""
        pending = self.sample_async(batch_size, device, generator)
        taken = 0
        while steps is None or taken < steps:
            batch = pending.result()
            taken += 1
            if steps is None or taken < steps:
                pending = self.sample_async(batch_size, device, generator)
            yield batch

    def compose(self, fresh: Any, replay_ratio: float | None = None, n_replay: int | None = None,
                multiple_of: int | None = None, device: torch.device | str | None = None,
                generator: torch.Generator | None = None, if_short: str = "truncate") -> ReplayBatch:
        """Fresh-anchored batch: all of `fresh`, then replayed rollouts. Their count is either
        `n_replay` exactly, or `replay_ratio` of the result (0 <= replay_ratio < 1), rounded so
        that the whole batch is a multiple of `multiple_of` when given (trainers split batches
        over accumulation steps and ranks and drop remainders).

        `fresh`'s policy_version moves the buffer's version first: rollouts it makes stale are
        never drawn, and replayed ages are measured against it. Replayed rollouts are drawn before
        `fresh` is stored, so they are never the fresh ones; fresh rows get IS weight 1 and their
        use counts towards max_reuse. If the caps leave too few draws, `if_short="truncate"`
        (default: the first steps of a run have nothing to replay) returns fewer replayed rows, cut
        to keep `multiple_of`; "raise" raises ValueError. Either way, or on any other error,
        `fresh` has not been added and nothing changed (except unreadable rollouts, see
        `on_corrupt`, which are evicted)."""
        _check_short(if_short)
        packed = validate_batch(fresh, self.fields)
        count = _replay_count(packed.n, replay_ratio, n_replay, multiple_of)
        self._check_admissible(packed)
        self._tick()
        generator = generator if generator is not None else self.generator
        version = max(self.version, int(packed.rollout["policy_version"].max()))
        stale = self._stale(version)
        multiple = multiple_of or 1
        state = generator.get_state()
        replayed = None
        replay_slots = torch.empty(0, dtype=torch.int64)
        while count and self.slots.count and replayed is None:
            replay_slots, replay_weights = self._draw(count, generator, stale, if_short, packed.n, multiple)
            if replay_slots.numel() == 0:
                break
            plan = self.assembler.plan(self.slots, replay_slots, replay_weights,
                                       torch.zeros(replay_slots.numel(), dtype=torch.bool), version)
            try:
                replayed = self.assembler.materialize(plan)
            except CorruptRows as exc:
                self._evict_corrupt(exc)  # then redraw ("skip") or raise
                stale = self._stale(version)
        if replayed is None:
            replay_slots = torch.empty(0, dtype=torch.int64)
            if count and if_short == "raise":
                generator.set_state(state)
                raise ValueError(f"cannot fill {count} replayed rows: nothing drawable in the buffer")
        if (packed.n + replay_slots.numel()) % multiple:
            generator.set_state(state)
            raise ValueError(f"cannot make a batch that is a multiple of {multiple_of}: {packed.n} fresh rollouts "
                             f"and only {replay_slots.numel()} replayable")
        try:
            handles = self._insert(packed)
        except BaseException:
            generator.set_state(state)
            raise
        fresh_batch = self.assembler.materialize(self.assembler.plan(
            self.slots, handles.slot, torch.ones(packed.n), torch.ones(packed.n, dtype=torch.bool), self.version))
        # Uses are counted once both parts are read: a replayed slot freed now could otherwise
        # be handed to a fresh rollout of this same call.
        replay_live = replay_slots[self.slots.generation[replay_slots] == replayed.handles.generation] \
            if replayed is not None else replay_slots
        out = fresh_batch if replayed is None else concat(fresh_batch, replayed, self.assembler)
        self._record_use(torch.cat([handles.slot, replay_live]), out.weights,
                         replayed.weights if replayed is not None else None)
        self._counters["sampled_fresh"] += packed.n
        self._counters["sample_calls"] += 1
        self._counters["sampled_replay"] += replay_slots.numel()
        return out if device is None else out.to(device)

    def _evict_corrupt(self, exc: CorruptRows, always_raise: bool = False) -> None:
        """Evict the live rollouts stored in the unreadable rows; raise unless on_corrupt='skip'
        (a caller that asked for specific slots always gets the error)."""
        t = self.slots
        hit = ((t.chunk == exc.shard_id) & t.live).nonzero().flatten()
        hit = hit[torch.isin(t.row[hit], torch.tensor(exc.rows, dtype=torch.int64))]
        self._evict(hit, "corrupt")
        self.storage.counters["corrupt_rows"] += hit.numel()
        if always_raise or self.on_corrupt == "raise" or self.slots.count == 0:
            raise StorageError(f"{exc}; {hit.numel()} rollout(s) evicted, the rest of the buffer is intact") from exc

    def _record_use(self, slots: torch.Tensor, weights: torch.Tensor | None,
                    replay_weights: torch.Tensor | None) -> None:
        """Count one use per occurrence; evict what reached max_reuse; note the batch's weights."""
        if weights is not None and weights.numel():
            self._last_ess = effective_sample_size(weights)
        self._last_replay_weight_mean = float(replay_weights.double().mean()) \
            if replay_weights is not None and replay_weights.numel() else math.nan
        self.slots.reuse.index_put_((slots,), torch.ones_like(slots), accumulate=True)
        self._evict_overused(slots)

    def _evict_overused(self, slots: torch.Tensor) -> None:
        if self.max_reuse is None or slots.numel() == 0:
            return
        unique = torch.unique(slots)
        self._evict(unique[(self.slots.reuse[unique] >= self.max_reuse) & self.slots.live[unique]], "reuse")

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

    # -------------------------------------------------------------------------------- priorities
    def update_priorities(self, handles: Handles, advantages: torch.Tensor) -> int:
        """Set new advantages for still-live handles. Handles whose rollout was evicted or whose slot
        was reused are ignored and counted (`stale_handle_updates`). Returns how many applied.
        All-or-nothing: a priority the sampler rejects (e.g. overflow) leaves every advantage as it was."""
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
        t = self.slots
        current = t.live[slot] & (t.generation[slot] == handles.generation.cpu())
        slot, advantages = slot[current], advantages[current]
        if slot.numel():
            changed = torch.unique(slot)
            old = t.advantage[changed].clone()
            t.advantage[slot] = advantages  # last occurrence wins for repeated handles
            try:
                self.sampler.on_priority(changed)
            except BaseException:
                t.advantage[changed] = old
                raise
        self._counters["stale_handle_updates"] += int((~current).sum())
        return int(current.sum())

    # ----------------------------------------------------------------------------------- metrics
    def metrics(self) -> dict[str, float]:
        """A flat dict of numbers for a logger: size, bytes, capacity, age and reuse histograms,
        the effective sample size of the last returned batch's IS weights (fraction of the batch),
        the mean IS weight of its replayed rows, evictions by reason, stale-handle updates, sampled
        fresh/replay counts."""
        t = self.slots
        live = t.live
        ages = t.ages(live)
        reuse = t.reuse[live]
        out: dict[str, float] = {
            "size": t.count,
            "capacity": self.capacity,
            "bytes": self.storage.total_bytes(),
            "policy_version": t.version,
            "ess_fraction": self._last_ess,
            "replay_weight_mean": self._last_replay_weight_mean,
            "age_mean": float(ages.double().mean()) if ages.numel() else 0.0,
            "age_max": int(ages.max()) if ages.numel() else 0,
            "reuse_mean": float(reuse.double().mean()) if reuse.numel() else 0.0,
        }
        for name, values, bins in (("age", ages, ((0, 0), (1, 1), (2, 3), (4, 7), (8, None))),
                                   ("reuse", reuse, ((0, 0), (1, 1), (2, 3), (4, None)))):
            for lo, hi in bins:
                key = f"{name}_hist_{lo}" if lo == hi else (f"{name}_hist_{lo}_{hi}" if hi else f"{name}_hist_{lo}_plus")
                sel = (values >= lo) if hi is None else ((values >= lo) & (values <= hi))
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
        return {"format_version": _STATE_VERSION, "config": self._config(), **self.slots.state(),
                "counters": dict(self._counters), "last_ess": self._last_ess,
                "last_replay_weight_mean": self._last_replay_weight_mean,
                "rng": self.generator.get_state(), "sampler": self.sampler.state_dict()}

    def _live_shards(self) -> tuple[list[int], list[int]]:
        t = self.slots
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
                "overflow": self.overflow, "padding_side": self.padding_side, "pad_token_id": self.pad_token_id,
                **self._schema_args}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from `state_dict()`. Validates everything before changing anything."""
        if not isinstance(state, Mapping) or not isinstance(state.get("chunks"), Mapping):
            raise TypeError("state must be a mapping from state_dict() (with 'chunks')")
        sizes = {}
        for cid, c in state["chunks"].items():
            offsets = c.get("offsets") if isinstance(c, Mapping) else None
            if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1 or offsets.dtype != torch.int64:
                raise ValueError(f"state chunk {cid}: offsets must be a 1-D int64 tensor")
            if not str(cid).isdigit():
                raise ValueError(f"state chunk id {cid!r} is not a non-negative integer")
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
        table = SlotTable.from_state(self.capacity, self.max_staleness is not None, state)
        live_chunks = table.chunk[table.live]
        if not set(live_chunks.tolist()) <= set(chunk_rows):
            raise ValueError("state: a live slot names a chunk that is not stored")
        for cid, n in chunk_rows.items():
            rows_used = table.row[table.live][live_chunks == cid]
            if rows_used.numel() and (int(rows_used.min()) < 0 or int(rows_used.max()) >= n):
                raise ValueError(f"state chunk {cid}: a live slot names a row outside its {n} rows")
        rng = state.get("rng")
        if not isinstance(rng, torch.Tensor) or rng.dtype != torch.uint8:
            raise ValueError("state 'rng' must be a uint8 generator state tensor")
        counters = state.get("counters")
        if not isinstance(counters, Mapping) or set(counters) != set(self._counters):
            raise ValueError(f"state 'counters' must have the keys {sorted(self._counters)}")
        old_table, old_sampler_state, old_rng = self.slots, self.sampler.state_dict(), self.generator.get_state()
        self.slots = table
        try:
            self.sampler.bind(table)
            self.sampler.load_state_dict(state["sampler"])
            self.generator.set_state(rng)
        except Exception:
            self.slots = old_table
            self.sampler.bind(old_table)
            self.sampler.load_state_dict(old_sampler_state)
            self.generator.set_state(old_rng)
            raise
        # Committed: release what the buffer held, then store the chunks under new shard ids.
        for sid, count in zip(*torch.unique(old_table.chunk[old_table.live], return_counts=True)):
            self._release_shard(int(sid), int(count))
        remap: dict[int, int] = {}
        live_per_chunk = dict(zip(*(x.tolist() for x in torch.unique(live_chunks, return_counts=True))))
        for cid in sorted(live_per_chunk):
            remap[cid] = store_chunk(cid)
            dead = chunk_rows[cid] - live_per_chunk[cid]
            if dead:
                self._release_shard(remap[cid], dead)
        live_slots = table.live_slots()
        table.chunk[live_slots] = torch.tensor([remap[c] for c in table.chunk[live_slots].tolist()],
                                               dtype=torch.int64)
        self._counters = dict(counters)
        self._last_ess = float(state.get("last_ess", math.nan))
        self._last_replay_weight_mean = float(state.get("last_replay_weight_mean", math.nan))
        self._set_version(table.version, force=True)
        self._evict(self._stale(table.version), "staleness")

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

    def __init__(self, buffer: RolloutBuffer, future: Future, device, redraw: tuple, plan: Plan) -> None:
        self._buffer, self._future, self._device, self._redraw, self._plan = buffer, future, device, redraw, plan

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> ReplayBatch:
        try:
            batch = self._future.result()
        except CorruptRows as exc:
            self._buffer._evict_corrupt(exc)  # raises unless on_corrupt == "skip"
            batch_size, generator, if_short = self._redraw
            return self._buffer.sample(batch_size, self._device, generator, if_short=if_short)
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




def _check_short(if_short: str) -> None:
    if if_short not in SHORT_POLICIES:
        raise ValueError(f"if_short must be one of {SHORT_POLICIES}, got {if_short!r}")


def _replay_count(n_fresh: int, replay_ratio: float | None, n_replay: int | None, multiple_of: int | None) -> int:
    """How many replayed rows `compose` asks for (see its docstring)."""
    if multiple_of is not None and (isinstance(multiple_of, bool) or not isinstance(multiple_of, int)
                                    or multiple_of < 1):
        raise ValueError(f"multiple_of must be None or an int >= 1, got {multiple_of!r}")
    if (replay_ratio is None) == (n_replay is None):
        raise ValueError("compose needs exactly one of replay_ratio and n_replay")
    if n_replay is not None:
        if isinstance(n_replay, bool) or not isinstance(n_replay, int) or n_replay < 0:
            raise ValueError(f"n_replay must be an int >= 0, got {n_replay!r}")
        if multiple_of is not None and (n_fresh + n_replay) % multiple_of:
            raise ValueError(f"n_replay: {n_fresh} fresh + {n_replay} replayed is not a multiple of {multiple_of}")
        return n_replay
    if isinstance(replay_ratio, bool) or not isinstance(replay_ratio, (int, float)) or not 0 <= replay_ratio < 1:
        raise ValueError(f"replay_ratio must be a number in [0, 1), got {replay_ratio!r}")
    count = round(n_fresh * replay_ratio / (1 - replay_ratio))
    if multiple_of is not None:
        total = max(multiple_of, round((n_fresh + count) / multiple_of) * multiple_of)
        while total < n_fresh:
            total += multiple_of
        count = total - n_fresh
    return count
