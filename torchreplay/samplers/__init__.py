"""Samplers: which slots a batch draws, and with what importance weights.

A sampler knows nothing of bytes. The buffer tells it which slots became live, died or changed
advantage, and asks it for `n` slots. See `Sampler` for the protocol and docs/api.md for how to
write your own.
"""

from torchreplay.samplers.base import ProportionalSampler, Sampler, SlotView, TreeSampler
from torchreplay.samplers.builtin import (
    FreshnessSampler,
    GroupSampler,
    PNewestSampler,
    PrioritizedSampler,
    UniformSampler,
)
from torchreplay.samplers.registry import register_sampler, registered_samplers, sampler_from_state, sampler_spec

__all__ = [
    "Sampler",
    "ProportionalSampler",
    "SlotView",
    "TreeSampler",
    "UniformSampler",
    "PrioritizedSampler",
    "FreshnessSampler",
    "PNewestSampler",
    "GroupSampler",
    "register_sampler",
    "registered_samplers",
    "sampler_from_state",
    "sampler_spec",
]
