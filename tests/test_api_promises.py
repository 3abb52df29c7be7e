"""Behaviour docs/api.md promises that no other test pins down: a sampler written against the
`tr.Sampler` protocol alone, `prefetching(steps=None)`, and the buffer as a context manager.

Each test's docstring names a mutation of the library that was seen to make it fail."""

import itertools
import json
import os
import threading

import pytest
import torch

import torchreplay as tr
from rollouts import make_batch


# ------------------------------------------------------------------ a sampler without a tree
class ListSampler:
    """Uniform over the live slots, kept in a Python set: no SegmentTree, no TreeSampler; only the
    `tr.Sampler` protocol. It honours `remaining` (at most remaining[s] draws of slot s) and returns
    weights (slot + 1) / 64, so that a test can tell its weights from the buffer's defaults. It
    records every call it gets."""

    def __init__(self) -> None:
        self.slots = None
        self.live: set[int] = set()
        self.versions: list[int] = []
        self.calls: list[tuple[int, torch.Tensor | None, torch.Tensor, torch.Tensor]] = []

    def bind(self, slots) -> None:
        self.slots = slots
        self.live = set()

    def on_insert(self, slots: torch.Tensor) -> None:
        self.live.update(slots.tolist())

    def on_remove(self, slots: torch.Tensor) -> None:
        self.live.difference_update(slots.tolist())

    def on_priority(self, slots: torch.Tensor) -> None:
        pass

    def on_advance(self, version: int) -> None:
        self.versions.append(version)

    def sample(self, n, generator, remaining=None):
        budget = {s: n if remaining is None else int(remaining[s]) for s in sorted(self.live)}
        out: list[int] = []
        while len(out) < n:
            pool = [s for s, b in budget.items() if b > 0]
            if not pool:
                break  # fewer than n only when nothing drawable is left
            s = pool[int(torch.randint(len(pool), (1,), generator=generator))]
            budget[s] -= 1
            out.append(s)
        slots = torch.tensor(out, dtype=torch.int64)
        weights = (slots.float() + 1) / 64
        self.calls.append((n, None if remaining is None else remaining.clone(), slots, weights))
        return slots, weights

    def state_dict(self):
        return {"type": "ListSampler", "live": torch.tensor(sorted(self.live), dtype=torch.int64)}

    def load_state_dict(self, state) -> None:
        if state.get("type") != "ListSampler":
            raise ValueError("not a ListSampler state")
        self.live = set(state["live"].tolist())

    def to(self, device):
        return self


def test_protocol_sampler_without_a_tree():
    """A non-tree `tr.Sampler` plugged into RolloutBuffer: the buffer hands it the reuse budgets
    (`remaining` = max_reuse - reuse for live slots, 0 elsewhere), the batch holds exactly the slots
    and weights it returned (rows and order), the max_reuse cap holds within and across batches,
    evictions reach `on_remove`, a short draw raises or truncates per `if_short`, and the state
    round trip through `state_dict` gives the same draws.

    Mutations seen failing: Ledger.remaining ignoring max_reuse (budgets of 2**62 for every live
    slot); BatchAssembler.plan replacing the sampler's weights with ones."""
    sampler = ListSampler()
    assert isinstance(sampler, tr.Sampler) and not isinstance(sampler, tr.TreeSampler)
    buf = tr.RolloutBuffer(16, sampler=sampler, max_reuse=3, seed=0)
    data = make_batch(6, seed=90)
    handles = buf.add(data)
    assert sampler.live == set(handles.slot.tolist())
    source = {int(s): k for k, s in enumerate(handles.slot.tolist())}  # slot -> row of `data`
    buf.advance(2)
    assert sampler.versions[-1] == 2 and buf.version == 2

    twin = tr.RolloutBuffer(16, sampler=ListSampler(), max_reuse=3, seed=0)
    twin.load_state_dict(buf.state_dict())
    a = buf.sample(4, generator=torch.Generator().manual_seed(7), if_short="truncate")
    b = twin.sample(4, generator=torch.Generator().manual_seed(7), if_short="truncate")
    assert torch.equal(a.handles.slot, b.handles.slot) and torch.equal(a.tokens, b.tokens)
    uses = torch.bincount(a.handles.slot, minlength=16)

    gen = torch.Generator().manual_seed(1)
    short_draws = 0
    while True:
        live, reuse = buf.slots.live.clone(), buf.slots.reuse.clone()
        budget = int(torch.where(live, 3 - reuse, torch.zeros_like(reuse)).sum())
        if budget == 0:
            break
        if 0 < budget < 4:  # a short draw: "raise" changes nothing, "truncate" returns what fits
            short_draws += 1
            gen_state = gen.get_state()
            with pytest.raises(ValueError, match="cannot fill"):
                buf.sample(4, generator=gen)
            assert torch.equal(buf.slots.reuse, reuse) and torch.equal(gen.get_state(), gen_state)
        out = buf.sample(4, generator=gen, if_short="truncate")
        n, remaining, slots, weights = sampler.calls[-1]
        assert n == 4 and torch.equal(remaining, torch.where(live, 3 - reuse, torch.zeros_like(reuse)))
        assert len(out) == min(4, budget)
        assert torch.equal(out.handles.slot, slots) and torch.equal(out.weights, weights)
        assert torch.equal(out.reuse, reuse[slots])
        for k, slot in enumerate(slots.tolist()):
            row = source[slot]
            n_tok = data["tokens"][row].numel()
            assert torch.equal(out.tokens[k, :n_tok], data["tokens"][row])
            assert out.advantage[k] == data["advantage"][row]
        uses += torch.bincount(slots, minlength=16)
        assert int(uses.max()) <= 3, "max_reuse is a hard cap, within and across batches"
        assert sampler.live == set(buf.slots.live.nonzero().flatten().tolist()), "evictions reach on_remove"
    assert short_draws == 1 and uses[handles.slot].tolist() == [3] * 6  # every budget used up, none exceeded
    assert len(buf) == 0 and buf.metrics()["evicted_reuse"] == 6 and sampler.live == set()
    with pytest.raises(ValueError, match="empty"):
        buf.sample(1)


# ------------------------------------------------------------------------------ prefetching
def _check_batch(batch, data, size: int) -> None:
    assert len(batch) == size
    for k, slot in enumerate(batch.handles.slot.tolist()):
        n = data["tokens"][slot].numel()
        assert torch.equal(batch.tokens[k, :n], data["tokens"][slot])
        assert torch.equal(batch.logprobs[k, :n], data["logprobs"][slot])
        assert int(batch.attention_mask[k].sum()) == n


def test_prefetching_without_steps_yields_until_the_caller_stops():
    """`prefetching(B)` (steps=None) keeps yielding: 25 batches taken with islice, each of B valid
    rows and the same as 25 `sample(B)` calls with the same generator on a twin buffer.

    Mutation seen failing: RolloutBuffer.prefetching looping `while steps is not None and taken <
    steps` (steps=None yields nothing)."""
    buf = tr.RolloutBuffer(64, sampler=tr.PrioritizedSampler(alpha=1.0, beta=0.4), seed=0)
    data = make_batch(20, seed=91)
    buf.add(data)
    twin = tr.RolloutBuffer(64, sampler=tr.PrioritizedSampler(alpha=1.0, beta=0.4), seed=0)
    twin.load_state_dict(buf.state_dict())
    batches = list(itertools.islice(buf.prefetching(8, generator=torch.Generator().manual_seed(3)), 25))
    assert len(batches) == 25
    gen = torch.Generator().manual_seed(3)
    for batch in batches:
        _check_batch(batch, data, 8)
        expected = twin.sample(8, generator=gen)
        assert torch.equal(batch.handles.slot, expected.handles.slot)
        assert torch.equal(batch.tokens, expected.tokens) and torch.equal(batch.weights, expected.weights)
    buf.close()


def test_prefetching_with_steps_yields_exactly_that_many():
    """`prefetching(B, steps=3)` yields exactly 3 valid batches and draws exactly 3 (no batch is
    drawn ahead past the last step, which would spend reuse budgets for nothing).

    Mutations seen failing: the loop condition `taken <= steps` (4 batches); always drawing the
    next batch ahead (`if True:` before the sample_async in the loop: a 4th draw is counted)."""
    buf = tr.RolloutBuffer(64, sampler=tr.UniformSampler(), max_reuse=100, seed=0)
    data = make_batch(20, seed=92)
    buf.add(data)
    batches = list(buf.prefetching(8, steps=3, generator=torch.Generator().manual_seed(4)))
    assert len(batches) == 3
    for batch in batches:
        _check_batch(batch, data, 8)
    m = buf.metrics()
    assert m["sample_calls"] == 3 and m["sampled_replay"] == 24
    assert int(buf.slots.reuse.sum()) == 24
    buf.close()


# ------------------------------------------------------------------------ context manager
def _children() -> dict[int, bytes]:
    """This process's child processes (zombies included) and their command lines, from /proc."""
    me, out = os.getpid(), {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue  # exited meanwhile
        if int(stat[stat.rindex(")") + 2:].split()[1]) == me:
            out[int(entry)] = cmdline
    return out


def _background_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("torchreplay-")}


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads child processes from /proc (Linux)")
@pytest.mark.parametrize("raises", [False, True], ids=["clean_exit", "exception"])
def test_context_manager_closes_threads_helper_and_publishes(tmp_path, raises):
    """`with tr.RolloutBuffer(...) as buf:` closes the buffer on exit, also when the block raises:
    the checkpoint worker, prefetch and spill threads (names "torchreplay-...") have ended, the
    upload helper process is gone (not even a zombie), and a final manifest naming the buffer's
    last state was published (LATEST points past the one published inside the block).

    Mutations seen failing: RolloutBuffer.__exit__ doing nothing; RolloutBuffer.close calling
    `self.checkpointer.close(final=False)` (no final manifest)."""
    threads_before, children_before = _background_threads(), set(_children())
    ckpt = tmp_path / "ckpt"
    buf_ref = None
    try:
        with tr.RolloutBuffer(64, sampler=tr.UniformSampler(), seed=0,
                              storage=tr.TieredStorage(spill_dir=str(tmp_path / "spill")),
                              checkpoint=tr.Checkpointer(f"file://{ckpt}", interval_s=3600)) as buf:
            buf_ref = buf
            buf.add(make_batch(8, seed=93))
            buf.checkpoint()  # the helper has served a request: it is running now
            inside = json.loads((ckpt / "LATEST").read_bytes())["manifest"]
            buf.sample_async(4).result()  # starts the prefetch thread
            buf.add(make_batch(4, seed=94, version=5))
            started = _background_threads() - threads_before
            helpers = {pid for pid, cmd in _children().items()
                       if pid not in children_before and b"torchreplay.checkpoint.uploader" in cmd}
            assert {t.name for t in started} >= {"torchreplay-checkpoint", "torchreplay-prefetch_0",
                                                 "torchreplay-spill_0"}
            assert len(helpers) == 1, "the upload helper runs while the buffer is open"
            if raises:
                raise RuntimeError("training step failed")
    except RuntimeError as exc:
        assert raises and str(exc) == "training step failed"
    assert buf_ref is not None
    alive = [t.name for t in started if t.is_alive()]
    assert alive == [], f"background threads still running after the with block: {alive}"
    left = set(_children()) - children_before
    assert not left & helpers, "the upload helper process must be gone (and reaped)"
    latest = json.loads((ckpt / "LATEST").read_bytes())["manifest"]
    assert latest != inside, "closing must publish a final manifest"
    manifest = json.loads((ckpt / latest).read_bytes())
    assert manifest["rollouts"] == 12 and manifest["policy_version"] == 5
    assert all((ckpt / s["key"]).is_file() for s in manifest["shards"])
    restored = tr.RolloutBuffer.from_checkpoint(f"file://{ckpt}", progress=False)
    assert len(restored) == 12 and restored.version == 5
    restored.close()


# ------------------------------------------------------------------ buf.slots is read-only
def test_slot_table_view_is_read_only_and_current():
    """docs/api.md: `buf.slots` is a read-only view of the slot table. Writing into what it
    returns changes nothing in the buffer; it has no mutators and no settable columns; it follows
    the buffer through adds and a load. Mutation seen failing: `RolloutBuffer.slots` returning
    the ledger's own (mutable) SlotTable."""
    buf = tr.RolloutBuffer(8, sampler=tr.UniformSampler(), seed=0)
    view = buf.slots
    handles = buf.add(make_batch(3, seed=0))
    assert view.live.sum() == 3 and view.count == 3 and len(view.free) == 5  # the same view, now current
    before = buf.state_dict()
    view.live[:] = False  # a copy: the buffer keeps its three rollouts
    view.reuse[handles.slot] = 7
    view.shard.fill_(-1)
    assert len(buf) == 3 and bool(buf.slots.live[handles.slot].all()) and int(buf.slots.reuse.sum()) == 0
    for name in ("live", "advantage", "free", "version"):
        with pytest.raises(AttributeError):
            setattr(buf.slots, name, None)
    for mutator in ("take", "insert", "kill", "restore_rows", "compact"):
        assert not hasattr(buf.slots, mutator), mutator
    assert len(buf.sample(3).tokens) == 3
    other = tr.RolloutBuffer(8, sampler=tr.UniformSampler(), seed=1)
    other_view = other.slots
    other.load_state_dict(before)  # the ledger adopts a new table; the view follows it
    assert torch.equal(other_view.live, before["table"]["live"]) and other_view.count == 3


def test_the_slot_table_view_keeps_no_ledger_alive():
    """`buf.slots` creates no reference cycle: a closed buffer's ledger and sampler (its tree, on
    CUDA device memory) go with the last reference, not at the next cyclic collection. Mutation
    seen failing: the ledger holding its view as `SlotTableView(lambda: self.slots)`."""
    import gc
    import weakref

    buf = tr.RolloutBuffer(16, seed=0)
    buf.add(make_batch(3, seed=0))
    assert int(buf.slots.live.sum()) == 3
    ledger, sampler = weakref.ref(buf.ledger), weakref.ref(buf.sampler)
    buf.close()
    gc.disable()
    try:
        del buf
        assert ledger() is None and sampler() is None
    finally:
        gc.enable()
