"""The runtime state of an FSDP unit (``UnitState``), whose bound methods are its forward and
backward hooks, and what the units of one model share (``RootState``): the root's state holds
every unit of the model and its name, filled once when the root is built.

The wrapper (fsdp.py) builds a unit (construction.py) and keeps its ``UnitState``; state dicts,
checkpoints and hooks read the units from the root's state. Plain objects, not ``nn.Module``s:
``nn.Module.__setattr__`` is slow on the hot path.

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
             computed from the gradient), barrier(reduced) after it; the root's scalar outputs
             (the loss) join the barrier on the gradient reaching the root, so they are computed
             before backward goes on (ours, not torch_xla's: docs/tpu.md).
Measured on XLA:CPU (torch_xla 2.9; tests/test_compiled_program.py): the two gathers are never
merged there, barriers or not, because torch_xla threads a token through the collectives of a
graph (each collective's operand is ``input + token``), and XLA:CPU removes the barriers right
after its first CSE pass, before fusion and scheduling. It then issued gathers blocks ahead of
their use; so on the CPU a gather's dependencies also enter its operand as an exact zero
(``_xla.order_after``), which the scheduler must respect (tests/test_memory.py).

[Note: the optimizer in backward]
With ``apply_optimizer_in_backward(optimizer)`` (the Accelerate plugin's
``xla_fsdp_optimizer_in_backward``) each group's update is made in backward, as soon as its
gradient is reduced: ``optimizer.step()`` with every other parameter's gradient set aside, after
which the gradient is dropped, and the updated shards join the barrier before the next unit's
backward gather. The TPU compiler's scheduler otherwise makes every update at the step's end,
holding each layer's reduced gradient shard through the rest of backward (docs/tpu.md, "The
scheduler's memory target"); the barrier pins each update where it is made. The script's own
``optimizer.step()`` then steps what is left: the vocabulary's tables kept sharded, whose
gradient autograd accumulates on the shard, and parameters without gradients. Under ``no_sync``
nothing is stepped; the micro-batch that syncs steps the accumulated gradient. Gradient clipping
needs every gradient before the first update, so ``clip_grad_norm_`` refuses.
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from contextlib import contextmanager
from enum import Enum, auto
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from . import _xla, embedding, linear, sharded_loss, sharded_tables
from .checkpointing import in_recompute
from .collectives import GradBucket, Reduced, gather_groups
from .options import FsdpOptions, ShardingGroup
from .param_group import ShardedParamGroup, free_groups
from .xla_cpu.graph_boundaries import before_graph_cut

# The wrapper's attribute holding its unit's state (``is_unit`` reads it).
STATE_ATTRIBUTE = "unit_state"


class TrainingState(Enum):
    IDLE = auto()
    FORWARD = auto()
    BACKWARD_PRE = auto()
    BACKWARD_POST = auto()


def is_unit(module: nn.Module) -> bool:
    """Whether ``module`` is an FSDP unit (a wrapper that has been built)."""
    return isinstance(module.__dict__.get(STATE_ATTRIBUTE), UnitState)


class UnitState:
    """One unit's runtime state: its settings, its parameter groups and their gradient bucket,
    where it is in the step. Its bound methods are the hooks on the wrapped module."""

    __slots__ = (
        "wrapper",
        "module",
        "options",
        "sharding",
        "param_groups",
        "grad_bucket",
        "buffer_orig_dtypes",
        "training_state",
        "summoned",
        "_root_state",
        "__weakref__",
    )

    def __init__(
        self,
        wrapper: nn.Module,
        module: nn.Module,
        options: FsdpOptions,
        sharding: ShardingGroup,
        param_groups: List[ShardedParamGroup],
        buffer_orig_dtypes: Dict[str, torch.dtype],
    ) -> None:
        self.wrapper = wrapper  # the XlaFullyShardedDataParallel (its parameters are the shards)
        self.module = module  # the module it wraps, which the hooks sit on
        self.options = options
        self.sharding = sharding
        self.param_groups = param_groups
        self.grad_bucket = GradBucket(options.bucket_bytes)
        self.buffer_orig_dtypes = buffer_orig_dtypes  # by name under the wrapper
        self.training_state = TrainingState.IDLE
        self.summoned = False  # inside summon_full_params: forwards keep the full parameters
        self._root_state: Optional[RootState] = None  # set by the root (RootState)

    def install_hooks(self) -> None:
        for group in self.param_groups:
            self.ensure_grad_hooks(group)
        self.install_weight_grad_sinks()
        self.module.register_forward_pre_hook(self._pre_forward, with_kwargs=True, prepend=True)
        self.module.register_forward_hook(self._post_forward, with_kwargs=True, always_call=True)

    @property
    def root_state(self) -> RootState:
        """What the units of this model share: set when the root is built, before any hook runs."""
        state = self._root_state
        if state is None:
            raise RuntimeError("this FSDP unit is used before the root wrapper around it was built")
        return state

    @root_state.setter
    def root_state(self, state: RootState) -> None:
        self._root_state = state

    @property
    def is_root(self) -> bool:
        return self.root_state.root is self

    def named_units(self) -> List[Tuple[str, UnitState]]:
        """This unit (first, named ``""``) and every unit inside it, named under this unit."""
        return self.root_state.units_under(self)

    # -- gathering and freeing --------------------------------------------------------------

    @property
    def params_gathered(self) -> bool:
        """Whether every group is gathered, or kept sharded for compute (``keep_vocabulary_sharded``)."""
        return all(g.gathered or g.kept_sharded for g in self.param_groups)

    def gather_params(
        self,
        deps: Optional[List[torch.Tensor]],
        dtype: Optional[torch.dtype] = None,
        after_collectives: Sequence[torch.Tensor] = (),
        for_compute: bool = True,
    ) -> None:
        """Gather every group of this unit (in one all-gather with ``coalesce_all_gather_ops``);
        with ``deps``, not before those are computed. ``after_collectives``: more dependencies,
        outputs of collectives (reduced gradients), which the barrier takes too; on the CPU the
        gather follows them anyway (XLA orders collectives among themselves), so the ordering
        zero, traced from each dependency, leaves them out. ``for_compute``: for the unit's
        forward and backward, which compute the groups kept sharded from their shards."""
        pending = [g for g in self.param_groups if not (g.gathered or (for_compute and g.kept_sharded))]
        if not pending:
            return
        with torch.no_grad():
            zero = None
            sources: List[torch.Tensor] = [g.shard for g in pending]
            if deps is not None:
                sources = _xla.optimization_barrier_(deps + list(after_collectives), read_only=sources)
                zero = _xla.ordering_zero(deps)
            gather_groups(pending, sources, self.options.coalesce_all_gather_ops, deps is not None, zero, dtype)

    def free_params(self, deps: Optional[List[torch.Tensor]]) -> None:
        free_groups(self.param_groups)
        if deps is not None:
            _xla.optimization_barrier_(deps, read_only=self._shards())

    def _shards(self) -> List[torch.Tensor]:
        return [g.shard for g in self.param_groups]

    # -- forward ----------------------------------------------------------------------------

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
        self.training_state = TrainingState.FORWARD
        for group in self.param_groups:
            if group.follow_requires_grad():  # hooks are made when wrapping, and here after an unfreeze
                self.ensure_grad_hooks(group)
        if self.options.compute_dtype != torch.float32:
            args, kwargs = tree_map(functools.partial(_cast, self.options.compute_dtype), (args, kwargs))
        if torch.is_grad_enabled() and not in_recompute():
            self.root_state.record_forward(self)
        barrier = self.options.optimization_barrier_in_forward
        self.gather_params(_tensors_in((args, kwargs)) if barrier else None)
        return args, kwargs

    def _post_forward(self, module: nn.Module, args: tuple, kwargs: dict, outputs: Any) -> None:
        # Called also when the forward raised (always_call): then free, so the model stays usable.
        failed = sys.exc_info()[1] is not None
        output_tensors = _tensors_in(outputs)
        if failed or self._frees_after_forward():
            self.free_params(output_tensors if self.options.optimization_barrier_in_forward else None)
        if torch.is_grad_enabled() and not failed:
            self._hook_output_grads(output_tensors)
            if self.options.optimization_barrier_in_backward:
                self.root_state.hook_input_grads(_tensors_in((args, kwargs)))
                if self.is_root and not in_recompute():
                    self.root_state.forward_outputs = [t for t in output_tensors if t.dim() == 0]
        self.training_state = TrainingState.IDLE

    def _frees_after_forward(self) -> bool:
        if self.summoned:
            return False  # inside summon_full_params: kept until the block ends
        if not torch.is_grad_enabled():
            return True  # nothing will need the parameters for backward
        if in_recompute():
            return False  # the backward of this recomputation follows at once
        if self.is_root and self.options.disable_reshard_on_root:
            return False
        return self.options.reshard_after_forward

    # -- backward ---------------------------------------------------------------------------

    def _hook_output_grads(self, outputs: List[torch.Tensor]) -> None:
        for t in outputs:
            if t.requires_grad:
                t.register_hook(self._pre_backward)

    def _pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        state = self.root_state
        state.queue_finalize()
        barrier = self.options.optimization_barrier_in_backward
        if barrier:
            state.backward_deps.append(grad)
        if not self.params_gathered:
            self.gather_params(state.backward_deps if barrier else None, after_collectives=state.reduced_grads)
            state.backward_deps.clear()
            state.reduced_grads.clear()
        if self.options.backward_prefetch:
            self._prefetch_next(grad if barrier else None)
        if self.training_state in (TrainingState.IDLE, TrainingState.FORWARD):
            self.training_state = TrainingState.BACKWARD_PRE
        if barrier:
            # With the root's scalar outputs (the loss), computed before backward goes on: the TPU
            # compiler left the loss's reduction for the step's end, which held the logits through
            # the whole backward (docs/tpu.md).
            _xla.optimization_barrier_([grad] + state.forward_outputs)
            state.forward_outputs = []
            return grad.view(grad.size())
        return grad

    def _prefetch_next(self, dep: Optional[torch.Tensor]) -> None:
        """Gather, now, the unit backward will need after this one (PyTorch's BACKWARD_PRE)."""
        nxt = self.root_state.unit_before(self)
        if nxt is not None and nxt.training_state is TrainingState.IDLE:
            nxt.gather_params([dep] if dep is not None else None)

    def ensure_grad_hooks(self, group: ShardedParamGroup) -> None:
        """Hook each trainable full parameter's accumulated gradient (once; also after an unfreeze)."""
        for param in group.full_params:
            if param.requires_grad and id(param) not in group.grad_hooked:
                param.register_post_accumulate_grad_hook(functools.partial(self._on_grad_accumulated, group))
                group.grad_hooked.add(id(param))

    @torch.no_grad()
    def _on_grad_accumulated(self, group: ShardedParamGroup, param: torch.Tensor) -> None:
        if param.grad is None and linear.has_weight_grad_sink(param):
            return  # the sink took the gradient (autograd still runs the hook, with nothing)
        self.training_state = TrainingState.BACKWARD_POST
        if group.note_grad_ready() and self.root_state.sync_gradients:
            self.reduce_group(group)
            self._end_if_all_in()

    def keep_tables_sharded(self, is_root: bool) -> None:
        """``keep_vocabulary_sharded``: in the root, compute each stock Embedding and patched Linear
        whose weight is a dim-0 group of this unit's own from that group's shard, never gathered
        whole (sharded_tables.py), and with ``lm_loss_in_chunks`` give the module the loss from
        lm_head's chunks (sharded_loss.py); in any other unit (a former root), gather them again."""
        options = self.options
        keep = is_root and options.keep_vocabulary_sharded and self.sharding.world_size > 1
        for group in self.param_groups:
            group.kept_sharded = False
        if not keep:
            return
        dim0 = {id(g.slots[0].param): g for g in self.param_groups if g.spec.dim0 and len(g.slots) == 1}
        # A table stays sharded only if every module holding it computes from its shard: a tied
        # weight also read by another module (Gemma-2's scaled embedding, a subclass with its own
        # forward, beside its patched lm_head) must be gathered for it.
        holders: Dict[int, List[nn.Module]] = {}
        for m in self.module.modules():  # full parameters are plain attributes (construction.py)
            for value in [*m._parameters.values(), *vars(m).values()]:
                if isinstance(value, torch.Tensor):
                    holders.setdefault(id(value), []).append(m)
        computes_from_shard = [m for m in self.module.modules() if embedding.is_patched(m) or linear.is_patched(m)]
        for m in computes_from_shard:
            table = dim0.get(id(m.weight))
            if table is not None and all(h in computes_from_shard for h in holders[id(m.weight)]):
                sharded_tables.attach(m, table)
                table.kept_sharded = True
        if options.lm_loss_in_chunks and any(g.kept_sharded for g in self.param_groups):
            sharded_loss.install(self.module)

    def install_weight_grad_sinks(self) -> None:
        """``reduce_scatter_in_linear_backward``: give each patched Linear's weight that is a dim-0
        group of this unit's own (tied or not) the sink that reduce-scatters its gradient in chunks
        when this unit is the root (which the sink asks when called: the root is the outermost
        unit, known only once it is built)."""
        options = self.options
        if not (options.reduce_scatter_in_linear_backward and options.use_xla_patched_linear):
            return
        if self.sharding.world_size == 1:
            return
        weights = {id(m.weight) for m in self.module.modules() if linear.is_patched(m)}
        for group in self.param_groups:
            slot = group.slots[0]
            if group.spec.dim0 and len(group.slots) == 1 and id(slot.param) in weights:
                linear.set_weight_grad_sink(slot.param, functools.partial(self._reduce_linear_weight_grad, group))

    @torch.no_grad()
    def _reduce_linear_weight_grad(
        self, group: ShardedParamGroup, grad_output: torch.Tensor, input: torch.Tensor
    ) -> bool:
        """A Linear weight's gradient sink: reduced in chunks as it is computed. Only in the root
        unit, which holds lm_head: its full gradient is the one that counts (vocabulary x hidden),
        and on the blocks' Linears the chunks planned more, not less (495.4 against 362.2 MB, issue
        25's Llama, bf16, v5e-8). Not under no_sync, nor with full gradients pending from one
        (autograd's gradient joins them, and they are reduced together as before)."""
        if not (self.is_root and self.root_state.sync_gradients) or group.has_pending_grads:
            return False
        self.training_state = TrainingState.BACKWARD_POST
        reduced = group.reduce_linear_weight_grad(grad_output, input)
        # Not noted for the next gather's barrier (_note_reduced): tied to the last block's gather,
        # lm_head's chunks planned 477.5 against 362.2 MB (issue 25's Llama, bf16, v5e-8).
        barrier = self.options.optimization_barrier_in_backward
        if group.slots[0].aliases:
            # A tied weight (lm_head is the embedding): this use's part is reduced now, added to
            # the shard's gradient; the embedding's comes through autograd at the end of backward
            # and takes the group as usual. Reduce-scattering is linear: the sum is the same.
            group.add_reduced_grad(reduced, barrier)
            return True
        taken = self.grad_bucket.take_reduced(group, reduced, barrier)
        self.root_state.step_in_backward(taken)
        self._end_if_all_in()
        return True

    def _end_if_all_in(self) -> None:
        trainable = [g for g in self.param_groups if g.requires_grad]
        if self.grad_bucket.groups_taken == len(trainable):
            # Every trainable group is in (else RootState.finalize_backward ends the unit).
            # Their full parameters are read by nothing after their gradients, so they are
            # freed here, together (the compiled program is the same as freeing each group
            # as it is reduced). The frozen ones may still be read by the rest of the unit's
            # backward.
            free_groups(trainable)
            self.end_backward()

    def reduce_group(self, group: ShardedParamGroup) -> None:
        """Put the group's gradients in the unit's bucket, which reduce-scatters them at once or
        with the groups after them (collectives.GradBucket)."""
        self._note_reduced(self.grad_bucket.add(group, self.options.optimization_barrier_in_backward))

    def end_backward(self) -> None:
        """Every gradient of the unit is in: reduce what its bucket still holds."""
        self._note_reduced(self.grad_bucket.end_backward(self.options.optimization_barrier_in_backward))

    def _note_reduced(self, reduced: List[Reduced]) -> None:
        updated = self.root_state.step_in_backward(reduced)
        if self.options.optimization_barrier_in_backward:
            # The next unit's backward gather waits for these, and for the shards the optimizer
            # updated from them ([Note: the optimizer in backward]).
            self.root_state.reduced_grads.extend([grad for _, grad in reduced] + updated)


class RootState:
    """What the units of one wrapped model share, held by the root's state: every unit with its
    name under the root (the root first, named ``""``), and the step's bookkeeping. Made by the
    outermost wrapper when it is built; an outer wrapper built later makes its own."""

    def __init__(self, named_units: List[Tuple[str, UnitState]]) -> None:
        self.named_units = named_units
        self.units = [unit for _, unit in named_units]
        self.root = self.units[0]
        self.device = _xla.device()
        self.backward_deps: List[torch.Tensor] = []  # gradients computed since the last gather
        self.reduced_grads: List[torch.Tensor] = []  # reduce-scatter outputs since the last gather
        self.forward_outputs: List[torch.Tensor] = []  # the root's scalar outputs, until backward
        self.finalize_queued = False
        self.forward_order: List[UnitState] = []  # of the last forward
        self.sync_gradients = True
        self.optimizer_in_backward: Optional[torch.optim.Optimizer] = None  # [Note: the optimizer in backward]
        self.stepped_in_backward = False  # in this backward
        self.awaiting_step = False  # stepped in a backward, and the script's step not called since
        self.in_backward_step = False  # the optimizer is stepping for us, not for the script
        for unit in self.units:
            unit.root_state = self
            unit.keep_tables_sharded(unit is self.root)
        _track_root(self)

    def step_in_backward(self, reduced: List[Reduced]) -> List[torch.Tensor]:
        """[Note: the optimizer in backward]: with an optimizer given, step the groups whose
        gradients were just reduced, and only them; returns their updated shards."""
        optimizer = self.optimizer_in_backward
        if optimizer is None or not self.sync_gradients:  # every unit's backward passes here
            return []
        shards: List[torch.Tensor] = [group.shard for group, _ in reduced if group.shard.grad is not None]
        if not shards:
            return []
        if self.awaiting_step:
            raise RuntimeError(
                "a second backward stepped the optimizer before its step() was called: with the optimizer "
                "in backward each backward that syncs applies its gradients, so accumulate over micro-batches "
                "under model.no_sync() (Accelerate's accumulate() does) and call optimizer.step() after each "
                "backward that syncs"
            )
        self.stepped_in_backward = True
        with _only_grads_of(optimizer, shards), _in_backward_step(self):
            optimizer.step()
        for shard in shards:
            shard.grad = None  # applied: the step after backward leaves it alone
        return shards

    def units_under(self, unit: UnitState) -> List[Tuple[str, UnitState]]:
        """``unit`` (named ``""``) and the units inside it, named under it."""
        prefix = next(name for name, u in self.named_units if u is unit)
        if not prefix:
            return self.named_units
        return [
            (name[len(prefix) + 1 :] if name != prefix else "", u)
            for name, u in self.named_units
            if name == prefix or name.startswith(prefix + ".")
        ]

    def record_forward(self, unit: UnitState) -> None:
        if unit is self.root:
            self.forward_order.clear()
        self.forward_order.append(unit)

    def unit_before(self, unit: UnitState) -> Optional[UnitState]:
        """The unit whose forward started just before ``unit``'s: backward needs it next."""
        index = next((i for i, u in enumerate(self.forward_order) if u is unit), 0)
        return self.forward_order[index - 1] if index > 0 else None

    def hook_input_grads(self, inputs: List[torch.Tensor]) -> None:
        for t in inputs:
            if t.requires_grad:
                t.register_hook(self._collect_input_grad)

    def _collect_input_grad(self, grad: torch.Tensor) -> torch.Tensor:
        self.backward_deps.append(grad)
        _xla.optimization_barrier_([grad])
        return grad.view(grad.size())  # a view of the barrier's output

    def queue_finalize(self) -> None:
        if not self.finalize_queued:
            self.finalize_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)

    @torch.no_grad()
    def _finalize_backward(self) -> None:
        """After the whole backward: reduce what is left (unless in no_sync), free everything, reset."""
        for unit in self.units:
            for group in unit.param_groups:
                if not self.sync_gradients:
                    group.forget_grads_seen()
                elif group.has_pending_grads:
                    unit.reduce_group(group)
            free_groups(unit.param_groups)
            unit.end_backward()
            unit.training_state = TrainingState.IDLE
        # No barrier over every shard and gradient here, where torch_xla's FSDP puts one: with it
        # the TPU compiler cannot start the optimizer's update of a unit before the last gradient
        # of the step is made, so every gradient shard is held to the end of backward (Llama-3.1-8B
        # on v5p-8: 3.4 GiB of the plan, docs/tpu.md). Without it each update follows its unit's
        # reduce-scatter, as in SPMD FSDPv2's program; data dependencies keep it after the last
        # gather that reads the shard.
        self.backward_deps.clear()
        self.reduced_grads.clear()
        self.finalize_queued = False
        self.awaiting_step = self.awaiting_step or self.stepped_in_backward
        self.stepped_in_backward = False
        if self.root.options.sync_on_finalization:
            _xla.sync()


@contextmanager
def _in_backward_step(state: RootState) -> Iterator[None]:
    """Marks the optimizer's step as ours, which its step hook (``script_stepped``) ignores."""
    state.in_backward_step = True
    try:
        yield
    finally:
        state.in_backward_step = False


def script_stepped(state: RootState) -> None:
    """The optimizer's step hook: a step the script called ends the wait for it."""
    if not state.in_backward_step:
        state.awaiting_step = False


@contextmanager
def _only_grads_of(optimizer: torch.optim.Optimizer, shards: List[torch.Tensor]) -> Iterator[None]:
    """The optimizer's other parameters without their gradients for the duration: a
    ``torch.optim`` optimizer skips a parameter whose gradient is None."""
    keep = {id(s) for s in shards}
    others = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None and id(p) not in keep]
    grads = [p.grad for p in others]
    for p in others:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in zip(others, grads):
            p.grad = grad


# Replica threads wrap models and sync at once. Not a WeakSet: one iterated in a replica's sync
# while another replica adds its new root raised "Set changed size during iteration" (once in
# ~110 runs of a reused 4-device pool, at the sync that ends wrapping); here only a lock holder
# changes the list.
_LIVE_ROOTS: List["weakref.ref[RootState]"] = []
_LIVE_ROOTS_LOCK = threading.Lock()


def _track_root(state: RootState) -> None:
    with _LIVE_ROOTS_LOCK:
        _LIVE_ROOTS[:] = [r for r in _LIVE_ROOTS if r() is not None] + [weakref.ref(state)]


def _live_roots() -> List[RootState]:
    with _LIVE_ROOTS_LOCK:
        states = [r() for r in _LIVE_ROOTS]
    return [s for s in states if s is not None]


def _free_idle_units() -> None:
    """Before a graph cut: free full parameters held outside a forward or backward.

    A forward with gradients enabled and no backward (an evaluation that forgot ``no_grad``)
    leaves the root (and units that do not reshard after forward) holding full parameters; the
    next program would output them. A backward after the cut gathers them again, as always.
    """
    device = _xla.device()
    for state in _live_roots():
        if state.device == device:
            for unit in state.units:
                if unit.training_state is TrainingState.IDLE and not unit.summoned:
                    unit.free_params(None)


before_graph_cut(_free_idle_units)


@contextmanager
def holding_full_params(units: List[UnitState], in_shard_dtype: bool, writeback: bool) -> Iterator[None]:
    """``units`` gathered (no gradients) until the block ends: forwards inside do not free them
    (``summoned``), nor does a graph cut. Then written back into the shards if asked, and freed."""
    with torch.no_grad():
        for unit in units:
            dtype = unit.param_groups[0].shard.dtype if in_shard_dtype and unit.param_groups else None
            unit.gather_params(None, dtype=dtype, for_compute=False)
            unit.summoned = True
        try:
            yield
        finally:
            for unit in units:
                unit.summoned = False
                if writeback:
                    for group in unit.param_groups:
                        group.write_back()
                unit.free_params(None)


def _cast(dtype: torch.dtype, x: Any) -> Any:
    if isinstance(x, torch.Tensor) and torch.is_floating_point(x):
        return x.to(dtype)
    return x


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
