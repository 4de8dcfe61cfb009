"""Save and load sharded checkpoints from a wrapped model (see [Note: checkpoint layout]).

``save_sharded`` and ``load_sharded`` are called on every replica with the root unit. Loading
works across world sizes and layouts ([Note: the virtual full tensor]): each replica reads only
the slices its own shards need.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Protocol, Tuple

import torch
import torch.nn as nn
from safetensors.torch import save_file

from .. import _xla
from ..fsdp import XlaFullyShardedDataParallel
from ..param_group import ParamSlot, ShardedParamGroup
from ..state_dict import buffer_original_dtype, full_name, join, named_units, original_name
from .format import (
    BUFFER, FORMAT, META_KEY, MODEL, OPTIM, RECORD, CheckpointError, GroupEntry, ParamEntry, RankMeta,
    ShardedCheckpoint, dtype_name, read_record, rank_file_name,
)


class ParamSource(Protocol):
    """Where full parameters come from, by name and flat element range."""

    def read_param(self, name: str, start: int = 0, stop: Optional[int] = None) -> torch.Tensor: ...


# ---------------------------------------------------------------------------------------------
# Saving


def save_sharded(model: XlaFullyShardedDataParallel, optimizer: Optional[torch.optim.Optimizer], directory: str) -> None:
    """Write this replica's shards (and optimizer state) into ``directory``; call on every replica.

    Atomic: the checkpoint already in ``directory`` stays whole and loadable until every rank has
    written the new one; then ``checkpoint.json`` is replaced in one step and older saves removed.
    """
    _check_root(model)
    _xla.sync()  # the step's pending updates, so that the shards are values to copy
    rank, world = _xla.global_rank(), _xla.world_size()
    root = Path(directory)
    save_id = _next_save_id(root)
    groups = list(_groups_of(model))
    tensors, meta = _rank_tensors(model, optimizer, groups, save_id, rank, world)
    target = root / save_id / rank_file_name(rank, world)
    target.parent.mkdir(parents=True, exist_ok=True)
    _write_atomically(target, lambda tmp: save_file(tensors, str(tmp), metadata={META_KEY: meta.to_json()}))
    _barrier()  # every rank's file is on disk
    if rank == 0:
        files = [f"{save_id}/{rank_file_name(r, world)}" for r in range(world)]
        record = {"format": FORMAT, "save_id": save_id, "world_size": world, "files": files}
        _write_atomically(root / RECORD, lambda tmp: tmp.write_text(json.dumps(record, indent=1)))
        _remove_other_saves(root, keep=save_id)
    _barrier()  # no rank reads the directory before it is committed


def _check_root(model: nn.Module) -> None:
    if not isinstance(model, XlaFullyShardedDataParallel) or not model.is_root:
        raise TypeError(
            f"save_sharded / load_sharded take the root XlaFullyShardedDataParallel (the outermost "
            f"wrapper), got {type(model).__name__}"
        )


def _next_save_id(root: Path) -> str:
    """``save-<n>``, one more than the committed save's. Every rank reads the record before any
    rank can replace it (that waits for every rank's file), so all agree on it."""
    try:
        last = int(read_record(root)["save_id"].rsplit("-", 1)[1])
    except (CheckpointError, ValueError, IndexError):
        last = -1
    return f"save-{last + 1:06d}"


def _groups_of(model: XlaFullyShardedDataParallel) -> Iterator[Tuple[str, str, ShardedParamGroup]]:
    """(unit prefix, group key, group) for every group of every unit, in a fixed order."""
    for prefix, unit in named_units(model):
        for group in unit.param_groups:
            yield prefix, join(prefix, group.spec.shard_name), group


def _param_entries(prefix: str, group: ShardedParamGroup) -> Tuple[ParamEntry, ...]:
    return tuple(
        ParamEntry(full_name(prefix, s.name), tuple(s.shape), s.offset, tuple(full_name(prefix, a) for a in s.aliases))
        for s in group.slots
    )


def _rank_tensors(
    model: XlaFullyShardedDataParallel, optimizer: Optional[torch.optim.Optimizer],
    groups: List[Tuple[str, str, ShardedParamGroup]], save_id: str, rank: int, world: int,
) -> Tuple[Dict[str, torch.Tensor], RankMeta]:
    tensors: Dict[str, torch.Tensor] = {}
    entries = []
    for prefix, key, group in groups:
        tensors[f"{MODEL}/{key}"] = group.shard.detach().cpu().contiguous()
        entries.append(GroupEntry(
            key=key, shard_numel=group.shard.numel(), world_size=group.sharding.world_size,
            dtype=dtype_name(group.shard.dtype), requires_grad=group.shard.requires_grad,
            params=_param_entries(prefix, group),
        ))
    buffers = {}
    for name, buf in model.named_buffers():
        value = buf.detach().cpu().to(buffer_original_dtype(model, name) or buf.dtype).contiguous()
        tensors[f"{BUFFER}/{original_name(name)}"] = value
        buffers[original_name(name)] = dtype_name(value.dtype)
    optim_meta = _optimizer_tensors(optimizer, groups, tensors) if optimizer is not None else None
    meta = RankMeta(FORMAT, save_id, rank, world, tuple(entries), buffers, optim_meta)
    return tensors, meta


def _optimizer_tensors(
    optimizer: torch.optim.Optimizer, groups: List[Tuple[str, str, ShardedParamGroup]], tensors: Dict[str, torch.Tensor]
) -> Dict[str, Any]:
    key_of = {id(g.shard): key for _, key, g in groups}
    param_groups, scalars = [], {}
    for pg in optimizer.param_groups:
        unknown = [p for p in pg["params"] if id(p) not in key_of]
        if unknown:
            raise CheckpointError(
                f"the optimizer holds {len(unknown)} parameter(s) that are not shards of this model: build it "
                "from the wrapped model's parameters()"
            )
        hyper = {k: v for k, v in pg.items() if k != "params" and _is_json(v)}
        param_groups.append({**hyper, "groups": [key_of[id(p)] for p in pg["params"]]})
        for p in pg["params"]:
            for name, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    tensors[f"{OPTIM}/{key_of[id(p)]}/{name}"] = value.detach().cpu().contiguous()
                elif _is_json(value):
                    scalars[f"{key_of[id(p)]}/{name}"] = value
    return {"type": type(optimizer).__name__, "param_groups": param_groups, "scalars": scalars}


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def _write_atomically(path: Path, write: Any) -> None:
    """Write through a temporary file in the same directory, flushed to disk, then rename."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write(tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _remove_other_saves(root: Path, keep: str) -> None:
    for child in root.iterdir():
        if child.is_dir() and child.name.startswith("save-") and child.name != keep:
            shutil.rmtree(child, ignore_errors=True)


def _barrier() -> None:
    """Every replica reaches this point before any leaves it (a one-element collective)."""
    flag = _xla.all_reduce(torch.ones((), device=_xla.device()), "sum", None, True)
    # Run it at a sync, where replicas take turns (one compiles, the others reuse the program):
    # read back directly, every replica would compile it at once, and a replica that reaches
    # the collective over 10 s late ends the process on XLA:CPU.
    _xla.sync()
    flag.cpu()


# ---------------------------------------------------------------------------------------------
# Loading


def load_sharded(model: XlaFullyShardedDataParallel, optimizer: Optional[torch.optim.Optimizer], directory: str) -> None:
    """Load a checkpoint saved by ``save_sharded`` on any number of ranks, in any layout.

    Call on every replica. The model (and optimizer) must be the same as when saved, wrapped in
    any way; each replica reads only the slices of the rank files that its shards need.
    """
    _check_root(model)
    ckpt = ShardedCheckpoint(directory)
    groups = list(_groups_of(model))
    _check_same_model(ckpt, groups)
    with torch.no_grad():
        for prefix, _, group in groups:
            fill_group(group, prefix, ckpt)
        for name, buf in model.named_buffers():
            buf.copy_(ckpt.read_buffer(original_name(name)).to(buf.dtype))
    if optimizer is not None:
        _load_optimizer(optimizer, groups, ckpt)
    _xla.sync()


def _check_same_model(ckpt: ShardedCheckpoint, groups: List[Tuple[str, str, ShardedParamGroup]]) -> None:
    mine = {e.name: e.shape for prefix, _, g in groups for e in _param_entries(prefix, g)}
    theirs = {name: entry.shape for name, (_, entry) in ckpt.params.items()}
    missing, unexpected = sorted(set(mine) - set(theirs)), sorted(set(theirs) - set(mine))
    wrong = sorted(n for n in set(mine) & set(theirs) if mine[n] != theirs[n])
    if missing or unexpected or wrong:
        parts = [f"missing {missing[:5]}" if missing else "", f"unexpected {unexpected[:5]}" if unexpected else ""]
        parts += [f"{n}: {theirs[n]} saved, {mine[n]} here" for n in wrong[:5]]
        raise CheckpointError(
            f"{ckpt.directory}: a checkpoint of another model ({'; '.join(p for p in parts if p)}). Load it "
            "into the model it was saved from."
        )


def fill_group(group: ShardedParamGroup, prefix: str, source: ParamSource) -> None:
    """Copy this replica's part of every parameter of ``group`` from ``source`` into its shard."""
    values = group.local_values(lambda slot, a, b: source.read_param(full_name(prefix, slot.name), a, b))
    group.shard.copy_(values.to(group.shard.device))


def _load_optimizer(optimizer: torch.optim.Optimizer, groups: List[Tuple[str, str, ShardedParamGroup]], ckpt: ShardedCheckpoint) -> None:
    saved = ckpt.metas[0].optimizer
    if saved is None:
        raise CheckpointError(f"{ckpt.directory}: saved without an optimizer; load with optimizer=None")
    if saved["type"] != type(optimizer).__name__ or len(saved["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError(
            f"{ckpt.directory}: saved with a {saved['type']} of {len(saved['param_groups'])} param group(s), "
            f"loading into a {type(optimizer).__name__} of {len(optimizer.param_groups)}"
        )
    by_shard = {id(g.shard): (prefix, g) for prefix, _, g in groups}
    first_rank_names = ckpt.tensor_names(0)
    for pg, saved_pg in zip(optimizer.param_groups, saved["param_groups"]):
        pg.update({k: (tuple(v) if isinstance(pg.get(k), tuple) else v) for k, v in saved_pg.items() if k != "groups"})
        for p in pg["params"]:
            prefix, group = by_shard[id(p)]
            optimizer.state[p] = _state_for(group, prefix, ckpt, saved, first_rank_names)


def _state_for(group: ShardedParamGroup, prefix: str, ckpt: ShardedCheckpoint, saved: Dict[str, Any], names: List[str]) -> Dict[str, Any]:
    """One shard's optimizer state: tensors shaped like the saved shards resharded element by
    element, the others (``step``) taken from the saved group holding this group's first parameter."""
    first = _param_entries(prefix, group)[0].name
    source_group, _ = ckpt.params[first]
    state: Dict[str, Any] = {}
    for name in names:
        if not name.startswith(f"{OPTIM}/{source_group.key}/"):
            continue
        key = name.rsplit("/", 1)[1]
        if list(ckpt.file(0).get_slice(name).get_shape()) == _saved_shard_shape(ckpt, source_group):
            state[key] = group.local_values(_optim_reader(ckpt, prefix, key)).to(group.shard.device)
        else:
            state[key] = ckpt.file(0).get_tensor(name).clone()  # the file's memory map is shared
    for name, value in saved["scalars"].items():
        if name.startswith(f"{source_group.key}/"):
            state[name.rsplit("/", 1)[1]] = value
    return state


def _saved_shard_shape(ckpt: ShardedCheckpoint, group: GroupEntry) -> List[int]:
    return list(ckpt.file(0).get_slice(f"{MODEL}/{group.key}").get_shape())


def _optim_reader(ckpt: ShardedCheckpoint, prefix: str, state: str) -> Callable[[ParamSlot, int, int], torch.Tensor]:
    def read(slot: ParamSlot, start: int, stop: int) -> torch.Tensor:
        group, saved = ckpt.params[full_name(prefix, slot.name)]
        return ckpt.read_range(group, saved.offset + start, saved.offset + stop, prefix=OPTIM, state=state)

    return read
