"""DistributedRolloutBuffer over gloo on the CPU: global sampling frequencies, local-mode IS weights,
payload integrity, collective argument checks, version/metrics agreement, dead and stalled peers.

Process start-up dominates the cost, so each job runs several scenarios and
writes one JSON result per rank; the tests below assert on those results. Two jobs of 2 ranks each.
"""

from __future__ import annotations

import json
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
def _entry(rank: int, world: int, init_file: str, out_dir: str, job: str, timeout_s: float) -> None:
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
        JOBS[job](rank, world, result)
        result["ok"] = True
    except BaseException:  # reported to the parent, which fails the test with it
        result["ok"] = False
        result["traceback"] = traceback.format_exc()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    # Skip destroy_process_group: after a peer failure it can block; the process is ending anyway.
    os._exit(0)


def run_job(job: str, world: int, tmp_path: Path, timeout_s: float = 30.0) -> tuple[list[dict], list[int]]:
    import torch.multiprocessing as mp

    # fork, not spawn: a spawned child re-imports torch, which costs ~5-10 s per rank on 2 loaded
    # cores. The parent never builds a process group, and children drop to one intra-op thread first.
    ctx = mp.get_context("fork")
    init_file = tmp_path / f"{job}.init"
    procs = [ctx.Process(target=_entry, args=(r, world, str(init_file), str(tmp_path), job, timeout_s))
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
        return tr.PrioritizedSampler(alpha=1.0, beta=BETA, eps=EPS)

    data = [shard_batch(r) for r in range(world)]
    prio = [(shard_advantages(r).double().abs() + EPS) for r in range(world)]
    pmin = min(float(p.min()) for p in prio)

    # -- global mode: frequencies, payload integrity, IS weights --------------------------------
    buf = DistributedRolloutBuffer(mode="global", capacity=32, sampler=sampler())
    buf.add(data[rank])
    stats_ = buf.shard_stats()
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
    out["update_table"] = buf.buffer._table.advantage[: SIZES[rank]].tolist()

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


JOBS = {"main": _job_main, "failures": _job_failures}


# ------------------------------------------------------------------------------ tests
@pytest.fixture(scope="module")
def main_job(tmp_path_factory) -> list[dict]:
    results, codes = run_job("main", 2, tmp_path_factory.mktemp("main"))
    for r, res in enumerate(results):
        assert res.get("ok"), f"rank {r} failed (exit {codes[r]}):\n{res.get('traceback')}"
    return results


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
    g = main_job[0]["advance_global"]
    assert g == main_job[1]["advance_global"]
    received = {tuple(p) for r in range(2) for p in main_job[r]["reuse_received"]}
    assert g["evicted_staleness"] == 4 + 6
    assert g["evicted_reuse"] == len(received)
    assert g["size"] == 6 - len(received)
    assert g["policy_version"] == 2 and g["dist_served"] == g["dist_received"] == 4


def test_dead_or_stalled_rank_raises_replay_error_within_the_timeout(tmp_path):
    t0 = time.monotonic()
    results, codes = run_job("failures", 2, tmp_path, timeout_s=FAIL_TIMEOUT_S)
    assert codes[1] == 17, f"rank 1 should have died in the all_to_all: {results[1]}"
    res = results[0]
    assert res.get("ok"), res.get("traceback")
    assert res["stall_error"].startswith("ReplayError") and "rank 0 of 2" in res["stall_error"]
    assert "timeout" in res["stall_error"]
    assert FAIL_TIMEOUT_S - 0.5 < res["stall_elapsed"] < FAIL_TIMEOUT_S + 5
    assert res["dead_error"].startswith("ReplayError") and "sample: " in res["dead_error"]
    assert res["dead_elapsed"] < FAIL_TIMEOUT_S + 5
    assert "failed earlier" in res["after_error"]
    assert time.monotonic() - t0 < JOB_TIMEOUT_S


def test_constructor_needs_an_initialized_process_group():
    import torchreplay as tr
    from torchreplay.distributed import DistributedRolloutBuffer

    with pytest.raises(ValueError, match="mode"):
        DistributedRolloutBuffer(mode="everywhere", capacity=4)
    if not torch.distributed.is_initialized():
        with pytest.raises(tr.ReplayError, match="init_process_group"):
            DistributedRolloutBuffer(capacity=4)
