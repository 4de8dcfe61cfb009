"""The platform adapter: the one module that calls torch_xla.

Devices, collectives in the form each platform needs, optimization barriers, tensor storage.
Everything platform-specific lives here, so a port to another backend (or a change of mind about
which collective form a platform needs) is a change to this file alone. How replica threads of
one XLA:CPU process behave as processes (turns at graph boundaries, fail-fast, host rendezvous)
is ``xla_cpu/``; which torch_xla names it replaces, and why, is its patch table
(``xla_cpu/patches.py``).

[Note: collective forms]
On a TPU we issue torch_xla's collectives (``xm.all_gather``, ``xm.reduce_scatter``, its
all-reduce) with explicit ``groups`` and ``pin_layout``, no channel id, in the shapes the TPU
compiler keeps as all-gathers and reduce-scatters ([Note: TPU reduce-scatter shapes]; checked by
compiling for TPU topologies, docs/tpu.md). ``tracing_replica`` traces that form here.
On XLA:CPU devices that form hangs: XLA:CPU matches the participants of a collective by an op id
which, without a channel id, is the compiled module's unique id, different in every replica thread.
So on the CPU every collective carries a channel id, numbered per traced graph in trace order
(identical on every replica because every replica traces the same program), with
``use_global_device_ids=True`` and explicit groups. ``pin_layout=True`` would route all-gather
through an all-reduce that takes no channel id, so the CPU form never pins layouts, and the CPU has
no working all-reduce at all: we build it from an all-gather and a local reduction.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, cast

import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.runtime as xr
from torch_xla import runtime as _runtime
from torch_xla._internal import pjrt

Groups = Optional[List[List[int]]]

# ---------------------------------------------------------------------------------------------
# Platform and devices


_platform: Optional[str] = None


@dataclass(frozen=True)
class TracedReplica:
    """What ``tracing_replica`` makes this process trace as: ``rank`` of ``world_size`` replicas
    of ``platform``."""

    platform: str
    rank: int
    world_size: int


_traced: Optional[TracedReplica] = None
# Collectives traced in the platform's own form since the last graph cut (see tracing_replica).
_foreign_collectives = 0


@contextlib.contextmanager
def tracing_replica(rank: int, world_size: int, platform: str = "TPU") -> Iterator[TracedReplica]:
    """Trace, on this process's XLA:CPU device, the program replica ``rank`` of ``world_size``
    would trace on ``platform``: its collectives in that platform's form, shards sized for
    ``world_size``. Nothing with such a collective runs: a graph cut that would launch one raises
    (export the pending graph instead: ``tpu_program.export_step``). Graphs without collectives
    (wrapping's sharding, creating optimizer state) run as usual.

    One replica at a time, from the process's main thread, outside any replica run.
    """
    global _traced, _foreign_collectives
    if _traced is not None:
        raise RuntimeError(f"already tracing as {_traced}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not one of world_size {world_size} replicas")
    if (devices := xr.addressable_device_count()) != 1:
        # Graphs of wrapping may hold a collective over world_size replicas; with one device the
        # HLO verifier lets it through, with several it must match their count and refuses.
        raise RuntimeError(
            f"tracing_replica traces on one XLA:CPU device, and this process has {devices} "
            f"(CPU_NUM_DEVICES={os.environ.get('CPU_NUM_DEVICES')}): run it in a process of its own "
            "without CPU_NUM_DEVICES"
        )
    _traced, _foreign_collectives = TracedReplica(platform.upper(), rank, world_size), 0
    try:
        yield _traced
    finally:
        _traced, _foreign_collectives = None, 0


def traced_graph_exported() -> None:
    """The pending graph's collectives went into an exported program, whose tensors the caller
    drops: a later graph cut may run (``tpu_program.export_step`` calls this)."""
    global _foreign_collectives
    _foreign_collectives = 0


def platform() -> str:
    """The PJRT device type of this process: ``"CPU"``, ``"TPU"``, ... (under
    ``tracing_replica``, the platform traced for).

    Read from ``PJRT_DEVICE`` (importing torch_xla sets it when it is unset), so asking does not
    start the runtime: a launcher can ask before it starts the device processes. Read once: every
    collective and gather asks, and a process keeps its device type.
    """
    global _platform
    if _traced is not None:
        return _traced.platform
    if not _platform:
        _platform = (xr.device_type() or "").upper()
    return _platform


def check_graph_cut() -> None:
    """At a graph cut under ``tracing_replica``: refuse to run a graph holding collectives of
    the traced platform's form, which this device cannot run (``xla_cpu/graph_boundaries.py``
    calls this at every cut)."""
    if _foreign_collectives:
        assert _traced is not None  # counted only while tracing (reset when it ends)
        raise RuntimeError(
            f"a graph holding {_foreign_collectives} collective(s) in {_traced.platform} form was cut while "
            f"tracing as {_traced}: it cannot run here. Export the pending step instead "
            "(accel_xla_fsdp.tpu_program.export_step) before any sync."
        )


def on_cpu() -> bool:
    return platform() == "CPU"


def device() -> torch.device:
    """This replica's XLA device."""
    return torch_xla.device()


def is_xla_device(dev: torch.device) -> bool:
    return dev.type == "xla"


def global_rank() -> int:
    return _traced.rank if _traced is not None else xr.global_ordinal()


def world_size() -> int:
    return _traced.world_size if _traced is not None else xr.world_size()


def default_shard_size_multiple() -> int:
    """Pad each replica's shard to a multiple of this many elements.

    On a TPU, 2048: whole (16, 128) tiles, the TPU's tile of 16-bit values (two of f32's (8, 128)).
    torch_xla pads to 128 and gathers (-1, 128) rows (pytorch/xla#3510); a gradient's reduce-scatter
    then stays one only when each replica's part is whole tiles, else the TPU compiler makes it an
    all-reduce, twice the traffic ([Note: TPU reduce-scatter shapes]). Elsewhere padding only
    costs memory.
    """
    return TPU_SHARD_MULTIPLE if platform() == "TPU" else 1


def dim0_rows_multiple(row_numel: int) -> int:
    """Pad each replica's part of a dim-0 shard to a multiple of this many rows
    (``shard_param_on_dim_0``; a row is ``row_numel`` elements).

    On a TPU, whole (16, 128) tiles, so that the gradient's reduce-scatter stays one ([Note: TPU
    reduce-scatter shapes]): 16 rows of a width that is a multiple of 128 (reduce-scattered in its
    own rows); of any other width (a 1-D parameter's rows are single elements) enough rows for
    whole tiles of 2048 elements (reduce-scattered as (-1, 128) rows). Elsewhere torch_xla's rule:
    the parts only need to be equal.
    """
    if platform() != "TPU":
        return 1
    if row_numel % TPU_ROW == 0:
        return TPU_TILE_ROWS
    return TPU_SHARD_MULTIPLE // math.gcd(row_numel, TPU_SHARD_MULTIPLE)


# [Note: XNNPACK keeps the weights]
# XLA:CPU runs an f32 dot through XNNPACK when it can (--xla_cpu_use_xnnpack). Such a dot keeps a
# pool of XNNPACK runtimes for the life of the program, one per device that ran it at once
# (xla/backends/cpu/runtime/xnnpack/xnn_dot_thunk.cc), and what a runtime keeps is sized by the
# dot's operands: the full, gathered weights. So every device held about 0.3 M (M the whole
# model's size) after training, for good. Measured by scripts/memory_stages.py's census at hidden
# 2048, 4 layers, 4 replicas: the process held 5.55 GiB after training with XNNPACK, 4.50
# without, where the live shards and moments and the process before loading were 4.29
# (docs/accelerate.md). A TPU has no XNNPACK: this is the emulation's memory only. The user's own
# XLA_FLAGS come after ours, so they can set it back.
CPU_XLA_FLAGS = "--xla_cpu_use_xnnpack=false"


def cpu_device_env(num_devices: int, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The environment N XLA:CPU devices in one process need (see the platform note), with a
    caller's ``extra`` variables.

    ``PJRT_CPU_ASYNC_CLIENT=0``: with the asynchronous client, multi-step runs abort at a random
    step when one replica never reaches a rendezvous. ``XLA_THREAD_POOL_SIZE``: with the default
    pool, 4 devices on 2 cores abort at the first collective. ``XLA_FLAGS``: ours, then the
    caller's in ``extra`` or else the environment's ([Note: XNNPACK keeps the weights]).
    """
    extra = dict(extra or {})
    flags = extra.pop("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    return {
        "PJRT_DEVICE": "CPU",
        "CPU_NUM_DEVICES": str(num_devices),
        "PJRT_CPU_ASYNC_CLIENT": "0",
        "XLA_THREAD_POOL_SIZE": str(max(16, 4 * num_devices)),
        "XLA_FLAGS": f"{CPU_XLA_FLAGS} {flags}".strip(),
        **extra,
    }


def local_devices() -> List[torch.device]:
    """The XLA devices this process drives, one replica thread each on the CPU."""
    devices = [torch.device(d) for d in xm.get_xla_supported_devices()]
    xm.set_replication(torch_xla.device(), devices)
    return devices


def enter_replica_thread(dev: torch.device) -> None:
    """Make ``dev`` this thread's default device and set the thread's rank and world size."""
    torch_xla._XLAC._xla_set_default_device(str(dev))
    _runtime._init_world_size_ordinal()


def run_on_native_devices(fn: Callable[[], object]) -> dict:
    """The TPU (and any non-CPU) path: torch_xla's own process-per-chip launcher."""
    return pjrt.run_multiprocess(fn)


TORCH_XLA_DIR = os.path.dirname(torch_xla.__file__)  # frames in here are torch_xla's own


def sync() -> None:
    """Cut the traced graph here and run it (``xm.mark_step``). On XLA:CPU replica threads the
    cut is where the replicas take turns (``xla_cpu/graph_boundaries.py``)."""
    torch_xla.sync()


# Channel ids (the CPU form of a collective, [Note: collective forms]) are numbered per traced
# graph, and per device, not per thread: a replica's backward runs on autograd's worker thread
# for its device, not on the replica's own thread, and both parts of one program must draw from
# one count. A device is driven by one thread at a time (the replica's waits while autograd's
# runs), so the count needs no lock. Every graph cut restarts it (``reset_channel_ids``).
_channel_ids: Dict[torch.device, int] = {}


def _next_channel_id(tensor: torch.Tensor) -> int:
    key = tensor.device  # not its name: formatting one costs every collective host time
    _channel_ids[key] = _channel_ids.get(key, 0) + 1
    return _channel_ids[key]


def reset_channel_ids() -> None:
    """This device's graph ends here: its next collective is numbered from 1 again."""
    _channel_ids[device()] = 0


def clear_channel_ids() -> None:
    """A new set of replicas starts: every device numbers afresh, whatever an earlier run left traced."""
    _channel_ids.clear()


def uncached_compiles() -> int:
    """Programs this process has compiled so far (torch_xla's counter; a few microseconds)."""
    return torch_xla._XLAC._xla_counter_value("UncachedCompile") or 0


def replication_count() -> int:
    """How many devices the current replication spans (torch_xla's launcher sets it over every
    device of the process). Read anew each time, unlike ``xr.world_size()``, which keeps its
    first answer for the whole process."""
    return torch_xla._XLAC._xla_get_replication_devices_count()


def is_spmd() -> bool:
    return xr.is_spmd()


def addressable_device_count() -> int:
    return xr.addressable_device_count()


def collective_broadcast(tensors: Sequence[torch.Tensor]) -> None:
    """In place: every replica's device ``tensors`` take rank 0's values (torch_xla's broadcast)."""
    xm.collective_broadcast(list(tensors))


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


def placeholder(shape: Sequence[int], dtype: torch.dtype, sharding: Optional[Any] = None) -> torch.Tensor:
    """A device tensor of ``shape`` and ``dtype`` that holds no buffer, for a program that is
    traced and exported, never run: it becomes a parameter of the traced HLO like any device data,
    and reading its value aborts the process (torch_xla's ``create_placeholder_tensor``).

    ``sharding`` (an ``OpSharding``, SPMD only): annotated as a ``Sharding`` custom call on the
    placeholder (``mark_sharding`` refuses a tensor without data, as it moves data to the shards);
    ``tpu_program`` gives the HLO parameter that sharding, as a sharded buffer would have.
    """
    import torch_xla.core.xla_builder as xb

    tensor = xb.create_placeholder_tensor(tuple(shape), dtype)
    if sharding is not None:
        torch_xla._XLAC._xla_annotate_custom_sharding(tensor, sharding)
    return tensor


def optimization_barrier_(
    tensors: Sequence[torch.Tensor], read_only: Sequence[torch.Tensor] = ()
) -> List[torch.Tensor]:
    """In place: the compiler may not move computation across these values, nor merge through them.

    ``read_only`` (the shards) take part in the barrier through stand-ins, which are returned in
    their order, barriered, and the tensors themselves are left as they are: a shard changed in
    place, by a barrier too, takes a new tensor id before the optimizer's update, and
    ``write_in_donation_order`` can then no longer tell which buffer a sync donates for it. A
    clone is no copy on XLA: the stand-in shares the shard's traced value.
    """
    stand_ins = [t.clone() for t in read_only]
    barriered = [t for t in list(tensors) + stand_ins if t is not None]
    if barriered:
        xm.optimization_barrier_(barriered)
    return stand_ins


def tensor_ids(tensors: Sequence[torch.Tensor]) -> Dict[int, torch.Tensor]:
    """Each tensor under torch_xla's id of it now: the id a sync's device-data node for its
    current value carries, until something writes the tensor (every in-place op gives a new id)."""
    return {torch_xla._XLAC._xla_get_tensor_id(t): t for t in tensors}


def write_in_donation_order(
    earlier: Sequence[torch.Tensor], donated: Dict[int, torch.Tensor], written: Sequence[torch.Tensor]
) -> None:
    """Write each tensor of ``written`` once more (``x.mul_(1)``: exact, and the compiler drops
    it) so that the next sync's outputs come in the order of the buffers it donates to them
    ([Note: donation order]).

    ``earlier``: outputs of the sync written before (the loss); ``donated``: ``tensor_ids`` of
    the tensors that the sync donates, taken before they were written; ``written``: every tensor
    that the step wrote and the sync outputs, donated or not (new optimizer state).
    """
    order: List[torch.Tensor] = []
    placed: set = set()
    rest = list(donated.values())

    def number(roots: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """The donated tensors that the graphs of ``roots`` number first, in the sync's order."""
        ids, _ = torch_xla._XLAC._get_tensors_xla_device_data_node(list(roots))
        new = [donated[i] for i in ids if i in donated and id(donated[i]) not in placed]
        placed.update(id(t) for t in new)
        order.extend(new)
        return new

    new = number(earlier)
    while new or len(order) < len(rest):
        if new:
            new = number(new)
            continue
        # The earlier outputs and those placed so far number no more donated tensors (none at
        # all when an earlier sync computed the loss): the next one is placed as it comes, its
        # own update's graph numbering it first.
        following = next(t for t in rest if id(t) not in placed)
        new = number([following])
        if id(following) not in placed:  # not read by its own update: placed all the same
            placed.add(id(following))
            order.append(following)
    order += [t for t in written if id(t) not in placed]
    with torch.no_grad():
        for t in order:
            t.mul_(1)


# [Note: donation order]
# A sync donates the buffer of every tensor it updates in place, but torch_xla 2.9 only marks
# those inputs as buffer donors: which output takes which buffer is XLA's choice
# (OptimizeInputOutputBufferAlias), by byte size alone. The k-th donor of a size goes to the k-th
# output of that size; donors in parameter order (the post order of the graph's device data, from
# the outputs in turn), outputs in the order their tensors were last written. In a training step
# the two differ: the loss's graph reaches every shard first, so shards come first among the
# donors, while AdamW writes each moment before its parameter. A shard's buffer then goes to an
# output that is written while the shard is still to be read (its moment, say), and XLA's copy
# insertion copies the shard at the program's start; so for every donated shard, exp_avg and
# exp_avg_sq, the copies living on to the update (XLA:CPU, measured: 102 of 108 donated buffers of
# tests/test_memory.py's steady step; 0.16 B Llama, 4 replicas: ~390 MB per replica). Writing the
# step's outputs once more, in the donors' order, gives every buffer to its own tensor's update,
# which is in place. Only the pairing changes, never a value: a wrong order costs copies, not
# results. The pairing pass is XLA's, not XLA:CPU's alone.


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
    return xm.get_rng_state(str(dev))


def set_rng_state(seed: int, dev: torch.device) -> None:
    xm.set_rng_state(seed, str(dev))


# ---------------------------------------------------------------------------------------------
# Collectives (see [Note: collective forms])


def _explicit_groups(groups: Groups) -> List[List[int]]:
    """``groups``, or the one group of every replica: spelled out, so that torch_xla never asks
    its runtime for the world size (under ``tracing_replica`` that is not the traced one)."""
    return groups if groups is not None else [list(range(world_size()))]


def _native_collective() -> None:
    """Count a collective traced in the platform's own form (see ``tracing_replica``)."""
    global _foreign_collectives
    if _traced is not None:
        _foreign_collectives += 1


def _all_gather_pinned(tensor: torch.Tensor, groups: List[List[int]]) -> torch.Tensor:
    """torch_xla's pinned all-gather (``xm.all_gather(..., pin_layout=True)``): this replica's
    ``tensor`` zero-padded to its place in the full tensor, summed over the group by a pinned
    all-reduce. Written here so that the place comes from ``global_rank()``, which
    ``tracing_replica`` sets (torch_xla's reads its runtime's ordinal)."""
    position = next(g.index(global_rank()) for g in groups if global_rank() in g)
    size, count = tensor.size(0), len(groups[0])
    pad = [0, 0] * (tensor.dim() - 1) + [position * size, (count - 1 - position) * size]
    padded = torch.nn.functional.pad(tensor, pad)
    return _native_all_reduce(xm.REDUCE_SUM, padded, groups, pin_layout=True)


def _native_all_reduce(
    reduce_type: str, tensor: torch.Tensor, groups: List[List[int]], pin_layout: bool
) -> torch.Tensor:
    """What ``xm.all_reduce`` traces for one tensor and explicit groups. Called directly because
    ``xm.all_reduce`` returns its input unreduced when its runtime has one replica, as this
    process's does under ``tracing_replica``."""
    return torch_xla._XLAC._xla_all_reduce(reduce_type, tensor, 1.0, groups, pin_layout)


def all_gather(tensor: torch.Tensor, groups: Groups, pin_layout: bool) -> torch.Tensor:
    """Concatenate ``tensor`` from every member of this replica's group along dim 0."""
    if on_cpu():
        # What xm.all_gather calls for one tensor without pinning, with the same arguments. It
        # first fetches the all-reduce token, which that path never uses: a traced device-data
        # node per call, a third of the call's host time, paid twice per parameter and step.
        groups = _explicit_groups(groups)
        return torch_xla._XLAC._xla_all_gather(
            tensor, 0, len(groups[0]), groups, False, _next_channel_id(tensor), True
        )
    _native_collective()
    groups = _explicit_groups(groups)
    if pin_layout:
        return _all_gather_pinned(tensor, groups)
    return xm.all_gather(tensor, dim=0, groups=groups, pin_layout=False)


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
            groups=_explicit_groups(groups),
            pin_layout=False,
            channel_id=_next_channel_id(tensor),
            use_global_device_ids=True,
        )
    groups = _explicit_groups(groups)
    width = tensor.shape[1:].numel()  # from the shape: no op traced into the step
    if width % TPU_ROW == 0 and tensor.size(0) % shard_count == 0:
        # A gradient of dim-0 shards, in its own rows: as (-1, 128) rows it is relaid out whole first.
        rows = tensor.view(tensor.size(0), width)
    elif tensor.numel() % (shard_count * TPU_ROW) == 0:
        rows = tensor.reshape(-1, TPU_ROW)
    else:
        return _native_reduce_scatter(tensor, shard_count, scale, groups, pin_layout)
    return _reduce_scatter_rows(rows, shard_count, scale, groups, pin_layout).view(-1, *tensor.shape[1:])


def _native_reduce_scatter(
    tensor: torch.Tensor, shard_count: int, scale: float, groups: List[List[int]], pin_layout: bool
) -> torch.Tensor:
    _native_collective()
    return xm.reduce_scatter(
        xm.REDUCE_SUM,
        tensor,
        scale=scale,
        scatter_dim=0,
        shard_count=shard_count,
        groups=groups,
        pin_layout=pin_layout,
    )


# [Note: TPU reduce-scatter shapes]
# What the TPU compiler (libtpu 0.0.42.1; scripts/tpu_collective_probe.py, docs/tpu.md) keeps as a
# reduce-scatter: a 1-D operand never (it becomes an all-reduce, twice the ring traffic, at every
# size tried); the same elements as (-1, 128) rows when each chip's part is whole (16, 128) tiles
# that split evenly into the compiler's pieces. It cuts a part of T tiles into k = ceil(T / L)
# pieces (L = 152 on 8 v5e chips; 228 on 4 v5e, v4 or v5p chips) and keeps the reduce-scatter only
# when k divides T: on 8 v5e chips, up to 152 tiles always, 153-304 when even, 305-456 when a
# multiple of 3; any other part becomes an all-reduce and a collective-permute (1,103 probes,
# none off the rule; v6e kept every part tried, and on v4-16 every one became an all-reduce:
# not solved, docs/tpu.md). It counts rows, not bytes: f32 and bf16 fail at the same T, so chunks of
# 12 MiB (before) gave bf16 twice f32's rows per chip and odd counts above 152. So a gradient is
# reduce-scattered as rows in chunks of at most TPU_REDUCE_SCATTER_CHUNK_TILES whole tiles of each
# chip's part (below every L measured: k = 1), as equal as whole tiles allow; each chunk takes the
# same rows of every replica's part, so the chunks' results, joined, are this replica's shard.
# The rows are the gradient's own where they are a multiple of 128 elements wide (dim-0 shards):
# reshaped to (-1, 128) a 2-D gradient is relaid out whole first (the TPU tiles both dims), one
# more full gradient in memory (lm_head's at the peak of issue 25's step: docs/tpu.md).
# Shards are padded to whole tiles on a TPU (default_shard_size_multiple, dim0_rows_multiple).
TPU_ROW = 128
TPU_TILE_ROWS = 16
TPU_SHARD_MULTIPLE = TPU_TILE_ROWS * TPU_ROW
TPU_REDUCE_SCATTER_CHUNK_TILES = 128


def reduce_scatter_row_chunks(part_rows: int, width: int) -> List[Tuple[int, int]]:
    """The rows ``[start, stop)`` of each replica's part that one TPU reduce-scatter chunk takes,
    for parts of ``part_rows`` rows ``width`` elements wide: at most
    TPU_REDUCE_SCATTER_CHUNK_TILES tiles' elements each, as equal as whole tiles allow (see
    [Note: TPU reduce-scatter shapes]). The same on every platform: a plan, not a collective."""
    chunk_tiles = max(1, TPU_REDUCE_SCATTER_CHUNK_TILES * TPU_ROW // width)  # tiles of 16 rows this wide
    tiles = math.ceil(part_rows / TPU_TILE_ROWS)
    chunks = math.ceil(tiles / chunk_tiles)
    step = math.ceil(tiles / chunks) * TPU_TILE_ROWS
    return [(a, min(a + step, part_rows)) for a in range(0, part_rows, step)]


def _reduce_scatter_rows(
    rows: torch.Tensor, shard_count: int, scale: float, groups: List[List[int]], pin_layout: bool
) -> torch.Tensor:
    """The reduce-scatter of ``rows`` (2-D, rows a multiple of 128 elements wide) along dim 0, in
    the chunks of ``reduce_scatter_row_chunks``."""
    width = rows.size(1)
    parts = rows.view(shard_count, -1, width)  # replica r's part of the result is parts[r]
    spans = reduce_scatter_row_chunks(parts.size(1), width)
    if len(spans) == 1:
        return _native_reduce_scatter(rows, shard_count, scale, groups, pin_layout)
    reduced = [
        _native_reduce_scatter(parts[:, a:b].reshape(-1, width), shard_count, scale, groups, pin_layout)
        for a, b in spans
    ]
    return torch.cat(reduced)


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
        _native_collective()
        # torch_xla types all_gather for one tensor; given a list it gathers them as one op.
        gathered = xm.all_gather(
            list(tensors),  # type: ignore[arg-type]
            dim=0,
            groups=_explicit_groups(groups),
            pin_layout=False,
        )
        return cast(List[torch.Tensor], gathered)
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
        _native_collective()
        # torch_xla types reduce_scatter as returning one tensor; given a list it returns a list.
        return xm.reduce_scatter(  # type: ignore[return-value]
            xm.REDUCE_SUM,
            list(tensors),
            scale=scale,
            scatter_dim=0,
            shard_count=shard_count,
            groups=_explicit_groups(groups),
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
    _native_collective()
    reduce_type = xm.REDUCE_SUM if op == "sum" else xm.REDUCE_MAX
    return _native_all_reduce(reduce_type, tensor, _explicit_groups(groups), pin_layout)
