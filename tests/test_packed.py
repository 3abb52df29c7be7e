"""Packed (varlen) batches, issue 28 items 1, 3 and 4: `layout="packed"` for sample, compose,
gather and the prefetching paths; conversions to and from the padded layout, bit for bit; bad
arguments refused before anything changes; and a tiny transformers model that gives the same
per-token log-probs on a packed batch as on the padded one.

Every comparison is bit for bit (floats compared as their integer bit patterns), against the padded
batch the same draw gives: two buffers fed identical data and sampled with identical generators
(one per layout, so their reuse counts agree draw for draw)."""

from __future__ import annotations

import pytest
import torch

import torchreplay as tr
from rollouts import make_batch
from torchreplay._ops import ops
from torchreplay.storage import TieredStorage

EXTRA = {
    "values": tr.FieldSpec("values", "token", torch.float32, (2,)),
    # Optional: only the odd batches carry it, so some shards lack it (its rows come back as 0).
    "tool": tr.FieldSpec("tool", "token", torch.int16, (), required=False, accept="int"),
    "score": tr.FieldSpec("score", "rollout", torch.float64),
}

STORAGE = {  # the row sources a batch can take (docs/architecture.md, "Cold reads", "Device-bound")
    "hot": None,
    "cold": dict(hot_bytes=0, spill=True),
    "hot+cold": dict(hot_bytes=60_000, spill=True),
    "device-only": dict(device="cpu", device_bytes=1 << 30),
    "device+host": dict(device="cpu", device_bytes=60_000),
    "device+staged": dict(device="cpu", device_bytes=60_000, hot_bytes=0, spill=True),
}


def rollouts(i: int, n: int = 24) -> dict:
    batch = make_batch(n, seed=100 + i, max_len=60, group_base=10 * i)
    g = torch.Generator().manual_seed(i)
    lengths = [t.numel() for t in batch["tokens"]]
    batch["ref_logprobs"] = [-torch.rand(length, generator=g) for length in lengths]
    batch["routing"] = [torch.randint(0, 16, (length, 2, 2), generator=g) for length in lengths]
    batch["values"] = [torch.randn(length, 2, generator=g) for length in lengths]
    if i % 2:
        batch["tool"] = [torch.randint(-5, 5, (length,), generator=g) for length in lengths]
    batch["score"] = torch.randn(n, generator=g, dtype=torch.float64)
    return batch


def make_buffer(tmp_path, name: str, side: str = "right", case: str = "hot", batches: int = 6,
                device: str | None = None) -> tr.RolloutBuffer:
    """`device`: the storage's device instead of the case's ("cuda" for the CUDA variants)."""
    kw = dict(STORAGE[case] or {})
    if device is not None:
        kw["device"] = device
    if kw.pop("spill", False):
        kw.update(spill_dir=tmp_path / name, io="posix")
    buf = tr.RolloutBuffer(256, sampler=tr.PrioritizedSampler(alpha=0.7), padding_side=side, pad_token_id=-3,
                           ref_logprobs=True, routing=(16, 2, 2), extra_fields=EXTRA, max_reuse=6, seed=5,
                           storage=TieredStorage(**kw) if kw else None)
    for i in range(batches):
        buf.add(rollouts(i))
    buf.storage.flush()
    return buf


def twins(tmp_path, side: str = "right", case: str = "hot", device: str | None = None):
    return (make_buffer(tmp_path, "padded", side, case, device=device),
            make_buffer(tmp_path, "packed", side, case, device=device))


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def bits(t: torch.Tensor) -> torch.Tensor:
    """A float tensor as its bit patterns (so -0.0 != 0.0 and every NaN payload counts)."""
    if t.dtype.is_floating_point:
        return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def same_metrics(a: dict, b: dict) -> bool:
    """Equal metrics, a NaN (no batch yet: its effective sample size) equal to a NaN."""
    return a.keys() == b.keys() and all(a[k] == b[k] or (a[k] != a[k] and b[k] != b[k]) for k in a)


def assert_same_padded(a: tr.ReplayBatch, b: tr.ReplayBatch) -> None:
    assert a.data.keys() == b.data.keys() and a.token_fields == b.token_fields
    for name in a.data:
        assert same(a.data[name], b.data[name]), name
    for name in tr.ReplayBatch.BOOKKEEPING:
        assert same(getattr(a, name), getattr(b, name)), name
    assert torch.equal(a.handles.slot, b.handles.slot) and torch.equal(a.handles.generation, b.handles.generation)


def assert_same_packed(a: tr.PackedReplayBatch, b: tr.PackedReplayBatch) -> None:
    assert a.data.keys() == b.data.keys() and a.token_fields == b.token_fields and a.max_seqlen == b.max_seqlen
    for name in (*a.data, *tr.PackedReplayBatch.LAYOUT, "position_ids"):
        assert same(getattr(a, name), getattr(b, name)), name
    for name in tr.ReplayBatch.BOOKKEEPING:
        assert same(getattr(a, name), getattr(b, name)), name
    assert torch.equal(a.handles.slot, b.handles.slot) and torch.equal(a.handles.generation, b.handles.generation)


def assert_matches(padded: tr.ReplayBatch, packed: tr.PackedReplayBatch, side: str) -> None:
    """`packed` holds exactly `padded`'s rows: every token field is the padded one under its
    attention mask, laid end to end; everything per row is the same; both conversions are exact."""
    assert isinstance(padded, tr.ReplayBatch) and isinstance(packed, tr.PackedReplayBatch)
    valid = padded.attention_mask
    lengths = valid.sum(1)
    assert len(packed) == len(padded) and packed.num_tokens == int(lengths.sum())
    assert packed.cu_seqlens.dtype == torch.int32 and packed.cu_seqlens.shape == (len(padded) + 1,)
    assert packed.cu_seqlens.tolist() == [0, *lengths.cumsum(0).tolist()]
    assert packed.max_seqlen == valid.shape[1] == int(lengths.max()) and isinstance(packed.max_seqlen, int)
    assert packed.position_ids.dtype == torch.int64
    assert packed.position_ids.tolist() == [p for length in lengths.tolist() for p in range(length)]
    assert packed.token_fields == padded.token_fields
    assert set(packed.data) == set(padded.data) - {"attention_mask"}
    for name, value in packed.data.items():
        want = padded.data[name][valid] if name in padded.token_fields else padded.data[name]
        assert same(value, want), name
    for name in tr.ReplayBatch.BOOKKEEPING:
        assert same(getattr(packed, name), getattr(padded, name)), name
    assert torch.equal(packed.handles.slot, padded.handles.slot)
    assert torch.equal(packed.handles.generation, padded.handles.generation)
    assert_same_padded(packed.to_padded(side), padded)
    assert_same_packed(tr.to_packed(padded), packed)


# ------------------------------------------------------------------------------------- the op
def test_pack_rows_copies_each_row_to_its_offset_and_checks_everything_before_writing():
    values = [torch.arange(10), torch.arange(100, 110)]
    out = torch.full((7,), -1)
    ops.pack_rows(values, torch.tensor([1, 0]), torch.tensor([2, 5]), torch.tensor([3, 4]), torch.tensor([0, 3]), out)
    assert out.tolist() == [102, 103, 104, 5, 6, 7, 8]
    rows = torch.arange(24.0).view(12, 2)  # a row shape of (2,)
    flat = torch.zeros(5, 2)
    ops.pack_rows([rows], torch.tensor([0, 0]), torch.tensor([10, 0]), torch.tensor([2, 3]), torch.tensor([0, 2]), flat)
    assert flat.tolist() == [[20, 21], [22, 23], [0, 1], [2, 3], [4, 5]]
    before = out.clone()
    bad = [  # (what is wrong, source, starts, lengths, offsets)
        ("past out's end", [1, 0], [2, 5], [3, 4], [0, 4]),
        ("past the source's end", [1, 0], [2, 8], [3, 4], [0, 3]),
        ("no such source", [1, 2], [2, 5], [3, 4], [0, 3]),
        ("negative length", [1, 0], [2, 5], [3, -1], [0, 3]),
        ("negative offset", [1, 0], [2, 5], [3, 4], [-1, 3]),
    ]
    for what, *args in bad:
        with pytest.raises(IndexError):
            ops.pack_rows(values, *(torch.tensor(a) for a in args), out)
        assert torch.equal(out, before), what  # the first rows were fine: nothing was written
    with pytest.raises(RuntimeError, match="dtype"):
        ops.pack_rows([torch.arange(10, dtype=torch.int32)], torch.tensor([0]), torch.tensor([0]), torch.tensor([3]),
                      torch.tensor([0]), out)


# --------------------------------------------------------------------------------- sample
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("case", list(STORAGE))
def test_sample_packed_is_the_padded_batch_without_its_padding(tmp_path, case, side):
    """Every row source (hot copies, cold reads, device-tier copies, staged cold reads, and their
    mixes), both padding sides, shards with and without the optional field. Mutations of
    packed.py seen failing here: position_ids counted over the whole batch (no restart), the rows
    lacking the optional field not zeroed, cu_seqlens shifted by one row, the device path taking
    its device rows as the whole field when some rows lack the field ("device-only"), and
    `to_padded` padding tokens with 0 instead of pad_token_id."""
    padded_buf, packed_buf = twins(tmp_path, side, case)
    device = "cpu" if STORAGE[case] and "device" in STORAGE[case] else None
    for seed in range(2):
        padded = padded_buf.sample(40, device=device, generator=gen(seed))
        packed = packed_buf.sample(40, device=device, generator=gen(seed), layout="packed")
        assert_matches(padded, packed, side)
    # Reused outputs: the arenas hold the last batch's values; every element must be rewritten.
    for seed in range(2, 4):
        padded = padded_buf.sample(40, device=device, generator=gen(seed), reuse_output=True)
        packed = packed_buf.sample(40, device=device, generator=gen(seed), reuse_output=True, layout="packed")
        assert_matches(padded, packed, side)
    assert padded_buf.metrics()["sampled_replay"] == packed_buf.metrics()["sampled_replay"] == 160


def test_position_ids_are_derived_when_first_read_not_written_by_the_sample(tmp_path):
    """A sample does not write `position_ids` (8 bytes a token the trainer may never read, e.g.
    with flash-attention's varlen kernels): they are derived from `cu_seqlens` at the first read,
    on the batch's device, and kept; `to()` before that read leaves them to be derived there.
    Mutation seen failing: deriving them in `assemble_packed` (the sample writes them again)."""
    buf, _ = twins(tmp_path)
    packed = buf.sample(16, generator=gen(3), layout="packed")
    assert packed.derived_position_ids is None
    moved = packed.to("cpu")
    assert moved.derived_position_ids is None
    lengths = packed.lengths.tolist()
    want = [p for length in lengths for p in range(length)]
    assert moved.position_ids.tolist() == want and moved.derived_position_ids is moved.position_ids
    assert packed.position_ids.tolist() == want


def test_missing_optional_field_rows_are_zero_in_the_packed_batch(tmp_path):
    """Rows from shards stored before the optional `tool` field was given: 0 on every token, as in
    the padded batch. Mutation seen failing: `_zero_missing` returning at once."""
    buf = make_buffer(tmp_path, "one")
    warm = buf.sample(64, generator=gen(0), reuse_output=True, layout="packed")
    assert (warm.tool != 0).any()  # the arena now holds nonzero values
    batch = buf.sample(64, generator=gen(1), reuse_output=True, layout="packed")
    without = batch.group_id // 10 % 2 == 0  # rollouts(i) has group ids 10 i + k; even batches lack `tool`
    assert bool(without.any()) and bool((~without).any())
    rows = batch.row_of_token()
    assert bool((batch.tool[without[rows]] == 0).all())


@pytest.mark.cuda
@pytest.mark.parametrize("case", ["device-only", "device+host", "device+staged"])
def test_cuda_packed_batches_match_the_padded_ones(tmp_path, case):
    """The CUDA device tier (VRAM copies, pinned host staging, staged cold reads) and the prefetch
    stream's hand-over (`sample_async`, `prefetching`): every tensor of a packed batch, the
    layout's own included, is on the GPU and equal to the padded batch's rows."""
    padded_buf, packed_buf = twins(tmp_path, "left", case, device="cuda")
    for seed in range(2):
        padded = padded_buf.sample(40, device="cuda", generator=gen(seed)).to("cpu")
        packed = packed_buf.sample(40, device="cuda", generator=gen(seed), layout="packed")
        assert all(t.is_cuda for t in (*packed.data.values(), packed.cu_seqlens, packed.position_ids))
        assert_matches(padded, packed.to("cpu"), "left")
    g_padded, g_packed = gen(7), gen(7)
    pending = packed_buf.sample_async(24, device="cuda", generator=g_packed, layout="packed")
    assert_matches(padded_buf.sample(24, generator=g_padded), pending.result().to("cpu"), "left")
    for batch in packed_buf.prefetching(24, steps=2, device="cuda", generator=g_packed, layout="packed"):
        assert_matches(padded_buf.sample(24, generator=g_padded), batch.to("cpu"), "left")


# -------------------------------------------------------------------------- compose, gather
@pytest.mark.parametrize("side", ["right", "left"])
def test_compose_packed_is_the_padded_batch_without_its_padding(tmp_path, side):
    padded_buf, packed_buf = twins(tmp_path, side)
    for step in range(3):
        fresh = rollouts(10 + step, n=8)
        fresh["policy_version"] = step + 1
        padded = padded_buf.compose(fresh, n_replay=12, multiple_of=4, generator=gen(step))
        packed = packed_buf.compose(fresh, n_replay=12, multiple_of=4, generator=gen(step), layout="packed")
        assert_matches(padded, packed, side)
        assert packed.is_fresh.tolist() == [True] * 8 + [False] * 12
        assert packed.cu_seqlens[8] == sum(t.numel() for t in fresh["tokens"])  # the fresh rows come first
    assert len(padded_buf) == len(packed_buf) and same_metrics(padded_buf.metrics(), packed_buf.metrics())


def test_compose_packed_with_nothing_to_replay_and_onto_a_device(tmp_path):
    buf = tr.RolloutBuffer(64, ref_logprobs=True, routing=(16, 2, 2), extra_fields=EXTRA)
    fresh = rollouts(3, n=5)
    out = buf.compose(fresh, replay_ratio=0.5, device="cpu", layout="packed")  # an empty buffer: fresh only
    assert isinstance(out, tr.PackedReplayBatch) and len(out) == 5
    assert out.tokens.tolist() == torch.cat(fresh["tokens"]).tolist()
    assert out.cu_seqlens.tolist() == [0, *torch.tensor([t.numel() for t in fresh["tokens"]]).cumsum(0).tolist()]


@pytest.mark.parametrize("side", ["right", "left"])
def test_gather_packed_is_the_padded_batch_without_its_padding(tmp_path, side):
    padded_buf, packed_buf = twins(tmp_path, side, "hot+cold")
    slots = torch.tensor([5, 140, 5, 77, 0, 143, 30])
    for count_use in (False, True):
        padded = padded_buf.gather(slots, count_use=count_use, weights=torch.linspace(0.5, 2, 7))
        packed = packed_buf.gather(slots, count_use=count_use, weights=torch.linspace(0.5, 2, 7), layout="packed")
        assert_matches(padded, packed, side)
    assert torch.equal(padded_buf.slots.reuse, packed_buf.slots.reuse)


def test_sample_async_and_prefetching_packed(tmp_path):
    padded_buf, packed_buf = twins(tmp_path, "left", "cold")
    pending = packed_buf.sample_async(16, generator=gen(4), layout="packed")
    assert_matches(padded_buf.sample(16, generator=gen(4)), pending.result(), "left")
    g_padded, g_packed = gen(9), gen(9)
    ahead = list(packed_buf.prefetching(16, steps=3, generator=g_packed, layout="packed"))
    assert len(ahead) == 3
    for batch in ahead:
        assert_matches(padded_buf.sample(16, generator=g_padded), batch, "left")


# ---------------------------------------------------------------------------- conversions
def test_conversions_round_trip_bit_for_bit_on_either_side_and_any_width(tmp_path):
    """packed -> padded (left, right, wider than the batch) -> packed gives the packed batch back;
    a left-padded sample -> packed -> right-padded is the right-padded buffer's sample."""
    packed = make_buffer(tmp_path, "one", "left").sample(32, generator=gen(2), layout="packed")
    for side in ("left", "right"):
        for width in (None, packed.max_seqlen + 5):
            padded = packed.to_padded(side, width=width)
            assert padded.attention_mask.shape == (32, width or packed.max_seqlen)
            assert_same_packed(tr.to_packed(padded), packed)
    # Both buffers drew the same rows at the same reuse counts (fresh twins, same generator).
    left, right = make_buffer(tmp_path, "left2", "left"), make_buffer(tmp_path, "right2", "right")
    from_left = left.sample(32, generator=gen(3))
    assert_same_padded(tr.to_packed(from_left).to_padded("right"), right.sample(32, generator=gen(3)))
    assert_same_padded(tr.to_packed(from_left).to_padded("left"), from_left)


def test_conversion_arguments_are_checked():
    buf = tr.RolloutBuffer(16)
    buf.add(make_batch(6, seed=1))
    packed = buf.sample(4, generator=gen(0), layout="packed")
    with pytest.raises(ValueError, match="padding_side"):
        packed.to_padded("middle")
    for width in (packed.max_seqlen - 1, 2.5, True):
        with pytest.raises(ValueError, match="width"):
            packed.to_padded("right", width=width)
    padded = packed.to_padded("right")
    holed = tr.ReplayBatch.assembled({**padded.data, "attention_mask": padded.attention_mask.clone()},
                                     padded.handles, **{n: getattr(padded, n) for n in tr.ReplayBatch.BOOKKEEPING},
                                     token_fields=padded.token_fields, pad_token_id=0)
    holed.attention_mask[1, 1] = False  # a hole inside row 1: not one run of tokens
    with pytest.raises(ValueError, match="attention_mask, row 1"):
        tr.to_packed(holed)
    with pytest.raises(TypeError, match="ReplayBatch"):
        tr.to_packed(packed)


# ------------------------------------------------------------------------- bad arguments
@pytest.mark.parametrize("layout", ["varlen", "Packed", None, 1, ("packed",)])
def test_an_unknown_layout_is_refused_before_anything_changes(layout):
    buf = tr.RolloutBuffer(32, max_reuse=2, seed=3)
    buf.add(make_batch(10, seed=1))
    before = (len(buf), buf.slots.reuse.clone(), buf.generator.get_state().clone(), buf.metrics(), buf.version)

    def unchanged() -> None:
        after = (len(buf), buf.slots.reuse, buf.generator.get_state(), buf.metrics(), buf.version)
        assert after[0] == before[0] and torch.equal(after[1], before[1]) and torch.equal(after[2], before[2])
        assert same_metrics(after[3], before[3]) and after[4] == before[4]

    calls = {
        "sample": lambda: buf.sample(4, layout=layout),
        "sample_async": lambda: buf.sample_async(4, layout=layout),
        "gather": lambda: buf.gather(torch.tensor([0, 1]), layout=layout),
        "compose": lambda: buf.compose(make_batch(4, seed=2, version=3), n_replay=2, layout=layout),
        "prefetching": lambda: next(buf.prefetching(4, steps=2, layout=layout)),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match="layout") as info:
            call()
        assert repr(layout) in str(info.value), name
        unchanged()


# ------------------------------------------------------------------ a model consumes it
def block_causal_mask(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[1, 1, N, N] bool: token i attends to token j iff both are in the same row and j <= i."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    row = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    n = row.numel()
    causal = torch.arange(n)[:, None] >= torch.arange(n)[None, :]
    return ((row[:, None] == row[None, :]) & causal)[None, None]


def next_token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log p(ids[t + 1] | ids[:t + 1]) at every position t but the last (per row)."""
    return logits[..., :-1, :].log_softmax(-1).gather(-1, ids[..., 1:, None]).squeeze(-1)


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_tiny_transformers_model_gives_the_same_logprobs_on_packed_and_padded_batches(side):
    """A 2-layer Qwen2 (random weights, float64, built from a config: nothing is downloaded) run
    on a padded batch (attention_mask, position_ids from it) and on the packed batch as one row of
    N tokens, with the batch's position_ids and a block-diagonal causal mask built from
    cu_seqlens (what flash-attention's varlen kernels compute from it), gives the same per-token
    log-probs, to float64 rounding. Without the block structure the rows attend to earlier rows:
    a plain causal mask over the pack, or no mask at all, gives different log-probs (checked), so
    the test shows that cu_seqlens delimits the sequences the model must see. (Rotary positions
    are relative: counting them on over the pack instead of restarting would shift each row by a
    constant and change nothing here; the restart is checked against the padded layout's
    positions in `assert_matches`.)"""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).double().eval()
    buf = tr.RolloutBuffer(64, padding_side=side, pad_token_id=0, seed=1)
    buf.add(make_batch(12, seed=4, max_len=30))
    packed = buf.sample(6, generator=gen(5), layout="packed")
    padded = packed.to_padded(side)
    valid = padded.attention_mask
    n = packed.num_tokens
    # next-token pairs within a row: every packed position but each row's last
    pair = torch.ones(n, dtype=torch.bool)
    pair[packed.cu_seqlens[1:].long() - 1] = False
    with torch.no_grad():
        positions = (valid.long().cumsum(1) - 1).clamp(min=0)
        logits = model(input_ids=padded.tokens, attention_mask=valid.long(), position_ids=positions).logits
        want = next_token_logprobs(logits, padded.tokens)[valid[:, 1:] & valid[:, :-1]]

        def packed_logprobs(mask, position_ids):
            out = model(input_ids=packed.tokens[None], attention_mask=mask, position_ids=position_ids[None]).logits
            return next_token_logprobs(out, packed.tokens[None])[0][pair[:-1]]

        got = packed_logprobs(block_causal_mask(packed.cu_seqlens), packed.position_ids)
        causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
        leaky = [packed_logprobs(causal, packed.position_ids), packed_logprobs(None, packed.position_ids)]
    assert got.shape == want.shape == (n - len(packed),)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for wrong in leaky:
        assert float((wrong - want).abs().max()) > 1e-3
