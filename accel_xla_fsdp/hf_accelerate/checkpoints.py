"""``Accelerator.save_state`` / ``load_state`` with sharded checkpoints.

An Accelerate checkpoint folder (``checkpoint_<n>`` under ``project_dir/checkpoints`` with
automatic naming) holds, here:

- ``xla_fsdp_<i>/``: model ``i`` and its optimizer, written by ``save_sharded`` (each rank its
  shard; loads on any number of ranks);
- what Accelerate itself writes for the rest: schedulers, dataloader samplers, each rank's random
  states, the step, registered objects;
- with ``fsdp_state_dict_type: FULL_STATE_DICT``, also ``model/`` (``model_<i>/``): the
  consolidated model in the Hugging Face layout, which ``from_pretrained`` loads.

A URL (``s3://``, ``gs://``, ...) is never a local folder: ``save_state`` / ``load_state`` at a
URL go through ``bucket_state.py`` ([Note: save_state in a bucket]).

[Note: replacing a save_state folder]
The folder is written as ``.<name>.accel-xla-fsdp-saving`` beside it and renamed into place once
every rank's files are complete, so a save that fails leaves every earlier checkpoint as it was;
rotation (``total_limit``) removes the oldest only after that. A folder that already exists is
renamed to ``.<name>.accel-xla-fsdp-replaced`` first, then what save_state did not write in it
(the user's files: the folder lists its own entries in ``.accel_xla_fsdp_state.json``) is moved
into the new one, and only then is it removed. A save killed between those renames is finished
(or the old folder put back) by the next ``save_state`` or ``load_state`` of that folder. A
symbolic link is followed, so that the folder is staged beside the one it points to, on its
filesystem (a rename cannot cross filesystems); a folder that is a mount point cannot be renamed
at all, and is refused before anything is written.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

import torch
from accelerate.checkpointing import (
    load_accelerator_state,
    load_custom_state,
    save_accelerator_state,
    save_custom_state,
)
from accelerate.utils import RNG_STATE_NAME
from accelerate.utils import load as accelerate_load

from .. import _xla, host_memory
from ..checkpoint import CheckpointError, ShardedCheckpoint, consolidate, load_sharded, save_sharded
from ..checkpoint.files import numbered_folders
from ..checkpoint.format import RECORD
from ..fsdp import XlaFullyShardedDataParallel

_NUMBERED = re.compile(r"^checkpoint_(\d+)$")
STAGED = ".{}.accel-xla-fsdp-saving"  # beside the folder: names no user picks, the same on every rank
REPLACED = ".{}.accel-xla-fsdp-replaced"
MANIFEST = ".accel_xla_fsdp_state.json"  # in the folder: the entries save_state wrote
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


def pair_optimizers(
    models: Sequence[XlaFullyShardedDataParallel], optimizers: Sequence[Any]
) -> List[ModelAndOptimizer]:
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
    return numbered_folders(root, _NUMBERED)


def checkpoint_number(folder: Path) -> Optional[int]:
    match = _NUMBERED.match(folder.name)
    return int(match.group(1)) if match else None


def save(accelerator: Any, folder: Path, pairs: List[ModelAndOptimizer], full_state_dict: bool) -> None:
    """Write the checkpoint into ``folder`` (replacing it if it exists) on every replica
    ([Note: replacing a save_state folder])."""
    target = real_folder(folder)
    check_replaceable(folder, target)  # every rank, before anything is written: all refuse alike
    partial = sibling(target, STAGED)
    main = accelerator.is_main_process
    if main:
        recover(target)
        if partial.is_dir() and not partial.is_symlink():
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
        commit_folder(partial, target)
    host_memory.give_back()  # the shards' host copies, written
    accelerator.wait_for_everyone()


def real_folder(folder: Path) -> Path:
    """The folder a save replaces: through symbolic links, the one they point to (staged beside
    it, on its filesystem; the links then point at the new folder)."""
    return Path(os.path.realpath(folder))


def sibling(target: Path, pattern: str) -> Path:
    return target.with_name(pattern.format(target.name))


def check_replaceable(folder: Path, target: Path) -> None:
    if target.exists() and not target.is_dir():
        raise CheckpointError(f"save_state: {folder} exists and is not a folder")
    if target.is_dir() and os.path.ismount(target):
        raise CheckpointError(
            f"save_state: {folder} is a mount point: a save replaces its folder whole by a rename, which a mount "
            f"point cannot take (nothing was written). Save into a folder inside it, e.g. {folder / 'state'}"
        )


def commit_folder(partial: Path, folder: Path) -> None:
    """``partial`` becomes ``folder``; an older ``folder`` is removed only after the rename, once
    what save_state did not write in it has been moved into the new one."""
    (partial / MANIFEST).write_text(json.dumps({"written": sorted(os.listdir(partial))}))
    old = sibling(folder, REPLACED)
    recover(folder)  # an earlier commit's, killed: its user entries are moved before ``old`` is reused
    if folder.exists():
        os.replace(folder, old)
    os.replace(partial, folder)
    carry_over(old, folder)


def recover(folder: Path) -> None:
    """Finish a commit that was killed: put the old folder back if the new one is not in place,
    else move the user's entries out of the old one and remove it. Main process; never raises
    (a folder it cannot repair is reported by the save or load that follows)."""
    old = sibling(folder, REPLACED)
    if not old.is_dir() or old.is_symlink():
        return
    try:
        if not folder.exists() and not folder.is_symlink():
            os.replace(old, folder)
        else:
            carry_over(old, folder)
    except OSError:
        pass


def carry_over(old: Path, folder: Path) -> None:
    """Move the entries of ``old`` that save_state did not write into ``folder`` (where the new
    save has none of that name), then remove ``old``. Every step can be done again."""
    if not old.is_dir() or old.is_symlink():
        return
    for name in foreign_entries(old):
        if not (folder / name).exists() and not (folder / name).is_symlink():
            os.replace(old / name, folder / name)
    shutil.rmtree(old)


def foreign_entries(folder: Path) -> List[str]:
    """The entries of ``folder`` that save_state did not write: those its manifest does not list.
    A folder without one is a save_state folder of an earlier version (every entry ours) if it
    holds a sharded checkpoint, else the user's (every entry theirs)."""
    names = sorted(os.listdir(folder))
    try:
        written = set(json.loads((folder / MANIFEST).read_text())["written"])
    except (OSError, ValueError, KeyError, TypeError):
        written = set(names) if (sharded_dir(folder, 0) / RECORD).is_file() else set()  # an earlier version's
    return [n for n in names if n not in written and n != MANIFEST]


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
        if not source.is_dir():
            raise CheckpointError(
                f"{folder} holds no XLA FSDP model {index} ({source.name}/ is missing): "
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
    host_memory.give_back()  # what staging the shards freed
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
