"""verl's `DataProto` in and out of a `RolloutBuffer`.

    from torchreplay.integrations.verl import DataProtoAdapter, verl_fields

    buf = tr.RolloutBuffer(65536, extra_fields=verl_fields(batch), max_staleness=4, max_reuse=4)
    replay = DataProtoAdapter(buf)
    # in RayPPOTrainer.fit, after compute_advantage, before update_actor:
    mixed = replay.compose(batch, version=step, replay_ratio=0.5, multiple_of=dp_size)
    batch = replay.to_dataproto(mixed, template=batch, is_weights=True)  # len % dp_size == 0: chunk() works
    # is_weights: the rows' IS weights multiplied into rollout_is_weights, which verl's policy losses take

Public: `verl_fields` (the buffer's extra field declarations) and `DataProtoAdapter`, whose
methods `from_dataproto(data, version=...) -> dict` (a batch for `RolloutBuffer.add`/`compose`),
`add`, `compose` and `to_dataproto(batch, template=data)` do the work. The adapter holds what the
buffer does not: uid strings and the non-tensor columns (`reward_model`, `extra_info`,
`data_source`, ...), keyed by handle. Only `to_dataproto` imports verl.

verl's layout (0.9.1: experimental/agent_loop/agent_loop.py, trainer/ppo/ray_trainer.py):
`prompts` [B, Tp] left-padded, `responses` [B, Tr] right-padded, `input_ids` their concatenation,
`attention_mask` [B, Tp + Tr], `position_ids` [B, Tp + Tr] or [B, C, Tp + Tr] (Qwen-VL mrope: C = 3,
or 4 in the agent loop), `response_mask` [B, Tr] (0 on tool output and padding), per-token values
over the response ([B, Tr]: old_log_probs, rollout_log_probs, ref_log_prob, advantages, returns,
token_level_scores, token_level_rewards, values) or the whole sequence ([B, Tp + Tr, ...]:
routed_experts); `non_tensor_batch` of numpy arrays, `uid` naming each row's GRPO group.

Stored per rollout (the tokens under attention_mask; the conversion is padded.py's: `from_padded`
with attention_mask's response part as `completion_extent` and response_mask as the training mask,
and back through `split_padded` at the template's widths):
- `tokens`, `prompt_len`, `response_mask` (False over the prompt), `logprobs` = old_log_probs (or
  rollout_log_probs when there is none) over the response and 0 over the prompt;
- `advantage` = the mean of `advantages` where response_mask is 1, summed in float64: for GRPO
  (one scalar times the mask) that is the group-normalized scalar exactly;
- `reward` = token_level_scores summed over the response, when the batch has token_level_scores;
- `group_id` = a 63-bit blake2b hash of the uid: the same uid gets the same id in every call,
  process and rank, with no map that grows; rows without a uid get ids from -1 down;
- every other batch key, position_ids included, as a declared extra field of its own dtype.

`to_dataproto` gives the template's keys (in order), dtypes, devices, widths and meta_info, with
`global_token_num` and `images_seqlens`, which describe the rows, recomputed. Positions under the
attention mask come back bit for bit. Padding is made as verl makes it: token ids with the pad id
found at padded positions (of the template, else of data taken in, else 0); position_ids by the
convention found there (left pads 0 or 1; right pads 0, 1, the last position, or counting on from
it as hf_rollout does; by default compute_position_id_with_mask's for [B, T] and get_rope_index's
1s for [B, C, T]); every other value 0.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch

from torchreplay.buffer import Handles, ReplayBatch, RolloutBuffer
from torchreplay.packed import PackedReplayBatch
from torchreplay.padded import SPLIT_KEYS, from_padded, split_padded
from torchreplay.schema import ROLLOUT, TOKEN, FieldSpec, default_fields

__all__ = ["DataProtoAdapter", "verl_fields"]

# Keys rebuilt from the built-in fields, not stored on their own.
_DERIVED = ("prompts", "responses", "input_ids", "attention_mask", "response_mask", "old_log_probs")
_RESPONSE_FLOATS = ("old_log_probs", "rollout_log_probs", "ref_log_prob", "advantages", "returns",
                    "token_level_scores", "token_level_rewards", "values")
_BUILTIN = frozenset(default_fields(ref_logprobs=True, routing=(2, 1, 1)))
# Pad conventions of position_ids by layout ([B, T]: 2, [B, C, T]: 3), verl's default first.
_LEFT_RULES = {2: ("zero", "one"), 3: ("one", "zero")}
_RIGHT_RULES = {2: ("last", "continue", "zero", "one"), 3: ("one", "zero", "last", "continue")}


@dataclass(frozen=True)
class _Layout:
    size: int
    prompt_width: int
    response_width: int
    where: dict[str, str]  # stored key -> "response", "sequence" or "rollout"


def _tensors(data: Any) -> dict[str, torch.Tensor]:
    batch = getattr(data, "batch", data)
    if batch is None:
        raise ValueError("the DataProto has no tensor batch")
    if not hasattr(batch, "items"):
        raise TypeError(f"expected a verl DataProto, got {type(data).__name__}")
    tensors = dict(batch.items())
    for key, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"batch key {key!r}: expected a tensor, got {type(value).__name__}")
    return tensors


def _layout(tensors: Mapping[str, torch.Tensor]) -> _Layout:
    """Where each stored key's values sit. Raises ValueError/TypeError naming the key for a missing
    key, a shape or a dtype that is not verl's."""
    for key in ("responses", "attention_mask", "input_ids"):
        if key not in tensors:
            raise ValueError(f"the DataProto's batch has no {key!r}; it has {sorted(tensors)}")
    responses, mask = tensors["responses"], tensors["attention_mask"]
    if responses.dim() != 2:
        raise ValueError(f"'responses': expected [B, T_response], got shape {list(responses.shape)}")
    size, response_width = responses.shape
    if mask.dim() != 2 or mask.shape[0] != size or mask.shape[1] <= response_width:
        raise ValueError(f"'attention_mask': expected [{size}, T_prompt + {response_width}], got {list(mask.shape)}")
    width = mask.shape[1]
    expected = {"input_ids": (size, width), "prompts": (size, width - response_width),
                "response_mask": (size, response_width), **{key: (size, response_width) for key in _RESPONSE_FLOATS}}
    for key, value in tensors.items():
        if key in expected and tuple(value.shape) != expected[key]:
            raise ValueError(f"{key!r}: expected shape {list(expected[key])}, got {list(value.shape)}")
        if key == "position_ids" and (value.dim() not in (2, 3) or value.shape[-1] != width):
            raise ValueError(f"'position_ids': expected [{size}, {width}] or [{size}, C, {width}], "
                             f"got {list(value.shape)}")
        floating = value.dtype.is_floating_point or value.dtype.is_complex
        if key in ("responses", "input_ids", "prompts", "position_ids", "attention_mask") and (
                floating or (value.dtype == torch.bool and key != "attention_mask")):
            raise TypeError(f"{key!r}: expected integer values, got dtype {value.dtype}")
        if key in _RESPONSE_FLOATS and not value.dtype.is_floating_point:
            raise TypeError(f"{key!r}: expected floating-point values, got dtype {value.dtype}")
        if key in _BUILTIN and key not in _DERIVED:
            raise ValueError(f"batch key {key!r} has the name of a built-in buffer field; rename it")
        if key in SPLIT_KEYS:  # to_dataproto reads the rows back through split_padded's layout keys
            raise ValueError(f"batch key {key!r} has the name of a padded layout key; rename it")
    where = {}
    for key, value in tensors.items():
        if key in _DERIVED:
            continue
        if key == "position_ids" or (value.dim() >= 2 and value.shape[1] == width):
            where[key] = "sequence"
        elif value.dim() >= 2 and value.shape[1] == response_width:
            where[key] = "response"
        else:
            where[key] = "rollout"
    return _Layout(size, width - response_width, response_width, where)


def _field_specs(tensors: Mapping[str, torch.Tensor], layout: _Layout) -> dict[str, FieldSpec]:
    fields = {}
    for key, where in layout.where.items():
        value = tensors[key]
        if key == "position_ids":
            shape = () if value.dim() == 2 else (value.shape[1],)  # stored per token: [B, C, T] -> rows of (C,)
        else:
            shape = tuple(value.shape[1:] if where == "rollout" else value.shape[2:])
        accept = "bool" if value.dtype == torch.bool else "float" if value.dtype.is_floating_point else "int"
        fields[key] = FieldSpec(key, ROLLOUT if where == "rollout" else TOKEN, value.dtype, shape, accept=accept)
    return fields


def verl_fields(data: Any, position_channels: int | None = None) -> dict[str, FieldSpec]:
    """The extra fields a buffer needs to hold DataProtos like `data` (a DataProto or its batch):
    `RolloutBuffer(..., extra_fields=verl_fields(data))`; every batch key but those rebuilt from
    built-in fields, in its own dtype. Before any batch exists, pass a list of key names instead
    (verl's float32 response keys and position_ids; `position_channels`: C of a [B, C, T] one)."""
    if isinstance(data, (list, tuple, set, frozenset)):
        fields = {}
        for key in data:
            if key == "position_ids":
                shape = () if position_channels is None else (position_channels,)
                fields[key] = FieldSpec(key, TOKEN, torch.int64, shape, accept="int")
            elif key in _RESPONSE_FLOATS and key not in _DERIVED:
                fields[key] = FieldSpec(key, TOKEN, torch.float32)
            elif key not in _DERIVED:
                raise ValueError(f"{key!r}: pass a DataProto that has it, so that its dtype and shape are known")
        return fields
    tensors = _tensors(data)
    return _field_specs(tensors, _layout(tensors))


def _uid_group(uid: Any) -> int:
    return int.from_bytes(hashlib.blake2b(str(uid).encode(), digest_size=8).digest(), "little") >> 1


def _fill_positions(position: torch.Tensor, valid: torch.Tensor, prompt_width: int, left: str,
                    right: str) -> torch.Tensor:
    """`position` [n, C, T] with its padding (where `valid` [n, T] is False) made by the rules."""
    cols = torch.arange(valid.shape[1], device=valid.device)
    last = (valid * cols).amax(1)  # each row's last token (verl's rows are never empty)
    last_value = position.gather(2, last.view(-1, 1, 1).expand(-1, position.shape[1], 1))
    values = {"zero": torch.zeros_like(last_value), "one": torch.ones_like(last_value), "last": last_value,
              "continue": last_value + (cols - last.unsqueeze(1)).unsqueeze(1)}
    padded = torch.where((cols < prompt_width).view(1, 1, -1), values[left], values[right])
    return torch.where(valid.unsqueeze(1), position, padded.expand_as(position))


def _padding(tensors: Mapping[str, torch.Tensor], valid: torch.Tensor, prompt_width: int) -> dict[str, Any]:
    """The pad ids and position_ids pad rules `tensors` show, where they show one. Rules are keyed
    by layout ("left2", "right3", ...): [B, T] and [B, C, T] pad differently."""
    found = {}
    for name, part in (("prompt_pad", slice(None, prompt_width)), ("response_pad", slice(prompt_width, None))):
        pads = tensors["input_ids"][:, part][~valid[:, part]]
        if pads.numel():
            found[name] = int(pads[0])
    if "position_ids" in tensors:
        dims = tensors["position_ids"].dim()
        position = tensors["position_ids"].unsqueeze(1) if dims == 2 else tensors["position_ids"]
        prompt_side = (torch.arange(valid.shape[1]) < prompt_width).unsqueeze(0)
        for side, pads, rules in (("left", ~valid & prompt_side, _LEFT_RULES[dims]),
                                  ("right", ~valid & ~prompt_side, _RIGHT_RULES[dims])):
            pads = pads.unsqueeze(1).expand_as(position)
            for rule in rules if bool(pads.any()) else ():
                made = _fill_positions(position, valid, prompt_width, rule, rule)
                if torch.equal(made[pads], position[pads]):
                    found[f"{side}{dims}"] = rule
                    break
    return found


def _to_json(key: str, value: Any) -> Any:
    """A non-tensor column value as JSON; numpy values keep their dtype in a tagged object."""
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            return {"__ndarray_object__": [_to_json(key, v) for v in value.tolist()]}
        return {"__ndarray__": value.tolist(), "dtype": value.dtype.str}
    if isinstance(value, np.generic):
        return {"__ndarray__": value.tolist(), "dtype": value.dtype.str, "scalar": True}
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"non-tensor column {key!r}: a dict with non-string keys cannot be saved as JSON")
        return {"__dict__": {k: _to_json(key, v) for k, v in value.items()}}
    if isinstance(value, (list, tuple)):
        return [_to_json(key, v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"non-tensor column {key!r}: a {type(value).__name__} cannot be saved as JSON")


def _from_json(value: Any) -> Any:
    if isinstance(value, dict):
        if "__ndarray__" in value:
            array = np.array(value["__ndarray__"], dtype=np.dtype(value["dtype"]))
            return array[()] if value.get("scalar") else array
        if "__ndarray_object__" in value:
            items = [_from_json(v) for v in value["__ndarray_object__"]]
            array = np.empty(len(items), dtype=object)
            for i, item in enumerate(items):
                array[i] = item
            return array
        if "__dict__" in value:
            return {k: _from_json(v) for k, v in value["__dict__"].items()}
        raise ValueError(f"untagged object {sorted(value)[:3]}")
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    return value


class DataProtoAdapter:
    """Moves verl DataProtos into `buffer` and sampled batches back out (see the module docstring).

    It keeps the uid and non-tensor columns of each rollout it adds, keyed by handle, until the
    buffer has evicted the rollout: entries go at the start of the next `add`/`compose` (or
    `prune`), so a batch whose rows the reuse cap evicted still converts. They live in this process,
    not in the buffer's checkpoints (save `state_dict()` beside them); non-tensor objects are kept
    by reference."""

    def __init__(self, buffer: RolloutBuffer) -> None:
        if not isinstance(buffer, RolloutBuffer):
            raise TypeError(f"buffer must be a RolloutBuffer, got {type(buffer).__name__}")
        self.buffer = buffer
        self._rows: dict[tuple[int, int], tuple[int, dict[str, Any]]] = {}  # handle -> (group id, columns)
        self._uids: dict[int, list] = {}  # group id -> [uid, entries holding it]
        self._anonymous = 0
        self._seen: dict[str, Any] = {}  # padding found in the data taken in

    def __len__(self) -> int:
        """Rollouts whose columns the adapter holds."""
        return len(self._rows)

    @property
    def uid_count(self) -> int:
        """Distinct uid strings the adapter holds: each is kept while a rollout of its group is live
        (as of the last `prune`), so this stays bounded by the buffer's capacity."""
        return len(self._uids)

    def from_dataproto(self, data: Any, *, version: int | torch.Tensor) -> dict[str, Any]:
        """A batch for `RolloutBuffer.add`/`compose` from a verl DataProto with its advantages
        computed; `version`: its policy version (an int or [B]). Raises ValueError/TypeError naming
        the key for a batch not in verl's layout or with a key the buffer does not declare. (Rows
        added from it without the adapter's `add`/`compose` have no non-tensor columns to give back.)"""
        tensors = {key: value.detach().cpu() for key, value in _tensors(data).items()}
        layout = _layout(tensors)
        size, prompt_width = layout.size, layout.prompt_width
        if "advantages" not in tensors:
            raise ValueError("the DataProto's batch has no 'advantages': add rollouts after compute_advantage")
        if "old_log_probs" not in tensors and "rollout_log_probs" not in tensors:
            raise ValueError("the DataProto's batch has no 'old_log_probs' (nor 'rollout_log_probs')")
        for key, spec in _field_specs(tensors, layout).items():
            have = self.buffer.fields.get(key)
            if have is None:
                raise ValueError(f"{key!r}: the buffer does not declare it; build the buffer with "
                                 f"extra_fields=verl_fields(data), or pop the key from the DataProto")
            if (have.kind, have.shape) != (spec.kind, spec.shape):
                raise ValueError(f"{key!r}: the buffer declares a {have.kind} field of rows {have.shape}, this "
                                 f"DataProto has a {spec.kind} field of rows {spec.shape}")
        attention = tensors["attention_mask"]
        if attention.dtype != torch.bool and not bool(((attention == 0) | (attention == 1)).all()):
            raise ValueError("'attention_mask': must hold only 0 and 1")
        valid = attention != 0
        prompt_len, response_len = valid[:, :prompt_width].sum(1), valid[:, prompt_width:].sum(1)
        expected = torch.cat([torch.arange(prompt_width) >= prompt_width - prompt_len.unsqueeze(1),
                              torch.arange(layout.response_width) < response_len.unsqueeze(1)], 1)
        bad = (valid != expected).any(1)
        if bool(bad.any()):
            raise ValueError(f"'attention_mask', row {int(bad.nonzero()[0, 0])}: the prompt must be left-padded "
                             f"and the response right-padded, one run of 1s each")
        ids = tensors["input_ids"]
        for key, part in (("prompts", ids[:, :prompt_width]), ("responses", ids[:, prompt_width:])):
            if key in tensors and not torch.equal(tensors[key].to(ids.dtype), part):
                raise ValueError(f"{key!r}: differs from its part of 'input_ids' (verl's input_ids is "
                                 f"cat(prompts, responses))")
        trained = tensors["response_mask"] != 0 if "response_mask" in tensors else valid[:, prompt_width:]
        if bool((trained & ~valid[:, prompt_width:]).any()):
            raise ValueError("'response_mask': 1 at a padded position of the response")

        behaviour = tensors["old_log_probs" if "old_log_probs" in tensors else "rollout_log_probs"]
        # [B, C, T] position_ids -> one (C,) row per token; every other key as it is.
        extra = {key: tensors[key].transpose(1, 2) if key == "position_ids" and tensors[key].dim() == 3
                 else tensors[key] for key in layout.where}
        # attention_mask is the extent (what is stored), response_mask the training mask within it.
        batch = from_padded(
            ids[:, :prompt_width], valid[:, :prompt_width], ids[:, prompt_width:], trained, behaviour.float(),
            completion_extent=valid[:, prompt_width:], policy_version=version, group_id=None,
            advantage=((tensors["advantages"].double() * trained).sum(1) / trained.sum(1).clamp(min=1)).float(),
            reward=tensors["token_level_scores"].double().sum(1).float() if "token_level_scores" in tensors else None,
            **extra)
        batch["group_id"] = self._group_ids(data, size)  # after every check: it uses up ids of uid-less rows
        self._seen.update(_padding(tensors, valid, prompt_width))
        return batch

    def add(self, data: Any, *, version: int | torch.Tensor) -> Handles:
        """`from_dataproto`, then `buffer.add`; keeps the rows' uids and non-tensor columns."""
        fresh = self.from_dataproto(data, version=version)
        self.prune()
        handles = self.buffer.add(fresh)
        self._remember(handles, data, fresh["group_id"])
        return handles

    def compose(self, data: Any, *, version: int | torch.Tensor, **compose_args: Any) -> ReplayBatch:
        """`from_dataproto`, then `buffer.compose(fresh, **compose_args)`: replay_ratio or n_replay,
        and multiple_of=dp_size for a batch that `DataProto.chunk(dp_size)` splits."""
        fresh = self.from_dataproto(data, version=version)
        self.prune()
        batch = self.buffer.compose(fresh, **compose_args)
        size = len(fresh["prompt_len"])  # the fresh rows come first
        self._remember(Handles(batch.handles.slot[:size], batch.handles.generation[:size]), data, fresh["group_id"])
        return batch

    def prune(self) -> int:
        """Drop the entries of rollouts the buffer no longer holds (evicted, or their slot reused);
        returns how many went."""
        if not self._rows:
            return 0
        handles = list(self._rows)
        slots = torch.tensor([slot for slot, _ in handles], dtype=torch.int64)
        generations = torch.tensor([generation for _, generation in handles], dtype=torch.int64)
        table = self.buffer.slots
        alive = (table.live[slots] & (table.generation[slots] == generations)).tolist()
        gone = [handle for handle, keep in zip(handles, alive) if not keep]
        for handle in gone:
            self._forget(handle)
        return len(gone)

    def state_dict(self) -> dict[str, Any]:
        """The adapter's own state as plain JSON values (uids, non-tensor columns by handle, the
        padding it has seen), to save beside the buffer's checkpoint so that rows restored there
        convert back after a resume. numpy arrays and scalars are tagged with their dtype; a column
        value JSON cannot hold (an arbitrary object) raises TypeError naming the column."""
        self.prune()
        rows = [[slot, generation, group, {key: _to_json(key, value) for key, value in columns.items()}]
                for (slot, generation), (group, columns) in self._rows.items()]
        return {"format": 1, "rows": rows, "uids": [[group, _to_json("uid", uid), count]
                                                    for group, (uid, count) in self._uids.items()],
                "anonymous": self._anonymous, "seen": self._seen}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict()`'s output (after the buffer itself was restored). Checked whole
        before anything changes: a malformed state raises ValueError."""
        try:
            if state["format"] != 1:
                raise ValueError(f"unknown format {state['format']!r}")
            rows = {(int(slot), int(generation)): (int(group), {key: _from_json(value) for key, value in columns.items()})
                    for slot, generation, group, columns in state["rows"]}
            uids = {int(group): [_from_json(uid), int(count)] for group, uid, count in state["uids"]}
            anonymous, seen = int(state["anonymous"]), dict(state["seen"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a DataProtoAdapter state: {exc}") from exc
        self._rows, self._uids, self._anonymous, self._seen = rows, uids, anonymous, seen
        self.prune()

    def to_dataproto(self, batch: ReplayBatch | PackedReplayBatch, template: Any, multiple_of: int | None = None,
                     is_weights: bool = False) -> Any:
        """A verl DataProto of `batch`'s rows laid out like `template`, a DataProto of this run
        (usually the step's fresh one): its batch keys in order, dtypes, devices, widths, non-tensor
        keys and meta_info. A packed batch (`layout="packed"`) gives the same DataProto as the
        padded one: verl's DataProto is padded, and its actor's remove-padding path
        (`use_remove_padding`) unpads it again into exactly the packed batch's tokens,
        `cu_seqlens`, `max_seqlen` and (for [B, T] position_ids) `position_ids`. `multiple_of`: a
        ValueError unless the row count is a multiple of it (`compose(..., multiple_of=)` makes it
        one). `is_weights=True` multiplies each row's IS weight into `rollout_is_weights` [B, Tr]
        (created as the weights if the template has none): verl's policy losses take that per-token
        weight, whatever their loss mode; its KL and entropy terms do not."""
        try:
            from verl import DataProto
        except ImportError as exc:
            raise ImportError("to_dataproto needs verl: pip install torchreplay[verl]") from exc
        if isinstance(batch, PackedReplayBatch):
            batch = batch.to_padded()  # exact; the template's widths are applied below
        if not isinstance(batch, ReplayBatch):
            raise TypeError(f"batch must be a ReplayBatch or PackedReplayBatch, got {type(batch).__name__}")
        if not isinstance(template, DataProto):
            raise TypeError(f"template must be a verl DataProto, got {type(template).__name__}")
        n = len(batch)
        if multiple_of is not None and (multiple_of < 1 or n % multiple_of):
            raise ValueError(f"multiple_of={multiple_of}: the batch has {n} rows; use compose(..., multiple_of=)")
        like = _tensors(template)
        layout = _layout(like)
        prompt_width = layout.prompt_width
        data, present = batch.data, batch.data["attention_mask"]
        lengths, prompt_len = present.sum(1), data["prompt_len"].to(present.device)
        for key, count, room in (("prompts", prompt_len, prompt_width),
                                 ("responses", lengths - prompt_len, layout.response_width)):
            if bool((count > room).any()):
                i = int((count > room).nonzero()[0, 0])
                raise ValueError(f"{key!r}: row {i} has {int(count[i])} tokens, the template's width is {room}")
        cpu = {key: value.detach().cpu() for key, value in like.items()}
        found = {**self._seen, **_padding(cpu, cpu["attention_mask"] != 0, prompt_width)}
        prompt_pad = found.get("prompt_pad", found.get("response_pad", 0))
        # Prompts left-padded and responses right-padded to the template's widths; the keys it
        # holds over the whole sequence come back over prompt + response.
        sequence = tuple(key for key, where in layout.where.items()
                         if where == "sequence" and key in batch.token_fields)
        parts = split_padded(data, batch.token_fields, prompt_pad, "left",
                             widths=(prompt_width, layout.response_width), full_width=sequence)
        extent = parts["completion_extent"].bool()
        response_ids = parts["completion_ids"].masked_fill(~extent, found.get("response_pad", prompt_pad))
        ids = torch.cat([parts["prompt_ids"], response_ids], 1)
        valid = torch.cat([parts["prompt_mask"].bool(), extent], 1)
        built = {"input_ids": ids, "prompts": ids[:, :prompt_width], "responses": ids[:, prompt_width:],
                 "attention_mask": valid, "response_mask": parts["completion_mask"], "old_log_probs": parts["logprobs"]}
        out = {}
        for key, example in like.items():
            if key in built:
                value = built[key]
            elif key not in parts:
                raise ValueError(f"{key!r}: the template has it, the buffer's rows do not")
            elif key == "position_ids":
                dims, position = example.dim(), parts[key]
                if position.dim() != dims:
                    raise ValueError(f"'position_ids': the buffer's rows are {'[B, T]' if dims == 3 else '[B, C, T]'}, "
                                     f"the template's {list(example.shape)}")
                position = position.unsqueeze(1) if dims == 2 else position.transpose(1, 2)
                rules = found.get(f"left{dims}", _LEFT_RULES[dims][0]), found.get(f"right{dims}", _RIGHT_RULES[dims][0])
                position = _fill_positions(position, valid, prompt_width, *rules)
                value = position.squeeze(1) if dims == 2 else position
            else:  # a rollout key is the buffer's own tensor: copied, so the DataProto owns its values
                value = parts[key].clone() if layout.where[key] == "rollout" else parts[key]
            if value.shape[1:] != example.shape[1:]:
                raise ValueError(f"{key!r}: rows of shape {list(value.shape[1:])}, the template's are "
                                 f"{list(example.shape[1:])}")
            out[key] = value.to(device=example.device, dtype=example.dtype).contiguous()
        if is_weights:
            width = out["responses"].shape[1]
            existing = out.get("rollout_is_weights")
            weights = batch.weights.to(device=out["responses"].device, dtype=torch.float32)[:, None].expand(n, width)
            out["rollout_is_weights"] = weights.clone() if existing is None else existing * weights.to(existing.dtype)
        non_tensors = {key: self._column(batch, key, example) for key, example in template.non_tensor_batch.items()}
        meta = dict(template.meta_info)
        if "global_token_num" in meta:
            meta["global_token_num"] = out["attention_mask"].sum(-1).tolist()
        if "images_seqlens" in meta and "multi_modal_inputs" in non_tensors:
            meta["images_seqlens"] = [s for inputs in non_tensors["multi_modal_inputs"] if "image_grid_thw" in inputs
                                      for s in inputs["images_seqlens"].tolist()]
        return DataProto.from_dict(tensors=out, non_tensors=non_tensors, meta_info=meta)

    # ------------------------------------------------------------------------------- internals
    def _group_ids(self, data: Any, size: int) -> torch.Tensor:
        uids = getattr(data, "non_tensor_batch", {}).get("uid")
        if uids is None:  # each row its own group, below the hashed ids (which are >= 0)
            start, self._anonymous = self._anonymous, self._anonymous - size
            return torch.arange(start - 1, start - size - 1, -1, dtype=torch.int64)
        ids = {uid: _uid_group(uid) for uid in set(uids.tolist())}
        for uid, group in ids.items():
            held = self._uids.get(group)
            if held is not None and held[0] != uid:
                raise ValueError(f"'uid': {uid!r} and {held[0]!r} hash to the same group id; rename one")
        if len(set(ids.values())) != len(ids):
            raise ValueError("'uid': two uids of this batch hash to the same group id; rename one")
        return torch.tensor([ids[uid] for uid in uids.tolist()], dtype=torch.int64)

    def _remember(self, handles: Handles, data: Any, group_ids: torch.Tensor) -> None:
        columns = dict(getattr(data, "non_tensor_batch", {}))
        uids = columns.pop("uid", None)
        for i, handle in enumerate(handles):
            # A row of a 2-D numpy column is a view of the caller's array: copy it.
            row = {key: value[i].copy() if value.ndim > 1 else value[i] for key, value in columns.items()}
            self._rows[handle] = (int(group_ids[i]), row)
            if uids is not None:
                self._uids.setdefault(int(group_ids[i]), [uids[i], 0])[1] += 1

    def _forget(self, handle: tuple[int, int]) -> None:
        group, _ = self._rows.pop(handle, (None, None))
        held = self._uids.get(group)
        if held is not None:
            held[1] -= 1
            if held[1] == 0:
                del self._uids[group]

    def _column(self, batch: ReplayBatch, key: str, example: np.ndarray) -> np.ndarray:
        values = []
        for i, (handle, group) in enumerate(zip(batch.handles, batch.data["group_id"].tolist())):
            entry = self._uids.get(group) if key == "uid" else self._rows.get(handle)
            if key == "uid" and entry is None:
                raise ValueError(f"'uid': row {i} (group id {group}) was not added with a uid by this adapter")
            if key != "uid" and (entry is None or key not in entry[1]):
                raise ValueError(f"{key!r}: row {i} (slot {handle[0]}, generation {handle[1]}) has no value for it: "
                                 f"it was not added with that key by this adapter's add/compose")
            values.append(entry[0] if key == "uid" else entry[1][key])
        if example.dtype.kind in "US":  # fixed-width strings: widened when a replayed one is longer
            column = np.array(values, dtype=example.dtype.kind)
            return column.astype(np.promote_types(column.dtype, example.dtype))
        if example.dtype != object:
            return np.array(values, dtype=example.dtype).reshape(len(values), *example.shape[1:])
        column = np.empty((len(values), *example.shape[1:]), dtype=object)
        for i, value in enumerate(values):  # element by element: np.array would unpack lists
            column[i] = value
        return column
