"""Checkpoints that survive what users' machines do to them: other filesystems, files of two runs,
corrupt bytes, malformed metadata, user folders in the checkpoint folder, read-only or full
disks, and processes killed with SIGKILL at any point.

Every refusal must name the file and the field at fault, end the command with exit status 1 and
no traceback, and leave what was there before exactly as it was.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

import pytest
import torch
from models import build, compute_loss, global_batch, local_slice, wrap
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from stores import record_file

from accel_xla_fsdp import CheckpointError, ReplicaError, ShardedCheckpoint, _xla, cli, load_sharded, save_sharded
from accel_xla_fsdp.checkpoint import sharded
from accel_xla_fsdp.checkpoint.files import current_umask
from accel_xla_fsdp.checkpoint.format import find_saves, read_header
from accel_xla_fsdp.param_group import shard_param_name

REPO = Path(__file__).resolve().parents[1]
MODEL = "nested_linear"
LAYOUT = {"flatten_parameters": True}


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: Any, optimizer: Any, rank: int, world: int, steps: range) -> None:
    for step in steps:
        x, y = (t.to(_xla.device()) for t in local_slice(global_batch(MODEL, step, 0, world), rank))
        compute_loss(MODEL, model, x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
        _xla.sync()


def two_runs(rank: int, world: int, first: str, second: str) -> Dict[str, torch.Tensor]:
    """One save into ``first``, one more step, another save into ``second``: both are
    ``save-000000`` of the same model, the second another run's as far as the files can tell."""
    model = wrap(MODEL, build(MODEL), rank, world, LAYOUT)
    optimizer = adamw(model)
    train(model, optimizer, rank, world, range(1))
    save_sharded(model, optimizer, first)
    state = model.full_state_dict()
    train(model, optimizer, rank, world, range(1, 2))
    save_sharded(model, optimizer, second)
    return state


@pytest.fixture(scope="module")
def runs(pools, tmp_path_factory) -> Dict[str, Any]:
    root = tmp_path_factory.mktemp("runs")
    state = pools[2].run(two_runs, 2, str(root / "one"), str(root / "two"))[0]
    return {"one": root / "one", "two": root / "two", "state": state}


def copy_of(ckpt: Path, tmp_path: Path, name: str = "ckpt") -> Path:
    target = tmp_path / name
    shutil.copytree(ckpt, target)
    return target


def rank_file(ckpt: Path, rank: int) -> Path:
    return ckpt / json.loads(record_file(ckpt).read_text())["files"][rank]


def snapshot(folder: Path) -> Dict[str, bytes]:
    """Every file under ``folder`` (hidden ones too) with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def run_cli(capsys, *args: str) -> str:
    """``accel-xla-fsdp ARGS`` in this process: must fail with status 1, a message and no traceback."""
    code = cli.main([*args, "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert err.startswith(f"accel-xla-fsdp {args[0]}: error: ") and "Traceback" not in err, err
    return err


def consolidated(out: Path) -> Dict[str, torch.Tensor]:
    tensors: Dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("model*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def assert_is_state(tensors: Dict[str, torch.Tensor], state: Dict[str, torch.Tensor]) -> None:
    assert sorted(tensors) == sorted(state)
    for name, value in state.items():
        assert torch.equal(tensors[name], value), name


def flip_a_bit(path: Path) -> None:
    """One bit of the last byte of a model shard's data."""
    header = read_header(path)
    shard = next(t for n, t in header.tensors.items() if n.startswith("model/") and t.end > t.begin)
    data = bytearray(path.read_bytes())
    data[header.data_start + shard.end - 1] ^= 0x01
    path.write_bytes(bytes(data))


def no_staging_left(*folders: Path) -> bool:
    return not [p for f in folders if f.exists() for p in f.iterdir() if ".consolidating-" in p.name]


# ---------------------------------------------------------------------------------------------
# Another filesystem


@pytest.fixture
def shm_dir() -> Any:
    path = Path(tempfile.mkdtemp(prefix="accel-xla-fsdp-test-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_overwrite_into_an_out_dir_on_another_filesystem(runs, tmp_path, shm_dir, capsys) -> None:
    """OUT_DIR is a symbolic link to tmpfs (/dev/shm), its parent on the checkout's disk: moving a
    file from beside OUT_DIR into it would cross filesystems (the `Invalid cross-device link`
    that lost both models); staged inside OUT_DIR, every move is a rename."""
    assert os.stat(shm_dir).st_dev != os.stat(tmp_path).st_dev
    out = tmp_path / "out"
    out.symlink_to(shm_dir, target_is_directory=True)
    assert cli.main(["consolidate", str(runs["one"]), str(out), "--no-progress", "--max-shard-size", "1KB"]) == 0
    (shm_dir / "tokenizer.json").write_text("{}")  # the user's: kept
    before = snapshot(shm_dir)
    # The new model is corrupt: refused after staging began, and the old one is untouched.
    bad = copy_of(runs["two"], tmp_path)
    path = rank_file(bad, 1)
    flip_a_bit(path)
    err = run_cli(capsys, "consolidate", str(bad), str(out), "--overwrite")
    assert f"{path}: the bytes of tensor 'model/" in err and "do not match the checksum" in err
    assert snapshot(shm_dir) == before and no_staging_left(shm_dir, tmp_path)
    # A good one replaces it: one file now, the old shards gone, the user's file kept.
    assert cli.main(["consolidate", str(runs["two"]), str(out), "--no-progress", "--overwrite"]) == 0
    assert sorted(p.name for p in shm_dir.iterdir()) == ["model.safetensors", "tokenizer.json"]
    assert no_staging_left(shm_dir, tmp_path)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == sorted(runs["state"])


def test_overwrite_into_an_out_dir_that_is_a_mount_point(runs, tmp_path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(out)]).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        assert os.stat(out).st_dev != os.stat(tmp_path).st_dev
        assert cli.main(["consolidate", str(runs["two"]), str(out), "--no-progress", "--max-shard-size", "1KB"]) == 0
        assert cli.main(["consolidate", str(runs["one"]), str(out), "--no-progress", "--overwrite"]) == 0
        assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"] and no_staging_left(out, tmp_path)
        assert_is_state(consolidated(out), runs["state"])
    finally:
        subprocess.run(["umount", str(out)], check=True)


def test_a_new_out_dir_on_another_filesystem(runs, tmp_path, shm_dir) -> None:
    out = shm_dir / "new" / "out"  # parents created too
    assert cli.main(["consolidate", str(runs["one"]), str(out), "--no-progress"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert_is_state(consolidated(out), runs["state"])


# ---------------------------------------------------------------------------------------------
# Files of two runs, corrupt bytes: refused by name everywhere


def test_a_rank_file_of_another_run_is_refused(runs, tmp_path, capsys) -> None:
    ckpt = copy_of(runs["one"], tmp_path)
    shutil.copyfile(rank_file(runs["two"], 1), rank_file(ckpt, 1))  # both are save-000000, rank 1 of 2
    with pytest.raises(CheckpointError, match="files of different runs are mixed") as e:
        ShardedCheckpoint(ckpt)
    assert str(rank_file(ckpt, 1)) in str(e.value)
    err = run_cli(capsys, "consolidate", str(ckpt), str(tmp_path / "out"))
    assert f"{rank_file(ckpt, 1)}: belongs to another run" in err and "run token" in err
    assert not (tmp_path / "out").exists()


def load_refused(rank: int, world: int, directory: str) -> Dict[str, Any]:
    """load_sharded into a fresh model: its error, and whether the model is as it was."""
    model = wrap(MODEL, build(MODEL), rank, world, LAYOUT)
    optimizer = adamw(model)
    before = model.full_state_dict()
    try:
        load_sharded(model, optimizer, directory)
        error = None
    except CheckpointError as e:
        error = str(e)
    after = model.full_state_dict()
    return {
        "error": error,
        "intact": all(torch.equal(before[k], after[k]) for k in before),
        "state": optimizer.state == {},
    }


def mixed(runs: Dict[str, Any], tmp_path: Path) -> Path:
    ckpt = copy_of(runs["one"], tmp_path)
    shutil.copyfile(rank_file(runs["two"], 1), rank_file(ckpt, 1))
    return ckpt


def corrupt(runs: Dict[str, Any], tmp_path: Path) -> Path:
    ckpt = copy_of(runs["one"], tmp_path)
    flip_a_bit(rank_file(ckpt, 1))
    return ckpt


def short_shard(runs: Dict[str, Any], tmp_path: Path) -> Path:
    ckpt = copy_of(runs["one"], tmp_path)
    path = rank_file(ckpt, 1)
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(path)
    key = next(k for k in tensors if k.startswith("model/"))
    tensors[key] = tensors[key][:-2].clone()
    save_file(tensors, str(path), metadata=meta)
    return ckpt


@pytest.mark.parametrize(
    "make,says",
    [
        (mixed, "files of different runs are mixed"),
        (corrupt, "do not match the checksum"),
        (short_shard, "elements (shape"),
    ],
    ids=["another run", "corrupt bytes", "short shard"],
)
def test_load_sharded_refuses_by_name_and_changes_nothing(pools, runs, tmp_path, make: Callable, says: str) -> None:
    ckpt = make(runs, tmp_path)
    results = pools[2].run(load_refused, 2, str(ckpt))
    for r in results:
        assert r["error"] is not None and says in r["error"], r["error"]
        assert r["intact"] and r["state"], "the model or optimizer changed before the refusal"
    assert any(str(rank_file(ckpt, 1)) in r["error"] for r in results)


def accelerate_save(rank: int, world: int, folder: str, steps: int) -> None:
    from accel_xla_fsdp import Accelerator

    acc = Accelerator()
    model = acc.prepare(torch.nn.Sequential(torch.nn.Linear(4, 3)))
    del model, steps
    acc.save_state(folder)


def accelerate_load(rank: int, world: int, folder: str) -> str:
    from accel_xla_fsdp import Accelerator

    acc = Accelerator()
    acc.prepare(torch.nn.Sequential(torch.nn.Linear(4, 3)))
    try:
        acc.load_state(folder)
    except CheckpointError as e:
        return str(e)
    return "loaded"


def test_accelerate_load_state_refuses_a_rank_file_of_another_run(pools, tmp_path) -> None:
    pools[2].run(accelerate_save, 2, str(tmp_path / "a"), 0)
    pools[2].run(accelerate_save, 2, str(tmp_path / "b"), 0)
    assert pools[2].run(accelerate_load, 2, str(tmp_path / "a")) == ["loaded", "loaded"]
    wrong = rank_file(tmp_path / "a" / "state-000000" / "xla_fsdp_0", 1)
    shutil.copyfile(rank_file(tmp_path / "b" / "state-000000" / "xla_fsdp_0", 1), wrong)
    for message in pools[2].run(accelerate_load, 2, str(tmp_path / "a")):
        assert f"{wrong}: belongs to another run" in message and "files of different runs are mixed" in message


def accelerate_round(rank: int, world: int, folder: str, seed: int) -> Dict[str, torch.Tensor]:
    """save_state of a model drawn from ``seed``; its state."""
    from accel_xla_fsdp import Accelerator

    acc = Accelerator()
    torch.manual_seed(seed)
    model = acc.prepare(torch.nn.Sequential(torch.nn.Linear(4, 3)))
    acc.save_state(folder)
    return acc.get_state_dict(model)


def accelerate_loaded(rank: int, world: int, folder: str) -> Any:
    from accel_xla_fsdp import Accelerator

    acc = Accelerator()
    model = acc.prepare(torch.nn.Sequential(torch.nn.Linear(4, 3)))
    try:
        acc.load_state(folder)
    except (CheckpointError, ValueError) as e:
        return str(e)
    return acc.get_state_dict(model)


def users_things(folder: Path) -> None:
    """What a user keeps in and beside a folder given to save_state (a backup named like ours)."""
    (folder / "logs").mkdir(parents=True)
    (folder / "logs" / "events").write_text("the user's")
    (folder / "README.md").write_text("the user's")
    for name in ("state.old", "state.partial"):
        (folder.parent / name).mkdir(exist_ok=True)
        (folder.parent / name / "backup").write_text("the user's")


def assert_users_things_kept(folder: Path) -> None:
    """The user's things are where they were; nothing of ours beside ``folder``."""
    assert (folder / "logs" / "events").read_text() == (folder / "README.md").read_text() == "the user's"
    for name in ("state.old", "state.partial"):
        assert (folder.parent / name / "backup").read_text() == "the user's"
    assert sorted(p.name for p in folder.parent.iterdir() if "accel-xla-fsdp" in p.name) == []


def test_save_state_replaces_only_what_it_wrote(pools, tmp_path) -> None:
    """save_state writes a folder of its own in the one given and removes the previous one after
    its record: the user's files in it, and folders beside it named like an older version's
    staging, are not touched."""
    folder = tmp_path / "state"
    users_things(folder)
    pools[2].run(accelerate_round, 2, str(folder), 1)
    second = pools[2].run(accelerate_round, 2, str(folder), 2)[0]
    assert_is_state(pools[2].run(accelerate_loaded, 2, str(folder))[0], second)
    assert_users_things_kept(folder)
    assert sorted(p.name for p in folder.iterdir()) == [
        "README.md",
        "accel_xla_fsdp_state.json",
        "logs",
        "state-000001",
    ]


def test_save_state_through_a_symlink_to_another_filesystem_and_into_a_mount_point(pools, tmp_path, shm_dir) -> None:
    """No folder is renamed ([Note: save_state folders]): a link to another filesystem is written
    through, and a mount point is saved into like any folder."""
    link = tmp_path / "state"
    link.symlink_to(shm_dir / "state", target_is_directory=True)
    pools[2].run(accelerate_round, 2, str(link), 1)
    second = pools[2].run(accelerate_round, 2, str(link), 2)[0]
    assert link.is_symlink() and record_file(shm_dir / "state" / "state-000001" / "xla_fsdp_0").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"] and sorted(os.listdir(shm_dir)) == ["state"]
    assert_is_state(pools[2].run(accelerate_loaded, 2, str(link))[0], second)
    mount = tmp_path / "volume"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)]).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        first = pools[2].run(accelerate_round, 2, str(mount), 1)[0]
        assert_is_state(pools[2].run(accelerate_loaded, 2, str(mount))[0], first)
        assert sorted(os.listdir(mount)) == ["accel_xla_fsdp_state.json", "state-000000"]
    finally:
        subprocess.run(["umount", str(mount)], check=True)


# ---------------------------------------------------------------------------------------------
# Malformed metadata and records: a refusal naming the file and the field, nothing written


def edit_meta(path: Path, edit: Callable[[Dict[str, Any]], Any]) -> None:
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    raw = json.loads(meta["accel_xla_fsdp"])
    new = edit(raw)
    meta["accel_xla_fsdp"] = new if isinstance(new, str) else json.dumps(raw)
    save_file(load_file(path), str(path), metadata=meta)


def set_field(*path: Any, value: Any) -> Callable[[Dict[str, Any]], None]:
    def edit(raw: Dict[str, Any]) -> None:
        node = raw
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return edit


CASES = {
    "float where an integer belongs": (
        set_field("groups", 0, "shard_numel", value=1.5),
        ["field 'shard_numel'", "expected an integer", "1.5"],
    ),
    "string where an integer belongs": (
        set_field("groups", 1, "params", 0, "offset", value="0"),
        ["field 'offset'", "expected an integer"],
    ),
    "a negative shape": (set_field("groups", 0, "params", 0, "shape", value=[-4, 8]), ["field 'shape'", "-4"]),
    "deep nesting": (lambda raw: "[" * 100_000 + "]" * 100_000, ["nested too deeply"]),
    "a name that is not UTF-8": (
        set_field("groups", 0, "params", 0, "name", value="module.0.\udc80weight"),
        ["is not valid UTF-8", "field 'name'"],
    ),
    "two groups with one key": (lambda raw: raw["groups"].append(raw["groups"][0]), ["is listed twice"]),
    "a rank out of range": (set_field("rank", value=7), ["field 'rank'", "from 0 to 1"]),
    "a dtype of nothing": (set_field("groups", 0, "dtype", value="float128"), ["field 'dtype'", "float128"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_malformed_metadata_is_refused_by_file_and_field(runs, tmp_path, capsys, case: str) -> None:
    edit, says = CASES[case]
    ckpt = copy_of(runs["one"], tmp_path)
    path = rank_file(ckpt, 0)
    edit_meta(path, edit)
    out = tmp_path / "out"
    assert cli.main(["consolidate", str(runs["one"]), str(out), "--no-progress"]) == 0
    before = snapshot(out)
    err = run_cli(capsys, "consolidate", str(ckpt), str(out), "--overwrite")
    assert str(path) in err, err
    for part in says:
        assert part in err, err
    assert snapshot(out) == before and no_staging_left(out, tmp_path)


def test_a_record_listing_fewer_files_than_the_world(runs, tmp_path, capsys) -> None:
    ckpt = copy_of(runs["one"], tmp_path)
    path = record_file(ckpt)
    record = json.loads(path.read_text())
    record["files"] = record["files"][:1]
    path.write_text(json.dumps(record))
    err = run_cli(capsys, "consolidate", str(ckpt), str(tmp_path / "out"))
    assert f"{path}: lists 1 rank files for a world of 2" in err
    assert not (tmp_path / "out").exists()


def test_a_record_naming_a_path_outside_the_checkpoint(runs, tmp_path, capsys) -> None:
    ckpt = copy_of(runs["one"], tmp_path)
    record = json.loads(record_file(ckpt).read_text())
    record["files"][1] = "../../etc/passwd"
    record_file(ckpt).write_text(json.dumps(record))
    err = run_cli(capsys, "consolidate", str(ckpt), str(tmp_path / "out"))
    assert "files[1]: expected a path like 'save-000000/rank-00001-of-00002.safetensors'" in err


# ---------------------------------------------------------------------------------------------
# torch_xla input


def torch_xla_files(directory: Path, edit: Callable[[int, Dict[str, Any]], None] = lambda r, c: None) -> torch.Tensor:
    """Two rank files as torch_xla's FSDP writes them for a root holding one 20 x 16 parameter
    (flattened, padded to a multiple of 2 x 128 elements: 2 shards of 256); returns it."""
    directory.mkdir(parents=True, exist_ok=True)
    weight = torch.arange(320, dtype=torch.float32).reshape(20, 16)
    key = shard_param_name("_fsdp_wrapped_module.weight")
    full = torch.zeros(512)
    full[:320] = weight.reshape(-1)
    for rank in range(2):
        ckpt = {
            "model": {key: full[rank * 256 : (rank + 1) * 256].clone()},
            "shard_metadata": {
                "shard_info": {
                    "": {key: {"_orig_size": torch.Size([20, 16]), "_orig_name": "_fsdp_wrapped_module.weight"}}
                },
                "flatten_info": {},
                "buffer_info": {},
                "world_size": 2,
                "rank": rank,
            },
        }
        edit(rank, ckpt)
        torch.save(ckpt, directory / f"final_ckpt_rank-{rank:08d}-of-{2:08d}.pth")
    return weight


def test_torch_xla_files_as_torch_xla_writes_them_convert(tmp_path) -> None:
    weight = torch_xla_files(tmp_path / "in")
    assert cli.main(["convert-torch-xla", str(tmp_path / "in"), str(tmp_path / "out"), "--no-progress"]) == 0
    assert torch.equal(load_file(tmp_path / "out" / "model.safetensors")["weight"], weight)


def _meta(rank: int, ckpt: Dict[str, Any]) -> Dict[str, Any]:
    return ckpt["shard_metadata"]


TORCH_XLA_CASES = {
    "shard_metadata of another type": (
        lambda r, c: c.__setitem__("shard_metadata", [1, 2]),
        ["shard_metadata: expected a dict, found list"],
    ),
    "shard_info without the shard": (
        lambda r, c: _meta(r, c)["shard_info"][""].clear(),
        ["has no entry in its shard_metadata"],
    ),
    "_orig_size smaller than the data": (
        lambda r, c: next(iter(_meta(r, c)["shard_info"][""].values())).__setitem__(
            "_orig_size", torch.Size([10, 16])
        ),
        ["'_orig_size' [10, 16]", "does not fit the 2 shards"],
    ),
    "_orig_size of another type": (
        lambda r, c: next(iter(_meta(r, c)["shard_info"][""].values())).__setitem__("_orig_size", "3x4"),
        ["'_orig_size'", "expected a shape"],
    ),
    "a rank's shard in another dtype": (
        lambda r, c: r == 1 and c["model"].update({k: v.half() for k, v in c["model"].items()}),
        ["is torch.float16", "rank 0's file"],
    ),
    "a world size that is not an integer": (
        lambda r, c: _meta(r, c).__setitem__("world_size", 2.0),
        ["its metadata says rank"],
    ),
}


@pytest.mark.parametrize("case", list(TORCH_XLA_CASES))
def test_malformed_torch_xla_files_are_refused(tmp_path, capsys, case: str) -> None:
    edit, says = TORCH_XLA_CASES[case]
    torch_xla_files(tmp_path / "in", edit)
    err = run_cli(capsys, "convert-torch-xla", str(tmp_path / "in"), str(tmp_path / "out"))
    assert "final_ckpt_rank-0000000" in err, err
    for part in says:
        assert part in err, err
    assert not (tmp_path / "out").exists()


def test_deeply_nested_torch_xla_metadata_is_refused_as_such(tmp_path, capsys) -> None:
    """Unpickling nests without limit; comparing the ranks' metadata recursed into a RecursionError,
    reported as files of different checkpoints mixed."""
    nested: List[Any] = []
    for _ in range(5000):
        nested = [nested]
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(50_000)  # for torch.save to write it
    try:
        torch_xla_files(tmp_path / "in", lambda r, c: _meta(r, c).__setitem__("extra", nested))
    finally:
        sys.setrecursionlimit(limit)
    err = run_cli(capsys, "convert-torch-xla", str(tmp_path / "in"), str(tmp_path / "out"))
    assert "final_ckpt_rank-00000001-of-00000002.pth: its shard_metadata is nested too deeply" in err, err
    assert not (tmp_path / "out").exists()


def test_a_huge_world_size_in_a_file_name_is_refused_at_once(tmp_path, capsys) -> None:
    (tmp_path / "x_rank-0-of-99999999999.pth").write_bytes(b"")
    start = time.perf_counter()
    err = run_cli(capsys, "convert-torch-xla", str(tmp_path), str(tmp_path / "out"))
    assert time.perf_counter() - start < 5
    assert "x_rank-0-of-99999999999.pth: rank 0 of 99999999999 in its name is not a rank of a world size" in err
    (tmp_path / "x_rank-0-of-99999999999.pth").unlink()
    (tmp_path / "x_rank-0-of-99999.pth").write_bytes(b"")
    err = run_cli(capsys, "convert-torch-xla", str(tmp_path), str(tmp_path / "out"))
    assert "the names say a world of 99999 ranks, 1 rank file(s) are present" in err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# Permissions, read-only and full disks


def as_nobody(args: List[str], **kw: Any) -> subprocess.CompletedProcess:
    """The command as another user (nobody) when we are root, else as ourselves."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": "/tmp"}
    prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if os.geteuid() == 0 else []
    return subprocess.run(
        prefix + [sys.executable, "-m", "accel_xla_fsdp", *args, "--no-progress"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        **kw,
    )


def test_rank_files_are_readable_as_the_umask_allows_and_read_only_out_dirs_refused(runs, shm_dir) -> None:
    mode = 0o666 & ~current_umask()
    for rank in range(2):
        assert os.stat(rank_file(runs["one"], rank)).st_mode & 0o777 == mode
    assert mode & 0o044, "this test needs a umask that lets others read"
    os.chmod(shm_dir, 0o755)
    ckpt = shm_dir / "ckpt"
    shutil.copytree(runs["one"], ckpt)  # keeps the files' modes
    # Another user reads the rank files (0600 files gave "No such file or directory")...
    (shm_dir / "theirs").mkdir(mode=0o777)
    os.chmod(shm_dir / "theirs", 0o777)
    done = as_nobody(["consolidate", str(ckpt), str(shm_dir / "theirs" / "out")])
    assert done.returncode == 0, done.stderr
    # ... and cannot write into a folder that is not theirs: refused before anything is written.
    (shm_dir / "mine").mkdir()
    if os.geteuid() != 0:
        os.chmod(shm_dir / "mine", 0o555)
    done = as_nobody(["consolidate", str(ckpt), str(shm_dir / "mine" / "out")])
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert f"{shm_dir / 'mine'}: not writable" in done.stderr
    assert list((shm_dir / "mine").iterdir()) == []


@pytest.fixture
def small_tmpfs(tmp_path) -> Any:
    """A 256 KiB tmpfs, mounted for the test (root only)."""
    mount = tmp_path / "small"
    mount.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)]).returncode
    ):
        pytest.skip("mounting a tmpfs needs root")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_disk_without_room_is_refused_before_writing(runs, small_tmpfs, capsys) -> None:
    (small_tmpfs / "filler").write_bytes(b"\0" * 200 * 1024)
    err = run_cli(capsys, "consolidate", str(runs["one"]), str(small_tmpfs / "out"))
    assert re.search(
        rf"{small_tmpfs}: \d+\.\d\d kB free, the model takes \d+\.\d\d kB \(and 1.05 MB is kept spare\)", err
    )
    assert sorted(p.name for p in small_tmpfs.iterdir()) == ["filler"]


def save_refused(rank: int, world: int, directory: str) -> str:
    model = wrap(MODEL, build(MODEL), rank, world, LAYOUT)
    try:
        save_sharded(model, None, directory)
    except CheckpointError as e:
        return str(e)
    return "saved"


def test_a_save_without_room_is_refused_on_every_rank_before_writing(pools, small_tmpfs) -> None:
    (small_tmpfs / "filler").write_bytes(b"\0" * 200 * 1024)
    ckpt = small_tmpfs / "ckpt"
    for rank, message in enumerate(pools[2].run(save_refused, 2, str(ckpt))):
        says = rf"{small_tmpfs}: \d+\.\d\d kB free, rank {rank}'s file takes \d+ bytes \(and 1.05 MB is kept spare\)"
        assert re.search(says, message), message
    assert sorted(p.name for p in small_tmpfs.iterdir()) == ["filler"]


# ---------------------------------------------------------------------------------------------
# save_sharded: only our own folders, leftovers of killed saves cleaned up


def save_killed(rank: int, world: int, directory: str, point: str) -> None:
    """Save once, train a step, then die (SIGKILL) at ``point`` of the second save."""
    model = wrap(MODEL, build(MODEL), rank, world, LAYOUT)
    optimizer = adamw(model)
    train(model, optimizer, rank, world, range(1))
    save_sharded(model, optimizer, directory)
    train(model, optimizer, rank, world, range(1, 2))
    die = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
    if point == "marking the new folder":  # the marker written, no rank file yet
        real = sharded._mark
        sharded._mark = lambda *args: (real(*args), die())
    elif point == "writing rank files":  # rank files partly written
        real_write = sharded.write_rank_file
        sharded.write_rank_file = lambda f, *args: (real_write(f, *args), f.flush(), f.truncate(100), die())
    elif point == "before the commit":  # every rank file written and confirmed
        sharded._commit = die
    elif point == "after the commit":  # committed, the older save not removed yet
        sharded._remove_save = die
    save_sharded(model, optimizer, directory)


def load_then_save(rank: int, world: int, directory: str) -> Dict[str, torch.Tensor]:
    model = wrap(MODEL, build(MODEL), rank, world, LAYOUT)
    optimizer = adamw(model)
    load_sharded(model, optimizer, directory)
    state = model.full_state_dict()
    save_sharded(model, optimizer, directory)
    return state


def state_after(rank: int, world: int, steps: int) -> Dict[str, torch.Tensor]:
    model = wrap(MODEL, build(MODEL), rank, world, LAYOUT)
    train(model, adamw(model), rank, world, range(steps))
    return model.full_state_dict()


@pytest.mark.parametrize(
    "point", ["marking the new folder", "writing rank files", "before the commit", "after the commit"]
)
def test_a_killed_save_leaves_the_checkpoint_and_the_next_save_no_stray_files(pools, tmp_path, point: str) -> None:
    ckpt = tmp_path / "ckpt"
    # A user's folder in the checkpoint folder: a copy of a save, with a file named like ours.
    best = ckpt / "save-best"
    best.mkdir(parents=True)
    (best / ".rank-00000-of-00002.safetensors.tmp-1").write_text("the user's")
    with pytest.raises(ReplicaError, match="SIGKILL"):
        pools[2].run(save_killed, 2, str(ckpt), point)
    found = find_saves(ckpt)
    committed = found.record.save_id
    assert committed == ("save-000001" if point == "after the commit" else "save-000000")
    assert found.incomplete == (() if point == "after the commit" else ("save-000001",))  # skipped, named
    loaded = pools[2].run(load_then_save, 2, str(ckpt))[0]  # the checkpoint is whole; save again
    assert_is_state(loaded, pools[2].run(state_after, 2, 2 if point == "after the commit" else 1)[0])
    record = json.loads(record_file(ckpt).read_text())
    assert sorted(p.name for p in ckpt.iterdir()) == sorted(["save-best", record["save_id"]])
    assert record["save_id"] > committed
    assert sorted(p.name for p in (ckpt / record["save_id"]).iterdir()) == [
        "checkpoint.json",
        *[f"rank-0000{r}-of-00002.safetensors" for r in range(2)],
        "started.json",
    ]
    assert [p.name for p in best.iterdir()] == [".rank-00000-of-00002.safetensors.tmp-1"]


# ---------------------------------------------------------------------------------------------
# consolidate killed with SIGKILL


KILLER = """
import importlib, os, signal, sys, time
from pathlib import Path
from accel_xla_fsdp import cli
c = importlib.import_module("accel_xla_fsdp.checkpoint.consolidate")  # the module, not the function

point = sys.argv[1]
die = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
if point == "writing":
    real, calls = c.write_safetensors, []
    def write(path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            Path(path).write_bytes(b"partial")
            die()
        return real(path, *args, **kwargs)
    c.write_safetensors = write
elif point == "before the commit":
    c.commit = die
elif point == "waiting to be killed":
    c.commit = lambda *a, **k: (print("READY", flush=True), time.sleep(60))
elif point == "amid the commit":
    real_replace, moves = os.replace, []
    def replace(a, b):
        moves.append(a)
        if len(moves) == 2:
            die()
        real_replace(a, b)
    c.os.replace = replace
sys.exit(cli.main(sys.argv[2:]))
"""


@pytest.mark.parametrize("point", ["writing", "before the commit", "waiting to be killed", "amid the commit"])
def test_a_killed_consolidation_leaves_the_old_model_and_the_next_one_no_stray_files(
    runs, tmp_path, point: str
) -> None:
    out = tmp_path / "out"
    assert cli.main(["consolidate", str(runs["one"]), str(out), "--no-progress", "--max-shard-size", "1KB"]) == 0
    before = snapshot(out)
    (tmp_path / ".out.consolidating-12345-0badc0de").mkdir()  # what an earlier version left beside OUT_DIR
    args = [
        point,
        "consolidate",
        str(runs["two"]),
        str(out),
        "--no-progress",
        "--overwrite",
        "--max-shard-size",
        "1KB",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", KILLER, *args], stdout=subprocess.PIPE, text=True, env=env)
    if point == "waiting to be killed":
        assert proc.stdout.readline().strip() == "READY"
        os.kill(proc.pid, signal.SIGKILL)  # a real kill -9 from outside
    assert proc.wait(timeout=300) == -signal.SIGKILL
    proc.stdout.close()
    left = [p.name for p in out.iterdir() if ".consolidating-" in p.name]
    assert len(left) == 1
    if point != "amid the commit":
        assert {k: v for k, v in snapshot(out).items() if ".consolidating-" not in k} == before
    # The next consolidation finishes or removes what the killed one left, then does its work.
    assert cli.main(["consolidate", str(runs["two"]), str(out), "--no-progress", "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert no_staging_left(out, tmp_path)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == sorted(runs["state"])


# ---------------------------------------------------------------------------------------------
# Checkpoints of format 1 (before run tokens and checksums)


def as_format_1(ckpt: Path) -> None:
    """``ckpt`` rewritten as version 1 wrote it: no token, no checksums, one record at the top."""
    record = json.loads(record_file(ckpt).read_text())
    for name in record["files"]:

        def old(raw: Dict[str, Any]) -> None:
            raw["format"] = "accel-xla-fsdp/1"
            del raw["token"], raw["checksums"]

        edit_meta(ckpt / name, old)
    record_file(ckpt).unlink()
    (ckpt / record["save_id"] / "started.json").unlink()
    record = {"format": "accel-xla-fsdp/1", **{k: record[k] for k in ("save_id", "world_size", "files")}}
    (ckpt / "checkpoint.json").write_text(json.dumps(record))


def test_format_1_checkpoints_are_read_and_saved_over(pools, runs, tmp_path) -> None:
    ckpt = copy_of(runs["one"], tmp_path)
    as_format_1(ckpt)
    assert ShardedCheckpoint(ckpt).format == "accel-xla-fsdp/1"
    assert cli.main(["consolidate", str(ckpt), str(tmp_path / "out"), "--no-progress"]) == 0
    assert_is_state(consolidated(tmp_path / "out"), runs["state"])
    (ckpt / "save-best").mkdir()
    loaded = pools[2].run(load_then_save, 2, str(ckpt))[0]  # a format-2 save over it
    assert_is_state(loaded, runs["state"])
    record = json.loads(record_file(ckpt).read_text())
    assert record["format"] == "accel-xla-fsdp/2" and record["save_id"] == "save-000001"
    assert sorted(p.name for p in ckpt.iterdir()) == ["save-000001", "save-best"]
