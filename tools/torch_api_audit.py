"""Which torch APIs torchreplay uses, and whether an older torch has them.

torchreplay declares the oldest torch it supports in pyproject.toml. That minimum cannot be proved by
installing it here: the package index serves torch 2.11 only as a CUDA build (several GB with its
nvidia-* dependencies), which must not go onto a machine without a GPU. So the minimum is proved by
what the code uses, in two halves:

- Python: every torch name the package uses (dotted paths rooted at `torch`, names imported from
  torch modules, Tensor methods and attributes, keyword arguments passed to torch calls) must be
  defined in the older torch's Python sources and stubs (`*.py`, `*.pyi`, unpacked from its wheel
  without installing it). A name counts as defined if the identifier occurs as a token there; that
  catches new functions, modules, classes, methods and keywords, not changed semantics, which only
  a run on that torch can show (benchmarks/gpu_check.sh runs on the GPU image's torch 2.11).
- C++: every source in csrc/ is syntax-checked against the older torch's headers, the CPU sources as
  C++17 and the CUDA build's glue as C++20 with TORCHREPLAY_WITH_CUDA, as tools/check_cuda_compile.sh
  does against torch 2.14.1's.

The audited names are committed in tools/torch_api_audit.json; tests/test_torch_minimum.py fails when
the package starts using a torch name that is not in that list, so a new use is audited before it
lands:

    pip download --no-deps torch==2.11.0 -d /tmp/t        # the wheel only, never installed
    python tools/torch_api_audit.py --wheel /tmp/t/torch-2.11.0-*.whl --write
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import re
import subprocess
import sys
import sysconfig
import tempfile
import tokenize
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "torchreplay"
AUDIT_FILE = ROOT / "tools" / "torch_api_audit.json"


class _TorchUses(ast.NodeVisitor):
    """Collects the torch-facing names of one module.

    Local aliases are followed (`import torch.distributed as dist`, `from torch import nn`), so
    `dist.all_gather` records `torch.distributed.all_gather`. Method calls on other objects are
    recorded as `Tensor.<name>` when the running torch's Tensor has that attribute: most such calls in
    this package are on tensors, and a name shared with another type only makes the audit stricter.
    """

    def __init__(self, tensor_attrs: frozenset[str], own_params: dict[str, set[str]]) -> None:
        self.aliases: dict[str, str] = {}
        self.uses: set[str] = set()
        self.tensor_attrs = tensor_attrs
        self.own_params = own_params

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name == "torch" or alias.name.startswith("torch."):
                self.uses.add(alias.name)
                if alias.asname:
                    self.aliases[alias.asname] = alias.name
                else:
                    self.aliases["torch"] = "torch"

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if node.level == 0 and (module == "torch" or module.startswith("torch.")):
            for alias in node.names:
                path = f"{module}.{alias.name}"
                self.uses.add(path)
                self.aliases[alias.asname or alias.name] = path

    def _dotted(self, node: ast.AST) -> str | None:
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id in self.aliases:
            return ".".join([self.aliases[node.id], *reversed(parts)])
        return None

    def visit_Attribute(self, node: ast.Attribute) -> None:
        path = self._dotted(node)
        if path is not None:
            self.uses.add(path)
            return  # the inner attributes are prefixes of this path
        if node.attr in self.tensor_attrs and not node.attr.startswith("__"):
            self.uses.add(f"Tensor.{node.attr}")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        callee = self._dotted(node.func)
        if callee is None and isinstance(node.func, ast.Attribute) and node.func.attr in self.tensor_attrs:
            callee = f"Tensor.{node.func.attr}"
        if callee is not None:
            method = callee.rsplit(".", 1)[-1]
            for keyword in node.keywords:
                # buf.gather(slots, count_use=...) is this package's own method, not Tensor.gather.
                own = callee.startswith("Tensor.") and keyword.arg in self.own_params.get(method, ())
                if keyword.arg is not None and not own:
                    self.uses.add(f"{callee}(${keyword.arg})")
        self.generic_visit(node)


def used_names(package: Path = PACKAGE) -> set[str]:
    """Every torch name the package's modules use (see _TorchUses)."""
    import torch

    tensor_attrs = frozenset(name for name in dir(torch.Tensor) if not name.startswith("_"))
    trees = [ast.parse(path.read_text(), filename=str(path)) for path in sorted(package.rglob("*.py"))]
    own_params: dict[str, set[str]] = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                params = node.args.args + node.args.kwonlyargs + node.args.posonlyargs
                own_params.setdefault(node.name, set()).update(arg.arg for arg in params)
    uses: set[str] = set()
    for tree in trees:
        visitor = _TorchUses(tensor_attrs, own_params)
        visitor.visit(tree)
        uses |= visitor.uses
    # torch.ops.<namespace>.<op> are this package's own custom ops, registered by its extension.
    return {name for name in uses if not name.startswith("torch.ops.torchreplay")}


def identifiers(name: str) -> list[str]:
    """The identifiers an audited name is made of: `torch.a.b(kw)` -> torch, a, b, kw."""
    return re.findall(r"[A-Za-z_][A-Za-z0-9_]*", name)


def defined_tokens(torch_root: Path) -> set[str]:
    """Every identifier token in a torch tree's Python sources and stubs."""
    tokens: set[str] = set()
    for path in torch_root.rglob("*.py*"):
        if path.suffix not in (".py", ".pyi"):
            continue
        try:
            for token in tokenize.generate_tokens(io.StringIO(path.read_text(errors="replace")).readline):
                if token.type == tokenize.NAME:
                    tokens.add(token.string)
        except (tokenize.TokenError, SyntaxError, IndentationError):
            tokens.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", path.read_text(errors="replace")))
    return tokens


def missing_in(names: set[str], torch_root: Path) -> dict[str, list[str]]:
    """The names some of whose identifiers the torch tree at torch_root never mentions, and whose
    module paths (torch.a.b as torch/a/b.py or torch/a/b/) it lacks."""
    tokens = defined_tokens(torch_root)
    missing: dict[str, list[str]] = {}
    for name in sorted(names):
        absent = [ident for ident in identifiers(name) if ident not in tokens]
        if absent:
            missing[name] = absent
    return missing


def check_cxx(include: Path) -> list[str]:
    """Syntax-checks every C++ source against the torch headers under include; returns the failures."""
    py_inc = sysconfig.get_paths()["include"]
    flags = ["-fsyntax-only", "-fopenmp", f"-I{include}", f"-I{include}/torch/csrc/api/include", f"-I{py_inc}"]
    cuda_inc = Path("/usr/local/cuda/include")
    cpu_sources = sorted((ROOT / "csrc").glob("cpu/*.cpp")) + [ROOT / "csrc" / "ops.cpp"]
    cuda_sources = sorted((ROOT / "csrc").glob("cuda/*.cpp")) + cpu_sources
    failures = []
    jobs = [("c++17", [], src) for src in cpu_sources]
    if cuda_inc.is_dir():
        jobs += [("c++20", ["-DTORCHREPLAY_WITH_CUDA", f"-I{cuda_inc}"], src) for src in cuda_sources]
    for std, extra, src in jobs:
        result = subprocess.run(["g++", f"-std={std}", *flags, *extra, str(src)], capture_output=True, text=True)
        label = f"{src.relative_to(ROOT)} ({std}{', CUDA glue' if extra else ''})"
        print(("ok    " if result.returncode == 0 else "FAIL  ") + label)
        if result.returncode != 0:
            failures.append(label + "\n" + result.stderr[-2000:])
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wheel", type=Path, required=True, help="a torch wheel (not installed; only unpacked)")
    parser.add_argument("--write", action="store_true", help=f"record the audited names in {AUDIT_FILE.name}")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(args.wheel) as wheel:
        members = [m for m in wheel.namelist() if m.startswith("torch/")
                   and (m.endswith((".py", ".pyi")) or m.startswith("torch/include/"))]
        wheel.extractall(tmp, members)
        torch_root = Path(tmp) / "torch"
        version = re.search(r"__version__ = '([^']+)'", (torch_root / "version.py").read_text()).group(1)
        names = used_names()
        missing = missing_in(names, torch_root)
        for name, absent in missing.items():
            print(f"MISSING in torch {version}: {name} ({', '.join(absent)})")
        print(f"python: {len(names)} torch names used, {len(missing)} missing in torch {version}")
        failures = check_cxx(torch_root / "include")
        for failure in failures:
            print(failure)
    if missing or failures:
        return 1
    if args.write:
        record = {
            "minimum": version.split("+")[0],
            "checked_against": args.wheel.name,
            "how": "tools/torch_api_audit.py: identifiers in the wheel's *.py/*.pyi; csrc/ syntax-checked "
                   "against its headers (C++17 CPU sources, C++20 CUDA glue)",
            "names": sorted(names),
        }
        AUDIT_FILE.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {AUDIT_FILE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
