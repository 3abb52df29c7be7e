"""Batch assembly: padding rollouts into a ReplayBatch, in host memory or on the storage's device.

Both buffers use it: RolloutBuffer for its own draws, DistributedRolloutBuffer for the slots other
ranks request. It reads only a `Plan` (what the batch holds, snapshotted on the trainer thread)
and pinned, immutable shards, so it may run on a prefetch thread: it asks the storage once per
batch for a `Gather` (the rows' sources and where each row is in them) inside the `with` block
that unpins the plan's shards.
"""

from __future__ import annotations

import functools
import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterator, Mapping

import torch

from torchreplay._ops import ops
from torchreplay.padded import split_padded
from torchreplay.schema import ROLLOUT, TOKEN, FieldSpec, PackedBatch
from torchreplay.slots import TABLE_FIELDS, SlotTable
from torchreplay.storage import CorruptRows, Gather, PinnedShards, TieredStorage
from torchreplay.storage.reads import ranges


@dataclass(frozen=True)
class Handles:
    """Identifies stored rollouts across slot reuse: a handle is live while its generation matches."""

    slot: torch.Tensor  # int64 [n]
    generation: torch.Tensor  # int64 [n]

    def __len__(self) -> int:
        return self.slot.numel()

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return zip(self.slot.tolist(), self.generation.tolist())


def move_tensor(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`: as it is when already there; from the CPU to CUDA through pinned memory,
    non-blocking (the batch types' `to`)."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass
class ReplayBatch:
    """A padded training batch. `data` holds every field as [B, T, ...] (token) or [B] (rollout)
    tensors: tokens, attention_mask, response_mask, logprobs, reward, advantage, group_id,
    policy_version, prompt_len, plus optional/declared fields. Bookkeeping: handles, IS `weights`
    (normalized by the sampler's `weight_norm`), `age` (policy versions), `reuse` (times used before this batch), `is_fresh`."""

    data: dict[str, torch.Tensor]
    handles: Handles
    weights: torch.Tensor
    age: torch.Tensor
    reuse: torch.Tensor
    is_fresh: torch.Tensor
    token_fields: tuple[str, ...] = ()  # which `data` entries are per-token (for `split`)
    pad_token_id: int = 0

    # The per-row bookkeeping beside `data` and `handles`: `to` and `concat` treat them alike.
    BOOKKEEPING: ClassVar[tuple[str, ...]] = ("weights", "age", "reuse", "is_fresh")

    @classmethod
    def assembled(cls, data: dict[str, torch.Tensor], handles: Handles, *, weights: torch.Tensor,
                  age: torch.Tensor, reuse: torch.Tensor, is_fresh: torch.Tensor,
                  token_fields: tuple[str, ...], pad_token_id: int) -> "ReplayBatch":
        """The one constructor path every batch takes (assembly, `to`, `concat`, a distributed
        sample), so a new field of the batch is added in one place."""
        return cls(data=data, handles=handles, weights=weights, age=age, reuse=reuse, is_fresh=is_fresh,
                   token_fields=token_fields, pad_token_id=pad_token_id)

    def __getattr__(self, name: str) -> torch.Tensor:
        data = self.__dict__.get("data", {})
        if name in data:
            return data[name]
        raise AttributeError(f"ReplayBatch has no field {name!r}; fields: {sorted(data)}")

    def __len__(self) -> int:
        return self.weights.numel()

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the batch holds (`data` and the bookkeeping columns)."""
        return [*self.data.values(), *(getattr(self, name) for name in self.BOOKKEEPING)]

    def split(self, prompt_side: str = "left") -> dict[str, torch.Tensor]:
        """The layout TRL and verl train on: `prompt_ids`/`prompt_mask` [B, Tp] padded on
        `prompt_side`, `completion_ids`/`completion_mask` [B, Tc] right-padded (int64 masks),
        `completion_extent` [B, Tc] (1 on each completion's tokens, trained or not), every other
        token field completion-aligned [B, Tc, ...] (`logprobs` included), rollout fields as they
        are, plus `weights`, `is_fresh`, `age` and `reuse`. A batch made by
        `from_padded` comes back exactly as it went in, up to the batch's own padding widths."""
        out = split_padded(self.data, self.token_fields, self.pad_token_id, prompt_side)
        out.update(weights=self.weights, is_fresh=self.is_fresh, age=self.age, reuse=self.reuse)
        return out

    def to(self, device: torch.device | str) -> "ReplayBatch":
        """Move every tensor. From the CPU to CUDA this goes through pinned memory, non-blocking."""
        device = torch.device(device)

        move = functools.partial(move_tensor, device=device)
        return ReplayBatch.assembled({k: move(v) for k, v in self.data.items()}, self.handles,
                                     **{name: move(getattr(self, name)) for name in self.BOOKKEEPING},
                                     token_fields=self.token_fields, pad_token_id=self.pad_token_id)


@dataclass
class Plan:
    """What a batch will hold, snapshotted on the trainer thread so that materializing it (padding,
    cold reads) can run on a prefetch thread while the buffer moves on."""

    slots: torch.Tensor
    weights: torch.Tensor
    is_fresh: torch.Tensor
    shard_of: torch.Tensor
    rows: torch.Tensor
    meta: dict[str, torch.Tensor]
    generation: torch.Tensor
    age: torch.Tensor
    reuse: torch.Tensor
    pinned: PinnedShards  # the batch's shards, pinned until materialize is done with them
    fields: list[str]
    reuse_output: bool = False
    layout: str = "padded"  # or one of BatchAssembler.layouts (the buffer's: "packed", torchreplay/packed.py)
    device: torch.device | None = None  # assemble on the storage's device (see TieredStorage(device=))
    ready: Any = None  # CUDA event recorded after a device batch's last kernel (see PendingBatch)



class PendingBatch:
    """A batch being paged in. `result()` waits for it; if its rollouts turned out unreadable,
    `redraw(error)` runs on the owner's thread (the buffer evicts them and draws again, or raises)."""

    def __init__(self, future: Future, device, plan: Plan, redraw: Callable[[CorruptRows], ReplayBatch]) -> None:
        self._future, self._device, self._plan, self._redraw = future, device, plan, redraw

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> ReplayBatch:
        try:
            batch = self._future.result()
        except CorruptRows as exc:
            return self._redraw(exc)
        ready = self._plan.ready
        if ready is not None:
            # The batch was put together on the prefetch thread's stream: the caller's stream waits
            # for it, and its memory is not reused while the caller's kernels may still read it.
            stream = torch.cuda.current_stream(self._plan.device)
            stream.wait_event(ready)
            for t in batch.tensors():
                if t.is_cuda:
                    t.record_stream(stream)
        return batch if self._device is None else batch.to(self._device)


def check_device(device: torch.device | str | int | None) -> None:
    """Refuse a `device` no tensor can be put on (ValueError naming it; TypeError for a value that
    is no device at all). The calls that take one check it first, before they draw or count
    anything: moving the finished batch there is their last step."""
    if device is None:
        return
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
        raise TypeError(f"device must be a torch.device, a str or an int, got {type(device).__name__}")
    try:
        torch.empty(0, device=torch.device(device))
    except (RuntimeError, AssertionError, ValueError) as exc:  # unknown type, no such GPU, no CUDA build
        raise ValueError(f"device {device!r} cannot hold a batch here: {exc}") from exc


def prefetched(start: Callable[[], PendingBatch], steps: int | None) -> Iterator[Any]:
    """`steps` batches (None: endless) from `start()`, the next one always in flight while the
    caller has the current one (`RolloutBuffer.prefetching`)."""
    pending = start()
    taken = 0
    while steps is None or taken < steps:
        batch = pending.result()
        taken += 1
        if steps is None or taken < steps:
            pending = start()
        yield batch


def effective_sample_size(weights: torch.Tensor) -> float:
    """ESS of IS weights as a fraction of their count (1.0: all equal; nan for no weights)."""
    if weights.numel() == 0:
        return math.nan
    w = weights.double()
    return float(w.sum() ** 2 / (w.pow(2).sum() * w.numel()))


def padding_mask(lengths: torch.Tensor, width: int, side: str) -> torch.Tensor:
    """[n, width] bool: True on each row's `lengths` token positions, padded on `side`."""
    column = torch.arange(width, device=lengths.device)
    if side == "left":
        return column[None, :] >= (width - lengths)[:, None]
    return column[None, :] < lengths[:, None]


class BatchAssembler:
    """Pads planned rows into ReplayBatches (host or device), reusing output arenas on request.
    `layouts`: other layouts a plan may ask for, name -> function(assembler, plan) -> batch, run
    where padding would be (inside the plan's pins, on the prefetch thread for `sample_async`)."""

    def __init__(self, storage: TieredStorage, fields: Mapping[str, FieldSpec], padding_side: str,
                 pad_token_id: int,
                 layouts: Mapping[str, Callable[["BatchAssembler", Plan], Any]] | None = None) -> None:
        self.layouts = dict(layouts or {})
        self.storage = storage
        self.fields = fields
        self.padding_side = padding_side
        self.pad_token_id = pad_token_id
        self._arenas: dict[str, torch.Tensor] = {}
        self._prefetch_stream = None
        self._prefetcher: ThreadPoolExecutor | None = None

    def start(self, plan: Plan, inline: bool) -> Future:
        """Materialize `plan` now (inline) or on the prefetch thread; the result as a Future."""
        if not inline:
            if self._prefetcher is None:
                self._prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchreplay-prefetch")
            return self._prefetcher.submit(self.materialize_ahead, plan)
        future: Future = Future()
        try:
            future.set_result(self.materialize(plan))
        except BaseException as exc:  # noqa: BLE001 - handed to PendingBatch.result
            future.set_exception(exc)
        return future

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=True)

    def home_for(self, device: torch.device | str | None) -> torch.device | None:
        """The storage's device if a batch bound for `device` should be put together there (device
        tier copies and staged cold reads land there); None to assemble in host memory."""
        home = self.storage.device
        if device is None or home is None:
            return None
        wanted = torch.device(device)
        if wanted.type == "cuda" and wanted.index is None:
            wanted = torch.device("cuda", torch.cuda.current_device())
        return home if wanted == home else None

    def plan(self, table: SlotTable, slots: torch.Tensor, weights: torch.Tensor, is_fresh: torch.Tensor,
             version: int, device: torch.device | None = None, reuse_output: bool = False,
             layout: str = "padded") -> Plan:
        """Snapshot what the batch needs and pin its shards (trainer thread). `version` is the one
        the batch's ages are measured against."""
        shard_of = table.shard[slots]
        pinned = self.storage.pinned(torch.unique(shard_of).tolist())
        fields = [name for name, spec in self.fields.items()
                  if spec.required or name in self.storage.optional_fields]
        return Plan(
            slots=slots.clone(), weights=weights.to(torch.float32), is_fresh=is_fresh, shard_of=shard_of,
            rows=table.row[slots], meta={name: getattr(table, name)[slots].clone() for name in TABLE_FIELDS},
            generation=table.generation[slots].clone(), age=version - table.policy_version[slots],
            reuse=table.reuse[slots].clone(), pinned=pinned, fields=fields,
            reuse_output=reuse_output, layout=layout, device=device,
        )

    def materialize(self, plan: Plan) -> ReplayBatch:
        """Page in and pad (any thread; touches only the plan and pinned, immutable shards)."""
        with plan.pinned:
            batch = self._pad(plan) if plan.layout == "padded" else self.layouts[plan.layout](self, plan)
            if plan.device is not None and plan.device.type == "cuda":
                plan.ready = torch.cuda.Event()
                plan.ready.record(torch.cuda.current_stream(plan.device))
            return batch

    def materialize_ahead(self, plan: Plan) -> ReplayBatch:
        """`materialize` on the prefetch thread. A CUDA batch is built on a stream of its own: on
        the default stream its kernels (and the sync before a staged read) would queue behind the
        trainer's whole step; PendingBatch.result hands it over with an event."""
        if plan.device is None or plan.device.type != "cuda":
            return self.materialize(plan)
        if self._prefetch_stream is None:
            self._prefetch_stream = torch.cuda.Stream(plan.device)
        with torch.cuda.stream(self._prefetch_stream):
            return self.materialize(plan)

    def check_request(self, device: torch.device | str | int | None, layout: Any) -> None:
        """`check_device`, and refuse a `layout` this assembler cannot make (ValueError naming it):
        the calls that take them check them first, before they draw or count anything."""
        check_device(device)
        if not (isinstance(layout, str) and (layout == "padded" or layout in self.layouts)):
            raise ValueError(f"layout must be one of {['padded', *self.layouts]}, got {layout!r}")

    def output(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, reuse: bool) -> torch.Tensor:
        """An uninitialized output (every element is written by pad_rows or pack_rows). With `reuse`, a
        view of a per-field arena kept across calls: writing into warm memory instead of freshly
        faulted pages is most of the cost of a large batch."""
        if not reuse:
            return torch.empty(shape, dtype=dtype)
        need = math.prod(shape)
        arena = self._arenas.get(name)
        if arena is None or arena.numel() < need or arena.dtype != dtype:
            arena = torch.empty(need, dtype=dtype, pin_memory=self.storage.pin)
            self._arenas[name] = arena
        return arena[:need].view(shape)

    def _pad(self, plan: Plan) -> ReplayBatch:
        n = plan.slots.numel()
        token_fields = [f for f in plan.fields if self.fields[f].kind == TOKEN]
        gather = self.storage.gather(plan.pinned, plan.shard_of, plan.rows, token_fields, plan.device)
        sources, source, starts, lengths = gather.sources, gather.source, gather.starts, gather.lengths
        width = int(lengths.max()) if n else 0
        left = self.padding_side == "left"
        if plan.device is not None:
            data = self._pad_on_device(plan.device, gather, starts, lengths, width, token_fields)
            return self._finish(plan, gather, data)
        dest = torch.arange(n)
        # The mask is a padded copy of an all-True row: the same one-pass op, into a reusable arena.
        valid = self.output("attention_mask", (n, width), torch.bool, plan.reuse_output)
        ops.pad_rows([torch.ones(width, dtype=torch.bool)], torch.zeros(n, dtype=torch.int64),
                     torch.zeros(n, dtype=torch.int64), lengths, dest, valid, left, False)
        data: dict[str, torch.Tensor] = {}
        for name in token_fields:
            spec = self.fields[name]
            fill = self.pad_token_id if name == "tokens" else 0
            out = self.output(name, (n, width, *spec.shape), spec.dtype, plan.reuse_output)
            values = [b.token.get(name) for b in sources]
            field_starts, field_lengths = starts, lengths
            if any(v is None for v in values):  # shards stored before this optional field existed: all padding
                missing = torch.tensor([v is None for v in values])[source]
                field_starts, field_lengths = starts.masked_fill(missing, 0), lengths.masked_fill(missing, 0)
                values = [torch.empty((0, *spec.shape), dtype=spec.dtype) if v is None else v for v in values]
            if n:
                ops.pad_rows(values, source, field_starts, field_lengths, dest, out, left, fill)
            data[name] = out
        data["attention_mask"] = valid
        return self._finish(plan, gather, data)

    def _finish(self, plan: Plan, gather: Gather, data: dict[str, torch.Tensor]) -> ReplayBatch:
        """The padded token fields in `data`, plus rollout-level fields and the plan's bookkeeping."""
        data.update(self.rollout_data(plan, gather))
        return ReplayBatch.assembled(data, Handles(plan.slots, plan.generation), weights=plan.weights, age=plan.age,
                                     reuse=plan.reuse, is_fresh=plan.is_fresh,
                                     token_fields=tuple(f for f in plan.fields if self.fields[f].kind == TOKEN),
                                     pad_token_id=self.pad_token_id)

    def rollout_data(self, plan: Plan, gather: Gather) -> dict[str, torch.Tensor]:
        """The batch's rollout-level fields [B, ...], whatever its layout: declared ones from the
        gathered shards (0 where a shard predates an optional one), the slot table's from the plan."""
        n = plan.slots.numel()
        sources = gather.sources
        data: dict[str, torch.Tensor] = {}
        extra_rollout = [f for f in plan.fields if self.fields[f].kind == ROLLOUT and f not in TABLE_FIELDS]
        rollout_rows = gather.rollout_rows() if extra_rollout else None
        for name in extra_rollout:
            spec = self.fields[name]
            columns = [b.rollout.get(name) for b in sources]
            columns = [torch.zeros((b.n, *spec.shape), dtype=spec.dtype) if c is None else c
                       for b, c in zip(sources, columns)]
            data[name] = torch.cat(columns)[rollout_rows] if n else torch.zeros((0, *spec.shape), dtype=spec.dtype)
        data.update(plan.meta)
        return data

    def _pad_on_device(self, device: torch.device, gather: Gather, starts: torch.Tensor, lengths: torch.Tensor, width: int,
                       token_fields: list[str]) -> dict[str, torch.Tensor]:
        """Padded token fields and the mask, on `device`. Rows whose source is on the device (tier
        copies, staged cold reads) are gathered there with index ops; the rest are padded in host
        memory by pad_rows, as without a device, and copied over in one transfer per field."""
        sources, source = gather.sources, gather.source
        n = source.numel()
        left = self.padding_side == "left"
        on_device = torch.tensor(gather.on_device, dtype=torch.bool)[source] if sources else torch.zeros(0, dtype=torch.bool)
        host_rows, device_rows = (~on_device).nonzero().flatten(), on_device.nonzero().flatten()
        pin = device.type == "cuda"
        data = {"attention_mask": padding_mask(lengths.to(device), width, self.padding_side)}
        device_row_there = device_rows.to(device)
        for name in token_fields:
            spec = self.fields[name]
            fill = self.pad_token_id if name == "tokens" else 0
            out = torch.full((n, width, *spec.shape), fill, dtype=spec.dtype, device=device)
            values = [b.token.get(name) for b in sources]
            missing = torch.tensor([v is None for v in values], dtype=torch.bool)[source] if sources else on_device
            field_lengths = lengths.masked_fill(missing, 0)
            if host_rows.numel():
                host_values = [torch.empty((0, *spec.shape), dtype=spec.dtype) if v is None or there else v
                               for v, there in zip(values, gather.on_device)]
                staged = torch.empty((host_rows.numel(), width, *spec.shape), dtype=spec.dtype, pin_memory=pin)
                ops.pad_rows(host_values, source[host_rows], starts[host_rows].masked_fill(missing[host_rows], 0),
                             field_lengths[host_rows], torch.arange(host_rows.numel()), staged, left, fill)
                out[host_rows.to(device)] = staged.to(device, non_blocking=pin)
            if device_rows.numel():
                # Only the sampled tokens move: one view per row, one cat, one scatter into place.
                # (Concatenating whole device shards would briefly double their VRAM per field.)
                src, first, count = (source[device_rows].tolist(), starts[device_rows].tolist(),
                                     field_lengths[device_rows].tolist())
                views = [values[i][a : a + c] for i, a, c in zip(src, first, count) if c]
                if views:
                    flat = torch.cat(views)
                    counts = field_lengths[device_rows].to(device)
                    total = flat.shape[0]
                    row = torch.repeat_interleave(device_row_there, counts, output_size=total)
                    first_col = width - counts if left else torch.zeros_like(counts)
                    out[row, ranges(first_col, first_col + counts, total)] = flat.to(spec.dtype)
            data[name] = out
        return data

def subset(batch: PackedBatch, index: torch.Tensor) -> PackedBatch:
    """Rows `index` of a packed batch, as a new packed batch (row k = batch row index[k])."""
    starts, ends = batch.offsets[index], batch.offsets[index + 1]
    lengths = ends - starts
    offsets = torch.zeros(index.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    token_rows = ranges(starts, ends, int(offsets[-1]))
    return PackedBatch(n=index.numel(), offsets=offsets, token={k: v[token_rows] for k, v in batch.token.items()},
                       rollout={k: v[index] for k, v in batch.rollout.items()})


def concat(first: ReplayBatch, second: ReplayBatch, assembler: BatchAssembler) -> ReplayBatch:
    """Stack two padded batches, re-padding token fields to the wider of the two."""
    width = max(first.tokens.shape[1], second.tokens.shape[1])
    data = {}
    for name, a in first.data.items():
        b = second.data[name]
        if a.dim() >= 2 and name in assembler.fields and assembler.fields[name].kind == TOKEN or name == "attention_mask":
            fill = assembler.pad_token_id if name == "tokens" else 0
            a, b = (_pad_to(x, width, fill, assembler.padding_side) for x in (a, b))
        data[name] = torch.cat([a, b])
    handles = Handles(torch.cat([first.handles.slot, second.handles.slot]),
                      torch.cat([first.handles.generation, second.handles.generation]))
    columns = {name: torch.cat([getattr(first, name), getattr(second, name)]) for name in ReplayBatch.BOOKKEEPING}
    return ReplayBatch.assembled(data, handles, **columns,
                                 token_fields=first.token_fields or second.token_fields,
                                 pad_token_id=assembler.pad_token_id)


def _pad_to(x: torch.Tensor, width: int, fill: int, side: str) -> torch.Tensor:
    extra = width - x.shape[1]
    if extra == 0:
        return x
    pad = torch.full((x.shape[0], extra, *x.shape[2:]), fill, dtype=x.dtype)
    return torch.cat([x, pad] if side == "right" else [pad, x], dim=1)
