"""Host rendezvous between replica threads of one XLA:CPU process.

``xm.rendezvous`` (and ``xm.mesh_reduce``, built on it) exchange host values through an
all-gather without a channel id, which hangs on XLA:CPU devices (the platform note).
Accelerate's ``wait_for_everyone``, ``main_process_first`` and ``broadcast`` call them. When the
replicas are threads of one process they can simply hand each other the values, so the patch
table (patches.py) puts ``rendezvous`` and ``mesh_reduce`` in torch_xla's place on XLA:CPU; they
run torch_xla's own anywhere else (a process per replica).
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import torch

from .. import _xla
from . import graph_boundaries, replica_run


class _Exchange:
    """Replica threads of one process hand each other one value each, in rank order."""

    def __init__(self, num_replicas: int) -> None:
        self.meeting = replica_run.Meeting(num_replicas)
        self.values: List[Any] = [None] * num_replicas
        self.tags: List[str] = [""] * num_replicas

    def all_gather(self, rank: int, value: Any, tag: str) -> List[Any]:
        self.values[rank] = value
        self.tags[rank] = tag
        # No call site here (unlike a graph boundary): Accelerate's main_process_first meets from
        # two places by design. A rendezvous is told apart by its tag, checked below.
        self.meeting.wait(rank, f"rendezvous '{tag}'", graph_boundaries.sync_timeout())
        values, tags = list(self.values), list(self.tags)
        # nobody writes the next exchange's value before all have read this one
        self.meeting.wait(rank, f"rendezvous '{tag}' (reading)", graph_boundaries.sync_timeout())
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


def _forget_exchange() -> None:
    global _exchange
    with graph_boundaries.turns_lock:
        _exchange = None  # a new run meets afresh


graph_boundaries.on_new_run(_forget_exchange)


def replicas_are_threads() -> bool:
    """True in a replica thread on XLA:CPU whose process runs every replica as a thread: host
    values then pass between replicas in memory, and device collectives need the CPU form."""
    replicas = graph_boundaries.replica_threads()
    return replicas > 1 and replicas == _xla.world_size()


def exchange(value: Any, tag: str = "exchange") -> List[Any]:
    """Every replica thread's ``value``, by rank (``replicas_are_threads()`` must hold). The
    values are shared, not copied: treat them as read-only."""
    global _exchange
    with graph_boundaries.turns_lock:
        if _exchange is None:
            _exchange = _Exchange(graph_boundaries.replica_threads())
    return _exchange.all_gather(_xla.global_rank(), value, tag)


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
        _xla.collective_broadcast(tensors)
        return
    rank = _xla.global_rank()
    rank0 = exchange([t.detach().cpu() for t in tensors] if rank == 0 else None, "broadcast_from_rank0")[0]
    if rank != 0:
        with torch.no_grad():
            for mine, theirs in zip(tensors, rank0):
                mine.copy_(theirs.to(mine.device))
    exchange(None, "broadcast_from_rank0 done")  # rank 0's tensors are read; it may change them


Rendezvous = Callable[..., List[bytes]]
MeshReduce = Callable[[str, Any, Callable[[List[Any]], Any]], Any]


def rendezvous(original: Rendezvous) -> Rendezvous:
    """The patch of ``xm.rendezvous`` (patches.py): values handed over in memory between replica
    threads, ``original`` anywhere else."""

    def xla_rendezvous(tag: str, payload: bytes = b"", replicas: Sequence[int] = ()) -> List[bytes]:
        if not replicas_are_threads():
            return original(tag, payload, list(replicas))
        if replicas and sorted(replicas) != list(range(_xla.world_size())):
            raise NotImplementedError(
                f"xm.rendezvous('{tag}') among some replicas only ({list(replicas)}) on XLA:CPU threads"
            )
        return exchange(payload, tag)

    xla_rendezvous.__doc__ = original.__doc__
    return xla_rendezvous


def mesh_reduce(original: MeshReduce) -> MeshReduce:
    """The patch of ``xm.mesh_reduce`` (patches.py): ``original``, after a graph boundary on
    replica threads."""

    def xla_mesh_reduce(tag: str, data: Any, reduce_fn: Callable[[List[Any]], Any]) -> Any:
        if replicas_are_threads():
            # torch_xla reads ``data`` back to the host; run pending work at a boundary first, where
            # replicas take turns, not in a read-back that every replica launches at once.
            _xla.sync()
        return original(tag, data, reduce_fn)

    xla_mesh_reduce.__doc__ = original.__doc__
    return xla_mesh_reduce
