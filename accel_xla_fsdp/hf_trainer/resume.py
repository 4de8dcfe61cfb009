"""Which ``checkpoint-N`` a Trainer run resumes from: the newest complete one.

The Trainer writes ``output_dir/checkpoint-N/`` in place, in order: the sharded model and
optimizer (``xla_fsdp_0/``, all or nothing: its ``checkpoint.json`` is written last), the Trainer's
own files, and ``trainer_state.json`` near the end. A save killed midway leaves a
``checkpoint-N/`` without some of them, and ``transformers``' ``get_last_checkpoint`` (what
``resume_from_checkpoint=True`` uses) takes the highest N that is a folder, complete or not.
Here a checkpoint is complete when the record of ``xla_fsdp_0/`` and its rank files' headers
read (no tensor bytes) and ``trainer_state.json`` parses; ``newest_complete`` skips, and names,
the newer ones that are not.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import List, Optional, Tuple

from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..checkpoint import CheckpointError, ShardedCheckpoint
from ..checkpoint.files import numbered_folders
from ..checkpoint.torch_xla_files import holds_rank_files

SHARDED_DIR = "xla_fsdp_0"
_NUMBERED = re.compile(rf"{re.escape(PREFIX_CHECKPOINT_DIR)}-(\d+)")  # the names get_last_checkpoint takes


def incomplete_reason(folder: Path) -> Optional[str]:
    """Why ``folder`` is not a complete checkpoint of accel_xla_fsdp's Trainer, or None if it is."""
    sharded = folder / SHARDED_DIR
    if not sharded.is_dir():
        if holds_rank_files(folder):
            return (
                f"no {SHARDED_DIR}/ but torch_xla's rank files: written by the stock Trainer's XLA FSDP path, "
                "which accel_xla_fsdp does not resume from (`accel-xla-fsdp convert-torch-xla` turns the model "
                "into one that from_pretrained loads)"
            )
        return (
            f"no {SHARDED_DIR}/ (the sharded model, which the Trainer saves first): its save was stopped before "
            "the model was written, or accel_xla_fsdp's Trainer did not write it"
        )
    try:
        ShardedCheckpoint(sharded).close()  # the record and every rank file's header: no tensor bytes
    except CheckpointError as e:
        return f"its sharded model does not read ({e})"
    state = folder / TRAINER_STATE_NAME
    if not state.is_file():
        return f"no {TRAINER_STATE_NAME} (the Trainer writes it at the end of a save: this one was stopped)"
    try:
        json.loads(state.read_bytes())
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return f"its {TRAINER_STATE_NAME} does not parse as JSON ({e}): its save was stopped while writing it"
    return None


def numbered_checkpoints(output_dir: Path) -> List[Path]:
    """The ``checkpoint-N`` folders of ``output_dir``, highest N first."""
    return numbered_folders(output_dir, _NUMBERED)[::-1]


def is_newest(path: str | os.PathLike, output_dir: str | Path) -> bool:
    """Whether ``path`` is the highest ``checkpoint-N`` of ``output_dir``: what ``get_last_checkpoint``
    returns, and what transformers' example scripts find with it and pass on as a path."""
    output_dir = Path(output_dir)
    newest = numbered_checkpoints(output_dir)[:1]
    return bool(newest) and Path(path).resolve() == newest[0].resolve()


def newest_complete(output_dir: str | Path) -> Tuple[Path, List[Tuple[Path, str]]]:
    """The newest complete ``checkpoint-N`` of ``output_dir``, and each newer one skipped with
    why. None complete: a ``CheckpointError`` naming the folder and what each one lacks."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        raise CheckpointError(f"{output_dir}: no such folder, so no checkpoint-N to resume from (args.output_dir)")
    skipped: List[Tuple[Path, str]] = []
    for folder in numbered_checkpoints(output_dir):
        reason = incomplete_reason(folder)
        if reason is None:
            return folder, skipped
        skipped.append((folder, reason))
    if not skipped:
        raise CheckpointError(f"{output_dir}: no checkpoint-N folder to resume from (the Trainer saves them there)")
    lacking = "; ".join(f"{folder.name}: {reason}" for folder, reason in skipped)
    raise CheckpointError(f"{output_dir}: no complete checkpoint-N folder to resume from ({lacking})")
