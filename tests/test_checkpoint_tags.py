"""Checkpoints a trainer can line up with: `checkpoint(tag=step)` and `from_checkpoint(uri, tag=step)`
(issue #16, item 6), retention that keeps tagged manifests, and SIGKILL during a tagged publish."""

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

import torchreplay as tr
from crash_child import rollout_batch
from rollouts import make_batch
from torchreplay.checkpoint import Checkpointer, open_store, read_manifest

HERE = os.path.dirname(__file__)


def fingerprint(buf):
    """What must come back exactly: slot metadata, and a batch drawn with a fixed generator."""
    slots = {name: getattr(buf.slots, name).clone() for name in ("live", "generation", "reuse", "advantage",
                                                                 "policy_version")}
    return slots, buf.version, len(buf)


def test_a_trainer_resumes_from_an_older_tagged_step(tmp_path):
    """The repro: the trainer's newest checkpoint is step 5, the buffer's LATEST is ahead (version
    9). Restoring the buffer from LATEST failed with "policy_version must not go backwards"."""
    uri = f"file://{tmp_path}/ckpt"
    buf = tr.RolloutBuffer(256, sampler=tr.PrioritizedSampler(alpha=0.7), max_reuse=6, seed=1,
                           checkpoint=Checkpointer(uri, interval_s=0.01, keep_last=1))
    saved = {}
    for step in range(10):
        buf.add(make_batch(6, seed=step, version=step))
        buf.sample(8)
        buf.advance(step)
        if step in (3, 5):  # the trainer saves its own checkpoint at these steps
            buf.checkpoint(tag=step)
            saved[step] = fingerprint(buf)
        time.sleep(0.02)  # background publishes (keep_last=1) run between the trainer's saves
    buf.checkpoint()
    buf.checkpointer.close(final=False)  # the job dies: LATEST is at version 9
    assert read_manifest(open_store(uri))["policy_version"] == 9

    # The trainer resumes from its step-5 checkpoint, so the buffer must too.
    resumed = tr.RolloutBuffer.from_checkpoint(uri, tag=5, progress=False, checkpoint=True)
    slots, version, count = saved[5]
    assert resumed.version == version == 5 and len(resumed) == count
    for name, values in slots.items():
        assert torch.equal(getattr(resumed.slots, name), values), name
    resumed.add(make_batch(6, seed=100, version=6))  # the resumed run goes on from step 6
    resumed.sample(8)
    resumed.checkpoint(tag=6)
    assert tr.RolloutBuffer.from_checkpoint(uri, tag=3, progress=False).version == 3  # still kept
    again = tr.RolloutBuffer.from_checkpoint(uri, tag=6, progress=False)
    assert again.version == 6 and len(again) == len(resumed)
    assert read_manifest(open_store(uri))["policy_version"] == 6  # LATEST follows the resumed run
    again.close()
    resumed.close()


def test_keep_tags_bounds_tagged_manifests_and_keep_last_never_drops_a_kept_tag(tmp_path):
    uri = f"file://{tmp_path}/ckpt"
    buf = tr.RolloutBuffer(64, checkpoint=Checkpointer(uri, interval_s=3600, keep_last=1, keep_tags=2), seed=0)
    for step in range(5):
        buf.add(make_batch(4, seed=step, version=step))
        buf.checkpoint(tag=f"step-{step}")
        buf.checkpoint()  # an untagged one after each: keep_last=1 alone would drop the tagged ones
    store = open_store(uri)
    assert store.list("tags") == ["tags/step-3.json", "tags/step-4.json"]
    for step in (3, 4):
        restored = tr.RolloutBuffer.from_checkpoint(uri, tag=f"step-{step}", progress=False)
        assert restored.version == step and len(restored) == 4 * (step + 1)
        restored.close()
    with pytest.raises(tr.CheckpointError, match="no checkpoint tagged 'step-1'"):
        tr.RolloutBuffer.from_checkpoint(uri, tag="step-1", progress=False)
    assert len(store.list("manifests")) == 3  # two tagged, one newest
    buf.close()


def test_retagging_a_step_replaces_it(tmp_path):
    uri = f"file://{tmp_path}/ckpt"
    buf = tr.RolloutBuffer(64, checkpoint=Checkpointer(uri, interval_s=3600), seed=0)
    buf.add(make_batch(4, seed=0))
    buf.checkpoint(tag=7)
    buf.add(make_batch(4, seed=1))
    buf.checkpoint(tag=7)
    assert len(tr.RolloutBuffer.from_checkpoint(uri, tag=7, progress=False)) == 8
    buf.close()


@pytest.mark.parametrize("tag", ["", ".hidden", "a/b", "x" * 101, "../LATEST"])
def test_bad_tags_are_refused_before_anything_is_written(tmp_path, tag):
    uri = f"file://{tmp_path}/ckpt"
    buf = tr.RolloutBuffer(16, checkpoint=Checkpointer(uri, interval_s=3600), seed=0)
    buf.add(make_batch(2, seed=0))
    with pytest.raises(ValueError, match="tag"):
        buf.checkpoint(tag=tag)
    with pytest.raises(TypeError, match="tag"):
        buf.checkpoint(tag=1.5)
    assert open_store(uri).list("manifests") == []
    buf.close()


# ------------------------------------------------------------------------------- SIGKILL
def run_tagging_child(uri: str, spill: str, seed: int, kill_after_s: float) -> list[int]:
    """The crash child in tag mode: it tags every 2nd step and prints each tag once durable.
    Returns the tags it reported before it was killed."""
    child = subprocess.Popen([sys.executable, os.path.join(HERE, "crash_child.py"), uri, spill, str(seed), "tags"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
        time.sleep(kill_after_s)
        assert child.poll() is None, f"child died on its own: {child.stderr.read()}"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    lines = child.stdout.read().split()
    return [int(line.split("=")[1]) for line in lines if line.startswith("tagged=")]


def check_tagged_restore(uri: str, tag: int, spill: str) -> int:
    buf = tr.RolloutBuffer.from_checkpoint(uri, tag=tag, progress=False,
                                           storage=tr.TieredStorage(hot_bytes=0, spill_dir=spill, io="posix"))
    assert buf.version == tag
    live = buf.slots.live.nonzero().flatten()
    batch = buf.gather(live, count_use=False)
    for k, gid in enumerate(batch.group_id.tolist()):
        expected = rollout_batch(gid, 1, 0)
        n = expected["tokens"][0].numel()
        assert torch.equal(batch.tokens[k, :n], expected["tokens"][0]), f"tag {tag}: rollout {gid} differs"
    buf.close()
    return int(live.numel())


@pytest.mark.parametrize("trial", range(4))
def test_sigkill_during_tagged_publishes(tmp_path, trial):
    """Every tag the child reported durable restores bit-identical at its version; a tag whose
    publish was cut off either restores completely or is absent (never half there)."""
    rng = random.Random(77 + trial)
    uri = f"file://{tmp_path}/ckpt"
    reported = run_tagging_child(uri, str(tmp_path / "spill"), seed=trial, kill_after_s=rng.uniform(0.5, 2.0))
    store = open_store(uri)
    present = sorted(int(key.split("/")[1].removesuffix(".json")) for key in store.list("tags"))
    assert set(reported) <= set(present), (reported, present)
    for tag in present:
        check_tagged_restore(uri, tag, str(tmp_path / f"resume-{tag}"))
    if reported:
        assert check_tagged_restore(uri, max(reported), str(tmp_path / "resume-last")) > 0
