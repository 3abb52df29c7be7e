"""Where a DistributedRolloutBuffer checkpoints, and how a job resumes on another world size.

With `checkpoint_uri`, every rank's buffer checkpoints through its own `Checkpointer` (background
shard uploads, a manifest every `checkpoint_interval_s` seconds and on `checkpoint()`). Layout
under the run prefix::

    state/generation-<g>.json     {"generation": g, "world_size": W, "parent": g' or null, ...};
                                  written by rank 0 before any rank of generation g publishes
    gen-<g>/rank-<r>/...          rank r's checkpoint in generation g (the `Checkpointer` layout:
                                  shards/, state/, manifests/, LATEST)

A generation is one lineage of one world size. It is *complete* once every one of its W ranks has
published a manifest (its `LATEST` exists); a reader resumes from the newest complete generation,
so a generation whose ranks had not all published when the job died is skipped and its parent is
still whole. `from_checkpoint` on the same world size restores each rank exactly from its own
directory (`restore_rank`) and keeps checkpointing there. On a different world size it starts
generation g + 1 (one above the newest record, complete or not) and nothing writes the old
generation again: every new rank imports a disjoint set of whole old shards (`plan_reshard`,
`import_share`: storage shards, i.e. the rollouts of one `add` call; each goes to exactly one new
rank), carrying advantages, policy versions, group ids and use counts; then every rank publishes
once, which makes the new generation complete. Old generations are never deleted by torchreplay;
delete `gen-<g>/` yourself once a newer generation is complete. Do not point a plain
`Checkpointer` at the run prefix itself: its garbage collection would remove the generation
records in `state/`.
"""

from __future__ import annotations

import contextlib
import heapq
import json
import re
import time
from typing import Any

from torchreplay.buffer import RolloutBuffer
from torchreplay.checkpoint import Checkpointer, open_store
from torchreplay.checkpoint.manifest import read_manifest
from torchreplay.checkpoint.restore import (buffer_kwargs_from_config, live_rows_from_version, load_state,
                                            sampler_from_state)
from torchreplay.checkpoint.store import ObjectStore, open_reader
from torchreplay.checks import check_int, is_int
from torchreplay.distributed.comm import fingerprint
from torchreplay.errors import CheckpointError

GENERATION_KEY = re.compile(r"^state/generation-([0-9]{1,9})\.json$")
LAYOUT_VERSION = 1


def rank_uri(uri: str, generation: int, rank: int) -> str:
    """Where rank `rank` of generation `generation` checkpoints under the run prefix `uri`."""
    return f"{uri.rstrip('/')}/gen-{generation}/rank-{rank}"


def check_checkpoint_args(uri: str | None, interval_s: float, endpoint_url: str | None,
                          buffer_kwargs: dict[str, Any], required: bool = False) -> None:
    """The checkpoint arguments of the constructor and `from_checkpoint` (`uri` None: none)."""
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


def generation_records(store: ObjectStore) -> dict[int, int]:
    """generation -> world size, from the records under the run prefix's `state/`."""
    out: dict[int, int] = {}
    for key in store.list("state"):
        m = GENERATION_KEY.match(key)
        if m is None:
            continue
        try:
            record = json.loads(store.get(key))
        except ValueError as exc:
            raise CheckpointError(f"{store.uri}/{key} is not valid JSON") from exc
        generation = int(m.group(1))
        world = record.get("world_size") if isinstance(record, dict) else None
        if (not isinstance(record, dict) or record.get("generation") != generation
                or not is_int(world) or world < 1):
            raise CheckpointError(f"{store.uri}/{key} is not a generation record of generation {generation}: {record!r}")
        out[generation] = world
    return out


def missing_ranks(uri: str, generation: int, world: int, endpoint_url: str | None) -> list[int]:
    """The ranks of `generation` that have not published a manifest yet."""
    return [r for r in range(world) if not open_store(rank_uri(uri, generation, r), endpoint_url).exists("LATEST")]


def newest_complete_generation(uri: str, endpoint_url: str | None = None) -> tuple[int, int]:
    """(generation, world size) of the newest generation under `uri` in which every rank has
    published a manifest. Raises CheckpointError when there is none."""
    records = generation_records(open_store(uri, endpoint_url))
    incomplete = []
    for generation in sorted(records, reverse=True):
        missing = missing_ranks(uri, generation, records[generation], endpoint_url)
        if not missing:
            return generation, records[generation]
        incomplete.append(f"generation {generation} (world size {records[generation]}) lacks rank(s) {missing}")
    detail = "; ".join(incomplete) if incomplete else "no generation records under state/"
    raise CheckpointError(f"no complete DistributedRolloutBuffer checkpoint under {uri}: {detail}")


def start_generation(uri: str, world: int, parent: int | None, endpoint_url: str | None) -> int:
    """Write the record of a new generation one above every existing one; returns its number.

    Without a parent (a fresh buffer) a prefix that already holds a complete generation is refused:
    the new generation would hide it from `from_checkpoint` once complete."""
    store = open_store(uri, endpoint_url)
    records = generation_records(store)
    if parent is None:
        complete = [g for g in sorted(records, reverse=True) if not missing_ranks(uri, g, records[g], endpoint_url)]
        if complete:
            raise ValueError(f"checkpoint_uri {uri} already holds a complete checkpoint (generation {complete[0]}, "
                             f"world size {records[complete[0]]}): resume it with "
                             "DistributedRolloutBuffer.from_checkpoint, or use a new prefix")
    generation = max(records, default=-1) + 1
    record = {"format_version": LAYOUT_VERSION, "generation": generation, "world_size": world, "parent": parent,
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
    check_int(world_size, "world_size", low=1, error=ValueError)
    owner = [[-1] * len(rows) for rows in live_rows]
    loads = [(0, r) for r in range(world_size)]  # (live rollouts, new rank), a min-heap
    pairs = sorted(((-n, o, i) for o, rows in enumerate(live_rows) for i, n in enumerate(rows)))
    for neg_n, o, i in pairs:
        load, r = heapq.heappop(loads)
        owner[o][i] = r
        heapq.heappush(loads, (load - neg_n, r))
    return owner


def discard(buffer: RolloutBuffer | None) -> None:
    """Drop a rank buffer built by a failed collective call: no final checkpoint, files released."""
    if buffer is None:
        return
    ckpt = buffer.detach_checkpointer()
    if ckpt is not None:
        with contextlib.suppress(CheckpointError):
            ckpt.close(final=False)
    buffer.close()


def restore_rank(uri: str, generation: int, rank: int, interval_s: float, endpoint_url: str | None,
                 progress: bool, tag: int | str | None, buffer_kwargs: dict[str, Any],
                 retry_budget_s: float = 60.0) -> RolloutBuffer:
    """Rank `rank`'s buffer restored exactly from its own directory of `generation`, checkpointing
    there again (`RolloutBuffer.from_checkpoint`: slots, priorities, reuse counts, sampler and RNG)."""
    place = rank_uri(uri, generation, rank)
    ckpt = Checkpointer(place, interval_s=interval_s, endpoint_url=endpoint_url)
    try:
        return RolloutBuffer.from_checkpoint(place, endpoint_url=endpoint_url, checkpoint=ckpt, progress=progress,
                                             tag=tag, retry_budget_s=retry_budget_s, **buffer_kwargs)
    except BaseException:
        with contextlib.suppress(CheckpointError):
            ckpt.close(final=False)
        raise


def plan_shares(uri: str, source: int, source_world: int, world: int, endpoint_url: str | None,
                buffer_kwargs: dict[str, Any], tag: int | str | None, retry_budget_s: float = 60.0
                ) -> tuple[dict[str, Any], int, list[list[int]], list[int], float]:
    """Read generation `source`'s manifests and plan who imports what on `world` new ranks.

    Returns the new rank buffers' RolloutBuffer kwargs, the newest old policy version, `owner[o][i]`
    (the new rank importing shard i of old rank o, -1 for a shard with nothing to import), each
    new rank's planned rollouts and a fingerprint of the plan (equal on every rank iff all read
    the same manifests)."""
    stores = [open_reader(rank_uri(uri, source, o), endpoint_url, retry_budget_s) for o in range(source_world)]
    manifests = [read_manifest(s, tag=tag) for s in stores]
    newest = max(m["policy_version"] for m in manifests)
    state = load_state(stores[0], manifests[0])
    kwargs = {**buffer_kwargs_from_config(state["config"], buffer_kwargs), **buffer_kwargs}
    if kwargs.get("sampler") is None:
        kwargs["sampler"] = sampler_from_state(state)
    live_rows = [[entry["live_rows"] for entry in m["shards"]] for m in manifests]
    cap = kwargs.get("max_staleness")
    if is_int(cap) and cap >= 0:  # else the buffer refuses it later
        # Every new rank resumes at the newest old version, so rollouts stale there are dropped
        # on import whichever rank imports them (an old rank behind that version still held
        # them): plan without them. A rank at the newest version under the recorded cap holds
        # none, so only the others' tables are read.
        live_rows = [live_rows_from_version(store, m, newest - cap)
                     if m["policy_version"] < newest or "max_staleness" in buffer_kwargs else rows
                     for store, m, rows in zip(stores, manifests, live_rows)]
    owner = plan_reshard(live_rows, world)
    # A shard left with no rollout to import is not downloaded by anyone.
    owner = [[r if n else -1 for n, r in zip(rows, owners)] for rows, owners in zip(live_rows, owner)]
    share = [0] * world
    for rows, owners in zip(live_rows, owner):
        for n, r in zip(rows, owners):
            share[r] += n
    text = repr((source, [(m["sequence"], m["session"]) for m in manifests], live_rows))
    return kwargs, newest, owner, share, fingerprint(text)


def import_share(uri: str, source: int, source_world: int, rank: int, world: int, endpoint_url: str | None,
                 progress: bool, buffer_kwargs: dict[str, Any], tag: int | str | None = None,
                 retry_budget_s: float = 60.0) -> tuple[RolloutBuffer, float]:
    """Rank `rank`'s new buffer: its share of generation `source` (`plan_shares`), imported with
    use counts; returns it and the plan's fingerprint."""
    kwargs, newest, owner, share, plan = plan_shares(uri, source, source_world, world, endpoint_url,
                                                     buffer_kwargs, tag, retry_budget_s)
    capacity = kwargs.get("capacity")
    if is_int(capacity) and max(share) > capacity:
        raise ValueError(f"resharding {sum(share)} rollouts from {source_world} to {world} ranks puts up "
                         f"to {max(share)} on one rank (shares {share}) but capacity is {capacity}: "
                         f"pass capacity >= {max(share)}")
    buffer = RolloutBuffer(**kwargs)
    try:
        # Every rank starts at the old job's newest version before importing anything: the
        # staleness cap and FreshnessSampler's reference then agree on every rank, whichever
        # shards a rank happens to import (and in whatever order).
        buffer.advance(newest)
        imported = 0
        for o, mine in enumerate(owner):
            if rank not in mine:
                continue
            place = rank_uri(uri, source, o)

            def select(i: int, n: int, mine: list[int] = mine, place: str = place) -> bool:
                if n != len(mine):
                    raise CheckpointError(f"{place}: its manifest changed during the resume "
                                          f"({n} shards, planned with {len(mine)})")
                return mine[i] == rank

            imported += len(buffer.import_checkpoint(place, endpoint_url=endpoint_url, select=select, tag=tag,
                                                     keep_reuse=True, progress=progress,
                                                     retry_budget_s=retry_budget_s))
        if imported != share[rank]:
            raise CheckpointError(f"rank {rank} imported {imported} rollouts from generation {source}, "
                                  f"planned {share[rank]}")
    except BaseException:
        discard(buffer)
        raise
    return buffer, plan
