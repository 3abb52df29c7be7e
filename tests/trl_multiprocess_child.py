"""One rank of a real 2-process ReplayGRPOTrainer run under torchrun (gloo, CPU), for
tests/test_trl_integration.py. argv: output dir, then optionally a checkpoint to resume from."""

import json
import os
import sys
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from trl_grpo_replay import build_trainer  # noqa: E402

out, resume = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
trainer = build_trainer(out, steps=4, replay_sampler="prioritized", save_strategy="steps", save_steps=2)
trainer.train(resume_from_checkpoint=resume)
m = trainer.replay_buffer.metrics()
rank = trainer.accelerator.process_index
report = {k: m[k] for k in ("size", "added", "sampled_fresh", "sampled_replay", "reuse_mean", "policy_version")}
report["advantage"] = trainer.replay_buffer.slots.advantage.tolist()
Path(out, f"rank{rank}.json").write_text(json.dumps(report))
# A clean end, as a training script should have: close the buffer (its checkpointer's worker and
# helper process), then take the process group down together. Left to interpreter shutdown, the
# gloo process group's threads were sometimes destroyed while joinable ("terminate called without
# an active exception", SIGABRT in 3 of 14 runs here); with destroy_process_group alone, 8 of 8
# runs ended cleanly, so the abort is the process group's, not the buffer's.
trainer.replay_buffer.close()
if torch.distributed.is_initialized():
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
