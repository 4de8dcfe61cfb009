"""Run a function on N XLA devices, one replica per device.

On a TPU this is torch_xla's own launcher (a process per chip). On the CPU there are no chips:
torch_xla gives N XLA:CPU devices in one process, one Python thread each, and that process needs
settings nobody should have to remember (``_xla.cpu_device_env``). It also has two failure modes
that this module turns into errors:

* a replica that raises leaves the others waiting for ever at their next collective. The device
  process therefore runs in a child process; the first replica to fail reports its exception and
  traceback and the whole process ends, and the caller gets the error re-raised within seconds;
* XLA:CPU aborts when replicas reach a collective more than 10 s apart, e.g. while one is still
  compiling; the replicas take turns at every graph boundary, so one compiles and the others
  reuse its program. ``xla_cpu/graph_boundaries.py`` does that in every process that imports it, whoever starts the
  replica threads; the runner only sets how long a replica waits there for the others.

A ``DevicePool`` keeps the device process alive between calls, so compiled programs are shared
(the test suite runs every test of one device count in one pool); ``run_on_devices`` is the one-shot
form for scripts.
"""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import traceback
from contextlib import contextmanager
from multiprocessing.connection import Connection
from typing import Any, Callable, Dict, Iterator, List, NoReturn, Optional, Sequence

import torch
from torch.utils._pytree import tree_map

from . import _xla
from .xla_cpu import graph_boundaries, replica_run

ReplicaFn = Callable[..., Any]


class ReplicaError(RuntimeError):
    """A replica failed in a way that left no exception to re-raise (e.g. the process died)."""


class _RemoteTraceback(Exception):
    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


def run_on_devices(
    fn: ReplicaFn,
    num_devices: Optional[int] = None,
    args: Sequence[Any] = (),
    env: Optional[Dict[str, str]] = None,
) -> List[Any]:
    """Run ``fn(rank, *args)`` on every device; return the replicas' results in rank order.

    ``fn`` must be importable by name (a module-level function): on the CPU it runs in a child
    process. Tensors in the results come back on the CPU. ``env`` adds environment variables for
    the device process (for example ``XLA_FLAGS``). On a TPU, ``num_devices`` must be ``None``:
    every local device takes part, and results are those of torch_xla's launcher.
    """
    if not _xla.on_cpu():
        if num_devices is not None:
            raise ValueError("num_devices applies to XLA:CPU devices only; on a TPU every device runs")
        results = _xla.run_on_native_devices(_ReplicaCall(fn, tuple(args)))
        return [results[r] for r in sorted(results)]
    with DevicePool(num_devices or 1, env=env) as pool:
        return pool.run(fn, *args)


_SEEDED = threading.Lock()
_in_seeded = threading.local()


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Seed the CPU random generator for the block, one replica at a time.

    FSDP assumes every replica builds the same initial model. On XLA:CPU devices the replicas are
    threads sharing one random generator, so a model initialized at random must be built inside
    ``with seeded(seed):`` to come out the same on each. Wrap it outside the block: wrapping syncs
    the devices, which needs every replica, and the others are waiting for this block to end.
    """
    with _SEEDED:
        state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        _in_seeded.active = True
        try:
            yield
        finally:
            _in_seeded.active = False
            torch.random.set_rng_state(state)


def _refuse_sync_inside_seeded() -> None:
    if getattr(_in_seeded, "active", False):
        raise RuntimeError(
            "sync (xm.mark_step / torch_xla.sync, or wrapping with XlaFullyShardedDataParallel) "
            "inside `with seeded(...)`: the other replicas wait for this block to end, so they "
            "cannot join. Build the model inside the block, and wrap or sync after it."
        )


graph_boundaries.before_graph_cut(_refuse_sync_inside_seeded)


class DevicePool:
    """A child process driving ``num_devices`` XLA:CPU devices, reused across ``run`` calls.

    After a replica fails, the process is gone; the next ``run`` starts a fresh one.
    """

    def __init__(
        self,
        num_devices: int,
        env: Optional[Dict[str, str]] = None,
        sync_timeout_s: float = graph_boundaries.DEFAULT_SYNC_TIMEOUT_S,
    ) -> None:
        if num_devices < 1:
            raise ValueError(f"num_devices must be at least 1, got {num_devices}")
        self.num_devices = num_devices
        self.env = _xla.cpu_device_env(num_devices, env)
        self.sync_timeout_s = sync_timeout_s
        self._process: Optional[multiprocessing.process.BaseProcess] = None
        self._conn: Optional[Connection] = None

    def __enter__(self) -> DevicePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, fn: ReplicaFn, *args: Any) -> List[Any]:
        """Run ``fn(rank, *args)`` on every device of the pool; results in rank order."""
        self._ensure_started()
        assert self._conn is not None
        _send(self._conn, (fn, args))
        kind, payload = self._receive()
        if kind == "ok":
            return payload
        self.close()
        rank, exc, tb_text = payload
        raise _replica_exception(rank, self.num_devices, exc, tb_text)

    def close(self) -> None:
        process, conn = self._process, self._conn
        if process is None or conn is None:  # set together by _ensure_started
            return
        if process.is_alive():
            try:
                _send(conn, None)
                process.join(timeout=5)
            except (BrokenPipeError, OSError):
                pass
        if process.is_alive():
            process.kill()
            process.join()
        conn.close()
        self._process = self._conn = None

    def _ensure_started(self) -> None:
        if self._process is not None and self._process.is_alive():
            return
        self.close()
        ctx = multiprocessing.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe()
        process = ctx.Process(
            target=_serve,
            args=(child_conn, self.num_devices, self.sync_timeout_s),
            name=f"xla-cpu-{self.num_devices}-devices",
            daemon=True,
        )
        with _environment(self.env):
            process.start()
        child_conn.close()
        self._process, self._conn = process, parent_conn

    def _receive(self) -> tuple:
        assert self._conn is not None and self._process is not None
        while not self._conn.poll(0.2):
            if not self._process.is_alive():
                break
        try:  # a process that ended closed its end: what it sent before is still there
            return pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError):
            self._process.join(timeout=5)
            code = self._process.exitcode
            self.close()
            raise ReplicaError(
                f"the process driving {self.num_devices} XLA:CPU devices died "
                f"({_describe_exit(code)}); its own output above says why. XLA:CPU aborts the "
                "process when a replica waits too long at a collective for the others."
            ) from None


def _send(conn: Connection, obj: Any) -> None:
    """Plain pickle (torch's reducers would pass CPU tensors as shared-memory file handles)."""
    conn.send_bytes(pickle.dumps(obj))


# Held while a device process starts. multiprocessing has no ``env=``: a spawned child inherits
# os.environ, so the pool's variables (CPU_NUM_DEVICES, XLA_FLAGS...) are set in it for the moment
# of the start, which may be on a background thread. Code that copies os.environ while pools start
# elsewhere takes this lock, or it copies those variables and may restore them for good (a test
# fixture did: a StepDumper's XLA_FLAGS then made every later process dump every program).
ENVIRONMENT_LOCK = threading.Lock()


@contextmanager
def _environment(extra: Dict[str, str]) -> Iterator[None]:
    """Set ``extra`` in this process's environment while a child process starts (it inherits it)."""
    with ENVIRONMENT_LOCK:
        saved = {k: os.environ.get(k) for k in extra}
        os.environ.update(extra)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _describe_exit(code: Optional[int]) -> str:
    if code is not None and code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"exit code {code}"


def _replica_exception(rank: int, world: int, exc: Optional[BaseException], tb_text: str) -> BaseException:
    note = f"raised in replica {rank} of {world}"
    if exc is None:
        return ReplicaError(f"{note}:\n{tb_text}")
    exc.__cause__ = _RemoteTraceback(f"\n\nTraceback in replica {rank} of {world}:\n{tb_text}")
    if sys.version_info >= (3, 11):  # add_note is new in 3.11; on 3.10 the cause names the replica
        exc.add_note(note)
    return exc


class _ReplicaCall:
    """Pickle-able ``fn(rank, *args)`` for torch_xla's launcher."""

    def __init__(self, fn: ReplicaFn, args: tuple) -> None:
        self.fn, self.args = fn, args

    def __call__(self) -> Any:
        return self.fn(_xla.global_rank(), *self.args)


# ---------------------------------------------------------------------------------------------
# The device process


def _serve(conn: Connection, num_devices: int, sync_timeout_s: float) -> None:
    devices = _xla.local_devices()
    if len(devices) != num_devices:
        raise RuntimeError(f"asked for {num_devices} XLA:CPU devices, the runtime has {len(devices)}")
    graph_boundaries.set_sync_timeout(sync_timeout_s)
    send_lock = threading.Lock()
    while True:
        request = pickle.loads(conn.recv_bytes())
        if request is None:
            return
        fn, args = request
        results: List[Any] = [None] * num_devices
        graph_boundaries.begin_replica_run()
        threads = [
            threading.Thread(
                target=_replica_main,
                args=(rank, dev, fn, args, results, conn, send_lock),
                name=f"replica-{rank}",
            )
            for rank, dev in enumerate(devices)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        _send(conn, ("ok", results))


def _replica_main(
    rank: int,
    dev: torch.device,
    fn: ReplicaFn,
    args: tuple,
    results: List[Any],
    conn: Connection,
    send_lock: threading.Lock,
) -> None:
    def call() -> None:
        _xla.enter_replica_thread(dev)
        results[rank] = _to_host(fn(rank, *args))

    replica_run.run_replica(rank, len(results), call, functools.partial(_report_and_exit, conn, send_lock))


def _to_host(x: Any) -> Any:
    """Tensors (also inside containers and dataclasses) moved to the CPU, to leave the process."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        copy = dataclasses.replace(x)
        for f in dataclasses.fields(x):
            object.__setattr__(copy, f.name, _to_host(getattr(x, f.name)))
        return copy
    return tree_map(_to_host, x) if isinstance(x, (list, tuple, dict)) else x


def _report_and_exit(
    conn: Connection, send_lock: threading.Lock, rank: int, world: int, exc: BaseException
) -> NoReturn:
    """Send the first failure to the caller and end the process: the other replicas may be stuck
    inside a collective that will never complete, and no thread can be stopped from outside."""
    tb_text = "".join(traceback.format_exception(exc))
    with send_lock:
        _send(conn, ("error", (rank, exc if _survives_pickling(exc) else None, tb_text)))
        os._exit(1)


def _survives_pickling(exc: BaseException) -> bool:
    """Whether the caller can rebuild ``exc`` (some pickle but need other constructor arguments)."""
    try:
        pickle.loads(pickle.dumps(exc))
        return True
    except Exception:
        return False
