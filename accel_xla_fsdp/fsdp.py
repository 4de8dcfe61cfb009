"""``XlaFullyShardedDataParallel``: the module wrapper and its user-facing methods.

One wrapper is one *unit*: it owns the parameters of its module that no inner unit owns, as
``ShardedParamGroup``s (param_group.py), built by construction.py. Its runtime state is a
``UnitState`` (unit_state.py, ``wrapper.unit_state``), whose methods are the forward and backward
hooks. The outermost wrapper is the *root*: when it is built it makes the ``RootState`` that holds
every unit with its name, which state dicts (state_dict.py), checkpoints and hooks read. Settings
are in options.py.
"""

from __future__ import annotations

import functools
import weakref
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from . import _xla
from .construction import (
    FlatShardKey,
    ParamInitFn,
    ShardSource,
    build_groups,
    check_no_meta_buffers,
    materialize_meta,
    move_buffers,
)
from .embedding import patch_embedding_modules
from .linear import patch_linear_modules
from .options import (
    CONSTRUCTION_ARGUMENTS,
    EXTENSION_ARGUMENTS,
    FsdpOptions,
    ShardingGroup,
    check_debug_arguments,
    options_help,
    sharing_options,
    wrapper_signature,
)
from .param_group import ShardedParamGroup
from .state_dict import WRAPPED_MODULE, full_state_dict, kept_here, model_state_dict, shard_metadata
from .unit_state import STATE_ATTRIBUTE, RootState, TrainingState, UnitState, holding_full_params, script_stepped
from .wrap import recursive_wrap, resolve_policy
from .xla_cpu.rendezvous import agree

_WRAPPED_MODULES: weakref.WeakSet[nn.Module] = weakref.WeakSet()


class XlaFullyShardedDataParallel(nn.Module):
    """Shard a module's parameters across XLA replicas (a drop-in for torch_xla's class).

    Takes torch_xla's arguments, names and defaults (``FsdpOptions`` documents each option), plus
    ``auto_wrap_policy`` / ``auto_wrapper_callable`` (wrap submodules as units of their own),
    ``param_init_fn`` (materialize parameters built on the meta device) and ``flat_shard_key``
    (ours: with ``flatten_parameters``, parameters whose keys differ, ``flat_shard_key(param)``,
    get separate flat shards, as trainable and frozen ones do; for instance one key per optimizer
    param group, whose hyper-parameters a shard cannot mix). Build the optimizer after
    wrapping, on ``wrapped.parameters()`` (the shards), and step it with ``optimizer.step()``:
    gradients arrive already reduced and sharded.
    """

    def __init__(self, module: nn.Module, *args: Any, **kwargs: Any) -> None:
        arguments = _bind_arguments(module, args, kwargs)
        check_debug_arguments(arguments)
        options = FsdpOptions.from_arguments(arguments)
        policy, wrapper_fn = arguments.get("auto_wrap_policy"), arguments.get("auto_wrapper_callable")
        param_init_fn: Optional[ParamInitFn] = arguments.get("param_init_fn")
        flat_shard_key: Optional[FlatShardKey] = arguments.get("flat_shard_key")
        source = param_init_fn if isinstance(param_init_fn, ShardSource) else None
        if source is not None:
            source.remember_names(module)  # the outermost wrapper sees the model's full names
        _check_wrappable(module)
        super().__init__()
        if wrapper_fn is not None and policy is None:
            raise ValueError("auto_wrapper_callable needs an auto_wrap_policy to say which modules to wrap")
        if policy is not None:
            _check_not_wrapped_inside(module)
            # Auto-wrapped units get the same arguments (torch_xla's names, as torch_xla passes them
            # to an auto_wrapper_callable), and share this options object when they arrive unchanged.
            unit_kwargs = dict(options.as_arguments(), param_init_fn=param_init_fn, flat_shard_key=flat_shard_key)
            with sharing_options(options):
                wrapper = wrapper_fn or XlaFullyShardedDataParallel
                recursive_wrap(module, resolve_policy(policy, module), wrapper, unit_kwargs)
        if source is None:
            materialize_meta(module, param_init_fn)
        else:
            check_no_meta_buffers(module)
        self._init_unit(module, options, source, flat_shard_key)

    # -- construction -----------------------------------------------------------------------

    def _init_unit(
        self,
        module: nn.Module,
        options: FsdpOptions,
        source: Optional[ShardSource],
        flat_shard_key: Optional[FlatShardKey],
    ) -> None:
        if options.use_xla_patched_linear:
            patch_linear_modules(module)
        patch_embedding_modules(module)
        self._fsdp_wrapped_module = module
        _WRAPPED_MODULES.add(module)
        device = _xla.device()
        sharding = ShardingGroup.for_replica(options)
        groups = build_groups(module, options, sharding, device, source, flat_shard_key)
        for group in groups:
            self.register_parameter(group.spec.shard_name, group.shard)
        buffer_orig_dtypes = move_buffers(module, device, options.buffer_dtype)
        state = UnitState(self, module, options, sharding, groups, buffer_orig_dtypes)
        setattr(self, STATE_ATTRIBUTE, state)
        state.install_hooks()
        module._register_state_dict_hook(functools.partial(_whole_model_state_dict, weakref.ref(self)))
        self._become_root()
        if options.execute_sharding_on_init:
            _xla.sync()

    def _become_root(self) -> None:
        """Make the root state of every unit inside this one, with their names; an outer wrapper
        built later takes over (units are built innermost first)."""
        named = []
        for name, module in self.named_modules():
            if isinstance(module, XlaFullyShardedDataParallel):
                named.append((name, module.unit_state))
            elif _holds_units(module):
                module.named_modules = functools.partial(_named_modules_as_unwrapped, module)
        RootState(named)

    # -- the unit's state, as torch_xla's wrapper shows it ----------------------------------

    @property
    def options(self) -> FsdpOptions:
        return self.unit_state.options

    @property
    def sharding(self) -> ShardingGroup:
        return self.unit_state.sharding

    @property
    def param_groups(self) -> List[ShardedParamGroup]:
        return self.unit_state.param_groups

    @property
    def training_state(self) -> TrainingState:
        return self.unit_state.training_state

    @property
    def is_root(self) -> bool:
        return self.unit_state.is_root

    # -- forward ----------------------------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._fsdp_wrapped_module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # The wrapped module's hooks gather and free (unit_state.py): a direct call of the wrapped
        # module, as generate() makes, gets the same treatment.
        if torch.is_inference_mode_enabled():
            # torch_xla 2.9 cannot run nn.Linear under inference_mode ("Cannot set
            # version_counter for inference tensor", unwrapped models too): run as no_grad.
            with torch.inference_mode(False), torch.no_grad():
                return self.module(*args, **kwargs)
        return self.module(*args, **kwargs)

    # -- whole-model operations -------------------------------------------------------------

    def _check_root(self, what: str) -> None:
        if not self.is_root:
            raise RuntimeError(f"{what} applies to the whole model: call it on the root wrapper (the outermost)")

    def apply_optimizer_in_backward(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer``'s update of each unit in backward, as soon as its gradients are
        reduced ([Note: the optimizer in backward]); the script's ``optimizer.step()`` after
        backward then steps only what was not. ``optimizer`` steps this model's shards (a
        ``torch.optim`` optimizer: it skips a parameter without a gradient). No gradient clipping."""
        self._check_root("apply_optimizer_in_backward")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"apply_optimizer_in_backward takes a torch.optim.Optimizer (the one a wrapper such as "
                f"Accelerate's holds as .optimizer), not {type(optimizer).__name__}"
            )
        state = self.unit_state.root_state
        state.optimizer_in_backward = optimizer
        optimizer.register_step_post_hook(lambda *_: script_stepped(state))

    @torch.no_grad()
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, groups: Optional[List[List[int]]] = None
    ) -> torch.Tensor:
        """Scale all shards' gradients so that the norm of the whole gradient is at most ``max_norm``.

        The norm is that of all gradients of all replicas' shards together (as
        ``torch.nn.utils.clip_grad_norm_`` would compute on the unsharded model). Call it on every
        replica, on the root. Returns the total norm before clipping.
        """
        self._check_root("clip_grad_norm_")
        if self.unit_state.root_state.optimizer_in_backward is not None:
            raise RuntimeError(
                "clip_grad_norm_: the optimizer steps in backward (apply_optimizer_in_backward, or the "
                "Accelerate plugin's xla_fsdp_optimizer_in_backward), each update made before the norm of all "
                "gradients is known. Turn it off to clip, or do not clip (the Trainer: max_grad_norm=0)"
            )
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

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside keep full gradients, accumulating, with no reduce-scatter.

        torch_xla's meaning: the first backward after the block reduce-scatters the sum of all
        accumulated gradients. Costs one full gradient per parameter held between steps; saves
        the reduce-scatters of every micro-step but the last. Enter on the root.
        """
        self._check_root("no_sync")
        root_state = self.unit_state.root_state
        previous = root_state.sync_gradients
        root_state.sync_gradients = False
        try:
            yield
        finally:
            root_state.sync_gradients = previous

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """PyTorch FSDP2's switch (Accelerate uses it for gradient accumulation): ``False`` is
        ``no_sync()`` until switched back. Applies to the whole model (``recurse`` is accepted
        for FSDP2's signature; a part of a model cannot skip its reduction alone here)."""
        self._check_root("set_requires_gradient_sync")
        self.unit_state.root_state.sync_gradients = bool(requires_gradient_sync)

    @contextmanager
    def summon_full_params(self, recurse: bool = True, writeback: bool = True) -> Iterator[None]:
        """Gather full parameters for the block, in the shards' dtype, without gradients.

        Inside, the wrapped modules hold their full parameters, e.g. for evaluation, export or
        editing. With ``writeback`` (PyTorch FSDP's default) what the block changed in them is
        copied back into the shards when it ends. ``recurse=False``: this unit only. Enter on
        every replica.
        """
        units = [u for _, u in self.unit_state.named_units()] if recurse else [self.unit_state]
        with holding_full_params(units, in_shard_dtype=True, writeback=writeback):
            yield

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's ``generate()``, with every unit's parameters gathered once for it.

        Generation reads tokens back to the host as it goes (stopping criteria), which runs
        programs outside any sync. Gathered per token, each of those programs would hold
        collectives, which XLA:CPU replicas reaching them out of step abort on (measured: 4
        devices, the 15-s rendezvous limit); gathered once, in one program cut before the token
        loop, they hold none, and the loop does not gather 2 x units times per token. Call it on
        every replica.
        """
        self._check_root("generate")
        units = [u for _, u in self.unit_state.named_units()]
        with holding_full_params(units, in_shard_dtype=False, writeback=False):
            _xla.sync()
            model: Any = self.module  # a transformers model: nn.Module's types know no generate()
            return model.generate(*args, **kwargs)

    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """The unsharded state dict of the original module, on the CPU, under its own names:
        each parameter once (a tied one under its first name), every buffer.

        Every replica must call it (it gathers); each gets the same dict.
        """
        return full_state_dict(self.unit_state)

    def model_state_dict(self) -> Dict[str, torch.Tensor]:
        """What the unwrapped module's ``state_dict()`` would hold, with full tensors on the CPU:
        tied weights under each name, persistent buffers only. Every replica must call it."""
        return model_state_dict(self.unit_state)

    def get_shard_metadata(self) -> Dict[str, Any]:
        """What it takes to reassemble (or reshard) this replica's ``state_dict()`` (torch_xla's form)."""
        return shard_metadata(self.unit_state)

    def tie_weights(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to do: weights tied before wrapping stay tied (one parameter, sharded in one
        unit). transformers' examples call ``model.tie_weights()`` after ``prepare()`` on XLA;
        passed on to the wrapped model, it looks for the tied names among flat shards and fails."""

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
        container: Any = self.module  # a container module (nn.Sequential, nn.ModuleList)
        return container[key]

    def extra_repr(self) -> str:
        s = self.sharding
        options = self.options
        layout = "dim0" if options.shard_param_on_dim_0 else "per-parameter"
        layout = "flat" if options.flatten_parameters else layout
        return (
            f"rank={s.rank}, world_size={s.world_size}, groups={len(self.param_groups)} ({layout}), "
            f"compute_dtype={options.compute_dtype}"
        )


XlaFullyShardedDataParallel.__init__.__signature__ = wrapper_signature()  # type: ignore[attr-defined]


def _holds_units(module: nn.Module) -> bool:
    return any(isinstance(m, XlaFullyShardedDataParallel) for m in module.modules())


def _named_modules_as_unwrapped(
    module: nn.Module, memo: Optional[set] = None, prefix: str = "", remove_duplicate: bool = True
) -> Iterator[Tuple[str, nn.Module]]:
    """``named_modules()`` of a module with units inside, asked of it directly: the names the
    model had before wrapping (a unit and the module it wraps share one). peft matches the
    names of the unwrapped model's modules against its ``state_dict()`` keys (to pick an
    adapter's weights when saving), which have no ``_fsdp_wrapped_module`` either; a path with
    those names still resolves, as a unit passes attributes on to its module. Within an outer
    module's walk (``memo`` given) the names stay the walk's own."""
    named = nn.Module.named_modules(module, memo, prefix, remove_duplicate)
    if memo is not None:
        return named
    return ((".".join(part for part in name.split(".") if part != WRAPPED_MODULE), m) for name, m in named)


# The rendezvous every replica enters to gather the whole model for its module's state_dict().
WHOLE_MODEL_STATE_DICT = "state_dict() of the whole model (unwrap_model(model).state_dict(), save_pretrained)"


def _whole_model_state_dict(
    unit_ref: "weakref.ref[XlaFullyShardedDataParallel]", module: nn.Module, state: Dict[str, Any], prefix: str, _: Any
) -> Optional[Dict[str, torch.Tensor]]:
    """``state_dict()`` of the module a root unit wraps, asked of that module itself (as
    ``unwrap_model(model).save_pretrained(dir)`` does): the whole model, gathered, instead of
    freed full parameters (outside forward they hold no data) and the inner units' shards.
    The wrapper's own ``state_dict()`` (this replica's shards, for checkpoints) reaches the module
    under a prefix and is left alone. Inside a save only the writing replica keeps it
    (``kept_on_this_replica``)."""
    unit = unit_ref()
    if prefix or unit is None or not unit.is_root:
        return None
    agree(WHOLE_MODEL_STATE_DICT)
    return model_state_dict(unit.unit_state, kept_here())


def _bind_arguments(module: nn.Module, args: Sequence[Any], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """torch_xla's arguments by name, positional ones included; an unknown name is refused."""
    try:
        bound = wrapper_signature().bind(None, module, *args, **kwargs)
    except TypeError as e:
        raise TypeError(
            f"XlaFullyShardedDataParallel: {e}. Its options are {', '.join(options_help())}, and "
            f"{', '.join(name for name, _ in CONSTRUCTION_ARGUMENTS + EXTENSION_ARGUMENTS)}."
        ) from None
    return dict(bound.arguments)


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
