"""ReplayBatch is built in one place, `ReplayBatch.assembled` (issue 27 item 7), and the batches
made from others (`to`, compose's concatenation) carry every part of them."""

import ast
import dataclasses
import pathlib

import torch

import torchreplay as tr
from rollouts import make_batch

PACKAGE = pathlib.Path(tr.__file__).parent


def direct_constructions() -> list[str]:
    """Where a module calls `ReplayBatch(...)` itself instead of `ReplayBatch.assembled`."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
                if name == "ReplayBatch":
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    return found


def test_no_module_constructs_a_replay_batch_by_hand():
    """Mutation: `concat` building `ReplayBatch(data=..., ...)` again makes this fail (seen failing)."""
    assert direct_constructions() == []


def test_every_field_is_data_handles_layout_or_per_row_bookkeeping():
    """A new field must join BOOKKEEPING (moved and concatenated with the rows) or this fails."""
    names = {f.name for f in dataclasses.fields(tr.ReplayBatch)}
    assert names == {"data", "handles", "token_fields", "pad_token_id", *tr.ReplayBatch.BOOKKEEPING}


def test_compose_concatenates_every_part_of_the_fresh_and_replayed_batches():
    """Mutation: `concat` taking `reuse` (or any bookkeeping column) from the first part only
    makes the lengths or values differ here (seen failing)."""
    buf = tr.RolloutBuffer(capacity=64, max_reuse=8, pad_token_id=7)
    buf.add(make_batch(16, seed=1))
    buf.sample(6, generator=torch.Generator().manual_seed(0))  # some rollouts now have a reuse count
    fresh, before = make_batch(4, seed=2), buf.slots.reuse.clone()
    out = buf.compose(fresh, n_replay=5, generator=torch.Generator().manual_seed(1))
    assert len(out) == 9 and len(out.handles) == 9 and out.tokens.shape[0] == 9
    for name in tr.ReplayBatch.BOOKKEEPING:
        assert getattr(out, name).shape == (9,), name
    assert out.is_fresh.tolist() == [True] * 4 + [False] * 5
    assert out.reuse[:4].tolist() == [0] * 4 and out.age[:4].tolist() == [0] * 4
    assert out.reuse[4:].tolist() == before[out.handles.slot[4:]].tolist()
    assert out.reuse[4:].sum() > 0 and out.age[4:].tolist() == [0] * 5  # all rollouts were made at version 0
    assert out.pad_token_id == 7 and "tokens" in out.token_fields and "reward" not in out.token_fields
    for i, row in enumerate(fresh["tokens"]):  # the fresh part, unchanged by re-padding to the wider width
        assert out.tokens[i, out.attention_mask[i]].tolist() == row.tolist()

    moved = out.to("cpu")
    for field in dataclasses.fields(tr.ReplayBatch):
        a, b = getattr(out, field.name), getattr(moved, field.name)
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), field.name
        elif isinstance(a, dict):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), field.name
        else:
            assert a == b, field.name
