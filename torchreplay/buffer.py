"""RolloutBuffer: rollout-level, advantage-prioritized, staleness-bounded replay.

The buffer orchestrates: the Ledger keeps live rollouts and their caps (over a SlotTable and the
sampler), the BatchAssembler pads, TieredStorage holds the bytes, the Checkpointer persists them.
Every public call validates, then decides what it will change, then commits, so an exception
leaves the buffer as it was.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import torch

from torchreplay import budget, persistence
from torchreplay.assembly import BatchAssembler, Handles, PendingBatch, ReplayBatch, concat, prefetched
from torchreplay.checks import check_int
from torchreplay.config import BufferConfig
from torchreplay.errors import StorageError
from torchreplay.ledger import MAX_VERSION, Ledger, Released, check_short
from torchreplay.packed import LAYOUTS, Batch, PackedReplayBatch, concat as concat_packed
from torchreplay.padded import from_padded
from torchreplay.samplers import PrioritizedSampler, Sampler, sampler_spec
from torchreplay.schema import FieldSpec, PackedBatch, validate_batch
from torchreplay.shards import ShardKeeper, ShardListener
from torchreplay.slots import TABLE_FIELDS, SlotTableView
from torchreplay.snapshot import BufferSnapshot, ShardSource, checkpoint_reader, live_shards
from torchreplay.storage import CorruptRows, TieredStorage

__all__ = ["RolloutBuffer", "PendingBatch", "Handles", "ReplayBatch"]


class RolloutBuffer:
    """Stores rollouts individually and samples them for replay.

    Args:
        capacity: number of rollout slots.
        sampler: a `Sampler` (default `PrioritizedSampler()`: p = (|A| + eps) ** alpha, 0 for A = 0).
        max_staleness: hard cap on a rollout's age (`version - policy_version`): whenever the buffer's
            version moves (add, compose, advance, load), older rollouts are evicted before anything is
            sampled. None: no cap.
        max_reuse: hard cap on how often a rollout is returned (a fresh use in `compose` counts), within
            one batch and across batches; it is evicted when the cap is reached. None: no cap.
        overflow: "evict_oldest" (insertion order) or "raise" when `add` finds no free slot.
        padding_side: "right" or "left" padding of token fields in sampled batches.
        pad_token_id: value of padded `tokens` positions.
        ref_logprobs: store per-token reference log-probs too.
        routing: (num_experts, layers, top_k) to store MoE routing ids per token (Rollout Routing Replay),
            in the narrowest integer dtype that holds the expert ids.
        extra_fields: user-declared fields, name -> FieldSpec.
        storage: where rollout bytes live (default: hot-only, in host RAM). See TieredStorage.
        checkpoint: a Checkpointer: shards and manifests go to object storage in the background.
        token_dtype: torch.int64 (default) or torch.int32 (half the bytes of the largest field): the
            dtype token ids are stored and returned in.
        seed: seeds the buffer's own generator, used when `sample`/`compose` get none (its state is
            part of state_dict and checkpoints).
        on_corrupt: when stored rollouts cannot be read back intact (checksum mismatch, vanished file),
            they are evicted and counted (`evicted_corrupt`) and never returned; then "raise" raises
            StorageError from that `sample` call, "skip" redraws the batch.
    """

    def __init__(self, capacity: int, sampler: Sampler | None = None, max_staleness: int | None = None,
                 max_reuse: int | None = None, overflow: str = "evict_oldest", padding_side: str = "right",
                 pad_token_id: int = 0, ref_logprobs: bool = False, routing: tuple[int, int, int] | None = None,
                 extra_fields: Mapping[str, FieldSpec] | None = None, storage: TieredStorage | None = None,
                 on_corrupt: str = "raise", checkpoint: ShardListener | None = None, seed: int | None = None,
                 token_dtype: torch.dtype = torch.int64) -> None:
        if storage is not None and not isinstance(storage, TieredStorage):
            raise TypeError(f"storage must be a TieredStorage, got {type(storage).__name__}")
        sampler = sampler if sampler is not None else PrioritizedSampler()
        if not isinstance(sampler, Sampler):
            raise TypeError(f"sampler must implement the Sampler protocol, got {type(sampler).__name__}")
        self._settings = BufferConfig(capacity, max_staleness, max_reuse, overflow, padding_side, pad_token_id,
                                     ref_logprobs, routing, extra_fields, on_corrupt, token_dtype,
                                     sampler_spec(sampler))
        self.fields: dict[str, FieldSpec] = self._settings.fields()
        self.sampler = sampler
        self.ledger = Ledger(capacity, sampler, max_staleness, max_reuse)
        self.keeper = ShardKeeper(storage if storage is not None else TieredStorage())
        self.assembler = BatchAssembler(self.storage, self.fields, padding_side, pad_token_id, LAYOUTS)
        self.generator = torch.Generator()
        self.generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,))))
        if checkpoint is not None:
            self.attach_checkpointer(checkpoint)

    settings = property(lambda self: self._settings, doc="The configuration, caps as now (`_set_caps` replaces it).")
    capacity = property(lambda self: self.settings.capacity)
    overflow = property(lambda self: self.settings.overflow)
    padding_side = property(lambda self: self.settings.padding_side)
    pad_token_id = property(lambda self: self.settings.pad_token_id)
    on_corrupt = property(lambda self: self.settings.on_corrupt)
    max_staleness = property(lambda self: self._settings.max_staleness,
                             lambda self, value: self._set_caps(value, self.max_reuse),
                             doc="The staleness cap (policy versions); may be changed between calls.")
    max_reuse = property(lambda self: self._settings.max_reuse,
                         lambda self, value: self._set_caps(self.max_staleness, value),
                         doc="The reuse cap (times returned); may be changed between calls.")
    storage = property(lambda self: self.keeper.storage)
    checkpointer = property(lambda self: self.keeper.checkpointer,
                            doc="Where shards and manifests go (None: no checkpoints); see `attach_checkpointer`.")
    slots = property(lambda self: SlotTableView(self.ledger),
                     doc="A read-only view of the slot table (per-slot metadata; columns come back as copies).")

    def __len__(self) -> int:
        return self.ledger.slots.count

    def _set_caps(self, max_staleness: int | None, max_reuse: int | None) -> None:
        """New caps (validated before anything changes); a tighter cap evicts what it puts past it at once."""
        settings = self._settings.with_caps(max_staleness, max_reuse)
        self._release(self.ledger.set_max_reuse(max_reuse))
        self.ledger.max_staleness = max_staleness
        self._settings = settings
        self._release(self.ledger.advance(self.version)[1])

    @property
    def version(self) -> int:
        """The current policy version: the highest passed to `advance` or seen in `add`/`compose`."""
        return self.ledger.version

    # ------------------------------------------------------------------------------ inserting
    def add(self, batch: Any) -> Handles:
        """Validate and store a batch of rollouts; returns their handles.

        `batch` is a dict (or TensorDict) with, per rollout: `tokens` (prompt + response),
        `response_mask`, `logprobs` (ragged: a list of 1-D tensors, a nested tensor, or
        {"values", "offsets"}), and `prompt_len`, `reward`, `advantage`, `group_id` ([n] tensors),
        `policy_version` ([n] tensor or one int). The data is copied once, into the buffer's shard.
        A newer policy_version moves the buffer's version (evicting what that makes stale).
        Nothing changes unless the whole call succeeds.
        """
        # Copied into the host pool tentatively: a refused batch's memory and counts go back.
        with self.storage.host_pool.tentative():
            packed = self._validate(batch)
            self.ledger.check_admissible(packed.rollout["policy_version"], self.overflow == "raise")
            self.keeper.tick()
            return self._insert(packed)

    def _validate(self, batch: Any) -> PackedBatch:
        """`validate_batch`, with the caller's token data copied into storage's recycled memory."""
        return validate_batch(batch, self.fields, copy=self.storage.copy_in, concat=self.storage.concat_in)

    def add_padded(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                   completion_mask: torch.Tensor, logprobs: torch.Tensor, **rollout: Any) -> Handles:
        """`add` for the padded layout TRL and verl use: left-padded prompts, right-padded
        completions, int or bool masks, completion-only (or full-width) log-probs; `rollout` holds
        `advantage`, `group_id`, `policy_version`, optionally `reward`, `prompt_side` and declared
        extra fields. See `torchreplay.from_padded`, which `compose` callers use directly."""
        return self.add(from_padded(prompt_ids, prompt_mask, completion_ids, completion_mask, logprobs, **rollout))

    def _insert(self, packed: PackedBatch) -> Handles:
        """Store `packed`: write its shard first (the step that can fail on I/O), then commit it
        to the ledger, which undoes itself if a hook fails; the shard goes again in that case."""
        shard = self.keeper.put(PackedBatch(n=packed.n, offsets=packed.offsets, token=packed.token,
                                            rollout={k: v for k, v in packed.rollout.items() if k not in TABLE_FIELDS}))
        try:
            slots, released = self.ledger.insert(packed.rollout, packed.n, shard, self.overflow == "evict_oldest")
        except BaseException:
            self.keeper.release(shard, packed.n)
            raise
        self._release(released)
        return Handles(slots, self.ledger.slots.generation[slots].clone())

    def advance(self, policy_version: int) -> int:
        """Set the current policy version; evict rollouts older than `max_staleness` versions.

        Costs O(evicted + distinct live versions). Returns the number evicted.
        """
        check_int(policy_version, "policy_version")
        if not self.version <= policy_version < MAX_VERSION:
            raise ValueError(f"policy_version must not go backwards and must be < 2**62: {policy_version}, "
                             f"current {self.version}")
        self.keeper.tick()
        # Compaction first: it moves rows between shards but changes nothing a caller can see, so
        # an I/O error from it leaves the version where it was.
        self.keeper.compact(self.ledger.slots, self._evict_corrupt_quietly)
        evicted, released = self.ledger.advance(policy_version)
        self._release(released)
        return evicted

    def _evict_corrupt_quietly(self, exc: CorruptRows) -> None:
        try:
            self._evict_corrupt(exc)
        except StorageError:
            pass  # counted; the caller (compaction) goes on with the other shards

    def _release(self, released: Released) -> None:
        self.keeper.release_all(released)

    # ---------------------------------------------------------------------------------- sampling
    def sample(self, batch_size: int | None = None, device: torch.device | str | None = None,
               generator: torch.Generator | None = None, reuse_output: bool = False,
               if_short: str = "raise", max_tokens: int | None = None, layout: str = "padded") -> Batch:
        """Draw `batch_size` rollouts through the sampler (with replacement, but no rollout more
        often than its reuse budget allows), or instead as many as fit in `max_tokens` stored tokens
        (budget.py: the IS weights stay exact); padded, on `device`.

        `if_short`: when the caps leave fewer than `batch_size` draws, "raise" (ValueError, nothing
        changes) or "truncate" (a shorter batch). `reuse_output=True` writes the padded token fields
        into buffers kept across calls (much faster for large batches); the returned tensors are
        then valid only until the next `sample(..., reuse_output=True)`. `layout="packed"`: a
        `PackedReplayBatch` instead (flat tokens, `cu_seqlens`, `position_ids`; packed.py)."""
        return self.sample_async(batch_size, device, generator, if_short=if_short,
                                 max_tokens=max_tokens, layout=layout, _inline=True, _reuse=reuse_output).result()

    def sample_async(self, batch_size: int | None = None, device: torch.device | str | None = None,
                     generator: torch.Generator | None = None, if_short: str = "raise",
                     max_tokens: int | None = None, layout: str = "padded", _inline: bool = False,
                     _reuse: bool = False) -> PendingBatch:
        """Like `sample`, but cold rollouts are paged in and padded on a prefetch thread while the
        caller trains on the previous batch. Which rollouts are drawn (and their reuse counts) is
        decided now, on the calling thread, so results match `sample` for the same generator; a
        batch whose read then fails has still spent those uses (`sample` itself charges none).
        Call `.result()` on the returned object from the thread that owns the buffer."""
        size = budget.draw_size(batch_size, max_tokens)
        check_short(if_short)
        self.assembler.check_request(device, layout)
        if len(self) == 0:
            raise ValueError("cannot sample: the buffer is empty")
        self.keeper.tick()
        generator = generator if generator is not None else self.generator
        state = generator.get_state()
        slots, weights = budget.draw(self.ledger, self.storage, size, generator, torch.empty(0, dtype=torch.int64),
                                     if_short)
        if slots.numel() == 0:
            generator.set_state(state)
            raise ValueError("cannot sample: no live rollout has a non-zero priority and reuse budget left")
        plan = self.assembler.plan(self.ledger.slots, slots, weights, torch.zeros(slots.numel(), dtype=torch.bool),
                                   self.version, self.assembler.home_for(device), _reuse, layout)
        with self.storage.reads.deferred() as reads:  # an inline read counts once the call succeeds
            future = self.assembler.start(plan, inline=_inline)
        failed = future.exception() if _inline else None
        if failed is not None and not isinstance(failed, CorruptRows):
            generator.set_state(state)  # nothing was returned: no use is counted, nothing changed
            raise failed
        if failed is None:
            # An async batch's uses count now, so the next draw already sees its budgets.
            self.ledger.counters["sampled_replay"] += slots.numel()
            self.ledger.counters["sample_calls"] += 1
            self._record_use(slots, weights, weights)
            self.storage.reads.commit(reads)

        def redraw(exc: CorruptRows) -> Batch:
            self._evict_corrupt(exc)  # raises unless on_corrupt == "skip"
            return self.sample(batch_size, device, generator, if_short=if_short, max_tokens=max_tokens, layout=layout)

        return PendingBatch(future, device, plan, redraw)

    def gather(self, slots: torch.Tensor, count_use: bool = True, weights: torch.Tensor | None = None,
               device: torch.device | str | None = None, layout: str = "padded") -> Batch:
        """Read the given live slots as a batch in `layout` (e.g. slots chosen by another rank's draw).

        With `count_use` their reuse counts go up; naming a rollout more often than its reuse
        budget allows is a ValueError (nothing changes). Unreadable rollouts are evicted and raise
        StorageError."""
        if not isinstance(slots, torch.Tensor) or slots.dtype != torch.int64 or slots.dim() != 1:
            raise TypeError("slots must be a 1-D int64 tensor")
        self.assembler.check_request(device, layout)
        slots = slots.cpu()
        self.ledger.check_uses(slots if count_use else torch.unique(slots))
        n = slots.numel()
        plan = self.assembler.plan(self.ledger.slots, slots, torch.ones(n) if weights is None else weights,
                                   torch.zeros(n, dtype=torch.bool), self.version, self.assembler.home_for(device),
                                   layout=layout)
        with self.storage.reads.deferred() as reads:
            try:
                batch = self.assembler.materialize(plan)
            except CorruptRows as exc:
                self._evict_corrupt(exc, always_raise=True)
        if count_use:
            self._record_use(slots, weights, weights)
        self.storage.reads.commit(reads)
        return batch if device is None else batch.to(device)

    def draw_at(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """`Ledger.draw_at` with the buffer's own generator: (slots, priorities, redrawn) at positions `u`
        of a proportional sampler's mass, within the reuse budgets. Nothing is read or counted."""
        return self.ledger.draw_at(u, self.generator)

    def prefetching(self, batch_size: int, steps: int | None = None, device: torch.device | str | None = None,
                    generator: torch.Generator | None = None, layout: str = "padded") -> Iterator[Batch]:
        """Iterate batches with the next one always in flight (sample-ahead)."""
        return prefetched(lambda: self.sample_async(batch_size, device, generator, layout=layout), steps)

    def compose(self, fresh: Any, replay_ratio: float | None = None, n_replay: int | None = None,
                multiple_of: int | None = None, device: torch.device | str | None = None,
                generator: torch.Generator | None = None, if_short: str = "truncate",
                max_tokens: int | None = None, layout: str = "padded") -> Batch:
        """Fresh-anchored batch: all of `fresh`, then replayed rollouts: `n_replay` of them exactly,
        or `replay_ratio` of the result (0 <= replay_ratio < 1), rounded so that the whole batch is
        a multiple of `multiple_of` when given (trainers split batches over accumulation steps and
        ranks, and drop remainders); or, with `max_tokens` alone, as many as fit in what `fresh`
        leaves of that many stored tokens (budget.py; a `fresh` holding more is a ValueError).

        `fresh`'s policy_version moves the buffer's version first: rollouts it makes stale are
        never drawn, and replayed ages are measured against it. Replayed rollouts are drawn before
        `fresh` is stored, so they are never the fresh ones; fresh rows get IS weight 1 and their
        use counts towards max_reuse. If the caps leave too few draws, `if_short="truncate"`
        (default: early steps have little to replay) returns fewer replayed rows, cut to keep
        `multiple_of`; "raise" raises ValueError. On any error `fresh` has not been added and
        nothing changed, except that unreadable rollouts are evicted (see `on_corrupt`). `layout` as in `sample`."""
        check_short(if_short)
        self.assembler.check_request(device, layout)
        # A refused or failed compose leaves every counter as it was: the fresh copy goes back to
        # the host pool, and the replayed rows' reads count only once the call has succeeded.
        with self.storage.host_pool.tentative(), self.storage.reads.deferred() as reads:
            out = self._compose(fresh, replay_ratio, n_replay, multiple_of, generator, if_short, max_tokens, layout)
        self.storage.reads.commit(reads)
        return out if device is None else out.to(device)

    def _compose(self, fresh: Any, replay_ratio: float | None, n_replay: int | None, multiple_of: int | None,
                 generator: torch.Generator | None, if_short: str, max_tokens: int | None, layout: str) -> Batch:
        packed = self._validate(fresh)
        count = budget.replay_size(packed.n, int(packed.offsets[-1]), replay_ratio, n_replay, multiple_of, max_tokens)
        self.ledger.check_admissible(packed.rollout["policy_version"], self.overflow == "raise")
        self.keeper.tick()
        generator = generator if generator is not None else self.generator
        version = max(self.version, int(packed.rollout["policy_version"].max()))
        state, old_version = generator.get_state(), self.version
        try:
            # The sampler hears the new version before the draw, so version-dependent priorities
            # are current; what the version makes stale is excluded now and evicted by the insert.
            self.ledger.set_version(version)
            replayed = self._draw_replay(count, generator, version, if_short, packed.n, multiple_of or 1, layout)
            handles = self._insert(packed)
        except BaseException:
            self.ledger.set_version(old_version)
            generator.set_state(state)
            raise
        fresh_batch = self.assembler.materialize(self.assembler.plan(
            self.ledger.slots, handles.slot, torch.ones(packed.n), torch.ones(packed.n, dtype=torch.bool), self.version,
            layout=layout))
        out, used, replay_weights = fresh_batch, handles.slot, None
        if replayed is not None:
            # Uses are counted once both parts are read; a replayed slot the insert reused is
            # another rollout now and is not charged.
            same = self.ledger.slots.generation[replayed.handles.slot] == replayed.handles.generation
            out = (concat_packed(fresh_batch, replayed) if isinstance(fresh_batch, PackedReplayBatch)
                   else concat(fresh_batch, replayed, self.assembler))
            used, replay_weights = torch.cat([handles.slot, replayed.handles.slot[same]]), replayed.weights
        self._record_use(used, out.weights, replay_weights)
        self.ledger.counters["sampled_fresh"] += packed.n
        self.ledger.counters["sample_calls"] += 1
        self.ledger.counters["sampled_replay"] += len(out) - packed.n
        return out

    def _draw_replay(self, count: int | budget.TokenBudget, generator: torch.Generator, version: int, if_short: str,
                     n_fresh: int, multiple: int, layout: str) -> Batch | None:
        """The replayed part of a compose at `version`: drawn and read, not yet counted as used."""
        replayed = None
        while count and len(self) and replayed is None:
            slots, weights = budget.draw(self.ledger, self.storage, count, generator, self.ledger.stale(version),
                                         if_short, n_fresh, multiple)
            if slots.numel() == 0:
                break
            plan = self.assembler.plan(self.ledger.slots, slots, weights, torch.zeros(slots.numel(), dtype=torch.bool),
                                       version, layout=layout)
            try:
                replayed = self.assembler.materialize(plan)
            except CorruptRows as exc:
                self._evict_corrupt(exc)  # then redraw ("skip") or raise
        budget.check_replayed(count, None if replayed is None else len(replayed), n_fresh, multiple, if_short)
        return replayed

    def _evict_corrupt(self, exc: CorruptRows, always_raise: bool = False) -> None:
        """Evict the live rollouts stored in the unreadable rows; raise unless on_corrupt='skip'
        (a caller that asked for specific slots always gets the error)."""
        hit, released = self.ledger.evict_rows(exc.shard_id, exc.rows)
        self._release(released)
        self.storage.counters["corrupt_rows"] += hit
        if always_raise or self.on_corrupt == "raise" or len(self) == 0:
            raise StorageError(f"{exc}; {hit} rollout(s) evicted, the rest of the buffer is intact") from exc

    def _record_use(self, slots: torch.Tensor, weights: torch.Tensor | None,
                    replay_weights: torch.Tensor | None) -> None:
        """Count the uses (evicting what reached max_reuse) and note the returned batch's weights."""
        self.ledger.note_weights(weights, replay_weights)
        self._release(self.ledger.record_use(slots))

    # -------------------------------------------------------------------------------- priorities
    def update_priorities(self, handles: Handles, advantages: torch.Tensor) -> int:
        """Set new advantages for still-live handles. Handles whose rollout was evicted or whose slot
        was reused are ignored and counted (`stale_handle_updates`). Returns how many applied.
        All-or-nothing: a priority the sampler rejects (an overflow) leaves every advantage as it was."""
        if not isinstance(handles, Handles):
            raise TypeError(f"handles must be Handles (from add/sample), got {type(handles).__name__}")
        return self.ledger.set_advantages(handles.slot, handles.generation, advantages)

    def metrics(self) -> dict[str, float]:
        """A flat dict of numbers for a logger: size, bytes, capacity, age and reuse histograms,
        the effective sample size of the last returned batch's IS weights (fraction of the batch),
        the mean IS weight of its replayed rows, evictions by reason, stale-handle updates, sampled
        fresh/replay counts, storage figures, checkpoint failures and lag."""
        checkpoints = self.checkpointer.metrics() if self.checkpointer is not None else {}
        return {**self.ledger.metrics(), "bytes": self.storage.total_bytes(), **self.storage.metrics(), **checkpoints}

    # ------------------------------------------------------ persistence (persistence.py, snapshot.py)
    def config(self) -> BufferConfig:
        """The configuration with the caps as they are now: `settings` (what checkpoints record)."""
        return self._settings

    def snapshot(self) -> BufferSnapshot:
        """This buffer's state without payloads, as a value (what a checkpoint publishes)."""
        return persistence.snapshot_of(self._settings, self.ledger, self.generator)

    @classmethod
    def from_snapshot(cls, snapshot: BufferSnapshot, sources: Mapping[int, ShardSource],
                      sampler: Sampler | None = None, storage: TieredStorage | None = None,
                      **overrides: Any) -> "RolloutBuffer":
        """A new buffer holding `snapshot` (its shards from `sources`: id -> ShardSource); `overrides` replace
        non-layout settings."""
        return persistence.rebuild(cls, snapshot, sources, sampler, storage, overrides)

    def restore_snapshot(self, snapshot: BufferSnapshot, sources: Mapping[int, ShardSource]) -> None:
        """Replace this buffer's state by `snapshot` in place, all-or-nothing (`load_state_dict`)."""
        persistence.restore(snapshot, sources, self._settings, self.ledger, self.keeper, self.generator)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: tensors and plain Python values (no pickle)."""
        return persistence.full_state(self.snapshot(), self.storage)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from `state_dict()`. Validates everything before changing anything."""
        self.restore_snapshot(*persistence.parse_full_state(state, self._settings))

    def checkpoint(self, tag: int | str | None = None, timeout: float | None = None) -> None:
        """Publish a manifest now (named by `tag`); returns once it is durable (CheckpointError if not)."""
        persistence.publish(self.checkpointer, tag, timeout)

    @classmethod
    def from_checkpoint(cls, uri: str, *, endpoint_url: str | None = None, sampler: Sampler | None = None,
                        storage: TieredStorage | None = None, checkpoint: ShardListener | bool = False,
                        lazy: bool = False, progress: bool = True, manifest: str | None = None,
                        tag: int | str | None = None, retry_budget_s: float = 60.0, **kwargs: Any) -> "RolloutBuffer":
        """A buffer restored from the manifest at `uri` published last, under `tag`, or named `manifest`;
        one object read may keep failing for `retry_budget_s` seconds."""
        return checkpoint_reader().restore(cls, uri, endpoint_url=endpoint_url, sampler=sampler, storage=storage,
                                           checkpoint=checkpoint, lazy=lazy, progress=progress,
                                           manifest_key=manifest, tag=tag, retry_budget_s=retry_budget_s, **kwargs)

    def import_checkpoint(self, uri: str, *, endpoint_url: str | None = None, version_offset: int = 0,
                          reprioritize=None, progress: bool = False, select=None, keep_reuse: bool = False,
                          tag: int | str | None = None, retry_budget_s: float = 60.0) -> Handles:
        """Add another run's live rollouts as new ones (nothing there changes); returns their handles.
        One object read may keep failing for `retry_budget_s` seconds."""
        return checkpoint_reader().import_rollouts(self, uri, endpoint_url=endpoint_url, progress=progress, tag=tag,
                                                   version_offset=version_offset, reprioritize=reprioritize,
                                                   select=select, keep_reuse=keep_reuse, retry_budget_s=retry_budget_s)

    def carry_reuse(self, handles: Handles, reuse: torch.Tensor) -> None:
        """Set use counts carried over from another run; rollouts already at max_reuse are evicted."""
        self._release(self.ledger.carry_reuse(handles.slot, reuse.to(torch.int64)))

    def attach_checkpointer(self, checkpointer: ShardListener, durable: dict[int, str] | None = None) -> None:
        """Checkpoint through `checkpointer` from now on; `durable`: shard id -> key already stored there."""
        persistence.attach_checkpointer(self.keeper, checkpointer, self, live_shards(self.ledger.slots)[0], durable)

    def detach_checkpointer(self) -> ShardListener | None:
        """Stop checkpointing; returns the checkpointer (not closed) or None."""
        return persistence.detach_checkpointer(self.keeper)

    # ---------------------------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Finish background work (spills, prefetch), publish a final checkpoint, release files."""
        self.assembler.close()
        self.keeper.close()

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
