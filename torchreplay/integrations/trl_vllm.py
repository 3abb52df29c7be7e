"""vLLM's sampling log-probs and IS ratios on replayed rows (TRL 1.16, `use_vllm=True`).

With vLLM generating, TRL's generation output carries two more keys, and its loss reads them:
- `sampling_per_token_logps` [B, T]: the log-probs vLLM sampled each token with (NaN where vLLM
  could not score a token). The off-policy mask (`off_policy_mask_threshold`) compares them with
  the current policy's.
- `importance_sampling_ratio` (with `vllm_importance_sampling_correction`): exp(trainer log-prob -
  vLLM log-prob) at generation time, truncated or masked by `vllm_importance_sampling_mode`'s
  bounds; [B, 1] for the sequence modes, [B, T] for the token modes. Every policy loss but vespo
  multiplies its per-token loss by it; vespo adds its log to its sequence log-ratio.

Both are properties of the rollout as generated, like its behaviour log-probs, so they are stored
with it and handed back unchanged when it is replayed: TRL's correction then treats fresh and
replayed rows alike. A replayed row's ratio is pi_old / pi_vLLM at generation time and its PPO
ratio pi_theta / pi_old, so together they are pi_theta / pi_vLLM, as for a fresh row trained for a
second iteration.

Stored fields: `vllm_logprobs` (token) and `vllm_is_ratio` (token for the token modes; rollout, one
per row, for the sequence modes). The buffer keeps token floats finite, but these may hold NaN (vLLM)
or inf (a ratio with no upper bound), so each token field has a `<name>_nonfinite` companion
(uint8: 0 finite, 1 NaN, 2 +inf, 3 -inf) and the value 0 in its place; the round trip is exact.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from torchreplay.schema import ROLLOUT, TOKEN, FieldSpec

SAMPLING_KEY = "sampling_per_token_logps"
RATIO_KEY = "importance_sampling_ratio"
SAMPLING_FIELD = "vllm_logprobs"
RATIO_FIELD = "vllm_is_ratio"
NONFINITE = "_nonfinite"  # suffix of a token field's companion codes
SEQUENCE_MODES = ("sequence_mask", "sequence_truncate")
TOKEN_MODES = ("token_mask", "token_truncate")
_SPECIAL = ((1, float("nan")), (2, float("inf")), (3, float("-inf")))


def _token_pair(name: str) -> dict[str, FieldSpec]:
    return {name: FieldSpec(name, TOKEN, torch.float32),
            name + NONFINITE: FieldSpec(name + NONFINITE, TOKEN, torch.uint8, accept="int")}


def vllm_fields(use_vllm: bool, correction: bool, mode: str) -> dict[str, FieldSpec]:
    """The extra fields a buffer needs for a TRL config's vLLM outputs (none without vLLM)."""
    if not use_vllm:
        return {}
    fields = _token_pair(SAMPLING_FIELD)
    if correction:
        if mode in SEQUENCE_MODES:
            fields[RATIO_FIELD] = FieldSpec(RATIO_FIELD, ROLLOUT, torch.float32)
        elif mode in TOKEN_MODES:
            fields.update(_token_pair(RATIO_FIELD))
        else:
            raise ValueError(f"vllm_importance_sampling_mode: unknown mode {mode!r} "
                             f"(TRL 1.16 has {', '.join(SEQUENCE_MODES + TOKEN_MODES)})")
    return fields


def masked_position_ratio(mode: str, clip_min: float | None, clip_max: float | None) -> float:
    """The ratio TRL's correction gives a token outside the completion mask (and TRL's padding): its
    log-ratio is 0, so 1, then truncated or masked by the mode's bounds like any other."""
    if mode in ("sequence_truncate", "token_truncate"):
        low = 1.0 if clip_min is None else max(1.0, clip_min)
        return low if clip_max is None else min(low, clip_max)  # torch.clamp: the upper bound wins
    outside = (clip_min is not None and 1.0 < clip_min) or (clip_max is not None and 1.0 > clip_max)
    return 0.0 if outside else 1.0


def _encode(name: str, values: torch.Tensor) -> dict[str, torch.Tensor]:
    values = values.detach().float()
    codes = torch.zeros(values.shape, dtype=torch.uint8, device=values.device)
    for code, special in _SPECIAL:
        codes.masked_fill_(torch.isnan(values) if math.isnan(special) else values == special, code)
    return {name: values.masked_fill(codes != 0, 0.0), name + NONFINITE: codes}


def _decode(values: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    out = values.clone()
    for code, special in _SPECIAL:
        out.masked_fill_(codes == code, special)
    return out


def to_fields(outputs: dict[str, Any], mode: str | None) -> dict[str, torch.Tensor]:
    """The stored fields for a generation output's vLLM keys ([B, T] token fields for `from_padded`,
    the sequence ratio as [B]). `mode`: TRL's `vllm_importance_sampling_mode`, which the ratio's
    shape depends on; needed when the output carries a ratio."""
    fields: dict[str, torch.Tensor] = {}
    n, width = outputs["completion_ids"].shape
    sampling = outputs.get(SAMPLING_KEY)
    if sampling is not None:
        if sampling.shape != (n, width):
            raise ValueError(f"{SAMPLING_KEY}: expected [B, T] = {(n, width)}, got {tuple(sampling.shape)}")
        fields.update(_encode(SAMPLING_FIELD, sampling))
    ratio = outputs.get(RATIO_KEY)
    if ratio is not None:
        if mode in SEQUENCE_MODES:
            if ratio.shape != (n, 1):
                raise ValueError(f"{RATIO_KEY}: mode {mode!r} gives one ratio per row [B, 1] = {(n, 1)}, got "
                                 f"{tuple(ratio.shape)}")
            fields[RATIO_FIELD] = ratio.detach().float().reshape(n)
        elif mode in TOKEN_MODES:
            if ratio.shape != (n, width):
                raise ValueError(f"{RATIO_KEY}: mode {mode!r} gives one ratio per token [B, T] = {(n, width)}, got "
                                 f"{tuple(ratio.shape)}")
            fields.update(_encode(RATIO_FIELD, ratio))
        else:
            raise ValueError(f"vllm_importance_sampling_mode: needed to store {RATIO_KEY} (its shape depends on "
                             f"it), got {mode!r}")
    return fields


def pad_completion_columns(parts: dict[str, torch.Tensor], extra: int) -> None:
    """Widen the stored vLLM token fields of `split`'s output by `extra` right-padded columns."""
    for name in (SAMPLING_FIELD, SAMPLING_FIELD + NONFINITE, RATIO_FIELD, RATIO_FIELD + NONFINITE):
        if name in parts and parts[name].dim() == 2:
            parts[name] = torch.nn.functional.pad(parts[name], (0, extra))


def to_inputs(parts: dict[str, torch.Tensor], token_fields: tuple[str, ...],
              masked_ratio: float) -> dict[str, torch.Tensor]:
    """TRL's vLLM loss inputs from `split`'s output: the stored values, NaN/inf restored; a token
    ratio is `masked_ratio` (see `masked_position_ratio`) where `completion_mask` is 0, as TRL has it."""
    out = {}
    if SAMPLING_FIELD in parts:
        out[SAMPLING_KEY] = _decode(parts[SAMPLING_FIELD], parts[SAMPLING_FIELD + NONFINITE])
    if RATIO_FIELD in parts:
        if RATIO_FIELD in token_fields:
            ratio = _decode(parts[RATIO_FIELD], parts[RATIO_FIELD + NONFINITE])
            out[RATIO_KEY] = ratio.masked_fill(parts["completion_mask"] == 0, masked_ratio)
        else:
            out[RATIO_KEY] = parts[RATIO_FIELD].unsqueeze(-1)
    return out


def token_pad_values(mode: str, masked_ratio: float) -> dict[str, float]:
    """The vLLM loss inputs laid out per token, with their right-padding values: TRL pads sampling
    log-probs with 0, and a token-level ratio's padding is outside the mask."""
    return {SAMPLING_KEY: 0.0, **({RATIO_KEY: masked_ratio} if mode in TOKEN_MODES else {})}
