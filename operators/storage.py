"""One storage layer for local paths and object storage (``s3://``), used by every read and write of a run.

Paths go through fsspec (s3fs for ``s3://``). :class:`Storage` carries the options of the object store (endpoint,
region and, only when given in config, credentials) to every Ray task, and wraps each I/O operation in
:meth:`Storage.retry`: errors known to be transient (throttling, connection refused or reset, timeouts, HTTP 5xx)
are retried with bounded exponential backoff; every other error fails at once, with the path in its message
(STYLE practice 6: "retry only errors known to be transient").

Endpoint, region and credentials come from the config (``[storage]``), else the standard AWS environment and
profile, resolved once per process with botocore's rules (:mod:`operators.s3config`, which gives the order); s3fs and
every pyarrow filesystem (:meth:`Storage.arrow_filesystem`: Ray Data's reads, Ray Train's checkpoints) get the same
values (:meth:`Storage.s3`). An ``ExpiredToken`` error asks the credential provider once for new credentials and
retries; otherwise it is one :class:`CredentialsExpiredError` saying how to renew them. Credentials are never
written into a manifest, a log line or an error message: :meth:`Storage.__repr__` and :func:`redact` hide them.

Atomic publication: on a local disk a file is written under a hidden temporary name (``.name.tmp-<uuid>``) in the
target folder and renamed; on an object store a PUT (or a completed multipart upload) makes an object visible only
when it is complete, so the file is written under its final name directly (S3 has no atomic rename; copy + delete
could leave a visible temporary object behind a kill).
"""

from __future__ import annotations

import errno
import logging
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, TypeVar

from pairmine.operators.errors import PairmineError

log = logging.getLogger("pairmine")
T = TypeVar("T")

# S3 error codes that mean "try again later" (AWS docs, "Error responses"; throttling codes of other S3 servers).
TRANSIENT_S3_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests", "RequestTimeout",
    "RequestTimeoutException", "InternalError", "ServiceUnavailable", "503", "500", "502", "504", "429",
})
TRANSIENT_ERRNOS = frozenset({errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.ETIMEDOUT, errno.EPIPE,
                              errno.EHOSTUNREACH, errno.ENETUNREACH, getattr(errno, "EREMOTEIO", errno.EIO)})
_SECRET_KEYS = ("key", "secret", "token", "access_key_id", "secret_access_key", "session_token", "password")


class StorageError(PairmineError, OSError):
    """A storage operation failed for good (not transient, or still failing after the retries); the message names
    the operation and the path, never a credential. User-fixable (path, permissions, credentials, endpoint)."""


class CredentialsExpiredError(StorageError):
    """The S3 credentials expired and their provider gave no new ones (or the new ones expired too); the message
    names the operation, the path, where the credentials came from and how to renew them."""


def expired_message(what: str, path: str, settings, renewed: bool) -> str:
    """The one-line message of a :class:`CredentialsExpiredError` for ``what`` on ``path`` with ``settings`` (an
    :class:`operators.s3config.S3Settings`); ``renewed``: the provider gave new credentials, refused as expired too
    (else it gave none new)."""
    again = " and the renewed ones were refused too" if renewed else " and their provider gives no new ones"
    return (f"{what} {path} failed: the S3 credentials (from {settings.credentials_source}) have expired{again}; "
            f"{settings.renew_hint}, then run the same command again (a run resumes where it stopped)")


def is_transient(error: BaseException) -> bool:
    """True for errors worth retrying: connection refused/reset/closed, timeouts, throttling and HTTP 5xx/429 from
    an object store. Looks through ``__cause__``/``__context__`` (s3fs wraps botocore errors in OSError)."""
    seen = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)):
            return False
        if isinstance(e, (ConnectionError, TimeoutError)):
            return True
        name = type(e).__name__
        module = type(e).__module__ or ""
        if module.startswith(("botocore", "aiohttp", "urllib3")) and (
            "Connection" in name or "Timeout" in name or name in ("IncompleteRead", "ResponseParserError",
                                                                  "ClientPayloadError", "ServerDisconnectedError")
        ):
            return True
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            code = str(response.get("Error", {}).get("Code", ""))
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            if code in TRANSIENT_S3_CODES or status >= 500 or status == 429:
                return True
        if isinstance(e, OSError) and e.errno in TRANSIENT_ERRNOS:
            return True
        if any(code in str(e) for code in ("SlowDown", "ServiceUnavailable", "reduce your request rate")):
            return True
        e = e.__cause__ or e.__context__
    return False


def redact(value):
    """A copy of ``value`` (dict/list/scalar) with every credential-like entry replaced by ``"***"`` when set."""
    if isinstance(value, dict):
        return {k: ("***" if any(s in str(k).lower() for s in _SECRET_KEYS) and v else redact(v)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v) for v in value)
    return value


def is_local(path: str) -> bool:
    return "://" not in path or path.startswith("file://")


@dataclass(frozen=True)
class Storage:
    """Filesystem access with retries, picklable (it travels into Ray tasks).

    Args:
        endpoint_url: S3 endpoint (e.g. ``http://127.0.0.1:8333``); empty: ``$AWS_ENDPOINT_URL`` or AWS.
        region: S3 region; empty: the AWS environment's.
        access_key_id, secret_access_key, session_token: only when not taken from the environment or a profile.
        attempts: tries of one operation before it fails (1 = no retry).
        backoff_s: first wait; it doubles per try (with jitter) up to ``backoff_max_s``.
    """

    endpoint_url: str = ""
    region: str = ""
    access_key_id: str = field(default="", repr=False)
    secret_access_key: str = field(default="", repr=False)
    session_token: str = field(default="", repr=False)
    attempts: int = 8
    backoff_s: float = 0.5
    backoff_max_s: float = 20.0

    def __repr__(self) -> str:  # never show credentials (Ray prints task arguments in some errors)
        return (f"Storage(endpoint_url={self.endpoint_url!r}, region={self.region!r}, attempts={self.attempts}, "
                f"credentials={'from config' if self.access_key_id else 'from the environment'})")

    def s3(self):
        """The :class:`operators.s3config.S3Settings` every S3 client of this process gets: endpoint, region and
        credentials of ``[storage]``, else of the AWS environment and profile (botocore's resolution), with the
        source of each (``.describe()``). Resolved once per process; renewed credentials of a provider show here.

        Raises:
            operators.s3config.S3ConfigError: the AWS configuration cannot be read (unknown ``AWS_PROFILE``, ...).
        """
        from pairmine.operators.s3config import resolve

        return resolve(self.endpoint_url, self.region, self.access_key_id, self.secret_access_key,
                       self.session_token)

    def options(self, path: str) -> dict:
        """fsspec storage options for ``path`` (empty for local paths): for ``s3://``, :meth:`s3`'s values."""
        if is_local(path) or not path.startswith(("s3://", "s3a://")):
            return {}
        opts = self.s3().s3fs_options()
        # botocore's own retries stay short; the backoff that rides out an outage is ours (retry()).
        opts["config_kwargs"] = {"retries": {"max_attempts": 2, "mode": "standard"}, "connect_timeout": 5,
                                 "read_timeout": 60}
        return opts

    def fs(self, path: str):
        """(fsspec filesystem, path without protocol) for ``path``: for this class's operations (and tests); the
        commands use the operations, which retry."""
        import fsspec

        return fsspec.core.url_to_fs(path, **self.options(path))

    def retry(self, what: str, path: str, fn: Callable[[], T]) -> T:
        """Run ``fn()``; retry transient errors with bounded backoff, fail at once on any other.

        An ``ExpiredToken`` error (:func:`operators.s3config.is_expired_token`) asks the credential provider once for
        new credentials and retries with them (``fn`` must get its filesystem from :meth:`fs` inside, so that it
        uses them).

        Raises:
            FileNotFoundError: as raised (never retried).
            CredentialsExpiredError: the credentials expired and their provider gave no new ones, or the new ones
                were refused as expired too.
            StorageError: ``what`` failed on ``path``: any other OSError (permission denied included) or error of
                the S3 client (no credentials, ...), at once; a transient error after ``attempts`` tries. The
                message names the path.
            Exception: errors that are not about storage (a missing column, a corrupt file) are re-raised as they
                are, at once.
        """
        from pairmine.operators.s3config import is_expired_token, refresh

        wait, asked_again, attempt = self.backoff_s, False, 0
        while attempt < self.attempts:
            attempt += 1
            try:
                return fn()
            except (FileNotFoundError, StorageError):
                raise
            except Exception as e:  # classified below: transient ones are retried, the rest fail at once
                if not is_local(path) and is_expired_token(e):
                    settings = self.s3()
                    if not asked_again:  # once: a provider that renews credentials may have new ones
                        asked_again = True
                        renewed = refresh(self.endpoint_url, self.region, self.access_key_id,
                                          self.secret_access_key, self.session_token)
                        if renewed is not None:
                            _invalidate(path, self)
                            attempt -= 1  # the try with the renewed credentials is not one of the attempts
                            continue
                        raise CredentialsExpiredError(expired_message(what, path, settings, False)) from e
                    raise CredentialsExpiredError(expired_message(what, path, settings, True)) from e
                transient = is_transient(e)
                if transient and attempt < self.attempts:
                    _invalidate(path, self)
                    sleep = min(wait, self.backoff_max_s) * (0.75 + 0.5 * random.random())
                    log.warning("%s %s: transient error (%s), retry %d/%d in %.1f s", what, path, type(e).__name__,
                                attempt, self.attempts - 1, sleep)
                    time.sleep(sleep)
                    wait *= 2
                    continue
                storage_side = type(e).__module__.split(".")[0] in ("botocore", "aiobotocore", "s3fs", "aiohttp")
                if transient or isinstance(e, OSError) or storage_side:
                    detail = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                    tries = f" after {attempt} tries" if transient else ""
                    raise StorageError(f"{what} {path} failed{tries}: {detail}{self._where(path)}") from e
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _where(self, path: str) -> str:
        """`` (S3: endpoint ... (from ...), region ..., credentials from ...)`` for an s3:// path, to end an error
        message with the values every client used and where they came from (never a credential); else ``""``."""
        if not path.startswith(("s3://", "s3a://")):
            return ""
        try:
            return f" (S3: {self.s3().describe()})"
        except Exception:  # noqa: BLE001 - the message of the error being raised matters more
            return ""

    # ---- the operations a run uses ---------------------------------------------------------------------------
    # Each operation gets its filesystem inside the retried function: a retry after renewed credentials uses them.
    def read_bytes(self, path: str) -> bytes:
        return self.retry("read", path, lambda: _call(self.fs(path), "cat_file"))

    def write_bytes(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` so that readers see the old file or the whole new one, never a part."""
        def put():
            fs, p = self.fs(path)
            if is_local(path):
                folder, name = p.rsplit("/", 1) if "/" in p else (".", p)
                fs.makedirs(folder, exist_ok=True)
                tmp = f"{folder}/.{name}.tmp-{uuid.uuid4().hex}"
                with fs.open(tmp, "wb") as f:
                    f.write(data)
                fs.mv(tmp, p)
            else:
                fs.pipe_file(p, data)

        self.retry("write", path, put)

    def append(self, path: str, data: bytes) -> None:
        """Append ``data`` to the local file ``path`` (a log read line by line, such as train's metrics.jsonl;
        readers may see its last line cut). Object stores have no append: rewrite the file with
        :meth:`write_bytes` there.

        Raises:
            ValueError: ``path`` is not local.
        """
        if not is_local(path):
            raise ValueError(f"append {path}: object storage has no append; write the whole file")
        def add():
            fs, p = self.fs(path)
            with fs.open(p, "ab") as f:
                f.write(data)

        self.retry("append", path, add)

    def write_parquet_stream(self, path: str, schema, tables) -> int:
        """Write the tables of the iterable ``tables`` (each with ``schema``) one after the other as one zstd
        parquet file at ``path``, holding one of them at a time; readers see the old file or the whole new one,
        never a part (local: a hidden temporary file in the same folder, then a rename; object store: a local
        temporary file, then one upload, which becomes visible when complete). Returns the rows written. A
        transient error of the upload is retried; the tables are consumed once, so the local file is written once.

        Raises:
            StorageError: the upload failed for good (the message names the path).
        """
        import os
        import tempfile

        import pyarrow.parquet as pq

        fs, p = self.fs(path)
        if is_local(path):
            folder, name = p.rsplit("/", 1) if "/" in p else (".", p)
            fs.makedirs(folder, exist_ok=True)
            tmp = f"{folder}/.{name}.tmp-{uuid.uuid4().hex}"
        else:
            fd, tmp = tempfile.mkstemp(prefix="pairmine-part-", suffix=".parquet")
            os.close(fd)
        rows = 0
        try:
            with pq.ParquetWriter(tmp, schema, compression="zstd") as writer:
                for table in tables:
                    writer.write_table(table)
                    rows += table.num_rows
            if is_local(path):
                fs.mv(tmp, p)
            else:
                self.retry("write", path, lambda: _call(self.fs(path), "put_file", tmp))
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        return rows

    def absolute(self, path: str) -> str:
        """``path`` normalised as every listing names it: a local path made absolute, a URL kept with its
        protocol (no trailing ``/``)."""
        fs, p = self.fs(path)
        return self.url(path, p)

    def open(self, path: str):
        """``path`` opened for binary reading (a file object; use it in ``with``). Reads on it are not retried:
        call it inside :meth:`retry`, or use :meth:`read_with`, so that a transient error retries the whole read."""
        fs, p = self.fs(path)
        return fs.open(p, "rb")

    def read_with(self, path: str, fn: Callable[[object], T], what: str = "read") -> T:
        """``fn(f)`` on ``path`` opened for binary reading, the open and the whole of ``fn`` retried on a transient
        error (``fn`` must be a pure read: it may run more than once)."""

        def attempt() -> T:
            with self.open(path) as f:
                return fn(f)

        return self.retry(what, path, attempt)

    def read_parquet(self, path: str, columns: list[str] | None = None):
        """The parquet file ``path`` as a pyarrow Table (``columns`` only, when given), retried as a whole."""
        import pyarrow.parquet as pq

        return self.read_with(path, lambda f: pq.read_table(f, columns=columns))

    def files(self, path: str) -> tuple[str, str, list[tuple[str, dict]]]:
        """The files ``path`` names, sorted: (kind, ``path`` normalised (absolute; the URL's protocol kept), [(full
        path, fsspec info)]); kind is ``glob`` (``path`` has ``*``, ``?`` or ``[``), ``folder`` (every file below
        it, recursively) or ``file``. Listed in one retried operation.

        Raises:
            FileNotFoundError: nothing exists at ``path`` (a glob that matches nothing gives ``[]``).
        """
        import glob as _glob

        _, root = self.fs(path)

        def listing() -> tuple[str, list[tuple[str, dict]]]:
            fs = self.fs(path)[0]
            fs.invalidate_cache()
            if _glob.has_magic(root):
                kind, found = "glob", {p: fs.info(p) for p in fs.glob(root)}
            elif fs.isdir(root):
                kind, found = "folder", fs.find(root, detail=True)
            elif fs.exists(root):
                kind, found = "file", {root: fs.info(root)}
            else:
                raise FileNotFoundError(f"{path} does not exist")
            return kind, sorted((p, info) for p, info in found.items() if info.get("type", "file") == "file")

        kind, found = self.retry("list", path, listing)
        return kind, self.url(path, root), [(self.url(path, p), info) for p, info in found]

    def find(self, path: str) -> list[str]:
        """Full paths of every file below folder ``path`` (recursively), sorted; [] if it is missing or a file."""
        try:
            kind, _, found = self.files(path)
        except FileNotFoundError:
            return []
        return [p for p, _ in found] if kind == "folder" else []

    def arrow_filesystem(self, path: str):
        """(pyarrow filesystem, path for it) for a library that takes one (Ray Data's ``read_parquet``, Ray Train's
        ``storage_filesystem``), with the values of :meth:`s3` for ``s3://``: a ``pyarrow.fs.S3FileSystem``
        (endpoint_override/scheme, region, access key, secret, session token; the path is ``bucket/key``), or,
        when the credentials come from a provider that renews them, this storage's s3fs looked up at every call
        (:class:`operators.s3config.CurrentS3Handler`: a snapshot given to pyarrow would expire inside a long
        training run). Local paths: a ``LocalFileSystem``; other URLs: their fsspec filesystem wrapped for pyarrow.
        Its reads and writes are the library's, not retried here.

        Raises:
            operators.s3config.S3ConfigError: as :meth:`s3`.
        """
        import pyarrow.fs as pafs

        fs, p = self.fs(path)
        if is_local(path):
            return pafs.LocalFileSystem(), p
        if not path.startswith(("s3://", "s3a://")):
            return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), p
        from pairmine.operators.s3config import CurrentS3Handler

        settings = self.s3()
        if settings.refreshable:
            return pafs.PyFileSystem(CurrentS3Handler(self)), p
        return pafs.S3FileSystem(**settings.pyarrow_options(bucket=p.split("/", 1)[0])), p

    def info(self, path: str) -> dict | None:
        """fsspec info of ``path`` (``type`` is ``file`` or ``directory``), None when it does not exist, also when a
        part of it is a file (``notes.txt/_SUCCESS`` under an output folder holding a user's file). Unlike
        ``fs.exists``/``fs.isfile``, which answer False when the store cannot be reached, errors are raised."""
        def info():
            fs, p = self.fs(path)
            try:
                return fs.info(p)
            except (FileNotFoundError, NotADirectoryError):
                return None

        return self.retry("check", path, info)

    def exists(self, path: str) -> bool:
        return self.info(path) is not None

    def ls(self, path: str) -> list[str]:
        """Full paths (with the URL's protocol) of the entries directly under folder ``path``; [] if it is missing."""
        def listing():
            fs, p = self.fs(path)
            fs.invalidate_cache(p)
            try:
                return fs.ls(p, detail=False)
            except FileNotFoundError:
                return []

        return [self.url(path, q) for q in self.retry("list", path, listing)]

    def rm(self, path: str) -> None:
        """Remove a file or a folder tree; a missing path is fine."""
        def remove():
            fs, p = self.fs(path)
            fs.invalidate_cache(p)
            try:
                fs.rm(p, recursive=True)
            except FileNotFoundError:
                pass

        self.retry("remove", path, remove)

    def makedirs(self, path: str) -> None:
        if is_local(path):
            self.retry("create folder", path, lambda: _call(self.fs(path), "makedirs", exist_ok=True))

    @staticmethod
    def url(like: str, path: str) -> str:
        """``path`` (protocol stripped by fsspec) with the protocol of ``like`` put back."""
        if is_local(like):
            return path
        proto = like.split("://", 1)[0]
        return path if "://" in path else f"{proto}://{path}"


def join(folder: str, *names: str) -> str:
    """``folder/names...``: a local path as :mod:`os.path` joins it, a URL (``s3://...``) with ``/``."""
    import os

    if "://" not in folder:
        return os.path.join(folder, *names)
    return "/".join([folder.rstrip("/"), *names])


def _call(fs_and_path, method: str, *args, **kwargs):
    """``fs.<method>(*args, path, **kwargs)`` for ``(fs, path)`` of :meth:`Storage.fs` (``put_file``: the local
    file first, as ``args``)."""
    fs, p = fs_and_path
    return getattr(fs, method)(*args, p, **kwargs)


def _invalidate(path: str, storage: Storage) -> None:
    try:
        fs, p = storage.fs(path)
        fs.invalidate_cache(p)
    except Exception:  # cache invalidation is best effort before a retry
        pass


LOCAL = Storage()
