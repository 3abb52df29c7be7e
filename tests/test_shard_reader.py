"""The C++ cold-tier reader (torchreplay::read_shard_rows): same bytes as the Python decoder,
corruption and I/O failures reported per segment, inconsistent requests refused before reading."""

import errno
import os

import pytest
import torch

import torchreplay as tr
from torchreplay.storage import TieredStorage
from torchreplay.storage import format as fmt
from torchreplay.storage.io import (PAGE_BAD, PAGE_OK, READ_CHECKSUM, READ_FAILED, READ_OK, READ_OPEN,
                                    READ_SHORT, read_shard_rows)

PAGE = 4096  # small pages: a few KB of rows span many checksum pages


def write_shard(path, n=40, seed=0, page_size=PAGE):
    """A shard with int64, float32, bool, bfloat16 and a trailing-shape uint8 token field."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 700, (n,), generator=g)
    offsets = torch.zeros(n + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    total = int(offsets[-1])
    token = {
        "tokens": torch.randint(0, 150_000, (total,), generator=g),
        "logprobs": -torch.rand(total, generator=g),
        "response_mask": torch.rand(total, generator=g) > 0.3,
        "values": torch.randn(total, generator=g).to(torch.bfloat16),
        "routing": torch.randint(0, 255, (total, 3, 5), generator=g).to(torch.uint8),
    }
    rollout = {"reward": torch.rand(n, generator=g)}
    header, writes, head = fmt.plan_shard(offsets, token, rollout, page_size=page_size)
    data = bytearray(header.file_bytes)
    for offset, piece in [*writes, (0, head)]:
        piece = bytes(piece)
        data[offset : offset + len(piece)] = piece
    path.write_bytes(bytes(data))
    return header


def request(header, ref, rows, fields, dest_rows=None):
    """Op arguments for `rows` (sorted unique) of `fields` of one shard file, and the rows the
    Python decoder (zlib-verified parse_shard) gives for them."""
    offsets = ref.offsets
    rows = torch.as_tensor(rows, dtype=torch.int64)
    starts, ends = offsets[rows], offsets[rows + 1]
    out_offsets = torch.zeros(rows.numel() + 1, dtype=torch.int64)
    torch.cumsum(ends - starts, 0, out=out_offsets[1:])
    total = int(out_offsets[-1]) if dest_rows is None else dest_rows
    crcs, base = [], {}
    for name, b in header.blocks.items():
        base[name] = len(crcs)
        crcs.extend(b.page_crcs)
    segments, dests = [], []
    for name in fields:
        b = header.blocks[name]
        segments.append([0, b.offset, b.nbytes, b.row_bytes, header.page_size, base[name], len(dests), 0, rows.numel()])
        dests.append(torch.full((total, *b.shape), 7, dtype=b.dtype))
    expected = {name: torch.cat([ref.token[name][int(s):int(e)] for s, e in zip(starts, ends)]) for name in fields}
    return (torch.tensor(segments, dtype=torch.int64), torch.stack([starts, ends, out_offsets[:-1]], 1),
            torch.tensor(crcs, dtype=torch.int64), dests, expected)


@pytest.fixture
def shard(tmp_path):
    path = tmp_path / "shard.trs"
    header = write_shard(path)
    return path, header, fmt.parse_shard(path.read_bytes())


def run(path, segments, rows, crcs, dests, direct=False, threads=3):
    state = torch.empty(crcs.numel(), dtype=torch.uint8)
    status = read_shard_rows([str(path)], segments, rows, crcs, dests, state, direct, threads)
    return status, state


def supports_direct(directory):
    try:
        fd = os.open(directory / "probe", os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o644)
        os.close(fd)
        return True
    except OSError:
        return False


FIELDS = ["tokens", "logprobs", "response_mask", "values", "routing"]


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("threads", [1, 4])
def test_rows_bit_identical_to_python_decoder(shard, tmp_path, direct, threads):
    if direct and not supports_direct(tmp_path):
        pytest.skip(f"{tmp_path} does not support O_DIRECT")
    path, header, ref = shard
    for rows in ([0], [39], [3, 4, 5, 17, 30], list(range(40)), [1, 2, 38]):
        segments, row_t, crcs, dests, expected = request(header, ref, rows, FIELDS)
        status, state = run(path, segments, row_t, crcs, dests, direct, threads)
        assert (status[:, 0] == READ_OK).all(), status
        for name, out in zip(FIELDS, dests):
            assert out.dtype == expected[name].dtype
            assert torch.equal(out.view(torch.uint8), expected[name].view(torch.uint8)), name
        assert not (state == PAGE_BAD).any()
        # Bytes read are whole pages covering the rows, no more: every read page was verified.
        assert int(status[:, 2].sum()) >= sum(e.numel() * e.element_size() for e in expected.values())
        assert int((state == PAGE_OK).sum()) > 0


def test_storage_fetch_goes_through_the_reader(shard, tmp_path):
    path, header, ref = shard
    storage = TieredStorage(hot_bytes=0, spill_dir=tmp_path / "spill", io="posix")
    sid = storage.adopt(str(path))
    s = storage.shard(sid)
    calls = []
    inner = storage.io.read_rows
    storage.io.read_rows = lambda *a: calls.append(a) or inner(*a)
    rows = torch.tensor([12, 3, 3, 30, 0])
    batch, index = storage.fetch(s, rows, FIELDS)
    assert len(calls) == 1
    for k, r in enumerate(rows.tolist()):
        a, b = int(batch.offsets[index[k]]), int(batch.offsets[index[k] + 1])
        lo, hi = int(ref.offsets[r]), int(ref.offsets[r + 1])
        for name in FIELDS:
            assert torch.equal(batch.token[name][a:b].view(torch.uint8), ref.token[name][lo:hi].view(torch.uint8))
        assert torch.equal(batch.rollout["reward"][index[k]], ref.rollout["reward"][r])
    whole = storage.read_shard(sid)
    for name in FIELDS:
        assert torch.equal(whole.token[name].view(torch.uint8), ref.token[name].view(torch.uint8))
    storage.close()


def test_checksum_mismatch_is_reported_for_the_page_and_its_rows_not_copied(shard):
    path, header, ref = shard
    block = header.blocks["logprobs"]
    data = bytearray(path.read_bytes())
    bad_page = 2
    data[block.offset + bad_page * PAGE + 100] ^= 0x01
    path.write_bytes(bytes(data))
    segments, rows, crcs, dests, _ = request(header, ref, list(range(40)), ["tokens", "logprobs"])
    status, state = run(path, segments, rows, crcs, dests)
    assert status[0, 0] == READ_OK
    assert status[1, 0] == READ_CHECKSUM and status[1, 1] == bad_page
    first = segments[1, 5]
    assert state[first + bad_page] == PAGE_BAD
    assert (state[first : first + len(block.page_crcs)] == PAGE_BAD).sum() == 1


def test_corruption_seen_by_the_reader_evicts_through_the_buffer(tmp_path):
    buf = tr.RolloutBuffer(64, sampler=tr.UniformSampler(),
                           storage=TieredStorage(hot_bytes=0, spill_dir=tmp_path, io="posix", compact_below=0),
                           on_corrupt="skip")
    from rollouts import make_batch

    buf.add(make_batch(16, seed=1))
    bad = buf.add(make_batch(16, seed=2, min_len=3000, max_len=4000))
    buf.storage.flush()
    shard = buf.storage.shard(int(buf.slots.chunk[bad.slot[0]]))
    header = shard.header
    data = bytearray(open(shard.path, "rb").read())
    data[header.blocks["tokens"].offset + 5] ^= 0xFF  # page 0 of tokens: the first rollout(s) only
    open(shard.path, "wb").write(bytes(data))
    calls = []
    inner = buf.storage.io.read_rows
    buf.storage.io.read_rows = lambda *a: calls.append(a) or inner(*a)
    for seed in range(10):
        buf.sample(16, generator=torch.Generator().manual_seed(seed))
    m = buf.metrics()
    assert calls and m["evicted_corrupt"] >= 1 and m["storage_corrupt_rows"] == m["evicted_corrupt"]
    # Only rollouts touching the bad page went; the shard's other rollouts are still served.
    assert m["evicted_corrupt"] < 16 and len(buf) == 32 - m["evicted_corrupt"]
    buf.close()


def test_vanished_truncated_and_unreadable_files_are_reported(shard, tmp_path):
    path, header, ref = shard
    segments, rows, crcs, dests, _ = request(header, ref, [0, 39], ["tokens"])
    status, _ = run(tmp_path / "missing.trs", segments, rows, crcs, dests)
    assert status[0, 0] == READ_OPEN and status[0, 1] == errno.ENOENT
    status, _ = run(tmp_path, segments, rows, crcs, dests)  # a directory: open works, pread fails
    assert status[0, 0] == READ_FAILED and status[0, 1] == errno.EISDIR
    data = path.read_bytes()
    path.write_bytes(data[: header.blocks["tokens"].offset + PAGE])
    status, _ = run(path, segments, rows, crcs, dests)
    assert status[0, 0] == READ_SHORT


@pytest.mark.parametrize("breakage, match", [
    (lambda s, r, d: s.__setitem__((0, 0), 1), "file index"),
    (lambda s, r, d: s.__setitem__((0, 1), 4096 + 8), "aligned"),
    (lambda s, r, d: s.__setitem__((0, 4), 1000), "page size"),
    (lambda s, r, d: s.__setitem__((0, 5), 10_000), "checksums"),
    (lambda s, r, d: s.__setitem__((0, 6), 3), "destination index"),
    (lambda s, r, d: s.__setitem__((0, 8), 99), "row range"),
    (lambda s, r, d: r.__setitem__((1, 1), 10**9), "runs past the block"),
    (lambda s, r, d: r.__setitem__((1, 0), -1), "negative"),
    (lambda s, r, d: r.__setitem__((1, 2), 10**6), "does not fit"),
])
def test_inconsistent_requests_are_refused_before_reading(shard, breakage, match):
    path, header, ref = shard
    segments, rows, crcs, dests, _ = request(header, ref, [0, 5], ["tokens"])
    breakage(segments, rows, dests)
    before = dests[0].clone()
    with pytest.raises(ValueError, match=match):
        run(path, segments, rows, crcs, dests)
    assert torch.equal(dests[0], before)


def test_destination_too_small_is_refused(shard):
    path, header, ref = shard
    segments, rows, crcs, dests, _ = request(header, ref, [0, 5], ["tokens"], dest_rows=3)
    with pytest.raises(ValueError, match="does not fit"):
        run(path, segments, rows, crcs, dests)


def extra_fields_buffer(storage=None):
    return tr.RolloutBuffer(64, sampler=tr.UniformSampler(), storage=storage, routing=(200, 3, 2), extra_fields={
        "values": tr.FieldSpec("values", "token", torch.bfloat16, required=False),
        "difficulty": tr.FieldSpec("difficulty", "rollout", torch.float32, required=False),
    })


def extra_batch(n, seed, optional):
    from rollouts import make_batch

    batch = make_batch(n, seed=seed, min_len=50, max_len=3000)
    g = torch.Generator().manual_seed(seed)
    batch["routing"] = [torch.randint(0, 200, (t.numel(), 3, 2), generator=g) for t in batch["tokens"]]
    if optional:
        batch["values"] = [torch.randn(t.numel(), generator=g).to(torch.bfloat16) for t in batch["tokens"]]
        batch["difficulty"] = torch.rand(n, generator=g)
    return batch


@pytest.mark.parametrize("optional", [(True, True), (False, True), (True, False)])
def test_cold_samples_match_hot_with_shaped_and_optional_fields(tmp_path, optional):
    """Cold shards sharing a layout come back as one batch; shards that differ (an optional field
    present in some) take the per-shard path. Both must give what the hot-only buffer gives."""
    hot = extra_fields_buffer()
    cold = extra_fields_buffer(TieredStorage(hot_bytes=0, spill_dir=tmp_path, io="posix"))
    for i, opt in enumerate(optional):
        batch = extra_batch(12, seed=30 + i, optional=opt)
        hot.add(batch)
        cold.add(batch)
    cold.storage.flush()
    assert cold.metrics()["storage_cold_shards"] == len(optional)
    for seed in range(3):
        a = hot.sample(20, generator=torch.Generator().manual_seed(seed))
        b = cold.sample(20, generator=torch.Generator().manual_seed(seed))
        assert a.data.keys() == b.data.keys()
        for key in a.data:
            assert torch.equal(a.data[key], b.data[key]), key
    assert cold.metrics()["storage_cold_reads"] > 0
    cold.close()


def test_page_crc32_matches_zlib_and_rejects_bad_input():
    import zlib

    gen = torch.Generator().manual_seed(5)
    for n in (0, 1, 63, 64, 4095, 65536, 65537, 3 * 65536 + 17):
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
        got = torch.ops.torchreplay.page_crc32(data, 65536).tolist()
        raw = data.numpy().tobytes()
        want = [zlib.crc32(raw[i : i + 65536]) for i in range(0, n, 65536)] or [zlib.crc32(b"")]
        assert got == want, n
    torch.library.opcheck(torch.ops.torchreplay.page_crc32, (torch.arange(10000, dtype=torch.uint8), 4096))
    with pytest.raises(ValueError, match="page_size"):
        torch.ops.torchreplay.page_crc32(torch.zeros(10, dtype=torch.uint8), 1000)
    with pytest.raises(TypeError, match="uint8"):
        torch.ops.torchreplay.page_crc32(torch.zeros(10, dtype=torch.int32), 4096)


def test_span_crc32_matches_zlib_and_rejects_spans_outside_the_buffer():
    import zlib

    data = torch.randint(0, 256, (3 * 4096 + 50,), dtype=torch.uint8, generator=torch.Generator().manual_seed(6))
    raw = data.numpy().tobytes()
    spans = [(0, 4096), (4096, 4096), (8192, 4096), (12288, 50), (7, 0), (1, 4095), (0, len(raw))]
    got = torch.ops.torchreplay.span_crc32(data, torch.tensor(spans)).tolist()
    assert got == [zlib.crc32(raw[a : a + n]) for a, n in spans]
    torch.library.opcheck(torch.ops.torchreplay.span_crc32, (data, torch.tensor(spans)))
    for bad in ([(12288, 51)], [(-1, 4)], [(0, -1)]):
        with pytest.raises(ValueError, match="outside"):
            torch.ops.torchreplay.span_crc32(data, torch.tensor(bad))
    with pytest.raises(TypeError, match="int64"):
        torch.ops.torchreplay.span_crc32(data, torch.zeros(2, 3, dtype=torch.int64))
