"""``XlaFullyShardedDataParallel``: the module wrapper, its hooks and its user-facing methods.

One wrapper is one *unit*: it owns the parameters of its module that no inner unit owns, as
``ShardedParamGroup``s. The outermost unit called first is the *root*; it holds the state that
one forward/backward shares across units (``_RootState``).

The life of a unit in one training step (see [Note: full parameters and shards]):
  forward:   gather its groups; run the module; free them unless it keeps them for backward;
             hook its outputs' gradients.
  backward:  the hook on its outputs' gradients gathers the groups again; as each full parameter's
             gradient is accumulated, a group whose gradients are all in is reduce-scattered into
             its shard's ``.grad`` and freed; a callback queued by the first hook finishes all units
             after the backward (groups some parameter got no gradient in, frozen groups).

[Note: optimization barriers]
In one lazy graph a compiler may see the backward all-gather of a unit as the same value as the
forward one and merge them (keeping every full parameter alive from forward to backward), and
may move gathers and frees across the neighbouring units' computation. torch_xla's FSDP puts
optimization barriers at these points (proven on TPUs), and so do we, with the same options:
  forward:   barrier(shards + inputs) before the gather, barrier(gathered) after it,
             barrier(shards + outputs) after the free;
  backward:  the gradients reaching a unit's inputs and outputs, and each reduced gradient, are
             collected as dependencies; barrier(shards + dependencies) before the backward gather;
             barrier(full gradient) before the reduce-scatter, barrier(reduced) after it.
Measured on XLA:CPU (torch_xla 2.9; tests/test_compiled_program.py): the two gathers are never
merged there, barriers or not, because torch_xla threads a token through the collectives of a
graph (each collective's operand is ``input + token``), and XLA:CPU removes the barriers right
after its first CSE pass, before fusion and scheduling. It then issued gathers blocks ahead of
their use; so on the CPU a gather's dependencies also enter its operand as an exact zero
(``_xla.order_after``), which the scheduler must respect (tests/test_memory.py).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from enum import Enum, auto
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_flatten, tree_map

from . import _xla
from .checkpointing import in_recompute
from .linear import patch_linear_modules
from .options import FsdpOptions, make_options
from .param_group import ParamSlot, ShardedParamGroup, ShardSpec, shard_param_name
from .wrap import recursive_wrap, resolve_policy

WRAPPED_MODULE = "_fsdp_wrapped_module"

class _ParamRegistry:
    """Every full parameter a unit manages, and every parameter a unit replaced, with its name:
    to catch an optimizer built before wrapping, and a parameter claimed by two units.

    Keyed by identity: weak containers compare their keys with ``==``, elementwise for tensors.
    """

    def __init__(self) -> None:
        self._names: Dict[int, Tuple[weakref.ref[nn.Parameter], str]] = {}

    def add(self, param: nn.Parameter, name: str) -> None:
        key = id(param)
        self._names[key] = (weakref.ref(param), name)
        weakref.finalize(param, self._names.pop, key, None)

    def name_of(self, param: torch.Tensor) -> Optional[str]:
        entry = self._names.get(id(param))
        return entry[1] if entry is not None and entry[0]() is param else None


_MANAGED_PARAMS = _ParamRegistry()
_WRAPPED_MODULES: weakref.WeakSet[nn.Module] = weakref.WeakSet()


class TrainingState(Enum):
    IDLE = auto()
    FORWARD = auto()
    BACKWARD_PRE = auto()
    BACKWARD_POST = auto()


class _RootState:
    """What the units of one wrapped model share during a forward and backward."""

    def __init__(self, units: List[XlaFullyShardedDataParallel]) -> None:
        self.units = units
        self.backward_deps: List[torch.Tensor] = []
        self.finalize_queued = False
        self.forward_order: List[XlaFullyShardedDataParallel] = []  # of the last forward

    def record_forward(self, unit: XlaFullyShardedDataParallel) -> None:
        if unit._is_root:
            self.forward_order.clear()
        self.forward_order.append(unit)

    def unit_before(self, unit: XlaFullyShardedDataParallel) -> Optional[XlaFullyShardedDataParallel]:
        """The unit whose forward started just before ``unit``'s: backward needs it next."""
        index = next((i for i, u in enumerate(self.forward_order) if u is unit), 0)
        return self.forward_order[index - 1] if index > 0 else None


class XlaFullyShardedDataParallel(nn.Module):
    """Shard a module's parameters across XLA replicas (a drop-in for torch_xla's class).

    Arguments keep torch_xla's names and defaults; ``FsdpOptions`` documents each. Build the
    optimizer after wrapping, on ``wrapped.parameters()`` (the shards), and step it with
    ``optimizer.step()``: gradients arrive already reduced and sharded.
    """

    def __init__(
        self,
        module: nn.Module,
        reshard_after_forward: bool = True,
        flatten_parameters: bool = False,
        execute_sharding_on_init: bool = True,
        optimization_barrier_in_forward: bool = True,
        optimization_barrier_in_backward: bool = True,
        sync_on_finalization: bool = False,
        disable_reshard_on_root: bool = True,
        compute_dtype: Optional[torch.dtype] = None,
        buffer_dtype: Optional[torch.dtype] = None,
        fp32_reduce_scatter: bool = False,
        sharding_groups: Optional[List[List[int]]] = None,
        sharding_rank: Optional[int] = None,
        sharding_world_size: Optional[int] = None,
        shard_param_on_dim_0: bool = False,
        pin_layout_in_collective_ops: bool = True,
        auto_wrap_policy: Optional[Callable[..., bool]] = None,
        auto_wrapper_callable: Optional[Callable[..., nn.Module]] = None,
        backward_prefetch: bool = False,
        _shard_size_multiple: Optional[int] = None,
        _use_xla_patched_linear: bool = True,
    ) -> None:
        _check_wrappable(module)
        # Auto-wrapped units get the same arguments (torch_xla's names), hence the same options.
        unit_kwargs = dict(
            reshard_after_forward=reshard_after_forward,
            flatten_parameters=flatten_parameters,
            execute_sharding_on_init=execute_sharding_on_init,
            optimization_barrier_in_forward=optimization_barrier_in_forward,
            optimization_barrier_in_backward=optimization_barrier_in_backward,
            sync_on_finalization=sync_on_finalization,
            disable_reshard_on_root=disable_reshard_on_root,
            compute_dtype=compute_dtype,
            buffer_dtype=buffer_dtype,
            fp32_reduce_scatter=fp32_reduce_scatter,
            sharding_groups=sharding_groups,
            sharding_rank=sharding_rank,
            sharding_world_size=sharding_world_size,
            shard_param_on_dim_0=shard_param_on_dim_0,
            pin_layout_in_collective_ops=pin_layout_in_collective_ops,
            backward_prefetch=backward_prefetch,
            _shard_size_multiple=_shard_size_multiple,
            _use_xla_patched_linear=_use_xla_patched_linear,
        )
        options = make_options(**unit_kwargs)
        super().__init__()
        if auto_wrapper_callable is not None and auto_wrap_policy is None:
            raise ValueError("auto_wrapper_callable needs an auto_wrap_policy to say which modules to wrap")
        if auto_wrap_policy is not None:
            _check_not_wrapped_inside(module)
            wrapper = auto_wrapper_callable or XlaFullyShardedDataParallel
            recursive_wrap(module, resolve_policy(auto_wrap_policy, module), wrapper, unit_kwargs)
        self._init_unit(module, options)

    # -- construction -----------------------------------------------------------------------

    def _init_unit(self, module: nn.Module, options: FsdpOptions) -> None:
        self.options = options
        self.sharding = options.sharding
        self.training_state = TrainingState.IDLE
        self._root_state: Optional[_RootState] = None
        self._is_root: Optional[bool] = None
        if options.use_patched_linear:
            patch_linear_modules(module)
        self._fsdp_wrapped_module = module
        _WRAPPED_MODULES.add(module)
        device = _xla.device()
        owned = _owned_parameters(module)
        _check_devices(module, owned, device)
        self._groups = self._build_groups(owned, device)
        for group in self._groups:
            self.register_parameter(group.spec.shard_name, group.shard)
            for param in group.full_params:
                if param.requires_grad:
                    param.register_post_accumulate_grad_hook(self._make_grad_hook(group))
        self._buffer_orig_dtypes = _move_buffers(module, device, options.buffer_dtype)
        if options.execute_sharding_on_init:
            _xla.sync()

    def _build_groups(self, owned: _OwnedParams, device: torch.device) -> List[ShardedParamGroup]:
        full = {id(p): _full_param_for(p, owners, device) for p, owners in owned}
        named = [(full[id(p)], p, owners[0][2]) for p, owners in owned]
        if not self.options.flatten_parameters:
            return [self._make_group([entry], None, device) for entry in named]
        trainable = [e for e in named if e[1].requires_grad]
        frozen = [e for e in named if not e[1].requires_grad]
        parts = [part for part in (trainable, frozen) if part]
        return [self._make_group(part, i, device) for i, part in enumerate(parts)]

    def _make_group(
        self, entries: List[Tuple[nn.Parameter, nn.Parameter, str]], flat_index: Optional[int], device: torch.device
    ) -> ShardedParamGroup:
        """A group of (full parameter, original parameter, name) entries; flat if ``flat_index``."""
        slots, offset = [], 0
        for full, orig, name in entries:
            slots.append(ParamSlot(full, name, orig.shape, offset))
            offset += orig.numel()
        if flat_index is None:
            full, orig, name = entries[0]
            orig_name = f"{WRAPPED_MODULE}.{name}"
            spec = ShardSpec(
                shard_param_name(orig_name), orig_name, orig.shape,
                dim0=self.options.shard_param_on_dim_0 and orig.dim() > 0,
            )
        else:
            _check_same_dtype(entries)
            orig_name = f"{WRAPPED_MODULE}.flat_param_{flat_index}"
            spec = ShardSpec(
                shard_param_name(orig_name), orig_name, torch.Size([offset]), dim0=False,
                flat_names=tuple(name for _, _, name in entries),
                flat_shapes=tuple(orig.shape for _, orig, _ in entries),
            )
        return ShardedParamGroup(
            slots, [orig.detach() for _, orig, _ in entries], spec, self.options, self.sharding,
            device, requires_grad=entries[0][1].requires_grad,
        )

    # -- forward ----------------------------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._fsdp_wrapped_module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        state = self._lazy_init()
        self.training_state = TrainingState.FORWARD
        if self.options.compute_dtype != torch.float32:
            args, kwargs = tree_map(self._cast_input, (args, kwargs))
        inputs = _tensors_in((args, kwargs))
        barrier = self.options.optimization_barrier_in_forward
        if torch.is_grad_enabled() and not in_recompute():
            state.record_forward(self)
        self._gather(inputs if barrier else None)
        outputs = self.module(*args, **kwargs)
        if self._frees_after_forward():
            self._free(_tensors_in(outputs) if barrier else None)
        if torch.is_grad_enabled():
            self._hook_output_grads(outputs, state)
            if self.options.optimization_barrier_in_backward:
                self._hook_input_grads(inputs, state)
        self.training_state = TrainingState.IDLE
        return outputs

    def _cast_input(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor) and torch.is_floating_point(x):
            return x.to(self.options.compute_dtype)
        return x

    def _frees_after_forward(self) -> bool:
        if not torch.is_grad_enabled():
            return True  # nothing will need the parameters for backward
        if in_recompute():
            return False  # the backward of this recomputation follows at once
        if self._is_root and self.options.disable_reshard_on_root:
            return False
        return self.options.reshard_after_forward

    def _lazy_init(self) -> _RootState:
        if self._root_state is None:
            units = [m for m in self.modules() if isinstance(m, XlaFullyShardedDataParallel)]
            state = _RootState(units)
            for unit in units:
                unit._root_state = state
                unit._is_root = unit is self
        return self._root_state

    def _gather(self, deps: Optional[List[torch.Tensor]]) -> None:
        """Gather every group of this unit; with ``deps``, not before those are computed."""
        if all(g.gathered for g in self._groups):
            return
        if deps is not None:
            _xla.optimization_barrier_(self._shards() + deps)
            deps = _xla.combined_dependencies(deps)  # built once, not once per group
        for group in self._groups:
            group.gather(deps)

    def _free(self, deps: Optional[List[torch.Tensor]]) -> None:
        for group in self._groups:
            group.free()
        if deps is not None:
            _xla.optimization_barrier_(self._shards() + deps)

    def _shards(self) -> List[torch.Tensor]:
        return [g.shard for g in self._groups]

    # -- backward ---------------------------------------------------------------------------

    def _hook_output_grads(self, outputs: Any, state: _RootState) -> None:
        for t in _tensors_in(outputs):
            if t.requires_grad:
                t.register_hook(self._pre_backward_hook)

    def _hook_input_grads(self, inputs: List[torch.Tensor], state: _RootState) -> None:
        def collect(grad: torch.Tensor) -> torch.Tensor:
            state.backward_deps.append(grad)
            _xla.optimization_barrier_([grad])
            return grad.view(grad.size())  # a view of the barrier's output

        for t in inputs:
            if t.requires_grad:
                t.register_hook(collect)

    def _pre_backward_hook(self, grad: torch.Tensor) -> torch.Tensor:
        state = self._root_state
        self._queue_finalize(state)
        barrier = self.options.optimization_barrier_in_backward
        if barrier:
            state.backward_deps.append(grad)
        if not all(g.gathered for g in self._groups):
            self._gather(state.backward_deps if barrier else None)
            state.backward_deps.clear()
        if self.options.backward_prefetch:
            self._prefetch_next(state, grad if barrier else None)
        if self.training_state in (TrainingState.IDLE, TrainingState.FORWARD):
            self.training_state = TrainingState.BACKWARD_PRE
        if barrier:
            _xla.optimization_barrier_([grad])
            return grad.view(grad.size())
        return grad

    def _prefetch_next(self, state: _RootState, dep: Optional[torch.Tensor]) -> None:
        """Gather, now, the unit backward will need after this one (PyTorch's BACKWARD_PRE)."""
        nxt = state.unit_before(self)
        if nxt is not None and nxt.training_state is TrainingState.IDLE:
            nxt._gather([dep] if dep is not None else None)

    def _queue_finalize(self, state: _RootState) -> None:
        if not state.finalize_queued:
            state.finalize_queued = True
            root = next(u for u in state.units if u._is_root)
            torch.autograd.Variable._execution_engine.queue_callback(root._finalize_backward)

    def _make_grad_hook(self, group: ShardedParamGroup) -> Callable[[torch.Tensor], None]:
        def on_grad_accumulated(param: torch.Tensor) -> None:
            self.training_state = TrainingState.BACKWARD_POST
            if group.note_grad_ready():
                self._reduce_group(group)

        return on_grad_accumulated

    def _reduce_group(self, group: ShardedParamGroup) -> None:
        barrier = self.options.optimization_barrier_in_backward
        grads = [p.grad for p in group.full_params if p.grad is not None]
        group.free()
        if barrier:
            _xla.optimization_barrier_([group.shard] + grads)
        reduced = group.reduce_grads(barrier)
        if barrier and reduced is not None:
            self._root_state.backward_deps.append(reduced)

    @torch.no_grad()
    def _finalize_backward(self) -> None:
        """After the whole backward (root only): reduce what is left, free everything, reset."""
        state = self._root_state
        for unit in state.units:
            for group in unit._groups:
                if group.has_pending_grads:
                    unit._reduce_group(group)
                group.free()
            unit.training_state = TrainingState.IDLE
        if self.options.optimization_barrier_in_backward:
            shards = [p for p in self.parameters() if p.grad is not None]
            _xla.optimization_barrier_(shards + [p.grad for p in shards] + state.backward_deps)
        state.backward_deps.clear()
        state.finalize_queued = False
        if self.options.sync_on_finalization:
            _xla.sync()

    # -- whole-model operations -------------------------------------------------------------

    def _units(self) -> List[Tuple[str, XlaFullyShardedDataParallel]]:
        return [(n, m) for n, m in self.named_modules() if isinstance(m, XlaFullyShardedDataParallel)]

    @torch.no_grad()
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, groups: Optional[List[List[int]]] = None
    ) -> torch.Tensor:
        """Scale all shards' gradients so that the norm of the whole gradient is at most ``max_norm``.

        The norm is that of all gradients of all replicas' shards together (as
        ``torch.nn.utils.clip_grad_norm_`` would compute on the unsharded model). Call it on every
        replica, on the root. Returns the total norm before clipping.
        """
        if not self._is_root_or_unused():
            raise RuntimeError("clip_grad_norm_ applies to the whole model: call it on the root wrapper")
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        norm_type = float(norm_type)
        dev = _xla.device()
        if norm_type == float("inf"):
            local = torch.stack([g.abs().max() for g in grads]).max() if grads else torch.zeros((), device=dev)
            total = _xla.all_reduce(local.float(), "max", groups, self.options.pin_layout_in_collective_ops)
        else:
            powers = [g.float().abs().pow(norm_type).sum() for g in grads]
            local = torch.stack(powers).sum() if powers else torch.zeros((), device=dev)
            summed = _xla.all_reduce(local, "sum", groups, self.options.pin_layout_in_collective_ops)
            total = summed.pow(1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return total

    def _is_root_or_unused(self) -> bool:
        return self._is_root is not False

    @contextmanager
    def summon_full_params(self) -> Iterator[None]:
        """Gather every unit's full parameters for the duration of the block (no gradients).

        Inside, the wrapped modules hold their full parameters, e.g. for evaluation or export.
        Changes made to them are not written back to the shards. Enter on every replica.
        """
        units = [u for _, u in self._units()]
        with torch.no_grad():
            for unit in units:
                unit._gather(None)
            try:
                yield
            finally:
                for unit in units:
                    unit._free(None)

    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """The unsharded state dict of the original module, on the CPU, under its own names.

        Every replica must call it (it gathers); each gets the same dict.
        """
        with self.summon_full_params():
            _xla.sync()  # one program gathers every unit; the copies below only transfer
            state: Dict[str, torch.Tensor] = {}
            for prefix, unit in self._units():
                for group in unit._groups:
                    for slot in group.slots:
                        name = _original_name(_join(prefix, WRAPPED_MODULE, slot.name))
                        state[name] = slot.param.detach().cpu().to(group.shard.dtype)
        for name, buf in self.named_buffers():
            orig = self._buffer_dtype_of(name)
            state[_original_name(name)] = buf.detach().cpu().to(orig or buf.dtype)
        return state

    def _buffer_dtype_of(self, name: str) -> Optional[torch.dtype]:
        for prefix, unit in self._units():
            local = name[len(prefix) + 1 :] if prefix else name
            if (not prefix or name.startswith(prefix + ".")) and local in unit._buffer_orig_dtypes:
                return unit._buffer_orig_dtypes[local]
        return None

    def get_shard_metadata(self) -> Dict[str, Any]:
        """What it takes to reassemble (or reshard) this replica's ``state_dict()``.

        The same form as torch_xla's, so its ``consolidate_sharded_model_checkpoints`` reads
        checkpoints of ``{"model": state_dict(), "shard_metadata": get_shard_metadata()}``;
        ``sharding`` adds each unit's group, for loading on a different number of replicas.
        """
        shard_info, flatten_info, sharding = {}, {}, {}
        for prefix, unit in self._units():
            shard_info[prefix] = {
                g.spec.shard_name: {"_orig_size": g.spec.orig_size, "_orig_name": g.spec.orig_name}
                for g in unit._groups
            }
            sharding[prefix] = {
                "world_size": unit.sharding.world_size,
                "rank": unit.sharding.rank,
                "groups": unit.sharding.groups,
                "shard_param_on_dim_0": unit.options.shard_param_on_dim_0,
            }
            for g in unit._groups:
                if g.spec.flat_names is not None:
                    flatten_info[_join(prefix, g.spec.orig_name)] = (
                        list(g.spec.flat_names),
                        list(g.spec.flat_shapes),
                        [s.numel() for s in g.spec.flat_shapes],
                    )
        buffer_info = {
            name: {"_orig_dtype": dtype}
            for name, _ in self.named_buffers()
            if (dtype := self._buffer_dtype_of(name)) is not None
        }
        return {
            "shard_info": shard_info,
            "flatten_info": flatten_info,
            "buffer_info": buffer_info,
            "world_size": self.sharding.world_size,
            "rank": self.sharding.rank,
            "sharding": sharding,
        }

    # -- nn.Module plumbing -----------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        """Attributes the wrapper lacks come from the wrapped module (as torch_xla's does)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == WRAPPED_MODULE:
                raise
            return getattr(self._fsdp_wrapped_module, name)

    def __getitem__(self, key: int) -> nn.Module:
        return self.module.__getitem__(key)

    def extra_repr(self) -> str:
        s = self.sharding
        layout = "flat" if self.options.flatten_parameters else ("dim0" if self.options.shard_param_on_dim_0 else "per-parameter")
        return f"rank={s.rank}, world_size={s.world_size}, groups={len(self._groups)} ({layout}), compute_dtype={self.options.compute_dtype}"


# ---------------------------------------------------------------------------------------------
# Construction helpers

_OwnedParams = List[Tuple[nn.Parameter, List[Tuple[nn.Module, str, str]]]]


def _check_wrappable(module: nn.Module) -> None:
    if isinstance(module, XlaFullyShardedDataParallel):
        raise ValueError(
            "this module is already an XlaFullyShardedDataParallel; wrap each module once "
            "(for nesting, wrap the inner modules first, then their parent)"
        )
    if module in _WRAPPED_MODULES:
        raise ValueError(
            f"this {type(module).__name__} is already wrapped by another XlaFullyShardedDataParallel; "
            "wrap each module once and use the wrapper"
        )
    if type(module).forward is nn.Module.forward and "forward" not in module.__dict__:
        raise ValueError(
            f"{type(module).__name__} has no forward: wrap a module that is called (not an "
            "nn.ModuleList or nn.ModuleDict), or wrap its members"
        )


def _check_not_wrapped_inside(module: nn.Module) -> None:
    for name, m in module.named_modules():
        if isinstance(m, XlaFullyShardedDataParallel):
            raise ValueError(
                f"'{name}' is already wrapped; with auto_wrap_policy pass the unwrapped model "
                "(or wrap by hand, inner modules first, without a policy)"
            )


def _modules_outside_units(root: nn.Module, prefix: str = "") -> Iterator[Tuple[str, nn.Module]]:
    """``root`` and its submodules, except those inside (inner) FSDP units."""
    yield prefix, root
    for name, child in root.named_children():
        if not isinstance(child, XlaFullyShardedDataParallel):
            yield from _modules_outside_units(child, f"{prefix}{name}.")


def _owned_parameters(module: nn.Module) -> _OwnedParams:
    """The parameters this unit owns, each with every (module, attribute, name) that holds it."""
    found: Dict[int, Tuple[nn.Parameter, List[Tuple[nn.Module, str, str]]]] = {}
    for prefix, m in _modules_outside_units(module):
        for attr, p in m._parameters.items():
            if p is None:
                continue
            owner = _MANAGED_PARAMS.name_of(p)
            if owner is not None:
                raise ValueError(
                    f"parameter '{prefix}{attr}' is also used by '{owner}', which "
                    "another wrapper owns. A shared (tied) parameter must be used within one unit: "
                    "wrap the modules that share it together, or leave them to the outer wrapper."
                )
            found.setdefault(id(p), (p, []))[1].append((m, attr, f"{prefix}{attr}"))
    return list(found.values())


def _check_devices(module: nn.Module, owned: _OwnedParams, device: torch.device) -> None:
    seen: Dict[str, str] = {}
    buffers = [(f"{prefix}{n}", b) for prefix, m in _modules_outside_units(module) for n, b in m._buffers.items() if b is not None]
    tensors = [(owners[0][2], p) for p, owners in owned] + buffers
    for name, t in tensors:
        seen.setdefault(str(t.device), name)
    if len(seen) > 1:
        listing = ", ".join(f"'{n}' on {d}" for d, n in seen.items())
        raise ValueError(
            f"parameters and buffers are on different devices ({listing}); move the whole "
            "module to one device (the CPU, or this replica's XLA device) before wrapping"
        )
    for dev, name in seen.items():
        if dev.startswith("xla") and torch.device(dev) != device:
            raise ValueError(
                f"'{name}' is on {dev}, but this replica's device is {device}: build the model on "
                "the CPU, or move it to this replica's device, before wrapping"
            )
    for p, owners in owned:
        if not torch.is_floating_point(p):
            raise ValueError(f"parameter '{owners[0][2]}' has dtype {p.dtype}; only floating-point parameters can be sharded")


def _check_same_dtype(entries: Sequence[Tuple[nn.Parameter, nn.Parameter, str]]) -> None:
    dtypes = {orig.dtype: name for _, orig, name in entries}
    if len(dtypes) > 1:
        listing = ", ".join(f"'{n}' is {d}" for d, n in dtypes.items())
        raise ValueError(
            f"flatten_parameters=True needs one dtype per unit, but {listing}; cast the module to "
            "one dtype or use flatten_parameters=False"
        )


def _full_param_for(
    orig: nn.Parameter, owners: List[Tuple[nn.Module, str, str]], device: torch.device
) -> nn.Parameter:
    """The full parameter the modules will use: ``orig`` itself if already on this replica's
    device, else a new XLA parameter. It replaces ``orig`` as a plain attribute of every owner."""
    if orig.device == device:
        full = orig
    else:
        full = nn.Parameter(torch.zeros(1, dtype=orig.dtype, device=device), requires_grad=orig.requires_grad)
    for m, attr, _ in owners:
        del m._parameters[attr]
        object.__setattr__(m, attr, full)
    _MANAGED_PARAMS.add(orig, owners[0][2])
    _MANAGED_PARAMS.add(full, owners[0][2])
    return full


def _move_buffers(module: nn.Module, device: torch.device, dtype: torch.dtype) -> Dict[str, torch.dtype]:
    """Move this unit's buffers to ``device``, floating ones cast to ``dtype``; returns the
    original dtypes of the cast ones, by name under the unit."""
    cast: Dict[str, torch.dtype] = {}
    for prefix, m in _modules_outside_units(module):
        for name, buf in list(m._buffers.items()):
            if buf is None:
                continue
            new = buf.to(device)
            if torch.is_floating_point(buf) and buf.dtype != dtype:
                new = new.to(dtype)
                cast[f"{WRAPPED_MODULE}.{prefix}{name}"] = buf.dtype
            m._buffers[name] = new
    return cast


def _tensors_in(tree: Any) -> List[torch.Tensor]:
    leaves, _ = tree_flatten(tree)
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _original_name(name: str) -> str:
    """A name under the root wrapper as the unwrapped module would have it."""
    return name.replace(f"{WRAPPED_MODULE}.", "")


def _optimizer_step_pre_hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = _MANAGED_PARAMS.name_of(p)
            if name is not None:
                raise ValueError(
                    f"this {type(optimizer).__name__} holds '{name}' of the unwrapped "
                    "model, which FSDP has replaced by shards; build the optimizer after wrapping, "
                    "from the wrapped model's parameters()"
                )


register_optimizer_step_pre_hook(_optimizer_step_pre_hook)
