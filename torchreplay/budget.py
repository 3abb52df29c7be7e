"""Token budgets: draws sized in stored tokens instead of rows.

`sample(max_tokens=M)` returns as many rollouts as fit in M stored tokens (a rollout's stored
length: prompt + response, what a padded batch's `attention_mask.sum(1)` counts), and
`compose(fresh, max_tokens=M)` fills what the fresh rows leave of M with replayed ones.

The draw is a sequence of blocks, each an ordinary stratified draw of the sampler (under the reuse
budgets, as `Ledger.draw` makes them) of as many rows as are *sure* to fit in the room left,
whatever rows the block brings: the worst case is the longest drawable rollouts, each as often as
its reuse budget allows. It ends when not even one more row is sure to fit, so the room left
unused is less than the longest drawable rollout. Every block's size is decided from the rows
before it, never from its own, so given the past a block of b rows holds slot i b * P(i) times on
average, and by Wald's identity slot i's expected count in the whole batch is E[rows] * P(i): the
proportions the sampler's IS weights correct, exactly as for a fixed-size draw. Taking a row
because it happens to fit (a greedy fill) would favour short rollouts. Rollouts longer than the
whole room can never be in the batch and are not drawable in that call. docs/concepts.md,
"Token budgets", states this with the tests that check it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from torchreplay.checks import check_int
from torchreplay.ledger import Ledger, replay_count
from torchreplay.samplers import ProportionalSampler
from torchreplay.slots import LIMIT
from torchreplay.storage import TieredStorage

MAX_TOKENS = 2**40  # 8 TiB of int64 token ids: past any batch, and the worst-case sums below stay in int64
_CHUNK = 2**20  # worst-case prefix sums are taken this many rollouts at a time (each chunk's sum < 2**62)


@dataclass(frozen=True)
class TokenBudget:
    """A draw's size in stored tokens (from `draw_size` or `replay_size`); a row count is an int."""

    tokens: int

    def __bool__(self) -> bool:  # no room is nothing to draw, as a count of 0 is
        return self.tokens > 0

    def __str__(self) -> str:  # "cannot fill {size} replayed rows"
        return f"{self.tokens} tokens of"


def check_max_tokens(max_tokens: object) -> int:
    return check_int(max_tokens, "max_tokens", low=1, high=MAX_TOKENS)


def draw_size(batch_size: object, max_tokens: object) -> int | TokenBudget:
    """What `sample` asks for: `batch_size` rows or `max_tokens` tokens, exactly one of them
    (ValueError otherwise; TypeError for a value that is not an int)."""
    if (batch_size is None) == (max_tokens is None):
        raise ValueError(f"sample needs exactly one of batch_size and max_tokens, got batch_size={batch_size!r} "
                         f"and max_tokens={max_tokens!r}")
    if max_tokens is not None:
        return TokenBudget(check_max_tokens(max_tokens))
    return check_int(batch_size, "batch_size", low=1)


def replay_size(n_fresh: int, fresh_tokens: int, replay_ratio: float | None, n_replay: int | None,
                multiple_of: int | None, max_tokens: int | None) -> int | TokenBudget:
    """What `compose` replays: a row count (`ledger.replay_count`) or, with `max_tokens`, the room
    the fresh rows leave. Fresh rows are never dropped: fresh rows holding more than `max_tokens`
    tokens are a ValueError (and `fresh` is not added)."""
    if max_tokens is None:
        return replay_count(n_fresh, replay_ratio, n_replay, multiple_of)
    check_max_tokens(max_tokens)
    if replay_ratio is not None or n_replay is not None or multiple_of is not None:
        raise ValueError("max_tokens sizes the batch by tokens: pass it without replay_ratio, n_replay and multiple_of")
    if fresh_tokens > max_tokens:
        raise ValueError(f"max_tokens={max_tokens}: the {n_fresh} fresh rollouts alone hold {fresh_tokens} tokens; "
                         "compose never drops fresh rollouts (nothing was added)")
    return TokenBudget(max_tokens - fresh_tokens)


def check_replayed(size: int | TokenBudget, n_replayed: int | None, n_fresh: int, multiple: int,
                   if_short: str) -> None:
    """ValueError unless `compose` may return its replayed part (`n_replayed` rows; None: nothing
    was drawable): under if_short='raise' something was, and the whole batch is a multiple of `multiple`."""
    if size and n_replayed is None and if_short == "raise":
        raise ValueError(f"cannot fill {size} replayed rows: nothing drawable in the buffer")
    if (n_fresh + (n_replayed or 0)) % multiple:
        raise ValueError(f"cannot make a batch that is a multiple of {multiple}: {n_fresh} fresh rollouts "
                         f"and only {n_replayed or 0} replayable")


def draw(ledger: Ledger, storage: TieredStorage, size: int | TokenBudget, generator: torch.Generator,
         excluded: torch.Tensor, if_short: str, n_fresh: int = 0,
         multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """`size` rows (`Ledger.draw`) or a token budget's worth (`draw_tokens`): (slots, IS weights)."""
    if isinstance(size, TokenBudget):
        return draw_tokens(ledger, storage, size.tokens, generator, excluded, if_short)
    return ledger.draw(size, generator, excluded, if_short, n_fresh, multiple)


def sure_to_fit(lengths: torch.Tensor, budgets: torch.Tensor, room: int) -> int:
    """The most rows a draw may return that fit in `room` tokens whatever they are: the worst case
    takes the longest rollouts first, each as often as its budget allows. `lengths` descending
    (each >= 1), `budgets` the matching reuse budgets (>= 1)."""
    # One copy past room // length is enough to end the count inside that rollout's run (a
    # rollout longer than the room ends it at 0 rows), and keeps every run's tokens under
    # 2 * room, so the prefix sums stay in int64.
    copies = torch.minimum(budgets, room // lengths + 1)
    fit, before = 0, 0
    for start in range(0, lengths.numel(), _CHUNK):
        tokens = (lengths[start:start + _CHUNK] * copies[start:start + _CHUNK])
        after = before + torch.cumsum(tokens, 0)
        full = int((after <= room).sum())  # whole runs of copies that fit (after is increasing)
        fit += int(copies[start:start + full].sum())
        if full < tokens.numel():  # the next rollout's run fits only in part
            spent = before if full == 0 else int(after[full - 1])
            return fit + (room - spent) // int(lengths[start + full])
        before = int(after[-1])
    return fit


def draw_tokens(ledger: Ledger, storage: TieredStorage, room: int, generator: torch.Generator,
                excluded: torch.Tensor, if_short: str) -> tuple[torch.Tensor, torch.Tensor]:
    """As many rows as the rule in the module docstring takes from `room` tokens, under every reuse
    budget, `excluded` slots never drawn. A short draw (the caps ran out of rollouts before the
    rule stopped) raises ValueError with if_short='raise'. All-or-nothing on the generator."""
    state = generator.get_state()
    try:
        slots, weights, short = _draw_blocks(ledger, storage, room, generator, excluded)
        if short and if_short == "raise":
            raise ValueError(f"cannot fill max_tokens={room}: the caps ran out of rollouts after {slots.numel()} "
                             f"(live rollouts {ledger.slots.count}, non-zero priority and reuse budget left); "
                             "pass if_short='truncate' for a shorter batch")
    except BaseException:
        generator.set_state(state)
        raise
    return slots, weights


def _draw_blocks(ledger: Ledger, storage: TieredStorage, room: int, generator: torch.Generator,
                 excluded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    table, sampler = ledger.slots, ledger.sampler
    budget = ledger.remaining(excluded)
    if budget is None:
        budget = torch.where(table.live, LIMIT, 0)
    candidates = (budget > 0).nonzero().flatten()
    lengths = storage.row_lengths(table.shard[candidates], table.row[candidates])
    budget[candidates[lengths > room]] = 0  # longer than the whole room: never in this batch
    fits = lengths <= room
    order = torch.argsort(lengths[fits], descending=True, stable=True)
    candidates, lengths = candidates[fits][order], lengths[fits][order]
    length_of = torch.zeros(ledger.capacity, dtype=torch.int64)
    length_of[candidates] = lengths
    proportional = isinstance(sampler, ProportionalSampler) and sampler.proportional
    slots_drawn, values, smallest, short = [], [], math.nan, False
    while (n := sure_to_fit(lengths, budget[candidates], room)) > 0:
        if proportional:  # priorities now, IS weights once for the whole batch (batch_* norms)
            slots, block_values, block_min = sampler.draw(n, generator, budget)
            smallest = block_min if not slots_drawn else smallest  # the first block saw every drawable rollout
        else:  # a sampler outside the protocol weighs each block its own way
            slots, block_values = sampler.sample(n, generator, budget)
        slots_drawn.append(slots)
        values.append(block_values)
        budget.index_add_(0, slots, -torch.ones_like(slots))
        room -= int(length_of[slots].sum())
        keep = budget[candidates] > 0
        candidates, lengths = candidates[keep], lengths[keep]
        if slots.numel() < n:
            short = True
            break
    short = short or candidates.numel() == 0  # the caps, not the room, ended the draw
    if not slots_drawn:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.float32), short
    slots = torch.cat(slots_drawn)
    weights = sampler.is_weights(torch.cat(values), smallest) if proportional else torch.cat(values)
    return slots, weights.to(torch.float32), short
