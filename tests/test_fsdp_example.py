"""examples/fsdp_grpo.py trains under torchrun with 2 CPU processes (gloo) and prints its loss."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 240  # 2 processes importing torch and building FSDP2 on 2 shared cores


def test_fsdp_grpo_example_runs_under_torchrun():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    # --standalone: a free rendezvous port, so concurrent runs do not collide on 29500.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "examples" / "fsdp_grpo.py"), "--steps", "3"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    losses = re.findall(r"^step\s+(\d+) loss ([+-]\d+\.\d+)", proc.stdout, flags=re.MULTILINE)
    assert [int(s) for s, _ in losses] == [0, 1, 2], output[-4000:]
    assert all(abs(float(v)) < 100 for _, v in losses)
    assert "buffer: size" in proc.stdout
