"""Building a unit: which parameters it owns, their checks, its parameter groups and buffers.

What FSDP2 keeps in ``_fsdp_init.py``: the wrapper (fsdp.py) calls these once per unit, before it
makes the unit's ``UnitState`` (unit_state.py). Also the registry of every parameter a unit
manages or replaced, which catches an optimizer built before wrapping ([Note: the optimizer
check]) and a parameter claimed by two units.
"""

from __future__ import annotations

import weakref
from typing import (
    Any,
    Callable,
    Dict,
    Hashable,
    Iterator,
    List,
    Optional,
    Protocol,
    Sequence,
    Tuple,
    runtime_checkable,
)

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from . import _xla, host_memory
from .options import FsdpOptions, ShardingGroup
from .param_group import ParamSlot, ShardedParamGroup, ShardSpec, shard_param_name
from .state_dict import WRAPPED_MODULE
from .unit_state import is_unit


class _ParamRegistry:
    """Every full parameter a unit manages, and every parameter a unit replaced, with its name:
    to catch an optimizer built before wrapping, and a parameter claimed by two units.

    Keyed by identity: weak containers compare their keys with ``==``, elementwise for tensors.
    """

    def __init__(self) -> None:
        self._names: Dict[int, Tuple[weakref.ref[nn.Parameter], str]] = {}
        self.generation = 0  # counts additions: an optimizer checked before one is checked again

    def add(self, param: nn.Parameter, name: str) -> None:
        self.generation += 1
        key = id(param)
        self._names[key] = (weakref.ref(param), name)
        weakref.finalize(param, self._names.pop, key, None)

    def name_of(self, param: torch.Tensor) -> Optional[str]:
        entry = self._names.get(id(param))
        return entry[1] if entry is not None and entry[0]() is param else None


_MANAGED_PARAMS = _ParamRegistry()

ParamInitFn = Callable[[nn.Module], None]
FlatShardKey = Callable[[nn.Parameter], Hashable]


@runtime_checkable
class ShardSource(Protocol):
    """A ``param_init_fn`` that fills each replica's shards itself, reading only their slices
    (``accel_xla_fsdp.pretrained_weights``), instead of materializing whole modules."""

    def remember_names(self, model: nn.Module) -> None:
        """Called by the outermost wrapper before any wrapping, with the model as built."""

    def read(self, param: nn.Parameter, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of ``param`` (as built, possibly on meta) flattened."""


class PlaceholderShards:
    """A ``ShardSource`` for a step that is traced and exported, never run (``accel-xla-fsdp
    plan``): every shard is a placeholder that holds no buffer (``_xla.placeholder``), so no part
    of the model is ever in memory, whatever its size."""

    def remember_names(self, model: nn.Module) -> None:
        pass

    def read(self, param: nn.Parameter, start: int, stop: int) -> torch.Tensor:
        raise RuntimeError("PlaceholderShards has no values: its shards are placeholders, made whole")


def materialize_meta(module: nn.Module, param_init_fn: Optional[ParamInitFn]) -> None:
    """Give real tensors to this unit's parameters and buffers that are on the meta device.

    ``param_init_fn(submodule)`` is called for each submodule outside inner units that holds
    meta tensors itself (as PyTorch FSDP does); without one, the submodule is made on the CPU with
    ``to_empty`` and its ``reset_parameters()`` (torch_xla's default, per submodule).
    """
    for prefix, m in _modules_outside_units(module):
        if not _has_meta_tensors(m):
            continue
        reset_parameters = getattr(m, "reset_parameters", None)
        if param_init_fn is not None:
            param_init_fn(m)
        elif callable(reset_parameters):
            m.to_empty(device="cpu", recurse=False)
            reset_parameters()
        else:
            raise ValueError(
                f"'{prefix or type(module).__name__}' ({type(m).__name__}) has tensors on the meta device "
                "and no reset_parameters() to initialize them: pass param_init_fn (for instance one "
                "that loads pretrained weights), or build the module on the CPU"
            )
    for prefix, m in _modules_outside_units(module):
        if _has_meta_tensors(m):
            name = next(n for n, t in _direct_tensors(m) if t.is_meta)
            raise ValueError(f"param_init_fn left '{prefix}{name}' on the meta device: it must materialize it")


def check_no_meta_buffers(module: nn.Module) -> None:
    for prefix, m in _modules_outside_units(module):
        for name, buf in m._buffers.items():
            if buf is not None and buf.is_meta:
                raise ValueError(
                    f"buffer '{prefix}{name}' is on the meta device, and pretrained weights hold no buffers: "
                    "build the model with accelerate.init_empty_weights(), which keeps buffers real"
                )


def _direct_tensors(m: nn.Module) -> List[Tuple[str, torch.Tensor]]:
    return [(n, t) for n, t in list(m._parameters.items()) + list(m._buffers.items()) if t is not None]


def _has_meta_tensors(m: nn.Module) -> bool:
    return any(t.is_meta for _, t in _direct_tensors(m))


_OwnedParams = List[Tuple[nn.Parameter, List[Tuple[nn.Module, str, str]]]]
_Entry = Tuple[nn.Parameter, nn.Parameter, str]  # full parameter, original parameter, name


def _flat_parts(named: List[_Entry], key: Optional[FlatShardKey]) -> List[List[_Entry]]:
    """A unit's parameters split into the parts flattened together: trainable ones before frozen
    ones, and within each, apart by ``key`` (in order of first appearance)."""
    parts: Dict[Tuple[bool, Hashable], List[_Entry]] = {}
    for entry in named:
        orig = entry[1]
        parts.setdefault((not orig.requires_grad, key(orig) if key is not None else None), []).append(entry)
    return [part for _, part in sorted(parts.items(), key=lambda item: item[0][0])]  # stable: trainable first


def _modules_outside_units(root: nn.Module, prefix: str = "") -> Iterator[Tuple[str, nn.Module]]:
    """``root`` and its submodules, except those inside (inner) FSDP units."""
    yield prefix, root
    for name, child in root.named_children():
        if not is_unit(child):
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
    buffers = [
        (f"{prefix}{n}", b)
        for prefix, m in _modules_outside_units(module)
        for n, b in m._buffers.items()
        if b is not None
    ]
    tensors = [(owners[0][2], p) for p, owners in owned] + buffers
    for name, t in tensors:
        if not t.is_meta:  # filled by a param_init_fn that reads shards (ShardSource)
            seen.setdefault(str(t.device), name)
    if len(seen) > 1:
        listing = ", ".join(f"'{n}' on {d}" for d, n in seen.items())
        raise ValueError(
            f"parameters and buffers are on different devices ({listing}); move the whole "
            "module to one device (the CPU, or this replica's XLA device) before wrapping"
        )
    for dev, name in seen.items():
        if _xla.is_xla_device(torch.device(dev)) and torch.device(dev) != device:
            raise ValueError(
                f"'{name}' is on {dev}, but this replica's device is {device}: build the model on "
                "the CPU, or move it to this replica's device, before wrapping"
            )
    for p, owners in owned:
        if not torch.is_floating_point(p):
            raise ValueError(
                f"parameter '{owners[0][2]}' has dtype {p.dtype}; only floating-point parameters can be sharded"
            )


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


def move_buffers(module: nn.Module, device: torch.device, dtype: torch.dtype) -> Dict[str, torch.dtype]:
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


# [Note: the optimizer check]
# An optimizer built before wrapping holds the parameters the units replaced: its steps would do
# nothing (those never get a gradient again), silently. No per-optimizer hook can catch it: such
# an optimizer holds none of our shards, and nothing of ours ever sees it. So a step pre-hook on
# every optimizer is registered, but only once a unit has been built (importing the package
# registers nothing), and an optimizer is scanned only when its param groups are new to it (its
# first step, after ``add_param_group`` or Accelerate's ``prepare`` replaced a group's list, or
# after more parameters were replaced by units): a step of an optimizer already checked costs one
# comparison per param group.
_Layout = Tuple[int, Tuple[Tuple[int, int], ...]]  # the registry's generation, each group's list and length
_checked_layouts: "weakref.WeakKeyDictionary[torch.optim.Optimizer, _Layout]" = weakref.WeakKeyDictionary()
_optimizer_check: Optional[RemovableHandle] = None


def _watch_optimizers() -> None:
    """Register the optimizer check, once, when the first unit is built (see the note above)."""
    global _optimizer_check
    if _optimizer_check is None:
        _optimizer_check = register_optimizer_step_pre_hook(_check_optimizer)


def _check_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    groups = tuple((id(group["params"]), len(group["params"])) for group in optimizer.param_groups)
    layout = (_MANAGED_PARAMS.generation, groups)
    if _checked_layouts.get(optimizer) == layout:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = _MANAGED_PARAMS.name_of(p)
            if name is not None:
                raise ValueError(
                    f"this {type(optimizer).__name__} holds '{name}' of the unwrapped "
                    "model, which FSDP has replaced by shards; build the optimizer after wrapping, "
                    "from the wrapped model's parameters()"
                )
    _checked_layouts[optimizer] = layout


def build_groups(
    module: nn.Module,
    options: FsdpOptions,
    sharding: ShardingGroup,
    device: torch.device,
    source: Optional[ShardSource],
    flat_shard_key: Optional[FlatShardKey],
) -> List[ShardedParamGroup]:
    """The parameter groups of the unit wrapping ``module``: the parameters no inner unit owns,
    checked, replaced in their modules by full parameters on ``device``, and sharded (read from
    ``source`` if given)."""
    owned = _owned_parameters(module)
    _check_devices(module, owned, device)
    _watch_optimizers()
    full = {id(p): _full_param_for(p, owners, device) for p, owners in owned}
    named = [(full[id(p)], p, owners[0][2]) for p, owners in owned]
    aliases = {id(full[id(p)]): tuple(o[2] for o in owners[1:]) for p, owners in owned}
    if not options.flatten_parameters:
        groups = [_make_group([entry], None, options, sharding, device) for entry in named]
    else:
        parts = _flat_parts(named, flat_shard_key)
        groups = [_make_group(part, i, options, sharding, device) for i, part in enumerate(parts)]
    for group in groups:
        for slot in group.slots:
            slot.aliases = aliases[id(slot.param)]
    if isinstance(source, PlaceholderShards):
        for group in groups:
            group.shard.data = _xla.placeholder(group.shard.shape, group.shard.dtype)
    elif source is not None:
        orig_of = {id(full): orig for full, orig, _ in named}
        for group in groups:
            with host_memory.STAGING:
                local = group.local_values(lambda slot, a, b: source.read(orig_of[id(slot.param)], a, b))
                group.shard.data = local.to(device)
                host_memory.give_back()
    return groups


def _make_group(
    entries: List[_Entry],
    flat_index: Optional[int],
    options: FsdpOptions,
    sharding: ShardingGroup,
    device: torch.device,
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
            shard_param_name(orig_name),
            orig_name,
            orig.shape,
            dim0=options.shard_param_on_dim_0 and orig.dim() > 0,
        )
    else:
        _check_same_dtype(entries)
        orig_name = f"{WRAPPED_MODULE}.flat_param_{flat_index}"
        spec = ShardSpec(
            shard_param_name(orig_name),
            orig_name,
            torch.Size([offset]),
            dim0=False,
            flat_names=tuple(name for _, _, name in entries),
            flat_shapes=tuple(orig.shape for _, orig, _ in entries),
        )
    return ShardedParamGroup(
        slots,
        [orig.detach() for _, orig, _ in entries],
        spec,
        options,
        sharding,
        device,
        requires_grad=entries[0][1].requires_grad,
    )
