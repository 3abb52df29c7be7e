"""The C++ cold-tier reader (torchreplay::read_shard_rows): the bytes of the tensors the test wrote
(not whatever the library's own decoder reads back), exactly the pages covering the requested rows,
corruption and I/O failures reported per segment, inconsistent requests refused before reading."""

import errno
import os
from types import SimpleNamespace

import pytest
import torch

import torchreplay as tr
from torchreplay.storage import TieredStorage
from torchreplay.storage import format as fmt
from torchreplay.storage.io import (PAGE_BAD, PAGE_OK, PAGE_UNREAD, READ_CHECKSUM, READ_FAILED, READ_OK,
                                    READ_OPEN, READ_SHORT, read_shard_rows)

PAGE = 4096  # small pages: a few KB of rows span many checksum pages


def write_shard(path, n=40, seed=0, page_size=PAGE):
    """A shard with int64, float32, bool, bfloat16 and a trailing-shape uint8 token field.
    Returns the header and the generated tensors (`src`: offsets, token, rollout), which are the
    reference every test compares against, so an encode bug that the decoder mirrors cannot pass."""
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
    return header, SimpleNamespace(offsets=offsets, token=token, rollout=rollout)


def request(header, src, rows, fields, dest_rows=None):
    """Op arguments for `rows` (sorted unique) of `fields` of one shard file, and the rows of the
    generated tensors `src` (see write_shard) that the reader must return for them."""
    offsets = src.offsets
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
    expected = {name: torch.cat([src.token[name][int(s):int(e)] for s, e in zip(starts, ends)]) for name in fields}
    return (torch.tensor(segments, dtype=torch.int64), torch.stack([starts, ends, out_offsets[:-1]], 1),
            torch.tensor(crcs, dtype=torch.int64), dests, expected)


@pytest.fixture
def shard(tmp_path):
    path = tmp_path / "shard.trs"
    header, src = write_shard(path)
    return path, header, src


def pages_touched(src, name, rows, page_size=PAGE):
    """Block pages holding the bytes of `rows` of token field `name`, from the generated tensors
    and the test's page size alone (not from the header the library wrote)."""
    t = src.token[name]
    row_bytes = t[0].numel() * t.element_size()
    pages = set()
    for r in rows:
        a, b = int(src.offsets[r]) * row_bytes, int(src.offsets[r + 1]) * row_bytes
        if b > a:
            pages.update(range(a // page_size, (b - 1) // page_size + 1))
    return pages


def block_pages(src, name, page_size=PAGE):
    t = src.token[name]
    return max(1, -(-t.numel() * t.element_size() // page_size))


def page_read_bytes(src, name, page, page_size=PAGE):
    """Bytes a read of block page `page` takes: a whole page, except that the last one ends at the
    block's 4 KiB-aligned padded end (the file pads each block to 4 KiB, not to a page)."""
    t = src.token[name]
    padded = -(-t.numel() * t.element_size() // 4096) * 4096
    return min(page_size, padded - page * page_size)


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
def test_rows_bit_identical_to_generated_tensors(shard, tmp_path, direct, threads):
    """The reader returns the bytes of the tensors the test generated, and reads exactly the pages
    that hold the requested rows: each such page once and verified, no other page, no other byte.

    Shown to fail on mutations of torchreplay/storage/format.py (each reverted afterwards):
    - `_as_bytes` encoding bfloat16 through float16 (`t.to(torch.float16).view(torch.int16)`):
      the file holds wrong "values" bytes; parse_shard decodes the same wrong bytes, so the old
      parse_shard reference passed; the generated tensors catch it (assert ... "values").
    - `plan_shard` ignoring its page_size argument (`page_size = PAGE_SIZE`, 64 KiB pages): the
      data still round-trips and the old `>=` lower bound passed, but the reader now reads whole
      64 KiB pages, so the exact byte count below fails (e.g. rows [0]: 65536 != 4096 bytes).
    """
    if direct and not supports_direct(tmp_path):
        pytest.skip(f"{tmp_path} does not support O_DIRECT")
    path, header, src = shard
    for rows in ([0], [39], [3, 4, 5, 17, 30], list(range(40)), [1, 2, 38]):
        segments, row_t, crcs, dests, expected = request(header, src, rows, FIELDS)
        status, state = run(path, segments, row_t, crcs, dests, direct, threads)
        assert (status[:, 0] == READ_OK).all(), status
        for name, out in zip(FIELDS, dests):
            assert out.dtype == src.token[name].dtype
            assert torch.equal(out.view(torch.uint8), expected[name].view(torch.uint8)), name
        assert not (state == PAGE_BAD).any()
        # Bytes read are the whole pages covering the rows, no more: pages are computed from the
        # generated lengths, row sizes and the test's PAGE, each page counted once (adjacent and
        # shared pages are coalesced, never read twice); every page read was verified, no other.
        for i, name in enumerate(FIELDS):
            pages = pages_touched(src, name, rows)
            want = sum(page_read_bytes(src, name, p) for p in pages)
            assert int(status[i, 2]) == want, (name, rows, int(status[i, 2]), want)
            base = int(segments[i, 5])
            got_state = state[base : base + block_pages(src, name)]
            want_state = torch.full_like(got_state, PAGE_UNREAD)
            want_state[sorted(pages)] = PAGE_OK
            assert torch.equal(got_state, want_state), (name, rows)
        assert int((state != PAGE_UNREAD).sum()) == sum(len(pages_touched(src, f, rows)) for f in FIELDS)


def test_python_decoder_returns_the_generated_tensors(shard):
    """parse_shard (the Python decoder) against the tensors written, not against itself."""
    path, header, src = shard
    got = fmt.parse_shard(path.read_bytes())
    assert torch.equal(got.offsets, src.offsets)
    assert got.token.keys() == src.token.keys() and got.rollout.keys() == src.rollout.keys()
    for name, t in [*src.token.items(), *src.rollout.items()]:
        out = got.token.get(name, got.rollout.get(name))
        assert out.dtype == t.dtype and out.shape == t.shape, name
        assert torch.equal(out.view(torch.uint8), t.view(torch.uint8)), name


def test_storage_fetch_goes_through_the_reader(shard, tmp_path):
    path, header, src = shard
    storage = TieredStorage(hot_bytes=0, spill_dir=tmp_path / "spill", io="posix")
    sid = storage.adopt(str(path))
    calls = []
    inner = storage.io.read_rows
    storage.io.read_rows = lambda *a: calls.append(a) or inner(*a)
    rows = torch.tensor([12, 3, 3, 30, 0])
    batch, index = storage.fetch(sid, rows, FIELDS)
    assert len(calls) == 1
    for k, r in enumerate(rows.tolist()):
        a, b = int(batch.offsets[index[k]]), int(batch.offsets[index[k] + 1])
        lo, hi = int(src.offsets[r]), int(src.offsets[r + 1])
        for name in FIELDS:
            assert torch.equal(batch.token[name][a:b].view(torch.uint8), src.token[name][lo:hi].view(torch.uint8))
        assert torch.equal(batch.rollout["reward"][index[k]], src.rollout["reward"][r])
    whole = storage.read_shard(sid)
    for name in FIELDS:
        assert torch.equal(whole.token[name].view(torch.uint8), src.token[name].view(torch.uint8))
    storage.close()


def test_checksum_mismatch_is_reported_for_the_page_and_its_rows_not_copied(shard):
    path, header, src = shard
    block = header.blocks["logprobs"]
    data = bytearray(path.read_bytes())
    bad_page = 2
    data[block.offset + bad_page * PAGE + 100] ^= 0x01
    path.write_bytes(bytes(data))
    segments, rows, crcs, dests, _ = request(header, src, list(range(40)), ["tokens", "logprobs"])
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
    shard = buf.storage.shard(int(buf.slots.shard[bad.slot[0]]))
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
    path, header, src = shard
    segments, rows, crcs, dests, _ = request(header, src, [0, 39], ["tokens"])
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
    path, header, src = shard
    segments, rows, crcs, dests, _ = request(header, src, [0, 5], ["tokens"])
    breakage(segments, rows, dests)
    before = dests[0].clone()
    with pytest.raises(ValueError, match=match):
        run(path, segments, rows, crcs, dests)
    assert torch.equal(dests[0], before)


def test_destination_too_small_is_refused(shard):
    path, header, src = shard
    segments, rows, crcs, dests, _ = request(header, src, [0, 5], ["tokens"], dest_rows=3)
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
