"""Object-store back ends behind one small interface: `s3://bucket/prefix` (boto3) and
`file:///path` (the embedded default). Keys are relative to the store's prefix.

Both publish atomically: a local file is written to a temporary name, fsynced and renamed; an S3
object becomes visible only when its PUT (or multipart completion) succeeds.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import re
import stat
import tempfile
import time
from typing import Callable, Protocol, TypeVar
from urllib.parse import urlparse

from torchreplay.errors import CheckpointError

log = logging.getLogger("torchreplay.checkpoint")
T = TypeVar("T")

# Keys a checkpoint writes: no absolute paths, no "..", nothing outside these rooms.
KEY_PATTERN = re.compile(r"^(shards|manifests|state|tags)/[A-Za-z0-9._-]{1,200}$|^LATEST$")
ROOMS = ("shards", "manifests", "state", "tags")
# OS errors that waiting will not fix: the next publish tries again, but this one stops at once.
PERMANENT_ERRNOS = {errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.ENAMETOOLONG,
                    errno.ENOTDIR, errno.EISDIR}
# S3 answers that a retry cannot change (a missing bucket, refused credentials, a malformed request).
# Only these codes: others (RequestTimeout, BadDigest, SlowDown, a refreshable ExpiredToken...)
# may clear on a retry even when they come with a 400.
PERMANENT_S3_CODES = {"NoSuchBucket", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                      "InvalidBucketName", "AllAccessDisabled", "AccountProblem", "InvalidRequest",
                      "InvalidArgument", "MalformedXML", "InvalidToken", "NotImplemented", "MethodNotAllowed"}


class MissingObject(CheckpointError):
    """The object does not exist. Not retried: S3 and local files are strongly consistent, so a
    missing object stays missing (a deleted shard, a wrong prefix)."""


class PermanentError(CheckpointError):
    """A failure that a retry cannot fix (403, a missing bucket, 400, EACCES or ENOSPC on a
    file:// root): raised at once instead of spending the retry budget."""


class RefusedObject(CheckpointError):
    """The object is there but must not be read (a symlink, a FIFO, outside the root). Not
    retried: it will not become a regular file by waiting."""


def _file_error(what: str, path: str, exc: OSError) -> CheckpointError:
    if isinstance(exc, FileNotFoundError):
        cls = MissingObject
    elif exc.errno in PERMANENT_ERRNOS:
        cls = PermanentError
    else:
        cls = CheckpointError
    return cls(f"cannot {what} {path}: {exc}")


def _open_regular(root: str, path: str) -> int:
    """A read descriptor on `path`, only if it is a regular file inside `root`: the last component
    is not followed if it is a symlink (O_NOFOLLOW), no directory on the way may lead outside the
    root, and O_NONBLOCK makes a FIFO an error here instead of a read that never returns."""
    real_root = os.path.realpath(root)
    if os.path.commonpath([real_root, os.path.realpath(os.path.dirname(path))]) != real_root:
        raise RefusedObject(f"{path} lies outside the checkpoint root {root}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise RefusedObject(f"{path} is a symlink: checkpoint objects must be regular files") from exc
        raise _file_error("open", path, exc) from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise RefusedObject(f"{path} is not a regular file (a FIFO, device or directory)")
    os.set_blocking(fd, True)
    return fd


def check_key(key: str) -> str:
    if not isinstance(key, str) or not KEY_PATTERN.match(key) or ".." in key:
        raise CheckpointError(f"object key {key!r} is not a valid checkpoint key (confined to the run prefix)")
    return key


class ObjectStore(Protocol):
    uri: str

    def put(self, key: str, data: bytes) -> None: ...

    def put_file(self, key: str, path: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def get_to_file(self, key: str, path: str) -> None: ...

    def get_range(self, key: str, start: int, length: int) -> bytes: ...

    def size(self, key: str) -> int: ...

    def exists(self, key: str) -> bool: ...

    def list(self, room: str) -> list[str]: ...

    def delete(self, keys: list[str]) -> None: ...

    def probe(self) -> None: ...


class FileStore:
    """A local directory. `put` is atomic (temp file, fsync, rename, fsync of the directory)."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.uri = "file://" + self.root
        for room in ROOMS:
            path = os.path.join(self.root, room)
            try:
                os.makedirs(path, exist_ok=True)
            except OSError as exc:
                raise _file_error("create", path, exc) from exc

    def probe(self) -> None:
        """Fail now, naming the directory, if checkpoints cannot be written there."""
        for room in ROOMS:
            directory = os.path.join(self.root, room)
            try:
                fd, path = tempfile.mkstemp(dir=directory, prefix=".probe.partial-")
                os.close(fd)
                os.unlink(path)
            except OSError as exc:
                raise _file_error("write in", directory, exc) from exc

    def _path(self, key: str) -> str:
        return os.path.join(self.root, check_key(key))

    def _publish(self, key: str, write: Callable[[str], None]) -> None:
        path = self._path(key)
        tmp = f"{path}.partial-{os.getpid()}"
        try:
            write(tmp)
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            dfd = os.open(os.path.dirname(path), os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise _file_error("write", path, exc) from exc

    def put(self, key: str, data: bytes) -> None:
        def write(tmp: str) -> None:
            with open(tmp, "wb") as f:
                f.write(data)

        self._publish(key, write)

    def put_file(self, key: str, path: str) -> None:
        def write(tmp: str) -> None:
            try:
                os.link(path, tmp)  # same file system: no copy needed, the source is immutable
            except OSError:
                with open(path, "rb") as src, open(tmp, "wb") as dst:
                    while chunk := src.read(8 << 20):
                        dst.write(chunk)

        self._publish(key, write)

    def _open(self, key: str):
        return os.fdopen(_open_regular(self.root, self._path(key)), "rb")

    def get(self, key: str) -> bytes:
        try:
            with self._open(key) as f:
                return f.read()
        except OSError as exc:
            raise _file_error("read", self._path(key), exc) from exc

    def get_to_file(self, key: str, path: str) -> None:
        src = self._path(key)
        try:
            with self._open(key) as s:
                try:
                    os.link(src, path)  # same file system: no copy (checked a regular file just now)
                except OSError:
                    with open(path, "wb") as d:
                        while chunk := s.read(8 << 20):
                            d.write(chunk)
        except OSError as exc:
            raise _file_error("read", src, exc) from exc

    def get_range(self, key: str, start: int, length: int) -> bytes:
        try:
            with self._open(key) as f:
                f.seek(start)
                return f.read(length)
        except OSError as exc:
            raise _file_error("read", self._path(key), exc) from exc

    def size(self, key: str) -> int:
        with self._open(key) as f:
            return os.fstat(f.fileno()).st_size

    def exists(self, key: str) -> bool:
        return os.path.exists(self._path(key))

    def list(self, room: str) -> list[str]:
        directory = os.path.join(self.root, room)
        if not os.path.isdir(directory):
            return []
        return sorted(f"{room}/{name}" for name in os.listdir(directory) if ".partial-" not in name)

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            try:
                os.unlink(self._path(key))
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise _file_error("delete", self._path(key), exc) from exc


class S3Store:
    """`s3://bucket/prefix` through boto3, honouring the standard AWS configuration (environment,
    profiles, AWS_ENDPOINT_URL). Large objects go up in multipart uploads; every request carries a
    CRC32 checksum the server verifies. Credentials are never logged."""

    def __init__(self, uri: str, endpoint_url: str | None = None, multipart_bytes: int = 64 << 20,
                 retry_budget_s: float = 60.0) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        parsed = urlparse(uri)
        if parsed.scheme != "s3" or len(parsed.netloc) < 3:
            raise ValueError(f"S3 URI must look like s3://bucket/prefix (bucket of 3+ characters), got {uri!r}")
        self.uri = uri.rstrip("/")
        self.bucket = parsed.netloc
        self.prefix = parsed.path.strip("/")
        self.endpoint_url = endpoint_url
        # botocore's standard mode retries what it classifies as transient (throttling, 5xx,
        # dropped connections) with jittered backoff, per request, so one failed multipart part is
        # retried alone. `with_retries` bounds the whole operation by the wall-clock budget, and
        # the attempts and timeouts of one request are sized so it cannot overrun it by much.
        budget = max(float(retry_budget_s), 1.0)
        config = Config(retries={"total_max_attempts": 5 if budget >= 20 else 2, "mode": "standard"},
                        connect_timeout=min(5.0, budget / 4), read_timeout=min(30.0, budget / 2),
                        request_checksum_calculation="when_supported")
        session = boto3.session.Session()
        self.client = session.client("s3", endpoint_url=endpoint_url, config=config)
        self.probe_client = session.client("s3", endpoint_url=endpoint_url, config=config.merge(Config(
            retries={"total_max_attempts": 2, "mode": "standard"}, connect_timeout=2.0, read_timeout=5.0)))
        self.transfer = TransferConfig(multipart_threshold=multipart_bytes, multipart_chunksize=multipart_bytes,
                                       use_threads=True, max_concurrency=4)

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _wrap(self, what: str, key: str, fn: Callable[[], T]) -> T:
        from boto3.exceptions import Boto3Error
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn()
        except (BotoCoreError, ClientError, Boto3Error) as exc:
            code, status = s3_error_code(exc)
            raise s3_error_class(code, status)(f"S3 {what} s3://{self.bucket}/{self._key(key)} failed ({code or type(exc).__name__}): "
                      f"{exc}") from exc

    def probe(self) -> None:
        """Fail now if the bucket is missing or the credentials are refused: one listing of the
        prefix, which needs both (a PermanentError names the bucket and S3's error code). Two
        short attempts at most: an endpoint that does not answer is an outage, not an error, and
        this runs on the trainer's thread."""
        self._wrap("list", "LATEST", lambda: self.probe_client.list_objects_v2(
            Bucket=self.bucket, Prefix=self._key("LATEST"), MaxKeys=1))

    def put(self, key: str, data: bytes) -> None:
        self._wrap("put", key, lambda: self.client.put_object(
            Bucket=self.bucket, Key=self._key(key), Body=data, ChecksumAlgorithm="CRC32"))

    def put_file(self, key: str, path: str) -> None:
        self._wrap("upload", key, lambda: self.client.upload_file(
            path, self.bucket, self._key(key), ExtraArgs={"ChecksumAlgorithm": "CRC32"}, Config=self.transfer))

    def get(self, key: str) -> bytes:
        def fetch() -> bytes:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key), ChecksumMode="ENABLED")["Body"].read()

        return self._wrap("get", key, fetch)

    def get_to_file(self, key: str, path: str) -> None:
        self._wrap("download", key, lambda: self.client.download_file(
            self.bucket, self._key(key), path, Config=self.transfer))

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if length <= 0:
            return b""
        # No ChecksumMode: S3 has no checksum for a byte range; the shard's page CRCs cover it.
        return self._wrap("get", key, lambda: self.client.get_object(
            Bucket=self.bucket, Key=self._key(key), Range=f"bytes={start}-{start + length - 1}")["Body"].read())

    def size(self, key: str) -> int:
        return int(self._wrap("head", key, lambda: self.client.head_object(
            Bucket=self.bucket, Key=self._key(key)))["ContentLength"])

    def exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise CheckpointError(f"S3 head s3://{self.bucket}/{self._key(key)} failed: {exc}") from exc

    def list(self, room: str) -> list[str]:
        base = f"{self.prefix}/{room}/" if self.prefix else f"{room}/"

        def run() -> list[str]:
            keys = []
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base):
                keys += [obj["Key"][len(base) - len(room) - 1 :] for obj in page.get("Contents", [])]
            return sorted(keys)

        return self._wrap("list", room, run) if room else []

    def delete(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):
            batch = [{"Key": self._key(k)} for k in keys[i : i + 1000]]
            if batch:
                self._wrap("delete", keys[i], lambda: self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}))


def s3_error_code(exc: BaseException) -> tuple[str | None, int | None]:
    """S3's error code and HTTP status behind `exc`, which may wrap the ClientError (boto3's
    transfer manager raises its own exception types with the original as the cause)."""
    from botocore.exceptions import ClientError

    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, ClientError):
            return (exc.response.get("Error", {}).get("Code"),
                    exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode"))
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None, None


def s3_error_class(code: str | None, status: int | None) -> type[CheckpointError]:
    """How an S3 error is handled: MissingObject and PermanentError are not retried."""
    if code in ("404", "NoSuchKey", "NotFound"):
        return MissingObject
    if code in PERMANENT_S3_CODES or status in (401, 403):
        return PermanentError
    return CheckpointError


def open_store(uri: str, endpoint_url: str | None = None, multipart_bytes: int = 64 << 20,
               retry_budget_s: float = 60.0) -> ObjectStore:
    """The store at `uri`; `multipart_bytes` is the size from which S3 uploads go in parts;
    `retry_budget_s` bounds how long one S3 request may take, its own retries included."""
    if not isinstance(uri, str):
        raise TypeError(f"checkpoint uri must be a str, got {type(uri).__name__}")
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"file URI must be file:///absolute/path, got {uri!r}")
        return FileStore(parsed.path)
    if parsed.scheme == "s3":
        return S3Store(uri, endpoint_url=endpoint_url or os.environ.get("AWS_ENDPOINT_URL"),
                       multipart_bytes=multipart_bytes, retry_budget_s=retry_budget_s)
    raise ValueError(f"checkpoint uri must start with s3:// or file://, got {uri!r}")


def check_retry_budget(retry_budget_s: object) -> float:
    """`retry_budget_s` as seconds: a number >= 0 (inf: retry for as long as it takes)."""
    if isinstance(retry_budget_s, bool) or not isinstance(retry_budget_s, (int, float)):
        raise TypeError(f"retry_budget_s must be a number of seconds >= 0, got {type(retry_budget_s).__name__}")
    if not retry_budget_s >= 0:  # NaN too
        raise ValueError(f"retry_budget_s must be a number >= 0, got {retry_budget_s!r}")
    return float(retry_budget_s)


def open_reader(uri: str, endpoint_url: str | None = None, retry_budget_s: float = 60.0) -> "RetriedReads":
    """The store at `uri` for reading a checkpoint back, with its one retry layer: each read may
    keep failing transiently for `retry_budget_s` seconds before it raises (an S3 request's own
    attempts and timeouts are sized from the same budget, inside it). Callers do not retry again."""
    budget = check_retry_budget(retry_budget_s)
    return RetriedReads(open_store(uri, endpoint_url, retry_budget_s=budget), budget)


class RetriedReads:
    """A store whose reads are retried (transient errors, within `budget_s` each), for restores:
    one dropped connection must not fail a resume. Only the I/O is retried, never a validation
    of what was read, so a hostile object is still refused at once. The one retry layer of a
    restore (open_reader): what reads through it does not wrap it in `with_retries` again, which
    would multiply the budget."""

    def __init__(self, store: ObjectStore, budget_s: float = 60.0) -> None:
        self.store, self.budget_s, self.uri = store, check_retry_budget(budget_s), store.uri

    def _retry(self, what: str, fn: Callable[[], T]) -> T:
        return with_retries(fn, self.budget_s, what)

    def get(self, key: str) -> bytes:
        return self._retry(f"read {key}", lambda: self.store.get(key))

    def get_to_file(self, key: str, path: str) -> None:
        self._retry(f"download {key}", lambda: self.store.get_to_file(key, path))

    def get_range(self, key: str, start: int, length: int) -> bytes:
        return self._retry(f"read {key}", lambda: self.store.get_range(key, start, length))

    def size(self, key: str) -> int:
        return self._retry(f"size of {key}", lambda: self.store.size(key))

    def exists(self, key: str) -> bool:
        return self._retry(f"look up {key}", lambda: self.store.exists(key))

    def list(self, room: str) -> list[str]:
        return self._retry(f"list {room}", lambda: self.store.list(room))


def with_retries(fn: Callable[[], T], budget_s: float, what: str, base_s: float = 0.05, cap_s: float = 2.0,
                 rng: random.Random | None = None) -> T:
    """Call `fn` until it succeeds or `budget_s` seconds are spent: exponential backoff with full
    jitter (sleep ~ U[0, min(cap, base * 2^attempt)]). Raises the last CheckpointError."""
    rng = rng or random.Random()
    deadline = time.monotonic() + budget_s
    attempt = 0
    while True:
        try:
            return fn()
        except (MissingObject, RefusedObject, PermanentError):
            raise
        except CheckpointError as exc:
            attempt += 1
            delay = rng.uniform(0, min(cap_s, base_s * 2**attempt))
            if time.monotonic() + delay > deadline:
                raise CheckpointError(f"{what}: gave up after {attempt} attempts in {budget_s:.0f}s: {exc}") from exc
            log.warning("torchreplay checkpoint: %s failed (attempt %d), retrying in %.2fs", what, attempt, delay)
            time.sleep(delay)
