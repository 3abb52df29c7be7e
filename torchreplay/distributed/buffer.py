"""DistributedRolloutBuffer: one `RolloutBuffer` per rank (its rank buffer) over `torch.distributed`.

Rollouts are added on the rank that generated them and never move at insertion. Two ways to sample:

- ``mode="local"``: each rank samples its own buffer; no rollout bytes move. One all_reduce per
  `sample` call shares every rank buffer's (count, total priority, min priority) so the IS weights are
  normalized over the whole job (see "IS weights" below).
- ``mode="global"``: exact prioritized sampling over the union of all rank buffers. Each rank receives
  `batch_size` rollouts; together the ranks hold one stratified global batch of
  `batch_size * world_size` draws with P(i) = p_i / sum over every rank of p_j.

Protocol of a global `sample` (collectives in this order, on every rank):

1. all_reduce of a [world, 8] float64 table (`stats`): every rank fills its own row (count,
   total, min priority, beta, batch size, arguments-ok, on rank 0 a random shift, and the buffer's
   policy version). It also carries argument checks, so bad input on one rank raises on
   every rank instead of leaving the others waiting in the next collective. If the versions differ
   (a rank added newer rollouts), every rank advances to the newest and the table is exchanged
   again: the staleness cap and version-dependent priorities must agree before one global draw.
2. Uniforms: no extra collective. The global total T is cut into `B * W` strata; rank r takes the
   strata k * W + r (k = 0..B-1), draws its position inside each from its own `generator`, and every
   point is rotated by a shift s in [0, T) that rank 0 draws from its generator and shares in the
   step-1 table. The union is a stratified sample of the whole mass; each rank's share is spread
   over the whole mass (a contiguous slice would hand rank 0 mostly its own buffer), and the shared
   rotation makes each rank's expected counts exact too (without it, rank r would be biased by
   O(1 / B) towards the start of each block of W strata). Distinct strata mean identical seeds on
   all ranks are fine; seed every rank's generator for reproducibility.
3. all_to_all of request counts, then all_to_all of the requests: the position within the owner's
   total as a fraction in [0, 1) (float64).
4. The owner draws at those positions within every rollout's reuse budget
   (`RolloutBuffer.draw_at`: draws past a budget are redrawn from the owner's buffer), counts the
   use (reuse cap and eviction apply on the owner, after the payload is read), and answers with
   one all_to_all of one byte row per rollout and one all_to_all per token field (`wire`).
5. The receiver pads to its batch's longest rollout and restores stratum order.

IS weights. In global mode P(i) = p_i / T, so w_i = (N P(i)) ** -beta / max_j (N P(j)) ** -beta
= (p_i / p_min) ** -beta (N and T cancel), with p_min the smallest live priority on any rank. In
local mode a rank draws from its own buffer, so rollout i of rank r is drawn with probability
p_i / (W * T_r): the weights use that, normalized by the smallest such probability over all ranks:
w_i = ((p_i / T_r) / min_s(p_min_s / T_s)) ** -beta. When all rank buffers have the same total this is
(p_i / p_min_global) ** -beta; when they do not, it still corrects the over-sampling of small
rank buffers, which the plain global-min formula would not. Weights are <= 1. `beta` must agree on
every rank (checked each call); a sampler outside the `ProportionalSampler` protocol counts as
beta 0.

Failures: see `comm` (a dead or stalled peer raises `ReplayError`, and the buffer refuses further
collectives). Checkpoints: see `generations`.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from torchreplay.assembly import effective_sample_size
from torchreplay.buffer import Handles, ReplayBatch, RolloutBuffer
from torchreplay.checkpoint import Checkpointer
from torchreplay.checkpoint.store import check_retry_budget
from torchreplay.checks import is_int
from torchreplay.distributed.comm import Comm, fingerprint, ranks_differing
from torchreplay.distributed.generations import (check_checkpoint_args, discard, import_share, newest_complete_generation,
                                                 rank_uri, restore_rank, start_generation)
from torchreplay.distributed.stats import (BATCH, BETA, COUNT, MIN, OK, SHIFT, TOTAL, VERSION, RankStats,
                                           ShardStats, job_metrics, rank_row)
from torchreplay.distributed.wire import WireFormat
from torchreplay.errors import CheckpointError, ReplayError
from torchreplay.samplers import ProportionalSampler

MODES = ("local", "global")
ONE_BELOW_ONE = math.nextafter(1.0, 0.0)


@dataclass(frozen=True)
class DistributedHandles(Handles):
    """Handles of sampled rollouts that may live on other ranks: `rank` is the owner (int64 [n],
    ranks within the buffer's process group); `slot` and `generation` are the owner's."""

    rank: torch.Tensor = None  # type: ignore[assignment]  # int64 [n]; dataclass field order needs a default

    def __post_init__(self) -> None:
        if not isinstance(self.rank, torch.Tensor) or self.rank.shape != self.slot.shape:
            raise ValueError("DistributedHandles.rank must be an int64 tensor shaped like slot")


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def check_sampler(buffer: RolloutBuffer, mode: str) -> None:
    sampler = buffer.sampler
    if mode == "global" and not (isinstance(sampler, ProportionalSampler) and sampler.proportional):
        raise TypeError("mode='global' needs a proportional tree sampler (PrioritizedSampler, "
                        f"FreshnessSampler or UniformSampler), got {type(sampler).__name__}")


def check_update(handles: Handles, advantages: torch.Tensor, rank: int, world: int, mode: str
                 ) -> tuple[str | None, torch.Tensor | None]:
    """What is wrong with `update_priorities` arguments (None: nothing), and each handle's owner."""
    if not isinstance(handles, Handles):
        return f"handles must be Handles (from add/sample), got {type(handles).__name__}", None
    if not isinstance(advantages, torch.Tensor) or not advantages.is_floating_point():
        return "advantages must be a floating-point tensor", None
    if advantages.numel() != len(handles):
        return f"advantages has {advantages.numel()} values for {len(handles)} handles", None
    if not bool(torch.isfinite(advantages).all()):
        return "advantages must be finite", None
    owner = handles.rank.cpu() if isinstance(handles, DistributedHandles) else torch.full_like(handles.slot.cpu(), rank)
    if owner.numel() and (int(owner.min()) < 0 or int(owner.max()) >= world):
        return f"handles.rank outside [0, {world})", owner
    if mode == "local" and bool((owner != rank).any()):
        return f"local mode: handles must belong to this rank ({rank})", owner
    return None, owner


class DistributedRolloutBuffer:
    """A `RolloutBuffer` on every rank of `process_group` (its rank buffer), sampled locally or globally.

    Collectives (call them on every rank of the group, in the same order): the constructor,
    `from_checkpoint`, `checkpoint`, `sample`, `rank_stats`, `advance`, `metrics(global_=True)`,
    and `update_priorities` in global mode. `add`, `len()`, `metrics()` and `close()` are local.

    Args:
        process_group: the group to run over (None: the default group). Its `timeout` bounds how long
            a call waits for a dead or stalled peer before raising `ReplayError`.
        mode: "local" (sample the own buffer, weights normalized globally, no payload traffic) or
            "global" (exact prioritized sampling over all rank buffers; payloads move by all_to_all).
        checkpoint_uri: run prefix ("file:///abs/path" or "s3://bucket/prefix") under which every
            rank checkpoints its buffer (layout in `torchreplay.distributed.generations`); None: no
            checkpoints. A prefix that already holds a complete checkpoint is refused: resume it
            with `from_checkpoint`.
        checkpoint_interval_s: seconds between each rank's automatic background manifests
            (checked on buffer calls); `checkpoint()` publishes on every rank at once.
        endpoint_url: S3 endpoint for `checkpoint_uri` (else AWS_ENDPOINT_URL / the AWS config).
        buffer: this rank's buffer, a built `RolloutBuffer` without a checkpointer (instead of
            `buffer_kwargs`); it is this object's from now on. Its configuration must be the same
            on every rank (checked).
        generation: with `checkpoint_uri`, keep checkpointing in this existing generation instead
            of starting a new one (what `from_checkpoint` passes; a buffer without a checkpointer
            gets one there and every rank publishes once).
        **buffer_kwargs: passed to the local `RolloutBuffer` (capacity, sampler, max_staleness, ...).
            Must be the same on every rank (checked at construction). Global mode needs a
            proportional tree sampler (`PrioritizedSampler`, `FreshnessSampler`, `UniformSampler`).
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, mode: str = "local",
                 checkpoint_uri: str | None = None, checkpoint_interval_s: float = 60.0,
                 endpoint_url: str | None = None, *, buffer: RolloutBuffer | None = None,
                 generation: int | None = None, **buffer_kwargs: Any) -> None:
        check_checkpoint_args(checkpoint_uri, checkpoint_interval_s, endpoint_url, buffer_kwargs)
        check_mode(mode)
        if buffer is not None and not isinstance(buffer, RolloutBuffer):
            raise TypeError(f"buffer must be a RolloutBuffer, got {type(buffer).__name__}")
        if buffer is not None and buffer_kwargs:
            raise TypeError(f"pass buffer= or RolloutBuffer arguments, not both (got {sorted(buffer_kwargs)})")
        if generation is not None and (checkpoint_uri is None or not is_int(generation) or generation < 0):
            raise ValueError(f"generation must be None or an int >= 0 with a checkpoint_uri, got {generation!r}")
        if buffer is not None and buffer.checkpointer is not None and generation is None:
            raise TypeError("buffer= already has a checkpointer: DistributedRolloutBuffer attaches its own "
                            "(pass checkpoint_uri)")
        self.comm = Comm(process_group)
        built = buffer is None
        self.buffer = RolloutBuffer(**buffer_kwargs) if built else buffer
        self.mode = mode
        self.wire = WireFormat(self.buffer.fields)
        self._counters: dict[str, float] = {"dist_sample_calls": 0, "dist_received": 0, "dist_served": 0,
                                            "dist_reuse_redraws": 0}
        self._last_ess = math.nan
        error: BaseException | None = None
        started = -1
        try:
            check_sampler(self.buffer, mode)
            if checkpoint_uri is not None and generation is None and self.rank == 0:
                started = start_generation(checkpoint_uri, self.world_size, None, endpoint_url)
        except Exception as e:  # noqa: BLE001 - raised after the collective, so peers do not wait
            error = e
        try:
            rows = self._check_same_config(error, checkpoint_uri, [started])
        except BaseException:
            if built:
                discard(self.buffer)
            raise
        self.checkpoint_uri = checkpoint_uri
        self.generation = generation if generation is not None or checkpoint_uri is None else int(rows[0, 2])
        if checkpoint_uri is not None and self.buffer.checkpointer is None:
            # Shards the buffer already holds are uploaded in the background (the next manifest waits for them).
            self.buffer.attach_checkpointer(Checkpointer(rank_uri(checkpoint_uri, self.generation, self.rank),
                                                         interval_s=checkpoint_interval_s, endpoint_url=endpoint_url))
            if generation is not None:
                # Until every rank of a resumed generation has published, resuming falls back to the old one.
                self.checkpoint()

    group = property(lambda self: self.comm.group)
    rank = property(lambda self: self.comm.rank)
    world_size = property(lambda self: self.comm.world_size)
    comm_device = property(lambda self: self.comm.device)

    # ------------------------------------------------------------------------------ agreement
    def _check_same_config(self, error: BaseException | None, checkpoint_uri: str | None,
                           extra: list[float]) -> torch.Tensor:
        """Collective: raise on every rank unless all built the same buffer; returns the rows
        [ok, fingerprint, *extra] of every rank."""
        # The buffer's whole configuration (sampler spec included, caps as they are now), the mode
        # and where it checkpoints: ranks that differ in any of them would sample inconsistently.
        fp = fingerprint(repr((self.mode, self.buffer.config().fingerprint(), checkpoint_uri))) if error is None else 0.0
        rows = self.comm.agree("config check", [fp, *extra], error)
        differ = ranks_differing(rows, 1, fp)
        if differ:
            raise ValueError(f"rank {self.rank}: ranks {differ} built their DistributedRolloutBuffer with a different "
                             "mode, buffer configuration, sampler or checkpoint uri; every rank must pass the same "
                             "arguments")
        return rows

    def _exchange(self, step: str, batch_size: int, error: str | None, shift: float = 0.0) -> torch.Tensor:
        """Step 1 of the protocol. Raises on every rank when any rank's arguments were bad."""
        rows = self.comm.gather_rows(step, rank_row(self.buffer, batch_size if error is None else 0, error is None,
                                                     shift))
        if error is not None:
            raise ValueError(error)
        bad = ranks_differing(rows, OK, 1.0)
        if bad:
            raise ReplayError(f"rank {self.rank}: {step} aborted because rank(s) {bad} rejected their arguments")
        return rows

    def rank_stats(self) -> RankStats:
        """Collective: every rank buffer's count, total and min priority."""
        rows = self._exchange("rank stats", 0, None)
        return RankStats(rows[:, COUNT].to(torch.int64), rows[:, TOTAL].clone(), rows[:, MIN].clone())

    def shard_stats(self) -> ShardStats:
        """`rank_stats()` under its old name (deprecated)."""
        warnings.warn("shard_stats() is renamed rank_stats()", DeprecationWarning, stacklevel=2)
        return self.rank_stats()

    # ------------------------------------------------------------------------------ checkpoints
    @classmethod
    def from_checkpoint(cls, uri: str, process_group: dist.ProcessGroup | None = None, mode: str = "local",
                        checkpoint_interval_s: float = 60.0, endpoint_url: str | None = None,
                        progress: bool = False, tag: int | str | None = None, retry_budget_s: float = 60.0,
                        **buffer_kwargs: Any) -> "DistributedRolloutBuffer":
        """Collective: resume from the newest complete checkpoint generation under the run prefix `uri`.

        Same world size: every rank restores its own buffer exactly (`RolloutBuffer.from_checkpoint`:
        slots, priorities, reuse counts, sampler and RNG state) and keeps checkpointing to the same
        place. Different world size: a new generation is started; every rank imports a disjoint
        share of the old ranks' storage shards (`plan_reshard`), with advantages, policy versions,
        group ids and use counts, sets its policy version to the newest old rank's, and then every
        rank publishes once. Slots, RNG and sampler state are not carried over in that case.
        Either way every live rollout of the old checkpoint lands on exactly one rank, except, when
        resharding a cut whose ranks were at different versions, the rollouts stale at the newest
        one (under `max_staleness`): those are dropped on every rank alike (docs/checkpoints.md).

        Args:
            uri: the run prefix the old job passed as `checkpoint_uri`; must be the same on every rank.
            process_group, mode, checkpoint_interval_s, endpoint_url: as for the constructor.
            progress: show download progress bars.
            tag: resume the checkpoint every rank published with `checkpoint(tag=...)` (e.g. the
                trainer step being resumed) in the newest complete generation, instead of LATEST.
            retry_budget_s: how long one object read of the old checkpoint may keep failing
                transiently before this rank's restore fails (`RolloutBuffer.from_checkpoint`).
            **buffer_kwargs: passed to the local `RolloutBuffer`; unset ones (capacity, staleness and
                reuse caps, schema, built-in sampler) come from the checkpoint. When resharding,
                each new rank's share must fit its `capacity` (ValueError otherwise, before anything
                is imported), e.g. 4 -> 2 ranks usually needs a larger capacity.
        """
        check_checkpoint_args(uri, checkpoint_interval_s, endpoint_url, buffer_kwargs, required=True)
        if not isinstance(progress, bool):
            raise TypeError(f"progress must be a bool, got {type(progress).__name__}")
        check_retry_budget(retry_budget_s)
        check_mode(mode)
        comm = Comm(process_group)
        rank, world = comm.rank, comm.world_size
        # Step 1: rank 0 reads the layout (and records a new generation when resharding).
        layout, error = [-1.0, -1.0, -1.0], None
        if rank == 0:
            try:
                source, source_world = newest_complete_generation(uri, endpoint_url)
                target = source if source_world == world else start_generation(uri, world, source, endpoint_url)
                layout = [float(source), float(source_world), float(target)]
            except Exception as e:  # noqa: BLE001 - raised after the collective, so peers do not wait
                error = e
        rows = comm.agree("from_checkpoint: layout", [fingerprint(uri), *layout], error)
        differ = ranks_differing(rows, 1, float(rows[0, 1]))
        if differ:
            raise ValueError(f"rank {rank}: ranks {differ} passed a different uri than rank 0; "
                             "every rank must pass the same run prefix")
        source, source_world, target = (int(x) for x in rows[0, 2:5].tolist())
        # Step 2: every rank builds its buffer; then all check they read the same manifests.
        built, error, plan = None, None, 0.0
        try:
            if source_world == world:
                built = restore_rank(uri, source, rank, checkpoint_interval_s, endpoint_url, progress, tag,
                                     buffer_kwargs, retry_budget_s)
            else:
                built, plan = import_share(uri, source, source_world, rank, world, endpoint_url, progress,
                                           buffer_kwargs, tag, retry_budget_s)
            check_sampler(built, mode)
        except Exception as e:  # noqa: BLE001 - raised by agree, after the collective
            error = e
        try:
            rows = comm.agree("from_checkpoint: reshard plan", [plan], error)
            differ = ranks_differing(rows, 1, float(rows[0, 1]))
            if differ:
                raise CheckpointError(f"rank {rank}: ranks {differ} planned the resharding from different manifests "
                                      f"of generation {source} (was the old job still writing?)")
            resumed = cls(process_group, mode, uri, checkpoint_interval_s, endpoint_url, buffer=built,
                          generation=target)
        except BaseException:
            discard(built)
            raise
        resumed.comm.absorb(comm)
        return resumed

    def checkpoint(self, tag: int | str | None = None, timeout: float | None = None) -> None:
        """Collective: every rank publishes a manifest of its buffer; returns on every rank once all
        of them are durable (a consistent cut of the job), under `tag` if given (the trainer's
        step: `from_checkpoint(uri, tag=step)` resumes exactly this cut). `timeout` (seconds)
        bounds the local wait; a rank whose publish fails raises its CheckpointError, the others
        ReplayError."""
        if self.checkpoint_uri is None:
            raise ValueError("this DistributedRolloutBuffer has no checkpoint_uri")
        error = None
        try:
            self.buffer.checkpoint(tag=tag, timeout=timeout)
        except Exception as e:  # noqa: BLE001 - raised by agree, after the collective
            error = e
        self.comm.agree("checkpoint", [], error)

    def close(self) -> None:
        """Local: finish this rank's background work and, with a checkpoint_uri, publish a final
        manifest of its buffer (not a consistent cut across ranks: call `checkpoint()` for that)."""
        self.buffer.close()

    # ------------------------------------------------------------------------------ local API
    def add(self, batch: Any) -> Handles:
        """Store rollouts generated on this rank in this rank's buffer (no communication)."""
        return self.buffer.add(batch)

    def __len__(self) -> int:
        """Rollouts in this rank's buffer."""
        return len(self.buffer)

    @property
    def version(self) -> int:
        """This rank buffer's policy version (equal on every rank after `advance`)."""
        return self.buffer.version

    # ------------------------------------------------------------------------------ sampling
    def sample(self, batch_size: int, device: torch.device | str | None = None,
               generator: torch.Generator | None = None) -> ReplayBatch:
        """Collective: `batch_size` rollouts for this rank (with replacement), padded, on `device`.

        `batch_size` must be the same on every rank. The batch's `handles` are `DistributedHandles`
        (owner rank, slot, generation); `weights` are IS weights normalized over all ranks (max 1).
        In global mode `generator` draws this rank's positions (and, on rank 0, the shared shift).
        `device=None` leaves tensors where they were built: the CPU with gloo; with NCCL the
        received token fields and attention mask stay on the GPU they arrived on.
        """
        error = None
        if not is_int(batch_size) or batch_size < 1:
            error = f"batch_size must be an int >= 1, got {batch_size!r}"
        elif generator is not None and not isinstance(generator, torch.Generator):
            error = f"generator must be a torch.Generator or None, got {type(generator).__name__}"
        shift = 0.0
        if error is None and self.mode == "global" and self.rank == 0:
            shift = float(torch.rand(1, dtype=torch.float64, generator=generator))
        rows = self._exchange("sample: rank stats", batch_size if error is None else 0, error, shift)
        newest = int(rows[:, VERSION].max())
        if int(rows[:, VERSION].min()) != newest:
            # A rank that added newer rollouts moved its own version. Every rank moves to the
            # newest first, so the staleness cap and version-dependent priorities (FreshnessSampler's
            # reference) are the same on all of them; then the rank stats are taken again.
            failed = None
            try:
                self.buffer.advance(newest)
            except Exception as e:  # noqa: BLE001 - raised by _exchange, after the collective
                failed = f"advancing to version {newest} failed: {e}"
            rows = self._exchange("sample: rank stats", batch_size, failed, shift)
        sizes = rows[:, BATCH]
        if bool((sizes != batch_size).any()):
            raise ValueError(f"batch_size must be the same on every rank, got {sizes.to(torch.int64).tolist()}")
        betas = rows[:, BETA]
        if bool((betas != betas[0]).any()):
            raise ValueError(f"sampler beta must be the same on every rank, got {betas.tolist()}")
        self._counters["dist_sample_calls"] += 1
        out = self._sample_local(batch_size, rows, generator) if self.mode == "local" else \
            self._sample_global(batch_size, rows, generator)
        self._last_ess = effective_sample_size(out.weights)
        self._counters["dist_received"] += batch_size
        return out if device is None else out.to(device)

    def _sample_local(self, batch_size: int, rows: torch.Tensor, generator: torch.Generator | None) -> ReplayBatch:
        empty = (rows[:, COUNT] == 0).nonzero().flatten().tolist()
        if empty:
            raise ValueError(f"cannot sample in local mode: the buffer of rank(s) {empty} is empty")
        batch = self.buffer.sample(batch_size, generator=generator)
        beta = float(rows[self.rank, BETA])
        sampler = self.buffer.sampler
        if beta and isinstance(sampler, ProportionalSampler) and sampler.weight_norm == "buffer_max":
            # The sampler normalized by this rank buffer's min; rescale to the job-wide smallest probability.
            # (The batch norms need nothing: within one rank's batch its buffer's total cancels.)
            ratio = rows[:, MIN] / rows[:, TOTAL]
            factor = (ratio[self.rank] / ratio.min()) ** -beta
            batch.weights = (batch.weights.double() * factor).to(torch.float32)
        self._counters["dist_served"] += batch_size
        rank = torch.full_like(batch.handles.slot, self.rank)
        batch.handles = DistributedHandles(batch.handles.slot, batch.handles.generation, rank)
        return batch

    def _sample_global(self, batch_size: int, rows: torch.Tensor, generator: torch.Generator | None) -> ReplayBatch:
        totals = rows[:, TOTAL]
        total = float(totals.sum())
        if not total > 0:
            raise ValueError("cannot sample: every rank's buffer is empty")
        world, rank, comm = self.world_size, self.rank, self.comm
        # Stratum k * W + rank of B * W (module docstring, step 2).
        strata = torch.arange(batch_size, dtype=torch.float64) * world + rank
        u = (strata + torch.rand(batch_size, dtype=torch.float64, generator=generator)) / (batch_size * world)
        u = torch.remainder(u + float(rows[:, SHIFT].sum()), 1.0) * total
        ends = torch.cumsum(totals, 0)
        last = int((totals > 0).nonzero().max())
        owner = torch.searchsorted(ends, u, right=True).clamp(max=last)
        frac = ((u - (ends[owner] - totals[owner])) / totals[owner]).clamp(0.0, ONE_BELOW_ONE)
        order = torch.argsort(owner, stable=True)
        send_counts = torch.bincount(owner, minlength=world).tolist()
        recv_counts = comm.all_to_all("sample: request counts", torch.tensor(send_counts).reshape(world, 1),
                                      [1] * world, [1] * world, payload=False).reshape(-1).cpu().tolist()
        requests = comm.all_to_all("sample: requests", frac[order].reshape(-1, 1), send_counts, recv_counts,
                                   payload=False).reshape(-1).cpu()
        reply, token_bytes, lengths, failure = self._serve(requests)
        tokens_per_peer = [int(s.sum()) for s in torch.split(lengths, recv_counts)]
        # Replies: per-rollout bytes, then one tensor per token field.
        got = self.wire.read_rows(comm.all_to_all("sample: rollout fields", reply, recv_counts, send_counts,
                                                  payload=True).cpu())
        tokens_from = [int(s.sum()) for s in torch.split(got["length"], send_counts)]
        got_tokens = {name: comm.all_to_all(f"sample: field {name!r}", data, tokens_per_peer, tokens_from,
                                            payload=True) for name, data in token_bytes.items()}
        if failure is not None:
            raise failure
        failed = owner[order][got["status"] != 0].unique().tolist()
        if failed:
            raise ReplayError(f"rank {self.rank}: rank(s) {failed} could not read the requested rollouts "
                              "(their own error names the cause)")
        restore = torch.argsort(order)
        buf = self.buffer
        data = self.wire.batch_data(got, got_tokens, restore, self.comm_device, buf.padding_side, buf.pad_token_id)
        weights = buf.sampler.is_weights(got["priority"][restore], float(rows[:, MIN].min()))
        handles = DistributedHandles(got["slot"][restore], got["generation"][restore], owner[order][restore].clone())
        fresh = torch.zeros(restore.numel(), dtype=torch.bool)
        return ReplayBatch.assembled(data, handles, weights=weights, age=got["age"][restore],
                                     reuse=got["reuse"][restore], is_fresh=fresh,
                                     token_fields=self.wire.token_fields, pad_token_id=buf.pad_token_id)

    def _serve(self, requests: torch.Tensor
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, BaseException | None]:
        """Owner side: draw the requested rollouts, count their use, pack the reply (`wire`).

        A failure to read the rollouts (e.g. a storage error) does not skip the remaining
        collectives, which would leave the peers waiting: the reply carries status 1 and no tokens,
        and the error is returned to be raised once the exchange is over."""
        n = requests.numel()
        slots, prio = torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.float64)
        batch, failure = None, None
        if n:
            try:
                # Each slot's draws past its reuse budget are redrawn from this rank's buffer, so no rollout
                # exceeds max_reuse even when several ranks requested it.
                slots, prio, redrawn = self.buffer.draw_at(requests)
                self._counters["dist_reuse_redraws"] += redrawn
                batch = self.buffer.gather(slots, count_use=True)
            except Exception as e:  # noqa: BLE001 - re-raised by the caller after the exchange
                failure = e
        self._counters["dist_served"] += n
        reply, token_bytes, lengths = self.wire.reply(slots, prio, batch)
        return reply, token_bytes, lengths, failure

    # ------------------------------------------------------------------------------ priorities
    def update_priorities(self, handles: Handles, advantages: torch.Tensor) -> int:
        """Set new advantages for sampled rollouts; returns how many this rank's buffer applied.

        Local mode: applied to this rank's buffer, no communication (handles must be this rank's).
        Global mode: a collective; each update is routed to the owner rank by all_to_all. Handles
        whose rollout was evicted or whose slot was reused are ignored and counted on the owner.
        """
        error, owner = check_update(handles, advantages, self.rank, self.world_size, self.mode)
        if self.mode == "local":
            if error is not None:
                raise ValueError(error)
            return self.buffer.update_priorities(Handles(handles.slot, handles.generation), advantages)
        self._exchange("update_priorities: check", 0, error)
        adv = advantages.detach().cpu().reshape(-1).to(torch.float64)
        order = torch.argsort(owner, stable=True)
        send = torch.stack([handles.slot.cpu()[order], handles.generation.cpu()[order],
                            adv[order].view(torch.int64)], 1)
        send_counts = torch.bincount(owner, minlength=self.world_size)
        ones = [1] * self.world_size
        recv_counts = self.comm.all_to_all("update_priorities: counts", send_counts.reshape(-1, 1), ones, ones,
                                           payload=False).reshape(-1).cpu().tolist()
        got = self.comm.all_to_all("update_priorities: updates", send, send_counts.tolist(), recv_counts,
                                   payload=False).cpu()
        return self.buffer.update_priorities(Handles(got[:, 0].clone(), got[:, 1].clone()),
                                             got[:, 2].contiguous().view(torch.float64))

    # ------------------------------------------------------------------------------ versions
    def advance(self, policy_version: int) -> int:
        """Collective: set the policy version on every rank and evict rollouts past `max_staleness`.

        Every rank must pass the same version, and no rank buffer may already hold a newer one. Returns
        the number of rollouts this rank's buffer evicted.
        """
        error = None
        if not is_int(policy_version):
            error = f"policy_version must be an int, got {type(policy_version).__name__}"
        v = policy_version if error is None else 0
        # One MAX reduce: [bad flag, v, -v (min via max of negatives), this rank buffer's version].
        bad, v_max, neg_v_min, version_max = self.comm.max_reduce(
            "advance", [0 if error is None else 1, v, -v, self.buffer.version])
        if error is not None:
            raise TypeError(error)
        if bad:
            raise ReplayError(f"rank {self.rank}: advance aborted because another rank passed a bad policy_version")
        if v_max != -neg_v_min:
            raise ValueError(f"policy_version must be the same on every rank, got values from {-neg_v_min} to {v_max}")
        if version_max > policy_version:
            raise ValueError(f"policy_version must not go backwards: {policy_version} < {version_max} "
                             "(the newest version already held by some rank)")
        return self.buffer.advance(policy_version)

    # ------------------------------------------------------------------------------ metrics
    def metrics(self, global_: bool = False) -> dict[str, float]:
        """This rank buffer's `RolloutBuffer.metrics()` plus distributed counters (`dist_*`: sample calls,
        rollouts received by / served from this rank, payload and control bytes sent to other ranks).

        `global_=True` is a collective (one all_reduce) returning job-wide figures: counts, bytes
        and histograms summed; `age_max`, `policy_version`, `sample_calls` maxed; `age_mean`,
        `reuse_mean` weighted by rank buffer size; `ess_fraction` averaged over ranks.
        """
        out = self.buffer.metrics()
        out.update(self._counters)
        out.update(self.comm.counters)
        out["dist_ess_fraction"] = self._last_ess
        if self.mode == "global":
            # The rank buffer's own sample() is bypassed in global mode; report what this rank received.
            out["sampled_replay"] = self._counters["dist_received"]
            out["sample_calls"] = self._counters["dist_sample_calls"]
            out["ess_fraction"] = self._last_ess
        if not global_:
            return {**out, "rank": self.rank, "world_size": self.world_size}
        keys = sorted(out)
        rows = self.comm.gather_rows("metrics", torch.tensor([float(out[k]) for k in keys], dtype=torch.float64))
        return {**job_metrics(keys, rows), "world_size": self.world_size}
