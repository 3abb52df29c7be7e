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

# The torch glue of the CUDA build (csrc/cuda/*.cpp, and ops.cpp with CUDA on) needs the CUDA build
# of torch's headers, which the CPU wheel lacks. torch 2.14.1's CUDA wheel lies on this kind of
# machine's local disk: take only its headers (C++20) and syntax-check the glue against them.
headers=build/cuda-torch-headers
if [ ! -d "$headers/torch/include" ]; then
  wheel_dir=$(mktemp -d)
  mkdir -p "$headers"
  if python3 -m pip download -q --no-deps torch==2.14.1 -d "$wheel_dir" >"$wheel_dir/pip.log" 2>&1 \
      && unzip -q -o "$wheel_dir"/torch-2.14.1-*.whl 'torch/include/*' -d "$headers"; then
    echo "cuda-check: unpacked torch 2.14.1 CUDA headers into $headers"
  else
    echo "cuda-check: torch 2.14.1 CUDA wheel not available here, skipping the glue check:"
    tail -n 3 "$wheel_dir/pip.log" 2>/dev/null
    rm -rf "$wheel_dir" "$headers"
    exit $status
  fi
  rm -rf "$wheel_dir"
fi
inc="$headers/torch/include"
cuda_inc=$(dirname "$(command -v nvcc)")/../include
[ -d /usr/local/cuda/include ] && cuda_inc=/usr/local/cuda/include
py_inc=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])")
# Every C++ source of the CUDA build: the CPU ops are compiled as C++20 against these headers too.
for src in csrc/cuda/*.cpp csrc/ops.cpp csrc/cpu/*.cpp; do
  if g++ -std=c++20 -fsyntax-only -DTORCHREPLAY_WITH_CUDA -I"$inc" -I"$inc/torch/csrc/api/include" \
      -I"$cuda_inc" -I"$py_inc" "$src"; then
    echo "cuda-check: ok   $src (against the CUDA build's torch headers, C++20)"
  else
    echo "cuda-check: FAIL $src"
    status=1
  fi
done
exit $status
