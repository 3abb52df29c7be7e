"""Conversions between the [B, T] padded layout trainers use and the buffer's ragged rollouts.

TRL and verl hold a batch as left-padded prompt ids and right-padded completion ids, each with an
int (or bool) mask, and keep per-token values (log-probs, advantages) over the completion only.
`from_padded` turns that into the ragged batch `RolloutBuffer.add`/`compose` take; `split_padded`
(behind `ReplayBatch.split`) turns a sampled batch back into it, so a rollout that goes in comes
out with the same tokens, masks and completion-aligned values (a full-width field comes back
completion-aligned; its prompt part stays in `batch.data`).

Rules, so that the round trip is exact:
- a prompt mask must be one run of 1s (after the left padding, or before the right padding); the
  prompt is the tokens under it;
- a completion keeps every position up to its mask's last 1; 0s inside that span (e.g. tool
  output a trainer does not train on) stay in the stored `response_mask`, trailing 0s are padding;
  unless `completion_extent` says which positions are the completion's tokens (verl's layout: its
  attention mask is the extent, its response_mask the training mask, which may end earlier);
- a per-token field may be completion-aligned ([B, Tc, ...], 0 is stored over the prompt, as
  `add` requires for `logprobs`) or span prompt + completion ([B, Tp + Tc, ...]).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from torchreplay.checks import is_int
from torchreplay.storage.reads import ranges

SIDES = ("left", "right")
# The layout keys `split_padded` gives back; a field of one of these names would be overwritten.
SPLIT_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "completion_extent")
# Rollout-level fields `from_padded` fills itself; everything else in **fields passes through.
_ROLLOUT_ARGS = ("advantage", "group_id", "policy_version", "reward")


def _mask(name: str, mask: Any, shape: torch.Size) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(mask).__name__}")
    if mask.shape != shape:
        raise ValueError(f"{name}: shape {tuple(mask.shape)} does not match its ids' shape {tuple(shape)}")
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise TypeError(f"{name}: expected an int or bool mask, got dtype {mask.dtype}")
    if mask.dtype != torch.bool:
        if mask.numel() and not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError(f"{name}: an int mask must hold only 0 and 1")
        mask = mask != 0
    return mask.cpu()


def _ids(name: str, ids: Any) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name}: expected a [B, T] tensor, got {type(ids).__name__}")
    if ids.dim() != 2:
        raise ValueError(f"{name}: expected a [B, T] tensor, got shape {tuple(ids.shape)}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"{name}: expected integer token ids, got dtype {ids.dtype}")
    return ids.cpu()


def _first_bad(bad: torch.Tensor) -> int:
    return int(bad.nonzero()[0, 0])


def _gather_rows(x: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
    """x[i, starts[i] : starts[i] + lengths[i]] for each row, laid end to end."""
    cols = torch.arange(width)
    keep = cols.unsqueeze(0) < lengths.unsqueeze(1)
    index = (starts.unsqueeze(1) + cols.unsqueeze(0)).clamp(max=max(x.shape[1] - 1, 0))
    rows = torch.arange(x.shape[0]).unsqueeze(1).expand_as(index)
    return x[rows[keep], index[keep]]


def _extent_lengths(extent: Any, completion_mask: torch.Tensor) -> torch.Tensor:
    """Each row's completion length from its extent mask, a run of 1s from column 0 that covers
    every 1 of the training mask."""
    extent = _mask("completion_extent", extent, completion_mask.shape)
    lengths = extent.sum(1)
    prefix = torch.arange(extent.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
    if not bool((extent == prefix).all()):
        i = _first_bad((extent != prefix).any(1))
        raise ValueError(f"completion_extent, row {i}: must be one run of 1s from the first column")
    outside = (completion_mask & ~extent).any(1)
    if bool(outside.any()):
        raise ValueError(f"completion_mask, row {_first_bad(outside)}: 1 outside completion_extent")
    return lengths


def from_padded(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                completion_mask: torch.Tensor, logprobs: torch.Tensor, *, advantage: Any, group_id: Any,
                policy_version: Any, reward: Any = None, prompt_side: str = "left",
                completion_extent: torch.Tensor | None = None, **fields: Any) -> dict[str, Any]:
    """A ragged rollout batch for `RolloutBuffer.add`/`compose` from a padded one.

    `prompt_ids`/`prompt_mask` [B, Tp] (padded on `prompt_side`), `completion_ids`/
    `completion_mask` [B, Tc] (right-padded), masks int or bool; `logprobs`: the behaviour
    log-probs, [B, Tc] or [B, Tp + Tc]. `advantage`, `group_id`, `reward` (optional) are [B];
    `policy_version` an int or [B]. `completion_extent` [B, Tc] (int or bool, one run of 1s from
    column 0): the completion's tokens, when they run past the training mask's last 1;
    `completion_mask` must be 0 outside it. Other `fields` are declared extra fields: [B, ...]
    rollout fields pass through, and a [B, Tc, ...] or [B, Tp + Tc, ...] tensor is taken as a token
    field. Raises ValueError/TypeError naming the argument."""
    if prompt_side not in SIDES:
        raise ValueError(f"prompt_side must be 'left' or 'right', got {prompt_side!r}")
    prompt_ids, completion_ids = _ids("prompt_ids", prompt_ids), _ids("completion_ids", completion_ids)
    if prompt_ids.shape[0] != completion_ids.shape[0]:
        raise ValueError(f"completion_ids: {completion_ids.shape[0]} rows, prompt_ids has {prompt_ids.shape[0]}")
    prompt_mask = _mask("prompt_mask", prompt_mask, prompt_ids.shape)
    completion_mask = _mask("completion_mask", completion_mask, completion_ids.shape)
    n, tp = prompt_ids.shape
    tc = completion_ids.shape[1]

    prompt_len = prompt_mask.sum(1)
    # One run of 1s: the run's start (first 1) plus its length must reach the side's edge.
    first = torch.where(prompt_len > 0, prompt_mask.int().argmax(1), torch.full_like(prompt_len, tp))
    if prompt_side == "left":
        contiguous = first + prompt_len == tp
    else:
        contiguous = (first == 0) | (prompt_len == 0)
    if not bool(contiguous.all()):
        i = _first_bad(~contiguous)
        raise ValueError(f"prompt_mask, row {i}: must be one run of 1s padded on the {prompt_side}")
    prompt_start = first if prompt_side == "left" else torch.zeros_like(first)
    if completion_extent is None:  # a completion runs to its mask's last 1; later positions are padding
        last = torch.where(completion_mask.any(1), tc - 1 - completion_mask.flip(1).int().argmax(1), -1)
        completion_len = last + 1
    else:
        completion_len = _extent_lengths(completion_extent, completion_mask)
    lengths = prompt_len + completion_len
    if bool((lengths == 0).any()):
        raise ValueError(f"prompt_mask/{'completion_mask' if completion_extent is None else 'completion_extent'}, "
                         f"row {_first_bad(lengths == 0)}: the rollout has no token")

    def ragged(prompt_part: torch.Tensor | None, completion_part: torch.Tensor) -> dict[str, torch.Tensor]:
        """Row i: its prompt positions (or zeros), then its completion positions, packed."""
        completion_rows = _gather_rows(completion_part, torch.zeros(n, dtype=torch.int64), completion_len, tc)
        if prompt_part is None:
            prompt_rows = torch.zeros((int(prompt_len.sum()), *completion_part.shape[2:]), dtype=completion_part.dtype)
        else:
            prompt_rows = _gather_rows(prompt_part, prompt_start, prompt_len, tp)
        # Interleave per row: positions [offset_i, offset_i + plen_i) are prompt, then completion.
        offsets = torch.zeros(n + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        values = torch.empty((int(offsets[-1]), *completion_part.shape[2:]), dtype=completion_part.dtype)
        prompt_ends = offsets[:-1] + prompt_len
        values[ranges(offsets[:-1], prompt_ends)] = prompt_rows
        values[ranges(prompt_ends, offsets[1:])] = completion_rows
        return {"values": values, "offsets": offsets}

    def token_field(name: str, value: Any) -> dict[str, torch.Tensor]:
        if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[0] != n:
            raise ValueError(f"{name}: expected a [B, T, ...] tensor with B = {n}")
        value = value.detach().cpu()
        if value.shape[1] == tc:
            return ragged(None, value)
        if value.shape[1] == tp + tc:
            return ragged(value[:, :tp], value[:, tp:])
        raise ValueError(f"{name}: width {value.shape[1]} is neither the completion's ({tc}) nor prompt + "
                         f"completion ({tp + tc})")

    if not isinstance(logprobs, torch.Tensor):
        raise TypeError(f"logprobs: expected a [B, Tc] tensor of behaviour log-probs, got {type(logprobs).__name__}")
    batch: dict[str, Any] = {
        "tokens": ragged(prompt_ids, completion_ids),
        "response_mask": ragged(torch.zeros_like(prompt_mask), completion_mask),
        "logprobs": token_field("logprobs", logprobs),
        "prompt_len": prompt_len,
        "advantage": advantage,
        "group_id": group_id,
        "policy_version": policy_version,
    }
    if reward is not None:
        batch["reward"] = reward
    for name, value in fields.items():
        if name in batch or name in _ROLLOUT_ARGS:
            raise ValueError(f"{name}: given twice")
        is_token = isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] in (tc, tp + tc)
        batch[name] = token_field(name, value) if is_token else value
    return batch


def _widths(widths: Any) -> tuple[int, int]:
    if not (isinstance(widths, tuple) and len(widths) == 2
            and all(is_int(w) and w >= 0 for w in widths)):
        raise ValueError(f"widths: expected (prompt width, completion width) as two ints >= 0, got {widths!r}")
    return widths


def split_padded(data: Mapping[str, torch.Tensor], token_fields: tuple[str, ...], pad_token_id: int,
                 prompt_side: str = "left", *, widths: tuple[int, int] | None = None,
                 full_width: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """The padded trainer layout of a sampled batch (see `ReplayBatch.split`), plus
    `completion_extent` [B, Tc] (int64): 1 on each completion's tokens, of which `completion_mask`
    marks the trained ones. `widths`: the (Tp, Tc) to pad to instead of the batch's widest prompt
    and completion (ValueError naming the first row that does not fit). `full_width`: token fields
    given back over prompt + completion, [B, Tp + Tc, ...], their prompt part laid out like
    `prompt_ids`, instead of completion-aligned."""
    if prompt_side not in SIDES:
        raise ValueError(f"prompt_side must be 'left' or 'right', got {prompt_side!r}")
    for name in full_width:
        if name not in token_fields or name not in data:
            raise ValueError(f"full_width: {name!r} is not a token field of the batch")
    for name in data:
        if name in SPLIT_KEYS:
            raise ValueError(f"field {name!r} has the name of a layout key split gives back; rename the field")
    valid = data["attention_mask"]
    n, width = valid.shape
    lengths = valid.sum(1)
    # Sampled rows are contiguous: the first valid position is where the rollout starts.
    starts = torch.where(lengths > 0, valid.int().argmax(1), torch.zeros_like(lengths))
    prompt_len = data["prompt_len"].to(lengths.device)
    completion_len = lengths - prompt_len
    tp = int(prompt_len.max()) if n else 0
    tc = int(completion_len.max()) if n else 0
    if widths is not None:
        tp, tc = _widths(widths)
        for part, count, room in (("prompt", prompt_len, tp), ("completion", completion_len, tc)):
            if bool((count > room).any()):
                i = _first_bad(count > room)
                raise ValueError(f"widths: row {i} has {int(count[i])} {part} tokens, more than {room}")
    cols_p, cols_c = torch.arange(tp, device=valid.device), torch.arange(tc, device=valid.device)
    if prompt_side == "left":
        prompt_keep = cols_p.unsqueeze(0) >= (tp - prompt_len).unsqueeze(1)
        prompt_src = starts.unsqueeze(1) + cols_p.unsqueeze(0) - (tp - prompt_len).unsqueeze(1)
    else:
        prompt_keep = cols_p.unsqueeze(0) < prompt_len.unsqueeze(1)
        prompt_src = starts.unsqueeze(1) + cols_p.unsqueeze(0)
    completion_keep = cols_c.unsqueeze(0) < completion_len.unsqueeze(1)
    completion_src = (starts + prompt_len).unsqueeze(1) + cols_c.unsqueeze(0)

    def take(x: torch.Tensor, src: torch.Tensor, keep: torch.Tensor, fill: int | float) -> torch.Tensor:
        index = src.clamp(0, max(width - 1, 0))
        index = index.reshape(*index.shape, *([1] * (x.dim() - 2))).expand(*index.shape, *x.shape[2:])
        out = torch.gather(x, 1, index) if width else x.new_zeros((n, index.shape[1], *x.shape[2:]))
        return out.masked_fill(~keep.reshape(*keep.shape, *([1] * (x.dim() - 2))), fill)

    out: dict[str, torch.Tensor] = {
        "prompt_ids": take(data["tokens"], prompt_src, prompt_keep, pad_token_id),
        "prompt_mask": prompt_keep.long(),
        "completion_ids": take(data["tokens"], completion_src, completion_keep, pad_token_id),
        "completion_mask": take(data["response_mask"], completion_src, completion_keep, False).long(),
        "completion_extent": completion_keep.long(),
    }
    for name in token_fields:
        if name in full_width:
            out[name] = torch.cat([take(data[name], prompt_src, prompt_keep, 0),
                                   take(data[name], completion_src, completion_keep, 0)], 1)
        elif name not in ("tokens", "response_mask"):
            out[name] = take(data[name], completion_src, completion_keep, 0)
    for name, value in data.items():
        if name not in out and name not in token_fields and name != "attention_mask":
            out[name] = value
    return out
