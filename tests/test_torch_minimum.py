"""The declared torch minimum is the audited one (tools/torch_api_audit.py, docs/install.md).

The audit unpacked torch 2.11's wheel without installing it, found every torch name the package uses
in that torch's Python sources and stubs, and syntax-checked csrc/ against its headers. These tests
keep that true as the code changes: a torch name the package starts using must be audited first.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _audit_module():
    spec = importlib.util.spec_from_file_location("torch_api_audit", ROOT / "tools" / "torch_api_audit.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


audit = _audit_module()
RECORD = json.loads((ROOT / "tools" / "torch_api_audit.json").read_text())


def test_every_torch_name_the_package_uses_was_audited():
    """Fails when code starts using a torch name absent from the audited list, e.g. a mutation that
    calls `torch.accelerator.current_accelerator()` in buffer.py (shown: `torch.accelerator...` is
    then reported unaudited)."""
    unaudited = sorted(audit.used_names() - set(RECORD["names"]))
    assert not unaudited, (
        f"torch names not audited against torch {RECORD['minimum']}: {unaudited}. Download that wheel "
        "(pip download --no-deps torch==2.11.0 -d DIR; never install it without a GPU) and run "
        "python tools/torch_api_audit.py --wheel DIR/torch-*.whl --write")


def test_pyproject_declares_the_audited_minimum():
    text = (ROOT / "pyproject.toml").read_text()
    minimum = ".".join(RECORD["minimum"].split(".")[:2])
    declared = re.findall(r'"torch>=([0-9.]+)"', text)
    assert declared and all(v == minimum for v in declared), (declared, minimum)
    assert minimum in (ROOT / "docs" / "install.md").read_text()


def test_collector_follows_aliases_methods_and_keywords(tmp_path):
    """The collector sees through `import torch.distributed as dist` and `from torch import nn`,
    records Tensor methods and keyword names, and leaves out this package's own keywords."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "mod.py").write_text(textwrap.dedent("""
        import torch
        import torch.distributed as dist
        from torch.nn import functional as F

        def gather(slots, count_use=True):
            return slots

        def f(x, buf):
            dist.all_gather_object([], x)
            F.pad(x, (1, 0), value=0)
            y = x.new_zeros(3).cumsum(dim=0)
            buf.gather(y, count_use=False)
            return torch.special.erf(y)
    """))
    names = audit.used_names(package)
    for name in ("torch.distributed.all_gather_object", "torch.nn.functional.pad", "torch.nn.functional.pad($value)",
                 "Tensor.new_zeros", "Tensor.cumsum($dim)", "torch.special.erf", "Tensor.gather"):
        assert name in names, name
    assert "Tensor.gather($count_use)" not in names


def test_missing_names_are_reported(tmp_path):
    """Against a torch tree that lacks a name, the audit names it (the check has power)."""
    tree = tmp_path / "torch"
    tree.mkdir()
    (tree / "__init__.py").write_text("import torch\ndef cumsum(input, dim): ...\nclass Tensor:\n    def new_zeros(self): ...\n")
    missing = audit.missing_in({"torch.cumsum", "Tensor.new_zeros", "torch.cumsum($dim)", "torch.special.erf",
                                "Tensor.cumsum($dtype)"}, tree)
    assert missing == {"torch.special.erf": ["special", "erf"], "Tensor.cumsum($dtype)": ["dtype"]}
