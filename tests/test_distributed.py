"""DistributedRolloutBuffer over gloo on the CPU: global sampling frequencies, local-mode IS weights,
payload integrity, collective argument checks, version/metrics agreement, dead and stalled peers,
checkpoints and resumes on the same and on a different world size.

Process start-up dominates the cost, so each job runs several scenarios and
writes one JSON result per rank; the tests below assert on those results. Two jobs of 2 ranks
each, and one chain of checkpoint jobs (4 ranks -> 2 -> 3 -> 3) sharing one file:// run prefix.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

pytestmark = pytest.mark.distributed

P_MIN = 1e-3  # chi-square rejects below this p-value; seeds are fixed, so the outcome is too
JOB_TIMEOUT_S = 90.0  # per spawned job, generous for 2 shared, loaded cores
FAIL_TIMEOUT_S = 3.0  # process-group timeout in the failure job
# Shard contents for the sampling scenarios: rank 0 holds few rollouts with large |advantage|,
# rank 1 many with small ones, so the two shards' totals differ by about 10x.
SIZES = (6, 20)
EPS, BETA = 1e-3, 0.5


def shard_advantages(rank: int) -> torch.Tensor:
    if rank == 0:
        return torch.tensor([3.0, -4.0, 5.0, 6.0, -7.0, 8.0])
    return torch.linspace(0.05, 0.5, SIZES[1]) * torch.tensor([1.0, -1.0]).repeat(SIZES[1] // 2)


def shard_batch(rank: int) -> dict:
    from rollouts import make_batch

    return make_batch(SIZES[rank], version=0, seed=100 + rank, advantage=shard_advantages(rank))


# ------------------------------------------------------------------------------ process harness
def _entry(rank: int, world: int, init_file: str, out_dir: str, job: str, timeout_s: float,
           job_args: dict[str, Any]) -> None:
    import torch.distributed as dist

    tests_dir = str(Path(__file__).parent)
    if tests_dir not in sys.path:
        sys.path.insert(0, tests_dir)
    torch.set_num_threads(1)
    # RolloutBuffer.add tries `import tensordict` (which pulls in torch._dynamo: 5-10 s here) to
    # recognize TensorDict input; these workers pass plain dicts, so make that import fail fast.
    result: dict[str, Any] = {}
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        JOBS[job](rank, world, result, **job_args)
        result["ok"] = True
    except BaseException:  # reported to the parent, which fails the test with it
        result["ok"] = False
        result["traceback"] = traceback.format_exc()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    # Skip destroy_process_group: after a peer failure it can block; the process is ending anyway.
    os._exit(0)


def run_job(job: str, world: int, tmp_path: Path, timeout_s: float = 30.0,
            job_args: dict[str, Any] | None = None) -> tuple[list[dict], list[int]]:
    import torch.multiprocessing as mp

    # fork, not spawn: a spawned child re-imports torch, which costs ~5-10 s per rank on 2 loaded
    # cores. The parent never builds a process group, and children drop to one intra-op thread first.
    ctx = mp.get_context("fork")
    init_file = tmp_path / f"{job}.init"
    procs = [ctx.Process(target=_entry, args=(r, world, str(init_file), str(tmp_path), job, timeout_s,
                                              job_args or {}))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + JOB_TIMEOUT_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
        procs[r].join()
    assert not hung, f"job {job!r}: ranks {hung} still running after {JOB_TIMEOUT_S}s"
    results = []
    for r in range(world):
        path = tmp_path / f"rank{r}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {"ok": None})
    return results, [p.exitcode for p in procs]


def expect_raise(fn: Callable[[], Any], *types: type) -> str:
    try:
        fn()
    except types as e:
        return f"{type(e).__name__}: {e}"
    raise AssertionError(f"expected one of {types}, nothing raised")


# ------------------------------------------------------------------------------ jobs (in the workers)
def _job_main(rank: int, world: int, out: dict) -> None:
    import torch.distributed as dist

    import torchreplay as tr
    from rollouts import make_batch
    from torchreplay.distributed import DistributedHandles, DistributedRolloutBuffer

    def sampler() -> tr.PrioritizedSampler:
        # buffer_max: the scenarios below check PER's job-wide normalization by the smallest priority.
        return tr.PrioritizedSampler(alpha=1.0, beta=BETA, eps=EPS, weight_norm="buffer_max")

    data = [shard_batch(r) for r in range(world)]
    prio = [(shard_advantages(r).double().abs() + EPS) for r in range(world)]
    pmin = min(float(p.min()) for p in prio)

    # -- global mode: frequencies, payload integrity, IS weights --------------------------------
    buf = DistributedRolloutBuffer(mode="global", capacity=32, sampler=sampler())
    buf.add(data[rank])
    stats_ = buf.rank_stats()
    out["stats_count"] = stats_.count.tolist()
    out["stats_total"] = stats_.total.tolist()
    gen = torch.Generator().manual_seed(1234 + rank)
    counts = torch.zeros(world, 32)
    per_call_owner0 = []
    payload_errors = 0
    weight_err = 0.0
    calls, bsz = 150, 16
    for _ in range(calls):
        b = buf.sample(bsz, generator=gen)
        assert isinstance(b.handles, DistributedHandles)
        assert b.tokens.shape[0] == bsz and b.weights.shape == (bsz,)
        owner, slot = b.handles.rank, b.handles.slot
        counts.index_put_((owner, slot), torch.ones(bsz), accumulate=True)
        per_call_owner0.append(int((owner == 0).sum()))
        for k in range(bsz):
            o, s = int(owner[k]), int(slot[k])
            src = data[o]
            length = src["tokens"][s].numel()
            ok = (torch.equal(b.tokens[k, :length], src["tokens"][s])
                  and torch.equal(b.logprobs[k, :length], src["logprobs"][s])
                  and torch.equal(b.response_mask[k, :length], src["response_mask"][s])
                  and int(b.attention_mask[k].sum()) == length
                  and float(b.advantage[k]) == float(src["advantage"][s])
                  and float(b.reward[k]) == float(src["reward"][s])
                  and int(b.group_id[k]) == int(src["group_id"][s])
                  and int(b.prompt_len[k]) == int(src["prompt_len"][s])
                  and int(b.reuse[k]) >= 0 and int(b.age[k]) == 0)
            payload_errors += not ok
            expected_w = (float(prio[o][s]) / pmin) ** -BETA
            weight_err = max(weight_err, abs(float(b.weights[k]) - expected_w) / expected_w)
    out["global_counts"] = counts.tolist()
    out["global_payload_errors"] = payload_errors
    out["global_weight_rel_err"] = weight_err
    out["global_owner0_per_call"] = per_call_owner0
    m = buf.metrics()
    out["global_metrics"] = {k: m[k] for k in ("dist_payload_bytes_sent", "dist_received", "dist_served",
                                               "sampled_replay", "sample_calls")}
    out["global_metrics_all"] = buf.metrics(global_=True)

    # -- global mode: update_priorities is routed to the owner ------------------------------------
    b = buf.sample(8, generator=gen)
    new_adv = 100.0 + 1000.0 * b.handles.rank.double() + b.handles.slot.double()  # depends only on (owner, slot)
    applied = buf.update_priorities(b.handles, new_adv.float())
    sent = sorted({(int(o), int(s)) for o, s in zip(b.handles.rank, b.handles.slot)})
    out["update_sent"] = sent
    out["update_applied"] = applied
    out["update_table"] = buf.buffer.slots.advantage[: SIZES[rank]].tolist()

    # -- local mode: weights normalized over all ranks --------------------------------------------
    loc = DistributedRolloutBuffer(mode="local", capacity=32, sampler=sampler())
    loc.add(data[rank])
    ratio = [float(p.min() / p.sum()) for p in prio]
    worst = []
    max_w = 0.0
    for _ in range(20):
        b = loc.sample(16, generator=gen)
        assert bool((b.handles.rank == rank).all())
        for k, s in enumerate(b.handles.slot.tolist()):
            expected = ((float(prio[rank][s]) / float(prio[rank].sum())) / min(ratio)) ** -BETA
            worst.append(abs(float(b.weights[k]) - expected) / expected)
        max_w = max(max_w, float(b.weights.max()))
    out["local_update_applied"] = loc.update_priorities(b.handles, torch.ones(16))  # local: no collective
    out["local_weight_rel_err"] = max(worst)
    out["local_max_weight"] = max_w
    out["local_payload_bytes"] = loc.metrics()["dist_payload_bytes_sent"]

    # -- argument checks raise on every rank, and the group stays usable ----------------------------
    out["err_batch_differs"] = expect_raise(lambda: loc.sample(4 if rank == 0 else 5), ValueError)
    out["err_batch_bad"] = expect_raise(lambda: loc.sample(0 if rank == 1 else 4), ValueError, tr.ReplayError)
    out["err_advance_differs"] = expect_raise(lambda: loc.advance(3 if rank == 0 else 2), ValueError)
    out["err_mode_differs"] = expect_raise(
        lambda: DistributedRolloutBuffer(mode="local" if rank == 0 else "global", capacity=8), ValueError)
    out["err_bad_mode"] = expect_raise(lambda: DistributedRolloutBuffer(mode="both", capacity=8), ValueError)

    # -- advance and metrics agree across ranks ----------------------------------------------------
    st = DistributedRolloutBuffer(mode="global", capacity=16, sampler=tr.UniformSampler(),
                                  max_staleness=1, max_reuse=1)
    st.add(make_batch(4 + 2 * rank, version=0, seed=7 + rank))
    st.add(make_batch(3, version=1, seed=9 + rank))
    st.advance(2)  # evicts version 0 on every rank
    out["advance_len"] = len(st)
    out["advance_version"] = st.version
    b = st.sample(2, generator=gen)  # max_reuse=1: every served rollout is evicted on its owner
    out["reuse_received"] = sorted({(int(o), int(s)) for o, s in zip(b.handles.rank, b.handles.slot)})
    mg = st.metrics(global_=True)
    out["advance_global"] = {k: mg[k] for k in ("size", "evicted_staleness", "evicted_reuse", "policy_version",
                                                "dist_served", "dist_received")}
    out["err_backwards"] = expect_raise(lambda: st.advance(1), ValueError)

    # -- left padding, optional and multi-dim narrow-dtype token fields travel intact ---------------
    rich = DistributedRolloutBuffer(mode="global", capacity=8, sampler=tr.UniformSampler(), padding_side="left",
                                    pad_token_id=-1, ref_logprobs=True, routing=(8, 2, 2))
    rich_data = []
    for r in range(world):
        d = make_batch(5, seed=50 + r)
        g = torch.Generator().manual_seed(60 + r)
        d["ref_logprobs"] = [-torch.rand(t.numel(), generator=g) for t in d["tokens"]]
        d["routing"] = [torch.randint(0, 8, (t.numel(), 2, 2), generator=g) for t in d["tokens"]]
        rich_data.append(d)
    rich.add(rich_data[rank])
    b = rich.sample(12, generator=gen)
    width = b.tokens.shape[1]
    mismatches = 0
    for k in range(12):
        src, s = rich_data[int(b.handles.rank[k])], int(b.handles.slot[k])
        n_tok = src["tokens"][s].numel()
        cols = slice(width - n_tok, width)
        mismatches += not (torch.equal(b.tokens[k, cols], src["tokens"][s])
                           and bool((b.tokens[k, : width - n_tok] == -1).all())
                           and torch.equal(b.ref_logprobs[k, cols], src["ref_logprobs"][s])
                           and b.routing.dtype == torch.uint8
                           and torch.equal(b.routing[k, cols].long(), src["routing"][s])
                           and bool(b.attention_mask[k, cols].all()))
    out["rich_mismatches"] = mismatches
    out["rich_owners"] = sorted(set(b.handles.rank.tolist()))

    # -- a rank with an empty shard -----------------------------------------------------------------
    one = DistributedRolloutBuffer(mode="global", capacity=8, sampler=sampler())
    if rank == 0:
        one.add(make_batch(3, seed=11))
    b = one.sample(4, generator=gen)
    out["empty_shard_owners"] = b.handles.rank.tolist()
    one_local = DistributedRolloutBuffer(mode="local", capacity=8, sampler=sampler())
    if rank == 0:
        one_local.add(make_batch(3, seed=11))
    out["err_local_empty"] = expect_raise(lambda: one_local.sample(2), ValueError)

    # -- a built RolloutBuffer as the shard (buffer=), already holding rollouts ------------------------
    built = tr.RolloutBuffer(capacity=8, sampler=sampler(), seed=rank)
    built.add(make_batch(2, seed=20 + rank, advantage=torch.ones(2)))  # equal masses: both ranks own draws
    wrapped = DistributedRolloutBuffer(mode="global", buffer=built)
    b = wrapped.sample(4, generator=gen)
    out["built"] = {"is_shard": wrapped.buffer is built, "owners": sorted(set(b.handles.rank.tolist())),
                    "served": wrapped.metrics()["dist_served"], "uses": int(built.slots.reuse.sum())}
    other = tr.RolloutBuffer(capacity=8 + rank, sampler=sampler())
    out["err_built_differs"] = expect_raise(lambda: DistributedRolloutBuffer(mode="global", buffer=other), ValueError)
    dist.barrier()


def _job_failures(rank: int, world: int, out: dict) -> None:
    import torch.distributed as dist

    import torchreplay as tr
    from rollouts import make_batch
    from torchreplay.distributed import DistributedRolloutBuffer

    stall_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=FAIL_TIMEOUT_S))
    die_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=FAIL_TIMEOUT_S))

    # A stalled peer: rank 1 never enters the sample; rank 0 gets a ReplayError after the timeout.
    stalled = DistributedRolloutBuffer(stall_group, mode="global", capacity=8)
    stalled.add(make_batch(4, seed=rank))
    if rank == 0:
        t0 = time.monotonic()
        out["stall_error"] = expect_raise(lambda: stalled.sample(2), tr.ReplayError)
        out["stall_elapsed"] = time.monotonic() - t0
    else:
        time.sleep(FAIL_TIMEOUT_S + 2.0)

    # A dead peer: rank 1 exits inside the first all_to_all (after the stats all_reduce).
    dying = DistributedRolloutBuffer(die_group, mode="global", capacity=8)
    dying.add(make_batch(4, seed=rank))
    dying.sample(2)  # the protocol works before the failure
    if rank == 1:
        def die(*args: Any, **kwargs: Any) -> None:
            os._exit(17)

        dist.all_to_all_single = die
        dying.sample(2)
    t0 = time.monotonic()
    out["dead_error"] = expect_raise(lambda: dying.sample(2), tr.ReplayError)
    out["dead_elapsed"] = time.monotonic() - t0
    out["after_error"] = expect_raise(lambda: dying.metrics(global_=True), tr.ReplayError)


# ------------------------------------------------------------------------------ checkpoint jobs
CKPT_INTERVAL_S = 3600.0  # no background manifests: every publish in these jobs is an explicit checkpoint()
CKPT_CAPACITY = 40  # the resumed shards: 4 -> 2 ranks doubles each one's share


def live_rollouts(buffer: Any) -> list[dict]:
    """Every live rollout of a RolloutBuffer shard, in slot order, with what must survive a resume."""
    t = buffer.slots
    slots = t.live.nonzero().flatten()
    if not slots.numel():
        return []
    b = buffer.gather(slots, count_use=False)
    out = []
    for k, s in enumerate(slots.tolist()):
        n = int(b.attention_mask[k].sum())
        out.append({"slot": s, "group_id": int(t.group_id[s]), "tokens": b.tokens[k, :n].tolist(),
                    "logprobs": b.logprobs[k, :n].tolist(), "reward": float(t.reward[s]),
                    "advantage": float(t.advantage[s]), "policy_version": int(t.policy_version[s]),
                    "reuse": int(t.reuse[s]), "prompt_len": int(t.prompt_len[s])})
    return out


def unique_batch(n: int, version: int, seed: int, first_id: int) -> dict:
    from rollouts import make_batch

    batch = make_batch(n, version=version, seed=seed)
    batch["group_id"] = first_id + torch.arange(n)  # one id per rollout: its identity across resumes
    return batch


def _ckpt_sampler() -> Any:
    import torchreplay as tr

    return tr.PrioritizedSampler(alpha=1.0, beta=BETA, eps=EPS, weight_norm="buffer_max")


def _job_ckpt_origin(rank: int, world: int, out: dict, uri: str) -> None:
    """4 ranks: fill, sample (use counts, reuse evictions), reprioritize, checkpoint."""
    import torchreplay as tr
    from torchreplay.distributed import DistributedRolloutBuffer

    buf = DistributedRolloutBuffer(mode="global", capacity=24, checkpoint_uri=uri, checkpoint_interval_s=CKPT_INTERVAL_S,
                                   sampler=_ckpt_sampler(), max_reuse=3, max_staleness=4)
    for step in range(3):  # three adds: three storage shards per rank, of different sizes per rank
        buf.add(unique_batch(3 + rank, version=step, seed=10 * rank + step, first_id=1000 * rank + 100 * step))
    buf.advance(2)
    gen = torch.Generator().manual_seed(5 + rank)
    for _ in range(4):
        b = buf.sample(6, generator=gen)
    buf.update_priorities(b.handles, torch.linspace(-2.0, 3.0, 6) + rank)
    buf.checkpoint()
    out["generation"] = buf.generation
    out["live"] = live_rollouts(buf.buffer)
    out["evicted_reuse"] = buf.metrics()["evicted_reuse"]
    # A fresh buffer must not start over a prefix holding a complete checkpoint.
    out["err_fresh_over_checkpoint"] = expect_raise(
        lambda: DistributedRolloutBuffer(capacity=8, checkpoint_uri=uri), ValueError, tr.ReplayError)


def _job_ckpt_to_two(rank: int, world: int, out: dict, uri: str) -> None:
    """2 ranks resume the 4-rank checkpoint, then keep going and checkpoint again."""
    import torchreplay as tr
    from torchreplay.distributed import DistributedRolloutBuffer

    # Too small a capacity fails on every rank before anything is imported (it leaves generation 1
    # recorded but never complete, which later resumes must skip).
    out["err_capacity"] = expect_raise(
        lambda: DistributedRolloutBuffer.from_checkpoint(uri, mode="global", capacity=10,
                                                         checkpoint_interval_s=CKPT_INTERVAL_S), ValueError)
    out["err_checkpoint_kwarg"] = expect_raise(
        lambda: DistributedRolloutBuffer.from_checkpoint(uri, capacity=10, checkpoint=True), TypeError)
    buf = DistributedRolloutBuffer.from_checkpoint(uri, mode="global", capacity=CKPT_CAPACITY,
                                                   checkpoint_interval_s=CKPT_INTERVAL_S)
    out["generation"] = buf.generation
    out["version"] = buf.version
    out["sampler"] = type(buf.buffer.sampler).__name__
    out["max_reuse"] = buf.buffer.max_reuse
    out["live"] = live_rollouts(buf.buffer)
    buf.add(unique_batch(4, version=3, seed=70 + rank, first_id=10_000 + 1000 * rank))
    buf.advance(3)
    gen = torch.Generator().manual_seed(9 + rank)
    for _ in range(3):
        buf.sample(5, generator=gen)
    buf.checkpoint()
    out["live_after"] = live_rollouts(buf.buffer)
    assert isinstance(buf.buffer.checkpointer, tr.Checkpointer)


def _job_tag_write(rank: int, world: int, out: dict, uri: str) -> None:
    """The trainer saves step 1 (a tagged cut on every rank), then runs on: LATEST is ahead."""
    from torchreplay.distributed import DistributedRolloutBuffer

    buf = DistributedRolloutBuffer(capacity=24, checkpoint_uri=uri, checkpoint_interval_s=CKPT_INTERVAL_S,
                                   sampler=_ckpt_sampler())
    for step in range(2):
        buf.add(unique_batch(3, version=step, seed=10 * rank + step, first_id=1000 * rank + 100 * step))
    buf.advance(1)
    buf.checkpoint(tag=1)
    out["live_at_1"] = live_rollouts(buf.buffer)
    buf.add(unique_batch(3, version=2, seed=50 + rank, first_id=1000 * rank + 200))
    buf.advance(2)
    buf.checkpoint()
    buf.close()


def _job_tag_resume(rank: int, world: int, out: dict, uri: str) -> None:
    """Resume step 1, on the same world size (exact) or another one (resharded)."""
    from torchreplay.distributed import DistributedRolloutBuffer

    buf = DistributedRolloutBuffer.from_checkpoint(uri, tag=1, checkpoint_interval_s=CKPT_INTERVAL_S)
    out["live"] = live_rollouts(buf.buffer)
    out["version"] = buf.buffer.version
    buf.close()


def _job_ckpt_to_three(rank: int, world: int, out: dict, uri: str) -> None:
    """3 ranks resume the 2-rank checkpoint (reshard), or a 3-rank one (same world size, exact);
    then draw one seeded global sample."""
    from torchreplay.distributed import DistributedRolloutBuffer

    buf = DistributedRolloutBuffer.from_checkpoint(uri, mode="global", capacity=CKPT_CAPACITY,
                                                   checkpoint_interval_s=CKPT_INTERVAL_S)
    out["generation"] = buf.generation
    out["version"] = buf.version
    out["live"] = live_rollouts(buf.buffer)
    out["tree"] = buf.buffer.sampler.tree.priorities[: CKPT_CAPACITY].tolist()
    b = buf.sample(7, generator=torch.Generator().manual_seed(300 + rank))
    out["next_sample"] = {"rank": b.handles.rank.tolist(), "slot": b.handles.slot.tolist(),
                          "group_id": b.group_id.tolist(), "weights": b.weights.tolist(),
                          "tokens": b.tokens.tolist(), "reuse": b.reuse.tolist()}


def _job_contract(rank: int, world: int, out: dict, uri: str) -> None:
    """2 ranks: global sample(b) for b = 1..9 with an odd-width rollout field, batch-max weights,
    the reuse cap across ranks within one call; then a 1 -> 2 reshard of a FreshnessSampler
    checkpoint written by rank 0 alone."""
    import torchreplay as tr
    from rollouts import make_batch
    from torchreplay.distributed import DistributedRolloutBuffer

    score = {"score": tr.FieldSpec("score", "rollout", torch.int32, (), accept="int")}
    buf = DistributedRolloutBuffer(mode="global", capacity=32, extra_fields=score, max_reuse=2,
                                   sampler=tr.PrioritizedSampler(alpha=1.0, beta=BETA, eps=EPS, weight_norm="batch_max"))
    data = shard_batch(rank)
    data["score"] = (data["advantage"] * 1000).round().to(torch.int32)  # checkable on any receiver
    buf.add(data)
    gen = torch.Generator().manual_seed(77 + rank)
    out["sizes"], out["scores_ok"], out["max_weight"], out["draws"] = [], True, [], []
    for b in range(1, 10):
        batch = buf.sample(b, generator=gen)
        out["sizes"].append(len(batch))
        expect = (batch.advantage * 1000).round().to(torch.int32)
        out["scores_ok"] &= bool(torch.equal(batch.score, expect))
        out["max_weight"].append(float(batch.weights.max()))
        out["draws"].append(list(zip(batch.handles.rank.tolist(), batch.handles.slot.tolist(),
                                     batch.reuse.tolist())))
        buf.add(dict(data, policy_version=0))  # refill what the reuse cap evicted
    buf.close()

    # 1 -> 2 reshard: rank 0 writes a 1-rank checkpoint (its own group of one), then both resume.
    import torch.distributed as dist

    solo = dist.new_group([0])
    if rank == 0:
        old = DistributedRolloutBuffer(process_group=solo, mode="global", capacity=64, checkpoint_uri=uri,
                                       max_staleness=8,
                                       sampler=tr.FreshnessSampler(alpha=1.0, beta=0.4, eps=EPS, tau=0.5, weight_norm="batch_max"))
        for v in (10, 14, 18):
            old.add(make_batch(4, version=v, seed=v))
        old.buffer.sampler.beta = 0.7  # annealed: state, not configuration
        old.checkpoint()
        old.close()
    dist.barrier()
    new = DistributedRolloutBuffer.from_checkpoint(uri, mode="global", capacity=64)
    sampler = new.buffer.sampler
    out["reshard"] = {"version": new.version, "t_ref": sampler.t_ref, "beta": sampler.beta,
                      "tau": sampler.tau, "weight_norm": sampler.weight_norm, "live": len(new),
                      "max_staleness": new.buffer.max_staleness}
    counts: dict[str, int] = {}
    g = torch.Generator().manual_seed(5 + rank)
    for _ in range(50):
        b = new.sample(10, generator=g)
        for v in b.policy_version.tolist():
            counts[str(v)] = counts.get(str(v), 0) + 1
    out["reshard_version_draws"] = counts

    # Ranks whose own adds put them at different versions (31 and 32): the global draw brings both
    # to 32 first, so both FreshnessSampler references agree (tau 1: v31 weighs e^-1 of v32).
    fr = DistributedRolloutBuffer(mode="global", capacity=16,
                                  sampler=tr.FreshnessSampler(alpha=1.0, beta=0.0, eps=EPS, tau=1.0))
    fr.add(make_batch(2, version=31 + rank, seed=40 + rank, advantage=torch.ones(2)))
    g = torch.Generator().manual_seed(9 + rank)
    newest = 0
    for _ in range(40):
        newest += int((fr.sample(20, generator=g).policy_version == 32).sum())
    out["fresh_versions"] = [fr.version, fr.buffer.sampler.t_ref, newest]


def _job_mixed_versions_write(rank: int, world: int, out: dict, uri: str) -> None:
    """3 ranks, max_staleness=1, advance to 2; then rank 1 alone adds one rollout of version 3
    (its own version moves to 3 and evicts its version-1 rollouts) and the job checkpoints before
    the next collective advance: ranks 0 and 2 still hold version-1 rollouts, stale at 3."""
    from torchreplay.distributed import DistributedRolloutBuffer

    buf = DistributedRolloutBuffer(capacity=24, checkpoint_uri=uri, checkpoint_interval_s=CKPT_INTERVAL_S,
                                   sampler=_ckpt_sampler(), max_staleness=1)
    for v in (1, 2):
        buf.add(unique_batch(3, version=v, seed=10 * rank + v, first_id=1000 * rank + 100 * v))
        buf.advance(v)
    if rank == 1:
        buf.add(unique_batch(1, version=3, seed=99, first_id=1300))
    buf.checkpoint()
    out["version"] = buf.version
    out["live"] = live_rollouts(buf.buffer)
    buf.close()


def _job_mixed_versions_resume(rank: int, world: int, out: dict, uri: str) -> None:
    from torchreplay.distributed import DistributedRolloutBuffer

    buf = DistributedRolloutBuffer.from_checkpoint(uri, checkpoint_interval_s=CKPT_INTERVAL_S)
    out["version"] = buf.version
    out["live"] = live_rollouts(buf.buffer)
    out["evicted_staleness"] = buf.metrics()["evicted_staleness"]
    buf.close()


JOBS = {"contract": _job_contract, "main": _job_main, "failures": _job_failures, "ckpt_origin": _job_ckpt_origin,
        "ckpt_to_two": _job_ckpt_to_two, "ckpt_to_three": _job_ckpt_to_three, "tag_write": _job_tag_write,
        "tag_resume": _job_tag_resume, "mixed_versions_write": _job_mixed_versions_write,
        "mixed_versions_resume": _job_mixed_versions_resume}


# ------------------------------------------------------------------------------ tests
@pytest.fixture(scope="module")
def main_job(tmp_path_factory) -> list[dict]:
    results, codes = run_job("main", 2, tmp_path_factory.mktemp("main"))
    for r, res in enumerate(results):
        assert res.get("ok"), f"rank {r} failed (exit {codes[r]}):\n{res.get('traceback')}"
    return results


@pytest.fixture(scope="module")
def contract_job(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("contract")
    results, codes = run_job("contract", 2, root, job_args={"uri": f"file://{root}/run"})
    for r, res in enumerate(results):
        assert res.get("ok"), f"rank {r} failed (exit {codes[r]}):\n{res.get('traceback')}"
    return results


def test_global_sample_of_every_size_with_odd_width_fields(contract_job):
    """sample(1) used to crash viewing a 4-byte-wide column of one packed row as int64."""
    for res in contract_job:
        assert res["sizes"] == list(range(1, 10))
        assert res["scores_ok"]
        # batch_max (set explicitly): each batch's lowest-priority row gets weight 1.
        assert all(w == pytest.approx(1.0) for w in res["max_weight"])


def test_global_reuse_cap_holds_across_ranks_within_one_call(contract_job):
    for call in range(9):
        seen: dict[tuple[int, int], int] = {}
        for res in contract_job:
            for owner, slot, reuse in res["draws"][call]:
                seen[(owner, slot)] = seen.get((owner, slot), 0) + 1
                assert reuse < 2
        # Both ranks' batches together: no rollout more often than max_reuse=2 (minus earlier uses).
        assert max(seen.values()) <= 2, (call, seen)


def test_reshard_keeps_freshness_staleness_and_sampler_config_on_every_rank(contract_job):
    a, b = contract_job[0]["reshard"], contract_job[1]["reshard"]
    for r in (a, b):
        assert r["version"] == 18 and r["max_staleness"] == 8
        assert r["beta"] == pytest.approx(0.7) and r["tau"] == 0.5 and r["weight_norm"] == "batch_max"
    assert a["t_ref"] == b["t_ref"]
    assert a["live"] + b["live"] == 12  # nothing lost, nothing duplicated
    # tau 0.5: version 18 outweighs 14 by e^8; every draw must be version 18 rollouts (and none is lost to a
    # rank that never learned the newest version).
    total = {}
    for res in contract_job:
        for v, n in res["reshard_version_draws"].items():
            total[v] = total.get(v, 0) + n
    assert total.get("18", 0) / sum(total.values()) > 0.99


def test_global_sampling_brings_ranks_at_different_versions_together(contract_job):
    """Rank 0 added at version 31, rank 1 at 32: each rank's FreshnessSampler reference followed
    its own version, and the v32 rollouts got 0 of 800 draws. Expected share 1 / (1 + e^-1) =
    0.731; 1600 draws (stratified) give a standard error below 0.011, tolerance 0.06."""
    a, b = contract_job[0]["fresh_versions"], contract_job[1]["fresh_versions"]
    assert a[:2] == b[:2] and a[0] == 32
    share = (a[2] + b[2]) / 1600
    assert abs(share - 1 / (1 + math.exp(-1))) < 0.06, share


def test_global_sampling_frequencies_match_priorities_over_all_ranks(main_job):
    from scipy import stats

    counts = torch.tensor(main_job[0]["global_counts"]) + torch.tensor(main_job[1]["global_counts"])
    observed = torch.cat([counts[r, : SIZES[r]] for r in range(2)]).double()
    probs = torch.cat([shard_advantages(r).double().abs() + EPS for r in range(2)])
    expected = probs / probs.sum() * observed.sum()
    assert int(observed.sum()) == 2 * 150 * 16
    assert float(counts[0, SIZES[0]:].sum()) == 0 and float(counts[1, SIZES[1]:].sum()) == 0
    p = stats.chisquare(observed.numpy(), expected.numpy()).pvalue
    assert p > P_MIN, f"chi-square p={p:.2e}"
    # The skew is real (rank 0 holds ~90% of the mass with 6 of 26 rollouts) and both ranks get
    # a representative share, not a contiguous slice of the mass.
    share0 = float(probs[: SIZES[0]].sum() / probs.sum())
    assert share0 > 0.85
    for r in range(2):  # each rank's own share is an unbiased sample too (the shared rotation)
        per_rank = torch.tensor(main_job[r]["global_counts"])
        assert abs(float(per_rank[0].sum() / per_rank.sum()) - share0) < 0.02
        own = torch.cat([per_rank[o, : SIZES[o]] for o in range(2)]).double()
        p = stats.chisquare(own.numpy(), (probs / probs.sum() * own.sum()).numpy()).pvalue
        assert p > P_MIN, f"rank {r}: chi-square p={p:.2e}"


def test_global_payloads_and_weights_are_exact(main_job):
    for r in range(2):
        assert main_job[r]["global_payload_errors"] == 0
        assert main_job[r]["global_weight_rel_err"] < 1e-5
        m = main_job[r]["global_metrics"]
        assert m["dist_received"] == m["sampled_replay"] == 150 * 16
        assert m["sample_calls"] == 150 and m["dist_payload_bytes_sent"] > 0
    g = main_job[0]["global_metrics_all"]
    assert g["dist_received"] == g["dist_served"] == 2 * 150 * 16
    assert g == main_job[1]["global_metrics_all"]


def test_global_payload_packing_keeps_dtypes_shapes_and_left_padding(main_job):
    for r in range(2):
        assert main_job[r]["rich_mismatches"] == 0
    assert {o for r in range(2) for o in main_job[r]["rich_owners"]} == {0, 1}


def test_global_update_priorities_reach_the_owner(main_job):
    sent = {tuple(p) for r in range(2) for p in main_job[r]["update_sent"]}
    assert sum(main_job[r]["update_applied"] for r in range(2)) >= len(sent)
    for owner in range(2):
        table = main_job[owner]["update_table"]
        original = shard_advantages(owner)
        for slot in range(SIZES[owner]):
            want = 100.0 + 1000.0 * owner + slot if (owner, slot) in sent else float(original[slot])
            assert table[slot] == pytest.approx(want), (owner, slot)


def test_local_mode_weights_are_normalized_over_all_ranks(main_job):
    for r in range(2):
        assert main_job[r]["local_weight_rel_err"] < 1e-5
        assert main_job[r]["local_max_weight"] <= 1.0 + 1e-6
        assert main_job[r]["local_payload_bytes"] == 0
        assert main_job[r]["local_update_applied"] == 16
    # Rank 1's shard holds the smallest sampling probability, so its weights reach 1 and rank 0's
    # are all well below 1: the normalization is global, not per shard.
    assert main_job[1]["local_max_weight"] == pytest.approx(1.0)
    assert main_job[0]["local_max_weight"] < 0.5


def test_bad_or_disagreeing_arguments_raise_on_every_rank(main_job):
    for r in range(2):
        assert "same on every rank" in main_job[r]["err_batch_differs"]
        assert "same on every rank" in main_job[r]["err_advance_differs"]
        assert "different" in main_job[r]["err_mode_differs"]
        assert main_job[r]["err_bad_mode"].startswith("ValueError")
        assert "empty" in main_job[r]["err_local_empty"]
        assert "backwards" in main_job[r]["err_backwards"]
    assert main_job[1]["err_batch_bad"].startswith("ValueError: batch_size")
    assert main_job[0]["err_batch_bad"].startswith("ReplayError") and "rank(s) [1]" in main_job[0]["err_batch_bad"]


def test_advance_staleness_reuse_and_global_metrics_agree(main_job):
    for r in range(2):
        assert main_job[r]["advance_version"] == 2
        assert main_job[r]["advance_len"] == 3
        assert main_job[r]["empty_shard_owners"] == [0, 0, 0, 0]
        # A built shard (buffer=) is the one sampled: its rollouts are served and their uses counted in it.
        built = main_job[r]["built"]
        assert built["is_shard"] and built["owners"] == [0, 1] and built["served"] == built["uses"] > 0
        assert "different" in main_job[r]["err_built_differs"]
    assert sum(main_job[r]["built"]["served"] for r in range(2)) == 2 * 4
    g = main_job[0]["advance_global"]
    assert g == main_job[1]["advance_global"]
    received = {tuple(p) for r in range(2) for p in main_job[r]["reuse_received"]}
    assert g["evicted_staleness"] == 4 + 6
    assert g["evicted_reuse"] == len(received)
    assert g["size"] == 6 - len(received)
    assert g["policy_version"] == 2 and g["dist_served"] == g["dist_received"] == 4


def test_dead_or_stalled_rank_raises_replay_error_within_the_timeout(tmp_path):
    results, codes = run_job("failures", 2, tmp_path, timeout_s=FAIL_TIMEOUT_S)
    assert codes[1] == 17, f"rank 1 should have died in the all_to_all: {results[1]}"
    res = results[0]
    assert res.get("ok"), res.get("traceback")
    assert res["stall_error"].startswith("ReplayError") and "rank 0 of 2" in res["stall_error"]
    assert "timeout" in res["stall_error"]
    # The stalled call waited for the group's timeout (not a spurious early error: the lower bound)
    # and then raised rather than hanging. How long after the timeout it raised depends on the
    # machine's load, so the upper bound is only the harness's hang limit (run_job fails a job
    # still running after JOB_TIMEOUT_S); the error text says it was the timeout.
    assert FAIL_TIMEOUT_S - 0.5 < res["stall_elapsed"] < JOB_TIMEOUT_S
    assert res["dead_error"].startswith("ReplayError") and "sample: " in res["dead_error"]
    assert res["dead_elapsed"] < JOB_TIMEOUT_S
    assert "failed earlier" in res["after_error"]


def test_constructor_needs_an_initialized_process_group(tmp_path):
    import torchreplay as tr
    from torchreplay.distributed import DistributedRolloutBuffer

    with pytest.raises(ValueError, match="mode"):
        DistributedRolloutBuffer(mode="everywhere", capacity=4)
    # The one constructor's own arguments are checked before any collective.
    shard = tr.RolloutBuffer(capacity=4)
    with pytest.raises(TypeError, match="buffer must be a RolloutBuffer"):
        DistributedRolloutBuffer(buffer={"capacity": 4})
    with pytest.raises(TypeError, match="not both"):
        DistributedRolloutBuffer(buffer=shard, capacity=4)
    with pytest.raises(ValueError, match="generation"):
        DistributedRolloutBuffer(buffer=shard, generation=0)
    with pytest.raises(ValueError, match="generation"):
        DistributedRolloutBuffer(buffer=shard, checkpoint_uri=f"file://{tmp_path}/run", generation=-1)
    listening = tr.RolloutBuffer(capacity=4, checkpoint=tr.Checkpointer(f"file://{tmp_path}/ckpt"))
    with pytest.raises(TypeError, match="already has a checkpointer"):
        DistributedRolloutBuffer(buffer=listening)
    listening.detach_checkpointer().close(final=False)
    if not torch.distributed.is_initialized():
        with pytest.raises(tr.ReplayError, match="init_process_group"):
            DistributedRolloutBuffer(capacity=4)


# ------------------------------------------------------------------------------ checkpoint tests
@pytest.fixture(scope="module")
def ckpt_chain(tmp_path_factory) -> dict[str, Any]:
    """One run prefix: 4 ranks checkpoint; 2 resume (reshard) and checkpoint; 3 resume (reshard);
    3 resume the 3-rank checkpoint (same world size)."""
    root = tmp_path_factory.mktemp("ckpt")
    uri = f"file://{root}/run"
    out: dict[str, Any] = {"uri": uri}
    for name, job, world in (("origin", "ckpt_origin", 4), ("two", "ckpt_to_two", 2), ("three", "ckpt_to_three", 3),
                             ("same", "ckpt_to_three", 3)):
        t0 = time.monotonic()
        (root / name).mkdir()
        results, codes = run_job(job, world, root / name, job_args={"uri": uri})
        for r, res in enumerate(results):
            assert res.get("ok"), f"{name}: rank {r} failed (exit {codes[r]}):\n{res.get('traceback')}"
        out[name] = results
        out[f"{name}_s"] = time.monotonic() - t0
    return out


def _by_id(per_rank: list[list[dict]]) -> dict[int, dict]:
    """Rollouts of all ranks keyed by their (unique) group id; fails on any duplicate."""
    out: dict[int, dict] = {}
    for rollouts in per_rank:
        for r in rollouts:
            assert r["group_id"] not in out, f"rollout {r['group_id']} is on two ranks"
            out[r["group_id"]] = r
    return out


def _same_rollouts(old: list[list[dict]], new: list[list[dict]]) -> None:
    """Nothing lost, nothing duplicated, every carried field intact (slots may differ)."""
    fields = ("tokens", "logprobs", "reward", "advantage", "policy_version", "reuse", "prompt_len")
    a, b = _by_id(old), _by_id(new)
    assert sorted(a) == sorted(b), (f"lost {sorted(set(a) - set(b))}, appeared {sorted(set(b) - set(a))}")
    for gid in a:
        for f in fields:
            assert a[gid][f] == b[gid][f], (gid, f)


def test_reshard_four_to_two_loses_and_duplicates_nothing(ckpt_chain):
    origin, two = ckpt_chain["origin"], ckpt_chain["two"]
    old = [res["live"] for res in origin]
    assert sum(len(x) for x in old) > 30 and sum(res["evicted_reuse"] for res in origin) > 0
    assert {r["reuse"] for x in old for r in x} >= {0, 1}  # use counts of several values to carry
    _same_rollouts(old, [res["live"] for res in two])
    for res in two:
        # Generation 1 was recorded by the failed (capacity) attempt and never completed.
        assert res["generation"] == 2 and res["version"] == 2
        assert res["sampler"] == "PrioritizedSampler" and res["max_reuse"] == 3  # config from the checkpoint
        assert 0 < len(res["live"]) <= CKPT_CAPACITY
    sizes = [len(res["live"]) for res in two]
    assert abs(sizes[0] - sizes[1]) <= 6  # at most one storage shard's worth apart


def test_reshard_two_to_three_loses_and_duplicates_nothing(ckpt_chain):
    old = [res["live_after"] for res in ckpt_chain["two"]]
    assert any(r["policy_version"] == 3 for x in old for r in x)  # rollouts added after the first resume
    three = ckpt_chain["three"]
    _same_rollouts(old, [res["live"] for res in three])
    for res in three:
        assert res["generation"] == 3 and res["version"] == 3 and len(res["live"]) > 0


def test_resume_on_the_same_world_size_is_exact(ckpt_chain):
    three, same = ckpt_chain["three"], ckpt_chain["same"]
    for r in range(3):
        assert same[r]["generation"] == 3  # keeps checkpointing where it resumed from
        assert same[r]["live"] == three[r]["live"]  # slots included
        assert same[r]["tree"] == three[r]["tree"]
        assert same[r]["next_sample"] == three[r]["next_sample"]
    assert {o for r in range(3) for o in three[r]["next_sample"]["rank"]} == {0, 1, 2}


def test_resume_leaves_older_generations_intact_and_refuses_bad_calls(ckpt_chain):
    import torchreplay as tr
    from torchreplay.distributed import newest_complete_generation, rank_uri

    uri = ckpt_chain["uri"]
    assert newest_complete_generation(uri) == (3, 3)
    # The 4-rank checkpoint is still whole after the job resumed from it twice.
    restored = []
    for r in range(4):
        buf = tr.RolloutBuffer.from_checkpoint(rank_uri(uri, 0, r), progress=False)
        restored.append(live_rollouts(buf))
        buf.close()
    assert restored == [res["live"] for res in ckpt_chain["origin"]]
    assert ckpt_chain["origin"][0]["err_fresh_over_checkpoint"].startswith("ValueError") and \
        "from_checkpoint" in ckpt_chain["origin"][0]["err_fresh_over_checkpoint"]
    assert all("rank(s) [0]" in res["err_fresh_over_checkpoint"] for res in ckpt_chain["origin"][1:])
    for res in ckpt_chain["two"]:
        assert "capacity" in res["err_capacity"] and "pass capacity >=" in res["err_capacity"]
        assert "checkpoint_uri" in res["err_checkpoint_kwarg"]


def test_a_tagged_cut_resumes_on_the_same_and_on_another_world_size(tmp_path):
    """The trainer resumes from step 1 while LATEST is at step 2: every rank restores the tagged
    cut exactly (same world size), and a resharded resume holds exactly its rollouts."""
    uri = f"file://{tmp_path}/run"
    for name, job, world in (("write", "tag_write", 2), ("same", "tag_resume", 2), ("one", "tag_resume", 1)):
        (tmp_path / name).mkdir()
        results, codes = run_job(job, world, tmp_path / name, timeout_s=60, job_args={"uri": uri})
        for r, res in enumerate(results):
            assert res.get("ok"), f"{name}: rank {r} failed (exit {codes[r]}):\n{res.get('traceback')}"
        if name == "write":
            written = results
        elif name == "same":
            for r in range(2):
                assert results[r]["version"] == 1 and results[r]["live"] == written[r]["live_at_1"]
        else:
            _same_rollouts([res["live_at_1"] for res in written], [results[0]["live"]])
            assert results[0]["version"] == 1


def test_reshard_of_a_cut_with_ranks_at_different_versions_drops_exactly_the_stale_rollouts(tmp_path):
    """Issue 24 item 6. The cut is taken with rank 1 at version 3 and ranks 0 and 2 at 2
    (max_staleness=1). Resharded onto 2 ranks, every new rank resumes at version 3, the newest any
    old rank held, and treats every old rollout alike: exactly those stale at 3 (version 1, on old
    ranks 0 and 2) are dropped, every other one lands on exactly one new rank with its fields.
    Before the fix the plan counted the stale rollouts that the import then skipped, and the
    resume raised "rank 0 imported 1 rollouts from generation 0, planned 6" on one rank."""
    uri = f"file://{tmp_path}/run"
    runs = {}
    for name, job, world in (("write", "mixed_versions_write", 3), ("resume", "mixed_versions_resume", 2)):
        (tmp_path / name).mkdir()
        results, codes = run_job(job, world, tmp_path / name, timeout_s=60, job_args={"uri": uri})
        for r, res in enumerate(results):
            assert res.get("ok"), f"{name}: rank {r} failed (exit {codes[r]}):\n{res.get('traceback')}"
        runs[name] = results
    written, resumed = runs["write"], runs["resume"]
    assert [res["version"] for res in written] == [2, 3, 2]
    old = _by_id([res["live"] for res in written])
    # Rank 1 evicted its own version-1 rollouts when it moved to 3; ranks 0 and 2 still hold theirs.
    assert sorted(gid for gid, r in old.items() if r["policy_version"] == 1) == [100, 101, 102, 2100, 2101, 2102]
    survivors = [[r for r in res["live"] if r["policy_version"] >= 3 - 1] for res in written]
    _same_rollouts(survivors, [res["live"] for res in resumed])
    assert sorted(_by_id([res["live"] for res in resumed])) == [200, 201, 202, 1200, 1201, 1202, 1300,
                                                                 2200, 2201, 2202]
    for res in resumed:
        assert res["version"] == 3 and len(res["live"]) > 0
        assert res["evicted_staleness"] == 0  # dropped at import, not imported and then evicted


def test_plan_reshard_assigns_every_shard_once_and_balances():
    from torchreplay.distributed import plan_reshard

    live = [[5, 1, 9], [], [3, 3, 3, 8], [2]]
    for world in (1, 2, 3, 7):
        owner = plan_reshard(live, world)
        assert [len(o) for o in owner] == [len(x) for x in live]
        loads = [0] * world
        for rows, owners in zip(live, owner):
            for n, r in zip(rows, owners):
                assert 0 <= r < world
                loads[r] += n
        assert sum(loads) == sum(map(sum, live))
        assert max(loads) - min(loads) <= max(map(max, filter(None, live)))
        assert plan_reshard(live, world) == owner  # deterministic
    with pytest.raises(ValueError, match="world_size"):
        plan_reshard(live, 0)


def test_an_owners_draws_at_positions_keep_every_reuse_budget():
    """`RolloutBuffer.draw_at`, an owner's half of global sampling: a slot named past its reuse
    budget keeps its first draws and the rest are redrawn from slots with budget left; with no
    such slot it raises and the buffer's generator is as it was. Fails when `Ledger.draw_at` does
    not take the kept draws off the budgets (the redraw then names slot 0 again: [0, 0, 1])."""
    import torchreplay as tr
    from rollouts import make_batch

    sampler = tr.PrioritizedSampler(alpha=1.0, beta=0.0)
    buf = tr.RolloutBuffer(capacity=2, sampler=sampler, max_reuse=2, seed=0)
    buf.add(make_batch(2, advantage=torch.tensor([1000.0, 0.001])))  # slot 0 holds ~all the mass
    buf.gather(torch.tensor([0]), count_use=True)  # slot 0: one use left; slot 1: two
    within, _, redrawn = buf.draw_at(torch.tensor([0.5], dtype=torch.float64))
    assert within.tolist() == [0] and redrawn == 0  # within its budget: kept
    slots, prio, redrawn = buf.draw_at(torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64))
    assert slots.tolist() == [0, 1, 1] and redrawn == 2
    assert prio.tolist() == pytest.approx([1000.001, 0.002, 0.002])  # (|A| + eps) ** 1
    assert len(buf.gather(slots, count_use=True)) == 3  # within every budget: gather accepts them

    solo = tr.RolloutBuffer(capacity=2, sampler=tr.UniformSampler(), max_reuse=1, seed=0)
    solo.add(make_batch(1))
    state = solo.generator.get_state()
    with pytest.raises(ValueError, match="reuse budgets"):
        solo.draw_at(torch.tensor([0.1, 0.6], dtype=torch.float64))
    assert torch.equal(solo.generator.get_state(), state)
    with pytest.raises(TypeError, match="ProportionalSampler"):
        tr.RolloutBuffer(capacity=2, sampler=tr.GroupSampler()).draw_at(torch.tensor([0.5], dtype=torch.float64))


def test_rank_row_reads_samplers_through_the_protocol():
    """The rank table row (`stats.rank_row`): a `ProportionalSampler` gives its mass and beta;
    a sampler outside the protocol (GroupSampler: no beta, no mass) counts its rollouts with beta
    0, the protocol's documented default. Fails if rank_row reads `beta` off any sampler
    (GroupSampler has none: AttributeError) or ignores a proportional sampler's mass."""
    import torchreplay as tr
    from rollouts import make_batch
    from torchreplay.distributed.stats import BETA, COUNT, MIN, OK, SHIFT, TOTAL, VERSION, rank_row
    from torchreplay.samplers import ProportionalSampler

    assert isinstance(tr.PrioritizedSampler(), ProportionalSampler) and isinstance(tr.PNewestSampler(),
                                                                                      ProportionalSampler)
    assert not isinstance(tr.GroupSampler(), ProportionalSampler)
    per = tr.RolloutBuffer(capacity=4, sampler=tr.PrioritizedSampler(alpha=1.0, beta=0.25, eps=0.5))
    per.add(make_batch(2, version=3, advantage=torch.tensor([1.0, -2.5])))
    row = rank_row(per, 8, True, 0.5)
    assert row[COUNT] == 2 and row[TOTAL] == pytest.approx(1.5 + 3.0) and row[MIN] == pytest.approx(1.5)
    assert row[BETA] == 0.25 and row[OK] == 1 and row[SHIFT] == 0.5 and row[VERSION] == 3
    grouped = tr.RolloutBuffer(capacity=4, sampler=tr.GroupSampler())
    grouped.add(make_batch(3))
    row = rank_row(grouped, 8, False, 0.0)
    assert row[COUNT] == 3 and row[TOTAL] == 3 and row[MIN] == 1 and row[BETA] == 0 and row[OK] == 0
