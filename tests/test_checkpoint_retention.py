"""Retention as a pure planner (torchreplay/checkpoint/retention.py): what a publish deletes, from
listings, tag pointers and manifest references alone, with no store. The end-to-end behaviour
through a Checkpointer is in test_checkpoint_tags.py and test_checkpoint_robustness.py."""

import json
import random

import pytest

import torchreplay as tr
from torchreplay.checkpoint import Checkpointer, open_store, read_manifest
from torchreplay.checkpoint import manifest as mf
from torchreplay.checkpoint.retention import Listing, RetentionPolicy, plan, retained_manifests
from rollouts import make_batch


def m(seq: int) -> str:
    return mf.manifest_key(seq)


def refs_for(seqs, shards_of=lambda seq: {f"shards/s-{seq:010d}.trs"}) -> dict:
    return {m(seq): mf.ManifestRefs(frozenset(shards_of(seq)), frozenset(mf.state_keys(seq))) for seq in seqs}


def tag(seq: int) -> dict:
    return {"manifest": m(seq), "sequence": seq, "policy_version": seq}


def listing(seqs, shards=(), states=None) -> Listing:
    states = [k for seq in seqs for k in mf.state_keys(seq)] if states is None else states
    return Listing([m(seq) for seq in seqs], sorted(shards), sorted(states))


def test_keep_last_counts_untagged_manifests_and_the_newest_always_stays():
    """Mutation: retained_manifests without `| set(manifests[-1:])` (the newest, here tagged with
    its tag dropped, would go: LATEST would name a deleted manifest) fails the second case."""
    seqs = range(6)
    tags = {"tags/a.json": tag(1)}
    keep = retained_manifests([m(s) for s in seqs], tags, RetentionPolicy(keep_last=2))
    assert keep == {m(1), m(4), m(5)}  # two newest untagged, plus the tagged one
    # The newest manifest is tagged, its tag past keep_tags: not untagged, not retained-tagged,
    # yet it is what LATEST names.
    tags = {"tags/new.json": tag(5), "tags/newer.json": {**tag(3), "sequence": 9}}
    keep = retained_manifests([m(s) for s in seqs], tags, RetentionPolicy(keep_last=1, keep_tags=1))
    assert keep == {m(3), m(4), m(5)}


def test_plan_deletes_what_no_retained_manifest_names_keeping_live_shards():
    """Mutation: plan() without `set(live_shards)` (a shard sealed after the newest manifest is
    deleted before the next manifest names it) fails the `live` assertion."""
    seqs = [0, 1, 2]
    shard_keys = [f"shards/s-{i:010d}.trs" for i in range(4)]  # 3 named by manifest 3, never published
    refs = refs_for([1, 2])
    deletions = plan(listing(seqs, shard_keys), {}, refs, live_shards={shard_keys[3]},
                     policy=RetentionPolicy(keep_last=2))
    assert deletions.manifests == [m(0)]
    assert deletions.states == sorted(mf.state_keys(0))
    assert deletions.shards == [shard_keys[0]]
    assert shard_keys[3] not in deletions.shards, "live"
    assert deletions.tags == []


def test_keep_tags_drops_the_oldest_tag_objects_and_their_manifests():
    """Mutation: `by_age` sorted oldest first (reverse=False) keeps the old tags and deletes the
    newest ones instead."""
    tags = {f"tags/t{seq}.json": tag(seq) for seq in (0, 2, 4)}
    policy = RetentionPolicy(keep_last=1, keep_tags=2)
    seqs = range(6)
    keep = retained_manifests([m(s) for s in seqs], tags, policy)
    assert keep == {m(2), m(4), m(5)}
    deletions = plan(listing(seqs), tags, refs_for(sorted(int(k[10:22]) for k in keep)), (), policy)
    assert deletions.tags == ["tags/t0.json"]
    assert deletions.manifests == [m(0), m(1), m(3)]
    # keep_tags=None keeps every tag object.
    assert plan(listing(seqs), tags, refs_for([0, 2, 4, 5]), (), RetentionPolicy(keep_last=1)).tags == []


def test_a_pointer_that_is_not_a_tag_keeps_nothing_and_is_not_deleted():
    """An object under tags/ that is not a pointer ({}), or one whose sequence is not an int,
    never breaks the plan. Found while moving this code: a pointer with a string sequence made
    the old in-Checkpointer sort raise TypeError, which failed a publish that was already durable
    (test_checkpoint_retention::test_a_tag_with_a_junk_sequence_does_not_fail_the_publish)."""
    tags = {"tags/junk.json": {}, "tags/odd.json": {"manifest": m(0), "sequence": "x"}, "tags/t3.json": tag(3)}
    policy = RetentionPolicy(keep_last=1, keep_tags=1)
    keep = retained_manifests([m(s) for s in range(5)], tags, policy)
    assert keep == {m(3), m(4)}
    deletions = plan(listing(range(5)), tags, refs_for([3, 4]), (), policy)
    assert deletions.tags == ["tags/odd.json"]  # the junk one is left alone
    assert deletions.manifests == [m(0), m(1), m(2)]


def test_refs_must_cover_every_retained_manifest():
    with pytest.raises(KeyError):
        plan(listing([0, 1]), {}, refs_for([1]), (), RetentionPolicy(keep_last=2))


@pytest.mark.parametrize("kwargs, field", [({"keep_last": 0}, "keep_last"), ({"keep_last": True}, "keep_last"),
                                          ({"keep_tags": 0}, "keep_tags"), ({"keep_tags": 1.0}, "keep_tags")])
def test_policy_refuses_bad_counts(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RetentionPolicy(**kwargs)


def test_random_plans_keep_every_object_a_retained_manifest_needs():
    """Invariants over 300 random stores (seed 0): the newest manifest, the newest `keep_last`
    untagged ones and every retained tag's manifest stay; nothing a kept manifest names, and no
    live shard, is deleted; everything else in the listing is. Shards are shared between manifests
    (a shard lives across several publishes), as in a real run."""
    rng = random.Random(0)
    for _ in range(300):
        seqs = sorted(rng.sample(range(30), rng.randint(1, 12)))
        shards_of = {seq: {f"shards/s-{i:010d}.trs" for i in range(seq, seq + rng.randint(1, 4))} for seq in seqs}
        tagged = rng.sample(seqs, rng.randint(0, len(seqs)))
        tags = {f"tags/t{seq}.json": tag(seq) for seq in tagged}
        policy = RetentionPolicy(keep_last=rng.randint(1, 4), keep_tags=rng.choice([None, 1, 2, 3]))
        keep = retained_manifests([m(s) for s in seqs], tags, policy)
        live = {f"shards/s-{i:010d}.trs" for i in rng.sample(range(40), 3)}
        all_shards = sorted(set().union(*shards_of.values()) | live | {"shards/orphan.trs"})
        deletions = plan(listing(seqs, all_shards), tags, refs_for(seqs, shards_of.__getitem__), live, policy)
        untagged = [s for s in seqs if s not in tagged]
        kept_tags = sorted(tagged, reverse=True)[: policy.keep_tags]
        assert m(seqs[-1]) in keep
        assert {m(s) for s in untagged[-policy.keep_last :]} <= keep
        assert {m(s) for s in kept_tags} <= keep
        kept_seqs = [s for s in seqs if m(s) in keep]
        needed = set().union(*(shards_of[s] for s in kept_seqs)) | live
        assert set(deletions.shards) == set(all_shards) - needed
        assert set(deletions.manifests) == {m(s) for s in seqs} - keep
        assert set(deletions.states) == {k for s in seqs if m(s) not in keep for k in mf.state_keys(s)}
        assert set(deletions.tags) == {f"tags/t{s}.json" for s in tagged if s not in kept_tags}


def test_a_tag_with_a_junk_sequence_does_not_fail_the_publish(tmp_path):
    """A tag object whose sequence is not a number (another writer's, damaged) neither fails a
    publish that is already durable nor stops retention. Failed before the planner: the sort of
    int and str sequences raised TypeError out of the publish."""
    uri = f"file://{tmp_path}/ckpt"
    buf = tr.RolloutBuffer(64, checkpoint=Checkpointer(uri, interval_s=3600, keep_last=1, keep_tags=1), seed=0)
    buf.add(make_batch(4, seed=1))
    buf.checkpoint(tag=1)
    store = open_store(uri)
    store.put("tags/odd.json", json.dumps({"manifest": m(0), "sequence": "x"}).encode())
    buf.add(make_batch(4, seed=2))
    buf.checkpoint(tag=2)  # raised CheckpointError (TypeError inside) before
    buf.add(make_batch(4, seed=3))
    buf.checkpoint()
    buf.close()
    assert read_manifest(store, tag=2)["rollouts"] == 8
    # Retention went on (keep_tags=1, keep_last=1): the odd tag sorts oldest and goes with tag 1.
    assert store.list("tags") == ["tags/2.json"]
    assert store.list("manifests") == [m(1), m(3)]
