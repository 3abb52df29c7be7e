"""BufferConfig: the arguments that shape a buffer's behaviour, validated once, and their JSON
form (what checkpoints record and restores rebuild a buffer from). The one parser of a recorded
configuration."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

import torch

from torchreplay.checks import check_int, is_int
from torchreplay.ledger import check_cap
from torchreplay.schema import ROLLOUT, TOKEN, FieldSpec, default_fields
from torchreplay.storage.format import DTYPE_NAMES, DTYPES


@dataclass(frozen=True)
class BufferConfig:
    """The arguments that shape a buffer's behaviour, validated once (ValueError/TypeError naming
    the argument): the single source of a buffer's configuration. `buffer.config()` gives it with
    the caps as they are now; checkpoints record `to_json()`, restores rebuild the buffer from
    `from_json(...)`, and distributed ranks compare `fingerprint()`s."""

    capacity: int
    max_staleness: int | None = None
    max_reuse: int | None = None
    overflow: str = "evict_oldest"
    padding_side: str = "right"
    pad_token_id: int = 0
    ref_logprobs: bool = False
    routing: tuple[int, int, int] | None = None
    extra_fields: Mapping[str, FieldSpec] | None = None
    on_corrupt: str = "raise"
    token_dtype: torch.dtype = torch.int64
    sampler: Mapping[str, Any] | None = None  # {"type", "config"} (samplers.sampler_spec), None if unknown

    def __post_init__(self) -> None:
        check_int(self.capacity, "capacity", low=1, error=ValueError)
        check_cap("max_staleness", self.max_staleness)
        check_cap("max_reuse", self.max_reuse)
        for name, allowed in (("overflow", ("evict_oldest", "raise")), ("on_corrupt", ("raise", "skip")),
                              ("padding_side", ("left", "right"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        check_int(self.pad_token_id, "pad_token_id")
        if self.token_dtype in (torch.int32, torch.int64):
            info = torch.iinfo(self.token_dtype)
            if not info.min <= self.pad_token_id <= info.max:
                raise ValueError(f"pad_token_id {self.pad_token_id} does not fit token_dtype {self.token_dtype}")
        if not isinstance(self.ref_logprobs, bool):
            raise TypeError(f"ref_logprobs must be a bool, got {self.ref_logprobs!r}")
        # Copies of the caller's containers: changing them later must not change this buffer.
        if self.routing is not None:
            routing = tuple(self.routing)
            if len(routing) != 3 or not all(is_int(v) for v in routing):
                raise ValueError(f"routing must be (num_experts, layers, top_k) ints, got {self.routing!r}")
            object.__setattr__(self, "routing", routing)
        if self.extra_fields is not None:
            if not isinstance(self.extra_fields, Mapping):
                raise TypeError(f"extra_fields must be a mapping name -> FieldSpec, got {type(self.extra_fields).__name__}")
            object.__setattr__(self, "extra_fields", MappingProxyType(dict(self.extra_fields)))
        if self.sampler is not None:
            if not isinstance(self.sampler, Mapping) or not isinstance(self.sampler.get("type"), str):
                raise TypeError(f"sampler must be a sampler spec {{'type', 'config'}}, got {self.sampler!r}")
            config = self.sampler.get("config")
            object.__setattr__(self, "sampler", MappingProxyType(
                {"type": self.sampler["type"], "config": MappingProxyType(dict(config)) if config is not None else None}))
        self.fields()  # the schema itself is validated here too (token_dtype, routing, extra names)

    def __hash__(self) -> int:
        return hash(self.fingerprint())

    def fields(self) -> dict[str, FieldSpec]:
        return default_fields(self.ref_logprobs, self.routing, self.extra_fields, self.token_dtype)

    def with_caps(self, max_staleness: int | None, max_reuse: int | None) -> "BufferConfig":
        return dataclasses.replace(self, max_staleness=max_staleness, max_reuse=max_reuse)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON values, extra fields' specs included (a restore needs nothing passed in)."""
        return {
            "capacity": self.capacity, "max_staleness": self.max_staleness, "max_reuse": self.max_reuse,
            "overflow": self.overflow, "padding_side": self.padding_side, "pad_token_id": self.pad_token_id,
            "ref_logprobs": self.ref_logprobs, "routing": list(self.routing) if self.routing else None,
            "extra_fields": {name: {"kind": spec.kind, "dtype": DTYPE_NAMES[spec.dtype], "shape": list(spec.shape),
                                    "required": spec.required, "accept": spec.accept}
                             for name, spec in sorted((self.extra_fields or {}).items())},
            "on_corrupt": self.on_corrupt, "token_dtype": DTYPE_NAMES[self.token_dtype],
            "sampler": {"type": self.sampler["type"], "config": None if self.sampler["config"] is None
                        else dict(self.sampler["config"])} if self.sampler is not None else None,
        }

    @classmethod
    def from_json(cls, data: Any, extra_fields: Mapping[str, FieldSpec] | None = None) -> "BufferConfig":
        """The inverse of `to_json`, validated (ValueError/TypeError naming the key). Configs
        written before extra fields' specs were recorded (a list of names) need `extra_fields`."""
        if not isinstance(data, Mapping):
            raise TypeError(f"buffer config must be a JSON object, got {type(data).__name__}")
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"buffer config has unknown keys {sorted(unknown)}")
        kwargs = dict(data)
        if kwargs.get("routing") is not None:
            if not isinstance(kwargs["routing"], list):
                raise TypeError(f"buffer config routing must be a list, got {kwargs['routing']!r}")
            kwargs["routing"] = tuple(kwargs["routing"])
        if "token_dtype" in kwargs:
            if kwargs["token_dtype"] not in ("int32", "int64"):
                raise ValueError(f"buffer config token_dtype {kwargs['token_dtype']!r} is not int32/int64")
            kwargs["token_dtype"] = DTYPES[kwargs["token_dtype"]]
        recorded = kwargs.pop("extra_fields", None)
        if isinstance(recorded, list):  # names only (format_version 1)
            if sorted(extra_fields or {}) != sorted(recorded):
                raise ValueError(f"the config declares extra fields {recorded} without their specs: pass extra_fields=...")
            kwargs["extra_fields"] = extra_fields
        elif recorded:
            if not isinstance(recorded, Mapping):
                raise TypeError("buffer config extra_fields must map names to field specs")
            kwargs["extra_fields"] = {name: field_from_json(name, spec) for name, spec in recorded.items()}
        return cls(**kwargs)

    def fingerprint(self) -> str:
        """A digest of `to_json()`: equal exactly when two configurations are."""
        text = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def constructor_kwargs(self) -> dict[str, Any]:
        """Keyword arguments that rebuild a buffer with this configuration (the sampler aside)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "sampler"}

    def layout(self) -> dict[str, Any]:
        """What stored state depends on: the slot count and the schema. A state can be loaded into
        a buffer whose layout matches, whatever its caps, padding or sampler settings."""
        as_json = self.to_json()
        return {k: as_json[k] for k in ("capacity", "ref_logprobs", "routing", "extra_fields", "token_dtype")}


def field_from_json(name: str, spec: Any) -> FieldSpec:
    if not isinstance(spec, Mapping) or spec.get("dtype") not in DTYPES or spec.get("kind") not in (TOKEN, ROLLOUT):
        raise ValueError(f"buffer config extra field {name!r}: malformed spec {spec!r}")
    shape = spec.get("shape", [])
    if not isinstance(shape, list) or not all(is_int(d) and d >= 1 for d in shape):
        raise ValueError(f"buffer config extra field {name!r}: shape must be a list of ints >= 1, got {shape!r}")
    if not isinstance(spec.get("required", True), bool) or spec.get("accept", "float") not in ("float", "int", "bool"):
        raise ValueError(f"buffer config extra field {name!r}: malformed required/accept in {spec!r}")
    return FieldSpec(name, spec["kind"], DTYPES[spec["dtype"]], tuple(shape), spec.get("required", True),
                     spec.get("accept", "float"))
