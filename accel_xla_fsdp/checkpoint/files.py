"""Writing files all-or-nothing: checks before writing, atomic replacement, permissions.

Every file is written under a temporary name in the directory it ends up in and renamed into
place: a rename within one directory never crosses a filesystem, whatever is mounted where.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import uuid
from pathlib import Path
from typing import Callable, List

from .errors import CheckpointError

_umask_lock = threading.Lock()


def current_umask() -> int:
    """The process's umask, read without changing it (``os.umask`` sets it: other threads would
    create files with the wrong mode in between)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _umask_lock:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def file_mode() -> int:
    """What ``open()`` gives a new file: 0666 less the umask (safetensors writes 0600)."""
    return 0o666 & ~current_umask()


def nearest_existing(path: Path) -> Path:
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable(directory: Path, what: str = "the output") -> None:
    """``directory`` (or the folder it would be created in) is a directory we may write into."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(f"{directory}: exists and is not a directory")
    existing = nearest_existing(directory)
    if not existing.is_dir():
        raise CheckpointError(f"{existing}: not a directory, so {directory} cannot be created")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise CheckpointError(
            f"{existing}: not writable (read-only filesystem or permissions), so {what} cannot be written there"
        )


SPARE_BYTES = 2**20  # left free beyond the files: what the filesystem's own bookkeeping takes


def check_free_space(directory: Path, nbytes: int, what: str = "the output") -> None:
    existing = nearest_existing(Path(directory))
    free = shutil.disk_usage(existing).free
    if free < nbytes + SPARE_BYTES:
        raise CheckpointError(
            f"{existing}: {readable_size(free)} free, {what} takes {readable_size(nbytes)} "
            f"(and {readable_size(SPARE_BYTES)} is kept spare)"
        )


def readable_size(nbytes: int) -> str:
    """``nbytes`` in the largest unit it is at least one of (a small model's 0.00 GB said nothing)."""
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if nbytes >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes} bytes"


def temporary_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """Write through a temporary file in the same directory, readable as the umask allows,
    flushed to disk, then renamed over ``path``. On any error the temporary file is removed."""
    tmp = temporary_name(path)
    try:
        write(tmp)
        os.chmod(tmp, file_mode())
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    fsync_dir(path.parent)


def numbered_folders(root: Path, name: re.Pattern) -> List[Path]:
    """The folders in ``root`` whose whole name ``name`` matches, by the number its first group
    captures, lowest first (none if ``root`` is not a folder)."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := name.fullmatch(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found, key=lambda item: item[0])]
