"""Builds torchreplay._C with torch.utils.cpp_extension.

CUDA sources join the build only when torch itself has CUDA and nvcc is found, so a CPU-only
machine never needs the CUDA toolkit. DEBUG=1 builds with -O0 -g.

The extension is built against the torch this script imports, so install with
`pip install --no-build-isolation .` (docs/install.md): an isolated build would compile against a
second torch fetched into a throwaway environment, not the one the extension will run with.
"""

import os
from pathlib import Path

from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
import torch

ROOT = Path(__file__).parent
DEBUG = os.environ.get("DEBUG", "0") == "1"
# Sample targets must round identically on the CPU and the GPU, so no fused multiply-add anywhere.
CXX_FLAGS = ["-O0", "-g"] if DEBUG else ["-O3"]
CXX_FLAGS += ["-std=c++17", "-fopenmp", "-ffp-contract=off"]
NVCC_FLAGS = ["-O3", "--fmad=false", "-std=c++17"]
# Compiled into the binary (csrc/ops.cpp) and compared with the running torch at import: the
# extension only works with the torch minor release and C++ ABI it was built against. The ABI flag
# comes from the compiler itself there, as torch's own build flags set it.
CXX_FLAGS += [
    f'-DTORCHREPLAY_BUILT_TORCH_VERSION="{torch.__version__}"',
    f'-DTORCHREPLAY_BUILT_TORCH_CUDA="{torch.version.cuda or "none"}"',
]


def have_zlib_headers() -> bool:
    """Whether the C++ compiler finds zlib.h. A minimal image (the GPU machine's, say) may lack zlib's
    development headers; the extension then uses its own table-driven CRC (csrc/crc32.h), the same
    checksum, instead of failing to build."""
    import shutil
    import subprocess

    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        return True  # let the build itself report the missing compiler
    probe = subprocess.run([compiler, "-x", "c++", "-E", "-", "-o", os.devnull], input="#include <zlib.h>\n",
                           capture_output=True, text=True)
    return probe.returncode == 0


ZLIB = have_zlib_headers()
if not ZLIB:
    print("torchreplay: zlib.h not found, building with the portable CRC (TORCHREPLAY_NO_ZLIB)")
    CXX_FLAGS += ["-DTORCHREPLAY_NO_ZLIB"]
LIBRARIES = ["z"] if ZLIB else []


def want_cuda() -> bool:
    if os.environ.get("TORCHREPLAY_FORCE_CPU", "0") == "1":
        return False
    return torch.version.cuda is not None and CUDA_HOME is not None


def extension():
    sources = ["csrc/ops.cpp", "csrc/cpu/tree_cpu_ops.cpp", "csrc/cpu/pad_cpu.cpp", "csrc/cpu/shard_reader_ops.cpp"]
    if want_cuda():
        sources += ["csrc/cuda/tree_cuda.cu", "csrc/cuda/tree_cuda_ops.cpp", "csrc/cuda/crc_cuda.cu",
                    "csrc/cuda/storage_cuda_ops.cpp"]
        # torch's CUDA headers need C++20 from 2.14 on.
        cxx = [f for f in CXX_FLAGS if not f.startswith("-std=")] + ["-std=c++20", "-DTORCHREPLAY_WITH_CUDA"]
        return CUDAExtension(
            "torchreplay._C",
            sources,
            extra_compile_args={"cxx": cxx, "nvcc": NVCC_FLAGS},
            extra_link_args=["-fopenmp"],
            libraries=LIBRARIES,
        )
    return CppExtension(
        "torchreplay._C", sources, extra_compile_args={"cxx": CXX_FLAGS}, extra_link_args=["-fopenmp"],
        libraries=LIBRARIES,  # zlib's crc32 for the shard reader: the same checksum Python's zlib writes
    )


setup(
    name="torchreplay",
    version="0.1.0",
    packages=find_packages(include=["torchreplay", "torchreplay.*"]),
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
