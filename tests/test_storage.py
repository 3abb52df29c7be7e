"""Tiered storage: write-through spill, page-in, prefetch, shard lifecycle, faults, memory bound."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
import time

import pytest
import torch

import torchreplay as tr
from gpu_support import require_kvikio
from rollouts import make_batch
from torchreplay.snapshot import live_shards
from torchreplay.storage import TieredStorage
from torchreplay.storage import format as fmt

ROOT = os.geteuid() == 0 if hasattr(os, "geteuid") else False


def twin_buffers(tmp_path, hot_bytes, **kw):
    """The same buffer hot-only and tiered, fed identical data."""
    hot = tr.RolloutBuffer(256, sampler=tr.PrioritizedSampler(alpha=0.7), **kw)
    cold = tr.RolloutBuffer(256, sampler=tr.PrioritizedSampler(alpha=0.7), **kw,
                            storage=TieredStorage(hot_bytes=hot_bytes, spill_dir=tmp_path / "spill", io="posix"))
    for i in range(8):
        batch = make_batch(24, seed=100 + i, max_len=400, group_base=10 * i)
        hot.add(batch)
        cold.add(batch)
    return hot, cold


def assert_same(a, b):
    assert a.data.keys() == b.data.keys()
    for key in a.data:
        assert torch.equal(a.data[key], b.data[key]), key
    assert torch.equal(a.handles.slot, b.handles.slot) and torch.equal(a.weights, b.weights)


def test_spilled_rollouts_read_back_identical(tmp_path):
    hot, cold = twin_buffers(tmp_path, hot_bytes=20_000)
    cold.storage.flush()
    m = cold.metrics()
    assert m["storage_hot_bytes"] <= 20_000
    assert m["storage_cold_shards"] >= 6 and m["storage_spilled_shards"] == 8
    assert len(list((tmp_path / "spill").glob("*.trs"))) == 8
    for seed in range(3):
        assert_same(hot.sample(40, generator=torch.Generator().manual_seed(seed)),
                    cold.sample(40, generator=torch.Generator().manual_seed(seed)))
    assert cold.metrics()["storage_cold_reads"] > 0
    cold.close()


def test_page_in_reads_only_the_needed_pages(tmp_path):
    storage = TieredStorage(hot_bytes=0, spill_dir=tmp_path, io="posix")
    buf = tr.RolloutBuffer(4096, sampler=tr.UniformSampler(), storage=storage)
    buf.add(make_batch(4000, seed=1, min_len=200, max_len=400))
    storage.flush()
    shard_bytes = os.path.getsize(next(tmp_path.glob("*.trs")))
    buf.sample(4, generator=torch.Generator().manual_seed(0))
    read = buf.metrics()["storage_cold_bytes_read"]
    # 4 rollouts x 3 token fields, each at most two 64 KiB pages: far below the ~16 MB shard.
    assert 0 < read <= 4 * 3 * 2 * fmt.PAGE_SIZE < shard_bytes / 4


def test_prefetch_matches_sample(tmp_path):
    hot, cold = twin_buffers(tmp_path, hot_bytes=0, max_reuse=3)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    ahead = list(cold.prefetching(16, steps=5, generator=g2))
    for batch in ahead:
        assert_same(hot.sample(16, generator=g1), batch)
    pending = cold.sample_async(8, generator=g2)
    assert_same(hot.sample(8, generator=g1), pending.result())
    cold.close()


def test_shard_files_deleted_when_all_rollouts_evicted(tmp_path):
    storage = TieredStorage(hot_bytes=0, spill_dir=tmp_path, io="posix")
    buf = tr.RolloutBuffer(64, sampler=tr.UniformSampler(), max_staleness=2, storage=storage)
    for v in range(3):
        buf.add(make_batch(8, version=v, seed=v))
    storage.flush()
    assert len(list(tmp_path.glob("*.trs"))) == 3
    buf.advance(4)  # versions 0 and 1 go
    assert len(list(tmp_path.glob("*.trs"))) == 1
    buf.close()



def test_shard_that_dies_while_pinned_is_deleted_by_the_unpinning_thread(tmp_path):
    """A checkpoint upload pins its shard; if the shard's rollouts die meanwhile, the upload thread
    deletes the file when it unpins, rather than leaving a batch of unlinks to the trainer's next call.

    The shards are picked through the public slot table (the ones holding versions 0 and 1), not
    `storage._shards`. Mutation checked: `unpin_shards` without its `delete_ready()` fails."""
    import threading

    storage = TieredStorage(hot_bytes=0, spill_dir=tmp_path, io="posix")
    buf = tr.RolloutBuffer(64, sampler=tr.UniformSampler(), max_staleness=2, storage=storage)
    for v in range(3):
        buf.add(make_batch(8, version=v, seed=v))
    storage.flush()
    slots = buf.slots
    doomed = sorted(set(slots.shard[slots.live & (slots.policy_version < 2)].tolist()))
    assert len(doomed) == 2 and len(live_shards(slots)[0]) == 3  # one shard per add
    pinned = [storage.shard(sid) for sid in doomed]
    storage.pin_shards([s.id for s in pinned])
    buf.advance(4)  # both pinned shards die; their files must outlive the pin
    assert all(os.path.exists(s.path) for s in pinned)
    deleted_before = storage.counters["deleted_shards"]
    unpinner = threading.Thread(target=storage.unpin_shards, args=([s.id for s in pinned],))
    unpinner.start()
    unpinner.join()
    assert not any(os.path.exists(s.path) for s in pinned)  # no trainer call in between
    assert storage.counters["deleted_shards"] == deleted_before + 2
    assert len(list(tmp_path.glob("*.trs"))) == 1
    buf.close()

def test_mostly_dead_shards_are_compacted(tmp_path):
    storage = TieredStorage(hot_bytes=0, spill_dir=tmp_path, io="posix", compact_below=0.5)
    buf = tr.RolloutBuffer(64, sampler=tr.UniformSampler(), max_reuse=1, storage=storage)
    batch = make_batch(32, seed=3)
    handles = buf.add(batch)
    storage.flush()
    # Use up 24 of the 32 rollouts, leaving the shard 25% live.
    buf.sample(1, generator=torch.Generator().manual_seed(0))
    while len(buf) > 8:
        buf.sample(1, generator=torch.Generator().manual_seed(len(buf)))
    survivors = [s for s, g in handles if buf.slots.live[s]]
    buf.advance(1)
    storage.flush()
    assert buf.metrics()["storage_compactions"] == 1
    assert len(list(tmp_path.glob("*.trs"))) == 1
    out = buf.sample(8, generator=torch.Generator().manual_seed(1))
    for k, slot in enumerate(out.handles.slot.tolist()):
        assert slot in survivors
        n = batch["tokens"][slot].numel()
        assert torch.equal(out.tokens[k, :n], batch["tokens"][slot])
    buf.close()


def test_shard_header_validation(tmp_path):
    batch = make_batch(5, seed=4)
    hot = tr.RolloutBuffer(8, storage=TieredStorage(hot_bytes=0, spill_dir=tmp_path, io="posix"))
    hot.add(batch)
    hot.storage.flush()
    path = next(tmp_path.glob("*.trs"))
    data = path.read_bytes()
    header = fmt.parse_header(data, len(data))
    assert all(b.offset % 4096 == 0 for b in header.blocks.values())
    assert len(data) % 4096 == 0
    with pytest.raises(tr.StorageError, match="magic"):
        fmt.parse_header(b"XXXXXXXX" + data[8:], len(data))
    flipped = bytearray(data)
    flipped[30] ^= 0xFF
    with pytest.raises(tr.StorageError, match="checksum"):
        fmt.parse_header(bytes(flipped), len(data))
    with pytest.raises(tr.StorageError, match="bytes"):
        fmt.parse_header(data, len(data) - 4096)


def corrupt_block(path, field="tokens"):
    path = Path(path)
    data = bytearray(path.read_bytes())
    header = fmt.parse_header(bytes(data), len(data))
    block = header.blocks[field]
    for i in range(block.offset, block.offset + block.nbytes, 997):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


# device="cpu" reads cold rows through the staged path (preads into a staging buffer, checksums
# by span_crc32 where they landed), the one kvikio takes into GPU memory; None through the C++ reader.
@pytest.mark.parametrize("device", [None, "cpu"])
@pytest.mark.parametrize("mode", ["raise", "skip"])
def test_corrupt_block_evicts_affected_rollouts_and_keeps_serving(tmp_path, mode, device):
    storage = TieredStorage(hot_bytes=0, spill_dir=tmp_path, io="posix", compact_below=0, device=device)
    buf = tr.RolloutBuffer(64, sampler=tr.UniformSampler(), storage=storage, on_corrupt=mode)
    good = make_batch(16, seed=5)
    bad = make_batch(16, seed=6)
    good_handles = buf.add(good)
    bad_handles = buf.add(bad)
    storage.flush()
    corrupt_block(storage.shard(int(buf.slots.shard[bad_handles.slot[0]])).path)
    gen = torch.Generator().manual_seed(0)
    if mode == "raise":
        with pytest.raises(tr.StorageError, match="checksum"):
            for _ in range(20):
                buf.sample(8, device=device, generator=gen)
    for _ in range(20):
        out = buf.sample(8, device=device, generator=gen)
        assert set(out.handles.slot.tolist()) <= set(good_handles.slot.tolist())
        for k, slot in enumerate(out.handles.slot.tolist()):
            n = good["tokens"][slot].numel()
            assert torch.equal(out.tokens[k, :n], good["tokens"][slot])
    m = buf.metrics()
    assert (m["storage_device_staged_bytes"] > 0) == (device is not None)
    assert m["evicted_corrupt"] > 0 and m["storage_corrupt_rows"] == m["evicted_corrupt"]
    assert len(buf) == 32 - m["evicted_corrupt"]
    buf.close()


@pytest.mark.parametrize("device", [None, "cpu"])
def test_vanished_file_raises_storage_error_and_evicts_its_rollouts(tmp_path, device):
    storage = TieredStorage(hot_bytes=0, spill_dir=tmp_path, io="posix", compact_below=0, device=device)
    buf = tr.RolloutBuffer(64, sampler=tr.UniformSampler(), storage=storage)
    keep = buf.add(make_batch(8, seed=7))
    lost = buf.add(make_batch(8, seed=8))
    storage.flush()
    os.unlink(storage.shard(int(buf.slots.shard[lost.slot[0]])).path)
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(tr.StorageError, match="vanished"):
        for _ in range(10):
            buf.sample(16, device=device, generator=gen)
    assert len(buf) == 8 and buf.metrics()["evicted_corrupt"] == 8
    out = buf.sample(16, device=device, generator=gen)
    assert set(out.handles.slot.tolist()) <= set(keep.slot.tolist())
    buf.close()


@pytest.fixture
def small_tmpfs(tmp_path):
    if not ROOT:
        pytest.skip("mounting a size-limited tmpfs needs root (CI and these machines run as root)")
    mount = tmp_path / "tiny"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def test_disk_full_surfaces_storage_error_and_loses_nothing(small_tmpfs):
    storage = TieredStorage(hot_bytes=0, spill_dir=small_tmpfs, io="posix")
    buf = tr.RolloutBuffer(512, sampler=tr.UniformSampler(), storage=storage)
    batches = [make_batch(64, seed=10 + i, min_len=500, max_len=600) for i in range(4)]  # ~1.7 MB each
    handles = []
    with pytest.raises(tr.StorageError, match="disk full"):
        for b in batches:
            handles.append(buf.add(b))
            time.sleep(0.2)
        buf.storage.flush()
    assert len(buf) == 64 * len(handles)
    assert not [p for p in os.listdir(small_tmpfs) if ".tmp-" in p], "partial shard left behind"
    # Everything accepted is still readable: the failed shards kept their hot copies.
    out = buf.sample(256, generator=torch.Generator().manual_seed(0))
    for k, slot in enumerate(out.handles.slot.tolist()):
        for i, h in enumerate(handles):
            where = (h.slot == slot).nonzero()
            if where.numel():
                src = batches[i]["tokens"][int(where[0, 0])]
                assert torch.equal(out.tokens[k, : src.numel()], src)
    buf.close()


def test_permission_denied_is_a_storage_error(tmp_path):
    target = tmp_path / "locked"
    target.mkdir()
    os.chmod(target, 0o555)
    if not ROOT:
        with pytest.raises(tr.StorageError, match="permission denied"):
            TieredStorage(hot_bytes=0, spill_dir=target, io="posix")
        return
    # root bypasses permission bits: run the check in a child that has dropped the capabilities
    # that let it (util-linux setpriv), so the kernel really answers EACCES.
    setpriv = shutil.which("setpriv")
    assert setpriv, "setpriv (util-linux) is needed to drop root's DAC capabilities"
    code = textwrap.dedent(f"""
        from torchreplay.storage import TieredStorage
        from torchreplay.errors import StorageError
        try:
            TieredStorage(hot_bytes=0, spill_dir={str(target / "spill")!r}, io="posix")
        except StorageError as exc:
            print("StorageError:", exc)
    """)
    out = subprocess.run([setpriv, "--bounding-set", "-dac_override,-dac_read_search", sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=120)
    assert "StorageError" in out.stdout and "permission denied" in out.stdout, out.stdout + out.stderr


def device_twins(tmp_path, device, padding_side="right", io="posix", **storage_kw):
    """A hot-only buffer and one with a device tier on `device`, fed identical data: optional
    routing ids (a [3, 2] uint8 token field) on half the batches, so some shards lack that field."""
    routing = tr.FieldSpec("routing", "token", torch.uint8, (3, 2), required=False, accept="int")
    kw = dict(sampler=tr.PrioritizedSampler(alpha=0.7), extra_fields={"routing": routing},
              padding_side=padding_side, pad_token_id=-3)
    hot = tr.RolloutBuffer(256, **kw)
    tiered = tr.RolloutBuffer(256, **kw, storage=TieredStorage(device=device, io=io, **storage_kw))
    for i in range(8):
        batch = make_batch(24, seed=100 + i, max_len=400, group_base=10 * i)
        if i % 2:
            g = torch.Generator().manual_seed(i)
            batch["routing"] = [torch.randint(0, 64, (t.numel(), 3, 2), generator=g) for t in batch["tokens"]]
        hot.add(batch)
        tiered.add(batch)
    tiered.storage.flush()
    return hot, tiered


# Each case takes a different mix of row sources: device-tier copies only; device copies plus host
# hot copies (the device budget holds ~3 of 8 shards); device copies plus cold rows staged on the
# device (hot_bytes=0); cold rows only, staged.
DEVICE_CASES = {
    "device-only": dict(device_bytes=1 << 30),
    "device+host": dict(device_bytes=250_000),
    "device+staged": dict(device_bytes=250_000, hot_bytes=0, spill=True),
    "staged-only": dict(device_bytes=0, hot_bytes=0, spill=True),
}


def device_storage_kw(tmp_path, case):
    kw = dict(DEVICE_CASES[case])
    if kw.pop("spill", False):
        kw["spill_dir"] = tmp_path / "spill"
    return kw


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("case", list(DEVICE_CASES))
def test_device_tier_batches_equal_host_assembled_ones(tmp_path, case, side):
    """device='cpu' runs the device tier's code (copies, index-op padding, staged cold reads with
    on-device checksums) in host memory: every batch must equal the hot-only buffer's, bit for bit."""
    hot, tiered = device_twins(tmp_path, "cpu", side, **device_storage_kw(tmp_path, case))
    for seed in range(4):
        want = hot.sample(40, generator=torch.Generator().manual_seed(seed))
        assert_same(want, tiered.sample(40, device="cpu", generator=torch.Generator().manual_seed(seed)))
    ahead = list(tiered.prefetching(16, steps=3, device="cpu", generator=torch.Generator().manual_seed(9)))
    g = torch.Generator().manual_seed(9)
    for batch in ahead:
        assert_same(hot.sample(16, generator=g), batch)
    m = tiered.metrics()
    budget = DEVICE_CASES[case]["device_bytes"]
    assert m["storage_device_bytes"] <= budget
    assert (m["storage_device_hits"] > 0) == (budget > 0)
    assert (m["storage_device_staged_bytes"] > 0) == ("spill" in DEVICE_CASES[case])
    if case == "device+host":
        assert m["storage_device_dropped"] > 0 and m["storage_hot_hits"] > 0
    tiered.close()


@pytest.mark.cuda
@pytest.mark.parametrize("io", ["posix", "kvikio"])
@pytest.mark.parametrize("case", list(DEVICE_CASES))
def test_cuda_device_tier_batches_equal_host_assembled_ones(tmp_path, case, io):
    """The VRAM tier and (with kvikio) cold pages read straight into device memory and verified
    there by the CUDA span_crc32; POSIX cannot read into VRAM, so its cold rows come via the host."""
    if io == "kvikio":
        require_kvikio()
    hot, tiered = device_twins(tmp_path, "cuda", io=io, **device_storage_kw(tmp_path, case))
    for seed in range(4):
        want = hot.sample(40, generator=torch.Generator().manual_seed(seed))
        got = tiered.sample(40, device="cuda", generator=torch.Generator().manual_seed(seed))
        assert all(t.is_cuda for t in got.data.values())
        assert_same(want, got.to("cpu"))
    m = tiered.metrics()
    assert m["storage_device_bytes"] <= DEVICE_CASES[case]["device_bytes"]
    staged = "spill" in DEVICE_CASES[case] and io == "kvikio"
    assert (m["storage_device_staged_bytes"] > 0) == staged
    tiered.close()


@pytest.mark.cuda
def test_cuda_span_crc32_matches_the_host():
    data = torch.randint(0, 256, (5 * 4096 + 123,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    spans = torch.tensor([[0, 4096], [4096, 4096], [8192, 123], [100, 0], [20480, 123]])
    host = torch.ops.torchreplay.span_crc32(data, spans)
    assert torch.equal(torch.ops.torchreplay.span_crc32(data.cuda(), spans.cuda()).cpu(), host)
    # An out-of-range span is -1 from the kernel, never a read past the buffer.
    bad = torch.ops.torchreplay.span_crc32(data.cuda(), torch.tensor([[20480, 9999]], device="cuda")).cpu()
    assert bad.tolist() == [-1]


def test_device_tier_frees_its_bytes_as_rollouts_die(tmp_path):
    """The device tier holds exactly the token bytes of the live shards, and none once they die.

    Shards are found through the public slot table (`live_shards`), not `storage._shards`.
    Mutation checked: the tier skipping the first shard (`... and shard.id > 0` on the device-copy
    branch of `TieredStorage.put`) fails the held-bytes check; the final check alone passes it."""
    storage = TieredStorage(device="cpu", device_bytes=1 << 30)
    buf = tr.RolloutBuffer(64, sampler=tr.UniformSampler(), max_staleness=1, storage=storage)
    buf.add(make_batch(16, version=0, seed=1))
    buf.add(make_batch(16, version=1, seed=2))
    held = storage.metrics()["storage_device_bytes"]
    ids, rows = live_shards(buf.slots)
    assert rows == [16, 16] and storage.metrics()["storage_shards"] == len(ids) == 2
    assert held == sum(storage.shard(sid).token_bytes for sid in ids) > 0
    buf.advance(3)  # both batches are now too stale
    assert len(buf) == 0 and storage.metrics()["storage_device_bytes"] == 0


def test_device_settings_are_validated(tmp_path):
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA"):
            TieredStorage(device_bytes=1 << 20)  # the device defaults to cuda
    with pytest.raises(ValueError, match="device must"):
        TieredStorage(device="not-a-device")
    with pytest.raises(ValueError, match="device must be a CUDA device or 'cpu'"):
        TieredStorage(device="meta")
    with pytest.raises(ValueError, match="device_bytes"):
        TieredStorage(device="cpu", device_bytes=-1)
    with pytest.raises(ValueError, match="device_policy"):
        TieredStorage(device="cpu", device_policy="mru")
    with pytest.raises(TypeError, match="device_policy"):
        TieredStorage(device="cpu", device_policy=object())


def test_io_auto_without_cuda_driver_picks_posix(tmp_path, caplog):
    from torchreplay.storage import cuda_driver_present

    if cuda_driver_present():  # then auto must pick kvikio, which must be installed
        require_kvikio()
        assert TieredStorage(hot_bytes=0, spill_dir=tmp_path, io="auto").io_name == "kvikio"
        return
    with caplog.at_level("INFO", logger="torchreplay.storage"):
        storage = TieredStorage(hot_bytes=0, spill_dir=tmp_path, io="auto")
    assert storage.io_name == "posix" and "POSIX" in caplog.text
    with pytest.raises(tr.StorageError, match="CUDA driver"):
        TieredStorage(hot_bytes=0, spill_dir=tmp_path, io="kvikio")


@pytest.mark.cuda
def test_kvikio_round_trip(tmp_path):
    require_kvikio()
    hot, cold = twin_buffers(tmp_path, hot_bytes=0)
    cold.storage.close()
    kv = tr.RolloutBuffer(256, sampler=tr.PrioritizedSampler(alpha=0.7),
                          storage=TieredStorage(hot_bytes=0, spill_dir=tmp_path / "kv", io="kvikio"))
    for i in range(8):
        kv.add(make_batch(24, seed=100 + i, max_len=400, group_base=10 * i))
    kv.storage.flush()
    assert kv.storage.io_name == "kvikio"
    assert_same(hot.sample(40, generator=torch.Generator().manual_seed(0)),
                kv.sample(40, generator=torch.Generator().manual_seed(0)))


def test_direct_io_round_trip(tmp_path):
    try:
        fd = os.open(tmp_path / "probe", os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o644)
        os.close(fd)
    except OSError:
        pytest.skip(f"{tmp_path} does not support O_DIRECT")
    hot = tr.RolloutBuffer(64, sampler=tr.UniformSampler())
    direct = tr.RolloutBuffer(64, sampler=tr.UniformSampler(),
                              storage=TieredStorage(hot_bytes=0, spill_dir=tmp_path / "d", io="posix", direct=True))
    for i in range(3):
        b = make_batch(16, seed=20 + i, max_len=200)
        hot.add(b)
        direct.add(b)
    direct.storage.flush()
    assert_same(hot.sample(32, generator=torch.Generator().manual_seed(1)),
                direct.sample(32, generator=torch.Generator().manual_seed(1)))
    direct.close()


def test_memory_stays_within_the_hot_budget(tmp_path):
    """Spill 384 MiB with a 32 MiB hot budget: RSS growth stays under budget + 96 MiB fixed overhead.

    Runs in a child process so the measurement sees only this workload. The 4 GiB version is
    `benchmarks/bench_storage.py --rss`.
    """
    code = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import torchreplay as tr
        from torchreplay.storage import TieredStorage
        def rss():
            with open('/proc/self/statm') as f:
                return int(f.read().split()[1]) * 4096
        buf = tr.RolloutBuffer(1 << 16, sampler=tr.UniformSampler(),
                               storage=TieredStorage(hot_bytes=32 << 20, spill_dir={str(tmp_path)!r}, io='posix'))
        n, length = 256, 12 * 1024  # 256 rollouts x 12k tokens x 13 B = 40 MB per add
        toks = torch.randint(0, 1000, (n * length,))
        lp = -torch.rand(n * length)
        mask = torch.ones(n * length, dtype=torch.bool)
        offsets = torch.arange(n + 1) * length
        base = rss()
        peak = 0
        for step in range(10):
            buf.add({{'tokens': {{'values': toks, 'offsets': offsets}},
                     'logprobs': {{'values': lp, 'offsets': offsets}},
                     'response_mask': {{'values': mask, 'offsets': offsets}},
                     'prompt_len': torch.zeros(n, dtype=torch.long), 'reward': torch.zeros(n),
                     'advantage': torch.randn(n), 'group_id': torch.arange(n), 'policy_version': 0}})
            buf.sample(8, generator=torch.Generator().manual_seed(step))
            peak = max(peak, rss() - base)
        buf.storage.flush()
        print('spilled', buf.metrics()['storage_spilled_bytes'], 'peak_growth', peak)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    spilled, growth = (int(x) for x in out.stdout.split()[1::2])
    assert spilled >= 380 << 20
    assert growth <= (32 << 20) + (96 << 20), f"RSS grew {growth / 2**20:.0f} MiB"


def test_kvikio_read_spans_waits_for_every_issued_read_and_maps_failures(tmp_path):
    """The error handling of KvikioIO.read_spans, with a stand-in for kvikio's CuFile (the real
    one needs a CUDA driver; tests marked cuda run it). A pread that raises must not leave earlier
    reads of the same file unwaited, and a missing file must read as vanished (ENOENT)."""
    import errno
    from types import SimpleNamespace

    from torchreplay.storage.io import KvikioIO

    waited, closed = [], []

    class Future:
        def __init__(self, n):
            self.n = n

        def get(self):
            waited.append(self.n)
            return self.n

    class CuFile:
        def __init__(self, path, mode):
            if not os.path.exists(path):
                raise RuntimeError(f"cuFile open failed: {path}")
            self.path = path

        def pread(self, buf, size, file_offset):
            if file_offset == 3 * 4096:
                raise ValueError("buffer rejected")
            return Future(size)

        def close(self):
            closed.append(self.path)

    class FakeKvikio:
        defaults = SimpleNamespace(get=lambda name: 8)  # kvikio's pool already wider than 2: left alone

    FakeKvikio.CuFile = CuFile
    io = KvikioIO(threads=2, kvikio=FakeKvikio)
    present = tmp_path / "shard"
    present.write_bytes(bytes(5 * 4096))
    staging = torch.empty(5 * 4096, dtype=torch.uint8)
    spans = [(str(present), 0, 4096, 0), (str(present), 3 * 4096, 4096, 4096), (str(present), 4096, 100, 8192),
             (str(tmp_path / "gone"), 0, 10, 12288)]
    got = io.read_spans(spans, staging)
    assert got[0] == 4096 and got[2] == 100 and sorted(waited) == [100, 4096]
    assert isinstance(got[1], OSError) and got[1].errno == errno.EIO
    assert isinstance(got[3], OSError) and got[3].errno == errno.ENOENT
    assert closed == [str(present)]
    io.close()


@pytest.mark.parametrize("policy, dropped", [("lru", 1), ("newest", 0)])
def test_hot_policy_decides_which_copy_is_dropped(tmp_path, policy, dropped):
    """docs/api.md: `policy="lru"` drops the least recently sampled shard's hot copy first,
    `"newest"` the oldest added, whatever was sampled. Three shards of 10.4 KB under a 26 KB hot
    budget: shard 0 is sampled, then shard 2 arrives and one copy must go. Observed only through
    the public read counters. Mutation checked: LRUPolicy.touched as a no-op makes "lru" drop
    shard 0."""
    storage = TieredStorage(hot_bytes=26_000, spill_dir=tmp_path, io="posix", policy=policy)
    buf = tr.RolloutBuffer(64, sampler=tr.UniformSampler(), storage=storage)
    shards = [buf.add(make_batch(8, seed=i, min_len=100, max_len=100)) for i in range(2)]
    storage.flush()
    buf.gather(shards[0].slot, count_use=False)  # shard 0 is the most recently used
    shards.append(buf.add(make_batch(8, seed=2, min_len=100, max_len=100)))
    storage.flush()

    def read_cold(handles) -> bool:
        before = buf.metrics()["storage_cold_reads"]
        buf.gather(handles.slot, count_use=False)
        return buf.metrics()["storage_cold_reads"] > before

    assert [read_cold(shards[i]) for i in (2, dropped, 1 - dropped)] == [False, True, False]
    buf.close()


class NewestDroppedFirst:
    """A user-written HotPolicy (docs/api.md: any object with `added`, `touched`, `removed` and
    `drop_order`; no base class): drops the most recently added shard's hot copy first, which
    neither built-in does. It records what the storage tells it."""

    def __init__(self) -> None:
        self.order: list[int] = []
        self.events: list[tuple[str, int]] = []

    def added(self, shard_id: int) -> None:
        self.order.append(shard_id)
        self.events.append(("added", shard_id))

    def touched(self, shard_id: int) -> None:
        self.events.append(("touched", shard_id))

    def removed(self, shard_id: int) -> None:
        if shard_id in self.order:
            self.order.remove(shard_id)
        self.events.append(("removed", shard_id))

    def drop_order(self) -> list[int]:
        return self.order[::-1]


def test_a_user_written_hot_policy_decides_end_to_end(tmp_path):
    """The storage tells a user's policy object of every shard added, sampled and removed, and
    drops hot copies in its order: 10.4 KB shards under a 26 KB hot budget, so each third shard
    costs one copy, here the newest's (lru would drop shard 1, newest-first shard 0). Mutations
    seen failing: Tiers._enforce_budget walking the shards in id order instead of the
    policy's drop_order (shard 0 read cold); a policy object replaced by LRUPolicy() (no event
    reaches it)."""
    policy = NewestDroppedFirst()
    storage = TieredStorage(hot_bytes=26_000, spill_dir=tmp_path, io="posix", policy=policy)
    buf = tr.RolloutBuffer(24, sampler=tr.UniformSampler(), storage=storage)
    shards = [buf.add(make_batch(8, seed=i, min_len=100, max_len=100)) for i in range(3)]
    storage.flush()
    ids = [sid for event, sid in policy.events if event == "added"]
    assert len(set(ids)) == 3 and policy.order == ids

    def read_cold(handles) -> bool:
        before = buf.metrics()["storage_cold_reads"]
        buf.gather(handles.slot, count_use=False)
        return buf.metrics()["storage_cold_reads"] > before

    assert [read_cold(h) for h in shards] == [False, False, True]
    assert ("touched", ids[0]) in policy.events  # gathering shard 0 was reported
    shards.append(buf.add(make_batch(8, seed=3, min_len=100, max_len=100)))  # capacity 24: shard 0's rows die
    storage.flush()
    assert ("removed", ids[0]) in policy.events and ids[0] not in policy.order
    assert [read_cold(h) for h in shards[1:]] == [False, True, True]  # the new shard's copy went
    buf.close()


@pytest.mark.parametrize("policy, dropped", [("lru", 1), ("newest", 0)])
def test_device_policy_decides_which_device_copy_is_dropped(policy, dropped):
    """The device tier's `device_policy` (here on device="cpu", the CPU-testable path): 10.4 KB
    shards under a 26 KB device budget; shard 0 is sampled onto the device, then shard 2 arrives.
    Observed through `storage_device_hits`. Mutation checked: LRUPolicy.touched as a no-op makes
    "lru" drop shard 0."""
    storage = TieredStorage(device="cpu", device_bytes=26_000, device_policy=policy)
    buf = tr.RolloutBuffer(64, sampler=tr.UniformSampler(), storage=storage)
    shards = [buf.add(make_batch(8, seed=i, min_len=100, max_len=100)) for i in range(2)]
    buf.gather(shards[0].slot, count_use=False, device="cpu")
    shards.append(buf.add(make_batch(8, seed=2, min_len=100, max_len=100)))

    def on_device(handles) -> bool:
        before = buf.metrics()["storage_device_hits"]
        buf.gather(handles.slot, count_use=False, device="cpu")
        return buf.metrics()["storage_device_hits"] > before

    assert [on_device(shards[i]) for i in (2, dropped, 1 - dropped)] == [True, False, True]
    buf.close()
