"""The object store, run in a helper process so uploads never hold the trainer's GIL.

boto3 request handling (signing, checksums, HTTP parsing) is pure Python. Run on a thread of the
trainer's process it took the GIL from `add` and `sample` for milliseconds at a time: p99 latency
of those calls rose by 3-5x while shards uploaded (docs/benchmarks.md). In a helper process it
costs the trainer nothing but a pipe write per object. The helper also runs at a lower CPU
priority, so on a machine with few cores durability work yields to training.

`RemoteStore` is the trainer-side handle: the `ObjectStore` interface for writes (`put`,
`put_file`, `get`, `list`, `delete`), each call retried *inside* the helper within the retry budget
and answered with the result or the final error, raised here as `CheckpointError`.

Wire format, both directions: an 8-byte little-endian length, a JSON header of that length, then
`payload_bytes` raw bytes (the header says how many). No pickle: the helper only ever decodes JSON.

The helper dies with the thread that started it (PR_SET_PDEATHSIG) and on end of input, so a
killed trainer never leaves an orphan uploading or garbage-collecting under a prefix that a
resumed run is already writing to.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading
from typing import Any

from torchreplay.checkpoint.store import MissingObject, PermanentError, RefusedObject
from torchreplay.errors import CheckpointError

# The wire format (module docstring) is public: `write_frame` / `read_frame` and the length prefix.
FRAME_LENGTH = struct.Struct("<Q")
_ERROR_KINDS = {cls.__name__: cls for cls in (MissingObject, PermanentError, RefusedObject)}
_MAX_HEADER = 1 << 20
# The helper imports only this package's store code: bringing up torch would cost it seconds
# of start-up and hundreds of MiB for nothing. Empty package modules stand in for the package
# __init__ files (which import torch) so the submodules import on their own.
_BOOT = """
import os, sys, types
pkg = sys.argv[1]
for name, path in (("torchreplay", pkg), ("torchreplay.checkpoint", os.path.join(pkg, "checkpoint"))):
    module = types.ModuleType(name)
    module.__path__ = [path]
    sys.modules[name] = module
from torchreplay.checkpoint.uploader import serve
serve(*sys.argv[2:])
"""


def write_frame(stream, header: dict[str, Any], payload: bytes | memoryview = b"") -> None:
    """One frame: the length of the JSON header, the header (with `payload_bytes` added), the payload."""
    head = json.dumps(dict(header, payload_bytes=len(payload)), separators=(",", ":")).encode()
    stream.write(FRAME_LENGTH.pack(len(head)) + head)
    if len(payload):
        stream.write(payload)
    stream.flush()


def _read_exact(stream, n: int) -> bytes:
    data = stream.read(n)
    if data is None or len(data) != n:
        raise EOFError(f"stream ended after {0 if data is None else len(data)} of {n} bytes")
    return data


def read_frame(stream) -> tuple[dict[str, Any], bytes] | None:
    """The next frame's (header, payload), or None at a clean end of input. A header over 1 MiB, or
    one that is not an object with a size in `payload_bytes`, is a ValueError; input that ends
    inside a frame is an EOFError."""
    first = stream.read(FRAME_LENGTH.size)
    if not first:
        return None
    if len(first) != FRAME_LENGTH.size:
        raise EOFError("stream ended inside a frame length")
    (n,) = FRAME_LENGTH.unpack(first)
    if n > _MAX_HEADER:
        raise ValueError(f"frame header of {n} bytes exceeds {_MAX_HEADER}")
    header = json.loads(_read_exact(stream, n))
    if not isinstance(header, dict):
        raise ValueError("frame header is not a JSON object")
    size = header.get("payload_bytes", 0)
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"frame payload_bytes {size!r} is not a size")
    return header, _read_exact(stream, size) if size else b""


class RemoteStore:
    """The store at `uri`, served by a helper process started on first use.

    Calls are serialized (one in flight), which matches the checkpoint worker: it runs its queue
    in order so that a manifest always follows the uploads it names.
    """

    def __init__(self, uri: str, endpoint_url: str | None, retry_budget_s: float, nice: int = 10,
                 cpus: list[int] | None = None, multipart_bytes: int = 64 << 20) -> None:
        self.uri = uri
        self._args = [uri, endpoint_url or "", repr(float(retry_budget_s)), str(int(nice)),
                      ",".join(str(c) for c in cpus or []), str(int(multipart_bytes))]
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    @property
    def helper_pid(self) -> int | None:
        """The helper process's pid while one is started (None before the first call, after a
        helper died, and after `close`): for watching its placement and lifetime from outside."""
        proc = self._proc
        return None if proc is None else proc.pid

    def start(self) -> None:
        """Start the helper. Call it from the thread that will outlive every call (the helper is
        bound to its starter thread's life)."""
        package_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT, package_dir, str(os.getpid()), *self._args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, close_fds=True)

    def _call(self, header: dict[str, Any], payload: bytes | memoryview = b"") -> tuple[Any, bytes]:
        with self._lock:
            if self._proc is None:
                self.start()
            proc = self._proc
            try:
                write_frame(proc.stdin, header, payload)
                reply = read_frame(proc.stdout)
            except (OSError, EOFError, ValueError) as exc:
                reply = None
                reason = str(exc)
            else:
                reason = "no reply"
            if reply is None:
                code = proc.poll()
                # A dead helper is started afresh by the next call: one crash must not end checkpoints.
                self._proc = None
                try:
                    proc.kill()
                    proc.wait()
                except OSError:
                    pass
                raise CheckpointError(f"checkpoint upload helper for {self.uri} failed ({reason}; exit code {code})")
        answer, data = reply
        if not answer.get("ok"):
            # The helper's error class travels by name, so "do not retry" survives the pipe.
            cls = _ERROR_KINDS.get(answer.get("kind"), CheckpointError)
            raise cls(str(answer.get("error", "unknown error in the upload helper")))
        return answer.get("result"), data

    def put(self, key: str, data: bytes | memoryview) -> None:
        self._call({"op": "put", "key": key}, data)

    def put_file(self, key: str, path: str) -> None:
        self._call({"op": "put_file", "key": key, "path": path})

    def put_files(self, items: list[tuple[str, str]]) -> None:
        """Upload (key, path) pairs in order in one request; stops at the first that fails."""
        self._call({"op": "put_files", "items": [[key, path] for key, path in items]})

    def get(self, key: str) -> bytes:
        return self._call({"op": "get", "key": key})[1]

    def list(self, room: str) -> list[str]:
        return list(self._call({"op": "list", "room": room})[0])

    def delete(self, keys: list[str]) -> None:
        self._call({"op": "delete", "keys": list(keys)})

    def close(self) -> None:
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the thread that started it exits (Linux); elsewhere, or if the
    parent is already gone, rely on end of input."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:
        os._exit(0)


def serve(parent_pid: str, uri: str, endpoint_url: str, retry_budget_s: str, nice: str, cpus: str,
          multipart_bytes: str) -> None:
    """The helper's loop: one request, one reply, until end of input."""
    _die_with_parent(int(parent_pid))
    try:
        os.nice(int(nice))
    except OSError:
        pass
    if cpus:
        try:
            os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
        except (OSError, AttributeError):
            pass  # an affinity is a placement hint; uploads work anywhere
    from torchreplay.checkpoint.store import open_store, with_retries

    budget = float(retry_budget_s)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    # Anything else printing to stdout would corrupt the reply stream.
    sys.stdout = sys.stderr

    def open_once():
        try:
            return open_store(uri, endpoint_url or None, int(multipart_bytes), retry_budget_s=budget)
        except OSError as exc:  # e.g. a local directory that cannot be created: maybe transient
            raise CheckpointError(f"cannot open {uri}: {exc}") from exc

    store = None
    while True:
        try:
            frame = read_frame(stdin)
        except (EOFError, ValueError, OSError):
            return
        if frame is None:
            return
        header, payload = frame
        data = b""
        try:
            if store is None:
                store = with_retries(open_once, budget, f"open {uri}")
            op = header.get("op")
            if op == "put":
                key = header["key"]
                with_retries(lambda: store.put(key, payload), budget, f"upload {key}")
                result = None
            elif op == "put_file":
                key, path = header["key"], header["path"]
                with_retries(lambda: store.put_file(key, path), budget, f"upload {key}")
                result = None
            elif op == "put_files":
                for key, path in header["items"]:
                    with_retries(lambda: store.put_file(key, path), budget, f"upload {key}")
                result = None
            elif op == "get":
                key = header["key"]
                data = with_retries(lambda: store.get(key), budget, f"download {key}")
                result = None
            elif op == "list":
                room = header["room"]
                result = with_retries(lambda: store.list(room), budget, f"list {room}")
            elif op == "delete":
                keys = header["keys"]
                with_retries(lambda: store.delete(keys), budget, "delete")
                result = None
            else:
                raise CheckpointError(f"unknown upload helper op {op!r}")
            reply = {"ok": True, "result": result}
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the trainer
            reply, data = {"ok": False, "error": str(exc), "kind": type(exc).__name__}, b""
        try:
            write_frame(stdout, reply, data)
        except OSError:
            return
