#!/usr/bin/env bash
# Downloads, on a CPU machine with the package index, what benchmarks/gpu_check.sh needs and the GPU
# machine's image lacks. The GPU machine has no network, so these travel with the source tree.
#
#   bash benchmarks/gpu_wheels.sh [DIR]      # DIR defaults to .whl/ (git-ignored)
#
# 1. DIR: the wheels for the GPU image (python3 3.12, x86-64 manylinux), listed one by one with exact
#    versions, because nothing resolves dependencies over there. Total at most 48 MiB (the tree and the
#    wheels travel together under a 64 MiB limit). The image already has torch 2.11.0+cu130, numpy,
#    pybind11, ninja, setuptools, pytest, hypothesis, scipy, safetensors, tqdm, psutil, matplotlib
#    (hence python-dateutil and six), cupy-cuda13x, cuda-toolkit and cuda-pathfinder.
# 2. build/gpu-rehearsal/wheels: this machine's own wheels of what the image has (torch 2.13.0 from
#    local disk, never a CUDA build), so that `gpu_check.sh --dry-run` rehearses the offline path
#    here with --no-index. They never travel.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PY=${PYTHON:-python3}

# What the image lacks, for the GPU check: the runtime dependency boto3 (and its own dependencies),
# and the `gpu` extra kvikio with its native library and logger. urllib3 (botocore's) is pure
# Python and small, so it travels in case the image has none; so do python-dateutil and six
# (botocore's), which the image has through matplotlib, but whose absence would stop every step
# after the install. nvidia-cufile is installed over there
# only when the image's cuda-toolkit cannot load libcufile (gpu_check.sh decides).
GPU_WHEELS=(
  boto3==1.44.8
  botocore==1.44.8
  s3transfer==0.19.3
  jmespath==1.1.0
  urllib3==2.8.0
  python-dateutil==2.9.0.post0
  six==1.17.0
  kvikio-cu13==26.10.0
  libkvikio-cu13==26.10.0
  rapids-logger==0.3.0
  nvidia-cufile==1.15.1.6
)
MAX_MIB=48

mkdir -p "$DIR"
"$PY" -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d "$DIR" "${GPU_WHEELS[@]}"
# Exactly one wheel per requirement: a stale wheel of another version left in DIR would be installed
# beside the wanted one over there.
for req in "${GPU_WHEELS[@]}"; do
  name=${req%%==*}; version=${req##*==}
  stem=${name//-/_}
  found=("$DIR"/"$stem"-*.whl)
  wanted=("$DIR"/"$stem"-"$version"-*.whl)
  if [ ! -e "${wanted[0]}" ]; then echo "gpu_wheels: $req was not downloaded" >&2; exit 1; fi
  for whl in "${found[@]}"; do
    [[ " ${wanted[*]} " == *" $whl "* ]] || { echo "gpu_wheels: removing stale $whl"; rm -f "$whl"; }
  done
done
total=$(du -cb "$DIR"/*.whl | tail -n 1 | cut -f1)
echo "gpu_wheels: $(ls "$DIR"/*.whl | wc -l) wheels, $((total / 1024 / 1024)) MiB in $DIR"
if [ "$total" -gt $((MAX_MIB * 1024 * 1024)) ]; then
  echo "gpu_wheels: $total bytes exceed the ${MAX_MIB} MiB the GPU machine can take with the tree" >&2
  exit 1
fi

# The rehearsal image for --dry-run: what the GPU image has, as this machine's wheels. torch is pinned
# to the CPU build kept on local disk (an unpinned torch would pull a multi-GB CUDA build).
REHEARSAL=build/gpu-rehearsal/wheels
mkdir -p "$REHEARSAL"
"$PY" -m pip download --disable-pip-version-check -q -d "$REHEARSAL" \
  torch==2.13.0 numpy pybind11 ninja setuptools wheel pytest hypothesis scipy "safetensors>=0.8" tqdm psutil
echo "gpu_wheels: rehearsal image wheels in $REHEARSAL (for gpu_check.sh --dry-run; they stay here)"
