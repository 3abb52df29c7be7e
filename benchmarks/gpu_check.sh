#!/usr/bin/env bash
# One prepared script for a machine with an NVIDIA GPU: builds the CUDA extension, runs the CUDA
# tests (tree, buffer, device tier, kvikio storage), the GPU tree benchmark and the device-storage
# benchmark (VRAM tier, kvikio reads into device memory), and writes a JSON + Markdown
# summary under $OUT (default: ./gpu_out). Every step runs even if an earlier one fails; the exit
# status is non-zero if any failed.
#   usage: OUT=/some/dir bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
status=0
step() {
  local name=$1; shift
  echo "=== $name"
  if "$@" >"$OUT/$name.log" 2>&1; then echo "ok: $name"; else echo "FAILED: $name (see $OUT/$name.log)"; tail -n 20 "$OUT/$name.log"; status=1; fi
}
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || true
PY=${PYTHON:-python3}
step venv bash -c "$PY -m venv .venv-gpu && .venv-gpu/bin/pip install -q torch==2.13.0 && .venv-gpu/bin/pip install -q -r requirements-dev.txt && (.venv-gpu/bin/pip install -q kvikio-cu13 || .venv-gpu/bin/pip install -q kvikio-cu12 || true)"
step build bash -c ".venv-gpu/bin/pip install -q --no-build-isolation --no-deps -e . && .venv-gpu/bin/python -c 'import torch, torchreplay; print(torch.version.cuda, torch.ops.torchreplay.cuda_version())'"
step cuda_tests .venv-gpu/bin/python -m pytest -q -rs -m cuda tests
step cpu_tests .venv-gpu/bin/python -m pytest -q -x tests/test_tree.py tests/test_buffer.py tests/test_storage.py
step bench_gpu_tree .venv-gpu/bin/python benchmarks/bench_gpu_tree.py --out "$OUT/bench_gpu_tree.md"
# The VRAM tier and kvikio reads straight into device memory, against host assembly + copy.
step bench_device_storage .venv-gpu/bin/python benchmarks/bench_device_storage.py --device cuda --size-mib 1024 \
  --out "$OUT/bench_device_storage.md"
.venv-gpu/bin/python - "$OUT" "$status" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
summary = {"status": int(sys.argv[2]), "logs": {}}
for log in sorted(out.glob("*.log")):
    lines = log.read_text(errors="replace").strip().splitlines()
    summary["logs"][log.stem] = lines[-5:]
(out / "summary.json").write_text(json.dumps(summary, indent=2))
md = ["# GPU check", "", f"status: {'ok' if summary['status'] == 0 else 'FAILED'}", ""]
for name, tail in summary["logs"].items():
    md += [f"## {name}", "", "```", *tail, "```", ""]
for name in ("bench_gpu_tree.md", "bench_device_storage.md"):
    bench = out / name
    if bench.exists():
        md += [bench.read_text()]
(out / "summary.md").write_text("\n".join(md))
PY
exit $status
