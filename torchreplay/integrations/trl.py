"""Replay for TRL's GRPOTrainer: swap `GRPOTrainer` -> `ReplayGRPOTrainer` and `GRPOConfig` ->
`ReplayGRPOConfig`.

Every generation round, the trainer stores its fresh rollouts in `trainer.replay_buffer` and trains
on them plus replayed ones (`compose`: fresh first, then `replay_ratio` of the batch replayed, the
whole a multiple of `steps_per_generation` so that TRL's split drops no row). Replayed rows carry
their behaviour log-probs, so TRL's clipped ratio is the off-policy PPO ratio, and their IS weight
is folded into the advantage. That is exact for every policy loss TRL 1.16 offers (grpo, bnpo,
dr_grpo, dapo, luspo, cispo, sapo, vespo): each is A times a term that depends on A only through its
sign, and a weight w > 0 keeps the sign. The KL term and the entropy bonus carry no A: for rows with
w != 1 the trainer adds the difference to TRL's loss (trl_loss.py), so that each row's whole
contribution is times w. With `use_vllm=True`, each rollout's vLLM sampling log-probs and
`importance_sampling_ratio` are stored and replayed with it (trl_vllm.py), so TRL's vLLM IS
correction treats replayed rows as fresh ones.

TRL private names this module uses (tested against trl 1.16): `_generate_and_score_completions`
(overridden: the one place a generation batch exists), `_get_per_token_logps_and_entropies` (the
behaviour log-probs TRL skips computing when its own schedule makes them equal to the current
policy's; wrapped to keep the loss forward's outputs), `_compute_loss` (wrapped: the KL and entropy
weights) and `_last_world_entropy` (the adaptive entropy gate). Metrics go through `Trainer.log`, checkpoints through a `TrainerCallback.on_save` and
`train(resume_from_checkpoint=...)`: public hooks.

The policy version is `trainer.state.global_step` (optimizer steps), taken when a round generates.
"""

from __future__ import annotations

import json
import logging
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

try:
    from transformers import TrainerCallback
    from transformers.trainer_utils import get_last_checkpoint
    from trl import GRPOConfig, GRPOTrainer
    from trl import __version__ as trl_version
    from trl.models.utils import disable_gradient_checkpointing
    from trl.trainer.utils import get_config_model_id
except ImportError as exc:  # pragma: no cover - only without the extra
    raise ImportError("torchreplay.integrations.trl needs TRL: pip install 'torchreplay[trl]'") from exc

from torchreplay import Checkpointer, PrioritizedSampler, RolloutBuffer, Sampler, UniformSampler, from_padded
from torchreplay.integrations import trl_vllm
from torchreplay.integrations.trl_loss import entropy_coefficient, weight_correction

TESTED_TRL = ((1, 16), (1, 17))  # [low, high): the overridden private methods are TRL 1.16's


def _check_trl_version(version: str) -> None:
    parts = tuple(int(x) for x in version.split(".")[:2] if x.isdigit())
    if len(parts) == 2 and not TESTED_TRL[0] <= parts < TESTED_TRL[1]:
        warnings.warn(f"torchreplay.integrations.trl is tested with trl 1.16, found {version}: it overrides TRL "
                      "internals that may have changed", stacklevel=3)

_check_trl_version(trl_version)

__all__ = ["ReplayGRPOConfig", "ReplayGRPOTrainer", "from_grpo_outputs", "to_grpo_inputs"]

# What `_generate_and_score_completions` may return that replay knows how to carry. Anything else
# (images, tool masks) would be lost on replayed rows, so it is refused. With use_vllm=True the
# trainer also carries vLLM's sampling log-probs and IS ratios (trl_vllm.py).
_KNOWN_KEYS = {"prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages",
               "num_items_in_batch", "old_per_token_logps", "ref_per_token_logps"}
_VLLM_KEYS = {trl_vllm.SAMPLING_KEY, trl_vllm.RATIO_KEY}
logger = logging.getLogger(__name__)
POINTER_FILE = "replay_buffer.json"
LOCAL_DIR = "replay_buffer"


@dataclass
class ReplayGRPOConfig(GRPOConfig):
    """GRPOConfig plus replay settings (docs/integrations.md)."""

    replay_ratio: float = field(default=0.5, metadata={"help": "Fraction of each trained batch that is replayed (0 <= r < 1)."})
    replay_capacity: int = field(default=4096, metadata={"help": "Rollouts the buffer holds (per process)."})
    # Typed str so that TRL's command-line parser accepts it; a Sampler object works from Python.
    replay_sampler: str = field(default="prioritized", metadata={"help": "'uniform', 'prioritized' or a torchreplay Sampler."})
    replay_alpha: float | None = field(default=None, metadata={"help": "PrioritizedSampler alpha (None: its default)."})
    replay_beta: float | None = field(default=None, metadata={"help": "PrioritizedSampler IS exponent (None: its default)."})
    max_staleness: int | None = field(default=4, metadata={"help": "Oldest policy version replayed, in optimizer steps."})
    max_reuse: int | None = field(default=4, metadata={"help": "Training batches a rollout is drawn into, its fresh one included (each is trained num_iterations times)."})
    replay_spill_dir: str | None = field(default=None, metadata={"help": "Directory for rollouts past the RAM budget."})
    replay_checkpoint_uri: str | None = field(default=None, metadata={"help": "s3:// or file:// store for buffer checkpoints; None: inside each checkpoint-N."})

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe for TRL's loggers: a Sampler object is written as its class name."""
        out = super().to_dict()
        if not isinstance(self.replay_sampler, str):
            out["replay_sampler"] = type(self.replay_sampler).__name__
        return out

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.replay_ratio < 1:
            raise ValueError(f"replay_ratio must be in [0, 1), got {self.replay_ratio}")
        if isinstance(self.replay_sampler, str) and self.replay_sampler not in ("uniform", "prioritized"):
            raise ValueError(f"replay_sampler must be 'uniform', 'prioritized' or a Sampler, got {self.replay_sampler!r}")


def default_output_dir(model: Any) -> str:
    """The output_dir GRPOTrainer gives its default config: `<model name>-GRPO`, in the working directory."""
    name = model if isinstance(model, str) else get_config_model_id(model.config)
    return f"{name.split('/')[-1]}-GRPO"


def make_sampler(args: ReplayGRPOConfig) -> Sampler:
    if not isinstance(args.replay_sampler, str):
        return args.replay_sampler
    if args.replay_sampler == "uniform":
        return UniformSampler()
    kwargs = {k: v for k, v in (("alpha", args.replay_alpha), ("beta", args.replay_beta)) if v is not None}
    return PrioritizedSampler(**kwargs)


def from_grpo_outputs(outputs: dict[str, Any], *, group_id: torch.Tensor, policy_version: int,
                      logprobs: torch.Tensor | None = None,
                      vllm_importance_sampling_mode: str | None = None) -> dict[str, Any]:
    """A batch for `RolloutBuffer.add`/`compose` from `_generate_and_score_completions`' output:
    its padded ids and masks, `advantages` [B], behaviour log-probs (`old_per_token_logps`, or
    `logprobs` when TRL computed none), `ref_per_token_logps` when present, and vLLM's
    `sampling_per_token_logps` and `importance_sampling_ratio` when present (the buffer needs
    `trl_vllm.vllm_fields(...)` declared; the ratio's layout follows
    `vllm_importance_sampling_mode`, which must then be given)."""
    behaviour = outputs.get("old_per_token_logps") if logprobs is None else logprobs
    if behaviour is None:
        raise ValueError("logprobs: TRL computed no old_per_token_logps; pass the behaviour log-probs")
    advantages = outputs["advantages"]
    if advantages.dim() != 1:
        raise ValueError(f"advantages: expected one per rollout [B], got shape {tuple(advantages.shape)}")
    # A completion masked out entirely (mask_truncated_completions) trains nothing: stored with
    # advantage 0, so that a prioritized sampler never spends a replay slot on it. Its loss is 0
    # whatever its advantage, so the fresh batch is unchanged.
    advantages = advantages.masked_fill(~outputs["completion_mask"].bool().any(1), 0.0)
    extra = {}
    if outputs.get("ref_per_token_logps") is not None:
        extra["ref_logprobs"] = outputs["ref_per_token_logps"].detach().float()
    extra.update(trl_vllm.to_fields(outputs, vllm_importance_sampling_mode))
    return from_padded(outputs["prompt_ids"], outputs["prompt_mask"], outputs["completion_ids"],
                       outputs["completion_mask"], behaviour.detach().float(), advantage=advantages.detach().float(),
                       group_id=group_id, policy_version=policy_version, **extra)


def to_grpo_inputs(batch, device: torch.device | str | None = None, *, masked_is_ratio: float = 1.0) -> dict[str, Any]:
    """TRL's loss inputs from a `ReplayBatch`: the IS weight folded into `advantages` (exact for
    TRL's policy losses, see the module docstring), `old_per_token_logps` the behaviour log-probs,
    and each row's stored vLLM `sampling_per_token_logps` and `importance_sampling_ratio` when the
    buffer holds them (a token-level ratio is `masked_is_ratio` where `completion_mask` is 0:
    `trl_vllm.masked_position_ratio`); `replay_weights`, `replay_is_fresh` and
    `replay_policy_version` ride along (TRL's own loss ignores them; ReplayGRPOTrainer's reads
    `replay_weights`). `num_items_in_batch` is this process's; a trainer sums it over processes."""
    parts = batch.split(prompt_side="left")
    if parts["completion_ids"].shape[1] == 0:  # every completion masked out: TRL needs one column to slice
        for key in ("completion_ids", "completion_mask", "logprobs", "ref_logprobs"):
            if key in parts:
                parts[key] = torch.nn.functional.pad(parts[key], (0, 1), value=batch.pad_token_id if key == "completion_ids" else 0)
        trl_vllm.pad_completion_columns(parts, 1)
    out = {
        "prompt_ids": parts["prompt_ids"].long(),
        "prompt_mask": parts["prompt_mask"],
        "completion_ids": parts["completion_ids"].long(),
        "completion_mask": parts["completion_mask"],
        "advantages": parts["advantage"] * parts["weights"],
        "old_per_token_logps": parts["logprobs"],
        "num_items_in_batch": parts["completion_mask"].sum(),
        "replay_weights": parts["weights"],
        "replay_is_fresh": parts["is_fresh"],
        "replay_policy_version": parts["policy_version"],
    }
    if "ref_logprobs" in parts:
        out["ref_per_token_logps"] = parts["ref_logprobs"]
    out.update(trl_vllm.to_inputs(parts, batch.token_fields, masked_is_ratio))
    return {k: v.to(device) if device is not None else v for k, v in out.items()}


class _SaveReplayBuffer(TrainerCallback):
    """Saves the buffer next to every TRL checkpoint, under the checkpoint's step as tag."""

    def __init__(self, trainer: "ReplayGRPOTrainer") -> None:
        self.trainer = trainer

    def on_save(self, args, state, control, **kwargs):
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        self.trainer.save_replay_buffer(folder, state.global_step)


class ReplayGRPOTrainer(GRPOTrainer):
    """GRPOTrainer with rollout replay; same constructor. `replay_buffer` is its RolloutBuffer."""

    def __init__(self, model: Any, reward_funcs: Any = None, args: ReplayGRPOConfig | None = None,
                 *rest: Any, **kwargs: Any) -> None:
        if args is None:
            args = ReplayGRPOConfig(default_output_dir(model))
        if not isinstance(args, ReplayGRPOConfig):
            raise TypeError(f"args must be a ReplayGRPOConfig, got {type(args).__name__}")
        # Refuse what the config alone rules out before TRL loads models for it.
        self._check_config(args)
        super().__init__(model, reward_funcs, args, *rest, **kwargs)
        self._check_supported()
        self._warn_if_saves_split_rounds()
        self._group_base = 0
        self.replay_buffer = self._new_buffer()
        self.add_callback(_SaveReplayBuffer(self))

    # --------------------------------------------------------------------------- configuration
    def _check_supported(self) -> None:
        refuse = []
        if self.tools or self.environment_factories is not None:
            refuse.append("tools / environments (tool masks are not stored for replay)")
        if hasattr(self.processing_class, "image_processor"):
            refuse.append("vision-language models (images are not stored for replay)")
        if refuse:
            raise ValueError("ReplayGRPOTrainer does not support: " + "; ".join(refuse))

    def _warn_if_saves_split_rounds(self) -> None:
        """TRL's checkpoints keep no generated-but-untrained batch, so a run resumed from a save
        inside a generation round generates that round again; its buffer then differs from an
        uninterrupted run's (more fresh rollouts). Saves on round boundaries resume exactly."""
        a = self.args
        every = a.steps_per_generation * self.num_iterations
        if a.save_strategy == "steps" and isinstance(a.save_steps, int) \
                and (a.save_steps * a.gradient_accumulation_steps) % every:
            logger.warning(
                "save_steps=%d x gradient_accumulation_steps=%d is not a multiple of steps_per_generation x "
                "num_iterations = %d: a run resumed from such a checkpoint regenerates the interrupted round, so "
                "its replay buffer will differ from an uninterrupted run's", a.save_steps,
                a.gradient_accumulation_steps, every)

    @classmethod
    def _check_config(cls, args: ReplayGRPOConfig) -> None:
        cls._vllm_fields(args)  # an IS mode replay cannot lay out, before TRL starts a vLLM engine

    @staticmethod
    def _vllm_fields(args: ReplayGRPOConfig) -> dict[str, Any]:
        return trl_vllm.vllm_fields(args.use_vllm, args.vllm_importance_sampling_correction,
                                    args.vllm_importance_sampling_mode)

    @property
    def _masked_is_ratio(self) -> float:
        a = self.args
        return trl_vllm.masked_position_ratio(a.vllm_importance_sampling_mode, a.vllm_importance_sampling_clip_min,
                                              a.vllm_importance_sampling_clip_max)

    def _storage(self):
        from torchreplay import TieredStorage

        spill = self.args.replay_spill_dir
        if not spill:
            return None
        if self._rank:  # shard file names count from 0 in every process
            spill = os.path.join(spill, self._rank)
        return TieredStorage(spill_dir=spill)

    def _checkpointer(self) -> Checkpointer | None:
        """Background checkpoints to `replay_checkpoint_uri`; TRL's `save_total_limit` also bounds
        the tags kept there, as it bounds the checkpoint-N folders."""
        uri = self.args.replay_checkpoint_uri
        return Checkpointer(self._rank_uri(uri), keep_tags=self.args.save_total_limit) if uri else None

    def _new_buffer(self) -> RolloutBuffer:
        a = self.args
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        return RolloutBuffer(
            a.replay_capacity, sampler=make_sampler(a), max_staleness=a.max_staleness, max_reuse=a.max_reuse,
            padding_side="right", pad_token_id=tokenizer.pad_token_id or 0, ref_logprobs=a.beta != 0.0,
            extra_fields=self._vllm_fields(a) or None, storage=self._storage(), checkpoint=self._checkpointer(),
            seed=a.seed + self.accelerator.process_index)

    @property
    def _rank(self) -> str:
        """This process's name in per-process paths; empty on a single process."""
        return f"rank{self.accelerator.process_index}" if self.accelerator.num_processes > 1 else ""

    def _rank_uri(self, uri: str) -> str:
        return uri.rstrip("/") + f"/{self._rank}" if self._rank else uri

    # --------------------------------------------------------------------------- the replay step
    def _generate_and_score_completions(self, inputs):
        outputs = super()._generate_and_score_completions(inputs)
        if not self.model.training:
            return outputs
        return self._with_replay(outputs)

    def _with_replay(self, outputs: dict[str, Any]) -> dict[str, Any]:
        known = _KNOWN_KEYS | _VLLM_KEYS if self.args.use_vllm else _KNOWN_KEYS
        unknown = {k for k, v in outputs.items() if v is not None} - known
        if unknown:
            raise ValueError(f"ReplayGRPOTrainer cannot replay rollouts with {sorted(unknown)}")
        if self.args.use_vllm and outputs.get(trl_vllm.SAMPLING_KEY) is None:
            raise ValueError(f"ReplayGRPOTrainer with use_vllm=True stores each rollout's {trl_vllm.SAMPLING_KEY}, "
                             "and this generation output has none (a rollout_func that returns logprobs=None?)")
        device = self.accelerator.device
        logprobs = outputs.get("old_per_token_logps")
        if logprobs is None:
            logprobs = self._behaviour_logprobs(outputs)
        n = outputs["prompt_ids"].shape[0]
        world_rows = n * self.accelerator.num_processes
        # Groups are consecutive rows of the global batch (TRL's RepeatSampler), numbered uniquely over rounds.
        rows = self.accelerator.process_index * n + torch.arange(n)
        group_id = self._group_base + torch.div(rows, self.num_generations, rounding_mode="floor")
        self._group_base += -(-world_rows // self.num_generations)
        fresh = from_grpo_outputs(outputs, group_id=group_id, policy_version=self.state.global_step,
                                  logprobs=logprobs,
                                  vllm_importance_sampling_mode=self.args.vllm_importance_sampling_mode)
        ratio = self.args.replay_ratio
        n_replay = round(n * ratio / (1 - ratio))
        batch = self.replay_buffer.compose(fresh, n_replay=n_replay, multiple_of=self.args.steps_per_generation)
        batch = self._same_size_on_every_process(batch, n)
        mixed = to_grpo_inputs(batch, device, masked_is_ratio=self._masked_is_ratio)
        if self.beta != 0.0 and self.args.sync_ref_model:
            self._refresh_reference_logprobs(mixed)
        if isinstance(self.pad_to_multiple_of, int):  # TRL's own shapes, for backends compiled per shape
            self._pad_widths(mixed, self.pad_to_multiple_of, batch.pad_token_id,
                             trl_vllm.token_pad_values(self.args.vllm_importance_sampling_mode, self._masked_is_ratio))
        mixed["num_items_in_batch"] = self.accelerator.gather(mixed["num_items_in_batch"].reshape(1)).sum()
        return mixed

    @staticmethod
    def _pad_widths(mixed: dict[str, Any], multiple: int, pad_token_id: int,
                    token_pads: dict[str, float] | None = None) -> None:
        """Prompts (left) and completions (right) padded to a multiple of `multiple`, as TRL pads;
        `token_pads`: more completion-aligned keys, with their padding values."""
        pad = torch.nn.functional.pad
        prompt_extra = -mixed["prompt_ids"].shape[1] % multiple
        completion_extra = -mixed["completion_ids"].shape[1] % multiple
        mixed["prompt_ids"] = pad(mixed["prompt_ids"], (prompt_extra, 0), value=pad_token_id)
        mixed["prompt_mask"] = pad(mixed["prompt_mask"], (prompt_extra, 0))
        mixed["completion_ids"] = pad(mixed["completion_ids"], (0, completion_extra), value=pad_token_id)
        for key in ("completion_mask", "old_per_token_logps", "ref_per_token_logps"):
            if key in mixed:
                mixed[key] = pad(mixed[key], (0, completion_extra))
        for key, value in (token_pads or {}).items():
            if key in mixed:
                mixed[key] = pad(mixed[key], (0, completion_extra), value=value)

    # --------------------------------------------------------------------------- the loss
    def _compute_loss(self, model, inputs):
        """TRL's loss, plus the KL and entropy parts of replayed rows' IS weights (trl_loss.py)."""
        weights = inputs.get("replay_weights")
        coef = entropy_coefficient(self)
        if weights is None or (self.beta == 0.0 and coef == 0.0) or bool((weights == 1).all()):
            return super()._compute_loss(model, inputs)
        self._forward_outputs = []
        try:
            loss = super()._compute_loss(model, inputs)
            (logps, entropies), = self._forward_outputs
        finally:
            self._forward_outputs = None
        return loss + weight_correction(self, inputs, logps, entropies, coef)

    def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any):
        out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if getattr(self, "_forward_outputs", None) is not None:  # inside _compute_loss: its one forward
            self._forward_outputs.append(out[:2])
        return out

    @torch.no_grad()
    def _refresh_reference_logprobs(self, mixed: dict[str, Any]) -> None:
        """TRL's SyncRefModelCallback moves the reference model at the end of every optimizer step
        that is a multiple of `ref_model_sync_steps`. A replayed row generated before the latest sync
        holds the old reference's log-probs: recompute them with the current reference model."""
        every = self.args.ref_model_sync_steps
        last_sync = self.state.global_step // every * every
        stale = ~mixed["replay_is_fresh"] & (mixed["replay_policy_version"] < last_sync)
        if not bool(stale.any()):
            return
        rows = torch.nonzero(stale).flatten()
        ids = torch.cat([mixed["prompt_ids"][rows], mixed["completion_ids"][rows]], dim=1)
        mask = torch.cat([mixed["prompt_mask"][rows], mixed["completion_mask"][rows]], dim=1)
        ref, _, _ = self._get_per_token_logps_and_entropies(
            self.ref_model, ids, mask, mixed["completion_ids"].shape[1],
            batch_size=self.args.per_device_train_batch_size)
        mixed["ref_per_token_logps"][rows] = ref.to(mixed["ref_per_token_logps"].dtype)

    @torch.no_grad()
    def _behaviour_logprobs(self, outputs: dict[str, Any]) -> torch.Tensor:
        """TRL skips old log-probs when its schedule makes them the current policy's; replay needs
        them stored, so compute them once, with the policy that generated the rollouts."""
        ids = torch.cat([outputs["prompt_ids"], outputs["completion_ids"]], dim=1)
        mask = torch.cat([outputs["prompt_mask"], outputs["completion_mask"]], dim=1)
        with disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            logps, _, _ = self._get_per_token_logps_and_entropies(
                self.model, ids, mask, outputs["completion_ids"].shape[1],
                batch_size=self.args.per_device_train_batch_size)
        return logps

    def _same_size_on_every_process(self, batch, n_fresh: int):
        """TRL gathers per-row metrics across processes, which needs equal row counts; a process
        whose caps left fewer replayable rollouts sets the count for all. Rows cut here were drawn
        (their use counted) but are not trained on."""
        if self.accelerator.num_processes == 1:
            return batch
        size = torch.tensor([len(batch)], device=self.accelerator.device)
        smallest = int(self.accelerator.gather(size).min())
        if smallest == len(batch):
            return batch
        keep = torch.arange(smallest)
        return batch.__class__(
            data={k: v[keep] for k, v in batch.data.items()},
            handles=type(batch.handles)(batch.handles.slot[keep], batch.handles.generation[keep]),
            weights=batch.weights[keep], age=batch.age[keep], reuse=batch.reuse[keep],
            is_fresh=batch.is_fresh[keep], token_fields=batch.token_fields, pad_token_id=batch.pad_token_id)

    # --------------------------------------------------------------------------- metrics
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.model is not None and self.model.training and "loss" in logs:
            m = self.replay_buffer.metrics()
            for key in ("size", "reuse_mean", "age_mean", "age_max", "ess_fraction", "replay_weight_mean",
                        "sampled_fresh", "sampled_replay", "evicted_reuse", "evicted_staleness", "evicted_capacity",
                        "checkpoint_failures", "checkpoint_lag_s"):
                # NaN (e.g. the replayed rows' mean weight before any replay) is left out, as TRL does.
                if key in m and not math.isnan(float(m[key])):
                    logs[f"replay/{key}"] = float(m[key])
        super().log(logs, start_time)

    # --------------------------------------------------------------------------- checkpoints
    def save_replay_buffer(self, folder: str, step: int) -> None:
        """The buffer under tag `step`: into `replay_checkpoint_uri` when set (a pointer file in
        `folder` names it), else self-contained in `folder/replay_buffer` (so that TRL's
        `save_total_limit` rotation removes it with its checkpoint)."""
        os.makedirs(folder, exist_ok=True)
        suffix = f".{self._rank}" if self._rank else ""
        if self.args.replay_checkpoint_uri:
            uri = self._rank_uri(self.args.replay_checkpoint_uri)
            self.replay_buffer.checkpoint(tag=str(step))
        else:
            local = os.path.join(os.path.abspath(folder), LOCAL_DIR + suffix)
            uri = None
            checkpointer = Checkpointer(f"file://{local}", interval_s=float("inf"))
            previous = self.replay_buffer.detach_checkpointer()
            try:
                self.replay_buffer.attach_checkpointer(checkpointer)
                self.replay_buffer.checkpoint(tag=str(step))
            finally:
                self.replay_buffer.detach_checkpointer()
                checkpointer.close(final=False)
                if previous is not None:
                    self.replay_buffer.attach_checkpointer(previous)
        pointer = {"uri": uri, "local_dir": None if uri else LOCAL_DIR + suffix, "tag": str(step),
                   "group_base": self._group_base}
        with open(os.path.join(folder, POINTER_FILE.replace(".json", f"{suffix}.json")), "w") as f:
            json.dump(pointer, f)

    def load_replay_buffer(self, folder: str) -> bool:
        """Replace the buffer with the one saved with TRL checkpoint `folder`. A checkpoint saved
        without one (plain TRL, another world size, a crash between TRL's save and the buffer's)
        logs a warning and keeps the empty buffer; returns whether a buffer was restored."""
        suffix = f".{self._rank}" if self._rank else ""
        path = os.path.join(folder, POINTER_FILE.replace(".json", f"{suffix}.json"))
        if not os.path.exists(path):
            logger.warning("%s holds no replay buffer (%s): resuming with an empty one", folder, os.path.basename(path))
            return False
        with open(path) as f:
            pointer = json.load(f)
        uri = pointer["uri"] or f"file://{os.path.join(os.path.abspath(folder), pointer['local_dir'])}"
        a = self.args
        # The empty buffer's checkpointer goes first, unpublished: a final manifest of it would become
        # the store's newest, and its manifest numbers would collide with the restored buffer's.
        previous = self.replay_buffer.detach_checkpointer()
        if previous is not None:
            previous.close(final=False)
        restored = RolloutBuffer.from_checkpoint(
            uri, tag=pointer["tag"], sampler=make_sampler(a) if not isinstance(a.replay_sampler, str) else None,
            storage=self._storage(), checkpoint=self._checkpointer() or False, progress=False)
        stored, wanted = dict(restored.settings.extra_fields or {}), self._vllm_fields(a)
        if stored != wanted:  # e.g. saved without vLLM, or with a sequence-level IS mode, resumed otherwise
            checkpointer = restored.detach_checkpointer()
            if checkpointer is not None:
                checkpointer.close(final=False)  # publishes nothing over the store the buffer came from
            restored.close()
            raise ValueError(f"{folder}: its replay buffer stores the extra fields {sorted(stored)}, and this config "
                             f"(use_vllm={a.use_vllm}, vllm_importance_sampling_mode={a.vllm_importance_sampling_mode!r}) "
                             f"needs {sorted(wanted)}: resume with the config the checkpoint was trained with")
        self.replay_buffer.close()
        self.replay_buffer = restored
        self._group_base = int(pointer["group_base"])
        return True

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        folder = resume_from_checkpoint
        if folder is True:
            folder = get_last_checkpoint(self.args.output_dir)
        if isinstance(folder, str):
            self.load_replay_buffer(folder)
        return super().train(resume_from_checkpoint, *args, **kwargs)
