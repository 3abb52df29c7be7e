"""Samplers by name, so a checkpoint can name its sampler and a restore can rebuild it.

A sampler is recorded as {"type": its registered name, "config": its `config()`}, plus whatever
its `state_dict()` carries. The built-in samplers are registered here; register your own with
`register_sampler` to restore it without passing `sampler=` back in.
"""

from __future__ import annotations

from typing import Any, Mapping

from torchreplay.samplers.base import Sampler
from torchreplay.samplers.builtin import (
    FreshnessSampler,
    GroupSampler,
    PNewestSampler,
    PrioritizedSampler,
    UniformSampler,
)

_REGISTRY: dict[str, type] = {}


def register_sampler(cls: type) -> type:
    """Register a sampler class under its class name (usable as a decorator). Its `config()` must
    return the constructor's keyword arguments as plain values."""
    if not isinstance(cls, type) or not callable(getattr(cls, "config", None)):
        raise TypeError(f"a registered sampler must be a class with a config() method, got {cls!r}")
    existing = _REGISTRY.get(cls.__name__)
    if existing is not None and existing is not cls:
        raise ValueError(f"a different sampler is already registered as {cls.__name__!r}")
    _REGISTRY[cls.__name__] = cls
    return cls


def registered_samplers() -> dict[str, type]:
    return dict(_REGISTRY)


def sampler_spec(sampler: Sampler) -> dict[str, Any]:
    """{"type", "config"} of a sampler: what a buffer's configuration records about it (config is
    None for a sampler without `config()`, which a restore cannot rebuild by itself)."""
    config = sampler.config() if callable(getattr(sampler, "config", None)) else None
    return {"type": type(sampler).__name__, "config": config}


def sampler_from_state(state: Mapping[str, Any]) -> Sampler:
    """A registered sampler rebuilt from its `state_dict()` (or `sampler_spec`): constructed from
    the recorded config, with beta (state, not configuration: it may be annealed) as saved.
    ValueError names what is wrong."""
    if not isinstance(state, Mapping):
        raise ValueError("sampler state must be a mapping with 'type' and 'config'")
    name = state.get("type")
    cls = _REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"sampler {state.get('type')!r} is not registered: pass sampler=... to restore "
                         f"(or register_sampler it); registered: {sorted(_REGISTRY)}")
    config = state.get("config")
    if not isinstance(config, dict) or not all(isinstance(k, str) and isinstance(v, (bool, int, float, str))
                                               for k, v in config.items()):
        raise ValueError(f"sampler config {config!r} is malformed")
    try:
        sampler = cls(**config)
        if "beta" in state:
            sampler.beta = float(state["beta"])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"sampler config {config!r} is malformed: {exc}") from exc
    return sampler


for _builtin in (UniformSampler, PrioritizedSampler, FreshnessSampler, PNewestSampler, GroupSampler):
    register_sampler(_builtin)
