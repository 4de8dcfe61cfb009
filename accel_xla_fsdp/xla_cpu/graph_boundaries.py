"""Graph boundaries: callbacks before every cut, and replica threads taking turns there.

Every sync (``xm.mark_step``, ``torch_xla.sync``) goes through ``_XLAC._xla_step_marker``. The
patch table (patches.py) puts ``step_marker``'s replacement in its place when ``accel_xla_fsdp``
is imported, once per process, whoever launches the replicas (``run_on_devices``, ``xmp.spawn``,
``pjrt.run_multiprocess``, ``accelerate launch``). It runs the ``before_graph_cut`` callbacks (on
every platform), and with several replica threads on XLA:CPU it makes them take turns. So
``accel_xla_fsdp`` must be imported at module level: torch_xla's launcher imports the replica
function's module in its worker process before it starts the replica threads. A replica that
synced before the import would miss a meeting at a boundary and leave the others waiting there.

A failing replica ends the run, whoever launched it. torch_xla's launcher
(``pjrt.run_multiprocess``, which ``xmp.spawn`` and ``accelerate launch`` call) runs the replicas
of a worker process in a thread pool and collects their results in rank order: a replica that
raises is only noticed once the replicas before it have returned, and the pool then waits for the
others, which wait for the failed one at their next meeting or collective (600 s, or for ever).
The patch table puts ``run_replica_threads``' replacement in place of its thread runner, so that
each replica runs under ``replica_run.run_replica``: the first to raise prints its traceback and
ends the worker process; the pool's parent then sees its worker die (``BrokenProcessPool``),
stops the other workers (on a TPU, the other chips' processes) and exits non-zero. The worker
imports this module to unpickle the runner, before any replica starts.
"""

from __future__ import annotations

import ctypes
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .. import _xla
from . import replica_run

DEFAULT_SYNC_TIMEOUT_S = 600.0

_graph_cut_callbacks: Tuple[Callable[[], None], ...] = ()
_callbacks_lock = threading.Lock()
_sync_timeout_s = DEFAULT_SYNC_TIMEOUT_S


def before_graph_cut(callback: Callable[[], None]) -> None:
    """Run ``callback()`` before every graph cut (every ``xm.mark_step`` / ``torch_xla.sync``).

    On every platform, in the thread that syncs, before the replicas meet at the boundary; an
    exception from it propagates out of the sync and nothing is launched. It runs for every sync
    of every replica, so it must be cheap. Callbacks run in the order they were registered.
    """
    global _graph_cut_callbacks
    with _callbacks_lock:
        _graph_cut_callbacks = (*_graph_cut_callbacks, callback)


def set_sync_timeout(seconds: float) -> None:
    """How long a replica thread on XLA:CPU waits at a graph boundary for the others, then raises."""
    global _sync_timeout_s
    _sync_timeout_s = seconds


def sync_timeout() -> float:
    return _sync_timeout_s


_turns: Optional[replica_run.Turns] = None
turns_lock = threading.Lock()  # also guards rendezvous.py's exchange, made afresh with the turns


def _process_turns(num_replicas: int) -> replica_run.Turns:
    global _turns
    with turns_lock:
        if _turns is None:
            _turns = replica_run.Turns(num_replicas)
        return _turns


def turns_made() -> bool:
    """Whether replica threads of this process have taken turns at a boundary in this run."""
    return _turns is not None


def replica_threads() -> int:
    """How many replica threads of this process take turns at this thread's syncs (0: none).

    Turns are for XLA:CPU replicas that are threads of one process: a launcher (ours or
    torch_xla's) sets the replication over every device of the process and runs one replica per
    device, each in a thread it started. The process's main thread is never one of them, and
    under SPMD one thread drives every device. The replication count is read, not
    ``xr.world_size()``, which keeps its first answer for the whole process.
    """
    if _xla.is_spmd() or threading.current_thread() is threading.main_thread():
        return 0
    if _xla.replication_count() < 2:
        return 0
    return _xla.addressable_device_count()


# torch_xla's step marker, set when the patch is installed (patches.py); tests may spy on it.
torch_xla_step_marker: Callable[..., None] = lambda *args, **kwargs: None  # noqa: E731


def _launch_in_turn(
    turns: replica_run.Turns,
    device: str = "",
    devices: Sequence[str] = (),
    wait: bool = True,
    reset_scope: bool = True,
) -> None:
    """Meet the other replicas, then launch this graph in rank order.

    XLA:CPU aborts the process when a replica waits at a collective too long for the others (a
    fixed rendezvous timeout: a warning after 5 s, the abort 10 s later). So the replicas first
    wait for each other at the boundary (one may still be tracing, or held up by its caller), then
    launch in turn. Replicas that launch a new graph together all compile it at once on the
    shared cores and finish up to tens of seconds apart (measured: 18 to 37 s for one step of a
    small transformer on 4 devices). Compiled programs are cached per process, not per device, so
    taken in turns the first replica compiles while the others wait, and they then find it in the
    cache and launch within moments of each other, compiling it once instead of N times.

    The step marker launches the graph without waiting for it (the first replica's graph waits
    at its first collective for the others); a sync asked to ``wait`` would deadlock with the
    replicas behind it, so it is launched without waiting too.
    """
    del wait
    rank = _xla.global_rank()
    turns.wait_for(rank, _sync_timeout_s, _sync_site())
    try:
        compiled, started = _xla.uncached_compiles(), time.monotonic()
        torch_xla_step_marker(device, list(devices), wait=False, reset_scope=reset_scope)
        if rank > 0 and _xla.uncached_compiles() > compiled:
            turns.note_own_program(rank, time.monotonic() - started)
    finally:
        turns.done()


SYNC_SITE_FRAMES = 3


def _sync_site() -> replica_run.Site:
    """Where this sync was called from: the innermost frames outside torch_xla, this module and
    the replica entry (a few microseconds). Replicas meeting at one boundary from different
    places are said. The entry's frames are named per rank (``replica_0``, ...) so that thread
    dumps say which replica is which: counted in, a shallow replica function's syncs would
    differ by rank alone."""
    site: List[Tuple[str, int, str]] = []
    frame: Optional[FrameType] = sys._getframe(1)
    while frame is not None and len(site) < SYNC_SITE_FRAMES:
        path = frame.f_code.co_filename
        if path not in (__file__, replica_run.__file__) and not path.startswith(_xla.TORCH_XLA_DIR):
            site.append((path, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return tuple(site)


def _step_marker(*args: Any, **kwargs: Any) -> None:
    """torch_xla's step marker, after the ``before_graph_cut`` callbacks; on XLA:CPU, in turns
    when the process runs several replica threads, and restarting the channel-id numbering."""
    for callback in _graph_cut_callbacks:
        callback()
    _xla.check_graph_cut()  # under _xla.tracing_replica: nothing of the traced platform runs here
    if not _xla.on_cpu():
        torch_xla_step_marker(*args, **kwargs)
        return
    replicas = replica_threads()
    try:
        if replicas > 1:
            _launch_in_turn(_process_turns(replicas), *args, **kwargs)
        else:
            torch_xla_step_marker(*args, **kwargs)
    finally:
        _xla.reset_channel_ids()  # the graph ends here


def step_marker(original: Callable[..., None]) -> Callable[..., None]:
    """The patch of ``_XLAC._xla_step_marker`` (patches.py): ``_step_marker`` around ``original``."""
    global torch_xla_step_marker
    torch_xla_step_marker = original
    return _step_marker


_new_run_callbacks: Tuple[Callable[[], None], ...] = ()


def on_new_run(callback: Callable[[], None]) -> None:
    """Run ``callback()`` whenever a launcher starts a new set of replica threads."""
    global _new_run_callbacks
    _new_run_callbacks = (*_new_run_callbacks, callback)


def begin_replica_run() -> None:
    """A launcher is about to start a new set of replica threads in this process."""
    global _turns
    with turns_lock:
        _turns = None  # a new run meets afresh (a pool's process serves many)
    for callback in _new_run_callbacks:
        callback()
    _xla.clear_channel_ids()  # and numbers its collectives afresh, whatever an earlier run left traced
    replica_run.begin_run()
    if _xla.on_cpu():
        _print_native_stacks_on_crash()


_native_stacks = False
_SIGACTION_BYTES = 256  # room for the C library's struct sigaction (152 bytes on x86_64 and aarch64)


def _print_native_stacks_on_crash() -> None:
    """On a SIGSEGV (also SIGBUS, SIGILL, SIGFPE), every thread's native stack on stderr, then
    faulthandler's Python stacks (``replica_run.begin_run``): PyTorch's handler, installed after
    faulthandler, calls it.

    Replica threads on XLA:CPU have died of a SIGSEGV inside torch_xla, rarely and not reproduced
    (docs/xla-cpu.md): Python stacks alone do not say where. PyTorch's handler also takes SIGABRT
    and SIGINT, which keep the handlers they had: XLA:CPU's abort at a collective hits several
    replicas at once, and only faulthandler's dump comes out whole then; Ctrl-C stays Python's.
    Once per process, on Linux, and kept (a signal handler, as faulthandler's, not a name in the
    patch table).
    """
    global _native_stacks
    if _native_stacks or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    kept = {sig: ctypes.create_string_buffer(_SIGACTION_BYTES) for sig in (signal.SIGABRT, signal.SIGINT)}
    for sig, action in kept.items():
        libc.sigaction(sig, None, action)
    torch._C._set_print_stack_traces_on_fatal_signal(True)
    for sig, action in kept.items():
        libc.sigaction(sig, action, None)
    _native_stacks = True


class _FailFast:
    """torch_xla's replica function (pickle-able), run so that its failure ends the run."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn

    def __call__(self) -> Any:
        return replica_run.run_replica(_xla.global_rank(), _xla.world_size(), self.fn)


RunThreads = Callable[[int, int, Callable[[], Any], Callable[[int, int], None]], Dict[int, Any]]
# torch_xla's thread runner, set when the patch is installed (patches.py).
torch_xla_run_thread_per_device: Optional[RunThreads] = None


def _run_replica_threads(
    local_rank: int, local_world_size: int, fn: Callable[[], Any], initializer_fn: Callable[[int, int], None]
) -> Dict[int, Any]:
    """torch_xla's ``pjrt._run_thread_per_device``, each replica run by ``_FailFast``. A module
    function: the launcher pickles it by name for its worker process, which imports this module
    (so ``accel_xla_fsdp``, which installs the patches) to unpickle it."""
    assert torch_xla_run_thread_per_device is not None, "installed by patches.py"
    begin_replica_run()
    return torch_xla_run_thread_per_device(local_rank, local_world_size, _FailFast(fn), initializer_fn)


def run_replica_threads(original: RunThreads) -> RunThreads:
    """The patch of torch_xla's ``pjrt._run_thread_per_device`` (patches.py)."""
    global torch_xla_run_thread_per_device
    torch_xla_run_thread_per_device = original
    return _run_replica_threads
