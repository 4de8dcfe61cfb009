"""``Accelerator.save_state`` / ``load_state`` with sharded checkpoints, in a local folder or at a URL.

[Note: save_state folders]
A save_state folder (the one given, or ``checkpoint_<n>`` under ``project_dir/checkpoints`` with
automatic naming) is a local path or any fsspec URL (``s3://``, ``gs://``, ...), and the same
protocol serves both: no folder is renamed and no host needs to see another's files. Every save
writes a folder of its own inside it, and a record, written last, names the complete one:

    FOLDER/accel_xla_fsdp_state.json     the record: {"state": "state-000002"}, written last
    FOLDER/state-000002/started.json     the main process's marker, written first: a save of ours
    FOLDER/state-000002/xla_fsdp_0/      model 0 and its optimizer (save_sharded: every rank its file)
    FOLDER/state-000002/random_states_<r>.pkl, scheduler.bin, ...   Accelerate's files (accelerate_files.py)
    FOLDER/state-000002/model/           with FULL_STATE_DICT: the consolidated model (model_<i>/ for model i)

Every rank writes its files straight into ``state-<n>/`` (nothing is staged on a local disk);
once every rank has confirmed them (one collective), the main process writes the record in one
step (``Location.put``: one upload in a bucket; on a local disk a temporary file renamed over
it in the same folder), which replaces the previous record whole. The save is complete from
then on; only then is the ``state-<n>/`` the previous record named removed. A save that fails
or is killed before its record leaves the previous record and its state as they were (loads
read them, naming the incomplete save in a warning), and the next save into FOLDER removes the
``state-<n>/`` folders with our marker that the record does not name: only what an incomplete
save of ours wrote. Nothing else in FOLDER is touched (your logs, notes, a model of yours stay).

With automatic naming a ``checkpoint_<n>`` folder is complete when it holds the record:
``load_state()`` loads the newest complete one (naming the incomplete ones above it in a
warning), and rotation (``total_limit``) counts only complete ones and removes the older ones'
saves, record first (a removal cut short leaves an incomplete save, never a record naming
missing files, and the next rotation finishes it).

A folder written by an earlier version (every entry at the top, listed in
``.accel_xla_fsdp_state.json``, no record) still loads, and the first save into it removes the
entries that list names once its own record is written.
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any, List, Optional, Sequence, Set, Tuple

import torch

from .. import _xla, host_memory
from ..checkpoint import CheckpointError, ShardedCheckpoint, consolidate, load_sharded, save_sharded
from ..checkpoint.format import SAVE_MARKER
from ..checkpoint.sharded import sum_over_replicas
from ..checkpoint.store import Location, PathLike, is_url
from ..fsdp import XlaFullyShardedDataParallel
from . import accelerate_files

logger = logging.getLogger(__name__)

STATE_RECORD = "accel_xla_fsdp_state.json"
EARLIER_MANIFEST = ".accel_xla_fsdp_state.json"  # an earlier version's folder: the entries it wrote
_STATE = re.compile(r"state-(\d{6})")
_RECORD_TMP = re.compile(rf"\.{re.escape(STATE_RECORD)}\.tmp-.+")  # a local put killed midway
_NUMBERED = re.compile(r"checkpoint_(\d+)")
ModelAndOptimizer = Tuple[XlaFullyShardedDataParallel, Optional[torch.optim.Optimizer]]


def sharded_dir(state: Location, index: int) -> Location:
    return state / f"xla_fsdp_{index}"


def consolidated_dir(state: Location, index: int) -> Location:
    return state / ("model" if index == 0 else f"model_{index}")


def pair_optimizers(
    models: Sequence[XlaFullyShardedDataParallel],
    optimizers: Sequence[Any],
    why_one: str = "save_state keeps one per model",
) -> List[ModelAndOptimizer]:
    """Each prepared model with the optimizer over its shards (or None); ``why_one``: what
    refuses several, for the error."""
    pairs: List[ModelAndOptimizer] = []
    for model in models:
        owned = {id(p) for p in model.parameters()}
        mine = [o for o in optimizers if any(id(p) in owned for g in o.param_groups for p in g["params"])]
        if len(mine) > 1:
            raise ValueError(f"{len(mine)} optimizers step the parameters of one model; {why_one}")
        pairs.append((model, mine[0].optimizer if mine else None))
    return pairs


def checkpoint_number(folder: PathLike) -> Optional[int]:
    match = _NUMBERED.fullmatch(Location.of(folder).name)
    return int(match.group(1)) if match else None


def recorded_state(folder: Location) -> Optional[str]:
    """The ``state-<n>`` folder the record names (None: no record)."""
    if STATE_RECORD not in folder.names():
        return None
    try:
        name = json.loads((folder / STATE_RECORD).read_bytes())["state"]
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"{folder / STATE_RECORD}: not a save_state record of accel_xla_fsdp") from None
    if not isinstance(name, str) or not _STATE.fullmatch(name):
        raise CheckpointError(f"{folder / STATE_RECORD}: names {name!r}, not a state-<n> folder")
    return name


def _is_complete(entries: Set[str]) -> bool:
    return STATE_RECORD in entries or EARLIER_MANIFEST in entries


# ---------------------------------------------------------------------------------------------
# Saving


def save(accelerator: Any, folder: Location, pairs: List[ModelAndOptimizer], full_state_dict: bool) -> None:
    """Write a new save into ``folder`` ([Note: save_state folders]); on every replica. Any
    rank's failure ends the save on every rank, the previous save in ``folder`` as it was."""
    main = accelerator.is_main_process
    number = 0
    error: Optional[BaseException] = None
    if main:
        try:
            number = _prepare(folder)
        except (CheckpointError, OSError) as e:
            error = e
    agreed = sum_over_replicas([number, int(error is not None)])
    raise_if_failed(error, agreed[1], f"{folder}: the main process could not prepare the save (its error says why)")
    state = folder / f"state-{agreed[0]:06d}"
    _xla.sync()  # finish the step before reading its state
    for index, (model, optimizer) in enumerate(pairs):
        save_sharded(model, optimizer, sharded_dir(state, index))  # every rank learns of any failure
    try:
        accelerate_files.write(accelerator, state)
        if main and full_state_dict:
            for index, (model, _) in enumerate(pairs):
                config = getattr(model.module, "config", None)
                consolidate(sharded_dir(state, index), consolidated_dir(state, index), config=config, progress=False)
    except Exception as e:  # noqa: BLE001 - every rank must hear of it
        error = e
    failed = sum_over_replicas([int(error is not None)])[0]
    raise_if_failed(error, failed, f"{folder}: {failed} rank(s) could not write their files (their errors say why)")
    if main:
        try:
            _commit(folder, state.name)
        except (CheckpointError, OSError) as e:
            error = e
    failed = sum_over_replicas([int(error is not None)])[0]
    raise_if_failed(error, failed, f"{folder}: the main process could not commit the save (its error says why)")
    host_memory.give_back()  # the shards' host copies, written


def raise_if_failed(error: Optional[BaseException], failed: int, message: str) -> None:
    """After every replica has counted the failures (``failed``): this replica's own error, or
    ``message`` on a replica that did not fail itself."""
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(message)


def _prepare(folder: Location) -> int:
    """Main process, before anything is written: remove what incomplete saves of ours left, mark
    the new save's folder (numbered above every ``state-<n>``, ours or not: never reused)."""
    current = recorded_state(folder)
    entries = folder.names()
    for name in entries:
        if _STATE.fullmatch(name) and name != current:
            _remove_state(folder / name)
        elif _RECORD_TMP.fullmatch(name):
            (folder / name).remove()
    number = max((int(m.group(1)) for n in entries if (m := _STATE.fullmatch(n))), default=-1) + 1
    folder.makedirs()
    (folder / f"state-{number:06d}" / SAVE_MARKER).put(json.dumps({"accel_xla_fsdp": "save_state"}).encode())
    return number


def _commit(folder: Location, state: str) -> None:
    """Main process, once every rank confirmed its files: the record, then the older saves go.
    A failure after the record is logged: the save is complete, the next one removes the rest."""
    previous = recorded_state(folder)
    (folder / STATE_RECORD).put(json.dumps({"state": state}).encode())
    try:
        if previous is not None:
            _remove_state(folder / previous)
        _remove_earlier_version(folder)
    except (CheckpointError, OSError) as e:
        logger.warning("%s: the previous save is not all removed (%s); the next save removes it", folder, e)


def _remove_state(state: Location) -> None:
    """Remove a ``state-<n>`` folder of ours (one with our marker; any other is left alone): its
    entries, then the marker, so that a removal cut short is finished by the next save."""
    entries = state.names()
    if SAVE_MARKER not in entries:
        return
    for name in entries:
        if name != SAVE_MARKER:
            _remove_tree(state / name)
    (state / SAVE_MARKER).remove()
    state.remove_dir_if_empty()


def _remove_tree(location: Location) -> None:
    location.retried("remove", lambda: location.fs.rm(location.path, recursive=True) if location.exists() else None)


def _remove_earlier_version(folder: Location) -> None:
    """The entries an earlier version's save wrote at the top of ``folder`` (its manifest lists
    them), then the manifest."""
    if EARLIER_MANIFEST not in folder.names():
        return
    manifest = folder / EARLIER_MANIFEST
    try:
        written = json.loads(manifest.read_bytes())["written"]
    except (ValueError, KeyError, TypeError):
        written = []  # not ours to read: nothing of it is removed but the manifest
    for name in written:
        if isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and name != STATE_RECORD:
            _remove_tree(folder / name)
    manifest.remove()


# ---------------------------------------------------------------------------------------------
# Automatic naming: complete checkpoints, rotation


def complete_checkpoints(root: Location) -> List[Location]:
    """The complete ``checkpoint_<n>`` folders under ``root``, oldest first; the incomplete ones
    newer than the newest complete one are named in a warning."""
    numbered = sorted((int(m.group(1)), n) for n in root.names() if (m := _NUMBERED.fullmatch(n)))
    complete: List[Location] = []
    incomplete: List[str] = []
    for _, name in numbered:
        if _is_complete(set((root / name).names())):
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
    """Keep the newest ``total_limit`` complete checkpoints (main process): the older ones' record
    first, then their saves; and what a rotation cut short left in folders older than those kept.
    Your own files in a ``checkpoint_<n>`` folder stay (the folder with them)."""
    if total_limit is None:
        return
    complete = complete_checkpoints(root)
    if len(complete) <= total_limit:
        return
    oldest_kept = checkpoint_number(complete[len(complete) - total_limit])
    assert oldest_kept is not None
    for name in root.names():
        number = checkpoint_number(root / name)
        if number is not None and number < oldest_kept:
            folder = root / name
            entries = folder.names()
            if STATE_RECORD in entries:
                (folder / STATE_RECORD).remove()
            for entry in entries:
                if _STATE.fullmatch(entry):
                    _remove_state(folder / entry)
            _remove_earlier_version(folder)
            folder.remove_dir_if_empty()


# ---------------------------------------------------------------------------------------------
# Loading


def load(accelerator: Any, folder: Location, pairs: List[ModelAndOptimizer], load_kwargs: Optional[dict]) -> int:
    """Read the complete save in ``folder`` on every replica; returns the step it was saved at.
    Every model's files are checked (one save of one run, every header and metadata field)
    before any model is loaded."""
    state = complete_state(folder)
    for index in range(len(pairs)):
        source = sharded_dir(state, index)
        if not source.isdir():
            raise CheckpointError(
                f"{state} holds no XLA FSDP model {index} ({source.name}/ is missing): "
                "load a folder written by accel_xla_fsdp's Accelerator.save_state"
            )
        ShardedCheckpoint(source).close()
    for index, (model, optimizer) in enumerate(pairs):
        load_sharded(model, optimizer, sharded_dir(state, index))
    step = accelerate_files.read(accelerator, state, load_kwargs)
    host_memory.give_back()  # what staging the shards freed
    return step


def complete_state(folder: Location) -> Location:
    """The folder of the save in ``folder`` to load: the one its record names (an earlier
    version's folder: ``folder`` itself); none complete is a ``CheckpointError`` saying why."""
    state = recorded_state(folder)
    entries = folder.names()
    unfinished = [
        n for n in entries if _STATE.fullmatch(n) and n > (state or "") and SAVE_MARKER in (folder / n).names()
    ]
    if state is not None:
        if unfinished:
            logger.warning(
                "%s: skipping incomplete save(s) %s (no %s names it: a save that did not finish); reading %s",
                folder,
                ", ".join(unfinished),
                STATE_RECORD,
                state,
            )
        return folder / state
    if EARLIER_MANIFEST in entries:
        return folder
    if unfinished:
        raise CheckpointError(
            f"{folder}: no complete save_state checkpoint: {', '.join(unfinished)} did not finish (no "
            f"{STATE_RECORD}); the next save_state into it removes what it wrote"
        )
    raise CheckpointError(
        f"{folder}: no {STATE_RECORD}, so no complete save_state checkpoint (load a folder written by "
        "accel_xla_fsdp's Accelerator.save_state)"
    )


def expand(where: str) -> Location:
    """A folder given to save_state / load_state: ``~`` expanded in a local path, a URL as given."""
    return Location.of(where if is_url(where) else os.path.expanduser(where))
