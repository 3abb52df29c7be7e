"""Which checkpoint objects may go after a publish: a pure planner. It reads no store; the
Checkpointer lists the store, reads the tags and the retained manifests, and deletes what the plan
says, tags first (so a tag never names a manifest that is gone).

The policy (`Checkpointer(keep_last=, keep_tags=)`):
- the newest manifest (what LATEST names) always stays;
- `keep_last` counts untagged manifests: the newest `keep_last` of them stay;
- a tagged manifest stays as long as its tag does; `keep_tags` (None: all) keeps the tags of the
  newest tagged manifests, and the older tag objects are deleted (their manifests then count as
  neither tagged nor untagged, and go);
- a state object stays while a retained manifest names it; a shard object stays while a retained
  manifest names it or it is live in the writing session (sealed after the newest manifest, it
  will be named by the next one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from torchreplay.checkpoint.manifest import ManifestRefs
from torchreplay.checks import check_int, is_int


@dataclass(frozen=True)
class RetentionPolicy:
    keep_last: int = 2
    keep_tags: int | None = None

    def __post_init__(self) -> None:
        check_int(self.keep_last, "keep_last", low=1, error=ValueError)
        check_int(self.keep_tags, "keep_tags (None keeps all)", low=1, allow_none=True, error=ValueError)


@dataclass(frozen=True)
class Listing:
    """The store's keys, per room, sorted as `ObjectStore.list` returns them."""

    manifests: list[str]
    shards: list[str]
    states: list[str]


@dataclass(frozen=True)
class Deletions:
    tags: list[str]  # deleted first
    manifests: list[str]
    states: list[str]
    shards: list[str]


def _sequence(pointer: Mapping[str, Any]) -> int:
    # A pointer without a usable sequence (another writer's, damaged) sorts as the oldest.
    value = pointer.get("sequence", -1)
    return value if is_int(value) else -1


def _named(pointer: Mapping[str, Any]) -> str | None:
    value = pointer.get("manifest")
    return value if isinstance(value, str) else None


def _tag_plan(tags: Mapping[str, Mapping[str, Any]], policy: RetentionPolicy) -> tuple[set[str], set[str], list[str]]:
    """Manifests the retained tags name, manifests any tag names, and the tag objects to delete.
    `tags` maps each tag object's key to its pointer ({} for one that is not a pointer: it keeps
    nothing alive and is never deleted here)."""
    by_age = sorted(tags.items(), key=lambda item: _sequence(item[1]), reverse=True)
    kept = by_age if policy.keep_tags is None else by_age[: policy.keep_tags]
    stale = [] if policy.keep_tags is None else [key for key, pointer in by_age[policy.keep_tags :] if pointer]
    retained = {_named(p) for _, p in kept} - {None}
    tagged = {_named(p) for _, p in by_age} - {None}
    return retained, tagged, stale


def retained_manifests(manifests: list[str], tags: Mapping[str, Mapping[str, Any]],
                       policy: RetentionPolicy) -> set[str]:
    """The manifests (of the sorted listing `manifests`) that stay."""
    retained_tagged, tagged, _ = _tag_plan(tags, policy)
    untagged = [key for key in manifests if key not in tagged]
    return set(untagged[-policy.keep_last :]) | (retained_tagged & set(manifests)) | set(manifests[-1:])


def plan(listing: Listing, tags: Mapping[str, Mapping[str, Any]], refs: Mapping[str, ManifestRefs],
         live_shards: Iterable[str], policy: RetentionPolicy) -> Deletions:
    """What to delete. `refs` holds the references of every manifest `retained_manifests` keeps
    (KeyError otherwise); `live_shards` are the writing session's live shard keys."""
    keep = retained_manifests(listing.manifests, tags, policy)
    needed_shards = set(live_shards)
    needed_states: set[str] = set()
    for key in keep:
        needed_shards |= refs[key].shards
        needed_states |= refs[key].states
    return Deletions(tags=_tag_plan(tags, policy)[2],
                     manifests=[key for key in listing.manifests if key not in keep],
                     states=[key for key in listing.states if key not in needed_states],
                     shards=[key for key in listing.shards if key not in needed_shards])
