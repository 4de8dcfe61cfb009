"""Accelerate's collectives for XLA:CPU replicas that are threads of one process.

Accelerate's XLA forms of ``gather``, ``reduce``, ``pad_across_processes`` and the shuffled
dataloader's seed broadcast issue torch_xla collectives without a channel id, which hang on
several XLA:CPU devices (see the platform note in _xla.py). Replica threads share the host, so
here each value is read back at a graph boundary (where the replicas take turns) and handed
over in memory: exact, and no program to compile. Used only when ``rendezvous.replicas_are_threads()``;
on a TPU Accelerate's own forms run.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .. import _xla
from .rendezvous import exchange


def _exchange_leaves(data: Any, tag: str, prepare: Callable[[torch.Tensor], Any]) -> tuple:
    leaves, spec = tree_flatten(data)
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"{tag} takes tensors (or lists, tuples and dicts of them), got {type(leaf).__name__}")
    everyone = exchange([prepare(t) for t in leaves], tag)
    return leaves, spec, everyone


def _on_host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().cpu()


def gather(data: Any) -> Any:
    """Every replica's tensors concatenated along dim 0 (scalars as 1-element tensors), in rank
    order, on this replica's device: what Accelerate's ``gather`` gives on a TPU."""
    _xla.sync()
    leaves, spec, everyone = _exchange_leaves(data, "gather", _on_host)
    gathered = [
        torch.cat([theirs[i].reshape(1) if theirs[i].dim() == 0 else theirs[i] for theirs in everyone]).to(leaf.device)
        for i, leaf in enumerate(leaves)
    ]
    return tree_unflatten(gathered, spec)


def reduce(data: Any, reduction: str, scale: float) -> Any:
    """Sum (times ``scale``) or mean over the replicas; ``"none"`` returns ``data`` as it is."""
    if reduction == "none":
        return data
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be 'sum', 'mean' or 'none', got {reduction!r}")
    _xla.sync()
    leaves, spec, everyone = _exchange_leaves(data, "reduce", _on_host)
    reduced = []
    for i, leaf in enumerate(leaves):
        total = torch.stack([theirs[i] for theirs in everyone]).sum(0) * scale
        if reduction == "mean":
            total = total / len(everyone)
        reduced.append(total.to(leaf.dtype).to(leaf.device))
    return tree_unflatten(reduced, spec)


def pad_across_processes(data: Any, dim: int, pad_index: int, pad_first: bool) -> Any:
    """Pad each tensor along ``dim`` to the largest size any replica has there (shapes only are
    exchanged: nothing is read back from the device)."""
    leaves, spec, everyone = _exchange_leaves(data, "pad_across_processes", lambda t: tuple(t.shape))
    padded = [
        _pad(leaf, [theirs[i] for theirs in everyone], dim, pad_index, pad_first) for i, leaf in enumerate(leaves)
    ]
    return tree_unflatten(padded, spec)


def _pad(tensor: torch.Tensor, shapes: List[Sequence[int]], dim: int, pad_index: int, pad_first: bool) -> torch.Tensor:
    if not -tensor.dim() <= dim < tensor.dim():
        return tensor
    dim %= tensor.dim()
    size = max(shape[dim] for shape in shapes)
    if size == tensor.shape[dim]:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = size
    out = tensor.new_full(shape, pad_index)
    start = size - tensor.shape[dim] if pad_first else 0
    out.narrow(dim, start, tensor.shape[dim]).copy_(tensor)
    return out


def share_rng_states(rng_types: Sequence[str], generator: Optional[torch.Generator]) -> None:
    """Rank 0's random state for each of ``rng_types`` on every replica (Accelerate's
    ``synchronize_rng_states``, which a shuffling dataloader calls at the start of each epoch)."""
    for rng_type in rng_types:
        kind = str(getattr(rng_type, "value", rng_type))
        if kind == "generator" and generator is not None:
            generator.set_state(exchange(generator.get_state(), "generator state")[0])
        elif kind == "xla":
            dev = _xla.device()
            _xla.set_rng_state(exchange(_xla.rng_state(dev), "xla rng state")[0], dev)
        elif kind == "torch":
            torch.set_rng_state(exchange(torch.get_rng_state(), "torch rng state")[0])
