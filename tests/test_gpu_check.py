"""The GPU check's scripts, as far as a CPU machine can hold them to their promises; the whole offline
path is rehearsed by `bash benchmarks/gpu_check.sh --dry-run`, which CI runs after `make test`."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECK = ROOT / "benchmarks" / "gpu_check.sh"
WHEELS = ROOT / "benchmarks" / "gpu_wheels.sh"


def test_scripts_parse():
    for script in (CHECK, WHEELS):
        subprocess.run(["bash", "-n", str(script)], check=True)


def test_gpu_check_installs_nothing_from_the_network_and_makes_no_venv_on_the_gpu_machine():
    """Every pip install in gpu_check.sh is --no-index; the only venv is the dry run's image stand-in.
    (Mutation: restoring the old `pip install torch==2.13.0` step fails this.)"""
    text = CHECK.read_text()
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    installs = re.findall(r"pip install[^\n]*", code.replace("\\\n", " "))
    assert installs, "no pip install found: the test would check nothing"
    for install in installs:
        assert "--no-index" in install, install
    dry_block = code[code.index("if [ $DRY = 1 ]; then\n  REHEARSAL"):code.index("PY=$ROOT/$REHEARSAL/image/bin/python")]
    assert code.count("-m venv") == dry_block.count("-m venv") == 1


def test_gpu_wheels_pins_every_wheel():
    """Nothing resolves dependencies on the GPU machine, so each wheel is named with its exact version."""
    text = WHEELS.read_text()
    block = text[text.index("GPU_WHEELS=(") + len("GPU_WHEELS=("):text.index(")", text.index("GPU_WHEELS=("))]
    requirements = block.split()
    assert {"boto3", "botocore", "s3transfer", "jmespath", "kvikio-cu13", "libkvikio-cu13", "rapids-logger"} <= {
        r.split("==")[0] for r in requirements}
    assert all(re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][A-Za-z0-9.]*", r) for r in requirements), requirements


def test_memcheck_probe_runs_and_compares_on_the_cpu():
    """The probe that compute-sanitizer runs on the GPU exercises tree and buffer paths and compares
    them with the host path; on the CPU the same code must pass, so a GPU run fails only on the GPU."""
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_memcheck_probe.py"), "--device", "cpu"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "probe ok on cpu" in result.stdout
