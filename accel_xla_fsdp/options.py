"""The settings of one FSDP unit, validated once, shared by every unit an auto-wrap creates."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from . import _xla

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class ShardingGroup:
    """Which replicas one parameter shard is split across, and this replica's place among them.

    ``groups=None`` means every replica, in rank order.
    """

    rank: int
    world_size: int
    groups: Optional[List[List[int]]] = None


@dataclass(frozen=True)
class FsdpOptions:
    """Everything ``XlaFullyShardedDataParallel`` is told, with torch_xla's names and defaults.

    reshard_after_forward: free full parameters after forward, gather again for backward (ZeRO-3).
    flatten_parameters: one flat shard per unit (one gather, one reduce-scatter) instead of one per
        parameter; trainable and frozen parameters are flattened separately.
    shard_param_on_dim_0: without flattening, shard each parameter along dim 0, keeping its shape.
    optimization_barrier_in_forward / _in_backward: stop the compiler from merging the backward
        gather into the forward one (which would keep every full parameter alive) or from moving
        a unit's gather and free across the neighbouring units' computation.
    disable_reshard_on_root: the root unit keeps its parameters from forward to backward, which
        starts right after it.
    compute_dtype / buffer_dtype: dtype of the gathered parameters (and of float inputs) and of
        floating buffers; the shards and optimizer state stay in the parameters' own dtype.
    fp32_reduce_scatter: reduce gradients in fp32 when computing in a lower precision.
    sharding: the replicas to shard across (torch_xla's sharding_groups / _rank / _world_size).
    pin_layout_in_collective_ops: torch_xla's layout pinning; the XLA:CPU form never pins.
    execute_sharding_on_init: run the sharding program at once to free the full parameters.
    sync_on_finalization: cut the graph after backward, before the optimizer step.
    use_patched_linear: give nn.Linear a backward that reads the weight parameter itself.
    shard_size_multiple: pad shards to a multiple of this many elements per replica (128 on a
        TPU, for efficient gathers of 2-D tiles; 1 elsewhere).
    backward_prefetch: in a unit's pre-backward hook, also gather the unit whose forward ran
        just before (the next one backward needs), as PyTorch's BACKWARD_PRE prefetch does.
        Off by default: on the benchmark's Llama it holds one more block's full parameters
        (+4% bytes at 2 devices, +10% at 4) for a step-time gain that did not hold at 4 devices.
    """

    reshard_after_forward: bool = True
    flatten_parameters: bool = False
    shard_param_on_dim_0: bool = False
    optimization_barrier_in_forward: bool = True
    optimization_barrier_in_backward: bool = True
    disable_reshard_on_root: bool = True
    compute_dtype: torch.dtype = torch.float32
    buffer_dtype: torch.dtype = torch.float32
    fp32_reduce_scatter: bool = False
    sharding: Optional[ShardingGroup] = None
    pin_layout_in_collective_ops: bool = True
    execute_sharding_on_init: bool = True
    sync_on_finalization: bool = False
    use_patched_linear: bool = True
    shard_size_multiple: int = 1
    backward_prefetch: bool = False

    @property
    def reduce_dtype(self) -> torch.dtype:
        return torch.float32 if self.fp32_reduce_scatter else self.compute_dtype


def make_options(
    *,
    compute_dtype: Optional[torch.dtype],
    buffer_dtype: Optional[torch.dtype],
    sharding_groups: Optional[List[List[int]]],
    sharding_rank: Optional[int],
    sharding_world_size: Optional[int],
    flatten_parameters: bool,
    shard_param_on_dim_0: bool,
    _shard_size_multiple: Optional[int],
    _use_xla_patched_linear: bool,
    **flags: bool,
) -> FsdpOptions:
    """Validate torch_xla-style arguments and resolve their defaults into ``FsdpOptions``."""
    compute = _check_dtype("compute_dtype", compute_dtype or torch.float32)
    buffer = _check_dtype("buffer_dtype", buffer_dtype or compute)
    if flatten_parameters and shard_param_on_dim_0:
        raise ValueError(
            "flatten_parameters=True and shard_param_on_dim_0=True contradict each other: a flat "
            "shard has no dim 0 of its own. Choose one."
        )
    multiple = _shard_size_multiple
    if multiple is None:
        multiple = 1 if shard_param_on_dim_0 else _xla.default_shard_size_multiple()
    if multiple < 1:
        raise ValueError(f"_shard_size_multiple must be at least 1, got {multiple}")
    return FsdpOptions(
        compute_dtype=compute,
        buffer_dtype=buffer,
        sharding=resolve_sharding(sharding_groups, sharding_rank, sharding_world_size),
        shard_size_multiple=multiple,
        use_patched_linear=_use_xla_patched_linear,
        flatten_parameters=flatten_parameters,
        shard_param_on_dim_0=shard_param_on_dim_0,
        **flags,
    )


def _check_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be one of {FLOAT_DTYPES}, got {dtype}")
    return dtype


def resolve_sharding(
    groups: Optional[List[List[int]]], rank: Optional[int], world_size: Optional[int]
) -> ShardingGroup:
    """This replica's sharding group: every replica by default, else checked ``sharding_groups``."""
    if groups is None:
        if rank is not None or world_size is not None:
            raise ValueError("sharding_rank and sharding_world_size go with sharding_groups; pass all three")
        return ShardingGroup(rank=_xla.global_rank(), world_size=_xla.world_size())
    if rank is None or world_size is None:
        raise ValueError(
            "sharding_groups needs sharding_rank and sharding_world_size too (this replica's "
            "position in its group and the group size)"
        )
    check_sharding_groups(groups, rank, world_size, _xla.global_rank(), _xla.world_size())
    return ShardingGroup(rank=rank, world_size=world_size, groups=[list(g) for g in groups])


def check_sharding_groups(
    groups: List[List[int]], rank: int, world_size: int, replica: int, num_replicas: int
) -> None:
    """Groups must split the replicas into equal parts that cover each replica exactly once."""
    members = sorted(r for g in groups for r in g)
    if members != list(range(num_replicas)):
        raise ValueError(
            f"sharding_groups {groups} must cover each of the {num_replicas} replicas "
            f"(0..{num_replicas - 1}) exactly once"
        )
    sizes = {len(g) for g in groups}
    if sizes != {world_size}:
        raise ValueError(
            f"sharding_groups {groups} have sizes {sorted(sizes)}, but sharding_world_size is {world_size}"
        )
    mine = next(g for g in groups if replica in g)
    if mine.index(replica) != rank:
        raise ValueError(
            f"replica {replica} is at position {mine.index(replica)} of its sharding group {mine}, "
            f"but sharding_rank is {rank}"
        )
