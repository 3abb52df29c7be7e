"""DistributedRolloutBuffer: one `RolloutBuffer` shard per rank over `torch.distributed`.

Rollouts are added on the rank that generated them and never move at insertion. Two ways to sample:

- ``mode="local"``: each rank samples its own shard; no rollout bytes move. One all_reduce per
  `sample` call shares every shard's (count, total priority, min priority) so the IS weights are
  normalized over the whole job (see "IS weights" below).
- ``mode="global"``: exact prioritized sampling over the union of all shards. Each rank receives
  `batch_size` rollouts; together the ranks hold one stratified global batch of
  `batch_size * world_size` draws with P(i) = p_i / sum over every rank of p_j.

Protocol of a global `sample` (collectives in this order, on every rank):

1. all_reduce of a [world, 8] float64 table: every rank fills its own row (count, total, min
   priority, beta, batch size, arguments-ok, on rank 0 a random shift, and the shard's policy
   version) and zeros elsewhere, so a SUM reduce gathers all rows in one collective, exactly
   (adding zeros is exact). It also carries argument checks, so bad input on one rank raises on
   every rank instead of leaving the others waiting in the next collective. If the versions differ
   (a rank added newer rollouts), every rank advances to the newest and the table is exchanged
   again: the staleness cap and version-dependent priorities must agree before one global draw.
2. Uniforms: no extra collective. The global total T is cut into `B * W` strata; rank r takes the
   strata k * W + r (k = 0..B-1), draws its position inside each from its own `generator`, and every
   point is rotated by a shift s in [0, T) that rank 0 draws from its generator and shares in the
   step-1 table. The union is a stratified sample of the whole mass; each rank's share is spread
   over the whole mass (a contiguous slice would hand rank 0 mostly its own shard), and the shared
   rotation makes each rank's expected counts exact too (without it, rank r would be biased by
   O(1 / B) towards the start of each block of W strata). Distinct strata mean identical seeds on
   all ranks are fine; seed every rank's generator for reproducibility.
3. all_to_all of request counts, then all_to_all of the requests: the position within the owner's
   total as a fraction in [0, 1) (float64).
4. The owner descends its tree (`SegmentTree.sample(u=..., stratified=False)`), counts the use
   (reuse cap and eviction apply on the owner, after the payload is read), and answers with one
   all_to_all for all per-rollout fields (one byte row per rollout: length, slot, generation, reuse,
   age, priority, reward, advantage, ...) and one all_to_all per token field (the requested rollouts'
   tokens concatenated, no padding). Every field is sent as its raw bytes (`Tensor.view(torch.uint8)`)
   so bool, bfloat16 and the narrow routing dtypes travel on any backend.
5. The receiver pads to its batch's longest rollout and restores stratum order.

IS weights. In global mode P(i) = p_i / T, so w_i = (N P(i)) ** -beta / max_j (N P(j)) ** -beta
= (p_i / p_min) ** -beta (N and T cancel), with p_min the smallest live priority on any rank. In
local mode a rank draws from its own shard, so rollout i of rank r is drawn with probability
p_i / (W * T_r): the weights use that, normalized by the smallest such probability over all ranks:
w_i = ((p_i / T_r) / min_s(p_min_s / T_s)) ** -beta. When all shards have the same total this is
(p_i / p_min_global) ** -beta; when they do not, it still corrects the over-sampling of small
shards, which the plain global-min formula would not. Weights are <= 1.
`beta` must agree on every rank (checked each call).

Failures. Every collective goes through one wrapper: a backend error (a peer rank died, or did not
arrive within the process group's `timeout`, as set in `init_process_group(timeout=...)` or
`new_group(timeout=...)`) becomes a `ReplayError` naming the step, the rank and the likely cause, and
the buffer refuses further collectives.

Checkpoints. With `checkpoint_uri`, every rank's shard checkpoints through its own `Checkpointer`
(background shard uploads, a manifest every `checkpoint_interval_s` seconds and on `checkpoint()`).
Layout under the run prefix::

    state/generation-<g>.json     {"generation": g, "world_size": W, "parent": g' or null, ...};
                                  written by rank 0 before any rank of generation g publishes
    gen-<g>/rank-<r>/...          rank r's checkpoint in generation g (the `Checkpointer` layout:
                                  shards/, state/, manifests/, LATEST)

A generation is one lineage of one world size. It is *complete* once every one of its W ranks has
published a manifest (its `LATEST` exists); a reader resumes from the newest complete generation,
so a generation whose ranks had not all published when the job died is skipped and its parent is
still whole. `from_checkpoint` on the same world size restores each rank exactly from its own
directory and keeps checkpointing there. On a different world size it starts generation g + 1 (one
above the newest record, complete or not) and nothing writes the old generation again: every new
rank imports a disjoint set of whole old shards (storage shards, i.e. the rollouts of one `add`
call; each goes to exactly one new rank), carrying advantages, policy versions, group ids and use
counts; then every rank publishes once, which makes the new generation complete. Old generations
are never deleted by torchreplay; delete `gen-<g>/` yourself once a newer generation is complete.
Do not point a plain `Checkpointer` at the run prefix itself: its garbage collection would remove
the generation records in `state/`.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import json
import math
import re
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from torchreplay.assembly import effective_sample_size, padding_mask
from torchreplay.buffer import Handles, ReplayBatch, RolloutBuffer
from torchreplay.checkpoint import Checkpointer, open_store, read_manifest
from torchreplay.checkpoint.store import ObjectStore
from torchreplay.errors import CheckpointError, ReplayError
from torchreplay.samplers import ProportionalSampler
from torchreplay.schema import ROLLOUT, TOKEN

MODES = ("local", "global")
# Columns of the per-call shard table (see the module docstring, step 1).
_COUNT, _TOTAL, _MIN, _BETA, _BATCH, _OK, _SHIFT, _VERSION = range(8)
_ONE_BELOW_ONE = math.nextafter(1.0, 0.0)
# Per-rollout fields the receiver rebuilds from the owner's slot table.
_META_INT = ("status", "length", "slot", "generation", "reuse", "age", "prompt_len", "group_id", "policy_version")
_META_FLOAT = ("priority", "reward", "advantage")
# Generation records of the checkpoint layout (module docstring, "Checkpoints").
_GENERATION_KEY = re.compile(r"^state/generation-([0-9]{1,9})\.json$")
_LAYOUT_VERSION = 1


@dataclass(frozen=True)
class DistributedHandles(Handles):
    """Handles of sampled rollouts that may live on other ranks: `rank` is the owner (int64 [n],
    ranks within the buffer's process group); `slot` and `generation` are the owner's."""

    rank: torch.Tensor = None  # type: ignore[assignment]  # int64 [n]; dataclass field order needs a default

    def __post_init__(self) -> None:
        if not isinstance(self.rank, torch.Tensor) or self.rank.shape != self.slot.shape:
            raise ValueError("DistributedHandles.rank must be an int64 tensor shaped like slot")


@dataclass(frozen=True)
class ShardStats:
    """Every shard's figures as of one collective: `count` (rollouts, int64 [W]), `total` and `min`
    (sum and smallest positive priority, float64 [W]; min is +inf for an empty shard)."""

    count: torch.Tensor
    total: torch.Tensor
    min: torch.Tensor

    @property
    def global_count(self) -> int:
        return int(self.count.sum())

    @property
    def global_total(self) -> float:
        return float(self.total.sum())

    @property
    def global_min(self) -> float:
        return float(self.min.min())


def _to_bytes(t: torch.Tensor, rows: int) -> torch.Tensor:
    """A [rows, ...] tensor as its raw bytes, [rows, bytes per row] uint8."""
    return t.contiguous().view(torch.uint8).reshape(rows, math.prod(t.shape[1:]) * t.element_size())


def _from_bytes(b: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Inverse of `_to_bytes`: [rows, bytes per row] uint8 -> [rows, *shape] of `dtype`.

    Copied into a fresh [rows, width] buffer first: a column slice of a packed row keeps the row's
    stride, which `view(dtype)` rejects unless it divides by the element size (a single row is
    "contiguous" whatever its stride, so `.contiguous()` would not fix it)."""
    dense = torch.empty(b.shape, dtype=torch.uint8, device=b.device).copy_(b)
    return dense.view(dtype).reshape(b.shape[0], *shape)


def _row_bytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _fingerprint(text: str) -> float:
    """48 bits of a SHA-256, as a float64 (exact) for the per-call tables."""
    return float(int.from_bytes(hashlib.sha256(text.encode()).digest()[:6], "big"))


# ------------------------------------------------------------------------------ checkpoint layout
def rank_uri(uri: str, generation: int, rank: int) -> str:
    """Where rank `rank` of generation `generation` checkpoints under the run prefix `uri`."""
    return f"{uri.rstrip('/')}/gen-{generation}/rank-{rank}"


def _generation_records(store: ObjectStore) -> dict[int, int]:
    """generation -> world size, from the records under the run prefix's `state/`."""
    out: dict[int, int] = {}
    for key in store.list("state"):
        m = _GENERATION_KEY.match(key)
        if m is None:
            continue
        try:
            record = json.loads(store.get(key))
        except ValueError as exc:
            raise CheckpointError(f"{store.uri}/{key} is not valid JSON") from exc
        generation = int(m.group(1))
        world = record.get("world_size") if isinstance(record, dict) else None
        if (not isinstance(record, dict) or record.get("generation") != generation
                or isinstance(world, bool) or not isinstance(world, int) or world < 1):
            raise CheckpointError(f"{store.uri}/{key} is not a generation record of generation {generation}: {record!r}")
        out[generation] = world
    return out


def _missing_ranks(uri: str, generation: int, world: int, endpoint_url: str | None) -> list[int]:
    return [r for r in range(world) if not open_store(rank_uri(uri, generation, r), endpoint_url).exists("LATEST")]


def newest_complete_generation(uri: str, endpoint_url: str | None = None) -> tuple[int, int]:
    """(generation, world size) of the newest generation under `uri` in which every rank has
    published a manifest. Raises CheckpointError when there is none."""
    records = _generation_records(open_store(uri, endpoint_url))
    incomplete = []
    for generation in sorted(records, reverse=True):
        missing = _missing_ranks(uri, generation, records[generation], endpoint_url)
        if not missing:
            return generation, records[generation]
        incomplete.append(f"generation {generation} (world size {records[generation]}) lacks rank(s) {missing}")
    detail = "; ".join(incomplete) if incomplete else "no generation records under state/"
    raise CheckpointError(f"no complete DistributedRolloutBuffer checkpoint under {uri}: {detail}")


def _start_generation(uri: str, world: int, parent: int | None, endpoint_url: str | None) -> int:
    """Write the record of a new generation one above every existing one; returns its number.

    Without a parent (a fresh buffer) a prefix that already holds a complete generation is refused:
    the new generation would hide it from `from_checkpoint` once complete."""
    store = open_store(uri, endpoint_url)
    records = _generation_records(store)
    if parent is None:
        complete = [g for g in sorted(records, reverse=True) if not _missing_ranks(uri, g, records[g], endpoint_url)]
        if complete:
            raise ValueError(f"checkpoint_uri {uri} already holds a complete checkpoint (generation {complete[0]}, "
                             f"world size {records[complete[0]]}): resume it with "
                             "DistributedRolloutBuffer.from_checkpoint, or use a new prefix")
    generation = max(records, default=-1) + 1
    record = {"format_version": _LAYOUT_VERSION, "generation": generation, "world_size": world, "parent": parent,
              "created_unix_s": time.time()}
    store.put(f"state/generation-{generation}.json", json.dumps(record).encode())
    return generation


def plan_reshard(live_rows: list[list[int]], world_size: int) -> list[list[int]]:
    """Assign every old storage shard to exactly one new rank.

    `live_rows[o][i]` is the live rollouts of shard i (manifest order) of old rank o; returns
    `owner[o][i]`, the new rank that imports it. Largest shard first to the least loaded new rank
    (ties: lower old rank and index, then lower new rank), so the shares differ by at most one
    shard's rollouts; a plain round robin over shards could put several large ones on one rank
    and overflow its capacity. Deterministic: every rank computes the same plan.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    owner = [[-1] * len(rows) for rows in live_rows]
    loads = [(0, r) for r in range(world_size)]  # (live rollouts, new rank), a min-heap
    pairs = sorted(((-n, o, i) for o, rows in enumerate(live_rows) for i, n in enumerate(rows)))
    for neg_n, o, i in pairs:
        load, r = heapq.heappop(loads)
        owner[o][i] = r
        heapq.heappush(loads, (load - neg_n, r))
    return owner


def _check_checkpoint_args(uri: str | None, interval_s: float, endpoint_url: str | None,
                           buffer_kwargs: dict[str, Any], required: bool = False) -> None:
    if uri is None and required:
        raise TypeError("uri must be a str (file:///abs/path or s3://bucket/prefix), got None")
    if uri is not None:
        if not isinstance(uri, str):
            raise TypeError(f"checkpoint uri must be a str, got {type(uri).__name__}")
        if not uri.startswith(("file:///", "s3://")):
            raise ValueError(f"checkpoint uri must be file:///abs/path or s3://bucket/prefix, got {uri!r}")
    if isinstance(interval_s, bool) or not isinstance(interval_s, (int, float)) or not interval_s > 0:
        raise ValueError(f"checkpoint_interval_s must be a number > 0, got {interval_s!r}")
    if endpoint_url is not None and not isinstance(endpoint_url, str):
        raise TypeError(f"endpoint_url must be a str or None, got {type(endpoint_url).__name__}")
    if "checkpoint" in buffer_kwargs:
        raise TypeError("DistributedRolloutBuffer builds each rank's Checkpointer itself: pass checkpoint_uri "
                        "(and checkpoint_interval_s), not checkpoint=")


def _check_sampler(buffer: RolloutBuffer, mode: str) -> None:
    sampler = buffer.sampler
    if mode == "global" and not (isinstance(sampler, ProportionalSampler) and sampler.proportional):
        raise TypeError("mode='global' needs a proportional tree sampler (PrioritizedSampler, "
                        f"FreshnessSampler or UniformSampler), got {type(buffer.sampler).__name__}")


def _discard(buffer: RolloutBuffer | None) -> None:
    """Drop a shard built by a failed collective call: no final checkpoint, files released."""
    if buffer is None:
        return
    ckpt = buffer.detach_checkpointer()
    if ckpt is not None:
        with contextlib.suppress(CheckpointError):
            ckpt.close(final=False)
    buffer.close()


class DistributedRolloutBuffer:
    """A `RolloutBuffer` shard on every rank of `process_group`, sampled locally or globally.

    Collectives (call them on every rank of the group, in the same order): the constructor,
    `from_checkpoint`, `checkpoint`, `sample`, `shard_stats`, `advance`, `metrics(global_=True)`,
    and `update_priorities` in global mode. `add`, `len()`, `metrics()` and `close()` are local.

    Args:
        process_group: the group to run over (None: the default group). Its `timeout` bounds how long
            a call waits for a dead or stalled peer before raising `ReplayError`.
        mode: "local" (sample the own shard, weights normalized globally, no payload traffic) or
            "global" (exact prioritized sampling over all shards; payloads move by all_to_all).
        checkpoint_uri: run prefix ("file:///abs/path" or "s3://bucket/prefix") under which every
            rank checkpoints its shard (layout in the module docstring); None: no checkpoints. A
            prefix that already holds a complete checkpoint is refused: resume it with
            `from_checkpoint`.
        checkpoint_interval_s: seconds between each rank's automatic background manifests
            (checked on buffer calls); `checkpoint()` publishes on every rank at once.
        endpoint_url: S3 endpoint for `checkpoint_uri` (else AWS_ENDPOINT_URL / the AWS config).
        **buffer_kwargs: passed to the local `RolloutBuffer` (capacity, sampler, max_staleness, ...).
            Must be the same on every rank (checked at construction). Global mode needs a
            proportional tree sampler (`PrioritizedSampler`, `FreshnessSampler`, `UniformSampler`).
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, mode: str = "local",
                 checkpoint_uri: str | None = None, checkpoint_interval_s: float = 60.0,
                 endpoint_url: str | None = None, **buffer_kwargs: Any) -> None:
        _check_checkpoint_args(checkpoint_uri, checkpoint_interval_s, endpoint_url, buffer_kwargs)
        self._bind(process_group, mode)
        buffer = RolloutBuffer(**buffer_kwargs)
        _check_sampler(buffer, mode)
        self.buffer = buffer
        error: BaseException | None = None
        generation = -1
        if checkpoint_uri is not None and self.rank == 0:
            try:
                generation = _start_generation(checkpoint_uri, self.world_size, None, endpoint_url)
            except Exception as e:  # noqa: BLE001 - raised after the collective, so peers do not wait
                error = e
        rows = self._check_same_config(error, checkpoint_uri, [generation])
        self.checkpoint_uri = checkpoint_uri
        self.generation: int | None = None
        if checkpoint_uri is not None:
            self.generation = int(rows[0, 2])
            self._attach_checkpointer(Checkpointer(rank_uri(checkpoint_uri, self.generation, self.rank),
                                                   interval_s=checkpoint_interval_s, endpoint_url=endpoint_url))

    def _bind(self, process_group: dist.ProcessGroup | None, mode: str) -> None:
        """Validate the mode and the process group; set the communication state (no collective)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not dist.is_available() or not dist.is_initialized():
            raise ReplayError("DistributedRolloutBuffer needs torch.distributed initialized "
                              "(call torch.distributed.init_process_group first)")
        self.buffer: RolloutBuffer = None  # type: ignore[assignment]  # set once built
        self.mode = mode
        self.group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        backend = str(dist.get_backend(process_group)).lower()
        # NCCL moves only device tensors; the shard itself stays in host memory.
        self.comm_device = (torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend
                            else torch.device("cpu"))
        self._failed: str | None = None
        self._counters: dict[str, float] = {
            "dist_sample_calls": 0, "dist_received": 0, "dist_served": 0, "dist_reuse_redraws": 0,
            "dist_payload_bytes_sent": 0, "dist_control_bytes_sent": 0,
        }
        self._last_ess = math.nan
        self.checkpoint_uri = None
        self.generation = None

    def _attach_checkpointer(self, ckpt: Checkpointer) -> None:
        """Checkpoint the local shard through `ckpt` from now on; shards it already holds are
        uploaded in the background (the next manifest waits for them)."""
        self.buffer.attach_checkpointer(ckpt)

    # ------------------------------------------------------------------------------ plumbing
    def _collective(self, step: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._failed is not None:
            raise ReplayError(f"rank {self.rank}: the buffer's process group failed earlier ({self._failed}); "
                              "recreate the process group and the buffer")
        try:
            return fn(*args, group=self.group, **kwargs)
        except RuntimeError as e:  # DistBackendError and gloo/nccl errors are RuntimeErrors
            text = str(e)
            low = text.lower()
            if "timed out" in low or "timeout" in low:
                cause = "a peer rank did not arrive within the process group timeout (stalled or dead)"
            elif "connection" in low or "closed" in low or "reset" in low or "peer" in low:
                cause = "lost the connection to a peer rank (it probably died)"
            else:
                cause = "the backend reported an error"
            self._failed = f"{step}: {cause}"
            raise ReplayError(
                f"torchreplay.distributed: collective {step!r} failed on rank {self.rank} of {self.world_size}: "
                f"{cause}. Backend said: {text.splitlines()[0][:300] if text else type(e).__name__}"
            ) from e

    def _comm(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.comm_device)

    def _gather_rows(self, step: str, row: torch.Tensor) -> torch.Tensor:
        """Every rank's `row` (float64 [K]) as [W, K], in one all_reduce."""
        table = torch.zeros(self.world_size, row.numel(), dtype=torch.float64, device=self.comm_device)
        table[self.rank] = row.to(self.comm_device, torch.float64)
        self._collective(step, dist.all_reduce, table)
        self._counters["dist_control_bytes_sent"] += table.numel() * 8
        return table.cpu()

    def _all_to_all(self, step: str, send: torch.Tensor, send_rows: list[int], recv_rows: list[int],
                    payload: bool) -> torch.Tensor:
        """all_to_all_single of a [rows, R] tensor split by rows; returns the received [sum(recv_rows), R]."""
        width = math.prod(send.shape[1:])
        out = torch.empty(sum(recv_rows), *send.shape[1:], dtype=send.dtype, device=self.comm_device)
        # Flattened, so the splits are plain element counts on every backend.
        self._collective(step, dist.all_to_all_single, out.view(-1), self._comm(send).reshape(-1),
                         [r * width for r in recv_rows], [r * width for r in send_rows])
        moved = sum(n for i, n in enumerate(send_rows) if i != self.rank) * width * send.element_size()
        self._counters["dist_payload_bytes_sent" if payload else "dist_control_bytes_sent"] += moved
        return out

    def _config_fingerprint(self, checkpoint_uri: str | None) -> float:
        # The buffer's whole configuration (sampler spec included, caps as they are now), the mode
        # and where it checkpoints: ranks that differ in any of them would sample inconsistently.
        return _fingerprint(repr((self.mode, self.buffer.config().fingerprint(), checkpoint_uri)))

    def _agree(self, step: str, values: list[float], error: BaseException | None) -> torch.Tensor:
        """One all_reduce of every rank's [ok, *values] row, as [W, 1 + len(values)]. A rank that
        failed locally (`error`) raises it; the others raise ReplayError naming it, so no rank is
        left waiting in a later collective."""
        rows = self._gather_rows(step, torch.tensor([0.0 if error is not None else 1.0, *values],
                                                    dtype=torch.float64))
        if error is not None:
            raise error
        bad = (rows[:, 0] == 0).nonzero().flatten().tolist()
        if bad:
            raise ReplayError(f"rank {self.rank}: {step} aborted because rank(s) {bad} failed "
                              "(their own error names the cause)")
        return rows

    def _check_same_config(self, error: BaseException | None = None, checkpoint_uri: str | None = None,
                           extra: tuple[float, ...] | list[float] = ()) -> torch.Tensor:
        """Collective: raise on every rank unless all built the same buffer; returns the rows
        [ok, fingerprint, *extra] of every rank."""
        fp = self._config_fingerprint(checkpoint_uri) if error is None else 0.0
        rows = self._agree("config check", [fp, *extra], error)
        differ = (rows[:, 1] != fp).nonzero().flatten().tolist()
        if differ:
            raise ValueError(f"rank {self.rank}: ranks {differ} built their DistributedRolloutBuffer with a different "
                             "mode, buffer configuration, sampler or checkpoint uri; every rank must pass the same "
                             "arguments")
        return rows

    def _shard_row(self, batch_size: int, ok: bool, shift: float = 0.0) -> torch.Tensor:
        sampler = self.buffer.sampler
        count = len(self.buffer)
        weighted = isinstance(sampler, ProportionalSampler)
        if weighted and sampler.proportional:
            total, pmin = sampler.mass()
        else:  # samplers without priorities: weights are all ones, only count matters
            total, pmin = float(count), (1.0 if count else math.inf)
        beta = float(sampler.beta) if weighted else 0.0  # the protocol's default outside it
        return torch.tensor([count, total, pmin, beta, batch_size, 1.0 if ok else 0.0, shift, self.buffer.version],
                            dtype=torch.float64)

    def _exchange(self, step: str, batch_size: int, error: str | None, shift: float = 0.0) -> torch.Tensor:
        """Step 1 of the protocol. Raises on every rank when any rank's arguments were bad."""
        rows = self._gather_rows(step, self._shard_row(batch_size if error is None else 0, error is None, shift))
        if error is not None:
            raise ValueError(error)
        bad = (rows[:, _OK] == 0).nonzero().flatten().tolist()
        if bad:
            raise ReplayError(f"rank {self.rank}: {step} aborted because rank(s) {bad} rejected their arguments")
        return rows

    def shard_stats(self) -> ShardStats:
        """Collective: every shard's count, total and min priority."""
        rows = self._exchange("shard stats", 0, None)
        return ShardStats(rows[:, _COUNT].to(torch.int64), rows[:, _TOTAL].clone(), rows[:, _MIN].clone())

    # ------------------------------------------------------------------------------ checkpoints
    @classmethod
    def from_checkpoint(cls, uri: str, process_group: dist.ProcessGroup | None = None, mode: str = "local",
                        checkpoint_interval_s: float = 60.0, endpoint_url: str | None = None,
                        progress: bool = False, tag: int | str | None = None,
                        **buffer_kwargs: Any) -> "DistributedRolloutBuffer":
        """Collective: resume from the newest complete checkpoint generation under the run prefix `uri`.

        Same world size: every rank restores its own shard exactly (`RolloutBuffer.from_checkpoint`:
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
            **buffer_kwargs: passed to the local `RolloutBuffer`; unset ones (capacity, staleness and
                reuse caps, schema, built-in sampler) come from the checkpoint. When resharding,
                each new rank's share must fit its `capacity` (ValueError otherwise, before anything
                is imported), e.g. 4 -> 2 ranks usually needs a larger capacity.
        """
        _check_checkpoint_args(uri, checkpoint_interval_s, endpoint_url, buffer_kwargs, required=True)
        if not isinstance(progress, bool):
            raise TypeError(f"progress must be a bool, got {type(progress).__name__}")
        self = cls.__new__(cls)
        self._bind(process_group, mode)
        world, rank = self.world_size, self.rank
        # Step 1: rank 0 reads the layout (and records a new generation when resharding).
        layout, error = [-1.0, -1.0, -1.0], None
        if rank == 0:
            try:
                source, source_world = newest_complete_generation(uri, endpoint_url)
                target = source if source_world == world else _start_generation(uri, world, source, endpoint_url)
                layout = [float(source), float(source_world), float(target)]
            except Exception as e:  # noqa: BLE001 - raised after the collective, so peers do not wait
                error = e
        rows = self._agree("from_checkpoint: layout", [_fingerprint(uri), *layout], error)
        differ = (rows[:, 1] != rows[0, 1]).nonzero().flatten().tolist()
        if differ:
            raise ValueError(f"rank {rank}: ranks {differ} passed a different uri than rank 0; "
                             "every rank must pass the same run prefix")
        source, source_world, target = (int(x) for x in rows[0, 2:5].tolist())
        # Step 2: every rank builds its shard.
        error, plan = None, 0.0
        try:
            if source_world == world:
                place = rank_uri(uri, source, rank)
                ckpt = Checkpointer(place, interval_s=checkpoint_interval_s, endpoint_url=endpoint_url)
                try:
                    self.buffer = RolloutBuffer.from_checkpoint(place, endpoint_url=endpoint_url, checkpoint=ckpt,
                                                                progress=progress, tag=tag, **buffer_kwargs)
                except BaseException:
                    with contextlib.suppress(CheckpointError):
                        ckpt.close(final=False)
                    raise
            else:
                self.buffer, plan = self._import_share(uri, source, source_world, endpoint_url, progress,
                                                       buffer_kwargs, tag)
            _check_sampler(self.buffer, mode)
        except Exception as e:  # noqa: BLE001 - raised by _check_same_config, after the collective
            error = e
        try:
            rows = self._check_same_config(error, uri, [plan])
            differ = (rows[:, 2] != rows[0, 2]).nonzero().flatten().tolist()
            if differ:
                raise CheckpointError(f"rank {rank}: ranks {differ} planned the resharding from different manifests "
                                      f"of generation {source} (was the old job still writing?)")
        except BaseException:
            _discard(self.buffer)
            raise
        self.checkpoint_uri, self.generation = uri, target
        if source_world != world:
            self._attach_checkpointer(Checkpointer(rank_uri(uri, target, rank), interval_s=checkpoint_interval_s,
                                                   endpoint_url=endpoint_url))
            # Until every rank of the new generation has published, resuming falls back to the old one.
            self.checkpoint()
        return self

    def _import_share(self, uri: str, source: int, source_world: int, endpoint_url: str | None, progress: bool,
                      buffer_kwargs: dict[str, Any], tag: int | str | None = None) -> tuple[RolloutBuffer, float]:
        """Build this rank's shard from its share of generation `source`; returns it and a
        fingerprint of the plan (equal on every rank iff all read the same manifests)."""
        from torchreplay.checkpoint.restore import (buffer_kwargs_from_config, live_rows_from_version, load_state,
                                                    sampler_from_state)

        places = [rank_uri(uri, source, o) for o in range(source_world)]
        stores = [open_store(p, endpoint_url) for p in places]
        manifests = [read_manifest(s, tag=tag) for s in stores]
        newest = max(m["policy_version"] for m in manifests)
        state = load_state(stores[0], manifests[0])
        kwargs = {**buffer_kwargs_from_config(state["config"], buffer_kwargs), **buffer_kwargs}
        if kwargs.get("sampler") is None:
            kwargs["sampler"] = sampler_from_state(state)
        live_rows = [[entry["live_rows"] for entry in m["shards"]] for m in manifests]
        cap = kwargs.get("max_staleness")
        if isinstance(cap, int) and not isinstance(cap, bool) and cap >= 0:  # else the buffer refuses it below
            # Every new rank resumes at the newest old version, so rollouts stale there are dropped
            # on import whichever rank imports them (an old rank behind that version still held
            # them): plan without them. A rank at the newest version under the recorded cap holds
            # none, so only the others' tables are read.
            live_rows = [live_rows_from_version(store, m, newest - cap)
                         if m["policy_version"] < newest or "max_staleness" in buffer_kwargs else rows
                         for store, m, rows in zip(stores, manifests, live_rows)]
        owner = plan_reshard(live_rows, self.world_size)
        # A shard left with no rollout to import is not downloaded by anyone.
        owner = [[r if n else -1 for n, r in zip(rows, owners)] for rows, owners in zip(live_rows, owner)]
        share = [0] * self.world_size
        for rows, owners in zip(live_rows, owner):
            for n, r in zip(rows, owners):
                share[r] += n
        capacity = kwargs.get("capacity")
        if isinstance(capacity, int) and not isinstance(capacity, bool) and max(share) > capacity:
            raise ValueError(f"resharding {sum(share)} rollouts from {source_world} to {self.world_size} ranks puts up "
                             f"to {max(share)} on one rank (shares {share}) but capacity is {capacity}: "
                             f"pass capacity >= {max(share)}")
        buffer = RolloutBuffer(**kwargs)
        try:
            # Every rank starts at the old job's newest version before importing anything: the
            # staleness cap and FreshnessSampler's reference then agree on every rank, whichever
            # shards a rank happens to import (and in whatever order).
            buffer.advance(newest)
            imported = 0
            for o, place in enumerate(places):
                mine = owner[o]
                if self.rank not in mine:
                    continue

                def select(i: int, n: int, mine: list[int] = mine, o: int = o) -> bool:
                    if n != len(mine):
                        raise CheckpointError(f"{places[o]}: its manifest changed during the resume "
                                              f"({n} shards, planned with {len(mine)})")
                    return mine[i] == self.rank

                imported += len(buffer.import_checkpoint(place, endpoint_url=endpoint_url, select=select, tag=tag,
                                                         keep_reuse=True, progress=progress))
            if imported != share[self.rank]:
                raise CheckpointError(f"rank {self.rank} imported {imported} rollouts from generation {source}, "
                                      f"planned {share[self.rank]}")
        except BaseException:
            _discard(buffer)
            raise
        text = repr((source, [(m["sequence"], m["session"]) for m in manifests], live_rows))
        return buffer, _fingerprint(text)

    def checkpoint(self, tag: int | str | None = None, timeout: float | None = None) -> None:
        """Collective: every rank publishes a manifest of its shard; returns on every rank once all
        of them are durable (a consistent cut of the job), under `tag` if given (the trainer's
        step: `from_checkpoint(uri, tag=step)` resumes exactly this cut). `timeout` (seconds)
        bounds the local wait; a rank whose publish fails raises its CheckpointError, the others
        ReplayError."""
        if self.checkpoint_uri is None:
            raise ValueError("this DistributedRolloutBuffer has no checkpoint_uri")
        error = None
        try:
            self.buffer.checkpoint(tag=tag, timeout=timeout)
        except Exception as e:  # noqa: BLE001 - raised by _agree, after the collective
            error = e
        self._agree("checkpoint", [], error)

    def close(self) -> None:
        """Local: finish this rank's background work and, with a checkpoint_uri, publish a final
        manifest of its shard (not a consistent cut across ranks: call `checkpoint()` for that)."""
        self.buffer.close()

    # ------------------------------------------------------------------------------ local API
    def add(self, batch: Any) -> Handles:
        """Store rollouts generated on this rank in this rank's shard (no communication)."""
        return self.buffer.add(batch)

    def __len__(self) -> int:
        """Rollouts in this rank's shard."""
        return len(self.buffer)

    @property
    def version(self) -> int:
        """This shard's policy version (equal on every rank after `advance`)."""
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
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            error = f"batch_size must be an int >= 1, got {batch_size!r}"
        elif generator is not None and not isinstance(generator, torch.Generator):
            error = f"generator must be a torch.Generator or None, got {type(generator).__name__}"
        shift = 0.0
        if error is None and self.mode == "global" and self.rank == 0:
            shift = float(torch.rand(1, dtype=torch.float64, generator=generator))
        rows = self._exchange("sample: shard stats", batch_size if error is None else 0, error, shift)
        newest = int(rows[:, _VERSION].max())
        if int(rows[:, _VERSION].min()) != newest:
            # A rank that added newer rollouts moved its own version. Every rank moves to the
            # newest first, so the staleness cap and version-dependent priorities (FreshnessSampler's
            # reference) are the same on all of them; then the shard stats are taken again.
            failed = None
            try:
                self.buffer.advance(newest)
            except Exception as e:  # noqa: BLE001 - raised by _exchange, after the collective
                failed = f"advancing to version {newest} failed: {e}"
            rows = self._exchange("sample: shard stats", batch_size, failed, shift)
        sizes = rows[:, _BATCH]
        if bool((sizes != batch_size).any()):
            raise ValueError(f"batch_size must be the same on every rank, got {sizes.to(torch.int64).tolist()}")
        betas = rows[:, _BETA]
        if bool((betas != betas[0]).any()):
            raise ValueError(f"sampler beta must be the same on every rank, got {betas.tolist()}")
        self._counters["dist_sample_calls"] += 1
        out = self._sample_local(batch_size, rows, generator) if self.mode == "local" else \
            self._sample_global(batch_size, rows, generator)
        self._last_ess = effective_sample_size(out.weights)
        self._counters["dist_received"] += batch_size
        return out if device is None else out.to(device)

    def _sample_local(self, batch_size: int, rows: torch.Tensor, generator: torch.Generator | None) -> ReplayBatch:
        empty = (rows[:, _COUNT] == 0).nonzero().flatten().tolist()
        if empty:
            raise ValueError(f"cannot sample in local mode: the shard of rank(s) {empty} is empty")
        batch = self.buffer.sample(batch_size, generator=generator)
        beta = float(rows[self.rank, _BETA])
        sampler = self.buffer.sampler
        if beta and isinstance(sampler, ProportionalSampler) and sampler.weight_norm == "buffer_max":
            # The sampler normalized by this shard's min; rescale to the job-wide smallest probability.
            # (The batch norms need nothing: within one rank's batch the shard total cancels.)
            ratio = rows[:, _MIN] / rows[:, _TOTAL]
            factor = (ratio[self.rank] / ratio.min()) ** -beta
            batch.weights = (batch.weights.double() * factor).to(torch.float32)
        self._counters["dist_served"] += batch_size
        rank = torch.full_like(batch.handles.slot, self.rank)
        batch.handles = DistributedHandles(batch.handles.slot, batch.handles.generation, rank)
        return batch

    def _sample_global(self, batch_size: int, rows: torch.Tensor, generator: torch.Generator | None) -> ReplayBatch:
        totals = rows[:, _TOTAL]
        total = float(totals.sum())
        if not total > 0:
            raise ValueError("cannot sample: every shard is empty")
        world, rank = self.world_size, self.rank
        # Stratum k * W + rank of B * W (module docstring, step 2).
        strata = torch.arange(batch_size, dtype=torch.float64) * world + rank
        u = (strata + torch.rand(batch_size, dtype=torch.float64, generator=generator)) / (batch_size * world)
        u = torch.remainder(u + float(rows[:, _SHIFT].sum()), 1.0) * total
        ends = torch.cumsum(totals, 0)
        last = int((totals > 0).nonzero().max())
        owner = torch.searchsorted(ends, u, right=True).clamp(max=last)
        frac = ((u - (ends[owner] - totals[owner])) / totals[owner]).clamp(0.0, _ONE_BELOW_ONE)
        order = torch.argsort(owner, stable=True)
        send_counts = torch.bincount(owner, minlength=world)
        recv_counts = self._all_to_all("sample: request counts", send_counts.reshape(world, 1),
                                       [1] * world, [1] * world, payload=False).reshape(-1).cpu()
        send_counts_l, recv_counts_l = send_counts.tolist(), recv_counts.tolist()
        requests = self._all_to_all("sample: requests", frac[order].reshape(-1, 1), send_counts_l, recv_counts_l,
                                    payload=False).reshape(-1).cpu()
        meta, token_bytes, tokens_per_peer, failure = self._serve(requests, recv_counts_l)
        # Replies: per-rollout bytes, then one tensor per token field.
        got_meta = self._all_to_all("sample: rollout fields", meta, recv_counts_l, send_counts_l, payload=True)
        got = self._decode_meta(got_meta.cpu())
        lengths = got["length"]
        tokens_from = [int(s.sum()) for s in torch.split(lengths, send_counts_l)]
        got_tokens = {name: self._all_to_all(f"sample: field {name!r}", data, tokens_per_peer, tokens_from,
                                             payload=True) for name, data in token_bytes.items()}
        if failure is not None:
            raise failure
        failed = owner[order][got["status"] != 0].unique().tolist()
        if failed:
            raise ReplayError(f"rank {self.rank}: rank(s) {failed} could not read the requested rollouts "
                              "(their own error names the cause)")
        return self._assemble(got, got_tokens, order, owner[order], rows)

    def _token_fields(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return {n: (s.dtype, s.shape) for n, s in self.buffer.fields.items() if s.kind == TOKEN}

    def _extra_rollout_fields(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        table = set(_META_INT) | set(_META_FLOAT)
        return {n: (s.dtype, s.shape) for n, s in self.buffer.fields.items() if s.kind == ROLLOUT and n not in table}

    def _serve(self, requests: torch.Tensor, recv_counts: list[int]
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[int], BaseException | None]:
        """Owner side: draw the requested rollouts, count their use, pack their fields.

        A failure to read the rollouts (e.g. a storage error) does not skip the remaining
        collectives, which would leave the peers waiting: the reply carries status 1 and no tokens,
        and the error is returned to be raised once the exchange is over."""
        buf = self.buffer
        n = requests.numel()
        failure: BaseException | None = None
        batch = None
        slots, prio = torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.float64)
        if n:
            try:
                # Each slot's draws past its reuse budget are redrawn from this shard, so no rollout
                # exceeds max_reuse even when several ranks requested it.
                slots, prio, redrawn = buf.draw_at(requests)
                self._counters["dist_reuse_redraws"] += redrawn
                batch = buf.gather(slots, count_use=True)
            except Exception as e:  # noqa: BLE001 - re-raised by the caller after the exchange
                failure = e
        if batch is not None:
            mask = batch.attention_mask
            lengths = mask.sum(1)
        else:
            mask, lengths = torch.zeros(n, 0, dtype=torch.bool), torch.zeros(n, dtype=torch.int64)
        self._counters["dist_served"] += n
        ints = {"status": torch.full((n,), int(failure is not None), dtype=torch.int64), "length": lengths,
                "slot": slots}
        if batch is not None:
            ints.update(generation=batch.handles.generation, reuse=batch.reuse, age=batch.age,
                        **{k: batch.data[k] for k in ("prompt_len", "group_id", "policy_version")})
            floats = {"priority": prio, **{k: batch.data[k] for k in ("reward", "advantage")}}
        else:
            ints.update({k: torch.zeros(n, dtype=torch.int64) for k in _META_INT[3:]})
            floats = {"priority": prio, **{k: torch.zeros(n, dtype=torch.float64) for k in _META_FLOAT[1:]}}
        cols = [_to_bytes(ints[k].to(torch.int64), n) for k in _META_INT]
        cols += [_to_bytes(floats[k].to(torch.float64), n) for k in _META_FLOAT]
        for name, (dtype, shape) in self._extra_rollout_fields().items():
            value = batch.data.get(name) if batch is not None else None
            cols.append(_to_bytes(value if value is not None else torch.zeros(n, *shape, dtype=dtype), n))
        meta = torch.cat(cols, 1) if cols else torch.empty(n, 0, dtype=torch.uint8)
        n_tok = int(lengths.sum())
        token_bytes = {}
        for name, (dtype, shape) in self._token_fields().items():
            value = batch.data.get(name) if batch is not None else None
            flat = value[mask] if value is not None else torch.zeros(n_tok, *shape, dtype=dtype)
            token_bytes[name] = _to_bytes(flat, n_tok)
        tokens_per_peer = [int(s.sum()) for s in torch.split(lengths, recv_counts)]
        return meta, token_bytes, tokens_per_peer, failure

    def _decode_meta(self, meta: torch.Tensor) -> dict[str, torch.Tensor]:
        out, col = {}, 0
        layout = [(k, torch.int64, ()) for k in _META_INT] + [(k, torch.float64, ()) for k in _META_FLOAT]
        layout += [(k, d, s) for k, (d, s) in self._extra_rollout_fields().items()]
        for name, dtype, shape in layout:
            width = _row_bytes(dtype, shape)
            out[name] = _from_bytes(meta[:, col:col + width], dtype, shape)
            col += width
        return out

    def _assemble(self, got: dict[str, torch.Tensor], got_tokens: dict[str, torch.Tensor], order: torch.Tensor,
                  owner_sorted: torch.Tensor, rows: torch.Tensor) -> ReplayBatch:
        """Receiver side: pad token fields, restore stratum order, compute IS weights."""
        buf = self.buffer
        lengths = got["length"]
        n = lengths.numel()
        width = int(lengths.max()) if n else 0
        valid = padding_mask(lengths, width, buf.padding_side)
        valid_dev = valid.to(self.comm_device)
        restore = torch.argsort(order)
        restore_dev = restore.to(self.comm_device)
        data: dict[str, torch.Tensor] = {}
        for name, (dtype, shape) in self._token_fields().items():
            values = _from_bytes(got_tokens[name], dtype, shape)
            fill = buf.pad_token_id if name == "tokens" else 0
            padded = torch.full((n, width, *shape), fill, dtype=dtype, device=self.comm_device)
            padded[valid_dev] = values
            data[name] = padded[restore_dev]
        data["attention_mask"] = valid_dev[restore_dev]
        for name in ("prompt_len", "group_id", "policy_version"):
            data[name] = got[name][restore]
        for name in ("reward", "advantage"):
            data[name] = got[name][restore].to(torch.float32)
        for name in self._extra_rollout_fields():
            data[name] = got[name][restore]
        prio = got["priority"][restore]
        weights = buf.sampler.is_weights(prio, float(rows[:, _MIN].min()))
        handles = DistributedHandles(got["slot"][restore], got["generation"][restore], owner_sorted[restore].clone())
        return ReplayBatch(data=data, handles=handles, weights=weights,
                           age=got["age"][restore], reuse=got["reuse"][restore],
                           is_fresh=torch.zeros(n, dtype=torch.bool),
                           token_fields=tuple(self._token_fields()), pad_token_id=buf.pad_token_id)

    # ------------------------------------------------------------------------------ priorities
    def update_priorities(self, handles: Handles, advantages: torch.Tensor) -> int:
        """Set new advantages for sampled rollouts; returns how many this rank's shard applied.

        Local mode: applied to this rank's shard, no communication (handles must be this rank's).
        Global mode: a collective; each update is routed to the owner rank by all_to_all. Handles
        whose rollout was evicted or whose slot was reused are ignored and counted on the owner.
        """
        error = None
        if not isinstance(handles, Handles):
            error = f"handles must be Handles (from add/sample), got {type(handles).__name__}"
        elif not isinstance(advantages, torch.Tensor) or not advantages.is_floating_point():
            error = "advantages must be a floating-point tensor"
        elif advantages.numel() != len(handles):
            error = f"advantages has {advantages.numel()} values for {len(handles)} handles"
        elif not bool(torch.isfinite(advantages).all()):
            error = "advantages must be finite"
        else:
            owner = handles.rank.cpu() if isinstance(handles, DistributedHandles) else \
                torch.full_like(handles.slot.cpu(), self.rank)
            if owner.numel() and (int(owner.min()) < 0 or int(owner.max()) >= self.world_size):
                error = f"handles.rank outside [0, {self.world_size})"
            elif self.mode == "local" and bool((owner != self.rank).any()):
                error = f"local mode: handles must belong to this rank ({self.rank})"
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
        recv_counts = self._all_to_all("update_priorities: counts", send_counts.reshape(-1, 1),
                                       [1] * self.world_size, [1] * self.world_size,
                                       payload=False).reshape(-1).cpu().tolist()
        got = self._all_to_all("update_priorities: updates", send, send_counts.tolist(), recv_counts,
                               payload=False).cpu()
        return self.buffer.update_priorities(Handles(got[:, 0].clone(), got[:, 1].clone()),
                                             got[:, 2].contiguous().view(torch.float64))

    # ------------------------------------------------------------------------------ versions
    def advance(self, policy_version: int) -> int:
        """Collective: set the policy version on every rank and evict rollouts past `max_staleness`.

        Every rank must pass the same version, and no shard may already hold a newer one. Returns
        the number of rollouts this rank's shard evicted.
        """
        error = None
        if isinstance(policy_version, bool) or not isinstance(policy_version, int):
            error = f"policy_version must be an int, got {type(policy_version).__name__}"
        v = policy_version if error is None else 0
        # One MAX reduce: [bad flag, v, -v (min via max of negatives), this shard's version].
        flags = torch.tensor([0 if error is None else 1, v, -v, self.buffer.version], dtype=torch.int64,
                             device=self.comm_device)
        self._collective("advance", dist.all_reduce, flags, op=dist.ReduceOp.MAX)
        self._counters["dist_control_bytes_sent"] += flags.numel() * 8
        bad, v_max, neg_v_min, version_max = flags.cpu().tolist()
        if error is not None:
            raise TypeError(error)
        if bad:
            raise ReplayError(f"rank {self.rank}: advance aborted because another rank passed a bad policy_version")
        if v_max != -neg_v_min:
            raise ValueError(f"policy_version must be the same on every rank, got values from {-neg_v_min} to {v_max}")
        if version_max > policy_version:
            raise ValueError(f"policy_version must not go backwards: {policy_version} < {version_max} "
                             "(the newest version already held by some shard)")
        return self.buffer.advance(policy_version)

    # ------------------------------------------------------------------------------ metrics
    def metrics(self, global_: bool = False) -> dict[str, float]:
        """This shard's `RolloutBuffer.metrics()` plus distributed counters (`dist_*`: sample calls,
        rollouts received by / served from this rank, payload and control bytes sent to other ranks).

        `global_=True` is a collective (one all_reduce) returning job-wide figures: counts, bytes
        and histograms summed; `age_max`, `policy_version`, `sample_calls` maxed; `age_mean`,
        `reuse_mean` weighted by shard size; `ess_fraction` averaged over ranks.
        """
        out = self.buffer.metrics()
        out.update(self._counters)
        out["dist_ess_fraction"] = self._last_ess
        if self.mode == "global":
            # The shard's own sample() is bypassed in global mode; report what this rank received.
            out["sampled_replay"] = self._counters["dist_received"]
            out["sample_calls"] = self._counters["dist_sample_calls"]
            out["ess_fraction"] = self._last_ess
        if not global_:
            return {**out, "rank": self.rank, "world_size": self.world_size}
        keys = sorted(out)
        rows = self._gather_rows("metrics", torch.tensor([float(out[k]) for k in keys], dtype=torch.float64))
        col = {k: rows[:, i] for i, k in enumerate(keys)}
        size = col["size"]
        result: dict[str, float] = {}
        for k in keys:
            c = col[k]
            if k in ("age_max", "policy_version", "sample_calls", "dist_sample_calls"):
                result[k] = float(c.max())
            elif k in ("age_mean", "reuse_mean"):
                result[k] = float((c * size).sum() / size.sum()) if float(size.sum()) else 0.0
            elif k in ("ess_fraction", "dist_ess_fraction"):
                result[k] = float(c.nanmean()) if bool((~c.isnan()).any()) else math.nan
            else:
                result[k] = float(c.sum())
        result["world_size"] = self.world_size
        return result

