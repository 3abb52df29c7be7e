#!/usr/bin/env bash
# The one command a GPU machine runs. It takes the machine's image as it is: its python3 and its torch
# (no venv, no torch install, no network), the wheels in .whl/ (benchmarks/gpu_wheels.sh, run
# beforehand on a machine with the package index) installed with --no-index into a target directory,
# and the extension built in place against that torch on all cores. Then, each step under its own
# time limit, the whole within about 8 minutes on a 16-core machine:
#
#   build            the extension in place (CUDA kernels for this GPU's architecture)
#   cuda_tests       every test marked cuda (tree, buffer, device tier, kvikio reads)
#   kvikio_tests     the kvikio tests, which fail rather than skip where a CUDA driver lacks kvikio
#   cpu_tests        the core CPU tests (tree, buffer, storage, contract)
#   bench_gpu_tree   P2: sample B=65536 from N=2^24 and update B=4096, against torch.multinomial and
#                    the CPU tree, alternating rounds
#   bench_device_storage  the VRAM tier and kvikio reads into device memory, against host assembly
#                    plus a copy
#   memcheck         compute-sanitizer memcheck on a short CUDA test, where compute-sanitizer works
#
# Every step's log goes to $OUT as it runs, and $OUT/summary.md is rewritten after each step, so a run
# cut short still returns what it measured. It ends with the benchmarks' ratios. Exit status: non-zero
# if a step failed.
#
#   OUT=/some/dir bash benchmarks/gpu_check.sh             # on the GPU machine
#   bash benchmarks/gpu_check.sh --dry-run                 # rehearsal on a CPU machine (CI runs it)
#
# --dry-run rehearses the same path on a machine without a GPU: an image stand-in (a Python
# environment installed with --no-index from build/gpu-rehearsal/wheels, which gpu_wheels.sh fills
# with this machine's wheels of what the GPU image has, torch 2.13.0's CPU build among them), the
# same wheel install from .whl/, the in-place build and the same step list; the CUDA steps report as
# skipped, the benchmarks run a small CPU rehearsal of their code. It ends by printing `dry run ok`.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT=${OUT:-gpu_out}
WHEELS=${WHEELS:-.whl}
SITE=${SITE:-build/gpu-site}
PY=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-470}   # the whole run; a step that would start past it is reported as not run
# A dry run's machine may have 2 cores where the GPU machine has 16: its limits stretch, since only
# the path is rehearsed there, not the time.
SLOW=1
if [ $DRY = 1 ]; then SLOW=4; BUDGET_S=$((BUDGET_S * SLOW)); fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
START=$SECONDS
status=0
SUMMARY="$OUT/summary.md"
declare -a RESULTS=()

write_summary() {
  {
    echo "# GPU check ($([ $DRY = 1 ] && echo 'dry run, no GPU' || echo "$(hostname)"))"
    echo
    echo "| step | result | seconds |"
    echo "|---|---|---:|"
    printf '%s\n' "${RESULTS[@]}"
    echo
    for bench in bench_gpu_tree bench_device_storage; do
      [ -f "$OUT/$bench.md" ] && { cat "$OUT/$bench.md"; echo; }
    done
  } >"$SUMMARY"
}

# step NAME LIMIT_S CMD...: runs CMD under a time limit, its output in $OUT/NAME.log.
step() {
  local name=$1 limit=$2; shift 2
  local elapsed=$((SECONDS - START)) t0=$SECONDS rc
  if [ $((elapsed + 5)) -ge "$BUDGET_S" ]; then
    echo "=== $name: not run (the run's ${BUDGET_S}s budget is spent)"
    RESULTS+=("| $name | not run: budget spent | 0 |"); write_summary; status=1; return
  fi
  [ $((elapsed + limit)) -gt "$BUDGET_S" ] && limit=$((BUDGET_S - elapsed))
  echo "=== $name (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  local took=$((SECONDS - t0))
  if [ $rc -eq 0 ]; then
    echo "ok: $name (${took}s)"; RESULTS+=("| $name | ok | $took |")
  else
    [ $rc -eq 124 ] || [ $rc -eq 137 ] && note="timed out after ${limit}s" || note="failed (exit $rc)"
    echo "FAILED: $name: $note (see $OUT/$name.log)"; tail -n 25 "$OUT/$name.log"
    RESULTS+=("| $name | $note | $took |"); status=1
  fi
  write_summary
}

skip() {
  echo "=== $1: skipped ($2)"; RESULTS+=("| $1 | skipped: $2 | 0 |"); write_summary
}

# --- the image (or, in a dry run, its stand-in) -------------------------------------------------
if [ $DRY = 1 ]; then
  REHEARSAL=build/gpu-rehearsal
  if [ ! -d "$REHEARSAL/wheels" ]; then
    echo "dry run: $REHEARSAL/wheels is missing: run bash benchmarks/gpu_wheels.sh first" >&2; exit 2
  fi
  # The stand-in is built once and reused; it is the GPU image's role, not a venv of the check.
  if [ ! -x "$REHEARSAL/image/bin/python" ] || [ ! -f "$REHEARSAL/image/.complete" ]; then
    rm -rf "$REHEARSAL/image"
    step image_stand_in $((300 * SLOW)) bash -c "$PY -m venv $REHEARSAL/image && $REHEARSAL/image/bin/pip install -q \
      --disable-pip-version-check --no-index --find-links $REHEARSAL/wheels torch==2.13.0 numpy pybind11 ninja \
      setuptools wheel pytest hypothesis scipy 'safetensors>=0.8' tqdm psutil && touch $REHEARSAL/image/.complete"
  fi
  PY=$ROOT/$REHEARSAL/image/bin/python
fi
{ echo "python: $($PY -c 'import sys; print(sys.version.split()[0], sys.executable)')"
  echo "cores: $(nproc)"
  nvidia-smi 2>&1 || echo "nvidia-smi: not available"
} >"$OUT/machine.txt" 2>&1
if ! $PY -c "import torch" 2>/dev/null; then
  echo "the image's $PY has no torch: nothing to check" >&2; exit 2
fi

# --- the wheels the image lacks, offline --------------------------------------------------------
if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  echo "no wheels in $WHEELS: run bash benchmarks/gpu_wheels.sh on a machine with the package index" >&2; exit 2
fi
rm -rf "$SITE"; mkdir -p "$SITE"; SITE=$(cd "$SITE" && pwd)
WHEEL_FILES=()
for whl in "$WHEELS"/*.whl; do
  # libcufile: the image's cuda-toolkit may carry it; a second copy on the path would shadow it.
  if [[ $(basename "$whl") == nvidia_cufile-* ]] && \
      $PY -c "from cuda.pathfinder import load_nvidia_dynamic_lib as load; load('cufile')" >/dev/null 2>&1; then
    echo "image has libcufile: not installing $(basename "$whl")"; continue
  fi
  WHEEL_FILES+=("$whl")
done
step wheels $((120 * SLOW)) $PY -m pip install --disable-pip-version-check -q --no-index --no-deps --target "$SITE" \
  "${WHEEL_FILES[@]}"
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
[ -d "$SITE/nvidia/cu13/lib" ] && export LD_LIBRARY_PATH="$SITE/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# Each wheel's package must now import from the target directory, not from anything else installed.
step wheels_import 60 $PY - "$SITE" <<'PY'
import importlib, sys
site = sys.argv[1]
for module in ("boto3", "botocore", "s3transfer", "jmespath"):
    path = importlib.import_module(module).__file__
    assert path.startswith(site), f"{module} imported from {path}, not from {site}"
    print(f"{module}: {path}")
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, device: {torch.cuda.is_available()}")
PY

# --- the extension, in place, against the image's torch, on all cores --------------------------
export MAX_JOBS=$(nproc)
CUDA_OK=$($PY -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
if [ "$CUDA_OK" = 1 ]; then
  # Only this GPU's architecture: the build is the longest step, and this run tests this GPU.
  TORCH_CUDA_ARCH_LIST=$($PY -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
  export TORCH_CUDA_ARCH_LIST
fi
step build $((200 * SLOW)) bash -c "$PY setup.py -q build_ext --inplace && $PY -c 'from torchreplay import _ops; print(_ops.BUILT)'"

# --- tests ---------------------------------------------------------------------------------------
CUDA_TEST_FILES=(tests/test_tree.py tests/test_buffer.py tests/test_contract.py tests/test_storage.py)
PYTEST=($PY -m pytest -q -rs -p no:cacheprovider)
if [ "$CUDA_OK" = 1 ]; then
  step cuda_tests $((90 * SLOW)) "${PYTEST[@]}" -m cuda "${CUDA_TEST_FILES[@]}"
  step kvikio_tests $((45 * SLOW)) "${PYTEST[@]}" -k kvikio tests/test_storage.py
else
  skip cuda_tests "no CUDA device"
  # Without a driver the kvikio tests skip, but they are collected and their CPU parts run.
  step kvikio_tests $((45 * SLOW)) "${PYTEST[@]}" -k kvikio tests/test_storage.py
fi
step cpu_tests $((120 * SLOW)) "${PYTEST[@]}" -x -m "not cuda" "${CUDA_TEST_FILES[@]}"

# --- benchmarks ----------------------------------------------------------------------------------
if [ "$CUDA_OK" = 1 ]; then
  step bench_gpu_tree $((60 * SLOW)) $PY benchmarks/bench_gpu_tree.py --rounds 5 --out "$OUT/bench_gpu_tree.md"
  step bench_device_storage $((75 * SLOW)) $PY benchmarks/bench_device_storage.py --device cuda --size-mib 512 --calls 8 \
    --out "$OUT/bench_device_storage.md"
else
  # A rehearsal of the benchmarks' own code on the CPU, so a script error shows before a GPU run.
  step bench_gpu_tree $((60 * SLOW)) $PY benchmarks/bench_gpu_tree.py --device cpu --log2n 16 --rounds 2 \
    --out "$OUT/bench_gpu_tree.md"
  step bench_device_storage $((60 * SLOW)) $PY benchmarks/bench_device_storage.py --device cpu --size-mib 32 --calls 2 \
    --out "$OUT/bench_device_storage.md"
fi

# --- memcheck ------------------------------------------------------------------------------------
SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
if [ "$CUDA_OK" = 1 ] && [ -n "$SANITIZER" ]; then
  step memcheck $((60 * SLOW)) "$SANITIZER" --tool memcheck --error-exitcode 1 --target-processes all \
    $PY benchmarks/gpu_memcheck_probe.py
else
  skip memcheck "$([ "$CUDA_OK" = 1 ] && echo 'compute-sanitizer not found' || echo 'no CUDA device')"
fi

# --- summary -------------------------------------------------------------------------------------
$PY - "$OUT" <<'PY' >>"$SUMMARY"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
lines = ["## Ratios", ""]
tree = out / "bench_gpu_tree.json"
if tree.exists():
    for row in json.loads(tree.read_text())["rows"]:
        lines.append(f"- {row['op']}: {row['peer']} / tree = {row['speedup_median']:.2f}x "
                     f"(range {row['speedup_min']:.2f}-{row['speedup_max']:.2f})")
storage = out / "bench_device_storage.json"
if storage.exists():
    report = json.loads(storage.read_text())
    for case in ("hot", "cold"):
        med = report[case]["median_s"]
        for name, sec in med.items():
            if name != "host":
                lines.append(f"- {case}: host assembly + copy / {name} = {med['host'] / sec:.2f}x")
print("\n".join(lines))
PY
cat "$SUMMARY"
echo "total: $((SECONDS - START))s"
if [ $DRY = 1 ]; then
  if [ $status = 0 ]; then echo "dry run ok"; else echo "dry run FAILED"; fi
fi
exit $status
