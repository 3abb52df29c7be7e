"""Loads the compiled extension and declares the fake (meta) kernels of its ops.

The fakes are what let `torch.compile` and `torch.library.opcheck` reason about the ops without
running them.
"""

from __future__ import annotations

import warnings

import torch

try:
    from torchreplay import _C  # noqa: F401  (importing registers the ops)
except ImportError as exc:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "torchreplay's C++ extension is not built. Run `make build` (or `pip install --no-build-isolation -e .`) "
        f"in the source tree. Original error: {exc}"
    ) from exc

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
