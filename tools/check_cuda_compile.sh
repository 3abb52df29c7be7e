#!/usr/bin/env bash
# Compile every .cu under csrc/ for sm_80 and sm_90 with the same flags setup.py uses. Compile only:
# no GPU is needed. The kernels include no torch headers, so the CUDA toolkit alone suffices.
set -euo pipefail
if ! command -v nvcc >/dev/null 2>&1; then
  echo "cuda-check: nvcc not found, skipping the CUDA compile check"
  exit 0
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
status=0
while IFS= read -r -d '' cu; do
  if nvcc -std=c++17 -O3 --fmad=false -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
      -c "$cu" -o "$out/$(basename "$cu").o"; then
    echo "cuda-check: ok   $cu (sm_80, sm_90)"
  else
    echo "cuda-check: FAIL $cu"
    status=1
  fi
done < <(find csrc -name '*.cu' -print0)
exit $status
