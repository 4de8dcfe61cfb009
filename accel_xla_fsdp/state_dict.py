"""State dicts of a wrapped model: the full one, and the metadata that puts shards back together.

Names: under the root wrapper every unit's module sits at ``..._fsdp_wrapped_module``; the full
state dict uses the names the unwrapped model has (``original_name``). The local state dict is
``nn.Module.state_dict()`` of the root: this replica's shards and the buffers. Every function
takes a unit's ``UnitState`` and reads the units inside it, with their names, from the root's
state (``UnitState.named_units``).
"""

from __future__ import annotations

import functools
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch

from . import _xla
from .param_group import ParamSlot, ShardedParamGroup
from .unit_state import UnitState

WRAPPED_MODULE = "_fsdp_wrapped_module"


def join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def original_name(name: str) -> str:
    """A name under the root wrapper as the unwrapped module would have it."""
    return name.replace(f"{WRAPPED_MODULE}.", "")


def full_name(prefix: str, name: str) -> str:
    """The name in the unwrapped model of parameter ``name`` of the unit at ``prefix``."""
    return original_name(join(prefix, WRAPPED_MODULE, name))


_saving = threading.local()


@contextmanager
def kept_on_this_replica(kept: bool) -> Iterator[None]:
    """Inside, ``state_dict()`` of a root unit's module (the unwrapped model's, as a save asks
    it) gives the full model on this replica only if ``kept``, else an empty dict, after taking
    part in the gathers: for saves, where one replica writes and the others need nothing."""
    with _saving_as(kept=kept):
        yield


@dataclass
class StandIns:
    """What ``state_dict()`` gave inside ``values_deferred``, by data pointer: each parameter's
    stand-in (its names, numel and dtype) and the buffers (real values)."""

    params: Dict[int, Tuple[Tuple[str, ...], int, torch.dtype]] = field(default_factory=dict)
    buffers: Set[int] = field(default_factory=set)


@contextmanager
def values_deferred(stand_ins: StandIns) -> Iterator[None]:
    """Inside, ``state_dict()`` of a root unit's module gathers nothing ([Note: saves written as
    gathered]): the replica that keeps it (``kept_on_this_replica``) gets an empty host tensor
    standing in for each parameter, never written to, recorded in ``stand_ins``;
    ``stream_params`` gives the values afterwards."""
    with _saving_as(stand_ins=stand_ins):
        yield


@contextmanager
def _saving_as(**setting: Any) -> Iterator[None]:
    """This thread's save setting (``_saving``), restored on the way out (saves may nest)."""
    ((name, value),) = setting.items()
    previous = getattr(_saving, name, None)
    setattr(_saving, name, value)
    try:
        yield
    finally:
        setattr(_saving, name, previous)


def kept_here() -> bool:
    """Whether ``state_dict()`` of the unwrapped model keeps the full model on this replica."""
    return getattr(_saving, "kept", None) is not False


def shards_by_name(root: UnitState) -> Dict[str, torch.nn.Parameter]:
    """Each parameter's name in the unwrapped model (tied names too) -> the shard holding it."""
    shards = {}
    for prefix, unit in root.named_units():
        for group in unit.param_groups:
            for slot in group.slots:
                for name in (slot.name, *slot.aliases):
                    shards[full_name(prefix, name)] = group.shard
    return shards


def full_state_dict(root: UnitState, kept_here: bool = True) -> Dict[str, torch.Tensor]:
    """The unsharded state dict of the original module, on the CPU, under its own names: each
    parameter once (a tied one under its first name), every buffer.

    Every replica must call it (it gathers); each gets the same dict, or with ``kept_here``
    False an empty one (it still takes part in the gathers). Parameters come back in their
    shards' dtype (float32 master weights under bf16 compute), buffers in their original one.
    """
    params = _streamed_params(root, kept_here)
    if not kept_here:
        return {}
    state = {names[0]: value for names, value in params}
    for name, buf in root.wrapper.named_buffers():
        state[original_name(name)] = _buffer_on_host(root, name, buf)
    return state


def model_state_dict(root: UnitState, kept_here: bool = True) -> Dict[str, torch.Tensor]:
    """What ``state_dict()`` of the unwrapped model gives, with full tensors on the CPU.

    Its keys: every name of every parameter (a tied weight under each of its names, one tensor)
    and the persistent buffers only (not, say, Llama's computed ``rotary_emb.inv_freq``); its
    dtypes: the parameters' (their shards') and the buffers' own. Accelerate's ``get_state_dict``
    and a stock ``save_pretrained`` read this. Every replica must call it (it gathers); with
    ``kept_here`` False it gives an empty dict (see ``full_state_dict``). Inside
    ``values_deferred`` it gathers nothing and its parameters are stand-ins.
    """
    stand_ins: Optional[StandIns] = getattr(_saving, "stand_ins", None)
    if stand_ins is None:
        params = _streamed_params(root, kept_here)
    else:
        params = _stand_in_params(root, stand_ins) if kept_here else []
    if not kept_here:
        return {}
    state = {name: value for names, value in params for name in names}
    for name, module in root.wrapper.named_modules():
        for local, buf in module._buffers.items():
            if buf is not None and local not in module._non_persistent_buffers_set:
                wrapped = join(name, local)
                state[original_name(wrapped)] = value = _buffer_on_host(root, wrapped, buf)
                if stand_ins is not None:
                    stand_ins.buffers.add(value.data_ptr())
    return state


# -- streaming the full parameters ------------------------------------------------------------
#
# [Note: streamed full state dicts]
# A full state dict is gathered a piece at a time, never a unit at once: each program
# all-gathers at most GATHER_BYTES of full tensors (rows of the shards, the same rows on every
# replica), and a replica that keeps the state dict copies each piece into the host tensor of its
# parameter at once, so what is gathered is freed before the next program. The full parameters
# the modules use stay freed throughout. A replica holds at most the host tensors it keeps (the
# whole model, on the replica that writes it; nothing on the others) plus one program's
# gathered pieces: on XLA:CPU, where device buffers are host memory too, GATHER_BYTES per
# replica. Gathering whole units, every one at once, and copying them out afterwards, cost
# about 2.9 full models per replica (issue 27). transformers' own save_pretrained need not keep
# anything: each piece goes into its file as it arrives (stream_params; [Note: saves written as
# gathered] in hf_accelerate/unwrapped_save.py).

GATHER_BYTES = 16 * 2**20


def _streamed_params(root: UnitState, kept_here: bool) -> List[Tuple[Tuple[str, ...], torch.Tensor]]:
    """Each full parameter on the CPU with its names in the unwrapped model (tied: several),
    unit by unit; with ``kept_here`` False none (the replica only takes part in the gathers)."""
    out: List[Tuple[Tuple[str, ...], torch.Tensor]] = []
    pending = _PendingPieces(kept_here)
    for prefix, unit in root.named_units():
        for group in unit.param_groups:
            hosts = [torch.empty(slot.shape, dtype=group.shard.dtype) if kept_here else None for slot in group.slots]
            for slot, host in zip(group.slots, hosts):
                if host is not None:
                    out.append((_names(prefix, slot), host))
            pending.gather(group, functools.partial(_place, group, hosts))
    pending.drain()
    return out


def _names(prefix: str, slot: ParamSlot) -> Tuple[str, ...]:
    return tuple(full_name(prefix, name) for name in (slot.name, *slot.aliases))


def _stand_in_params(root: UnitState, stand_ins: StandIns) -> List[Tuple[Tuple[str, ...], torch.Tensor]]:
    """An empty host tensor for each full parameter (``values_deferred``), with its names."""
    out = []
    for prefix, unit in root.named_units():
        for group in unit.param_groups:
            for slot in group.slots:
                stand_in = torch.empty(slot.shape, dtype=group.shard.dtype)
                stand_ins.params[stand_in.data_ptr()] = (_names(prefix, slot), slot.numel, stand_in.dtype)
                out.append((_names(prefix, slot), stand_in))
    return out


# Where ``stream_params`` hands each piece: (the parameter's names, its first element in the
# piece, the piece's elements in row-major order, on the CPU).
PieceWriter = Callable[[Tuple[str, ...], int, torch.Tensor], None]


def stream_params(root: UnitState, write: Optional[PieceWriter]) -> None:
    """Gather every full parameter a piece at a time ([Note: streamed full state dicts]) and
    hand each piece to ``write`` as it arrives; every replica must call it, those without a
    writer only take part in the gathers. Nothing is kept: a replica holds one program's pieces."""
    pending = _PendingPieces(write is not None)
    for prefix, unit in root.named_units():
        for group in unit.param_groups:
            names = [_names(prefix, slot) for slot in group.slots]
            pending.gather(group, functools.partial(_handed_over, group, names, write))
    pending.drain()


class _PendingPieces:
    """Pieces of shards all-gathered in the program being traced, and where each goes."""

    def __init__(self, kept_here: bool) -> None:
        self.kept_here = kept_here
        self.pieces: List[Tuple[torch.Tensor, Callable[[torch.Tensor], None]]] = []
        self.bytes = 0

    @torch.no_grad()
    def gather(self, group: ShardedParamGroup, place: Callable[[int, int, torch.Tensor], None]) -> None:
        """Trace the gathers of ``group``'s rows; each piece goes to ``place(first row, rows,
        gathered)`` once its program has run."""
        shard = group.shard.detach()
        world = group.sharding.world_size
        rows = shard.size(0)
        row_bytes = shard[:1].numel() * shard.element_size() * world
        step = max(1, GATHER_BYTES // row_bytes)
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            if self.bytes and self.bytes + (stop - start) * row_bytes > GATHER_BYTES:
                self.drain()
            piece = shard[start:stop]
            if world > 1:
                piece = _xla.all_gather(piece, group.sharding.groups, group.options.pin_layout_in_collective_ops)
            self.pieces.append((piece, functools.partial(place, start, stop - start)))
            self.bytes += (stop - start) * row_bytes

    def drain(self) -> None:
        """Run the gathers traced so far (every replica) and hand each piece, on the host, to
        where it goes (on a replica that keeps or writes the pieces)."""
        if not self.pieces:
            return
        _xla.sync()
        if self.kept_here:
            for piece, place in self.pieces:
                place(piece.cpu())
        self.pieces.clear()
        self.bytes = 0


def _slot_parts(
    group: ShardedParamGroup, start: int, count: int, gathered: torch.Tensor
) -> Iterator[Tuple[int, int, torch.Tensor]]:
    """The parts of ``gathered`` (rows ``[start, start + count)`` of every replica's shard,
    replica after replica) that belong to each parameter of the group: (its index, where the part
    starts in it, the part). The padded full tensor is the replicas' shards end to end along dim 0
    (flattened for a flat group, where a part starts at an element; a dim-0 group's one parameter
    by rows, where it starts at a row), and each parameter spans ``[offset, offset + its length)``."""
    rows = group.shard.size(0)
    for rank in range(group.sharding.world_size):
        lo = rank * rows + start
        part = gathered[rank * count : (rank + 1) * count]
        for index, slot in enumerate(group.slots):
            length = slot.shape[0] if group.spec.dim0 else slot.numel
            begin, end = max(lo, slot.offset), min(lo + count, slot.offset + length)
            if begin < end:
                yield index, begin - slot.offset, part[begin - lo : end - lo]


def _place(
    group: ShardedParamGroup, hosts: List[Optional[torch.Tensor]], start: int, count: int, gathered: torch.Tensor
) -> None:
    """Copy ``gathered`` into the host tensors of the group's parameters (``_slot_parts``)."""
    for index, begin, part in _slot_parts(group, start, count, gathered):
        host = hosts[index]
        assert host is not None  # placed only on the replica that keeps the state dict
        target = host if group.spec.dim0 else host.view(-1)
        target[begin : begin + part.size(0)] = part


def _handed_over(
    group: ShardedParamGroup,
    names: List[Tuple[str, ...]],
    write: Optional[PieceWriter],
    start: int,
    count: int,
    gathered: torch.Tensor,
) -> None:
    """Hand the parts of ``gathered`` to ``write``, each flattened, at its first element."""
    assert write is not None  # handed over only on the replica that writes
    for index, begin, part in _slot_parts(group, start, count, gathered):
        row = group.slots[index].shape[1:].numel() if group.spec.dim0 else 1
        write(names[index], begin * row, part.reshape(-1))


def _buffer_on_host(root: UnitState, name: str, buf: torch.Tensor) -> torch.Tensor:
    """Buffer ``name`` (under the root) on the CPU, in the dtype it had before wrapping."""
    return buf.detach().cpu().to(buffer_original_dtype(root, name) or buf.dtype)


def buffer_original_dtype(root: UnitState, name: str) -> Optional[torch.dtype]:
    """The dtype a buffer had before wrapping cast it to ``buffer_dtype`` (None if not cast)."""
    for prefix, unit in root.named_units():
        local = name[len(prefix) + 1 :] if prefix else name
        if (not prefix or name.startswith(prefix + ".")) and local in unit.buffer_orig_dtypes:
            return unit.buffer_orig_dtypes[local]
    return None


def shard_metadata(root: UnitState) -> Dict[str, Any]:
    """What it takes to reassemble (or reshard) this replica's ``state_dict()``.

    The same form as torch_xla's, so its ``consolidate_sharded_model_checkpoints`` reads
    checkpoints of ``{"model": state_dict(), "shard_metadata": get_shard_metadata()}``;
    ``sharding`` adds each unit's group, for loading on a different number of replicas.
    """
    shard_info, flatten_info, sharding = {}, {}, {}
    for prefix, unit in root.named_units():
        shard_info[prefix] = {
            g.spec.shard_name: {"_orig_size": g.spec.orig_size, "_orig_name": g.spec.orig_name}
            for g in unit.param_groups
        }
        sharding[prefix] = {
            "world_size": unit.sharding.world_size,
            "rank": unit.sharding.rank,
            "groups": unit.sharding.groups,
            "shard_param_on_dim_0": unit.options.shard_param_on_dim_0,
        }
        for g in unit.param_groups:
            names, shapes = g.spec.flat_names, g.spec.flat_shapes  # both set for a flat group
            if names is not None and shapes is not None:
                flatten_info[join(prefix, g.spec.orig_name)] = (list(names), list(shapes), [s.numel() for s in shapes])
    buffer_info = {
        name: {"_orig_dtype": dtype}
        for name, _ in root.wrapper.named_buffers()
        if (dtype := buffer_original_dtype(root, name)) is not None
    }
    return {
        "shard_info": shard_info,
        "flatten_info": flatten_info,
        "buffer_info": buffer_info,
        "world_size": root.sharding.world_size,
        "rank": root.sharding.rank,
        "sharding": sharding,
    }
