"""Rollout schema: field specs, ragged packing and validation.

A rollout is prompt + response tokens with per-token fields of the same length, plus per-rollout
scalars. Ragged fields are normalized to packed `(values, offsets)` so storage and sampling never
loop over rollouts in Python. Validation runs on the whole batch before the buffer changes.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from torchreplay.checks import is_int
from torchreplay.errors import SchemaError

TOKEN = "token"
ROLLOUT = "rollout"


@dataclass(frozen=True)
class FieldSpec:
    """One field. `kind` is "token" (one row per token, ragged) or "rollout" (one row per rollout).

    `dtype` is the stored dtype; `shape` is the trailing shape of one row (() for scalars), e.g.
    (layers, top_k) for MoE routing ids. `kinds_ok` lists the dtype kinds accepted on input.
    """

    name: str
    kind: str
    dtype: torch.dtype
    shape: tuple[int, ...] = ()
    required: bool = True
    accept: str = "float"  # "float", "int" or "bool": what input dtypes are accepted


def narrowest_int_dtype(max_value: int) -> torch.dtype:
    """Smallest integer dtype holding [0, max_value]: routing ids for 256 experts fit in uint8."""
    if max_value <= 255:
        return torch.uint8
    if max_value <= 32767:
        return torch.int16
    if max_value <= 2**31 - 1:
        return torch.int32
    return torch.int64


def default_fields(
    ref_logprobs: bool = False,
    routing: tuple[int, int, int] | None = None,
    extra: Mapping[str, FieldSpec] | None = None,
    token_dtype: torch.dtype = torch.int64,
) -> dict[str, FieldSpec]:
    """The rollout schema. `routing=(num_experts, layers, top_k)` adds MoE routing ids per token.
    `token_dtype` is how token ids are stored and returned (int32 halves their bytes; every
    tokenizer's vocabulary fits)."""
    if token_dtype not in (torch.int32, torch.int64):
        raise ValueError(f"token_dtype must be torch.int32 or torch.int64, got {token_dtype}")
    fields = {
        "tokens": FieldSpec("tokens", TOKEN, token_dtype, accept="int"),
        "response_mask": FieldSpec("response_mask", TOKEN, torch.bool, accept="bool"),
        "logprobs": FieldSpec("logprobs", TOKEN, torch.float32),
        "prompt_len": FieldSpec("prompt_len", ROLLOUT, torch.int64, accept="int"),
        # Optional: trainers such as TRL hand over advantages only. A missing reward is stored as NaN.
        "reward": FieldSpec("reward", ROLLOUT, torch.float32, required=False),
        "advantage": FieldSpec("advantage", ROLLOUT, torch.float32),
        "group_id": FieldSpec("group_id", ROLLOUT, torch.int64, accept="int"),
        "policy_version": FieldSpec("policy_version", ROLLOUT, torch.int64, accept="int"),
    }
    if ref_logprobs:
        fields["ref_logprobs"] = FieldSpec("ref_logprobs", TOKEN, torch.float32)
    if routing is not None:
        num_experts, layers, top_k = routing
        if min(num_experts, layers, top_k) < 1:
            raise ValueError(f"routing must be (num_experts, layers, top_k) >= 1, got {routing}")
        fields["routing"] = FieldSpec(
            "routing", TOKEN, narrowest_int_dtype(num_experts - 1), (layers, top_k), accept="int"
        )
    for name, spec in (extra or {}).items():
        if name in fields:
            raise ValueError(f"extra field {name!r} collides with a built-in field")
        if spec.kind not in (TOKEN, ROLLOUT):
            raise ValueError(f"extra field {name!r}: kind must be 'token' or 'rollout', got {spec.kind!r}")
        fields[name] = spec
    return fields


@dataclass
class PackedBatch:
    """A validated batch: token fields packed as values with shared offsets, rollout fields [n]."""

    n: int
    offsets: torch.Tensor  # [n + 1] int64, into every token field's values
    token: dict[str, torch.Tensor] = field(default_factory=dict)
    rollout: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def nbytes(self) -> int:
        total = self.offsets.numel() * 8
        for t in (*self.token.values(), *self.rollout.values()):
            total += t.numel() * t.element_size()
        return total


def _dtype_ok(spec: FieldSpec, dtype: torch.dtype) -> bool:
    if spec.accept == "float":
        return dtype.is_floating_point
    if spec.accept == "bool":
        return dtype == torch.bool
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool


_WIDE_UNSIGNED = (torch.uint16, torch.uint32, torch.uint64)


def _rollout_of(index: int, values: torch.Tensor, offsets: torch.Tensor | None) -> int:
    """The rollout holding flat element `index` of a token field's values (offsets given) or of a
    rollout field's [n, ...] rows."""
    row = index // max(1, math.prod(values.shape[1:]))
    return row if offsets is None else int(torch.searchsorted(offsets, torch.tensor(row), right=True)) - 1


def _computable(name: str, values: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:
    """`values` in a dtype torch can compare and reduce, holding the same numbers: uint16/32/64
    (no CPU comparisons or reductions) as int64, float8 (no sums or isfinite) as float32. Both are
    exact; a uint64 value past int64 is refused, naming the field."""
    if values.dtype in _WIDE_UNSIGNED:
        wide = values.to(torch.int64)
        if values.dtype == torch.uint64 and values.numel():
            past = wide < 0  # the values >= 2**63, wrapped by the conversion
            if bool(past.any()):
                first = _first_bad(past.reshape(-1))
                raise SchemaError(f"field {name!r}, rollout {_rollout_of(first, values, offsets)}: value "
                                  f"{int(wide.reshape(-1)[first]) + 2**64} does not fit int64")
        return wide
    if values.is_floating_point() and values.element_size() == 1:
        return values.to(torch.float32)
    return values


def _check_fits(name: str, values: torch.Tensor, dtype: torch.dtype, offsets: torch.Tensor | None = None) -> None:
    """SchemaError naming the field unless converting `values` to the stored `dtype` keeps every
    value in range: an integer past the dtype's range would wrap, a finite float past it would
    become inf. Costs one min/max, and only where the input dtype reaches past the stored one."""
    if values.dtype == dtype or values.numel() == 0 or dtype == torch.bool:
        return
    source = torch.finfo(values.dtype) if values.is_floating_point() else torch.iinfo(values.dtype)
    if dtype.is_floating_point:
        if source.max <= torch.finfo(dtype).max:
            return
        lo, hi = torch.aminmax(values)
        if bool(torch.isfinite(torch.stack([lo, hi]).to(dtype)).all()):
            return  # rounding is monotonic: the extremes fit, so does everything between
        bad = torch.isfinite(values) & ~torch.isfinite(values.to(dtype))  # NaN/inf stay what they were
        limit = f"the range of {dtype}"
    else:
        info = torch.iinfo(dtype)
        if not values.is_floating_point() and info.min <= source.min and source.max <= info.max:
            return
        lo, hi = (float(x) if values.is_floating_point() else int(x) for x in torch.aminmax(values))
        if info.min <= lo and hi <= info.max:
            return
        bad = (values < info.min) | (values > info.max)
        limit = f"{dtype}'s range [{info.min}, {info.max}]"
    if not bool(bad.any()):
        return
    first = _first_bad(bad.reshape(-1))
    value = values.reshape(-1)[first].item()
    raise SchemaError(f"field {name!r}, rollout {_rollout_of(first, values, offsets)}: value {value!r} is "
                      f"outside {limit}, the stored dtype")


def _ragged(name: str, value: Any, concat: Callable[[list[torch.Tensor]], torch.Tensor] = torch.cat
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalize a ragged field to (values, offsets); a list's rows are joined with `concat`."""
    if isinstance(value, torch.Tensor) and value.is_nested:
        parts = list(value.unbind())
        return _ragged(name, parts, concat)
    if isinstance(value, Mapping):
        if set(value) != {"values", "offsets"}:
            raise SchemaError(f"field {name!r}: a packed ragged field needs exactly 'values' and 'offsets'")
        values, offsets = value["values"], value["offsets"]
        if not isinstance(values, torch.Tensor) or not isinstance(offsets, torch.Tensor):
            raise SchemaError(f"field {name!r}: 'values' and 'offsets' must be tensors")
        if offsets.dim() != 1 or offsets.numel() < 1 or offsets.dtype.is_floating_point or offsets.dtype == torch.bool:
            raise SchemaError(f"field {name!r}: offsets must be a 1-D integer tensor of n + 1 entries")
        offsets = offsets.to(torch.int64)
        if values.dim() == 0 or int(offsets[0]) != 0 or int(offsets[-1]) != values.shape[0]:
            raise SchemaError(f"field {name!r}: offsets must start at 0 and end at len(values)")
        if bool((offsets[1:] < offsets[:-1]).any()):
            bad = int((offsets[1:] < offsets[:-1]).nonzero()[0, 0])
            raise SchemaError(f"field {name!r}, rollout {bad}: offsets decrease")
        return values, offsets
    if isinstance(value, (list, tuple)):
        parts = []
        for i, part in enumerate(value):
            if not isinstance(part, torch.Tensor):
                raise SchemaError(f"field {name!r}, rollout {i}: expected a tensor, got {type(part).__name__}")
            if part.dim() < 1:
                raise SchemaError(f"field {name!r}, rollout {i}: expected at least 1-D, got a scalar")
            parts.append(part)
        if not parts:
            return torch.empty(0), torch.zeros(1, dtype=torch.int64)
        trailing = {tuple(p.shape[1:]) for p in parts}
        dtypes = {p.dtype for p in parts}
        if len(trailing) > 1:
            raise SchemaError(f"field {name!r}: rollouts disagree on trailing shape: {sorted(trailing)}")
        if len(dtypes) > 1:
            raise SchemaError(f"field {name!r}: rollouts disagree on dtype: {sorted(map(str, dtypes))}")
        lengths = torch.tensor([p.shape[0] for p in parts], dtype=torch.int64)
        offsets = torch.zeros(len(parts) + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        return concat([p.detach().cpu() for p in parts]), offsets
    raise SchemaError(
        f"field {name!r}: a ragged field must be a list of tensors, a nested tensor or "
        f"{{'values', 'offsets'}}, got {type(value).__name__}"
    )


def _first_bad(mask: torch.Tensor) -> int:
    return int(mask.nonzero()[0, 0])


def to_mapping(batch: Any) -> Mapping[str, Any]:
    """Accept a dict or, when tensordict is installed, a TensorDict (checked first: it is not a
    plain Mapping of its keys)."""
    # Whoever passes a TensorDict has imported tensordict already; importing it here would cost
    # every other caller seconds (it pulls in torch._dynamo).
    tensordict = sys.modules.get("tensordict")
    TensorDictBase = getattr(tensordict, "TensorDictBase", None)  # noqa: N806
    if TensorDictBase is not None and isinstance(batch, TensorDictBase):
        return {key: batch.get(key) for key in batch.keys()}
    if isinstance(batch, Mapping):
        return batch
    raise SchemaError(f"a rollout batch must be a dict of tensors (or a TensorDict), got {type(batch).__name__}")


def validate_batch(batch: Any, fields: Mapping[str, FieldSpec],
                   copy: Callable[[torch.Tensor], torch.Tensor] | None = None,
                   concat: Callable[[list[torch.Tensor]], torch.Tensor] | None = None) -> PackedBatch:
    """Validate and pack a batch. Raises SchemaError naming field, rollout and problem.

    The result owns its memory: a token field still backed by the caller's storage is copied with
    `copy` (default: clone), a list of rows is joined with `concat` (default: torch.cat), a
    rollout field is cloned. Every check runs before anything is returned, in this order (the first
    problem found is the one reported): field names, each field's form, dtype and shape, the rollout
    counts, the token lengths, finiteness, value ranges."""
    batch = to_mapping(batch)
    _check_field_names(batch, fields)
    n, token, rollout, offsets_by_field = _read_fields(batch, fields, concat or torch.cat)
    offsets = _shared_offsets(offsets_by_field)
    _check_finite(fields, token, rollout, offsets)
    if "reward" not in rollout:
        rollout["reward"] = torch.full((n,), float("nan"), dtype=torch.float32)
    _check_ranges(fields, token, rollout, offsets)
    return _owned_batch(batch, fields, PackedBatch(n=n, offsets=offsets, token=token, rollout=rollout),
                        copy or torch.clone)


def _check_field_names(batch: Mapping[str, Any], fields: Mapping[str, FieldSpec]) -> None:
    unknown = set(batch) - set(fields)
    if unknown:
        raise SchemaError(f"unknown field(s) {sorted(unknown)}; declare extra fields in the buffer's schema")
    missing = [name for name, spec in fields.items() if spec.required and name not in batch]
    if missing:
        raise SchemaError(f"missing required field(s) {missing}")


def _read_fields(batch: Mapping[str, Any], fields: Mapping[str, FieldSpec],
                 concat: Callable[[list[torch.Tensor]], torch.Tensor]
                 ) -> tuple[int, dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Every field present, as tensors in a computable dtype: token fields packed (with each one's
    offsets), rollout fields [n, ...] on the CPU. Returns n, the rollout count all fields agree on;
    a single policy_version is broadcast to the n rollouts."""
    n = None
    token: dict[str, torch.Tensor] = {}
    rollout: dict[str, torch.Tensor] = {}
    offsets_by_field: dict[str, torch.Tensor] = {}
    for name, spec in fields.items():
        if name not in batch:
            continue
        if spec.kind == TOKEN:
            token[name], offsets_by_field[name] = _token_field(name, spec, batch[name], concat)
            count = offsets_by_field[name].numel() - 1
        else:
            rollout[name] = _rollout_field(name, spec, batch[name])
            count = rollout[name].shape[0]
            if name == "policy_version" and count == 1:
                continue  # a single version may apply to the whole batch
        if n is None:
            n = count
        elif count != n:
            raise SchemaError(f"field {name!r}: has {count} rollouts, other fields have {n}")
    if not n:
        raise SchemaError("field 'tokens': the batch holds no rollouts (every field is empty)")
    if rollout["policy_version"].shape[0] == 1 and n != 1:
        rollout["policy_version"] = rollout["policy_version"].expand(n).clone()
    elif rollout["policy_version"].shape[0] != n:
        raise SchemaError(f"field 'policy_version': has {rollout['policy_version'].shape[0]} rollouts, others have {n}")
    return n, token, rollout, offsets_by_field


def _token_field(name: str, spec: FieldSpec, value: Any, concat: Callable[[list[torch.Tensor]], torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A ragged field as (values, offsets), its dtype accepted and each token row of the spec's shape."""
    values, offsets = _ragged(name, value, concat)
    if values.numel() and not _dtype_ok(spec, values.dtype):
        raise SchemaError(f"field {name!r}: expected {spec.accept} values, got dtype {values.dtype}")
    values = _computable(name, values, offsets)
    if tuple(values.shape[1:]) != spec.shape and values.shape[0] > 0:
        raise SchemaError(
            f"field {name!r}: each token row must have shape {spec.shape}, got {tuple(values.shape[1:])}"
        )
    if values.shape[0] == 0:
        values = values.reshape(0, *spec.shape)
    return values, offsets


def _rollout_field(name: str, spec: FieldSpec, value: Any) -> torch.Tensor:
    """A per-rollout field as a [n, *spec.shape] CPU tensor; policy_version may be one int or a
    0-d tensor (n = 1 here, broadcast by the caller)."""
    if name == "policy_version" and is_int(value):
        if not -(2**63) <= value < 2**63:
            raise SchemaError(f"field 'policy_version': {value} does not fit int64")
        value = torch.tensor([value])
    if not isinstance(value, torch.Tensor):
        if isinstance(value, (list, tuple)):
            try:
                value = torch.tensor(value)
            except (TypeError, ValueError, RuntimeError) as exc:
                raise SchemaError(f"field {name!r}: cannot convert to a tensor ({exc})") from exc
        else:
            raise SchemaError(f"field {name!r}: expected a tensor, got {type(value).__name__}")
    if value.numel() and not _dtype_ok(spec, value.dtype):
        raise SchemaError(f"field {name!r}: expected {spec.accept} values, got dtype {value.dtype}")
    value = _computable(name, value)
    if value.dim() == 0 and name == "policy_version":
        value = value.reshape(1)
    if value.dim() == 0 or tuple(value.shape[1:]) != spec.shape:
        raise SchemaError(f"field {name!r}: expected shape [n, *{spec.shape}], got {tuple(value.shape)}")
    return value.detach().cpu()


def _shared_offsets(offsets_by_field: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The tokens field's offsets, once every token field has the same length per rollout and no
    rollout is empty."""
    offsets = offsets_by_field["tokens"]
    lengths = offsets[1:] - offsets[:-1]
    for name, other in offsets_by_field.items():
        if not torch.equal(other, offsets):
            other_lengths = other[1:] - other[:-1]
            bad = _first_bad(lengths != other_lengths)
            raise SchemaError(
                f"field {name!r}, rollout {bad}: length {int(other_lengths[bad])} != tokens length {int(lengths[bad])}"
            )
    if bool((lengths == 0).any()):
        raise SchemaError(f"field 'tokens', rollout {_first_bad(lengths == 0)}: empty rollout")
    return offsets


def _check_finite(fields: Mapping[str, FieldSpec], token: Mapping[str, torch.Tensor],
                  rollout: Mapping[str, torch.Tensor], offsets: torch.Tensor) -> None:
    """No NaN/inf in the advantage, the reward (when given) or a float token field."""
    for name in ("advantage", "reward"):
        if name not in rollout:
            continue
        bad = ~torch.isfinite(rollout[name])
        if bool(bad.any()):
            i = _first_bad(bad)
            raise SchemaError(f"field {name!r}, rollout {i}: must be finite, got {float(rollout[name][i])}")
    for name, spec in fields.items():
        if spec.kind == TOKEN and spec.accept == "float" and name in token:
            # One reduction proves the common case (all finite) in a single pass; only a non-finite
            # sum (a NaN/inf, or an overflow of large finite values) pays for the element-wise check.
            values = token[name]
            if values.dtype in (torch.float16, torch.bfloat16):
                values = values.float()  # a half-precision sum overflows long before its elements do
            if values.numel() and bool(torch.isfinite(values.sum())):
                continue
            bad = ~torch.isfinite(token[name])
            if bool(bad.any()):
                flat = bad.reshape(bad.shape[0], -1).any(dim=1)
                row = _first_bad(flat)
                i = int(torch.searchsorted(offsets, torch.tensor(row), right=True)) - 1
                raise SchemaError(f"field {name!r}, rollout {i}: contains NaN/inf")


def _check_ranges(fields: Mapping[str, FieldSpec], token: Mapping[str, torch.Tensor],
                  rollout: Mapping[str, torch.Tensor], offsets: torch.Tensor) -> None:
    """Values the schema bounds: policy_version >= 0, prompt_len within its rollout, routing ids
    within [0, their dtype's max], and every field within its stored dtype's range."""
    lengths = offsets[1:] - offsets[:-1]
    version = rollout["policy_version"]
    if bool((version < 0).any()):
        i = _first_bad(version < 0)
        raise SchemaError(f"field 'policy_version', rollout {i}: must be >= 0, got {int(version[i])}")
    prompt_len = rollout["prompt_len"]
    if bool(((prompt_len < 0) | (prompt_len > lengths)).any()):
        i = _first_bad((prompt_len < 0) | (prompt_len > lengths))
        raise SchemaError(
            f"field 'prompt_len', rollout {i}: must be in [0, {int(lengths[i])}] (the token count), got {int(prompt_len[i])}"
        )
    if "routing" in token:
        spec = fields["routing"]
        routing = token["routing"]
        hi = torch.iinfo(spec.dtype).max
        if routing.numel() and (int(routing.min()) < 0 or int(routing.max()) > hi):
            bad = ((routing < 0) | (routing > hi)).reshape(routing.shape[0], -1).any(dim=1)
            i = int(torch.searchsorted(offsets, torch.tensor(_first_bad(bad)), right=True)) - 1
            raise SchemaError(f"field 'routing', rollout {i}: expert id outside [0, {hi}]")
    for name, spec in fields.items():
        if name in token and name != "routing":  # routing's ids were held to [0, its dtype's max]
            _check_fits(name, token[name], spec.dtype, offsets)
        elif name in rollout:
            _check_fits(name, rollout[name], spec.dtype)


def _owned_batch(batch: Mapping[str, Any], fields: Mapping[str, FieldSpec], packed: PackedBatch,
                 copy: Callable[[torch.Tensor], torch.Tensor]) -> PackedBatch:
    """`packed` in the stored dtypes, contiguous, owning its memory: a tensor still backed by the
    caller's storage (the packed form, a rollout field already in the right dtype) is copied once
    here (token fields with `copy`, the rest cloned), so a caller that reuses or zeroes its tensors
    after `add` cannot change what was stored."""
    borrowed = _storages(batch)

    def own(t: torch.Tensor, copier: Callable[[torch.Tensor], torch.Tensor] = torch.clone) -> torch.Tensor:
        return copier(t) if t.numel() and t.untyped_storage().data_ptr() in borrowed else t

    for name, spec in fields.items():
        if name in packed.token:
            packed.token[name] = own(packed.token[name].to(spec.dtype).contiguous(), copy)
        elif name in packed.rollout:
            packed.rollout[name] = own(packed.rollout[name].to(spec.dtype).contiguous())
    packed.offsets = own(packed.offsets)
    return packed


def _storages(batch: Mapping[str, Any]) -> set[int]:
    """Storage addresses of the caller's tensors (top level and one level of packed/list nesting)."""
    found: set[int] = set()

    def visit(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            if v.device.type == "cpu" and not v.is_nested:
                found.add(v.untyped_storage().data_ptr())
        elif isinstance(v, Mapping):
            for x in v.values():
                visit(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                if isinstance(x, torch.Tensor):
                    visit(x)

    for value in batch.values():
        visit(value)
    return found


StoredField = tuple[str, torch.dtype, tuple[int, ...], int]  # kind, dtype, per-row shape, rows


def check_stored_fields(fields: Mapping[str, FieldSpec], stored: Mapping[str, StoredField],
                        convertible: bool = False) -> None:
    """Check fields stored apart from a batch (a shard file's blocks, a state_dict shard's tensors)
    against `fields`, the specs of what such a store holds, before they are adopted: no unknown
    field, every required one present, each with the spec's kind, dtype and per-row shape.

    Adopted rows skip `validate_batch`, so a dtype must be the stored one exactly; `convertible`
    accepts any dtype `validate_batch` converts, for rows that will go through `add` (an import).
    Raises SchemaError naming the field and the problem."""
    for name, (kind, dtype, shape, _) in stored.items():
        spec = fields.get(name)
        if spec is None:
            raise SchemaError(f"field {name!r}: unknown to this buffer's schema")
        if kind != spec.kind:
            raise SchemaError(f"field {name!r}: stored with kind {kind!r}, the schema's kind is {spec.kind!r}")
        if not (_dtype_ok(spec, dtype) if convertible else dtype == spec.dtype):
            want = f"{spec.accept} values" if convertible else str(spec.dtype)
            raise SchemaError(f"field {name!r}: stored dtype {dtype}, the schema needs {want}")
        if tuple(shape) != spec.shape:
            raise SchemaError(f"field {name!r}: stored rows of shape {tuple(shape)}, the schema has {spec.shape}")
    missing = [name for name, spec in fields.items() if spec.required and name not in stored]
    if missing:
        raise SchemaError(f"missing required field(s) {missing}")


def check_stored_offsets(offsets: torch.Tensor, stored: Mapping[str, StoredField]) -> None:
    """Check stored rows' offsets: n + 1 int64 from 0, strictly increasing (`validate_batch`
    refuses an empty rollout, and samples of one are garbage), ending at every token field's row
    count; every rollout field holds n rows. Raises SchemaError naming the field and the problem."""
    if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1 or offsets.numel() < 1 \
            or offsets.dtype != torch.int64:
        raise SchemaError("field 'offsets': must be a 1-D int64 tensor of n + 1 entries")
    if int(offsets[0]) != 0:
        raise SchemaError(f"field 'offsets': starts at {int(offsets[0])}, not 0")
    empty = offsets[1:] <= offsets[:-1]
    if bool(empty.any()):
        raise SchemaError(f"field 'offsets', rollout {_first_bad(empty)}: empty rollout (offsets must be "
                          f"strictly increasing)")
    n, total = offsets.numel() - 1, int(offsets[-1])
    for name, (kind, _, _, rows) in stored.items():
        want = total if kind == TOKEN else n
        if rows != want:
            raise SchemaError(f"field {name!r}: {rows} rows, the offsets say {want}")


def check_finite_advantages(advantages: torch.Tensor, name: str = "advantages") -> None:
    bad = ~torch.isfinite(advantages)
    if bool(bad.any()):
        i = _first_bad(bad)
        raise SchemaError(f"{name}[{i}] must be finite, got {float(advantages[i])}")

