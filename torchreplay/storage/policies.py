"""Hot-tier policies: which hot (or device) copies a tier over its budget drops first."""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Protocol


class HotPolicy(Protocol):
    """Decides which hot copies to drop first when the hot tier is over budget."""

    def added(self, shard_id: int) -> None: ...

    def touched(self, shard_id: int) -> None: ...

    def removed(self, shard_id: int) -> None: ...

    def drop_order(self) -> Iterable[int]: ...


class LRUPolicy:
    """Drop the least recently sampled (or added) shard first."""

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def added(self, shard_id: int) -> None:
        self._order[shard_id] = None

    def touched(self, shard_id: int) -> None:
        if shard_id in self._order:
            self._order.move_to_end(shard_id)

    def removed(self, shard_id: int) -> None:
        self._order.pop(shard_id, None)

    def drop_order(self) -> Iterable[int]:
        return list(self._order)


class NewestFirstPolicy(LRUPolicy):
    """Keep the most recently added shards hot, whatever was sampled: fresh data is what an
    on-policy-leaning sampler reads most."""

    def touched(self, shard_id: int) -> None:
        pass


POLICIES = {"lru": LRUPolicy, "newest": NewestFirstPolicy}


def make_policy(policy: str | HotPolicy, name: str) -> HotPolicy:
    """A policy from its name, or a HotPolicy object checked for its methods; `name` is the
    argument's, for the error."""
    if isinstance(policy, str):
        if policy not in POLICIES:
            raise ValueError(f"{name} must be one of {sorted(POLICIES)} or a HotPolicy, got {policy!r}")
        return POLICIES[policy]()
    missing = [m for m in ("added", "touched", "removed", "drop_order") if not callable(getattr(policy, m, None))]
    if missing:
        raise TypeError(f"{name} must be a policy name or a HotPolicy; {type(policy).__name__} lacks {missing}")
    return policy
