"""A restore reads through exactly one retry layer, with the caller's `retry_budget_s` (issue 27
item 5). Before, every restore read was retried for 60 s by `RetriedReads`, and the shard reads
were wrapped in a second 60 s `with_retries` around it: an outage failed a restore only after
~60-120 s, whatever the caller wanted, and `from_checkpoint` / `import_checkpoint` took no budget.

Outages come from the fault-injecting proxy in front of the loopback S3 server (tests/s3server.py):
every request (or every request for a shard object) answers 503, a transient error that is
retried until the budget is spent."""

import math
import time

import pytest

import torchreplay as tr
from rollouts import make_batch
from torchreplay.checkpoint import Checkpointer
from torchreplay.errors import CheckpointError
from torchreplay.storage import TieredStorage

BUDGET_S = 1.0
# The budget, plus one S3 request that may be in flight at the deadline (S3Store sizes botocore's
# attempts and timeouts from the same budget: 2 attempts, at most ~1 s of backoff between them),
# plus slack for a loaded 2-core machine. The old layering took >= 60 s here.
BOUND_S = 5.0


def publish(s3_server, bucket: str) -> str:
    uri = f"s3://{bucket}/run"
    buf = tr.RolloutBuffer(64, seed=0, checkpoint=Checkpointer(uri, interval_s=3600, endpoint_url=s3_server.endpoint_url))
    for i in range(3):
        buf.add(make_batch(4, seed=i))  # one shard each
    buf.checkpoint()
    buf.close()
    return uri


def retry_layers(exc: BaseException) -> int:
    """How many retry loops gave up on the way to `exc` (each adds 'gave up after' to the chain)."""
    layers = 0
    while exc is not None:
        layers += "gave up after" in str(exc)
        exc = exc.__cause__
    return layers


@pytest.fixture
def outage(s3_server):
    def start(where: str = "") -> None:
        s3_server.faults.fail_status = 503
        s3_server.faults.fail_only = where
        s3_server.faults.fail_next = 10**9

    yield start
    s3_server.faults.fail_next = 0
    s3_server.faults.fail_only = ""


@pytest.mark.parametrize("where", ["", ".trs"], ids=["every-object", "shards-only"])
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_a_restore_under_an_outage_fails_within_its_budget(s3_server, s3_bucket, tmp_path, outage, where, lazy):
    """An outage longer than the budget fails the restore within the budget, through one retry
    layer. "shards-only" fails the shard headers' reads, the reads that had the second layer.

    Mutations: restore.open_reader(..., retry_budget_s) given 60.0 instead (the budget not passed
    on): ~60 s, fails the bound. fetch_shard_metas reading `with_retries(lambda: store.size(key),
    budget, ...)` again (the old nested layer, with the caller's budget): two layers in the chain,
    fails `retry_layers == 1` (and the time doubles whenever the inner loop gives up early)."""
    uri = publish(s3_server, s3_bucket)
    storage = TieredStorage(hot_bytes=0, spill_dir=tmp_path / "spill", io="posix") if lazy else None
    outage(where)
    start = time.monotonic()
    with pytest.raises(CheckpointError, match="gave up after") as info:
        tr.RolloutBuffer.from_checkpoint(uri, endpoint_url=s3_server.endpoint_url, progress=False, lazy=lazy,
                                         storage=storage, retry_budget_s=BUDGET_S)
    elapsed = time.monotonic() - start
    assert elapsed < BOUND_S, f"a restore with retry_budget_s={BUDGET_S} failed only after {elapsed:.1f}s"
    assert retry_layers(info.value) == 1, str(info.value)
    if where:
        assert ".trs" in str(info.value)  # it got past the manifest and state: the shard reads failed


def test_an_import_under_an_outage_fails_within_its_budget_and_adds_nothing(s3_server, s3_bucket, outage):
    uri = publish(s3_server, s3_bucket)
    buf = tr.RolloutBuffer(64, seed=1)
    outage(".trs")
    start = time.monotonic()
    with pytest.raises(CheckpointError) as info:
        buf.import_checkpoint(uri, endpoint_url=s3_server.endpoint_url, retry_budget_s=BUDGET_S)
    assert time.monotonic() - start < BOUND_S
    assert retry_layers(info.value) == 1, str(info.value)
    assert len(buf) == 0


def test_the_one_layer_still_retries_a_transient_fault(s3_server, s3_bucket, outage):
    """Four 503s in a row: more than one S3 request's own attempts (2 at a small budget) absorb,
    so the restore succeeds only because the retry layer tries again.
    Mutation: open_reader returning the bare store (no retry layer) fails the restore."""
    uri = publish(s3_server, s3_bucket)
    s3_server.faults.fail_status = 503
    s3_server.faults.fail_next = 4
    buf = tr.RolloutBuffer.from_checkpoint(uri, endpoint_url=s3_server.endpoint_url, progress=False,
                                           retry_budget_s=10.0)
    assert s3_server.faults.fail_next == 0 and len(buf) == 12
    buf.close()


@pytest.mark.parametrize("bad, error", [(-1, ValueError), (math.nan, ValueError), ("1", TypeError), (True, TypeError)])
def test_a_bad_retry_budget_is_refused_before_anything(tmp_path, bad, error):
    uri = f"file://{tmp_path}/ckpt"
    source = tr.RolloutBuffer(64, seed=0, checkpoint=Checkpointer(uri, interval_s=3600))
    source.add(make_batch(4, seed=0))
    source.close()
    with pytest.raises(error, match="retry_budget_s"):
        tr.RolloutBuffer.from_checkpoint(uri, progress=False, retry_budget_s=bad)
    buf = tr.RolloutBuffer(64, seed=1)
    with pytest.raises(error, match="retry_budget_s"):
        buf.import_checkpoint(uri, retry_budget_s=bad)
    assert len(buf) == 0
    with pytest.raises(error, match="retry_budget_s"):
        Checkpointer(uri, retry_budget_s=bad)


def test_a_resumed_job_checkpoints_with_the_restore_budget(tmp_path):
    """`checkpoint=True` keeps checkpointing with the budget the restore was given."""
    uri = f"file://{tmp_path}/ckpt"
    source = tr.RolloutBuffer(64, seed=0, checkpoint=Checkpointer(uri, interval_s=3600))
    source.add(make_batch(4, seed=0))
    source.close()
    buf = tr.RolloutBuffer.from_checkpoint(uri, progress=False, checkpoint=True, retry_budget_s=2.5)
    assert buf.checkpointer.retry_budget_s == 2.5
    buf.close()


def test_a_distributed_resume_refuses_a_bad_budget_before_any_collective(tmp_path):
    """DistributedRolloutBuffer.from_checkpoint passes `retry_budget_s` to every rank's restore
    or import; a bad one is refused on the calling rank before it joins a collective (no
    process group is initialized here: reaching one would fail differently)."""
    with pytest.raises(ValueError, match="retry_budget_s"):
        tr.DistributedRolloutBuffer.from_checkpoint(f"file://{tmp_path}/run", retry_budget_s=-1.0)
