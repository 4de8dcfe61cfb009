"""The life of FSDP units in a training step: forward and backward hooks, and the state the
units of one model share during a step (``RootState``).

Forward hooks sit on each unit's *wrapped module*, not on the wrapper: every call of that module
gathers its parameters first, whoever makes it (the wrapper's forward, or ``generate()`` and other
methods of a ``transformers`` model that call the model directly).

  forward:   gather the unit's groups; run the module; free them unless the unit keeps them for
             backward; hook the outputs' gradients. A forward that raises frees them too.
  backward:  the hook on the outputs' gradients gathers the groups again; as each full
             parameter's gradient is accumulated, a group whose gradients are all in has them put
             in the unit's bucket, which reduce-scatters them into the shards' ``.grad`` at once
             or, with ``reduce_scatter_bucket_size_mb``, together with other groups'
             (collectives.py); once every trainable group of the unit is in, they are freed
             together; a callback queued by the first hook finishes all units after the backward
             (groups some parameter got no gradient in, buckets not yet full).
  no_sync:   the full gradients stay on the full parameters, accumulating, and are
             reduce-scattered by the first backward after it.
  graph cut: a unit still holding full parameters outside a forward or backward (a forward with
             gradients enabled and no backward) frees them before the graph is cut, so no program
             outputs them.

[Note: optimization barriers]
In one lazy graph a compiler may see the backward all-gather of a unit as the same value as the
forward one and merge them (keeping every full parameter alive from forward to backward), and
may move gathers and frees across the neighbouring units' computation. torch_xla's FSDP puts
optimization barriers at these points (proven on TPUs), and so do we, with the same options:
  forward:   barrier(shards + inputs) before the gather, barrier(gathered) after it,
             barrier(shards + outputs) after the free;
  backward:  the gradients reaching a unit's inputs and outputs, and each reduced gradient, are
             collected as dependencies; barrier(shards + dependencies) before the backward gather;
             barrier(shard + full gradient) before the reduce-scatter (torch_xla's barrier(shard +
             gradient) at the free and barrier(padded gradient) in one: the padded gradient is
             computed from the gradient), barrier(reduced) after it.
Measured on XLA:CPU (torch_xla 2.9; tests/test_compiled_program.py): the two gathers are never
merged there, barriers or not, because torch_xla threads a token through the collectives of a
graph (each collective's operand is ``input + token``), and XLA:CPU removes the barriers right
after its first CSE pass, before fusion and scheduling. It then issued gathers blocks ahead of
their use; so on the CPU a gather's dependencies also enter its operand as an exact zero
(``_xla.order_after``), which the scheduler must respect (tests/test_memory.py).
"""

from __future__ import annotations

import functools
import sys
import weakref
from enum import Enum, auto
from typing import TYPE_CHECKING, Any, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from . import _xla
from .checkpointing import in_recompute
from .param_group import ShardedParamGroup, free_groups

if TYPE_CHECKING:
    from .fsdp import XlaFullyShardedDataParallel as Unit


class TrainingState(Enum):
    IDLE = auto()
    FORWARD = auto()
    BACKWARD_PRE = auto()
    BACKWARD_POST = auto()


class RootState:
    """What the units of one wrapped model share: set by the outermost wrapper when it is built."""

    def __init__(self, units: List[Unit]) -> None:
        self.units = units
        self.root = units[0]
        self.device = _xla.device()
        self.backward_deps: List[torch.Tensor] = []  # gradients computed since the last gather
        self.reduced_grads: List[torch.Tensor] = []  # reduce-scatter outputs since the last gather
        self.finalize_queued = False
        self.forward_order: List[Unit] = []  # of the last forward
        self.sync_gradients = True
        _LIVE_ROOTS.add(self)

    def record_forward(self, unit: Unit) -> None:
        if unit is self.root:
            self.forward_order.clear()
        self.forward_order.append(unit)

    def unit_before(self, unit: Unit) -> Optional[Unit]:
        """The unit whose forward started just before ``unit``'s: backward needs it next."""
        index = next((i for i, u in enumerate(self.forward_order) if u is unit), 0)
        return self.forward_order[index - 1] if index > 0 else None


_LIVE_ROOTS: "weakref.WeakSet[RootState]" = weakref.WeakSet()


def _free_idle_units() -> None:
    """Before a graph cut: free full parameters held outside a forward or backward.

    A forward with gradients enabled and no backward (an evaluation that forgot ``no_grad``)
    leaves the root (and units that do not reshard after forward) holding full parameters; the
    next program would output them. A backward after the cut gathers them again, as always.
    """
    device = _xla.device()
    for state in list(_LIVE_ROOTS):
        if state.device == device:
            for unit in state.units:
                if unit.training_state is TrainingState.IDLE and not unit.summoned:
                    unit.free_params(None)


_xla.before_graph_cut(_free_idle_units)


# ---------------------------------------------------------------------------------------------
# Forward


def install_forward_hooks(unit: Unit) -> None:
    module = unit.module
    module.register_forward_pre_hook(functools.partial(_pre_forward, unit), with_kwargs=True, prepend=True)
    module.register_forward_hook(functools.partial(_post_forward, unit), with_kwargs=True, always_call=True)


def _pre_forward(unit: Unit, module: nn.Module, args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
    state = unit.root_state
    unit.training_state = TrainingState.FORWARD
    for group in unit.param_groups:
        if group.follow_requires_grad():  # hooks are made when wrapping, and here after an unfreeze
            ensure_grad_hooks(unit, group)
    if unit.options.compute_dtype != torch.float32:
        args, kwargs = tree_map(functools.partial(_cast, unit.options.compute_dtype), (args, kwargs))
    if torch.is_grad_enabled() and not in_recompute():
        state.record_forward(unit)
    barrier = unit.options.optimization_barrier_in_forward
    unit.gather_params(_tensors_in((args, kwargs)) if barrier else None)
    return args, kwargs


def _post_forward(unit: Unit, module: nn.Module, args: tuple, kwargs: dict, outputs: Any) -> None:
    # Called also when the forward raised (always_call): then free, so the model stays usable.
    failed = sys.exc_info()[1] is not None
    output_tensors = _tensors_in(outputs)
    if failed or _frees_after_forward(unit):
        unit.free_params(output_tensors if unit.options.optimization_barrier_in_forward else None)
    if torch.is_grad_enabled() and not failed:
        state = unit.root_state
        _hook_output_grads(unit, output_tensors)
        if unit.options.optimization_barrier_in_backward:
            _hook_input_grads(_tensors_in((args, kwargs)), state)
    unit.training_state = TrainingState.IDLE


def _cast(dtype: torch.dtype, x: Any) -> Any:
    if isinstance(x, torch.Tensor) and torch.is_floating_point(x):
        return x.to(dtype)
    return x


def _frees_after_forward(unit: Unit) -> bool:
    if unit.summoned:
        return False  # inside summon_full_params: kept until the block ends
    if not torch.is_grad_enabled():
        return True  # nothing will need the parameters for backward
    if in_recompute():
        return False  # the backward of this recomputation follows at once
    if unit.is_root and unit.options.disable_reshard_on_root:
        return False
    return unit.options.reshard_after_forward


def _tensors_in(tree: Any, found: Optional[List[torch.Tensor]] = None) -> List[torch.Tensor]:
    """The tensors in nested tuples, lists and dicts (``ModelOutput`` is a dict), in
    ``tree_flatten``'s order. Every unit's forward asks twice, and pytree's generic walk costs a
    replica about 25 us of host time for a decoder layer's arguments, this one about 4."""
    found = [] if found is None else found
    if isinstance(tree, torch.Tensor):
        found.append(tree)
    elif isinstance(tree, (tuple, list)):
        for x in tree:
            _tensors_in(x, found)
    elif isinstance(tree, dict):
        for x in tree.values():
            _tensors_in(x, found)
    return found


# ---------------------------------------------------------------------------------------------
# Backward


def _hook_output_grads(unit: Unit, outputs: List[torch.Tensor]) -> None:
    for t in outputs:
        if t.requires_grad:
            t.register_hook(functools.partial(_pre_backward, unit))


def _hook_input_grads(inputs: List[torch.Tensor], state: RootState) -> None:
    def collect(grad: torch.Tensor) -> torch.Tensor:
        state.backward_deps.append(grad)
        _xla.optimization_barrier_([grad])
        return grad.view(grad.size())  # a view of the barrier's output

    for t in inputs:
        if t.requires_grad:
            t.register_hook(collect)


def _pre_backward(unit: Unit, grad: torch.Tensor) -> torch.Tensor:
    state = unit.root_state
    _queue_finalize(state)
    barrier = unit.options.optimization_barrier_in_backward
    if barrier:
        state.backward_deps.append(grad)
    if not unit.params_gathered:
        unit.gather_params(state.backward_deps if barrier else None, after_collectives=state.reduced_grads)
        state.backward_deps.clear()
        state.reduced_grads.clear()
    if unit.options.backward_prefetch:
        _prefetch_next(unit, state, grad if barrier else None)
    if unit.training_state in (TrainingState.IDLE, TrainingState.FORWARD):
        unit.training_state = TrainingState.BACKWARD_PRE
    if barrier:
        _xla.optimization_barrier_([grad])
        return grad.view(grad.size())
    return grad


def _prefetch_next(unit: Unit, state: RootState, dep: Optional[torch.Tensor]) -> None:
    """Gather, now, the unit backward will need after this one (PyTorch's BACKWARD_PRE)."""
    nxt = state.unit_before(unit)
    if nxt is not None and nxt.training_state is TrainingState.IDLE:
        nxt.gather_params([dep] if dep is not None else None)


def _queue_finalize(state: RootState) -> None:
    if not state.finalize_queued:
        state.finalize_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(functools.partial(_finalize_backward, state))


def ensure_grad_hooks(unit: Unit, group: ShardedParamGroup) -> None:
    """Hook each trainable full parameter's accumulated gradient (once; also after an unfreeze)."""
    for param in group.full_params:
        if param.requires_grad and id(param) not in group.grad_hooked:
            param.register_post_accumulate_grad_hook(functools.partial(_on_grad_accumulated, unit, group))
            group.grad_hooked.add(id(param))


@torch.no_grad()
def _on_grad_accumulated(unit: Unit, group: ShardedParamGroup, param: torch.Tensor) -> None:
    if unit.training_state is not TrainingState.BACKWARD_POST:  # nn.Module's setattr is slow
        unit.training_state = TrainingState.BACKWARD_POST
    if group.note_grad_ready() and unit.root_state.sync_gradients:
        _reduce_group(unit, group)
        trainable = [g for g in unit.param_groups if g.requires_grad]
        if unit.grad_bucket.groups_taken == len(trainable):
            # Every trainable group is in (else _finalize_backward ends the unit). Their full
            # parameters are read by nothing after their gradients, so they are freed here,
            # together (the compiled program is the same as freeing each group as it is
            # reduced). The frozen ones may still be read by the rest of the unit's backward.
            free_groups(trainable)
            _end_unit_backward(unit)


def _reduce_group(unit: Unit, group: ShardedParamGroup) -> None:
    """Put the group's gradients in the unit's bucket, which reduce-scatters them at once or
    with the groups after them (collectives.GradBucket)."""
    _note_reduced(unit, unit.grad_bucket.add(group, unit.options.optimization_barrier_in_backward))


def _end_unit_backward(unit: Unit) -> None:
    """Every gradient of the unit is in: reduce what its bucket still holds."""
    _note_reduced(unit, unit.grad_bucket.end_backward(unit.options.optimization_barrier_in_backward))


def _note_reduced(unit: Unit, reduced: List[torch.Tensor]) -> None:
    if unit.options.optimization_barrier_in_backward:
        unit.root_state.reduced_grads.extend(reduced)


@torch.no_grad()
def _finalize_backward(state: RootState) -> None:
    """After the whole backward: reduce what is left (unless in no_sync), free everything, reset."""
    for unit in state.units:
        for group in unit.param_groups:
            if not state.sync_gradients:
                group.forget_grads_seen()
            elif group.has_pending_grads:
                _reduce_group(unit, group)
        free_groups(unit.param_groups)
        _end_unit_backward(unit)
        unit.training_state = TrainingState.IDLE
    root = state.root
    if root.options.optimization_barrier_in_backward:
        shards = [p for p in root.parameters() if p.grad is not None]
        _xla.optimization_barrier_(shards + [p.grad for p in shards] + state.backward_deps + state.reduced_grads)
    state.backward_deps.clear()
    state.reduced_grads.clear()
    state.finalize_queued = False
    if root.options.sync_on_finalization:
        _xla.sync()
