"""The collectives of a unit's parameter groups: their all-gather, one per group or one for all of
them (``coalesce_all_gather_ops``), and the bucket their gradients are reduce-scattered from
(``reduce_scatter_bucket_size_mb``).

Both options mean what they mean in torch_xla's FSDP, where they matter for the per-parameter
layout (a group per parameter, so dozens of collectives per unit and pass); with flat shards a
unit has one group, or two. Only groups with the same sharding (replica groups, shard count) and
the same reduce dtype can share a collective: the groups of one unit always do, so one unit's
groups are gathered together and share one bucket, never another unit's.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from . import _xla
from .param_group import ShardedParamGroup, adopt_gathered

# A group whose gradient was reduced, with the reduced gradient as it passed the barrier.
Reduced = Tuple[ShardedParamGroup, torch.Tensor]


def gather_groups(
    groups: Sequence[ShardedParamGroup],
    shards: Sequence[torch.Tensor],
    coalesce: bool,
    barrier: bool,
    zero: Optional[torch.Tensor],
    dtype: Optional[torch.dtype],
) -> None:
    """Gather ``groups`` (none gathered yet; one unit's): one all-gather each, or with
    ``coalesce`` one for all of them. Call under ``torch.no_grad()``.

    With ``barrier``, one optimization barrier follows the gathers (torch_xla's coalesced form),
    and on the CPU ``zero`` (``_xla.ordering_zero``) ties the first to what it must follow (see
    [Note: optimization barriers]); the others follow it, as XLA orders collectives among
    themselves. ``dtype``: see ``ShardedParamGroup.gather_input``.
    """
    inputs = [g.gather_input(shard, dtype) for g, shard in zip(groups, shards)]
    inputs[0] = _xla.order_after(inputs[0], zero)
    sharding, options = groups[0].sharding, groups[0].options
    pin = options.pin_layout_in_collective_ops
    if sharding.world_size == 1:
        gathered = inputs
    elif coalesce:
        gathered = _xla.all_gather_coalesced(inputs, sharding.groups, pin)
    else:
        gathered = [_xla.all_gather(t, sharding.groups, pin) for t in inputs]
    if barrier:
        _xla.optimization_barrier_(gathered)
    adopt_gathered(groups, gathered)


class GradBucket:
    """One unit's full gradients waiting to be reduce-scattered together (torch_xla's
    ``BucketizedReduceScatter``).

    A group's gradients join the bucket once all of them are in, and the bucket is reduced, in one
    collective, as soon as it holds more than ``limit_bytes`` (in the reduce dtype, padding
    included). That is torch_xla's rule: a bucket may exceed the limit by its last group, and a
    limit of 0 reduces every group on its own, at once. What is left is reduced when the unit's
    backward is done (``end_backward``).
    """

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.groups_taken = 0  # since the last end_backward: the unit's backward is done at its group count
        self._groups: List[ShardedParamGroup] = []
        self._grads: List[torch.Tensor] = []
        self._bytes = 0

    def add(self, group: ShardedParamGroup, barrier: bool) -> List[Reduced]:
        """Take ``group``'s full gradients; returns the groups with their reduced gradient shards
        if that filled the bucket (and so reduced it), else nothing."""
        self.groups_taken += 1
        full = group.take_full_grad()
        if full is None:
            return []
        if barrier:
            _xla.optimization_barrier_([full], read_only=[group.shard])  # see [Note: optimization barriers]
        self._groups.append(group)
        self._grads.append(full)
        self._bytes += full.numel() * full.element_size()
        return self.flush(barrier) if self._bytes > self.limit_bytes else []

    def take_reduced(self, group: ShardedParamGroup, reduced: torch.Tensor, barrier: bool) -> List[Reduced]:
        """Take ``group`` with its gradient already reduced (``reduced``, this replica's shard of it,
        ``ShardedParamGroup.reduce_linear_weight_grad``) into its ``shard.grad``; returns it with
        the gradient as it passed the barrier (``ShardedParamGroup.add_reduced_grad``)."""
        self.groups_taken += 1
        return [(group, group.add_reduced_grad(reduced, barrier))]

    def end_backward(self, barrier: bool) -> List[Reduced]:
        """The unit's backward is done: reduce what is left."""
        self.groups_taken = 0
        return self.flush(barrier)

    def flush(self, barrier: bool) -> List[Reduced]:
        """Reduce-scatter the bucket (mean over the sharding group) into its groups' ``shard.grad``;
        returns the groups with their reduced gradient shards as they passed the barrier. Call
        under ``torch.no_grad()``."""
        if not self._groups:
            return []
        groups, grads = self._groups, self._grads
        self._groups, self._grads, self._bytes = [], [], 0
        sharding, options = groups[0].sharding, groups[0].options
        world = sharding.world_size
        if world == 1:
            reduced = grads
        else:
            reduced = _xla.reduce_scatter_sum_coalesced(
                grads, world, 1.0 / world, sharding.groups, options.pin_layout_in_collective_ops
            )
        return [(group, group.add_reduced_grad(r, barrier)) for group, r in zip(groups, reduced)]
