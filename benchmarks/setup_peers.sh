#!/usr/bin/env bash
# Install the benchmark peers (cpprb, tensordict, torchrl) into an existing venv
# without ever changing its torch, and rebuild torchrl's C++ extension
# (torchrl._torchrl) against that torch: the published wheel's binary is tied to
# the torch it was built with and fails to load with a newer one.
#
# Usage: benchmarks/setup_peers.sh [VENV_PYTHON]   (default .venv/bin/python)
#
# Idempotent: peers already present are skipped, and the rebuilt extension is
# cached per (torchrl, torch, python ABI) under $TORCHREPLAY_BENCH_CACHE
# (default ~/.cache/torchreplay-bench).  A peer that fails is reported and
# skipped; the script always exits 0 so benchmarks can run with what is there.
#
# Overrides: TORCHRL_VERSION (0.14.1), TENSORDICT_SPEC, MAX_JOBS.

set -uo pipefail

PY="${1:-.venv/bin/python}"
TORCHRL_VERSION="${TORCHRL_VERSION:-0.14.1}"
# torchrl 0.14.x declares tensordict>=0.14.3,<0.15.0.
TENSORDICT_SPEC="${TENSORDICT_SPEC:-tensordict>=0.14.3,<0.15.0}"
CACHE_ROOT="${TORCHREPLAY_BENCH_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/torchreplay-bench}"
export MAX_JOBS="${MAX_JOBS:-$(nproc 2>/dev/null || echo 2)}"
export RL_WARNINGS=0

START_SECONDS=$SECONDS
declare -a INSTALLED=() SKIPPED=() FAILED=()

log() { printf '[setup_peers] %s\n' "$*"; }
note_installed() { INSTALLED+=("$1"); log "installed: $1"; }
note_skipped() { SKIPPED+=("$1"); log "skipped: $1"; }
note_failed() { FAILED+=("$1"); log "FAILED: $1"; }

summary() {
    local elapsed=$((SECONDS - START_SECONDS))
    echo
    echo "================ setup_peers summary ================"
    echo "python : $PY"
    echo "torch  : ${TORCH_VERSION:-unknown}"
    local item
    for item in "${INSTALLED[@]}"; do echo "  installed : $item"; done
    for item in "${SKIPPED[@]}"; do echo "  skipped   : $item"; done
    for item in "${FAILED[@]}"; do echo "  FAILED    : $item"; done
    if ((${#FAILED[@]})); then
        echo "note: failed peers are skipped by the benchmarks; exiting 0 anyway."
    fi
    echo "elapsed: ${elapsed}s"
    echo "====================================================="
}

if [[ ! -x "$PY" ]]; then
    log "no python at '$PY'; nothing installed."
    note_failed "all peers (venv python '$PY' not found)"
    summary
    exit 0
fi

TORCH_VERSION="$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null)"
if [[ -z "$TORCH_VERSION" ]]; then
    note_failed "all peers (torch is not importable in '$PY'; install torch first)"
    summary
    exit 0
fi
NUMPY_VERSION="$("$PY" -c 'import numpy; print(numpy.__version__)' 2>/dev/null)"

WORK="$(mktemp -d "${TMPDIR:-/tmp}/torchreplay-peers.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

# Every pip call goes through this constraints file so that no dependency
# resolution can swap the venv's torch (or numpy) for another build.
CONSTRAINTS="$WORK/constraints.txt"
{
    echo "torch==$TORCH_VERSION"
    [[ -n "$NUMPY_VERSION" ]] && echo "numpy==$NUMPY_VERSION"
} >"$CONSTRAINTS"

pip_install() { "$PY" -m pip install --quiet --disable-pip-version-check -c "$CONSTRAINTS" "$@"; }

# Prints the installed version of a distribution, or nothing.
dist_version() {
    "$PY" - "$1" <<'EOF' 2>/dev/null
import sys
from importlib.metadata import PackageNotFoundError, version
try:
    print(version(sys.argv[1]))
except PackageNotFoundError:
    pass
EOF
}

# Succeeds when the installed version of $1 satisfies the specifier $2.
dist_satisfies() {
    "$PY" - "$1" "$2" <<'EOF' >/dev/null 2>&1
import sys
from importlib.metadata import version
from packaging.specifiers import SpecifierSet
from packaging.version import Version
sys.exit(0 if Version(version(sys.argv[1])) in SpecifierSet(sys.argv[2]) else 1)
EOF
}

log "python $PY, torch $TORCH_VERSION, numpy ${NUMPY_VERSION:-missing}"

# ---------------------------------------------------------------- cpprb
if "$PY" -c 'import cpprb' >/dev/null 2>&1; then
    note_skipped "cpprb $(dist_version cpprb) (already importable)"
elif pip_install cpprb && "$PY" -c 'import cpprb' >/dev/null 2>&1; then
    note_installed "cpprb $(dist_version cpprb)"
else
    note_failed "cpprb (pip install or import failed)"
fi

# ------------------------------------------- pure-python deps of tensordict/torchrl
# These are installed with normal resolution (none of them needs torch);
# hoptorch declares torch, so it goes in with --no-deps.
PURE_DEPS=(cloudpickle packaging "pyvers>=0.2.3,<0.3.0" orjson importlib_metadata)
missing_deps=()
for spec in "${PURE_DEPS[@]}"; do
    name="${spec%%[<>=!]*}"
    if [[ "$spec" == "$name" ]]; then
        [[ -n "$(dist_version "$name")" ]] || missing_deps+=("$spec")
    else
        dist_satisfies "$name" "${spec#"$name"}" || missing_deps+=("$spec")
    fi
done
if ((${#missing_deps[@]})); then
    if pip_install "${missing_deps[@]}"; then
        note_installed "torchrl/tensordict deps: ${missing_deps[*]}"
    else
        note_failed "torchrl/tensordict deps: ${missing_deps[*]}"
    fi
else
    note_skipped "torchrl/tensordict deps (already present)"
fi
if dist_satisfies hoptorch ">=0.1.4"; then
    note_skipped "hoptorch $(dist_version hoptorch) (already present)"
elif pip_install --no-deps "hoptorch>=0.1.4"; then
    note_installed "hoptorch $(dist_version hoptorch) (--no-deps)"
else
    note_failed "hoptorch (optional for the replay-buffer paths)"
fi

# ---------------------------------------------------------------- tensordict
td_range="${TENSORDICT_SPEC#tensordict}"
if dist_satisfies tensordict "$td_range"; then
    note_skipped "tensordict $(dist_version tensordict) (already present)"
elif pip_install --no-deps "$TENSORDICT_SPEC"; then
    note_installed "tensordict $(dist_version tensordict) (--no-deps)"
else
    note_failed "tensordict ($TENSORDICT_SPEC)"
fi

# ---------------------------------------------------------------- torchrl
if [[ "$(dist_version torchrl)" == "$TORCHRL_VERSION" ]]; then
    note_skipped "torchrl $TORCHRL_VERSION (already present)"
elif pip_install --no-deps "torchrl==$TORCHRL_VERSION"; then
    note_installed "torchrl $TORCHRL_VERSION (--no-deps)"
else
    note_failed "torchrl $TORCHRL_VERSION"
fi

# ------------------------------------------------- torchrl C++ extension
ext_loads() {
    "$PY" -c 'from torchrl._torchrl import SumSegmentTreeFp32, MinSegmentTreeFp32' >/dev/null 2>&1
}

# Puts the .so given as $1 in place of torchrl's packaged extension.
install_ext() {
    "$PY" - "$1" <<'EOF'
import glob
import importlib.machinery
import importlib.util
import os
import shutil
import sys

pkg_dir = importlib.util.find_spec("torchrl").submodule_search_locations[0]
for old in glob.glob(os.path.join(pkg_dir, "_torchrl*.so")):
    os.remove(old)
dst = os.path.join(pkg_dir, "_torchrl" + importlib.machinery.EXTENSION_SUFFIXES[0])
shutil.copyfile(sys.argv[1], dst)
print(dst)
EOF
}

# Fetches torchrl's csrc (wheel first, sdist as fallback) into $WORK and prints its dir.
fetch_torchrl_csrc() {
    local dl="$WORK/dl" found
    mkdir -p "$dl"
    if "$PY" -m pip download --quiet --no-deps -d "$dl/wheel" "torchrl==$TORCHRL_VERSION" >/dev/null 2>&1; then
        "$PY" - "$dl/wheel" "$dl/wheel-x" <<'EOF' >/dev/null 2>&1
import glob, sys, zipfile
for whl in glob.glob(sys.argv[1] + "/*.whl"):
    zipfile.ZipFile(whl).extractall(sys.argv[2])
EOF
        found="$(find "$dl/wheel-x" -path '*/torchrl/csrc/pybind.cpp' 2>/dev/null | head -n1)"
    fi
    if [[ -z "${found:-}" ]] &&
        "$PY" -m pip download --quiet --no-deps --no-binary :all: -d "$dl/sdist" "torchrl==$TORCHRL_VERSION" >/dev/null 2>&1; then
        mkdir -p "$dl/sdist-x"
        for archive in "$dl"/sdist/*; do
            tar -xf "$archive" -C "$dl/sdist-x" 2>/dev/null ||
                "$PY" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$archive" "$dl/sdist-x"
        done
        found="$(find "$dl/sdist-x" -path '*/torchrl/csrc/pybind.cpp' 2>/dev/null | head -n1)"
    fi
    [[ -n "${found:-}" ]] && dirname "$found"
}

# Compiles the CPU part of torchrl's csrc (pybind.cpp + utils.cpp; the .cu files
# are only used under WITH_CUDA) against the venv's torch; prints the .so path.
build_ext() {
    local csrc="$1" build="$WORK/build"
    mkdir -p "$build"
    # cpp_extension.load drives ninja; the venv's bin comes first in case ninja
    # was pip-installed there.
    PATH="$(dirname "$PY"):$PATH" "$PY" - "$csrc" "$build" <<'EOF' >"$WORK/build.log" 2>&1
import os
import sys

from torch.utils.cpp_extension import load

csrc, build = sys.argv[1], sys.argv[2]
# -DNDEBUG: setuptools builds (like the published wheel) compile out the asserts.
load(
    name="_torchrl",
    sources=[os.path.join(csrc, "pybind.cpp"), os.path.join(csrc, "utils.cpp")],
    extra_cflags=["-O3", "-DNDEBUG"],
    build_directory=build,
    is_python_module=True,
    verbose=False,
)
EOF
    [[ -f "$build/_torchrl.so" ]] && echo "$build/_torchrl.so"
}

if [[ -z "$(dist_version torchrl)" ]]; then
    note_failed "torchrl._torchrl (torchrl not installed)"
elif ext_loads; then
    note_skipped "torchrl._torchrl rebuild (extension already loads)"
else
    soabi="$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("SOABI"))')"
    cache_so="$CACHE_ROOT/torchrl-${TORCHRL_VERSION}_torch-${TORCH_VERSION}_${soabi}/_torchrl.so"
    if [[ -f "$cache_so" ]] && install_ext "$cache_so" >/dev/null && ext_loads; then
        note_installed "torchrl._torchrl from cache ($cache_so)"
    else
        log "torchrl._torchrl does not load with torch $TORCH_VERSION; rebuilding from torchrl's csrc"
        if ! command -v ninja >/dev/null 2>&1 && [[ ! -x "$(dirname "$PY")/ninja" ]]; then
            pip_install ninja || log "could not install ninja; the build will likely fail"
        fi
        csrc="$(fetch_torchrl_csrc)"
        if [[ -z "$csrc" ]]; then
            note_failed "torchrl._torchrl (no csrc found in torchrl $TORCHRL_VERSION wheel or sdist)"
        else
            log "building from $csrc (MAX_JOBS=$MAX_JOBS; takes ~2 min on 2 cores)"
            build_start=$SECONDS
            so="$(build_ext "$csrc")"
            if [[ -n "$so" ]] && install_ext "$so" >/dev/null && ext_loads; then
                mkdir -p "$(dirname "$cache_so")" && cp "$so" "$cache_so"
                note_installed "torchrl._torchrl rebuilt against torch $TORCH_VERSION in $((SECONDS - build_start))s"
            else
                log "build log tail:"
                tail -n 15 "$WORK/build.log" 2>/dev/null | sed 's/^/    /'
                note_failed "torchrl._torchrl (rebuild failed; TorchRL tree peers will be skipped)"
            fi
        fi
    fi
fi

# ---------------------------------------------------------------- verification
# One interpreter for all checks: each torch/torchrl import costs seconds.
log "verifying imports"
verify_out="$("$PY" - "$TORCH_VERSION" <<'EOF' 2>/dev/null
import importlib
import sys

checks = [
    ("cpprb.PrioritizedReplayBuffer", "cpprb", "PrioritizedReplayBuffer"),
    ("tensordict.TensorDict", "tensordict", "TensorDict"),
    ("torchrl._torchrl.SumSegmentTreeFp32", "torchrl._torchrl", "SumSegmentTreeFp32"),
    ("torchrl._torchrl.MinSegmentTreeFp32", "torchrl._torchrl", "MinSegmentTreeFp32"),
    ("torchrl.data.TensorDictReplayBuffer", "torchrl.data", "TensorDictReplayBuffer"),
    ("torchrl.data.replay_buffers.samplers.PrioritizedSampler",
     "torchrl.data.replay_buffers.samplers", "PrioritizedSampler"),
]
for label, module, attr in checks:
    try:
        getattr(importlib.import_module(module), attr)
        print(f"ok|{label}")
    except Exception as exc:  # any failure only marks that peer unusable
        first_line = (str(exc).splitlines() or [""])[0][:160]
        print(f"FAIL|{label}|{type(exc).__name__}: {first_line}")
import torch
if torch.__version__ != sys.argv[1]:
    print(f"FAIL|torch changed from {sys.argv[1]} to {torch.__version__}; "
          f"reinstall torch=={sys.argv[1]}")
EOF
)"
if [[ -z "$verify_out" ]]; then
    FAILED+=("import checks (the verification interpreter crashed)")
fi
while IFS='|' read -r status label detail; do
    [[ -z "$status" ]] && continue
    if [[ "$status" == ok ]]; then
        log "  ok   : $label"
    else
        log "  FAIL : $label${detail:+ -> $detail}"
        FAILED+=("check: $label")
    fi
done <<<"$verify_out"

summary
exit 0
