"""SegmentTree and the torchreplay tree ops, against a NumPy float64 reference."""

import io
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

import torchreplay as tr

# The custom ops under torch's public op namespace (registered when torchreplay is imported).
ops = torch.ops.torchreplay

DTYPES = [torch.float32, torch.float64]


def reference_sample(p: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Stratified inverse-CDF sampling in float64 over the flat priorities."""
    n = len(u)
    target = (np.arange(n) + u) / n * p.sum()
    cdf = np.cumsum(p)
    return np.searchsorted(cdf, target, side="right")


@pytest.mark.parametrize("dtype", DTYPES)
def test_update_total_min_get(dtype):
    t = tr.SegmentTree(100, dtype=dtype)
    t.update(torch.tensor([3, 50, 99]), torch.tensor([1.5, 0.25, 4.0], dtype=dtype))
    assert t.total().item() == pytest.approx(5.75)
    assert t.min().item() == pytest.approx(0.25)
    assert t[50].item() == pytest.approx(0.25)
    assert torch.equal(t[torch.tensor([99, 3, 0])], torch.tensor([4.0, 1.5, 0.0], dtype=dtype))
    t.update(torch.tensor([50]), torch.tensor([0.0], dtype=dtype))  # killing the minimum
    assert t.min().item() == pytest.approx(1.5)


def test_empty_tree_min_is_inf():
    assert math.isinf(tr.SegmentTree(10).min().item())


def test_duplicates_last_occurrence_wins():
    t = tr.SegmentTree(16, dtype=torch.float64)
    t.update(torch.tensor([5, 7, 5, 5, 7]), torch.tensor([1.0, 2.0, 3.0, 9.0, 0.5], dtype=torch.float64))
    assert t[5].item() == 9.0
    assert t[7].item() == 0.5
    assert t.total().item() == 9.5


@settings(max_examples=60, deadline=None)
@given(
    capacity=st.integers(1, 300),
    dtype=st.sampled_from(DTYPES),
    data=st.data(),
)
def test_property_matches_numpy_reference(capacity, dtype, data):
    """Random update/sample sequences agree with a float64 NumPy model."""
    t = tr.SegmentTree(capacity, dtype=dtype)
    ref = np.zeros(capacity, dtype=np.float64)
    np_dtype = np.float32 if dtype == torch.float32 else np.float64
    for _ in range(data.draw(st.integers(1, 6))):
        n = data.draw(st.integers(1, 40))
        idx = data.draw(st.lists(st.integers(0, capacity - 1), min_size=n, max_size=n))
        pr = data.draw(
            st.lists(st.one_of(st.just(0.0), st.floats(1e-6, 1e6)), min_size=n, max_size=n)
        )
        pr_cast = np.asarray(pr, dtype=np_dtype)
        t.update(torch.tensor(idx), torch.from_numpy(pr_cast))
        for i, v in zip(idx, pr_cast):
            ref[i] = float(v)
        assert t.total().item() == pytest.approx(math.fsum(ref), rel=1e-12, abs=0)
        live = ref[ref > 0]
        assert t.min().item() == (live.min() if live.size else math.inf)
        np.testing.assert_array_equal(t.priorities.double().numpy(), ref)
        if ref.sum() > 0:
            batch = data.draw(st.integers(1, 64))
            u = torch.rand(batch, dtype=torch.float64, generator=torch.Generator().manual_seed(batch))
            got, got_p = t.sample(u=u)
            assert (ref[got.numpy()] > 0).all(), "a zero-priority leaf was sampled"
            assert got.max().item() < capacity
            np.testing.assert_array_equal(got_p.double().numpy(), ref[got.numpy()])
            expect = reference_sample(ref, u.numpy())
            # The tree sums in a different order than cumsum: allow disagreement only where the
            # target sits within rounding of a prefix-sum boundary.
            cdf = np.cumsum(ref)
            target = (np.arange(batch) + u.numpy()) / batch * ref.sum()
            edge = np.min(np.abs(cdf[:, None] - target[None, :]), axis=0) <= 1e-9 * ref.sum()
            assert ((got.numpy() == expect) | edge).all()


def test_zero_leaves_never_sampled_at_the_boundaries():
    # Only a middle and the last leaf are live; u = 0 and the largest double below 1 hit the edges.
    t = tr.SegmentTree(1000, dtype=torch.float32)
    t.update(torch.tensor([500, 999]), torch.tensor([1e-30, 3e-30]))
    u = torch.tensor([0.0, 0.5, np.nextafter(1.0, 0.0)], dtype=torch.float64)
    for stratified in (True, False):
        idx, _ = t.sample(u=u, stratified=stratified)
        assert set(idx.tolist()) <= {500, 999}
    idx, _ = t.sample(u=torch.tensor([np.nextafter(1.0, 0.0)], dtype=torch.float64), stratified=False)
    assert idx.item() == 999


def test_chi_square_frequencies_match_priorities():
    """Sampled frequencies follow p_i / sum(p): chi-square at fixed seed, reject below p = 1e-3."""
    capacity = 64
    gen = torch.Generator().manual_seed(1234)
    p = torch.rand(capacity, generator=gen, dtype=torch.float64) ** 3  # skewed
    p[::7] = 0.0  # dead leaves must get exactly zero draws
    t = tr.SegmentTree(capacity, dtype=torch.float64)
    t.update(torch.arange(capacity), p)
    counts = torch.zeros(capacity, dtype=torch.float64)
    for _ in range(50):
        idx, _ = t.sample(4096, generator=gen)
        counts += torch.bincount(idx, minlength=capacity).double()
    assert counts[p == 0].sum().item() == 0
    live = p > 0
    expected = (p[live] / p[live].sum() * counts.sum()).numpy()
    stat, pvalue = stats.chisquare(counts[live].numpy(), expected)
    assert pvalue > 1e-3, f"chi-square p = {pvalue:.2e}"


def test_stratified_samples_are_sorted_and_reproducible():
    t = tr.SegmentTree(5000)
    t.update(torch.arange(5000), torch.rand(5000, generator=torch.Generator().manual_seed(0)) + 0.01)
    a, _ = t.sample(777, generator=torch.Generator().manual_seed(7))
    b, _ = t.sample(777, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b)
    assert bool((a[1:] >= a[:-1]).all())


def test_root_does_not_drift_after_ten_million_updates():
    """10M random updates (float32 leaves): the float64 root equals fsum of the leaves within 1e-9."""
    capacity, batch = 1 << 16, 1 << 16
    t = tr.SegmentTree(capacity, dtype=torch.float32)
    gen = torch.Generator().manual_seed(42)
    done = 0
    while done < 10_000_000:
        idx = torch.randint(0, capacity, (batch,), generator=gen)
        # Magnitudes spread over 12 decades, the regime where naive float32 delta-updates drift.
        pr = torch.exp(torch.empty(batch).uniform_(-14.0, 14.0, generator=gen))
        t.update(idx, pr)
        done += batch
    exact = math.fsum(t.priorities.double().tolist())
    assert abs(t.total().item() - exact) <= 1e-9 * exact


@pytest.mark.parametrize("dtype", DTYPES)
def test_state_dict_round_trip_and_validation(dtype):
    t = tr.SegmentTree(300, dtype=dtype)
    t.update(torch.arange(0, 300, 3), torch.rand(100, dtype=dtype) + 0.1)
    state = t.state_dict()
    u = torch.rand(64, dtype=torch.float64)
    fresh = tr.SegmentTree(300, dtype=dtype)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.sample(u=u)[0], t.sample(u=u)[0])
    assert fresh.total().item() == t.total().item()
    assert fresh.min().item() == t.min().item()
    bad = dict(state, priorities=state["priorities"].clone())
    bad["priorities"][5] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        fresh.load_state_dict(bad)
    with pytest.raises(ValueError, match="capacity"):
        fresh.load_state_dict(dict(state, capacity=301))
    assert fresh.total().item() == t.total().item(), "a rejected load changed the tree"


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda t: t.update(torch.tensor([1.0]), torch.tensor([1.0])), TypeError, "indices"),
        (lambda t: t.update(torch.tensor([[1]]), torch.tensor([1.0])), ValueError, "indices must be 1-D"),
        (lambda t: t.update(torch.tensor([10]), torch.tensor([1.0])), IndexError, "out of range"),
        (lambda t: t.update(torch.tensor([-1]), torch.tensor([1.0])), IndexError, "out of range"),
        (lambda t: t.update(torch.tensor([1]), torch.tensor([-1.0])), ValueError, "priorities"),
        (lambda t: t.update(torch.tensor([1]), torch.tensor([float("nan")])), ValueError, "priorities"),
        (lambda t: t.update(torch.tensor([1]), torch.tensor([float("inf")])), ValueError, "priorities"),
        (lambda t: t.update(torch.tensor([1]), torch.tensor([1])), TypeError, "priorities"),
        (lambda t: t.update(torch.tensor([1, 2]), torch.tensor([1.0, 2.0, 3.0])), ValueError, "shape"),
        (lambda t: t.update(torch.tensor([1]), torch.tensor([1.0], device="meta")), ValueError, "device"),
        (lambda t: t.sample(u=torch.tensor([1.0], dtype=torch.float64)), ValueError, r"\[0, 1\)"),
        (lambda t: t.sample(u=torch.tensor([-0.1], dtype=torch.float64)), ValueError, r"\[0, 1\)"),
        (lambda t: t.sample(u=torch.tensor([0.1, float("nan")], dtype=torch.float64)), ValueError, r"\[0, 1\)"),
        (lambda t: t.update(torch.tensor([1, 2]), torch.tensor([1.0, -2.0])), ValueError, r"priorities\[1\]"),
        (lambda t: t.sample(u=torch.tensor([1])), TypeError, "u must be a floating"),
        (lambda t: t.sample(-3), ValueError, "batch_size"),
        (lambda t: t.sample(4.0), TypeError, "batch_size must be an int"),  # one int check: checks.check_int
        (lambda t: t.sample(True), TypeError, "batch_size must be an int"),
        (lambda t: t.sample(), ValueError, "batch_size or u"),
        (lambda t: t[11], IndexError, "out of range"),
    ],
)
def test_bad_input_raises_and_changes_nothing(call, error, match):
    t = tr.SegmentTree(10)
    t.update(torch.tensor([2, 3]), torch.tensor([1.0, 2.0]))
    before = t.raw_tensors()
    with pytest.raises(error, match=match):
        call(t)
    assert all(torch.equal(a, b) for a, b in zip(t.raw_tensors(), before))  # leaves and internal nodes
    assert t.total().item() == 3.0


def splitmix64_uniforms(seed: int, n: int) -> torch.Tensor:
    """Reference for csrc/segment_tree.h counter_uniform, in Python integers: SplitMix64's output
    function on state seed + (k + 1) * golden gamma, top 53 bits."""
    mask = (1 << 64) - 1
    out = []
    for k in range(n):
        z = (seed + (k + 1) * 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        z ^= z >> 31
        out.append((z >> 11) / 2.0**53)
    return torch.tensor(out, dtype=torch.float64)


def test_seeded_cpu_stream_is_uniform_and_is_counter_uniform():
    """The library's CPU `sample(B, generator=...)` stream, not the helper above: a tree of 2^16
    leaves of priority 1 maps a uniform u to leaf floor(u * 2^16) exactly (every prefix sum is an
    integer), so the sampled indices expose the op's uniforms to 16 bits. 100k non-stratified draws:
    a chi-square over 64 bins (reject below p = 1e-3), a lag-1 correlation within 4 sigma, then index
    for index the floor of the Python reference of counter_uniform (seed drawn from the same
    generator), non-stratified and stratified.

    Mutation checked: dropping SplitMix64's two xor-shift-multiply rounds from counter_uniform in
    csrc/segment_tree.h (leaving the Weyl counter, which is evenly spread but serially correlated)
    fails here on the lag-1 correlation (-0.42). test_seeded_sample_op and
    test_cpu_fast_paths_match_the_checked_paths, which compare the op with the same helper, fail on
    it too, but nothing else tests the library stream's statistics."""
    leaves, n = 1 << 16, 100_000
    t = tr.SegmentTree(leaves, dtype=torch.float32)
    t.update(torch.arange(leaves), torch.ones(leaves))
    idx, prio = t.sample(n, generator=torch.Generator().manual_seed(2024), stratified=False)
    assert idx.shape == (n,) and bool((prio == 1).all())
    counts = torch.bincount(idx >> 10, minlength=64).numpy()
    assert counts.sum() == n
    pvalue = stats.chisquare(counts).pvalue
    assert pvalue > 1e-3, f"chi-square p = {pvalue:.2e}"
    x = (idx.double() + 0.5) / leaves - 0.5
    corr = float((x[1:] * x[:-1]).mean() / x.var())
    assert abs(corr) < 4 / n**0.5, f"lag-1 correlation {corr:.4f}"
    # The same draws, predicted from the seed the documented 62-bit draw takes from the generator.
    seed = int(torch.randint(0, 1 << 62, (), generator=torch.Generator().manual_seed(2024)))
    u = splitmix64_uniforms(seed, n).numpy()
    np.testing.assert_array_equal(idx.numpy(), np.floor(u * leaves).astype(np.int64))
    strat, _ = t.sample(n, generator=torch.Generator().manual_seed(2024), stratified=True)
    expect = np.floor((np.arange(n) + u) / n * leaves).astype(np.int64)
    np.testing.assert_array_equal(strat.numpy(), expect)


def test_seeded_sample_op():
    t = tr.SegmentTree(300)
    t.update(torch.arange(300), torch.rand(300, generator=torch.Generator().manual_seed(0)) + 0.01)
    leaves, sums, _ = t.raw_tensors()
    for stratified in (True, False):
        idx, prio = ops.tree_sample_seeded(leaves, sums, 77, 50, 300, stratified)
        want = ops.tree_sample(leaves, sums, splitmix64_uniforms(77, 50), 300, stratified)
        assert torch.equal(idx, want[0]) and torch.equal(prio, want[1])
    torch.library.opcheck(ops.tree_sample_seeded.default, (leaves, sums, 77, 50, 300, True))
    with pytest.raises(ValueError, match="batch_size"):
        ops.tree_sample_seeded(leaves, sums, 77, -1, 300, True)
    empty_leaves, empty_sums, _ = tr.SegmentTree(10).raw_tensors()
    with pytest.raises(ValueError, match="empty tree"):
        ops.tree_sample_seeded(empty_leaves, empty_sums, 1, 4, 10, True)
    assert ops.tree_sample_seeded(empty_leaves, empty_sums, 1, 0, 10, True)[0].numel() == 0


def test_cpu_fast_paths_match_the_checked_paths():
    """sample(B, generator) and update(int64, same-dtype tensors) skip the Python checks on the CPU:
    same draws, same tree, and the op's own checks still reject bad values.

    "Same tree" is what the public API shows (`_observe`: leaves, total, min, fixed-u and seeded
    draws), not the private node arrays: both paths hand the same update op their arguments, so
    only what they pass can differ. Mutation checked: the fast path passing
    `priorities.clamp(max=1.0)` fails the first comparison."""
    a, b = tr.SegmentTree(1000), tr.SegmentTree(1000)
    prio = torch.rand(1000) + 0.1
    a.update(torch.arange(1000), prio)  # fast path
    b.update(list(range(1000)), prio.tolist())  # converted path
    assert torch.equal(a.priorities, prio)
    _assert_same(_observe(a), _observe(b))
    got = a.sample(64, generator=torch.Generator().manual_seed(3))
    seed = int(torch.randint(0, 1 << 62, (), generator=torch.Generator().manual_seed(3)))
    want = a.sample(u=splitmix64_uniforms(seed, 64))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    again = a.sample(64, generator=torch.Generator().manual_seed(3))
    assert torch.equal(got[0], again[0])
    assert not torch.equal(got[0], a.sample(64, generator=torch.Generator().manual_seed(4))[0])
    with pytest.raises(IndexError):
        a.update(torch.tensor([5, 1000]), torch.tensor([1.0, 1.0]))
    with pytest.raises(ValueError, match=r"priorities\[0\]"):
        a.update(torch.tensor([5]), torch.tensor([float("nan")]))
    with pytest.raises(ValueError, match="shape"):  # not the fast path: the full checks answer
        a.update(torch.tensor([5, 6]), torch.tensor([1.0]))
    _assert_same(_observe(a), _observe(b))  # the rejected updates changed nothing


@pytest.mark.parametrize("dtype", DTYPES)
def test_threaded_batches_match_one_thread_and_a_rebuild(dtype):
    """Batches big enough to be cut into chunks give, on 2 threads, exactly the 1-thread results,
    and the tree a rebuild from the same leaves gives (sorted sampled indices and random ones)."""
    before = torch.get_num_threads()
    trees = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            g = torch.Generator().manual_seed(7)
            t = tr.SegmentTree((1 << 16) + 3, dtype=dtype)
            t.update(torch.arange(t.capacity), torch.rand(t.capacity, generator=g, dtype=dtype))
            draws = []
            for step in range(6):
                idx, _ = t.sample(20000, generator=g)
                draws.append(idx)
                if step % 2:
                    idx = torch.randint(0, t.capacity, (30000,), generator=g)
                prio = torch.rand(idx.numel(), generator=g, dtype=dtype)
                prio[::7] = 0
                t.update(idx, prio)
            trees[threads] = (t, draws)
    finally:
        torch.set_num_threads(before)
    (one, draws1), (two, draws2) = trees[1], trees[2]
    assert all(torch.equal(a, b) for a, b in zip(draws1, draws2))
    assert torch.equal(one.priorities, two.priorities)
    # Bitwise equal internal nodes (not only the root total()/min()): the claim is that chunking
    # the batch over threads changes no node, which the public getters cannot show below the root.
    assert all(torch.equal(a, b) for a, b in zip(one.raw_tensors(), two.raw_tensors()))
    rebuilt = tr.SegmentTree(one.capacity, dtype=dtype)
    rebuilt.load_state_dict(one.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(rebuilt.raw_tensors(), one.raw_tensors()))


def test_sampling_an_empty_tree_is_an_error():
    with pytest.raises(ValueError, match="empty"):
        tr.SegmentTree(10).sample(4)


def test_sampling_a_tree_whose_sum_overflows_is_an_error():
    """float64 leaves can each be finite yet sum past the largest float64; sampling then refuses."""
    t = tr.SegmentTree(10, dtype=torch.float64)
    t.update(torch.tensor([2, 7]), torch.tensor([1.5e308, 1.5e308], dtype=torch.float64))
    assert t.total().item() == math.inf
    with pytest.raises(ValueError, match="largest float64"):
        t.sample(4)
    with pytest.raises(ValueError, match="largest float64"):
        t.sample(u=torch.tensor([0.0, 0.5], dtype=torch.float64))
    t.update(torch.tensor([7]), torch.tensor([0.0], dtype=torch.float64))
    idx, _ = t.sample(4)
    assert idx.tolist() == [2, 2, 2, 2]


def test_constructor_validation():
    with pytest.raises(ValueError, match="capacity"):
        tr.SegmentTree(0)
    with pytest.raises(TypeError, match="capacity"):
        tr.SegmentTree(3.5)
    with pytest.raises(TypeError, match="dtype"):
        tr.SegmentTree(4, dtype=torch.int32)


def test_raw_ops_reject_bad_input_without_crashing():
    """The ops themselves check, so a caller bypassing the Python class gets an error, not a segfault,
    and the storage it passed is unchanged."""
    t = tr.SegmentTree(10)
    leaves, sums, mins = t.raw_tensors()
    with pytest.raises(IndexError):
        ops.tree_update(leaves, sums, mins, torch.tensor([10**12]), torch.tensor([1.0]), 10)
    with pytest.raises(ValueError):
        ops.tree_update(leaves, sums, mins, torch.tensor([1]), torch.tensor([-1.0]), 10)
    with pytest.raises(RuntimeError, match="leaves"):
        ops.tree_update(leaves[:3], sums, mins, torch.tensor([1]), torch.tensor([1.0]), 10)
    with pytest.raises(ValueError, match="empty"):
        ops.tree_sample(leaves, sums, torch.tensor([0.5], dtype=torch.float64), 10, True)
    with pytest.raises(RuntimeError, match="float64"):
        ops.tree_sample(leaves, sums, torch.tensor([0.5]), 10, True)
    with pytest.raises(IndexError):
        ops.tree_get(leaves, torch.tensor([-5]), 10)
    assert all(torch.equal(a, b) for a, b in zip((leaves, sums, mins), t.raw_tensors()))  # refused unwritten
    t.update(torch.tensor([3]), torch.tensor([1.0]))
    leaves, sums, mins = t.raw_tensors()
    with pytest.raises(RuntimeError, match="leaves"):  # a capacity that does not match the storage
        ops.tree_sample(leaves, sums, torch.tensor([0.5], dtype=torch.float64), 1 << 20, True)
    with pytest.raises(RuntimeError, match="sums"):
        ops.tree_sample(leaves, sums[:1], torch.tensor([0.5], dtype=torch.float64), 10, True)
    with pytest.raises(RuntimeError, match="leaves"):
        ops.tree_get(leaves, torch.tensor([3]), 1 << 20)
    assert float(ops.tree_total(sums)) == 1.0


def _sample_args(dtype):
    t = tr.SegmentTree(200, dtype=dtype)
    t.update(torch.arange(0, 200, 2), torch.rand(100, dtype=dtype) + 0.5)
    return t


@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck_every_op(dtype):
    t = _sample_args(dtype)
    u = torch.rand(32, dtype=torch.float64)
    idx = torch.tensor([4, 8, 4, 199])
    pr = torch.rand(4, dtype=dtype)
    leaves, sums, mins = t.raw_tensors()
    cases = [
        (ops.tree_update.default, (*t.raw_tensors(), idx, pr, 200)),
        (ops.tree_sample.default, (leaves, sums, u, 200, True)),
        (ops.tree_total.default, (sums,)),
        (ops.tree_min.default, (mins,)),
        (ops.tree_get.default, (leaves, idx, 200)),
        (ops.tree_rebuild.default, (*t.raw_tensors(), 200)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


def _round_trip_tree(dtype, device="cpu"):
    """Skewed priorities with dead leaves, so total, min and sampling all have something to lose."""
    g = torch.Generator().manual_seed(11)
    p = (torch.rand(300, generator=g, dtype=torch.float64) ** 3 + 1e-4).to(dtype)
    p[::5] = 0
    t = tr.SegmentTree(300, dtype=dtype, device=device)
    t.update(torch.arange(300, device=device), p.to(device))
    return t


def _observe(t):
    """What a round trip must keep: leaves, total, min, and draws for a fixed generator and u."""
    u = torch.rand(97, dtype=torch.float64, generator=torch.Generator().manual_seed(5)).to(t.device)
    draws = [t.sample(u=u, stratified=s) for s in (True, False)]
    if t.device.type == "cpu":  # the seeded CPU stream; CUDA draws torch.rand on the device instead
        draws += [t.sample(64, generator=torch.Generator().manual_seed(9), stratified=s) for s in (True, False)]
    return (t.priorities.cpu().clone(), t.dtype, t.total().item(), t.min().item(),
            [(i.cpu(), p.cpu()) for i, p in draws])


def _assert_same(got, want):
    assert torch.equal(got[0], want[0]) and got[0].dtype == want[0].dtype, "priorities changed"
    assert got[1] == want[1]
    assert got[2] == want[2], "total changed"
    assert got[3] == want[3], "min changed"
    for (gi, gp), (wi, wp) in zip(got[4], want[4]):
        assert torch.equal(gi, wi) and torch.equal(gp, wp), "a draw changed"


@pytest.mark.parametrize("dtype", DTYPES)
def test_to_and_state_dict_round_trip_on_cpu(dtype):
    """State survives `.to()` and `state_dict()` -> `torch.save`/`torch.load` -> `load_state_dict()`:
    leaves (and their dtype), total, min, and the draws of the same generator and u, bitwise; the
    saved state is a copy that later updates do not reach.

    Mutations checked: `to()` moving the leaves as float32 (`self._leaves.to(device, torch.float32)`)
    fails the float64 case; `state_dict()` without `.clone()` (the state aliases the live leaves)
    fails both. The old test (`t.to("cpu") is t`) passed both."""
    t = _round_trip_tree(dtype)
    want = _observe(t)
    assert t.to("cpu") is t and t.device.type == "cpu"  # in place, like nn.Module.to
    _assert_same(_observe(t), want)
    assert t.to(torch.device("cpu")) is t
    _assert_same(_observe(t), want)

    state = t.state_dict()
    buf = io.BytesIO()
    torch.save(t.state_dict(), buf)
    t.update(torch.arange(300), torch.ones(300, dtype=dtype))  # must not reach either saved state
    buf.seek(0)
    for s in (state, torch.load(buf)):
        fresh = tr.SegmentTree(300, dtype=dtype)
        fresh.load_state_dict(s)
        _assert_same(_observe(fresh), want)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_to_and_state_dict_round_trip_through_cuda(dtype):
    """CPU -> CUDA -> CPU, and a CUDA tree's state loaded into a CPU tree, keep leaves, total, min and
    the draws for the same u (the back ends sample identically, see test_cuda_matches_cpu_...)."""
    t = _round_trip_tree(dtype)
    want = _observe(t)
    assert t.to("cuda") is t and t.device.type == "cuda"
    on_gpu = _observe(t)
    _assert_same(on_gpu, (want[0], want[1], want[2], want[3], want[4][:2]))
    assert isinstance(t.state_dict()["priorities"], torch.Tensor) and t.state_dict()["priorities"].device.type == "cpu"
    fresh = tr.SegmentTree(300, dtype=dtype)
    fresh.load_state_dict(t.state_dict())
    _assert_same(_observe(fresh), want)
    assert t.to("cpu") is t and t.device.type == "cpu"
    _assert_same(_observe(t), want)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_total_and_min_are_0dim_float64_on_the_tree_device(dtype, device):
    """docs/api.md: `total()` and `min()` are 0-dim float64 tensors on the tree's device; min is +inf
    for an empty tree (also after every leaf is killed) and the smallest positive priority otherwise.

    Mutations checked: `total()` returning the leaf dtype (`ops.tree_total(self._sums).to(self.dtype)`)
    fails the float32 case; `min()` returning shape (1,) (`.reshape(1)`) fails every case."""

    def check(t, total, lowest):
        for got in (t.total(), t.min()):
            assert isinstance(got, torch.Tensor)
            assert got.dim() == 0 and got.shape == ()
            assert got.dtype == torch.float64
            assert got.device == t.device
        assert t.total().item() == pytest.approx(total, rel=1e-15, abs=0)  # one summation tree's rounding
        assert t.min().item() == lowest  # a minimum is exact

    t = tr.SegmentTree(50, dtype=dtype, device=device)
    check(t, 0.0, math.inf)
    pr = torch.tensor([0.0, 3.5, 0.1, 1e-30, 7.0, 0.0], dtype=dtype)
    t.update(torch.tensor([0, 10, 20, 30, 40, 49], device=device), pr.to(device))
    stored = pr.double()  # 0.1 and 1e-30 as the leaf dtype holds them
    check(t, math.fsum(stored.tolist()), stored[stored > 0].min().item())
    t.update(torch.tensor([30], device=device), torch.tensor([0.0], dtype=dtype, device=device))
    check(t, math.fsum(stored.tolist()) - stored[3].item(), stored[2].item())
    t.update(torch.arange(50, device=device), torch.zeros(50, dtype=dtype, device=device))
    check(t, 0.0, math.inf)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_matches_cpu_on_identical_inputs(dtype):
    gen = torch.Generator().manual_seed(3)
    capacity = 100_003
    cpu = tr.SegmentTree(capacity, dtype=dtype)
    gpu = tr.SegmentTree(capacity, dtype=dtype, device="cuda")
    for _ in range(5):
        idx = torch.randint(0, capacity, (20_000,), generator=gen)
        pr = torch.rand(20_000, generator=gen, dtype=dtype)
        pr[::5] = 0
        cpu.update(idx, pr)
        gpu.update(idx.cuda(), pr.cuda())
        assert torch.equal(cpu.priorities, gpu.priorities.cpu()), "last-occurrence-wins differs"
        assert torch.equal(cpu.raw_tensors()[1], gpu.raw_tensors()[1].cpu()), "sums differ bitwise"
        assert cpu.min().item() == gpu.min().item()
        u = torch.rand(65_536, dtype=torch.float64, generator=gen)
        for stratified in (True, False):
            ci, cp = cpu.sample(u=u, stratified=stratified)
            gi, gp = gpu.sample(u=u.cuda(), stratified=stratified)
            assert torch.equal(ci, gi.cpu())
            assert torch.equal(cp, gp.cpu())
    state = gpu.state_dict()
    moved = tr.SegmentTree(capacity, dtype=dtype).to("cuda")
    moved.load_state_dict(state)
    assert torch.equal(moved.raw_tensors()[1].cpu(), gpu.raw_tensors()[1].cpu())


@pytest.mark.cuda
def test_cuda_opcheck_and_no_sync():
    t = _sample_args(torch.float32).to("cuda")
    t.validate = False
    u = torch.rand(32, dtype=torch.float64, device="cuda")
    leaves, sums, _ = t.raw_tensors()
    torch.library.opcheck(ops.tree_sample.default, (leaves, sums, u, 200, True))
    torch.cuda.set_sync_debug_mode("error")
    try:
        idx, _ = t.sample(u=u)
        t.update(idx, torch.rand(32, device="cuda"))
        t.total(), t.min(), t[idx]
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("left", [False, True])
def test_pad_rows_op(left):
    # Two sources of token rows with a row shape (2,); output rows come from either.
    values = [torch.arange(20, dtype=torch.float32).reshape(10, 2),
              100 + torch.arange(8, dtype=torch.float32).reshape(4, 2)]
    out = torch.full((4, 4, 2), -1.0)
    source, starts = torch.tensor([0, 1, 0, 1]), torch.tensor([0, 1, 8, 0])
    lengths, dest = torch.tensor([3, 3, 2, 0]), torch.tensor([2, 0, 1, 3])
    ops.pad_rows(values, source, starts, lengths, dest, out, left, -7.0)
    for src, s, n, d in zip(source.tolist(), starts.tolist(), lengths.tolist(), dest.tolist()):
        cols = slice(4 - n, 4) if left else slice(0, n)
        pad = slice(0, 4 - n) if left else slice(n, 4)
        assert torch.equal(out[d, cols], values[src][s : s + n])
        assert bool((out[d, pad] == -7).all())
    torch.library.opcheck(ops.pad_rows.default, (values, source, starts, lengths, dest, out.clone(), left, 0.0))
    before = out.clone()
    with pytest.raises(IndexError, match=r"outside the 4 token rows of values\[1\]"):
        ops.pad_rows(values, torch.tensor([0, 1]), torch.tensor([0, 3]), torch.tensor([1, 2]), torch.tensor([0, 1]),
                     out, left)
    with pytest.raises(IndexError, match="dest"):
        ops.pad_rows(values, torch.tensor([0]), torch.tensor([0]), torch.tensor([3]), torch.tensor([5]), out, left)
    with pytest.raises(IndexError, match="source"):
        ops.pad_rows(values, torch.tensor([2]), torch.tensor([0]), torch.tensor([1]), torch.tensor([0]), out, left)
    with pytest.raises(RuntimeError, match="dtype"):
        ops.pad_rows([values[0].double()], torch.tensor([0]), torch.tensor([0]), torch.tensor([1]), torch.tensor([0]),
                     out, left)
    assert torch.equal(out, before)  # a rejected call writes nothing
