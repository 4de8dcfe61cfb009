"""The one module that talks to torch_xla.

Everything platform-specific lives here, so a port to another backend (or a change of mind about
which collective form a platform needs) is a change to this file alone.

[Note: collective forms]
On a TPU we issue collectives exactly as torch_xla's own FSDP has for years: ``xm.all_gather``,
``xm.reduce_scatter`` and ``xm.all_reduce`` with ``groups`` and ``pin_layout``, no channel id.
On XLA:CPU devices that form hangs: XLA:CPU matches the participants of a collective by an op id
which, without a channel id, is the compiled module's unique id, different in every replica thread.
So on the CPU every collective carries a channel id, numbered per traced graph in trace order
(identical on every replica because every replica traces the same program), with
``use_global_device_ids=True`` and explicit groups. ``pin_layout=True`` would route all-gather
through an all-reduce that takes no channel id, so the CPU form never pins layouts, and the CPU has
no working all-reduce at all: we build it from an all-gather and a local reduction.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.runtime as xr
from torch_xla import runtime as _runtime
from torch_xla._internal import pjrt

from . import _replica_run

Groups = Optional[List[List[int]]]

# ---------------------------------------------------------------------------------------------
# Platform and devices


_platform: Optional[str] = None


def platform() -> str:
    """The PJRT device type of this process: ``"CPU"``, ``"TPU"``, ...

    Read from ``PJRT_DEVICE`` (importing torch_xla sets it when it is unset), so asking does not
    start the runtime: a launcher can ask before it starts the device processes. Read once: every
    collective and gather asks, and a process keeps its device type.
    """
    global _platform
    if not _platform:
        _platform = (xr.device_type() or "").upper()
    return _platform


def on_cpu() -> bool:
    return platform() == "CPU"


def device() -> torch.device:
    """This replica's XLA device."""
    return torch_xla.device()


def is_xla_device(dev: torch.device) -> bool:
    return dev.type == "xla"


def global_rank() -> int:
    return xr.global_ordinal()


def world_size() -> int:
    return xr.world_size()


def default_shard_size_multiple() -> int:
    """Pad each replica's shard to a multiple of this many elements.

    On a TPU, torch_xla pads to 128 and gathers 2-D (-1, 128) tiles, which it found efficient
    (pytorch/xla#3510); we keep that proven form there. Elsewhere padding only costs memory.
    """
    return 128 if platform() == "TPU" else 1


def cpu_device_env(num_devices: int) -> dict:
    """The environment N XLA:CPU devices in one process need (see the platform note).

    ``PJRT_CPU_ASYNC_CLIENT=0``: with the asynchronous client, multi-step runs abort at a random
    step when one replica never reaches a rendezvous. ``XLA_THREAD_POOL_SIZE``: with the default
    pool, 4 devices on 2 cores abort at the first collective.
    """
    return {
        "PJRT_DEVICE": "CPU",
        "CPU_NUM_DEVICES": str(num_devices),
        "PJRT_CPU_ASYNC_CLIENT": "0",
        "XLA_THREAD_POOL_SIZE": str(max(16, 4 * num_devices)),
    }


def local_devices() -> List[torch.device]:
    """The XLA devices this process drives, one replica thread each on the CPU."""
    devices = xm.get_xla_supported_devices()
    xm.set_replication(torch_xla.device(), devices)
    return [torch.device(d) for d in devices]


def enter_replica_thread(dev: torch.device) -> None:
    """Make ``dev`` this thread's default device and set the thread's rank and world size."""
    torch_xla._XLAC._xla_set_default_device(str(dev))
    _runtime._init_world_size_ordinal()


def run_on_native_devices(fn: Callable[[], object]) -> dict:
    """The TPU (and any non-CPU) path: torch_xla's own process-per-chip launcher."""
    return pjrt.run_multiprocess(fn)


# ---------------------------------------------------------------------------------------------
# Graph boundaries
#
# Every sync (``xm.mark_step``, ``torch_xla.sync``) goes through ``_XLAC._xla_step_marker``.
# Importing this module puts ``_step_marker`` in its place, once per process, whoever launches
# the replicas (``run_on_devices``, ``xmp.spawn``, ``pjrt.run_multiprocess``, ``accelerate
# launch``). It runs the ``before_graph_cut`` callbacks, and with several replica threads on
# XLA:CPU it makes them take turns. So ``accel_xla_fsdp`` must be imported at module level:
# torch_xla's launcher imports the replica function's module in its worker process before it
# starts the replica threads. A replica that synced before the import would miss a meeting at a
# boundary and leave the others waiting there.


def sync() -> None:
    """Cut the traced graph here and run it (``xm.mark_step``)."""
    torch_xla.sync()


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


# Channel ids are numbered per device, not per thread: a replica's backward runs on autograd's
# worker thread for its device, not on the replica's own thread, and both parts of one program
# must draw from one count. A device is driven by one thread at a time (the replica's waits while
# autograd's runs), so the count needs no lock.
_channel_ids: Dict[torch.device, int] = {}


def _next_channel_id(tensor: torch.Tensor) -> int:
    key = tensor.device  # not its name: formatting one costs every collective host time
    _channel_ids[key] = _channel_ids.get(key, 0) + 1
    return _channel_ids[key]


def _reset_channel_ids() -> None:
    _channel_ids[device()] = 0


_turns: Optional[_replica_run.Turns] = None
_turns_lock = threading.Lock()


def _process_turns(num_replicas: int) -> _replica_run.Turns:
    global _turns
    with _turns_lock:
        if _turns is None:
            _turns = _replica_run.Turns(num_replicas)
        return _turns


def _replica_threads() -> int:
    """How many replica threads of this process take turns at this thread's syncs (0: none).

    Turns are for XLA:CPU replicas that are threads of one process: a launcher (ours or
    torch_xla's) sets the replication over every device of the process and runs one replica per
    device, each in a thread it started. The process's main thread is never one of them, and
    under SPMD one thread drives every device. The replication count is read, not
    ``xr.world_size()``, which keeps its first answer for the whole process.
    """
    if xr.is_spmd() or threading.current_thread() is threading.main_thread():
        return 0
    if torch_xla._XLAC._xla_get_replication_devices_count() < 2:
        return 0
    return xr.addressable_device_count()


def _launch_in_turn(
    turns: _replica_run.Turns,
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
    rank = global_rank()
    turns.wait_for(rank, _sync_timeout_s, _sync_site())
    try:
        compiled, started = _uncached_compiles(), time.monotonic()
        _original_step_marker(device, list(devices), wait=False, reset_scope=reset_scope)
        if rank > 0 and _uncached_compiles() > compiled:
            turns.note_own_program(rank, time.monotonic() - started)
    finally:
        turns.done()


_TORCH_XLA_DIR = os.path.dirname(torch_xla.__file__)
SYNC_SITE_FRAMES = 3


def _sync_site() -> _replica_run.Site:
    """Where this sync was called from: the innermost frames outside torch_xla, this module and
    the replica entry (a few microseconds). Replicas meeting at one boundary from different
    places are said. The entry's frames are named per rank (``replica_0``, ...) so that thread
    dumps say which replica is which: counted in, a shallow replica function's syncs would
    differ by rank alone."""
    site: List[Tuple[str, int, str]] = []
    frame = sys._getframe(1)
    while frame is not None and len(site) < SYNC_SITE_FRAMES:
        path = frame.f_code.co_filename
        if path not in (__file__, _replica_run.__file__) and not path.startswith(_TORCH_XLA_DIR):
            site.append((path, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return tuple(site)


def _uncached_compiles() -> int:
    """Programs this process has compiled so far (torch_xla's counter; a few microseconds)."""
    return torch_xla._XLAC._xla_counter_value("UncachedCompile") or 0


def _step_marker(*args: Any, **kwargs: Any) -> None:
    """torch_xla's step marker, after the ``before_graph_cut`` callbacks; on XLA:CPU, in turns
    when the process runs several replica threads, and restarting the channel-id numbering."""
    for callback in _graph_cut_callbacks:
        callback()
    if not on_cpu():
        _original_step_marker(*args, **kwargs)
        return
    replicas = _replica_threads()
    try:
        if replicas > 1:
            _launch_in_turn(_process_turns(replicas), *args, **kwargs)
        else:
            _original_step_marker(*args, **kwargs)
    finally:
        _reset_channel_ids()  # the graph ends here


def _install_step_marker() -> Callable[..., None]:
    """Put ``_step_marker`` in torch_xla's place; return torch_xla's (also if this module is reloaded)."""
    current = torch_xla._XLAC._xla_step_marker
    original = getattr(current, "torch_xla_step_marker", current)
    _step_marker.torch_xla_step_marker = original
    torch_xla._XLAC._xla_step_marker = _step_marker
    return original


_original_step_marker = _install_step_marker()


# ---------------------------------------------------------------------------------------------
# A failing replica ends the run, whoever launched it
#
# torch_xla's launcher (``pjrt.run_multiprocess``, which ``xmp.spawn`` and ``accelerate launch``
# call) runs the replicas of a worker process in a thread pool and collects their results in rank
# order: a replica that raises is only noticed once the replicas before it have returned, and the
# pool then waits for the others, which wait for the failed one at their next meeting or
# collective (600 s, or for ever). Importing this module puts ``_run_replica_threads`` in place of
# its thread runner, so that each replica runs under ``_replica_run.run_replica``: the first to
# raise prints its traceback and ends the worker process; the pool's parent then sees its worker
# die (``BrokenProcessPool``), stops the other workers (on a TPU, the other chips' processes) and
# exits non-zero. The worker imports this module to unpickle the runner, before any replica starts.


def begin_replica_run() -> None:
    """A launcher is about to start a new set of replica threads in this process."""
    global _turns, _exchange
    with _turns_lock:
        _turns = _exchange = None  # a new run meets afresh (a pool's process serves many)
    _channel_ids.clear()  # and numbers its collectives afresh, whatever an earlier run left traced
    _replica_run.begin_run()


class _FailFast:
    """torch_xla's replica function (pickle-able), run so that its failure ends the run."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn

    def __call__(self) -> Any:
        return _replica_run.run_replica(global_rank(), world_size(), self.fn)


def _run_replica_threads(
    local_rank: int, local_world_size: int, fn: Callable[[], Any], initializer_fn: Callable[[int, int], None]
) -> Dict[int, Any]:
    """torch_xla's ``pjrt._run_thread_per_device``, each replica run by ``_FailFast``."""
    begin_replica_run()
    return _original_run_thread_per_device(local_rank, local_world_size, _FailFast(fn), initializer_fn)


def _install_replica_threads() -> Callable[..., Dict[int, Any]]:
    current = pjrt._run_thread_per_device
    original = getattr(current, "torch_xla_original", current)
    _run_replica_threads.torch_xla_original = original
    pjrt._run_thread_per_device = _run_replica_threads
    return original


_original_run_thread_per_device = _install_replica_threads()


# ---------------------------------------------------------------------------------------------
# Host rendezvous between replica threads
#
# ``xm.rendezvous`` (and ``xm.mesh_reduce``, built on it) exchange host values through an
# all-gather without a channel id, which hangs on XLA:CPU devices (the platform note). Accelerate's
# ``wait_for_everyone``, ``main_process_first`` and ``broadcast`` call them. When the replicas are
# threads of one process they can simply hand each other the values, so importing this module puts
# that in torch_xla's place for them; everywhere else torch_xla's own runs.


class _Exchange:
    """Replica threads of one process hand each other one value each, in rank order."""

    def __init__(self, num_replicas: int) -> None:
        self.meeting = _replica_run.Meeting(num_replicas)
        self.values: List[Any] = [None] * num_replicas
        self.tags: List[str] = [""] * num_replicas

    def all_gather(self, rank: int, value: Any, tag: str) -> List[Any]:
        self.values[rank] = value
        self.tags[rank] = tag
        # No call site here (unlike a graph boundary): Accelerate's main_process_first meets from
        # two places by design. A rendezvous is told apart by its tag, checked below.
        self.meeting.wait(rank, f"rendezvous '{tag}'", _sync_timeout_s)
        values, tags = list(self.values), list(self.tags)
        # nobody writes the next exchange's value before all have read this one
        self.meeting.wait(rank, f"rendezvous '{tag}' (reading)", _sync_timeout_s)
        if len(set(tags)) > 1:
            raise RuntimeError(_mismatch_message(rank, tags))
        return values


def _mismatch_message(rank: int, tags: List[str]) -> str:
    """Replicas met at different rendezvous: typically one called a collective under
    ``if accelerator.is_main_process:`` while the others went on to the next one."""
    mine = tags[rank]
    others = sorted({t for t in tags if t != mine})
    return (
        f"replica {rank} reached '{mine}' while replica(s) "
        f"{[r for r, t in enumerate(tags) if t != mine]} reached {' / '.join(map(repr, others))}: "
        "every replica must call the same collectives in the same order. A whole model's state dict is "
        "gathered from every replica: call state_dict(), save_pretrained, get_state_dict and save_model on "
        "every process (save_pretrained(dir, is_main_process=accelerator.is_main_process) writes on the main "
        "one only), not under `if accelerator.is_main_process:`."
    )


_exchange: Optional[_Exchange] = None


def replicas_are_threads() -> bool:
    """True in a replica thread on XLA:CPU whose process runs every replica as a thread: host
    values then pass between replicas in memory, and device collectives need the CPU form."""
    replicas = _replica_threads()
    return replicas > 1 and replicas == world_size()


def exchange(value: Any, tag: str = "exchange") -> List[Any]:
    """Every replica thread's ``value``, by rank (``replicas_are_threads()`` must hold). The
    values are shared, not copied: treat them as read-only."""
    global _exchange
    with _turns_lock:
        if _exchange is None:
            _exchange = _Exchange(_replica_threads())
    return _exchange.all_gather(global_rank(), value, tag)


def agree(tag: str) -> None:
    """Replica threads check that all of them are entering the collective ``tag`` (an error in
    every replica if some are at another rendezvous) before its device collectives, which would
    otherwise wait for ever. Nothing to check elsewhere: processes have no shared view."""
    if replicas_are_threads():
        exchange(None, tag)


def broadcast_from_rank0_(tensors: Sequence[torch.Tensor]) -> None:
    """In place: every replica's ``tensors`` take rank 0's values (Accelerate's
    ``sync_module_states``). On a TPU they must be on the device already (torch_xla's
    ``collective_broadcast``); between replica threads they may be anywhere."""
    if not replicas_are_threads():
        xm.collective_broadcast(list(tensors))
        return
    rank0 = exchange([t.detach().cpu() for t in tensors] if global_rank() == 0 else None, "broadcast_from_rank0")[0]
    if global_rank() != 0:
        with torch.no_grad():
            for mine, theirs in zip(tensors, rank0):
                mine.copy_(theirs.to(mine.device))
    exchange(None, "broadcast_from_rank0 done")  # rank 0's tensors are read; it may change them


def _rendezvous(tag: str, payload: bytes = b"", replicas: Sequence[int] = ()) -> List[bytes]:
    if not replicas_are_threads():
        return _original_rendezvous(tag, payload, list(replicas))
    if replicas and sorted(replicas) != list(range(world_size())):
        raise NotImplementedError(
            f"xm.rendezvous('{tag}') among some replicas only ({list(replicas)}) on XLA:CPU threads"
        )
    return exchange(payload, tag)


def _mesh_reduce(tag: str, data: Any, reduce_fn: Callable[[List[Any]], Any]) -> Any:
    if replicas_are_threads():
        # torch_xla reads ``data`` back to the host; run pending work at a boundary first, where
        # replicas take turns, not in a read-back that every replica launches at once.
        sync()
    return _original_mesh_reduce(tag, data, reduce_fn)


def _install_rendezvous() -> Tuple[Callable[..., Any], Callable[..., Any]]:
    originals = tuple(getattr(f, "torch_xla_original", f) for f in (xm.rendezvous, xm.mesh_reduce))
    for ours, original in zip((_rendezvous, _mesh_reduce), originals):
        ours.torch_xla_original = original
    xm.rendezvous, xm.mesh_reduce = _rendezvous, _mesh_reduce
    return originals


_original_rendezvous, _original_mesh_reduce = _install_rendezvous()


# ---------------------------------------------------------------------------------------------
# Tensor storage and the compiler


def replace_data(tensors: Sequence[torch.Tensor], new_data: Sequence[torch.Tensor]) -> None:
    """Point each of ``tensors`` at its ``new_data``'s storage, keeping its autograd identity.

    This is how full parameters are freed and rebuilt on XLA (there is no storage to resize):
    the parameter object stays a leaf that autograd knows, while the XLA tensor behind it is
    swapped for a gathered one or a 1-element placeholder that the compiler can recycle.
    torch_xla's FSDP uses ``_XLAC._replace_xla_tensor`` here when functionalization is on; in
    torch_xla 2.9 that call leaves a parameter holding materialized device data unchanged for the
    computations that read it (measured), while ``.data`` assignment works, so we use that. It
    keeps the tensor's version counter (torch_xla 2.9, measured), so backward accepts the
    parameters that forward saved.
    """
    for tensor, data in zip(tensors, new_data):
        tensor.data = data


def optimization_barrier_(tensors: Sequence[torch.Tensor]) -> None:
    """In place: the compiler may not move computation across these values, nor merge through them."""
    tensors = [t for t in tensors if t is not None]
    if tensors:
        xm.optimization_barrier_(tensors)


def ordering_zero(deps: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """On the CPU, a zero computed from ``deps`` for ``order_after``: a boolean that is always
    False (no element is above +inf, and a NaN compares False); elsewhere None. Call under
    ``torch.no_grad()``.

    Made once per unit and added to the operand of its first gather only, which the unit's other
    gathers follow (collectives are ordered among themselves). Every replica traces it, and
    tracing is the host's share of a step, so it takes as few traced ops as orders the gather
    (two per dependency: ``d > inf`` and ``any``, against five for "one element times zero, then
    nan_to_num"), and as few dependencies: of a forward's inputs, those that carry gradient when
    any do (the activations of the unit before; position embeddings and masks are computed before
    the first unit, and a gather ordered after the activations follows them too); in backward,
    where none does, the last one: the gradient reaching the unit, which the gradients collected
    before it (those of the inputs of the units after it) went into. ``any`` reads the whole
    dependency, so the gather waits for all of it (a compare the compiler cannot fold away).
    """
    if not on_cpu() or not deps:
        return None
    zero = None
    for dep in [d for d in deps if d.requires_grad] or deps[-1:]:
        above = (dep > math.inf).any()
        zero = above if zero is None else zero | above
    return zero


def order_after(tensor: torch.Tensor, zero: Optional[torch.Tensor]) -> torch.Tensor:
    """``tensor``, computed only once the dependencies of ``zero`` (``ordering_zero``) are: what
    an optimization barrier says on a TPU.

    XLA:CPU removes optimization barriers right after its first CSE pass, before it schedules
    (measured, torch_xla 2.9), and its collectives are ordered only among themselves (a token), so
    it issues a unit's all-gather blocks ahead of the computation that needs it, holding several
    units' full parameters at once. On the CPU we add a data dependency that the compiler cannot
    drop: the always-False boolean, which adds an exact zero (the sum keeps ``tensor``'s dtype).
    The value is unchanged. Elsewhere the barriers do it.
    """
    if zero is None:
        return tensor
    return tensor + zero


def rng_state(dev: torch.device) -> int:
    return xm.get_rng_state(dev)


def set_rng_state(seed: int, dev: torch.device) -> None:
    xm.set_rng_state(seed, dev)


# ---------------------------------------------------------------------------------------------
# Collectives (see [Note: collective forms])


def _cpu_groups(groups: Groups) -> List[List[int]]:
    return groups if groups is not None else [list(range(world_size()))]


def all_gather(tensor: torch.Tensor, groups: Groups, pin_layout: bool) -> torch.Tensor:
    """Concatenate ``tensor`` from every member of this replica's group along dim 0."""
    if on_cpu():
        # What xm.all_gather calls for one tensor without pinning, with the same arguments. It
        # first fetches the all-reduce token, which that path never uses: a traced device-data
        # node per call, a third of the call's host time, paid twice per parameter and step.
        groups = _cpu_groups(groups)
        return torch_xla._XLAC._xla_all_gather(
            tensor, 0, len(groups[0]), groups, False, _next_channel_id(tensor), True
        )
    return xm.all_gather(tensor, dim=0, groups=groups, pin_layout=pin_layout)


def reduce_scatter_sum(
    tensor: torch.Tensor, shard_count: int, scale: float, groups: Groups, pin_layout: bool
) -> torch.Tensor:
    """Sum ``tensor`` over the group, times ``scale``; keep this replica's 1/shard_count of dim 0."""
    if on_cpu():
        return xm.reduce_scatter(
            xm.REDUCE_SUM,
            tensor,
            scale=scale,
            scatter_dim=0,
            shard_count=shard_count,
            groups=_cpu_groups(groups),
            pin_layout=False,
            channel_id=_next_channel_id(tensor),
            use_global_device_ids=True,
        )
    return xm.reduce_scatter(
        xm.REDUCE_SUM,
        tensor,
        scale=scale,
        scatter_dim=0,
        shard_count=shard_count,
        groups=groups,
        pin_layout=pin_layout,
    )


def all_gather_coalesced(tensors: Sequence[torch.Tensor], groups: Groups, pin_layout: bool) -> List[torch.Tensor]:
    """``all_gather`` of each of ``tensors``, as one collective.

    On a TPU, torch_xla's coalesced all-gather (what its FSDP issues for
    ``coalesce_all_gather_ops``); it refuses ``pin_layout=True`` for a list, so it never pins.
    That op takes no channel id, so on the CPU the shards are packed into one vector instead:
    ``[t_1 | t_2 | ...]`` from every replica gathers to (replicas, total) rows, and each tensor's
    full value is its columns of that, taken row by row (a copy: XLA has no strided view).
    """
    if len(tensors) == 1:
        return [all_gather(tensors[0], groups, pin_layout)]
    if not on_cpu():
        return xm.all_gather(list(tensors), dim=0, groups=groups, pin_layout=False)
    sizes = [t.numel() for t in tensors]
    gathered = all_gather(torch.cat([t.reshape(-1) for t in tensors]), groups, pin_layout=False)
    columns = gathered.view(-1, sum(sizes)).split(sizes, dim=1)
    return [c.reshape(-1, *t.shape[1:]) for c, t in zip(columns, tensors)]


def reduce_scatter_sum_coalesced(
    tensors: Sequence[torch.Tensor], shard_count: int, scale: float, groups: Groups, pin_layout: bool
) -> List[torch.Tensor]:
    """``reduce_scatter_sum`` of each of ``tensors`` (each split along dim 0), as one collective.

    On a TPU, torch_xla's coalesced reduce-scatter (what its ``BucketizedReduceScatter`` issues).
    That op takes no channel id, so on the CPU the tensors are packed into one: each as
    (shard_count, its shard's numel), side by side, so that row r holds replica r's shard of
    every tensor; the reduce-scatter of that leaves each replica its row, split back per tensor.
    Every element is summed and scaled as in a reduce-scatter of its own tensor.
    """
    if len(tensors) == 1:
        return [reduce_scatter_sum(tensors[0], shard_count, scale, groups, pin_layout)]
    if not on_cpu():
        return xm.reduce_scatter(
            xm.REDUCE_SUM,
            list(tensors),
            scale=scale,
            scatter_dim=0,
            shard_count=shard_count,
            groups=groups,
            pin_layout=pin_layout,
        )
    rows = [t.reshape(shard_count, -1) for t in tensors]
    reduced = reduce_scatter_sum(torch.cat(rows, dim=1).reshape(-1), shard_count, scale, groups, pin_layout=False)
    parts = reduced.split([r.size(1) for r in rows])
    return [p.view(t.size(0) // shard_count, *t.shape[1:]) for p, t in zip(parts, tensors)]


def all_reduce(tensor: torch.Tensor, op: str, groups: Groups, pin_layout: bool) -> torch.Tensor:
    """Reduce ``tensor`` (``op`` is ``"sum"`` or ``"max"``) over the group; every member gets it."""
    if on_cpu():
        stacked = all_gather(tensor.unsqueeze(0), groups, pin_layout=False)
        return stacked.sum(0) if op == "sum" else stacked.amax(0)
    reduce_type = xm.REDUCE_SUM if op == "sum" else xm.REDUCE_MAX
    return xm.all_reduce(reduce_type, tensor, groups=groups, pin_layout=pin_layout)
