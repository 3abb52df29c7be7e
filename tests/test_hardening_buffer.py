"""Issue 24, items 9-11: a refused call leaves every metric as it was; a lowered reuse cap evicts
what reached it at once; the list-of-tensors input is copied into recycled host memory too.

"Twin" tests build two buffers the same way, give one of them the refused call, and compare the
whole `metrics()` dict: a refused call must leave nothing a logger could see."""

from __future__ import annotations

import math

import pytest
import torch

import torchreplay as tr
from faults import FlakyStorage
from rollouts import make_batch
from torchreplay.checkpoint import Checkpointer
from torchreplay.errors import StorageError


def packed(batch: dict) -> dict:
    """`batch` with its ragged fields in the packed {"values", "offsets"} form."""
    out = dict(batch)
    for name in ("tokens", "response_mask", "logprobs"):
        parts = batch[name]
        offsets = torch.zeros(len(parts) + 1, dtype=torch.int64)
        torch.cumsum(torch.tensor([p.shape[0] for p in parts]), 0, out=offsets[1:])
        out[name] = {"values": torch.cat(parts), "offsets": offsets}
    return out


FORMS = {"list": lambda b: b, "packed": packed}


def twins(**kwargs) -> tuple[tr.RolloutBuffer, tr.RolloutBuffer]:
    """Two buffers in the same state: 8 rollouts at version 0, each sampled once."""
    out = []
    for _ in range(2):
        buf = tr.RolloutBuffer(32, sampler=tr.UniformSampler(), seed=1, **kwargs)
        buf.add(make_batch(8, version=0, seed=3))
        buf.gather(torch.arange(8))
        out.append(buf)
    return out[0], out[1]


def assert_same_metrics(a: tr.RolloutBuffer, b: tr.RolloutBuffer) -> None:
    ma, mb = a.metrics(), b.metrics()
    assert ma.keys() == mb.keys()
    differ = {k: (ma[k], mb[k]) for k in ma
              if not (ma[k] == mb[k] or (isinstance(ma[k], float) and math.isnan(ma[k]) and math.isnan(mb[k])))}
    assert not differ, f"metrics that differ from the twin's (refused, twin): {differ}"


def assert_same_next_call(a: tr.RolloutBuffer, b: tr.RolloutBuffer) -> None:
    """Both buffers answer the next compose alike (the generator and the table were left as they were)."""
    fresh = make_batch(4, version=2, seed=9)
    x, y = a.compose(fresh, n_replay=4), b.compose(fresh, n_replay=4)
    assert torch.equal(x.handles.slot, y.handles.slot) and torch.equal(x.tokens, y.tokens)
    assert_same_metrics(a, b)


# ------------------------------------------------------------------ item 9: refused calls
COMPOSE_REFUSALS = {
    "negative n_replay": (dict(n_replay=-1), {}),
    "short replay under if_short='raise'": (dict(n_replay=100, if_short="raise"), dict(max_reuse=3)),
    "multiple_of that n_replay misses": (dict(n_replay=3, multiple_of=4), {}),
    "fresh rollouts older than the staleness cap": (dict(n_replay=2, version=0, advance=5), dict(max_staleness=1)),
}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", COMPOSE_REFUSALS)
def test_a_refused_compose_changes_no_metric(form, case):
    """Issue 24 item 9: after compose(packed, n_replay=-1) was refused, storage_fresh_bytes was
    6444 against 0 on a twin (the fresh batch had been copied into the host pool first)."""
    args, config = COMPOSE_REFUSALS[case]
    args = dict(args)
    version, advance = args.pop("version", 1), args.pop("advance", None)
    a, b = twins(**config)
    if advance is not None:
        a.advance(advance)
        b.advance(advance)
    fresh = FORMS[form](make_batch(4, version=version, seed=5))
    with pytest.raises((ValueError, tr.SchemaError)):
        a.compose(fresh, **args)
    assert_same_metrics(a, b)


ADD_REFUSALS = {
    "buffer full under overflow='raise'": (30, 0, dict(overflow="raise"), None),
    "rollouts older than the staleness cap": (3, 0, dict(max_staleness=0), 2),
}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", ADD_REFUSALS)
def test_a_refused_add_changes_no_metric(form, case):
    """The same defect in `add`: a batch refused by the admission checks (after validation) had
    been copied into the host pool, and storage_fresh_bytes counted it."""
    n, version, config, advance = ADD_REFUSALS[case]
    a, b = twins(**config)
    if advance is not None:
        a.advance(advance)
        b.advance(advance)
    with pytest.raises(tr.SchemaError):
        a.add(FORMS[form](make_batch(n, version=version, seed=5)))
    assert_same_metrics(a, b)


def test_a_refused_add_gives_recycled_memory_back():
    """A refused add that took a recycled buffer from the host pool puts it back: the twins'
    spare bytes stay equal, and the next add recycles in both alike."""
    a, b = twins()
    for buf in (a, b):
        buf.add(packed(make_batch(8, version=0, seed=4)))
        buf.max_staleness = 0
        buf.advance(1)  # every rollout is stale: both shards die, their memory goes to the pool
    assert a.metrics()["storage_spare_bytes"] > 0
    with pytest.raises(tr.SchemaError, match="staleness"):
        a.add(packed(make_batch(4, version=0, seed=6)))
    assert_same_metrics(a, b)
    for buf in (a, b):
        buf.add(packed(make_batch(4, version=1, seed=6)))
    assert a.metrics()["storage_recycled_bytes"] > 0
    assert_same_metrics(a, b)


def test_a_compose_that_fails_after_its_draw_changes_no_metric():
    """Issue 24 item 9: a compose whose replayed rows were drawn and read, and whose fresh shard
    then failed to store, bumped storage_hot_hits (and storage_fresh_bytes)."""
    a, b = (tr.RolloutBuffer(32, sampler=tr.UniformSampler(), seed=1, storage=FlakyStorage()) for _ in range(2))
    for buf in (a, b):
        buf.add(make_batch(8, version=0, seed=3))
    a.storage.fail_next = True
    with pytest.raises(StorageError):
        a.compose(packed(make_batch(4, version=1, seed=5)), n_replay=4)
    assert_same_metrics(a, b)
    assert_same_next_call(a, b)


@pytest.mark.parametrize("form", FORMS)
def test_an_add_whose_sampler_hook_fails_after_the_shard_was_stored_changes_no_metric(form):
    """A failure after `put` (a priority the sampler rejects): the new shard dies at once, and
    its memory, recycled from the pool, goes back to the pool as though it was never taken."""
    a, b = (tr.RolloutBuffer(8, sampler=tr.PrioritizedSampler(alpha=40.0), seed=0) for _ in range(2))
    for buf in (a, b):
        for step in range(3):  # full each time: every add evicts a whole shard into the pool
            buf.add(FORMS[form](make_batch(8, version=step, seed=step)))
    assert a.metrics()["storage_recycled_bytes"] > 0
    overflowing = make_batch(8, version=3, seed=7, advantage=torch.tensor([1e30] + [1.0] * 7))
    with pytest.raises(ValueError):
        a.add(FORMS[form](overflowing))
    assert_same_metrics(a, b)
    for buf in (a, b):
        buf.add(FORMS[form](make_batch(8, version=3, seed=8)))
    assert_same_metrics(a, b)


@pytest.mark.parametrize("call", ["sample", "gather", "compose"])
@pytest.mark.parametrize("device", ["cuda:99", "no-such-device"])
def test_an_unusable_device_is_refused_before_anything_changes(call, device):
    """The same defect in sample/gather/compose: the batch was drawn, counted (uses, evictions,
    for compose the fresh rollouts added) and only then moved to `device`, which raised."""
    a, b = twins()
    with pytest.raises(ValueError, match="device"):
        if call == "sample":
            a.sample(4, device=device)
        elif call == "gather":
            a.gather(torch.tensor([0, 1]), device=device)
        else:
            a.compose(make_batch(4, version=1, seed=5), n_replay=4, device=device)
    assert_same_metrics(a, b)
    assert_same_next_call(a, b)


def test_refused_sample_and_gather_change_no_metric():
    """Guards for the other reading calls: over-budget or dead slots in gather, a short sample
    under if_short='raise'. (These held before the fix; a refusal placed after the read fails them.)"""
    a, b = twins(max_reuse=3)
    with pytest.raises(ValueError, match="reuse budget"):
        a.gather(torch.tensor([0, 0, 0]))
    with pytest.raises(ValueError, match="live"):
        a.gather(torch.tensor([20]))
    with pytest.raises(ValueError, match="if_short"):
        a.sample(100, if_short="raise")
    assert_same_metrics(a, b)
    assert_same_next_call(a, b)


# ------------------------------------------------------------- item 10: lowering max_reuse
def reused_buffer(max_reuse: int | None = 5) -> tr.RolloutBuffer:
    """8 rollouts with reuse counts 2, 1, 3, 0, 0, 0, 0, 0 (slots 0-7)."""
    buf = tr.RolloutBuffer(16, max_reuse=max_reuse, sampler=tr.UniformSampler(), seed=0)
    buf.add(make_batch(8, version=0, seed=1))
    buf.gather(torch.tensor([0, 0, 1, 2, 2, 2]))
    return buf


def assert_all_live_readable(buf: tr.RolloutBuffer) -> None:
    live = buf.slots.live_slots()
    assert len(buf) == live.numel() == buf.metrics()["size"]
    for slot in live.tolist():  # each alone: one unreadable slot must not hide behind another
        assert len(buf.gather(torch.tensor([slot]), count_use=False)) == 1
    assert len(buf.gather(live, count_use=False)) == live.numel()
    assert len(buf.sample(4)) == 4


def test_lowering_max_reuse_evicts_what_reached_the_new_cap():
    """Issue 24 item 10: rollouts at or over a lowered cap stayed live (len counted them) but
    gather(slot, count_use=False) raised, for every slot once one was over the cap."""
    buf = reused_buffer()
    buf.max_reuse = 2
    assert sorted(buf.slots.live_slots().tolist()) == [1, 3, 4, 5, 6, 7]  # reuse 2 and 3 reached the cap
    assert buf.metrics()["evicted_reuse"] == 2
    assert buf.metrics()["reuse_hist_2_3"] == 0
    assert_all_live_readable(buf)


def test_raising_or_removing_max_reuse_evicts_nothing():
    for new_cap in (9, None):
        buf = reused_buffer()
        buf.max_reuse = new_cap
        assert len(buf) == 8 and buf.metrics()["evicted_reuse"] == 0
        assert_all_live_readable(buf)


def test_a_bad_max_reuse_is_refused_and_evicts_nothing():
    buf = reused_buffer()
    with pytest.raises(ValueError, match="max_reuse"):
        buf.max_reuse = 0
    assert buf.max_reuse == 5 and len(buf) == 8


def test_a_state_loaded_under_a_lower_cap_evicts_what_reached_it():
    """The other path that changes the cap: a state_dict saved under max_reuse=5, loaded into a
    buffer configured with max_reuse=2."""
    source = reused_buffer()
    buf = tr.RolloutBuffer(16, max_reuse=2, sampler=tr.UniformSampler(), seed=0)
    buf.load_state_dict(source.state_dict())
    assert sorted(buf.slots.live_slots().tolist()) == [1, 3, 4, 5, 6, 7]
    assert buf.metrics()["evicted_reuse"] == 2
    assert_all_live_readable(buf)


def test_a_checkpoint_restored_with_a_lower_cap_evicts_what_reached_it(tmp_path):
    """And a restore that overrides the cap: from_checkpoint(uri, max_reuse=2)."""
    uri = f"file://{tmp_path}/ckpt"
    source = tr.RolloutBuffer(16, max_reuse=5, sampler=tr.UniformSampler(), seed=0,
                              checkpoint=Checkpointer(uri, interval_s=3600))
    source.add(make_batch(8, version=0, seed=1))
    source.gather(torch.tensor([0, 0, 1, 2, 2, 2]))
    source.checkpoint()
    source.close()
    buf = tr.RolloutBuffer.from_checkpoint(uri, progress=False, max_reuse=2)
    assert buf.max_reuse == 2
    assert sorted(buf.slots.live_slots().tolist()) == [1, 3, 4, 5, 6, 7]
    assert_all_live_readable(buf)
    buf.close()


# ------------------------------------------------------- item 11: list input, recycled memory
def test_list_input_is_copied_into_recycled_host_memory():
    """Issue 24 item 11: torch.cat put every list-form add into fresh memory, so
    storage_recycled_bytes stayed 0 over 3000 steps. At steady state (each add evicts a whole
    earlier shard) every add after the warm-up is copied into recycled memory, and no fresh
    memory is taken any more."""
    buf = tr.RolloutBuffer(32, sampler=tr.UniformSampler(), seed=0)
    stored = []
    for step in range(12):
        batch = make_batch(16, version=step, seed=step, min_len=40, max_len=60)
        if step == 4:  # warm-up done: the pool holds the dead shards' memory
            warm = buf.metrics()
        before = buf.metrics()["storage_recycled_bytes"]
        handles = buf.add(batch)
        stored.append((handles, batch))
        token_bytes = sum(13 * len(t) for t in batch["tokens"])  # int64 + float32 + bool per token
        if step >= 4:
            assert buf.metrics()["storage_recycled_bytes"] - before == token_bytes
    assert buf.metrics()["storage_fresh_bytes"] == warm["storage_fresh_bytes"]
    # The recycled memory holds exactly what was given (the live half: the last two adds).
    for handles, batch in stored[-2:]:
        got = buf.gather(handles.slot, count_use=False)
        for i, length in enumerate(len(t) for t in batch["tokens"]):
            assert torch.equal(got.tokens[i, :length], batch["tokens"][i])
            assert torch.equal(got.logprobs[i, :length], batch["logprobs"][i])
            assert torch.equal(got.response_mask[i, :length], batch["response_mask"][i])


def test_list_input_in_recycled_memory_does_not_alias_the_caller_or_other_shards():
    """Writes to the caller's tensors after `add`, and later adds into recycled memory, leave
    stored rollouts as they were."""
    buf = tr.RolloutBuffer(24, sampler=tr.UniformSampler(), seed=0)
    for step in range(6):  # warm up: later adds recycle
        buf.add(make_batch(8, version=step, seed=step))
    batch = make_batch(8, version=6, seed=40)
    want = [t.clone() for t in batch["tokens"]]
    handles = buf.add(batch)
    for t in batch["tokens"]:
        t.zero_()
    buf.add(make_batch(8, version=7, seed=41))
    buf.add(make_batch(8, version=8, seed=42))  # evicts and recycles the shard before `batch`'s
    got = buf.gather(handles.slot, count_use=False)
    assert buf.metrics()["storage_recycled_bytes"] > 0
    for i, t in enumerate(want):
        assert torch.equal(got.tokens[i, : len(t)], t)


def test_a_tentative_copy_that_reached_a_shard_is_never_handed_out_again():
    """HostPool.tentative's contract: copies the block made are given back when it raises, except
    those `stored` was told of (a shard holds them). Mutation caught: `stored` keeping nothing
    back, which would hand a live shard's memory to the next add."""
    from torchreplay.storage.recycle import HostPool

    pool = HostPool(pin=False, limit_bytes=1 << 20)
    pool.give([torch.zeros(4096, dtype=torch.uint8)])
    assert pool.spare_bytes > 0
    before = dict(pool.counters)
    with pytest.raises(RuntimeError):
        with pool.tentative():
            held = pool.copy_in(torch.arange(500, dtype=torch.int64))  # 4000 bytes: takes the spare buffer
            pool.stored([held])
            dropped = pool.concat_in([torch.ones(3, dtype=torch.int64)] * 2)  # fresh, not stored
            raise RuntimeError("a later step failed")
    assert pool.spare_bytes == 0, "the stored copy's memory is the shard's"
    assert pool.counters == {"recycled_bytes": before["recycled_bytes"] + 4000, "fresh_bytes": before["fresh_bytes"]}
    assert torch.equal(held, torch.arange(500)) and torch.equal(dropped, torch.ones(6, dtype=torch.int64))


def test_a_refused_tentative_block_gives_back_what_it_took():
    """...and a block that raises with nothing stored leaves the spare list and counters exactly
    as they were, nested blocks included (the inner block's copies belong to the outer one)."""
    from torchreplay.storage.recycle import HostPool

    pool = HostPool(pin=False, limit_bytes=1 << 20)
    pool.give([torch.zeros(4096, dtype=torch.uint8)])
    spare, counters = pool.spare_bytes, dict(pool.counters)
    with pytest.raises(RuntimeError):
        with pool.tentative():
            with pool.tentative():
                pool.copy_in(torch.arange(500, dtype=torch.int64))
            pool.concat_in([torch.ones(100, dtype=torch.int64)] * 2)
            raise RuntimeError("refused")
    assert pool.spare_bytes == spare and pool.counters == counters
    with pool.tentative():  # a block that succeeds keeps its copies
        pool.copy_in(torch.arange(500, dtype=torch.int64))
    assert pool.spare_bytes == 0 and pool.counters["recycled_bytes"] == 4000
