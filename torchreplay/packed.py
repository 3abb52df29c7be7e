"""Packed (varlen) batches: every sampled rollout's tokens end to end, no padding.

The layout flash-attention's varlen kernels, verl's remove-padding path and padding-free trainers
consume: token fields flat [N, ...] (N = the batch's token count), `cu_seqlens` [B + 1] int32
(row i is tokens [cu_seqlens[i], cu_seqlens[i + 1])), `max_seqlen`, and `position_ids` [N]
restarting at 0 for each row; rollout fields, handles and the bookkeeping columns [B] as in a
padded `ReplayBatch`. `RolloutBuffer.sample/compose/gather(..., layout="packed")` assemble one
straight from the stored rows (`assemble_packed`: one `pack_rows` copy per field, no padding
pass); `to_packed` and `PackedReplayBatch.to_padded` convert either way, bit for bit.
(Not to be confused with `schema.PackedBatch`, the validated form rollouts are stored in.)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from torchreplay._ops import ops
from torchreplay.assembly import BatchAssembler, Handles, Plan, ReplayBatch, move_tensor, padding_mask
from torchreplay.padded import SIDES
from torchreplay.schema import TOKEN
from torchreplay.storage import Gather
from torchreplay.storage.reads import ranges

# cu_seqlens is int32, as flash-attention's varlen kernels take it.
MAX_TOKENS = 2**31 - 1


@dataclass
class PackedReplayBatch:
    """A packed training batch of B rollouts and N tokens. `data`: each token field flat [N, ...]
    (tokens, response_mask, logprobs, ref_logprobs, routing ids, declared token fields) and each
    rollout field [B, ...] (reward, advantage, group_id, policy_version, prompt_len, declared ones).
    Row i's tokens are [cu_seqlens[i], cu_seqlens[i + 1]) (int32, [B + 1]); `max_seqlen` is the
    longest row; `num_tokens` is N; `position_ids` [N] (int64) count each row's tokens from 0,
    derived from `cu_seqlens` when first read, on the batch's device (a sample does not write them:
    they would be 8 bytes a token beside the ragged fields' 13, and a trainer moving the batch to
    the GPU derives them there in microseconds). Every token is a real one, so there is no
    attention mask. Handles and the bookkeeping columns (`weights`, `age`,
    `reuse`, `is_fresh`) are [B], as in `ReplayBatch`. A declared field named `position_ids` stays
    in `data` (e.g. verl's, mrope's [N, C]); the attribute is always the restarting count."""

    data: dict[str, torch.Tensor]
    handles: Handles
    weights: torch.Tensor
    age: torch.Tensor
    reuse: torch.Tensor
    is_fresh: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    num_tokens: int
    token_fields: tuple[str, ...] = ()
    pad_token_id: int = 0  # what `to_padded` pads `tokens` with
    derived_position_ids: torch.Tensor | None = field(default=None, repr=False)  # `position_ids`, once read

    BOOKKEEPING: ClassVar[tuple[str, ...]] = ReplayBatch.BOOKKEEPING
    LAYOUT: ClassVar[tuple[str, ...]] = ("cu_seqlens",)  # the packed layout's own stored tensors

    def __getattr__(self, name: str) -> torch.Tensor:
        data = self.__dict__.get("data", {})
        if name in data:
            return data[name]
        raise AttributeError(f"PackedReplayBatch has no field {name!r}; fields: {sorted(data)}")

    def __len__(self) -> int:
        return self.weights.numel()

    @property
    def position_ids(self) -> torch.Tensor:
        """[N] int64: each row's tokens counted from 0, derived from `cu_seqlens` on its device
        at the first read, then kept."""
        if self.derived_position_ids is None:
            self.derived_position_ids = position_ids_of(self.cu_seqlens, self.num_tokens)
        return self.derived_position_ids

    @property
    def lengths(self) -> torch.Tensor:
        """Each row's token count, [B] int64."""
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()

    def row_of_token(self) -> torch.Tensor:
        """[N] int64: the row each token belongs to (to spread a rollout field over its tokens,
        `batch.advantage[batch.row_of_token()]`, or to sum per-token values per row)."""
        lengths = self.lengths
        return torch.repeat_interleave(torch.arange(len(self), device=lengths.device), lengths,
                                       output_size=self.num_tokens)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the batch holds (`position_ids` only once derived)."""
        derived = [] if self.derived_position_ids is None else [self.derived_position_ids]
        return [*self.data.values(), *(getattr(self, name) for name in (*self.BOOKKEEPING, *self.LAYOUT)), *derived]

    def to(self, device: torch.device | str) -> "PackedReplayBatch":
        """Move every tensor. From the CPU to CUDA this goes through pinned memory, non-blocking."""
        device = torch.device(device)

        move = functools.partial(move_tensor, device=device)
        derived = self.derived_position_ids
        return PackedReplayBatch(data={k: move(v) for k, v in self.data.items()}, handles=self.handles,
                                 **{name: move(getattr(self, name)) for name in (*self.BOOKKEEPING, *self.LAYOUT)},
                                 max_seqlen=self.max_seqlen, num_tokens=self.num_tokens,
                                 token_fields=self.token_fields, pad_token_id=self.pad_token_id,
                                 derived_position_ids=None if derived is None else move(derived))

    def to_padded(self, padding_side: str = "right", width: int | None = None) -> ReplayBatch:
        """The same rows as a padded `ReplayBatch` [B, T] (T = `width`, default `max_seqlen`),
        padded on `padding_side` with `pad_token_id` for tokens and 0 (False) for every other
        token field, plus `attention_mask`: bit for bit what `sample(..., layout="padded")` of a
        buffer with that padding side returns for the same rows."""
        if padding_side not in SIDES:
            raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
        if width is None:
            width = self.max_seqlen
        elif isinstance(width, bool) or not isinstance(width, int) or width < self.max_seqlen:
            raise ValueError(f"width must be an int >= max_seqlen ({self.max_seqlen}), got {width!r}")
        valid = padding_mask(self.lengths, width, padding_side)
        data: dict[str, torch.Tensor] = {}
        for name, value in self.data.items():
            if name in self.token_fields:
                fill = self.pad_token_id if name == "tokens" else 0
                out = torch.full((len(self), width, *value.shape[1:]), fill, dtype=value.dtype, device=value.device)
                out[valid] = value
                value = out
            data[name] = value
        data["attention_mask"] = valid
        return ReplayBatch.assembled(data, self.handles, **{n: getattr(self, n) for n in self.BOOKKEEPING},
                                     token_fields=self.token_fields, pad_token_id=self.pad_token_id)


def position_ids_of(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[N] int64 positions counting each row's tokens from 0."""
    starts = cu_seqlens[:-1].long()
    lengths = cu_seqlens[1:].long() - starts
    return torch.arange(num_tokens, device=cu_seqlens.device) - torch.repeat_interleave(
        starts, lengths, output_size=num_tokens)


def cu_seqlens_of(lengths: torch.Tensor) -> torch.Tensor:
    """[B + 1] int32 offsets of rows of these lengths laid end to end (ValueError past int32)."""
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, 0, out=offsets[1:])
    total = int(offsets[-1])
    if total > MAX_TOKENS:
        raise ValueError(f"a packed batch holds at most {MAX_TOKENS} tokens (int32 cu_seqlens), this one {total}")
    return offsets.to(torch.int32)


def to_packed(batch: ReplayBatch) -> PackedReplayBatch:
    """The same rows as a `PackedReplayBatch`: each row's tokens under `attention_mask` (one run
    per row, padded on either side, as every sampled batch is), bit for bit; `to_padded` with the
    batch's padding side (and width) gives `batch` back exactly."""
    if not isinstance(batch, ReplayBatch):
        raise TypeError(f"batch must be a ReplayBatch, got {type(batch).__name__}")
    valid = batch.data["attention_mask"]
    lengths = valid.sum(1)
    width = valid.shape[1]
    one_run = ((valid == padding_mask(lengths, width, "left")).all(1)
               | (valid == padding_mask(lengths, width, "right")).all(1))
    if not bool(one_run.all()):
        row = int((~one_run).nonzero()[0, 0])
        raise ValueError(f"attention_mask, row {row}: not one run of tokens padded on one side")
    cu_seqlens = cu_seqlens_of(lengths)
    num_tokens = int(cu_seqlens[-1])
    data = {name: value[valid] if name in batch.token_fields else value
            for name, value in batch.data.items() if name != "attention_mask"}
    return PackedReplayBatch(data=data, handles=batch.handles, **{n: getattr(batch, n) for n in batch.BOOKKEEPING},
                             cu_seqlens=cu_seqlens, max_seqlen=int(lengths.max()) if len(batch) else 0,
                             num_tokens=num_tokens, token_fields=batch.token_fields, pad_token_id=batch.pad_token_id)


def concat(first: PackedReplayBatch, second: PackedReplayBatch) -> PackedReplayBatch:
    """Rows of `first`, then rows of `second` (compose's fresh and replayed parts)."""
    shift = first.cu_seqlens[-1]
    cu_seqlens = torch.cat([first.cu_seqlens, second.cu_seqlens[1:] + shift])
    if int(cu_seqlens[-1]) < int(shift):  # the int32 sum wrapped
        raise ValueError(f"a packed batch holds at most {MAX_TOKENS} tokens (int32 cu_seqlens)")
    handles = Handles(torch.cat([first.handles.slot, second.handles.slot]),
                      torch.cat([first.handles.generation, second.handles.generation]))
    return PackedReplayBatch(
        data={name: torch.cat([value, second.data[name]]) for name, value in first.data.items()}, handles=handles,
        **{n: torch.cat([getattr(first, n), getattr(second, n)]) for n in PackedReplayBatch.BOOKKEEPING},
        cu_seqlens=cu_seqlens, max_seqlen=max(first.max_seqlen, second.max_seqlen),
        num_tokens=first.num_tokens + second.num_tokens,
        token_fields=first.token_fields or second.token_fields, pad_token_id=first.pad_token_id)


# ----------------------------------------------------------------------------------- assembly
def assemble_packed(assembler: BatchAssembler, plan: Plan) -> PackedReplayBatch:
    """A plan's rows as a packed batch (the assembler's "packed" layout; runs inside the plan's
    pins, on whichever thread materializes it). Host batches: one `pack_rows` copy per field from
    the gathered sources into an (optionally reused) output; device batches: see `_on_device`."""
    token_fields = [f for f in plan.fields if assembler.fields[f].kind == TOKEN]
    gather = assembler.storage.gather(plan.pinned, plan.shard_of, plan.rows, token_fields, plan.device)
    lengths = gather.lengths
    cu_seqlens = cu_seqlens_of(lengths)
    offsets = cu_seqlens.long()
    num_tokens = int(offsets[-1])
    max_seqlen = int(lengths.max()) if lengths.numel() else 0
    if plan.device is None:
        data = _on_host(assembler, plan, gather, offsets, num_tokens, token_fields)
    else:
        data = _on_device(assembler, plan.device, gather, offsets, num_tokens, token_fields)
        cu_seqlens = cu_seqlens.to(plan.device)
    data.update(assembler.rollout_data(plan, gather))
    return PackedReplayBatch(data=data, handles=Handles(plan.slots, plan.generation), weights=plan.weights,
                             age=plan.age, reuse=plan.reuse, is_fresh=plan.is_fresh, cu_seqlens=cu_seqlens,
                             max_seqlen=max_seqlen, num_tokens=num_tokens, token_fields=tuple(token_fields),
                             pad_token_id=assembler.pad_token_id)


def _field_rows(gather: Gather, name: str, spec: Any) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """The sources' values of one token field and each row's start and length in them; rows of a
    shard stored before this optional field existed get length 0 (their tokens are zeroed)."""
    values = [b.token.get(name) for b in gather.sources]
    starts, lengths = gather.starts, gather.lengths
    if any(v is None for v in values):
        missing = torch.tensor([v is None for v in values])[gather.source]
        starts, lengths = starts.masked_fill(missing, 0), lengths.masked_fill(missing, 0)
        values = [torch.empty((0, *spec.shape), dtype=spec.dtype) if v is None else v for v in values]
    return values, starts, lengths


def _zero_missing(out: torch.Tensor, gather: Gather, lengths: torch.Tensor, offsets: torch.Tensor) -> None:
    """Zero the tokens of rows whose shard lacks the field (`lengths` 0 there), as padding would."""
    missing = lengths != gather.lengths
    if bool(missing.any()):
        out[ranges(offsets[:-1][missing], offsets[1:][missing]).to(out.device)] = 0


def _on_host(assembler: BatchAssembler, plan: Plan, gather: Gather, offsets: torch.Tensor, num_tokens: int,
             token_fields: list[str]) -> dict[str, torch.Tensor]:
    data: dict[str, torch.Tensor] = {}
    for name in token_fields:
        spec = assembler.fields[name]
        out = assembler.output(name, (num_tokens, *spec.shape), spec.dtype, plan.reuse_output)
        values, starts, lengths = _field_rows(gather, name, spec)
        if lengths.numel():
            ops.pack_rows(values, gather.source, starts, lengths, offsets[:-1], out)
        _zero_missing(out, gather, lengths, offsets)
        data[name] = out
    return data


def _on_device(assembler: BatchAssembler, device: torch.device, gather: Gather, offsets: torch.Tensor,
               num_tokens: int, token_fields: list[str]) -> dict[str, torch.Tensor]:
    """Flat token fields on `device`. Rows whose source is on the device (tier copies, staged cold
    reads) are concatenated there; the rest are packed in host memory by pack_rows and copied over
    in one transfer per field; each part is put in place by one index write unless it is all."""
    source, n = gather.source, gather.source.numel()
    on_device = (torch.tensor(gather.on_device, dtype=torch.bool)[source] if gather.sources
                 else torch.zeros(0, dtype=torch.bool))
    host_rows, device_rows = (~on_device).nonzero().flatten(), on_device.nonzero().flatten()
    pin = device.type == "cuda"
    data: dict[str, torch.Tensor] = {}
    for name in token_fields:
        spec = assembler.fields[name]
        out = torch.empty((num_tokens, *spec.shape), dtype=spec.dtype, device=device)
        values, starts, lengths = _field_rows(gather, name, spec)
        for rows, here in ((host_rows, False), (device_rows, True)):
            if not rows.numel():
                continue
            row_lengths = lengths[rows]
            part_offsets = torch.zeros(rows.numel() + 1, dtype=torch.int64)
            torch.cumsum(row_lengths, 0, out=part_offsets[1:])
            total = int(part_offsets[-1])
            if here:  # only the sampled tokens move: one view per row, one cat
                views = [values[i][a : a + c] for i, a, c in
                         zip(source[rows].tolist(), starts[rows].tolist(), row_lengths.tolist()) if c]
                part = torch.cat(views) if views else out[:0]
            else:
                host_values = [torch.empty((0, *spec.shape), dtype=spec.dtype) if there else v
                               for v, there in zip(values, gather.on_device)]
                part = torch.empty((total, *spec.shape), dtype=spec.dtype, pin_memory=pin)
                ops.pack_rows(host_values, source[rows], starts[rows], row_lengths, part_offsets[:-1], part)
                part = part.to(device, non_blocking=pin)
            part = part.to(spec.dtype)
            if rows.numel() == n and total == num_tokens:
                out = part  # every row, in order: already the flat field
            elif total:
                out[ranges(offsets[rows], offsets[rows] + row_lengths, total).to(device)] = part
        _zero_missing(out, gather, lengths, offsets)
        data[name] = out
    return data


# The layouts this module adds to a BatchAssembler (RolloutBuffer passes them in).
LAYOUTS = {"packed": assemble_packed}
# What a sampling call returns, by its `layout`.
Batch = ReplayBatch | PackedReplayBatch
