"""Loads the compiled extension and declares the fake (meta) kernels of its ops.

The fakes are what let `torch.compile` and `torch.library.opcheck` reason about the ops without
running them.

The extension is C++ compiled against one torch: it links to that torch's C++ symbols, which change
between minor releases and with the C++11 ABI flag. Loading it under another torch either fails with
an undefined symbol or, worse, loads and misbehaves, so the torch it was built against is compiled
into it (csrc/ops.cpp) and checked here before any op runs.
"""

from __future__ import annotations

import importlib.machinery
import re
import warnings
from pathlib import Path

import torch

REBUILD_HINT = (
    "rebuild with `pip install --no-build-isolation --force-reinstall --no-deps torchreplay` "
    "(or `make clean build` in a source tree)"
)
_BUILD_INFO_PREFIX = "torchreplay-build-info:"


def parse_build_info(text: str) -> dict[str, str]:
    """{"torch": ..., "cxx11_abi": ..., "cuda": ...} from the string csrc/ops.cpp compiles in."""
    if not text.startswith(_BUILD_INFO_PREFIX):
        return {}
    fields = (item.partition("=") for item in text[len(_BUILD_INFO_PREFIX):].split(";") if item)
    return {key: value for key, _, value in fields}


def _major_minor(version: str) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", str(version))
    return (int(match.group(1)), int(match.group(2))) if match else None


def _abi(flag: object) -> bool | None:
    """The CXX11 ABI flag as a bool, None where unknown (libc++, or not recorded)."""
    if isinstance(flag, bool):
        return flag
    return {"1": True, "0": False, "true": True, "false": False}.get(str(flag).lower())


def _abi_text(flag: object) -> str:
    abi = _abi(flag)
    return "unknown" if abi is None else str(int(abi))


def check_torch_compat(*, built: str, running: str, built_abi: object = None, running_abi: object = None) -> None:
    """Raises ImportError unless an extension built against torch `built` can load under `running`.

    torch keeps its C++ ABI within a minor release, so only major.minor must agree (2.13.0 and 2.13.1
    mix; 2.12 and 2.13 do not). The CXX11 ABI flags must agree where both are known. A version that
    cannot be read is not held against the build.
    """
    built_mm, running_mm = _major_minor(built), _major_minor(running)
    version_differs = built_mm is not None and running_mm is not None and built_mm != running_mm
    abi_b, abi_r = _abi(built_abi), _abi(running_abi)
    abi_differs = abi_b is not None and abi_r is not None and abi_b != abi_r
    if version_differs or abi_differs:
        raise ImportError(
            f"torchreplay's extension was built against torch {built} (cxx11 abi {_abi_text(built_abi)}) but torch "
            f"{running} (cxx11 abi {_abi_text(running_abi)}) is installed; {REBUILD_HINT}"
        )


def _running_abi() -> bool | None:
    return getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", None)


def extension_file() -> Path | None:
    """The extension's binary beside this file, without importing it (it may not load)."""
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = here / f"_C{suffix}"
        if candidate.is_file():
            return candidate
    return None


def build_info_from_binary(path: Path) -> dict[str, str]:
    """The compiled-in build info read from the file's bytes, for a binary that will not load."""
    try:
        data = path.read_bytes()
    except OSError:
        return {}
    start = data.find(_BUILD_INFO_PREFIX.encode())
    if start < 0:
        return {}
    end = data.find(b"\0", start)
    return parse_build_info(data[start:end if end >= 0 else None].decode("ascii", "replace"))


def load_failure_message(error: BaseException, binary: Path | None, running: str) -> str:
    """What to tell the user when `from torchreplay import _C` raised `error`."""
    if binary is None:
        return (
            "torchreplay's C++ extension is not built. Run `make build` (or `pip install --no-build-isolation -e .`) "
            f"in the source tree. Original error: {error}"
        )
    running_text = f"torch {running} (cxx11 abi {_abi_text(_running_abi())})"
    info = build_info_from_binary(binary)
    if "torch" not in info:
        # No record (a binary from before this check): one that will not load is nearly always built
        # against another torch, whose C++ symbols it references no longer resolve ("undefined symbol").
        cause = f"most likely it was built against another torch than the installed {running_text}"
    else:
        try:
            check_torch_compat(built=info["torch"], running=running, built_abi=info.get("cxx11_abi"),
                               running_abi=_running_abi())
        except ImportError:
            cause = (f"it was built against torch {info['torch']} (cxx11 abi {info.get('cxx11_abi', 'unknown')}) "
                     f"but {running_text} is installed")
        else:
            cause = (f"it was built against this torch ({info['torch']}), so the cause lies elsewhere "
                     "(a missing library, or a stale or partial build)")
    return (
        f"torchreplay's extension ({binary.name}) could not be loaded: {cause}; {REBUILD_HINT}. "
        f"Original error: {error}"
    )


try:
    from torchreplay import _C  # (importing registers the ops)
except (ImportError, OSError) as exc:
    raise ImportError(load_failure_message(exc, extension_file(), torch.__version__)) from exc

# What the loaded binary was compiled against; a binary from before it recorded this is stale too.
BUILT = parse_build_info(getattr(_C, "BUILD_INFO", ""))
if "torch" not in BUILT:
    raise ImportError(
        f"torchreplay's extension at {_C.__file__} records no torch version: it predates this source tree; "
        f"{REBUILD_HINT}"
    )
check_torch_compat(
    built=BUILT["torch"], running=torch.__version__, built_abi=BUILT.get("cxx11_abi"), running_abi=_running_abi()
)

ops = torch.ops.torchreplay


def _check_cuda_version() -> None:
    built = ops.cuda_version()
    if built < 0 or torch.version.cuda is None:
        return
    major, minor = (int(x) for x in torch.version.cuda.split(".")[:2])
    torch_version = major * 1000 + minor * 10
    built_major, built_minor = built // 1000, (built % 1000) // 10
    if built_major != major:
        raise RuntimeError(
            f"torchreplay was built against CUDA {built // 1000}.{(built % 1000) // 10} but torch uses CUDA "
            f"{torch.version.cuda} (runtime {torch_version}). Rebuild torchreplay with the CUDA toolkit that "
            "matches torch: `make clean build`."
        )
    if built_minor != minor:
        # Same policy as torch.utils.cpp_extension: a minor mismatch is ABI-compatible within a major.
        warnings.warn(
            f"torchreplay was built against CUDA {built_major}.{built_minor}, torch uses {torch.version.cuda}",
            stacklevel=2,
        )


_check_cuda_version()


@torch.library.register_fake("torchreplay::tree_update")
def _(leaves, sums, mins, indices, priorities, capacity):
    return None


@torch.library.register_fake("torchreplay::tree_sample")
def _(leaves, sums, u, capacity, stratified):
    n = u.shape[0]
    return leaves.new_empty((n,), dtype=torch.int64), leaves.new_empty((n,))


@torch.library.register_fake("torchreplay::tree_sample_seeded")
def _(leaves, sums, seed, batch_size, capacity, stratified):
    return leaves.new_empty((batch_size,), dtype=torch.int64), leaves.new_empty((batch_size,))


@torch.library.register_fake("torchreplay::tree_total")
def _(sums):
    return sums.new_empty(())


@torch.library.register_fake("torchreplay::tree_min")
def _(mins):
    return mins.new_empty(())


@torch.library.register_fake("torchreplay::tree_get")
def _(leaves, indices, capacity):
    return leaves.new_empty(indices.shape)


@torch.library.register_fake("torchreplay::tree_rebuild")
def _(leaves, sums, mins, capacity):
    return None


@torch.library.register_fake("torchreplay::pad_rows")
def _(values, source, starts, lengths, dest, out, left, fill=None):
    return None


@torch.library.register_fake("torchreplay::pack_rows")
def _(values, source, starts, lengths, offsets, out):
    return None

@torch.library.register_fake("torchreplay::read_shard_rows")
def _(paths, segments, rows, crcs, dests, page_state, direct, threads):
    return segments.new_empty((segments.shape[0], 4), dtype=torch.int64)


@torch.library.register_fake("torchreplay::page_crc32")
def _(data, page_size):
    pages = max(1, -(-data.shape[0] // page_size))
    return data.new_empty((pages,), dtype=torch.int64)


@torch.library.register_fake("torchreplay::span_crc32")
def _(data, spans):
    return spans.new_empty((spans.shape[0],), dtype=torch.int64)
