"""The `torchreplay demo`: GRPO on a verifiable toy task, on-policy versus replay at equal generation budget."""

from torchreplay.demo.runner import run

__all__ = ["run"]
