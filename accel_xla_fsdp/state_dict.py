"""State dicts of a wrapped model: the full one, and the metadata that puts shards back together.

Names: under the root wrapper every unit's module sits at ``..._fsdp_wrapped_module``; the full
state dict uses the names the unwrapped model has (``original_name``). The local state dict is
``nn.Module.state_dict()`` of the root: this replica's shards and the buffers. Every function
takes a unit's ``UnitState`` and reads the units inside it, with their names, from the root's
state (``UnitState.named_units``).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from . import _xla
from .unit_state import UnitState, holding_full_params

WRAPPED_MODULE = "_fsdp_wrapped_module"


def join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def original_name(name: str) -> str:
    """A name under the root wrapper as the unwrapped module would have it."""
    return name.replace(f"{WRAPPED_MODULE}.", "")


def full_name(prefix: str, name: str) -> str:
    """The name in the unwrapped model of parameter ``name`` of the unit at ``prefix``."""
    return original_name(join(prefix, WRAPPED_MODULE, name))


def shards_by_name(root: UnitState) -> Dict[str, torch.nn.Parameter]:
    """Each parameter's name in the unwrapped model (tied names too) -> the shard holding it."""
    shards = {}
    for prefix, unit in root.named_units():
        for group in unit.param_groups:
            for slot in group.slots:
                for name in (slot.name, *slot.aliases):
                    shards[full_name(prefix, name)] = group.shard
    return shards


def full_state_dict(root: UnitState) -> Dict[str, torch.Tensor]:
    """The unsharded state dict of the original module, on the CPU, under its own names: each
    parameter once (a tied one under its first name), every buffer.

    Every replica must call it (it gathers); each gets the same dict. Parameters come back in
    their shards' dtype (float32 master weights under bf16 compute), buffers in their original one.
    """
    state = {names[0]: value for names, value in _gathered_params(root)}
    for name, buf in root.wrapper.named_buffers():
        state[original_name(name)] = _buffer_on_host(root, name, buf)
    return state


def model_state_dict(root: UnitState) -> Dict[str, torch.Tensor]:
    """What ``state_dict()`` of the unwrapped model gives, with full tensors on the CPU.

    Its keys: every name of every parameter (a tied weight under each of its names, one tensor)
    and the persistent buffers only (not, say, Llama's computed ``rotary_emb.inv_freq``); its
    dtypes: the parameters' (their shards') and the buffers' own. Accelerate's ``get_state_dict``
    and a stock ``save_pretrained`` read this. Every replica must call it (it gathers).
    """
    state = {name: value for names, value in _gathered_params(root) for name in names}
    for name, module in root.wrapper.named_modules():
        for local, buf in module._buffers.items():
            if buf is not None and local not in module._non_persistent_buffers_set:
                wrapped = join(name, local)
                state[original_name(wrapped)] = _buffer_on_host(root, wrapped, buf)
    return state


def _gathered_params(root: UnitState) -> List[Tuple[Tuple[str, ...], torch.Tensor]]:
    """Each full parameter on the CPU, with its names in the unwrapped model (tied: several)."""
    units = [unit for _, unit in root.named_units()]
    with holding_full_params(units, in_shard_dtype=True, writeback=False):
        _xla.sync()  # one program gathers every unit; the copies below only transfer
        return [
            (tuple(full_name(prefix, name) for name in (slot.name, *slot.aliases)), slot.param.detach().cpu())
            for prefix, unit in root.named_units()
            for group in unit.param_groups
            for slot in group.slots
        ]


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
