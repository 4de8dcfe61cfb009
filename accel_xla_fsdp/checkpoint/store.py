"""Where checkpoints live: a local folder or any fsspec URL (``s3://``, ``gs://``, ``memory://``, ...).

[Note: checkpoint locations]
Every checkpoint path goes through ``Location.of``: a string with ``://`` is a URL, opened with
fsspec (``s3fs`` for ``s3://``, ``gcsfs`` for ``gs://``: the ``s3`` and ``gcs`` extras), and
never taken as a local path (``save_state("s3://b/x")`` once wrote a local folder ``./s3:/b/x``);
anything else is a local path. A ``Location`` prints as the user wrote it (a local path as an
absolute path), so every message names the place the user knows.

Stores offer whole-object writes and no rename, so the checkpoint protocol needs only these
operations: write a whole file (a rank file streamed, or a small record in one ``put``), read a
file or a byte range of it, list a folder, remove a file. On a local disk ``put`` goes through a
temporary file and a rename in the same folder, so that a small record appears whole or not at
all there as it does in a bucket; rank files are written in place and ``fsync``ed.

Store calls are retried ([Note: store failures]): a transient failure (a dropped connection, a
timeout, an I/O error the store reports, a throttled request) is tried again after a backoff, at
most ``ATTEMPTS`` times in all; a permanent one (no permission, no such bucket, a full or
read-only disk) is raised at once as a ``CheckpointError`` naming the location.
"""

from __future__ import annotations

import errno
import logging
import os
import posixpath
import time
from pathlib import Path
from typing import Any, Callable, List, Optional, TypeVar, Union

import fsspec
from fsspec.implementations.local import LocalFileSystem

from .errors import CheckpointError
from .files import file_mode, write_atomically

logger = logging.getLogger(__name__)
T = TypeVar("T")

ATTEMPTS = 5  # every store call: the first try and at most 4 retries
BACKOFF_S = 0.1  # before retry k (1, 2, ...): BACKOFF_S * 2 ** (k - 1)
# Errors that say the same call will fail again: no retry.
PERMANENT_ERRNOS = {errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.ENOENT, errno.ENOTDIR}
PERMANENT_TYPES = (PermissionError, FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError)

PathLike = Union[str, "os.PathLike[str]", "Location"]


def is_url(where: PathLike) -> bool:
    """A URL (``s3://...``, any fsspec protocol), never taken as a local path."""
    if isinstance(where, Location):
        return not where.local
    return "://" in os.fspath(where)


class Location:
    """A file or folder in a filesystem (local or fsspec's), printed as the user knows it."""

    def __init__(self, fs: Any, path: str, shown: str) -> None:
        self.fs, self.path, self.shown = fs, path, shown

    @classmethod
    def of(cls, where: PathLike) -> Location:
        if isinstance(where, Location):
            return where
        text = os.fspath(where)
        if not is_url(text):
            path = os.path.abspath(text)
            return cls(LocalFileSystem(), path, path)
        protocol = text.split("://", 1)[0]
        try:
            fs, path = fsspec.core.url_to_fs(text)
        except ImportError as e:
            extra = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}.get(protocol)
            hint = f"pip install 'accel-xla-fsdp[{extra}]'" if extra else "install the fsspec filesystem for it"
            raise CheckpointError(f"{text}: the {protocol}:// filesystem is not installed ({e}); {hint}") from None
        except ValueError as e:
            raise CheckpointError(f"{text}: not a location fsspec knows ({e})") from None
        if isinstance(fs, LocalFileSystem):
            return cls(fs, path, text)
        return cls(fs, path.rstrip("/"), text.rstrip("/"))

    @property
    def local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    @property
    def name(self) -> str:
        return posixpath.basename(self.path.rstrip("/"))

    @property
    def parent(self) -> Location:
        return Location(self.fs, posixpath.dirname(self.path.rstrip("/")), posixpath.dirname(self.shown.rstrip("/")))

    def __truediv__(self, name: str) -> Location:
        return Location(self.fs, posixpath.join(self.path, name), posixpath.join(self.shown, name))

    def __str__(self) -> str:
        return self.shown

    def __repr__(self) -> str:
        return f"Location({self.shown!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Location) and (type(self.fs), self.path) == (type(other.fs), other.path)

    def __hash__(self) -> int:
        return hash((type(self.fs), self.path))

    def as_path(self) -> Path:
        assert self.local, self
        return Path(self.path)

    # -- calls, each retried ([Note: store failures]) ------------------------------------

    def retried(self, what: str, call: Callable[[], T]) -> T:
        return retried(self, what, call)

    def exists(self) -> bool:
        return self.retried("look up", lambda: bool(self.fs.exists(self.path)))

    def isfile(self) -> bool:
        return self.retried("look up", lambda: bool(self.fs.isfile(self.path)))

    def isdir(self) -> bool:
        return self.retried("look up", lambda: bool(self.fs.isdir(self.path)))

    def size(self) -> int:
        return int(self.retried("look up", lambda: self.fs.size(self.path)))

    def names(self) -> List[str]:
        """The entries of this folder (none if it is missing), fresh from the store: other hosts
        write into it, so a listing cached by the filesystem object would be stale."""

        def ls() -> List[str]:
            self.fs.invalidate_cache(self.path)
            try:
                entries = self.fs.ls(self.path, detail=False)
            except FileNotFoundError:
                return []
            return sorted({posixpath.basename(str(e).rstrip("/")) for e in entries} - {""})

        return self.retried("list", ls)

    def read_bytes(self, limit: Optional[int] = None) -> bytes:
        def read() -> bytes:
            with self.fs.open(self.path, "rb") as f:
                return f.read() if limit is None else f.read(limit)

        return self.retried("read", read)

    def read_range(self, start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)`` of this file: one ranged read in a bucket."""
        if stop <= start:
            return b""
        data = self.retried("read", lambda: self.fs.cat_file(self.path, start=start, end=stop))
        if len(data) != stop - start:
            raise CheckpointError(f"{self}: ends before byte {stop} (truncated)")
        return data

    def put(self, data: bytes) -> None:
        """Write the whole file in one step: it is there whole, or as it was ([Note: checkpoint
        locations]: a temporary file and a rename in its folder on a local disk)."""
        if self.local:
            self.retried("write", lambda: _put_local(Path(self.path), data))
        else:
            self.retried("write", lambda: self.fs.pipe_file(self.path, data))

    def write_stream(self, write: Callable[[Any], T]) -> T:
        """Write the file through ``write(file object)``, again from the start on a transient
        failure; on a local disk flushed to it (``fsync``) before returning."""

        def attempt() -> T:
            if self.local:
                path = Path(self.path)
                path.parent.mkdir(parents=True, exist_ok=True)
                with open(path, "wb") as f:
                    result = write(f)
                    f.flush()
                    os.fsync(f.fileno())
                os.chmod(path, file_mode())
                return result
            f = self.fs.open(self.path, "wb")
            try:
                result = write(f)
            except BaseException:
                # Closing would upload what was written so far: abort the upload instead.
                discard = getattr(f, "discard", None)
                if discard is not None:
                    discard()
                raise
            f.close()
            return result

        return self.retried("write", attempt)

    def remove(self) -> None:
        """Remove this file; missing already is fine."""

        def rm() -> None:
            try:
                self.fs.rm_file(self.path)
            except FileNotFoundError:
                pass

        self.retried("remove", rm)

    def makedirs(self) -> None:
        if self.local:
            # Through symbolic links: a link to a folder yet to be made makes that folder.
            self.retried("create", lambda: os.makedirs(os.path.realpath(self.path), exist_ok=True))
        # A bucket has no folders: a key's prefix exists once a file is written under it.

    def remove_dir_if_empty(self) -> None:
        """A local folder left empty (a bucket has no empty folders to remove)."""
        if self.local:
            try:
                os.rmdir(self.path)
            except OSError:
                pass


def _put_local(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, lambda tmp: tmp.write_bytes(data))


# [Note: store failures]
# A store call that fails with a transient error is tried again, ATTEMPTS times in all, after
# BACKOFF_S, 2 x BACKOFF_S, ... (1.5 s in all by default): a dropped connection, a timeout, a
# throttled request, an I/O error (s3fs reports the store's 5xx answers as EIO). Permanent errors
# (no permission, no such bucket or file, a full or read-only disk) are not retried: the save ends
# at once with a message naming the location, the previous checkpoint untouched. A
# ``CheckpointError`` (bad content, not a failed call) is never retried.


def is_transient(error: BaseException) -> bool:
    if isinstance(error, CheckpointError):
        return False
    if isinstance(error, (ConnectionError, TimeoutError)):
        return True
    if isinstance(error, PERMANENT_TYPES):
        return False
    if isinstance(error, OSError):
        return error.errno not in PERMANENT_ERRNOS
    return False


def retried(where: Any, what: str, call: Callable[[], T], attempts: Optional[int] = None) -> T:
    attempts = attempts or ATTEMPTS
    for attempt in range(1, attempts + 1):
        try:
            return call()
        except Exception as e:  # noqa: BLE001 - sorted into transient and permanent below
            if not is_transient(e):
                if isinstance(e, OSError):
                    raise CheckpointError(f"{where}: cannot {what} it ({_describe(e)})") from e
                raise
            if attempt == attempts:
                raise CheckpointError(
                    f"{where}: cannot {what} it: {attempts} attempts failed, the last with {_describe(e)}"
                ) from e
            delay = BACKOFF_S * 2 ** (attempt - 1)
            logger.warning("%s: %s failed (%s); trying again in %.1f s", where, what, _describe(e), delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


def _describe(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    return f"{type(error).__name__}: {text}" if not text.startswith(type(error).__name__) else text
