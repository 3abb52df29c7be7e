"""Issue 24, durability items: bounded checkpoint uploads (item 7) and the compaction threshold on
shard size (item 13). The resharding of a cut with ranks at different versions (item 6) is in
tests/test_distributed.py, which has the multi-process harness."""

from __future__ import annotations

import pytest
import torch

import torchreplay as tr
from rollouts import make_batch
from torchreplay.storage import TieredStorage


# ------------------------------------------------------------------------------ item 13
@pytest.mark.parametrize("min_rows", [None, 8])
def test_compaction_takes_shards_from_compact_min_rows_up(tmp_path, min_rows):
    """Two shards 1/4 live or less under compact_below=0.5: one of exactly `compact_min_rows` rows is
    rewritten by advance(), one a row smaller is not. `None` checks the documented default, 16.
    Mutations checked: `s.n > self.compact_min_rows` (the shard at the threshold stays) and the
    old hard-coded `s.n >= 16` with min_rows=8 (neither shard is compacted)."""
    kwargs = {} if min_rows is None else {"compact_min_rows": min_rows}
    threshold = 16 if min_rows is None else min_rows
    storage = TieredStorage(hot_bytes=0, spill_dir=tmp_path, io="posix", compact_below=0.5, **kwargs)
    assert storage.compact_min_rows == threshold
    buf = tr.RolloutBuffer(64, sampler=tr.UniformSampler(), max_reuse=1, storage=storage)
    at, below = make_batch(threshold, seed=1), make_batch(threshold - 1, seed=2)
    h_at, h_below = buf.add(at), buf.add(below)
    keep = 2  # survivors per shard: 2/threshold and 2/(threshold - 1) are both below 0.5
    buf.gather(h_at.slot[keep:])  # max_reuse=1: one use each evicts them
    buf.gather(h_below.slot[keep:])
    chunk_at, chunk_below = buf.slots.chunk[h_at.slot[:keep]].clone(), buf.slots.chunk[h_below.slot[:keep]].clone()
    storage.flush()
    buf.advance(1)
    assert buf.metrics()["storage_compactions"] == 1
    assert not torch.equal(buf.slots.chunk[h_at.slot[:keep]], chunk_at)  # rewritten into a new shard
    assert torch.equal(buf.slots.chunk[h_below.slot[:keep]], chunk_below)  # left as it was
    storage.flush()
    assert len(list(tmp_path.glob("*.trs"))) == 2
    # The compacted rollouts read back exactly.
    out = buf.gather(torch.cat([h_at.slot[:keep], h_below.slot[:keep]]), count_use=False)
    for k, (batch, i) in enumerate([(at, 0), (at, 1), (below, 0), (below, 1)]):
        n = batch["tokens"][i].numel()
        assert torch.equal(out.tokens[k, :n], batch["tokens"][i])
        assert torch.equal(out.logprobs[k, :n], batch["logprobs"][i])
    buf.close()


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-3, ValueError), (2.5, TypeError), (True, TypeError),
                                        ("8", TypeError), (None, TypeError)])
def test_compact_min_rows_is_validated(tmp_path, bad, error):
    with pytest.raises(error, match="compact_min_rows"):
        TieredStorage(hot_bytes=0, spill_dir=tmp_path, compact_min_rows=bad)
    assert not list(tmp_path.iterdir())  # refused before the spill directory is used
