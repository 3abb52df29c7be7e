"""How rollouts travel between ranks in a global sample: the owner's reply and the receiver's batch.

Every value is sent as its raw bytes (`Tensor.view(torch.uint8)`), so bool, bfloat16 and the
narrow routing dtypes travel on any backend. The reply to n requests is

- one byte row per rollout (`WireFormat.rollout_columns`): the reply's own columns (status: 0 read,
  1 the owner failed; length; slot, generation, reuse and age; priority), the slot-table fields
  the receiver's batch carries (prompt_len, group_id, policy_version, reward, advantage), then
  every other per-rollout field the buffer declares, in its declared dtype and shape;
- one tensor per token field: the rollouts' tokens concatenated, no padding.

The receiver pads to its batch's longest rollout (`WireFormat.batch_data`). The layout is
derived once from the buffer's fields, so it is the same on every rank (their configurations
are checked to agree at construction).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import torch

from torchreplay.assembly import ReplayBatch, padding_mask
from torchreplay.schema import ROLLOUT, TOKEN, FieldSpec

REPLY_INT = ("status", "length", "slot", "generation", "reuse", "age")
TABLE_INT = ("prompt_len", "group_id", "policy_version")
TABLE_FLOAT = ("reward", "advantage")


def to_bytes(t: torch.Tensor, rows: int) -> torch.Tensor:
    """A [rows, ...] tensor as its raw bytes, [rows, bytes per row] uint8."""
    return t.contiguous().view(torch.uint8).reshape(rows, math.prod(t.shape[1:]) * t.element_size())


def from_bytes(b: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Inverse of `to_bytes`: [rows, bytes per row] uint8 -> [rows, *shape] of `dtype`.

    Copied into a fresh [rows, width] buffer first: a column slice of a packed row keeps the row's
    stride, which `view(dtype)` rejects unless it divides by the element size (a single row is
    "contiguous" whatever its stride, so `.contiguous()` would not fix it)."""
    dense = torch.empty(b.shape, dtype=torch.uint8, device=b.device).copy_(b)
    return dense.view(dtype).reshape(b.shape[0], *shape)


@dataclass(frozen=True)
class Column:
    """One value per rollout (or per token) on the wire: its name, dtype and trailing shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...] = ()

    @property
    def width(self) -> int:
        """Bytes per row."""
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    def zeros(self, rows: int) -> torch.Tensor:
        return torch.zeros(rows, *self.shape, dtype=self.dtype)


class WireFormat:
    """The reply layout of a buffer with these `fields` (see the module docstring)."""

    def __init__(self, fields: Mapping[str, FieldSpec]) -> None:
        fixed = [Column(k, torch.int64) for k in (*REPLY_INT, *TABLE_INT)]
        fixed += [Column(k, torch.float64) for k in ("priority", *TABLE_FLOAT)]
        taken = {c.name for c in fixed}
        self.extra_columns = tuple(Column(n, s.dtype, tuple(s.shape)) for n, s in fields.items()
                                   if s.kind == ROLLOUT and n not in taken)
        self.rollout_columns = (*fixed, *self.extra_columns)
        self.token_columns = tuple(Column(n, s.dtype, tuple(s.shape)) for n, s in fields.items() if s.kind == TOKEN)

    @property
    def token_fields(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.token_columns)

    # -- owner side ------------------------------------------------------------------------------
    def reply(self, slots: torch.Tensor, prio: torch.Tensor, batch: ReplayBatch | None
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """The reply for the rollouts `slots` drawn with priorities `prio`: (rows uint8 [n, width],
        token field -> concatenated tokens uint8 [tokens, width], lengths int64 [n]). `batch` is
        their `gather`; None when the owner failed to read them (status 1, no tokens)."""
        n = slots.numel()
        if batch is None:
            lengths = torch.zeros(n, dtype=torch.int64)
            values = {"status": torch.ones(n, dtype=torch.int64), "slot": slots, "priority": prio}
            tokens: Mapping[str, torch.Tensor] = {}
        else:
            mask = batch.attention_mask
            lengths = mask.sum(1)
            values = {**batch.data, "status": torch.zeros(n, dtype=torch.int64), "length": lengths, "slot": slots,
                      "generation": batch.handles.generation, "reuse": batch.reuse, "age": batch.age,
                      "priority": prio}
            tokens = {c.name: batch.data[c.name][mask] for c in self.token_columns if c.name in batch.data}
        values["length"] = lengths
        rows = torch.cat([to_bytes(values[c.name].to(c.dtype) if c.name in values else c.zeros(n), n)
                          for c in self.rollout_columns], 1)
        n_tok = int(lengths.sum())
        packed = {c.name: to_bytes(tokens[c.name] if c.name in tokens else c.zeros(n_tok), n_tok)
                  for c in self.token_columns}
        return rows, packed, lengths

    # -- receiver side ---------------------------------------------------------------------------
    def read_rows(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """The per-rollout values of received rows (uint8 [n, width], CPU), by column name."""
        out, col = {}, 0
        for c in self.rollout_columns:
            out[c.name] = from_bytes(rows[:, col:col + c.width], c.dtype, c.shape)
            col += c.width
        return out

    def batch_data(self, values: Mapping[str, torch.Tensor], tokens: Mapping[str, torch.Tensor],
                   restore: torch.Tensor, device: torch.device, padding_side: str,
                   pad_token_id: int) -> dict[str, torch.Tensor]:
        """A batch's `data` from received rows (`read_rows`) and tokens: token fields padded to the
        longest rollout (`tokens` with `pad_token_id`, others with 0) on `device`, rows put in
        the order `restore` (indices into the received rows)."""
        lengths = values["length"]
        n = lengths.numel()
        width = int(lengths.max()) if n else 0
        valid = padding_mask(lengths, width, padding_side).to(device)
        restore_dev = restore.to(device)
        data: dict[str, torch.Tensor] = {}
        for c in self.token_columns:
            fill = pad_token_id if c.name == "tokens" else 0
            padded = torch.full((n, width, *c.shape), fill, dtype=c.dtype, device=device)
            padded[valid] = from_bytes(tokens[c.name], c.dtype, c.shape)
            data[c.name] = padded[restore_dev]
        data["attention_mask"] = valid[restore_dev]
        for name in TABLE_INT:
            data[name] = values[name][restore]
        for name in TABLE_FLOAT:
            data[name] = values[name][restore].to(torch.float32)
        for c in self.extra_columns:
            data[c.name] = values[c.name][restore]
        return data
