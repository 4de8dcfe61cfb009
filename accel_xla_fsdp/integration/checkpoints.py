"""``Accelerator.save_state`` / ``load_state`` with sharded checkpoints.

An Accelerate checkpoint folder (``checkpoint_<n>`` under ``project_dir/checkpoints`` with
automatic naming) holds, here:

- ``xla_fsdp_<i>/``: model ``i`` and its optimizer, written by ``save_sharded`` (each rank its
  shard; loads on any number of ranks);
- what Accelerate itself writes for the rest: schedulers, dataloader samplers, each rank's random
  states, the step, registered objects;
- with ``fsdp_state_dict_type: FULL_STATE_DICT``, also ``model/`` (``model_<i>/``): the
  consolidated model in the Hugging Face layout, which ``from_pretrained`` loads.

The folder is written as ``<name>.partial`` and renamed into place once every rank's files are
complete, so a save that fails leaves every earlier checkpoint as it was; rotation
(``total_limit``) removes the oldest only after that.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from accelerate.checkpointing import (
    load_accelerator_state,
    load_custom_state,
    save_accelerator_state,
    save_custom_state,
)
from accelerate.utils import RNG_STATE_NAME
from accelerate.utils import load as accelerate_load

from .. import _xla
from ..checkpoint import CheckpointError, ShardedCheckpoint, consolidate, load_sharded, save_sharded
from ..fsdp import XlaFullyShardedDataParallel

_NUMBERED = re.compile(r"^checkpoint_(\d+)$")
# Accelerate's ``load`` adds torch's safe globals for ``torch.load`` and clears them afterwards:
# a process-wide list. XLA:CPU replica threads loading at once clear each other's, a replica's
# random states then fail to unpickle, and Accelerate logs that at info level and goes on with
# its step at 0 (that replica then runs steps the others do not, and the run aborts at a
# collective). One replica at a time reads Accelerate's files.
_accelerate_files = threading.Lock()
ModelAndOptimizer = Tuple[XlaFullyShardedDataParallel, Optional[torch.optim.Optimizer]]


def sharded_dir(folder: Path, index: int) -> Path:
    return folder / f"xla_fsdp_{index}"


def consolidated_dir(folder: Path, index: int) -> Path:
    return folder / ("model" if index == 0 else f"model_{index}")


def pair_optimizers(models: Sequence[nn.Module], optimizers: Sequence[Any]) -> List[ModelAndOptimizer]:
    """Each prepared model with the optimizer over its shards (or None)."""
    pairs: List[ModelAndOptimizer] = []
    for model in models:
        owned = {id(p) for p in model.parameters()}
        mine = [o for o in optimizers if any(id(p) in owned for g in o.param_groups for p in g["params"])]
        if len(mine) > 1:
            raise ValueError(
                f"{len(mine)} optimizers step the parameters of one model; save_state keeps one per model"
            )
        pairs.append((model, mine[0].optimizer if mine else None))
    return pairs


def numbered_checkpoints(root: Path) -> List[Path]:
    """``checkpoint_<n>`` folders under ``root``, oldest first."""
    found = [p for p in root.iterdir() if p.is_dir() and _NUMBERED.match(p.name)] if root.is_dir() else []
    return sorted(found, key=lambda p: int(_NUMBERED.match(p.name).group(1)))


def checkpoint_number(folder: Path) -> Optional[int]:
    match = _NUMBERED.match(folder.name)
    return int(match.group(1)) if match else None


def save(accelerator: Any, folder: Path, pairs: List[ModelAndOptimizer], full_state_dict: bool) -> None:
    """Write the checkpoint into ``folder`` (replacing it if it exists) on every replica."""
    partial = folder.with_name(folder.name + ".partial")
    main = accelerator.is_main_process
    if main and partial.exists():
        shutil.rmtree(partial)  # what a failed save left
    accelerator.wait_for_everyone()
    partial.mkdir(parents=True, exist_ok=True)
    _xla.sync()  # finish the step before reading its state
    for index, (model, optimizer) in enumerate(pairs):
        save_sharded(model, optimizer, str(sharded_dir(partial, index)))
    save_accelerator_state(
        str(partial),
        [],
        [],
        accelerator._schedulers,
        accelerator._dataloaders,
        accelerator.process_index,
        accelerator.step,
        None,
        save_on_each_node=accelerator.project_configuration.save_on_each_node,
        safe_serialization=False,
    )
    for index, obj in enumerate(accelerator._custom_objects):
        save_custom_state(
            obj, str(partial), index, save_on_each_node=accelerator.project_configuration.save_on_each_node
        )
    if main and full_state_dict:
        for index, (model, _) in enumerate(pairs):
            config = getattr(model.module, "config", None)
            consolidate(sharded_dir(partial, index), consolidated_dir(partial, index), config=config, progress=False)
    accelerator.wait_for_everyone()
    if main:
        commit_folder(partial, folder)
    accelerator.wait_for_everyone()


def commit_folder(partial: Path, folder: Path) -> None:
    """``partial`` becomes ``folder``; an older ``folder`` is removed only after the rename."""
    old = folder.with_name(folder.name + ".old")
    if folder.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(folder, old)
    os.replace(partial, folder)
    if old.exists():
        shutil.rmtree(old)


def rotate(root: Path, total_limit: Optional[int]) -> None:
    """Keep the newest ``total_limit`` numbered checkpoints under ``root`` (main process)."""
    if total_limit is None:
        return
    folders = numbered_checkpoints(root)
    for folder in folders[: max(0, len(folders) - total_limit)]:
        shutil.rmtree(folder)


def load(accelerator: Any, folder: Path, pairs: List[ModelAndOptimizer], load_kwargs: Optional[dict]) -> dict:
    """Read the checkpoint in ``folder`` on every replica; returns what Accelerate restores too.
    Every model's files are checked (one save of one run, every header and metadata field)
    before any model is loaded."""
    for index in range(len(pairs)):
        source = sharded_dir(folder, index)
        if not (source / "checkpoint.json").is_file():
            raise CheckpointError(
                f"{folder} holds no XLA FSDP model {index} ({source.name}/checkpoint.json is missing): "
                "load a folder written by accel_xla_fsdp's Accelerator.save_state"
            )
        ShardedCheckpoint(source).close()
    for index, (model, optimizer) in enumerate(pairs):
        load_sharded(model, optimizer, str(sharded_dir(folder, index)))
    with _accelerate_files:
        restored = load_accelerator_state(
            str(folder),
            [],
            [],
            accelerator._schedulers,
            accelerator._dataloaders,
            accelerator.process_index,
            None,
            "cpu",
            load_kwargs,
        )
        for index, obj in enumerate(accelerator._custom_objects):
            load_custom_state(obj, str(folder), index)
        if "step" not in restored:
            restored["step"] = saved_step(folder)
    return restored


def saved_step(folder: Path) -> int:
    """The step saved with rank 0's random states. A replica that has no random states of its own
    (resumed on more replicas than saved) still resumes at the step the others do."""
    path = folder / f"{RNG_STATE_NAME}_0.pkl"
    if not path.is_file():
        raise CheckpointError(
            f"{folder} has no {path.name}: not a complete save_state folder (it holds the step to resume at)"
        )
    return int(accelerate_load(path)["step"])
