"""Checkpoint locations for tests: a real S3 API server on localhost (moto's server mode, as
s3fs's own tests use), a filesystem that injects store failures, and per-host folders that
simulate a pod's hosts without a shared filesystem."""

from __future__ import annotations

import errno
import os
import socket
import threading
from pathlib import Path
from typing import Any, Dict, Optional

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from accel_xla_fsdp.checkpoint.format import find_saves


def record_file(ckpt: Path) -> Path:
    """The record of the newest complete save in ``ckpt`` (``save-<n>/checkpoint.json``)."""
    found = find_saves(ckpt).record_path
    assert found is not None, f"{ckpt}: no complete save"
    return found.as_path()


# ---------------------------------------------------------------------------------------------
# S3 on localhost

S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def use_s3(endpoint: str) -> None:
    """Point s3fs (in this process) at ``endpoint``: what a user's environment does for a real
    bucket. s3fs instances are cached by their arguments, so the endpoint is one of them."""
    os.environ.update(S3_ENV)
    fsspec.config.conf["s3"] = {"client_kwargs": {"endpoint_url": endpoint}, "skip_instance_cache": True}


# ---------------------------------------------------------------------------------------------
# Injected failures: faulty://path is memory://path, with failures on the operations planned


class FaultyFileSystem(MemoryFileSystem):
    """fsspec's memory filesystem whose writes or reads fail as ``FAULTS`` plans: per operation
    ("write", "read", "list", "remove"), ``(count, error)`` (``count`` failures, then success;
    -1: always). Shared by every replica thread of a process, as a bucket is."""

    protocol = ("faulty",)
    store: Dict[str, Any] = MemoryFileSystem.store
    pseudo_dirs = MemoryFileSystem.pseudo_dirs
    FAULTS: Dict[str, list] = {}
    lock = threading.Lock()
    injected: Dict[str, int] = {}

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        text = str(path)
        return MemoryFileSystem._strip_protocol(
            "memory://" + text[len("faulty://") :] if text.startswith("faulty://") else text
        )

    @classmethod
    def plan(cls, **faults: Any) -> None:
        cls.FAULTS = {op: [count, error] for op, (count, error) in faults.items()}
        cls.injected = {}

    def _fault(self, op: str, path: str) -> None:
        with self.lock:
            planned = self.FAULTS.get(op)
            if not planned or planned[0] == 0:
                return
            if planned[0] > 0:
                planned[0] -= 1
            self.injected[op] = self.injected.get(op, 0) + 1
            error = planned[1]
        raise error() if callable(error) else error  # a factory of the error, or the error

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        self._fault("write" if "w" in mode else "read", path)
        return super()._open(path, mode, **kwargs)

    def pipe_file(self, path: str, value: bytes, **kwargs: Any) -> None:
        self._fault("write", path)
        return super().pipe_file(path, value, **kwargs)

    def cat_file(self, path: str, start: Optional[int] = None, end: Optional[int] = None, **kwargs: Any) -> bytes:
        self._fault("read", path)
        return super().cat_file(path, start=start, end=end, **kwargs)

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        self._fault("list", path)
        return super().ls(path, detail=detail, **kwargs)

    def rm_file(self, path: str) -> None:
        self._fault("remove", path)
        return super().rm_file(path)


def transient() -> OSError:
    return ConnectionResetError(errno.ECONNRESET, "Connection reset by peer (injected)")


def permanent() -> OSError:
    return PermissionError(errno.EACCES, "Access Denied (injected)")


fsspec.register_implementation("faulty", FaultyFileSystem, clobber=True)


# ---------------------------------------------------------------------------------------------
# Two hosts without a shared filesystem: host://x is HOSTS_ROOT/host<h>/x, h = this replica's host


class HostFileSystem(LocalFileSystem):
    """A local folder per simulated host: replicas 0-1 are host 0, 2-3 host 1 (``RANKS_PER_HOST``);
    the test process itself (no replica) sees host 0. Each pair writes where the other cannot see."""

    protocol = ("host",)
    root_marker = "/"
    RANKS_PER_HOST = 2

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        text = str(path)
        if text.startswith("host://"):
            text = text[len("host://") :]
            from accel_xla_fsdp import _xla

            try:
                rank = _xla.global_rank()
            except Exception:  # noqa: BLE001 - not on a replica: host 0
                rank = 0
            root = Path(os.environ["ACCEL_XLA_FSDP_TEST_HOSTS"]) / f"host{rank // cls.RANKS_PER_HOST}"
            return str(root / text.lstrip("/"))
        return LocalFileSystem._strip_protocol(text)


fsspec.register_implementation("host", HostFileSystem, clobber=True)
