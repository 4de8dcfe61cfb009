"""``Accelerator.save_state`` / ``load_state`` into a bucket (any fsspec URL: ``s3://``, ``gs://``, ...).

[Note: save_state in a bucket]
A bucket has no rename, so a local folder's scheme (stage beside it, rename into place) cannot
be used there. Instead every save_state writes a new folder of its own inside the one asked for,
and a record, written last, names it:

    FOLDER/accel_xla_fsdp_state.json      the record: {"state": "state-000002"}, written last
    FOLDER/state-000002/xla_fsdp_0/       model 0 and its optimizer (save_sharded: every rank its file)
    FOLDER/state-000002/random_states_<r>.pkl, scheduler.bin, ...   Accelerate's own files
    FOLDER/state-000002/model/            with FULL_STATE_DICT: the consolidated model

Each rank writes Accelerate's files of its own into a local temporary folder (Accelerate's
writers take local paths) and uploads them; once every rank has confirmed its uploads (one
collective), the main process writes the record in one upload, which replaces the previous
one whole. Only then are the older ``state-<n>`` folders removed. A save that fails or is killed
before the record leaves the previous record, and its folder, as they were; the next save
removes the ``state-<n>`` folders no record names. Nothing else in FOLDER is touched.

With ``automatic_checkpoint_naming`` a ``checkpoint_<n>`` folder is complete when it holds the
record: ``load_state()`` loads the newest complete one (naming the incomplete ones it skips), and
rotation (``total_limit``) counts and removes only complete ones.
"""

from __future__ import annotations

import json
import logging
import re
import tempfile
from pathlib import Path
from typing import Any, List, Optional

from accelerate.checkpointing import (
    load_accelerator_state,
    load_custom_state,
    save_accelerator_state,
    save_custom_state,
)

from .. import _xla
from ..checkpoint import CheckpointError, ShardedCheckpoint, consolidate, load_sharded, save_sharded
from ..checkpoint.sharded import sum_over_replicas
from ..checkpoint.store import Location
from .checkpoints import ModelAndOptimizer, _accelerate_files, saved_step

logger = logging.getLogger(__name__)

STATE_RECORD = "accel_xla_fsdp_state.json"
_STATE = re.compile(r"state-(\d{6})")
_NUMBERED = re.compile(r"checkpoint_(\d+)")


def is_url(where: Any) -> bool:
    return "://" in str(where)


def _record(folder: Location) -> Optional[str]:
    """The ``state-<n>`` folder the record names (None: no record)."""
    if STATE_RECORD not in folder.names():
        return None
    try:
        raw = json.loads((folder / STATE_RECORD).read_bytes())
        name = raw["state"]
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"{folder / STATE_RECORD}: not a save_state record of accel_xla_fsdp") from None
    if not isinstance(name, str) or not _STATE.fullmatch(name):
        raise CheckpointError(f"{folder / STATE_RECORD}: names {name!r}, not a state-<n> folder")
    return name


def save(accelerator: Any, folder: Location, pairs: List[ModelAndOptimizer], full_state_dict: bool) -> None:
    """[Note: save_state in a bucket]; on every replica."""
    main = accelerator.is_main_process
    number = 0
    error: Optional[BaseException] = None
    if main:
        try:
            current = _record(folder)
            for name in folder.names():  # what saves that did not finish left
                if _STATE.fullmatch(name) and name != current:
                    _remove_tree(folder / name)
            taken = [int(m.group(1)) for n in folder.names() if (m := _STATE.fullmatch(n))]
            number = max(taken, default=-1) + 1
        except (CheckpointError, OSError) as e:
            error = e
    agreed = sum_over_replicas([number, int(error is not None)])
    if error is not None:
        raise error
    if agreed[1]:
        raise CheckpointError(f"{folder}: the main process could not prepare the save (its error says why)")
    state = folder / f"state-{agreed[0]:06d}"
    _xla.sync()
    for index, (model, optimizer) in enumerate(pairs):
        save_sharded(model, optimizer, state / f"xla_fsdp_{index}")
    try:
        with tempfile.TemporaryDirectory(prefix="accel-xla-fsdp-state-") as local:
            save_accelerator_state(
                local,
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
                    obj, local, index, save_on_each_node=accelerator.project_configuration.save_on_each_node
                )
            for path in sorted(Path(local).iterdir()):
                data = path.read_bytes()
                (state / path.name).put(data)
                if (state / path.name).size() != len(data):
                    raise CheckpointError(f"{state / path.name}: the store holds another size than was written")
        if main and full_state_dict:
            for index, (model, _) in enumerate(pairs):
                config = getattr(model.module, "config", None)
                out = state / ("model" if index == 0 else f"model_{index}")
                consolidate(state / f"xla_fsdp_{index}", out, config=config, progress=False)
    except Exception as e:  # noqa: BLE001 - every rank must hear of it
        error = e
    failed = sum_over_replicas([int(error is not None)])[0]
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"{folder}: {failed} rank(s) could not write their files (their errors say why)")
    if main:
        try:
            previous = _record(folder)
            (folder / STATE_RECORD).put(json.dumps({"state": state.name}).encode())
            if previous is not None:
                _remove_tree(folder / previous)
        except (CheckpointError, OSError) as e:
            error = e
    if sum_over_replicas([int(error is not None)])[0]:
        raise error if error is not None else CheckpointError(f"{folder}: the main process could not commit the save")


def _remove_tree(location: Location) -> None:
    location.retried("remove", lambda: location.fs.rm(location.path, recursive=True) if location.exists() else None)


def complete_checkpoints(root: Location) -> List[Location]:
    """The complete ``checkpoint_<n>`` folders under ``root``, oldest first; the incomplete ones
    newer than the newest complete one are named in a warning."""
    numbered = sorted((int(m.group(1)), n) for n in root.names() if (m := _NUMBERED.fullmatch(n)))
    complete: List[Location] = []
    incomplete: List[str] = []
    for _, name in numbered:
        if STATE_RECORD in (root / name).names():
            complete.append(root / name)
            incomplete.clear()
        else:
            incomplete.append(name)
    if incomplete:
        logger.warning(
            "%s: skipping incomplete checkpoint(s) %s (no %s: a save that did not finish)",
            root,
            ", ".join(incomplete),
            STATE_RECORD,
        )
    return complete


def rotate(root: Location, total_limit: Optional[int]) -> None:
    """Keep the newest ``total_limit`` complete checkpoints: the older ones' record first, then
    the folders it named (an incomplete one is never counted nor removed here)."""
    if total_limit is None:
        return
    complete = complete_checkpoints(root)
    for folder in complete[: max(0, len(complete) - total_limit)]:
        state = _record(folder)
        (folder / STATE_RECORD).remove()
        if state is not None:
            _remove_tree(folder / state)


def load(accelerator: Any, folder: Location, pairs: List[ModelAndOptimizer], load_kwargs: Optional[dict]) -> dict:
    state_name = _record(folder)
    if state_name is None:
        raise CheckpointError(
            f"{folder}: no {STATE_RECORD}, so no complete save_state checkpoint (a save that did not finish "
            "leaves none)"
        )
    state = folder / state_name
    for index in range(len(pairs)):
        ShardedCheckpoint(state / f"xla_fsdp_{index}").close()  # every model checked before any is loaded
    for index, (model, optimizer) in enumerate(pairs):
        load_sharded(model, optimizer, state / f"xla_fsdp_{index}")
    with tempfile.TemporaryDirectory(prefix="accel-xla-fsdp-state-") as local:
        for name in state.names():
            if not name.startswith(("xla_fsdp_", "model")):
                (Path(local) / name).write_bytes((state / name).read_bytes())
        with _accelerate_files:
            restored = load_accelerator_state(
                local,
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
                load_custom_state(obj, local, index)
            if "step" not in restored:
                restored["step"] = saved_step(Path(local))
    return restored
