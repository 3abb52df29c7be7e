"""I/O back ends behind one interface: POSIX (thread pool, pread/pwrite, optional O_DIRECT) and
kvikio (cuFile; GPUDirect Storage or kvikio's compatibility mode) where a CUDA driver exists.

Both read and write the same 4 KiB-aligned shard files (see format.py).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Protocol, Sequence

import torch

from torchreplay._ops import ops
from torchreplay.errors import StorageError
from torchreplay.storage.format import ALIGN, align_up
from torchreplay.storage.reader_abi import PageState, ReadCode

log = logging.getLogger("torchreplay.storage")

# Large requests are split so several threads (and NVMe queues) work on one shard at a time.
TASK_BYTES = 4 * 1024 * 1024

# read_rows status codes per segment and page states, by their old names (reader_abi.py holds them,
# checked against csrc/shard_reader.h at import).
READ_OK, READ_CHECKSUM, READ_SHORT, READ_OPEN, READ_FAILED = ReadCode
PAGE_UNREAD, PAGE_OK, PAGE_BAD = PageState


def read_shard_rows(paths: Sequence[str], segments: torch.Tensor, rows: torch.Tensor, crcs: torch.Tensor,
                    dests: Sequence[torch.Tensor], page_state: torch.Tensor, direct: bool, threads: int
                    ) -> torch.Tensor:
    """Row reads from shard files by the C++ reader: see IOBackend.read_rows."""
    return ops.read_shard_rows(list(paths), segments, rows, crcs, list(dests), page_state, direct, threads)


def storage_error(exc: OSError, what: str, path: str) -> StorageError:
    reason = {
        errno.ENOSPC: "disk full",
        errno.EDQUOT: "disk quota exceeded",
        errno.EACCES: "permission denied",
        errno.EPERM: "permission denied",
        errno.ENOENT: "file vanished",
        errno.EROFS: "read-only file system",
        errno.EIO: "I/O error",
    }.get(exc.errno, os.strerror(exc.errno) if exc.errno else str(exc))
    return StorageError(f"{what} {path}: {reason} ({exc})")


class IOBackend(Protocol):
    name: str

    def write_file(self, path: str, pieces: Sequence[tuple[int, memoryview | bytes]], file_bytes: int,
                   digest: Callable[[memoryview], Any] | None = None,
                   finalize: Callable[[list[list[Any]]], Sequence[tuple[int, bytes]]] | None = None) -> None:
        """Write `pieces` (file offset, bytes) to a new file of `file_bytes`, atomically: the file
        appears under `path` complete, or not at all. Each piece is written in TASK_BYTES parts;
        `digest(part)` runs on every part next to its write (results per piece, in order), then
        `finalize(results)` returns more pieces (a header) written before the file is published."""

    def read_rows(self, paths: Sequence[str], segments: torch.Tensor, rows: torch.Tensor, crcs: torch.Tensor,
                  dests: Sequence[torch.Tensor], page_state: torch.Tensor) -> torch.Tensor:
        """Token rows of field blocks in shard files, every page they touch verified, copied into
        `dests` (host tensors). segments: int64 [S, 9], one reader_abi.Segment per row; rows:
        int64 [R, 3], one reader_abi.RowRange per row; crcs: every page checksum; page_state:
        uint8 per checksum, set to PageState.OK/BAD for the pages read. Returns int64 [S, 4], one
        reader_abi.ReadStatus per segment. Failures are reported, not raised; an inconsistent
        request raises ValueError before anything is read."""

    def can_stage_on(self, device: torch.device) -> bool:
        """Whether read_spans can read straight into memory on `device`."""

    def read_spans(self, spans: Sequence[tuple[str, int, int, int]], staging: torch.Tensor) -> list[int | OSError]:
        """Raw byte ranges of shard files into a 1-D uint8 tensor (host or, with kvikio, device
        memory), all in flight together: spans are (path, file offset, bytes, staging offset).
        Returns the bytes read per span, or the OSError that stopped it; nothing is verified here
        (the caller checks page checksums where the bytes landed)."""

    def close(self) -> None: ...


def _split(offset: int, nbytes: int) -> list[tuple[int, int]]:
    return [(o, min(TASK_BYTES, offset + nbytes - o)) for o in range(offset, offset + nbytes, TASK_BYTES)] or [
        (offset, 0)
    ]


class PosixIO:
    """pread/pwrite on a thread pool. `direct=True` opens with O_DIRECT and stages through
    page-aligned buffers (not every file system allows it: tmpfs does not)."""

    name = "posix"

    def __init__(self, threads: int = 4, direct: bool = False) -> None:
        if direct and not hasattr(os, "O_DIRECT"):
            raise ValueError("direct=True needs O_DIRECT, which this platform lacks")
        self.direct = direct
        self.threads = threads
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="torchreplay-io")
        self._local = threading.local()

    def _staging(self) -> mmap.mmap:
        """This thread's page-aligned O_DIRECT staging buffer, reused: a fresh mapping per request
        would page-fault a whole task's worth of memory every time."""
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = mmap.mmap(-1, TASK_BYTES)
        return buf

    def _flags(self, base: int) -> int:
        return base | (os.O_DIRECT if self.direct else 0)

    def _pwrite_all(self, fd: int, data: memoryview | bytes, offset: int) -> None:
        view = memoryview(data).cast("B")
        if self.direct:
            # O_DIRECT needs aligned memory and sizes; the tail is zero-padded to the block's 4 KiB padding.
            staged = self._staging()
            size = align_up(len(view)) or ALIGN
            staged[: len(view)] = view
            staged[len(view) : size] = bytes(size - len(view))
            view = memoryview(staged)[:size]
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], offset + done)

    def _digest_and_write(self, fd: int, data: memoryview, offset: int, digest) -> Any:
        result = digest(data) if digest is not None else None
        self._pwrite_all(fd, data, offset)
        return result

    def write_file(self, path: str, pieces: Sequence[tuple[int, memoryview | bytes]], file_bytes: int,
                   digest: Callable[[memoryview], Any] | None = None,
                   finalize: Callable[[list[list[Any]]], Sequence[tuple[int, bytes]]] | None = None) -> None:
        tmp = f"{path}.tmp-{os.getpid()}"
        try:
            fd = os.open(tmp, self._flags(os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 0o644)
        except OSError as exc:
            raise storage_error(exc, "cannot create shard", tmp) from exc
        try:
            tasks = []
            for offset, data in pieces:
                view = memoryview(data).cast("B")
                tasks.append([self.pool.submit(self._digest_and_write, fd, view[o - offset : o - offset + n], o, digest)
                              for o, n in _split(offset, len(view))])
            results = [[t.result() for t in parts] for parts in tasks]
            for offset, data in (finalize(results) if finalize is not None else ()):
                self._pwrite_all(fd, data, offset)
            os.ftruncate(fd, file_bytes)
        except OSError as exc:
            os.close(fd)
            _unlink_quietly(tmp)
            raise storage_error(exc, "cannot write shard", path) from exc
        except BaseException:
            os.close(fd)
            _unlink_quietly(tmp)
            raise
        os.close(fd)
        try:
            os.replace(tmp, path)
        except OSError as exc:
            _unlink_quietly(tmp)
            raise storage_error(exc, "cannot publish shard", path) from exc

    def read_rows(self, paths: Sequence[str], segments: torch.Tensor, rows: torch.Tensor, crcs: torch.Tensor,
                  dests: Sequence[torch.Tensor], page_state: torch.Tensor) -> torch.Tensor:
        return read_shard_rows(paths, segments, rows, crcs, dests, page_state, self.direct, self.threads)

    def can_stage_on(self, device: torch.device) -> bool:
        return device.type == "cpu"

    def read_spans(self, spans: Sequence[tuple[str, int, int, int]], staging: torch.Tensor) -> list[int | OSError]:
        if staging.device.type != "cpu":
            raise ValueError(f"the POSIX back end reads into host memory, not {staging.device}")
        view = memoryview(staging.numpy()).cast("B")
        by_path: dict[str, list[int]] = {}
        for i, (path, _, _, _) in enumerate(spans):
            by_path.setdefault(path, []).append(i)
        results: list[int | OSError] = [0] * len(spans)

        def read_file(path: str) -> None:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as exc:
                for i in by_path[path]:
                    results[i] = exc
                return
            try:
                for i in by_path[path]:
                    _, offset, nbytes, at = spans[i]
                    done = 0
                    try:
                        while done < nbytes:
                            got = os.preadv(fd, [view[at + done : at + nbytes]], offset + done)
                            if got == 0:
                                break
                            done += got
                        results[i] = done
                    except OSError as exc:
                        results[i] = exc
            finally:
                os.close(fd)

        list(self.pool.map(read_file, list(by_path)))
        return results

    def close(self) -> None:
        self.pool.shutdown(wait=True)


class KvikioIO:
    """cuFile reads and writes through kvikio: GPUDirect Storage where the platform has it, kvikio's
    compatibility mode otherwise. Needs a CUDA driver (libcuda.so.1) even in compatibility mode."""

    name = "kvikio"

    def __init__(self, threads: int = 4, kvikio: Any = None) -> None:
        """`kvikio`: the module to read and write through (None: `import kvikio`); a stand-in with
        its `CuFile` and `defaults` runs this class's own logic where no CUDA driver is."""
        if kvikio is None:
            import kvikio  # noqa: F401  (ImportError/OSError tell the caller kvikio is unusable here)

        self._kvikio = kvikio
        self.threads = threads
        _widen_kvikio_pool(kvikio, threads)
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="torchreplay-kvikio")
        self._posix = PosixIO(threads=threads)

    def write_file(self, path: str, pieces: Sequence[tuple[int, memoryview | bytes]], file_bytes: int,
                   digest: Callable[[memoryview], Any] | None = None,
                   finalize: Callable[[list[list[Any]]], Sequence[tuple[int, bytes]]] | None = None) -> None:
        import numpy as np

        tmp = f"{path}.tmp-{os.getpid()}"
        try:
            results = []
            for offset, data in pieces:
                view = memoryview(data).cast("B")
                results.append([digest(view[o - offset : o - offset + n]) if digest else None
                                for o, n in _split(offset, len(view))])
            extra = list(finalize(results)) if finalize is not None else []
            with self._kvikio.CuFile(tmp, "w") as f:
                futures = [f.pwrite(np.frombuffer(memoryview(d).cast("B"), dtype=np.uint8), file_offset=o)
                           for o, d in [*pieces, *extra] if len(memoryview(d).cast("B"))]
                for fut in futures:
                    fut.get()
            os.truncate(tmp, file_bytes)
            os.replace(tmp, path)
        except OSError as exc:
            _unlink_quietly(tmp)
            raise storage_error(exc, "cannot write shard", path) from exc
        except RuntimeError as exc:  # kvikio reports cuFile failures as RuntimeError
            _unlink_quietly(tmp)
            raise StorageError(f"kvikio cannot write shard {path}: {exc}") from exc

    def read_rows(self, paths: Sequence[str], segments: torch.Tensor, rows: torch.Tensor, crcs: torch.Tensor,
                  dests: Sequence[torch.Tensor], page_state: torch.Tensor) -> torch.Tensor:
        # Rows bound for host memory: cuFile would only add a bounce buffer over the same preads
        # (GPUDirect pays off for device destinations: read_spans), so the C++ reader serves both.
        return read_shard_rows(paths, segments, rows, crcs, dests, page_state, False, self.threads)

    def can_stage_on(self, device: torch.device) -> bool:
        return device.type == "cuda"

    def read_spans(self, spans: Sequence[tuple[str, int, int, int]], staging: torch.Tensor) -> list[int | OSError]:
        """cuFile preads straight into `staging` (GPUDirect Storage where the platform has it).
        Files are read side by side on the back end's threads: kvikio runs a device pread below
        its gds_threshold (1 MiB by default, more than most page runs) synchronously in the
        calling thread, so issuing them all from one thread would read one at a time."""
        by_path: dict[str, list[int]] = {}
        for i, (path, _, _, _) in enumerate(spans):
            by_path.setdefault(path, []).append(i)
        results: list[int | OSError] = [0] * len(spans)

        def failure(path: str, exc: Exception) -> OSError:
            if isinstance(exc, OSError):
                return exc
            # kvikio reports cuFile failures, a missing file included, as RuntimeError.
            return OSError(errno.EIO if os.path.exists(path) else errno.ENOENT, f"kvikio: {exc}")

        def read_file(path: str) -> None:
            members = by_path[path]
            try:
                f = self._kvikio.CuFile(path, "r")
            except Exception as exc:  # noqa: BLE001 - reported per span, like an OSError
                for i in members:
                    results[i] = failure(path, exc)
                return
            futures = []
            try:
                for i in members:
                    try:
                        futures.append((i, f.pread(staging[spans[i][3] : spans[i][3] + spans[i][2]],
                                                   size=spans[i][2], file_offset=spans[i][1])))
                    except Exception as exc:  # noqa: BLE001
                        results[i] = failure(path, exc)
            finally:
                # Every issued read is waited for, failed or not: none may still be writing into
                # the staging memory once this returns.
                for i, fut in futures:
                    try:
                        results[i] = int(fut.get())
                    except Exception as exc:  # noqa: BLE001
                        results[i] = failure(path, exc)
                f.close()

        list(self.pool.map(read_file, list(by_path)))
        return results

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self._posix.close()


def _widen_kvikio_pool(kvikio: Any, threads: int) -> None:
    """kvikio splits each pread over its own thread pool, one thread unless configured
    (KVIKIO_NTHREADS): widen it to `threads`, never narrow what someone else set."""
    defaults = kvikio.defaults
    try:
        if hasattr(defaults, "get"):
            current = int(defaults.get("num_threads"))
        elif hasattr(defaults, "get_num_threads"):
            current = int(defaults.get_num_threads())
        else:
            current = int(defaults.num_threads())
        if current >= threads:
            return
        if hasattr(defaults, "set"):
            defaults.set("num_threads", threads)  # kvikio >= 25.04
        else:
            defaults.num_threads_reset(threads)
    except (AttributeError, TypeError, ValueError, RuntimeError) as exc:
        log.info("torchreplay storage: cannot size kvikio's thread pool (%s); it keeps its default", exc)


def cuda_driver_present() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def make_io(kind: str, threads: int = 4, direct: bool = False) -> IOBackend:
    """`kind` is "auto", "kvikio" or "posix". "auto" takes kvikio when a CUDA driver and kvikio are
    present, POSIX otherwise, and logs its choice."""
    if kind not in ("auto", "kvikio", "posix"):
        raise ValueError(f"io must be 'auto', 'kvikio' or 'posix', got {kind!r}")
    if kind == "posix":
        return PosixIO(threads=threads, direct=direct)
    if kind == "kvikio":
        if not cuda_driver_present():
            raise StorageError("io='kvikio' needs a CUDA driver (libcuda.so.1), and none was found")
        try:
            return KvikioIO(threads=threads)
        except (ImportError, OSError) as exc:
            raise StorageError(f"io='kvikio' but kvikio cannot be loaded: {exc}") from exc
    if cuda_driver_present():
        try:
            backend: IOBackend = KvikioIO(threads=threads)
            log.info("torchreplay storage: io=auto chose kvikio (CUDA driver present)")
            return backend
        except (ImportError, OSError) as exc:
            log.info("torchreplay storage: io=auto: kvikio unavailable (%s), using POSIX", exc)
    else:
        log.info("torchreplay storage: io=auto chose POSIX (no CUDA driver)")
    return PosixIO(threads=threads, direct=direct)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
