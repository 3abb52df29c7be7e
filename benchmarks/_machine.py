"""What every benchmark report records about the machine and the packages it measured."""

from __future__ import annotations

import platform
import sys
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def package_versions(dists: tuple[str, ...]) -> dict[str, str]:
    """Installed versions of `dists`; torchreplay also with the directory it was imported from
    (an uninstalled checkout on PYTHONPATH has no distribution metadata)."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str] = {}
    for dist in dists:
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            pass
    mod = sys.modules.get("torchreplay")
    if mod is None and "torchreplay" in dists:
        try:
            import torchreplay as mod  # noqa: PLC0415
        except Exception:  # noqa: BLE001 - a broken checkout is reported as missing
            mod = None
    if mod is not None:
        out["torchreplay"] = f"{getattr(mod, '__version__', out.get('torchreplay', '?'))} ({Path(mod.__file__ or '').parent})"
    return out
