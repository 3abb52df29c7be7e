"""Prompt identity: a per-rollout prompt key and the two queries the peer replay rules need.

A prompt key is an int64 in [0, 2**63): by default a hash of the prompt's token ids (the first
`prompt_len` tokens), the same in every process and run (computed with numpy's wrapping uint64
arithmetic, never Python's salted `hash()`), or the caller's own id given as `prompt_key` at add.
Stored as the `prompt_key` rollout field (`prompt_key_field()`), it travels with the rollout
through checkpoints, imports and resharding like any extra field.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from torchreplay.assembly import Handles
from torchreplay.buffer import RolloutBuffer
from torchreplay.schema import ROLLOUT, FieldSpec

PROMPT_KEY = "prompt_key"
_MASK63 = np.uint64(2**63 - 1)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_POSITION = np.uint64(0xC2B2AE3D27D4EB4F)
_LENGTH = np.uint64(0x165667B19E3779F9)


def prompt_key_field() -> dict[str, FieldSpec]:
    """`extra_fields` entry declaring the int64 `prompt_key` rollout field."""
    return {PROMPT_KEY: FieldSpec(PROMPT_KEY, ROLLOUT, torch.int64, accept="int")}


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: every input bit reaches every output bit (uint64, wrapping)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _ragged(tokens: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, offsets) of the ragged forms `add` accepts: a list of 1-D tensors, a nested tensor
    or {"values", "offsets"}."""
    if isinstance(tokens, Mapping):
        return torch.as_tensor(tokens["values"]).reshape(-1), torch.as_tensor(tokens["offsets"], dtype=torch.int64)
    if isinstance(tokens, torch.Tensor) and tokens.is_nested:
        tokens = tokens.unbind()
    if isinstance(tokens, (list, tuple)):
        rows = [torch.as_tensor(t).reshape(-1) for t in tokens]
        lengths = torch.tensor([r.numel() for r in rows], dtype=torch.int64)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
        return (torch.cat(rows) if rows else torch.empty(0, dtype=torch.int64)), offsets
    raise TypeError(f"field 'tokens': expected a list of 1-D tensors, a nested tensor or "
                    f"{{'values', 'offsets'}}, got {type(tokens).__name__}")


def hash_prompts(tokens: Any, prompt_len: torch.Tensor) -> torch.Tensor:
    """int64 [n] keys in [0, 2**63): an order-sensitive hash of each rollout's first `prompt_len`
    token ids. Each token is mixed with its position, the mixed values are summed per prompt
    (wrapping), and the sum is mixed with the prompt's length, so equal prompts give equal keys
    everywhere and different ones collide with probability about n**2 / 2**64."""
    values, offsets = _ragged(tokens)
    if values.is_floating_point() or values.dtype == torch.bool:
        raise TypeError(f"field 'tokens': token ids must be integers, got {values.dtype}")
    prompt_len = torch.as_tensor(prompt_len, dtype=torch.int64).reshape(-1)
    n = offsets.numel() - 1
    if prompt_len.numel() != n:
        raise ValueError(f"field 'prompt_len': {prompt_len.numel()} values for {n} rollouts")
    lengths = offsets[1:] - offsets[:-1]
    if bool(((prompt_len < 0) | (prompt_len > lengths)).any()):
        raise ValueError("field 'prompt_len': must lie in [0, the rollout's token count]")
    starts = offsets[:-1]
    position = torch.arange(values.numel(), dtype=torch.int64) - torch.repeat_interleave(starts, lengths)
    in_prompt = position < torch.repeat_interleave(prompt_len, lengths)
    ids = values.to(torch.int64).numpy().view(np.uint64)
    pos = position.numpy().astype(np.uint64)
    mixed = _mix(ids * _GOLDEN + (pos + np.uint64(1)) * _POSITION) * in_prompt.numpy().astype(np.uint64)
    total = np.concatenate([np.zeros(1, dtype=np.uint64), np.cumsum(mixed, dtype=np.uint64)])
    ends = offsets[1:].numpy()
    per_prompt = total[ends] - total[starts.numpy()]
    keys = _mix(per_prompt ^ (prompt_len.numpy().astype(np.uint64) * _LENGTH)) & _MASK63
    return torch.from_numpy(keys.view(np.int64).copy())


def with_prompt_keys(batch: Mapping[str, Any]) -> dict[str, Any]:
    """`batch` (a dict for `add`/`compose`) with `prompt_key` filled in: the caller's own ids when
    given (int64 [n], >= 0), else `hash_prompts(tokens, prompt_len)`."""
    out = dict(batch)
    given = out.get(PROMPT_KEY)
    if given is None:
        out[PROMPT_KEY] = hash_prompts(out["tokens"], out["prompt_len"])
        return out
    keys = torch.as_tensor(given)
    if keys.is_floating_point() or keys.dtype == torch.bool:
        raise TypeError(f"field 'prompt_key': must be integers, got {keys.dtype}")
    keys = keys.to(torch.int64).reshape(-1)
    if bool((keys < 0).any()):
        raise ValueError("field 'prompt_key': keys must be >= 0")
    out[PROMPT_KEY] = keys
    return out


def zero_variance_prompts(prompt_key: torch.Tensor, reward: torch.Tensor) -> torch.Tensor:
    """The keys (sorted, int64) whose rows in this batch all have the same reward: the groups that
    give GRPO no learning signal. A NaN reward is a ValueError naming `reward`."""
    prompt_key, reward = torch.as_tensor(prompt_key).reshape(-1), torch.as_tensor(reward).reshape(-1).double()
    if bool(torch.isnan(reward).any()):
        raise ValueError("field 'reward': the prompt groups' rewards must all be known (no NaN)")
    keys, inverse = torch.unique(prompt_key, return_inverse=True)
    low = torch.full((keys.numel(),), torch.inf, dtype=torch.float64).scatter_reduce(0, inverse, reward, "amin")
    high = torch.full((keys.numel(),), -torch.inf, dtype=torch.float64).scatter_reduce(0, inverse, reward, "amax")
    return keys[low == high]


class PromptIndex:
    """prompt key -> the buffer's live rollouts of that prompt, in O(rollouts of the prompt).

    Feed it every add (`note(handles, keys)`; `apply_rule` does). Entries whose rollout died (evicted,
    slot reused) are dropped when met. After a restore or reshard, `rebuild()` reads the live
    rollouts' stored `prompt_key` (or hashes their prompts when the buffer has no such field)."""

    def __init__(self, buffer: RolloutBuffer) -> None:
        self.buffer = buffer
        self._entries: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._noted = 0

    def note(self, handles: Handles, keys: torch.Tensor) -> None:
        """Record that the rollouts `handles` have prompt `keys` (int64 [n])."""
        keys = torch.as_tensor(keys, dtype=torch.int64).reshape(-1)
        if keys.numel() != len(handles):
            raise ValueError(f"prompt keys: {keys.numel()} keys for {len(handles)} handles")
        for key in torch.unique(keys).tolist():
            hit = keys == key
            slot, generation = self._entries.get(key, (torch.empty(0, dtype=torch.int64),) * 2)
            self._entries[key] = (torch.cat([slot, handles.slot[hit]]), torch.cat([generation, handles.generation[hit]]))
        self._noted += keys.numel()
        if self._noted > 2 * self.buffer.ledger.capacity:  # bound the index by the buffer, not by history
            for key in list(self._entries):
                self.live(key)
            self._noted = sum(s.numel() for s, _ in self._entries.values())

    def live(self, key: int) -> Handles:
        """Handles of the live rollouts of prompt `key`, oldest insertion first."""
        slot, generation = self._entries.get(int(key), (torch.empty(0, dtype=torch.int64),) * 2)
        table = self.buffer.ledger.slots
        alive = table.live[slot] & (table.generation[slot] == generation)
        slot, generation = slot[alive], generation[alive]
        if slot.numel():
            self._entries[int(key)] = (slot, generation)
        else:
            self._entries.pop(int(key), None)
        return Handles(slot, generation)

    def keys(self) -> list[int]:
        """Prompt keys with at least one entry (some may have died since)."""
        return list(self._entries)

    def rebuild(self) -> None:
        """Index the buffer's live rollouts from their stored data (one read of each, no use counted)."""
        self._entries, self._noted = {}, 0
        slots = self.buffer.ledger.slots.live_slots()
        if slots.numel() == 0:
            return
        batch = self.buffer.gather(slots, count_use=False, layout="packed")
        if PROMPT_KEY in batch.data:
            keys = batch.data[PROMPT_KEY]
        else:
            tokens = {"values": batch.data["tokens"], "offsets": batch.cu_seqlens.to(torch.int64)}
            keys = hash_prompts(tokens, batch.data["prompt_len"])
        self.note(batch.handles, keys)
