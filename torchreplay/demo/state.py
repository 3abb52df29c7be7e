"""Trainer checkpoints for the demo: model, optimizer, generators and progress, next to the
buffer's own checkpoint, in the same object store (file:// or s3://). Tensors + JSON, no pickle."""

from __future__ import annotations

import json
from typing import Any

import torch

from torchreplay.checkpoint import tensorfile
from torchreplay.checkpoint.store import open_store, with_retries
from torchreplay.errors import CheckpointError


def optimizer_state(opt: torch.optim.Optimizer) -> dict[str, Any]:
    state = opt.state_dict()
    return {"state": {str(k): v for k, v in state["state"].items()}, "param_groups": state["param_groups"]}


def load_optimizer_state(opt: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    groups = [dict(g, betas=tuple(g["betas"])) if "betas" in g else g for g in saved["param_groups"]]
    opt.load_state_dict({"state": {int(k): v for k, v in saved["state"].items()}, "param_groups": groups})


class TrainerCheckpoint:
    """`<uri>/trainer`: state/<seq>.json + .bin and a LATEST pointer written last."""

    def __init__(self, uri: str, endpoint_url: str | None = None) -> None:
        self.store = open_store(f"{uri.rstrip('/')}/trainer", endpoint_url)
        self.sequence = 0

    def save(self, state: dict[str, Any]) -> None:
        text, blob = tensorfile.pack(state)
        name = f"state/{self.sequence:012d}"
        with_retries(lambda: self.store.put(f"{name}.bin", blob), 60.0, "trainer state")
        with_retries(lambda: self.store.put(f"{name}.json", text), 60.0, "trainer state")
        with_retries(lambda: self.store.put("LATEST", json.dumps({"state": name}).encode()), 60.0, "trainer LATEST")
        stale = [k for k in self.store.list("state") if not k.startswith(name)]
        self.store.delete(stale)
        self.sequence += 1

    def load(self) -> dict[str, Any] | None:
        if not self.store.exists("LATEST"):
            return None
        try:
            name = json.loads(self.store.get("LATEST"))["state"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{self.store.uri}/LATEST is malformed") from exc
        if not isinstance(name, str) or not name.startswith("state/") or "/" in name[len("state/"):]:
            raise CheckpointError(f"trainer LATEST names {name!r}, outside state/")
        state = tensorfile.unpack(self.store.get(f"{name}.json"), self.store.get(f"{name}.bin"))
        self.sequence = int(name.rsplit("/", 1)[1]) + 1
        return state
