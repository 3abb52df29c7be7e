"""Property test of the replay contract: random call sequences against a small pure-Python model.

The model knows, per rollout (identified by a unique group_id), its version, advantage, insertion
order, use count and tokens, and applies the documented rules: staleness eviction whenever the
version moves, the staleness check of a mixed-version batch at the version its newest row brings,
capacity eviction oldest-first, the reuse cap, priority 0 for a zero advantage, IS weights under
each `weight_norm`, all-or-nothing failures. It cannot predict which rollouts a draw picks, so it
takes the draw from the buffer, checks it against the rules, and applies its consequences.

Every sequence starts from a buffer holding a few rollouts, so that version moves meet live data
even in the short sequences Hypothesis tries first; each weight_norm gets its own run. Bounded and
seeded in `make test` (20 random sequences per norm, after two explicit regressions); the `slow`
variant (`TORCHREPLAY_SLOW=1`) runs many more and longer sequences. Mutations the default run
catches (each checked by running it; in brackets, how many of its 66 examples fail):
- drawing without the per-slot reuse budgets ("rollout 0 drawn 1x, budget 0") [36];
- the insert's staleness eviction made at the pre-add version (`self.stale(t.version)` in
  Ledger.insert: an add that moves the version keeps what it made stale, len 5 where the model
  holds 1) [12, 9 of them random]; at 25 examples before this change only the slow variant did;
- the add's staleness check made at the pre-add version (`versions < self.version -
  self.max_staleness` in Ledger.check_admissible: a mixed-version batch whose newest row makes its
  oldest stale is accepted) [6, 3 random];
- IS weights normalized by the batch max under every weight_norm [9 and 10, for buffer_max and
  batch_mean], and buffer_max normalized by the drawn rows' smallest priority instead of the
  drawable ones' [9].
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import pytest
import torch
from faults import FlakyStorage
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from rollouts import make_batch

import torchreplay as tr
from torchreplay.errors import SchemaError, StorageError

CAPACITY = 12
ALPHA, BETA, EPS = 1.0, 0.5, 1e-3


@dataclass
class Rollout:
    version: int
    advantage: float
    seq: int
    tokens: list[int]
    reuse: int = 0


@dataclass
class Model:
    max_staleness: int | None
    max_reuse: int | None
    version: int = 0
    live: dict[int, Rollout] = field(default_factory=dict)
    next_id: int = 0
    next_seq: int = 0
    evicted: dict[str, int] = field(default_factory=lambda: {"staleness": 0, "reuse": 0, "capacity": 0})

    def floor(self, version: int) -> int | None:
        return None if self.max_staleness is None else version - self.max_staleness

    def move_version(self, version: int) -> None:
        self.version = max(self.version, version)
        floor = self.floor(self.version)
        if floor is not None:
            for rid in [r for r, x in self.live.items() if x.version < floor]:
                del self.live[rid]
                self.evicted["staleness"] += 1

    def insert(self, ids: list[int], versions: list[int], advantages: list[float], tokens: list[list[int]]) -> None:
        self.move_version(max(versions))
        overflow = len(self.live) + len(ids) - CAPACITY
        if overflow > 0:
            for rid in sorted(self.live, key=lambda r: self.live[r].seq)[:overflow]:
                del self.live[rid]
                self.evicted["capacity"] += 1
        for rid, v, a, t in zip(ids, versions, advantages, tokens):
            self.live[rid] = Rollout(v, a, self.next_seq, t)
            self.next_seq += 1

    def use(self, ids: list[int]) -> None:
        for rid in ids:
            if rid in self.live:
                self.live[rid].reuse += 1
        if self.max_reuse is not None:
            for rid in set(ids):
                if rid in self.live and self.live[rid].reuse >= self.max_reuse:
                    del self.live[rid]
                    self.evicted["reuse"] += 1

    def budget(self, rid: int, at_version: int) -> int:
        """How often rollout `rid` may be drawn now (0: not at all)."""
        x = self.live[rid]
        floor = self.floor(at_version)
        if x.advantage == 0 or (floor is not None and x.version < floor):
            return 0
        return 10**9 if self.max_reuse is None else self.max_reuse - x.reuse


def priority(a: float) -> float:
    return 0.0 if a == 0 else (abs(a) + EPS) ** ALPHA


def id_of(batch: tr.ReplayBatch) -> list[int]:
    return batch.group_id.tolist()


def expected_weights(model: Model, ids: list[int], at_version: int, weight_norm: str) -> torch.Tensor:
    """The documented IS weights (N P_i)^-beta of the drawn rollouts `ids`, normalized under
    `weight_norm`: by the batch's largest weight, the batch mean, or the largest weight any
    rollout drawable when the call began could have had (that is, its smallest priority)."""
    p = torch.tensor([priority(model.live[r].advantage) for r in ids], dtype=torch.float64)
    if weight_norm == "buffer_max":
        drawable = [priority(x.advantage) for r, x in model.live.items() if model.budget(r, at_version) > 0]
        return (p / min(drawable)) ** -BETA
    w = (p / p.min()) ** -BETA
    return w / w.mean() if weight_norm == "batch_mean" else w


def check_drawn(model: Model, batch: tr.ReplayBatch, rows: torch.Tensor, at_version: int, wanted: int,
                weight_norm: str) -> None:
    """Rows `rows` of `batch` were drawn from the buffer: caps, content, ages and weights."""
    ids = [id_of(batch)[i] for i in rows.tolist()]
    counts: dict[int, int] = {}
    for rid in ids:
        assert rid in model.live, f"rollout {rid} returned but not live"
        counts[rid] = counts.get(rid, 0) + 1
    for rid, c in counts.items():
        assert c <= model.budget(rid, at_version), f"rollout {rid} drawn {c}x, budget {model.budget(rid, at_version)}"
    if len(ids) < wanted:  # shorter only when nothing drawable is left
        supply = sum(min(model.budget(r, at_version), wanted) for r in model.live)
        assert supply < wanted, f"batch cut to {len(ids)} of {wanted} with {supply} draws available"
    for i, rid in zip(rows.tolist(), ids):
        x = model.live[rid]
        n = len(x.tokens)
        assert batch.tokens[i, :n].tolist() == x.tokens and int(batch.attention_mask[i].sum()) == n
        assert int(batch.age[i]) == at_version - x.version
        assert int(batch.reuse[i]) == x.reuse
    if ids and BETA:
        torch.testing.assert_close(batch.weights[rows].double(), expected_weights(model, ids, at_version, weight_norm),
                                   rtol=1e-5, atol=1e-7)


def assert_same_state(a, b, path: str = "state") -> None:
    """Deep equality of two state_dicts, key by key whatever the keys are (nan equals nan)."""
    if isinstance(a, Mapping):
        assert isinstance(b, Mapping) and set(a) == set(b), path
        for key in a:
            assert_same_state(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b) or (a.is_floating_point() and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)), path
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), path
    else:
        assert a == b, path


def check_agrees(model: Model, buf: tr.RolloutBuffer) -> None:
    t = buf.slots
    live = t.live.nonzero().flatten()
    assert len(buf) == len(model.live) == live.numel()
    ids = t.group_id[live].tolist()
    assert sorted(ids) == sorted(model.live)
    for slot, rid in zip(live.tolist(), ids):
        x = model.live[rid]
        assert int(t.reuse[slot]) == x.reuse and int(t.policy_version[slot]) == x.version
        assert float(t.advantage[slot]) == pytest.approx(x.advantage)
    m = buf.metrics()
    assert m["size"] == len(model.live) and m["policy_version"] == model.version == buf.version
    for reason, n in model.evicted.items():
        assert m[f"evicted_{reason}"] == n, reason
    if model.live:
        assert m["age_max"] == max(model.version - x.version for x in model.live.values())
    assert len(buf.slots.free) + len(buf) == CAPACITY


def fresh_batch(model: Model, n: int, version: int, zeros: int, seed: int, spread: int = 0) -> tuple[dict, list[int]]:
    """n new rollouts, the first at `version` and row i at `version - i % (spread + 1)` (>= 0)."""
    adv = torch.randn(n, generator=torch.Generator().manual_seed(seed)).clamp(-2, 2)
    adv[:zeros] = 0.0
    versions = (version - torch.arange(n) % (spread + 1)).clamp(min=0)
    batch = make_batch(n, version=versions if spread else version, seed=seed, advantage=adv)
    ids = list(range(model.next_id, model.next_id + n))
    batch["group_id"] = torch.tensor(ids)
    return batch, ids


def insert_into_model(model: Model, batch: dict, ids: list[int]) -> None:
    model.next_id += len(ids)
    versions = torch.as_tensor(batch["policy_version"]).expand(len(ids)).tolist()
    model.insert(ids, versions, batch["advantage"].tolist(), [t.tolist() for t in batch["tokens"]])


OPS = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 6), st.integers(-3, 3), st.integers(0, 6), st.integers(0, 3)),
    st.tuples(st.just("compose"), st.integers(1, 5), st.integers(0, 2), st.integers(0, 8)),
    st.tuples(st.just("sample"), st.integers(1, 10), st.booleans()),
    st.tuples(st.just("update"), st.integers(0, 3)),
    st.tuples(st.just("advance"), st.integers(0, 3)),
    st.tuples(st.just("roundtrip"),),
    st.tuples(st.just("spill_error"), st.booleans()),
)


WARM_UP = ("add", 4, 0, 0, 1)  # four rollouts at versions 0 and -1 -> 0: live data from the start


def contract_holds(max_staleness, max_reuse, weight_norm, ops):
    def build(storage=None):
        return tr.RolloutBuffer(CAPACITY, sampler=tr.PrioritizedSampler(alpha=ALPHA, beta=BETA, eps=EPS, weight_norm=weight_norm),
                                max_staleness=max_staleness, max_reuse=max_reuse, seed=0,
                                storage=storage or FlakyStorage())

    buf = build()
    model = Model(max_staleness, max_reuse)
    gen = torch.Generator().manual_seed(1)
    last_handles = None
    for step, op in enumerate([WARM_UP, *ops]):
        kind = op[0]
        if kind == "add":
            _, n, delta, zeros, spread = op
            version = max(0, model.version + delta)
            batch, ids = fresh_batch(model, n, version, zeros, seed=step, spread=spread)
            floor = model.floor(max(model.version, version))  # the batch's newest row is at `version`
            oldest = int(torch.as_tensor(batch["policy_version"]).min())
            if floor is not None and oldest < floor:
                with pytest.raises(SchemaError, match="staleness"):
                    buf.add(batch)
            else:
                last_handles = buf.add(batch)
                insert_into_model(model, batch, ids)
        elif kind == "compose":
            _, n, delta, n_replay = op
            version = model.version + delta
            batch, ids = fresh_batch(model, n, version, zeros=0, seed=step)
            at = max(model.version, version)
            out = buf.compose(batch, n_replay=n_replay, generator=gen)
            replayed = (~out.is_fresh).nonzero().flatten()
            assert bool(out.is_fresh[:n].all()) and out.weights[:n].tolist() == [1.0] * n
            check_drawn(model, out, replayed, at, n_replay, weight_norm)
            insert_into_model(model, batch, ids)
            model.use(id_of(out))
            last_handles = out.handles
        elif kind == "sample":
            _, b, truncate = op
            if not model.live:
                with pytest.raises(ValueError):
                    buf.sample(b, generator=gen)
                continue
            supply = sum(min(model.budget(r, model.version), b) for r in model.live)
            if supply < b and not truncate or supply == 0:
                state = gen.get_state()
                with pytest.raises(ValueError, match="cannot"):
                    buf.sample(b, generator=gen, if_short="raise" if not truncate else "truncate")
                assert torch.equal(gen.get_state(), state)
            else:
                out = buf.sample(b, generator=gen, if_short="truncate" if truncate else "raise")
                check_drawn(model, out, torch.arange(len(out)), model.version, b, weight_norm)
                model.use(id_of(out))
                last_handles = out.handles
        elif kind == "update" and last_handles is not None and len(last_handles):
            new = torch.linspace(-1.0, 1.0, len(last_handles)) * op[1]  # op[1] == 0: every advantage 0
            buf.update_priorities(last_handles, new)
            # Last occurrence wins for repeated handles; stale handles are ignored.
            for slot, gen_, a in zip(last_handles.slot.tolist(), last_handles.generation.tolist(), new.tolist()):
                if bool(buf.slots.live[slot]) and int(buf.slots.generation[slot]) == gen_:
                    model.live[int(buf.slots.group_id[slot])].advantage = a
        elif kind == "advance":
            buf.advance(model.version + op[1])
            model.move_version(model.version + op[1])
        elif kind == "roundtrip":
            twin = build()
            twin.load_state_dict(buf.state_dict())
            buf.close()
            buf = twin
            last_handles = None
        elif kind == "spill_error":
            before = copy.deepcopy(buf.state_dict())  # a copy: the state may share the buffer's tensors
            buf.storage.fail_next = True
            batch, _ = fresh_batch(model, 2, model.version + 1, zeros=0, seed=step)
            with pytest.raises(StorageError):
                if op[1]:
                    buf.compose(batch, n_replay=2, generator=gen)
                else:
                    buf.add(batch)
            # The whole state, the sampler's tree included: the spill error came before anything
            # was committed. (Compared whole, so no key of the state's layout is named here.)
            assert_same_state(before, buf.state_dict())
        check_agrees(model, buf)
    buf.close()


WEIGHT_NORMS = ("batch_max", "batch_mean", "buffer_max")
# Explicit examples run before the random ones, whatever seed the source's digest gives: the
# minimal sequences of the two staleness-at-the-pre-add-version mutations named in the docstring.
REGRESSIONS = [
    dict(max_staleness=0, max_reuse=None, ops=[("add", 1, 1, 0, 0)]),  # version 0 -> 1: the warm-up's rows go
    dict(max_staleness=0, max_reuse=None, ops=[("add", 2, 1, 0, 1)]),  # rows at 1 and 0: 0 is stale at 1, refused
]


def property_test(examples: int, min_ops: int, max_ops: int):
    """`examples` seeded sequences per weight_norm (a pytest parameter rather than a drawn value:
    Hypothesis drew one norm for most of a short run), after the REGRESSIONS."""
    test = given(max_staleness=st.sampled_from([None, 0, 1, 2]), max_reuse=st.sampled_from([None, 1, 2, 3]),
                 ops=st.lists(OPS, min_size=min_ops, max_size=max_ops))(contract_holds)
    for case in REGRESSIONS:
        test = example(**case)(test)
    test = settings(max_examples=examples, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])(test)
    return pytest.mark.parametrize("weight_norm", WEIGHT_NORMS)(test)


# min_ops: Hypothesis tries very short sequences first, which meet few rules.
test_random_call_sequences_keep_the_contract = property_test(examples=20, min_ops=8, max_ops=25)
test_random_call_sequences_keep_the_contract_long = pytest.mark.slow(property_test(examples=150, min_ops=1, max_ops=60))
