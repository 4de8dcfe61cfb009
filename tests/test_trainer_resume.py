"""Which ``checkpoint-N`` ``Trainer.train(resume_from_checkpoint=True)`` resumes from
(hf_trainer/resume.py), on folders made on disk: the newest complete one, each newer
incomplete one (as a save killed midway leaves it) skipped with why, and an explicit path that is
incomplete refused with the right reason. The launched end-to-end check is in test_trainer.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable, Dict

import pytest
from models import build, wrap

from accel_xla_fsdp import CheckpointError, Trainer, save_sharded
from accel_xla_fsdp.hf_trainer.resume import incomplete_reason, is_newest, newest_complete

MODEL = "nested_linear"


def save_one(rank: int, world: int, directory: str) -> None:
    save_sharded(wrap(MODEL, build(MODEL), rank, world, {}), None, directory)


@pytest.fixture(scope="module")
def sharded(pools, tmp_path_factory) -> Path:
    """A committed sharded save of 2 ranks, as the Trainer writes into ``checkpoint-N/xla_fsdp_0``."""
    directory = tmp_path_factory.mktemp("sharded") / "xla_fsdp_0"
    pools[2].run(save_one, 2, str(directory))
    return directory


def complete(output_dir: Path, step: int, sharded: Path) -> Path:
    folder = output_dir / f"checkpoint-{step}"
    shutil.copytree(sharded, folder / "xla_fsdp_0")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
    (folder / "scheduler.pt").write_bytes(b"")
    return folder


def no_sharded_dir(folder: Path) -> None:
    shutil.rmtree(folder / "xla_fsdp_0")
    (folder / "trainer_state.json").unlink()


def no_record(folder: Path) -> None:
    (folder / "xla_fsdp_0" / "save-000000" / "checkpoint.json").unlink()


def a_rank_file_missing(folder: Path) -> None:
    record = json.loads((folder / "xla_fsdp_0" / "save-000000" / "checkpoint.json").read_text())
    (folder / "xla_fsdp_0" / record["files"][1]).unlink()


def no_trainer_state(folder: Path) -> None:
    (folder / "trainer_state.json").unlink()


def truncated_trainer_state(folder: Path) -> None:
    state = folder / "trainer_state.json"
    state.write_bytes(state.read_bytes()[:10])


KILLED: Dict[str, Callable[[Path], None]] = {
    "no xla_fsdp_0/": no_sharded_dir,
    "no checkpoint.json": no_record,
    "rank 1's file of save save-000000 is missing": a_rank_file_missing,
    "no trainer_state.json": no_trainer_state,
    "trainer_state.json does not parse as JSON": truncated_trainer_state,
}


def test_the_newest_complete_one_among_other_folders(sharded, tmp_path) -> None:
    for step in (3, 9, 10):
        complete(tmp_path, step, sharded)
    # Not checkpoint-N folders: never taken, whatever their number or content.
    complete(tmp_path, 12, sharded).rename(tmp_path / "checkpoint-12-copy")
    complete(tmp_path, 13, sharded).rename(tmp_path / "my-checkpoint-13")
    (tmp_path / "checkpoint-14").write_text("a file, not a folder")
    (tmp_path / "runs").mkdir()
    assert newest_complete(tmp_path) == (tmp_path / "checkpoint-10", [])  # 10 after 9: numbers, not names
    assert newest_complete(str(tmp_path))[0] == tmp_path / "checkpoint-10"


@pytest.mark.parametrize("killed", KILLED, ids=lambda k: k.replace(" ", "_"))
def test_an_incomplete_newest_one_is_skipped_by_name(sharded, tmp_path, killed: str) -> None:
    complete(tmp_path, 3, sharded)
    chosen = complete(tmp_path, 6, sharded)
    incomplete = complete(tmp_path, 9, sharded)
    KILLED[killed](incomplete)
    folder, skipped = newest_complete(tmp_path)
    assert folder == chosen
    assert [f for f, _ in skipped] == [incomplete] and killed in skipped[0][1], skipped
    assert incomplete_reason(chosen) is None and incomplete_reason(incomplete) == skipped[0][1]


def test_every_incomplete_one_newer_than_the_complete_one_is_named(sharded, tmp_path) -> None:
    chosen = complete(tmp_path, 3, sharded)
    (tmp_path / "checkpoint-9").mkdir()  # killed before the model was written
    no_trainer_state(complete(tmp_path, 6, sharded))
    folder, skipped = newest_complete(tmp_path)
    assert folder == chosen
    assert [(f.name, "no xla_fsdp_0/" in r, "no trainer_state.json" in r) for f, r in skipped] == [
        ("checkpoint-9", True, False),
        ("checkpoint-6", False, True),
    ]


def test_none_complete_names_the_folder_and_what_each_lacks(sharded, tmp_path) -> None:
    no_record(complete(tmp_path, 3, sharded))
    truncated_trainer_state(complete(tmp_path, 6, sharded))
    with pytest.raises(CheckpointError) as e:
        newest_complete(tmp_path)
    message = str(e.value)
    assert str(tmp_path) in message and "no complete checkpoint-N" in message
    assert "checkpoint-6: its trainer_state.json does not parse" in message
    assert "checkpoint-3: its sharded model does not read" in message and "no checkpoint.json" in message


def test_no_checkpoint_folder_at_all(tmp_path) -> None:
    (tmp_path / "checkpoint-final").mkdir()
    with pytest.raises(CheckpointError, match="no checkpoint-N folder to resume from"):
        newest_complete(tmp_path)
    with pytest.raises(CheckpointError, match="missing: no such folder"):
        newest_complete(tmp_path / "missing")


def refusal(folder: Path) -> str:
    """What the Trainer says when asked to resume from ``folder`` by path (the check needs no Trainer)."""
    with pytest.raises(CheckpointError) as e:
        Trainer._load_from_checkpoint(None, str(folder))
    return str(e.value)


def test_the_highest_checkpoint_by_path_counts_as_the_newest(tmp_path, monkeypatch) -> None:
    # transformers' example scripts pass get_last_checkpoint(output_dir)'s path: the Trainer then
    # resolves it as resume_from_checkpoint=True, so a killed last save is skipped for them too.
    for step in (9, 10):
        (tmp_path / "out" / f"checkpoint-{step}").mkdir(parents=True)
    (tmp_path / "other" / "checkpoint-10").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert is_newest(tmp_path / "out" / "checkpoint-10", tmp_path / "out")
    assert is_newest("out/checkpoint-10/", "out")  # relative, trailing slash: as scripts write them
    assert not is_newest(tmp_path / "out" / "checkpoint-9", tmp_path / "out")
    assert not is_newest(tmp_path / "other" / "checkpoint-10", tmp_path / "out")
    assert not is_newest(tmp_path / "out" / "checkpoint-10", tmp_path / "missing")


def test_an_explicit_incomplete_path_is_refused_with_its_reason(sharded, tmp_path) -> None:
    killed = complete(tmp_path, 8, sharded)
    no_sharded_dir(killed)
    (killed / "training_args.bin").write_bytes(b"")
    message = refusal(killed)
    assert f"Cannot resume from {killed}: no xla_fsdp_0/" in message and "save was stopped" in message
    assert "convert-torch-xla" not in message and "resume_from_checkpoint=True" in message

    no_trainer_state(complete(tmp_path, 9, sharded))
    assert "no trainer_state.json" in refusal(tmp_path / "checkpoint-9")
    Trainer._load_from_checkpoint(None, str(complete(tmp_path, 10, sharded)))  # complete: no error


def test_the_stock_trainers_torch_xla_files_point_to_the_converter(tmp_path) -> None:
    folder = tmp_path / "checkpoint-8"
    folder.mkdir()
    for rank in (0, 1):
        (folder / f"rank{rank}-of-2-pytorch_model.bin").write_bytes(b"")
    (folder / "trainer_state.json").write_text("{}")
    message = refusal(folder)
    assert "torch_xla's rank files" in message and "convert-torch-xla" in message
