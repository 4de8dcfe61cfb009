"""Consolidation into the Hugging Face layout: ``consolidate`` and ``accel-xla-fsdp consolidate``.

A tiny ``LlamaForCausalLM`` is trained a few steps with AdamW on 2 devices (flat shards, untied
embeddings) and on 4 (shards on dim 0, tied embeddings) and saved with ``save_sharded``; its
consolidation must load with ``AutoModelForCausalLM.from_pretrained`` into exactly the trained
model. Bad input must end with a message naming the file or key, a non-zero exit, and nothing
left behind.
"""

from __future__ import annotations

import importlib
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List

import pytest
import tomllib
import torch
from models import LLAMA_CONFIG, compute_loss, global_batch, local_slice, wrap
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from stores import record_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from accel_xla_fsdp import _xla, cli, consolidate, load_sharded, save_sharded, seeded
from accel_xla_fsdp.checkpoint import sharded

REPO = Path(__file__).resolve().parents[1]
# the module (its package exports the function of the same name)
consolidate_module = importlib.import_module("accel_xla_fsdp.checkpoint.consolidate")
STEPS = 2


def llama_config(tied: bool) -> LlamaConfig:
    return LlamaConfig(**dict(LLAMA_CONFIG, tie_word_embeddings=tied))


def build_llama(tied: bool) -> LlamaForCausalLM:
    with seeded(0):
        return LlamaForCausalLM(
            LlamaConfig(**dict(LLAMA_CONFIG, tie_word_embeddings=tied), attn_implementation="eager")
        )


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train_and_save(
    rank: int, world: int, tied: bool, layout: Dict, saves: List[str], plain_saves: List[str]
) -> Dict[str, torch.Tensor]:
    model = wrap("llama", build_llama(tied), rank, world, layout)
    optimizer = adamw(model)
    for step in range(STEPS):
        x, _ = (t.to(_xla.device()) for t in local_slice(global_batch("llama", step, 0, world), rank))
        compute_loss("llama", model, x, x).backward()
        optimizer.step()
        optimizer.zero_grad()
        _xla.sync()
    for directory in saves:
        save_sharded(model, optimizer, directory)
    for directory in plain_saves:  # without the optimizer
        save_sharded(model, None, directory)
    return model.full_state_dict()


def optimizer_shards(rank: int, world: int, tied: bool, directory: str) -> Dict[str, Any]:
    """This replica's optimizer state the other way: loaded by load_sharded into per-parameter
    shards, by ``<parameter>.<state>``, with each parameter's shape."""
    model = wrap("llama", build_llama(tied), rank, world, {})
    optimizer = adamw(model)
    load_sharded(model, optimizer, directory)
    state, shapes = {}, {}
    for prefix, _, group in sharded._groups_of(model):
        (entry,) = sharded._param_entries(prefix, group)
        shapes[entry.name] = entry.shape
        for key, value in optimizer.state[group.shard].items():
            state[f"{entry.name}.{key}"] = value.detach().cpu()
    return {"state": state, "shapes": shapes}


def full_optimizer_state(replicas: List[Dict[str, Any]]) -> Dict[str, torch.Tensor]:
    """Per-parameter shards put together as torch_xla does: concatenated, padding cut off."""
    full = {}
    for name, first in replicas[0]["state"].items():
        if first.dim() == 0:  # step: the same on every replica
            full[name] = first
            continue
        shape = replicas[0]["shapes"][name.rsplit(".", 1)[0]]
        flat = torch.cat([r["state"][name].reshape(-1) for r in replicas])
        full[name] = flat[: _numel(shape)].view(shape)
    return full


def _numel(shape) -> int:
    return int(torch.Size(shape).numel())


@dataclass
class Run:
    ckpt: Path
    config: Path  # a folder holding config.json
    state: Dict[str, torch.Tensor]  # the trained model's full_state_dict()
    tied: bool
    other_save: Path = None  # the same model saved twice more (save-000001), without optimizer


@pytest.fixture(scope="module")
def runs(pools, tmp_path_factory) -> Dict[str, Run]:
    made = {}
    for name, world, tied, layout in [
        ("untied", 2, False, {"flatten_parameters": True}),
        ("tied", 4, True, {"shard_param_on_dim_0": True}),
    ]:
        root = tmp_path_factory.mktemp(name)
        ckpt, other, config = root / "ckpt", root / "other", root / "config"
        plain = [str(other), str(other)] if name == "untied" else []
        state = pools[world].run(train_and_save, world, tied, layout, [str(ckpt)], plain)[0]
        llama_config(tied).save_pretrained(config)
        made[name] = Run(ckpt, config, state, tied, other if plain else None)
    return made


def load_pretrained(directory: Path, **kwargs) -> torch.nn.Module:
    model, info = AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True, **kwargs)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys, no errors
    return model


def assert_loads_the_trained_model(directory: Path, run: Run, **kwargs) -> torch.nn.Module:
    model = load_pretrained(directory, **kwargs)
    loaded = {**dict(model.named_parameters()), **dict(model.named_buffers())}  # non-persistent ones too
    for name, value in run.state.items():
        assert torch.equal(loaded[name], value.to(loaded[name].dtype)), name
    if run.tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    else:
        assert not torch.equal(loaded["lm_head.weight"], loaded["model.embed_tokens.weight"])
    return model


def param_names(run: Run) -> List[str]:
    return [n for n in run.state if "rotary_emb" not in n]  # full_state_dict: each parameter once, then buffers


@pytest.mark.parametrize("which", ["untied", "tied"])
def test_from_pretrained_loads_the_trained_model(runs, tmp_path, which: str) -> None:
    run = runs[which]
    out = consolidate(run.ckpt, tmp_path / "out", config=run.config, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    tensors = load_file(out / "model.safetensors")
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    # transformers' own names: tied weights once (the embedding), no non-persistent buffer
    assert sorted(tensors) == sorted(param_names(run))
    assert ("lm_head.weight" in tensors) == (not run.tied)
    for name, value in tensors.items():
        assert torch.equal(value, run.state[name]), name
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    assert_loads_the_trained_model(out, run)


def test_console_script_writes_shards_and_an_index(runs, tmp_path) -> None:
    run = runs["tied"]
    out = tmp_path / "out"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "accel_xla_fsdp.cli",
            "consolidate",
            str(run.ckpt),
            str(out),
            "--config",
            str(run.config),
            "--max-shard-size",
            "40KB",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "consolidating" in done.stderr and "100%" in done.stderr  # the progress bar
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 2 and files == sorted(p.name for p in out.glob("model-*.safetensors"))
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors" and not (out / "model.safetensors").exists()
    assert sorted(index["weight_map"]) == sorted(param_names(run))
    total = 0
    for name in files:
        tensors = load_file(out / name)
        assert sorted(tensors) == sorted(k for k, v in index["weight_map"].items() if v == name)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= 40_000 or len(tensors) == 1
        total += size
    assert index["metadata"]["total_size"] == total
    assert_loads_the_trained_model(out, run)


@pytest.mark.parametrize("which", ["untied", "tied"])
def test_without_a_config_parameters_keep_their_first_name(runs, tmp_path, which: str) -> None:
    run = runs[which]
    out = consolidate(run.ckpt, tmp_path / "out", progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert sorted(load_file(out / "model.safetensors")) == sorted(param_names(run))  # no buffers
    shutil.copyfile(run.config / "config.json", out / "config.json")  # as a user would
    assert_loads_the_trained_model(out, run)


def test_config_object(runs, tmp_path) -> None:
    run = runs["tied"]
    out = consolidate(run.ckpt, tmp_path / "out", config=llama_config(True), progress=False)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert_loads_the_trained_model(out, run)


def test_dtype_bfloat16(runs, tmp_path) -> None:
    run = runs["tied"]
    out = consolidate(run.ckpt, tmp_path / "out", config=run.config, dtype="bfloat16", progress=False)
    tensors = load_file(out / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    model = assert_loads_the_trained_model(out, run, dtype="auto")
    assert model.dtype == torch.bfloat16
    for name, value in tensors.items():
        assert torch.equal(value, run.state[name].to(torch.bfloat16)), name


@pytest.mark.parametrize("which", ["untied", "tied"])
def test_optimizer_state(pools, runs, tmp_path, which: str) -> None:
    run = runs[which]
    out = consolidate(run.ckpt, tmp_path / "out", config=run.config, optimizer=True, progress=False)
    state = load_file(out / "optimizer.safetensors")
    want = full_optimizer_state(pools[2].run(optimizer_shards, 2, run.tied, str(run.ckpt)))
    assert sorted(state) == sorted(want)
    for name, value in want.items():
        assert torch.equal(state[name], value), name
    assert {n.rsplit(".", 1)[1] for n in state} == {"exp_avg", "exp_avg_sq", "step"}
    assert float(state["model.norm.weight.step"]) == STEPS
    meta = json.loads((out / "optimizer.json").read_text())
    assert meta["type"] == "AdamW" and len(meta["param_groups"]) == 1
    group = meta["param_groups"][0]
    assert group["lr"] == 1e-2 and group["weight_decay"] == 0.1 and sorted(group["params"]) == sorted(param_names(run))
    assert_loads_the_trained_model(out, run)


def test_the_console_script_is_registered() -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    module, func = scripts["accel-xla-fsdp"].split(":")
    assert module == "accel_xla_fsdp.cli" and getattr(cli, func) is cli.main


# ---------------------------------------------------------------------------------------------
# Bad input: a message naming the file or key, exit status 1 (2 for arguments), nothing left


def copy_of(run: Run, tmp_path: Path) -> Path:
    target = tmp_path / "ckpt"
    shutil.copytree(run.ckpt, target)
    return target


def rank_file(ckpt: Path, rank: int) -> Path:
    return ckpt / json.loads(record_file(ckpt).read_text())["files"][rank]


def assert_refused(capsys, tmp_path: Path, ckpt: Path, *options: str, says: List[str], out: Path = None) -> None:
    out = out or tmp_path / "out"
    code = cli.main(["consolidate", str(ckpt), str(out), "--no-progress", *options])
    err = capsys.readouterr().err
    assert code == 1, err
    assert err.startswith("accel-xla-fsdp consolidate: error: ") and "Traceback" not in err
    for part in says:
        assert part in err, err
    assert not [p for p in out.parent.iterdir() if ".consolidating-" in p.name]


def nothing_left(tmp_path: Path) -> bool:
    return not (tmp_path / "out").exists()


def test_missing_rank_file(runs, tmp_path, capsys) -> None:
    ckpt = copy_of(runs["untied"], tmp_path)
    rank_file(ckpt, 1).unlink()
    assert_refused(
        capsys, tmp_path, ckpt, says=[str(rank_file(ckpt, 1)), "rank 1's file of save save-000000 is missing"]
    )
    assert nothing_left(tmp_path)


def test_console_script_fails_cleanly(runs, tmp_path) -> None:
    ckpt = copy_of(runs["untied"], tmp_path)
    rank_file(ckpt, 1).unlink()
    done = subprocess.run(
        [sys.executable, "-m", "accel_xla_fsdp", "consolidate", str(ckpt), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert done.returncode == 1
    assert (
        "Traceback" not in done.stderr
        and f"{rank_file(ckpt, 1)}: rank 1's file of save save-000000 is missing" in done.stderr
    )
    assert nothing_left(tmp_path)


def test_rank_file_of_another_save(runs, tmp_path, capsys) -> None:
    ckpt = copy_of(runs["untied"], tmp_path)
    shutil.copyfile(rank_file(runs["untied"].other_save, 1), rank_file(ckpt, 1))
    assert_refused(
        capsys,
        tmp_path,
        ckpt,
        says=[
            str(rank_file(ckpt, 1)),
            "belongs to save 'save-000001' (rank 1 of 2)",
            "files of different saves are mixed",
        ],
    )
    assert nothing_left(tmp_path)


def test_rank_file_of_another_world_size(runs, tmp_path, capsys) -> None:
    ckpt = copy_of(runs["untied"], tmp_path)
    shutil.copyfile(rank_file(runs["tied"].ckpt, 1), rank_file(ckpt, 1))
    assert_refused(
        capsys, tmp_path, ckpt, says=[str(rank_file(ckpt, 1)), "(rank 1 of 4)", "names save 'save-000000' of 2 ranks"]
    )
    assert nothing_left(tmp_path)


def test_truncated_rank_file(runs, tmp_path, capsys) -> None:
    ckpt = copy_of(runs["untied"], tmp_path)
    path = rank_file(ckpt, 1)
    path.write_bytes(path.read_bytes()[:-100])
    assert_refused(capsys, tmp_path, ckpt, says=[f"{path}: not a readable safetensors file"])
    assert nothing_left(tmp_path)


def test_corrupt_rank_file_header(runs, tmp_path, capsys) -> None:
    ckpt = copy_of(runs["untied"], tmp_path)
    path = rank_file(ckpt, 0)
    data = bytearray(path.read_bytes())
    data[8:40] = b"\x00\xff" * 16  # garbage where the JSON header starts
    path.write_bytes(bytes(data))
    assert_refused(capsys, tmp_path, ckpt, says=[f"{path}: not a readable safetensors file"])
    assert nothing_left(tmp_path)


def rewrite(path: Path, edit_tensors=None, edit_meta=None) -> None:
    """Write a rank file again with its tensors or its layout metadata changed."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(path)
    if edit_tensors:
        edit_tensors(tensors)
    if edit_meta:
        meta["accel_xla_fsdp"] = edit_meta(meta["accel_xla_fsdp"])
    save_file(tensors, str(path), metadata=meta)


def test_metadata_that_does_not_match_the_tensors(runs, tmp_path, capsys) -> None:
    ckpt = copy_of(runs["untied"], tmp_path)
    path = rank_file(ckpt, 1)
    key = next(k for k in load_file(path) if k.startswith("model/") and "layers.1" in k)
    rewrite(path, edit_tensors=lambda t: t.__setitem__(key, t[key][:-3].clone()))
    assert_refused(capsys, tmp_path, ckpt, says=[str(path), repr(key), "elements", "its metadata says"])
    assert nothing_left(tmp_path)


def test_metadata_listing_a_parameter_outside_its_group(runs, tmp_path, capsys) -> None:
    ckpt = copy_of(runs["untied"], tmp_path)

    def grow(text: str) -> str:
        meta = json.loads(text)
        meta["groups"][0]["params"][0]["shape"] = [10_000]
        return json.dumps(meta)

    for rank in (0, 1):
        rewrite(rank_file(ckpt, rank), edit_meta=grow)
    assert_refused(
        capsys, tmp_path, ckpt, says=[str(rank_file(ckpt, 0)), "model.embed_tokens.weight", "outside the group"]
    )
    assert nothing_left(tmp_path)


def test_unreadable_layout_metadata(runs, tmp_path, capsys) -> None:
    ckpt = copy_of(runs["untied"], tmp_path)
    path = rank_file(ckpt, 1)
    rewrite(path, edit_meta=lambda text: text[: len(text) // 2])
    assert_refused(capsys, tmp_path, ckpt, says=[str(path), "metadata is not a valid accel-xla-fsdp/2 record"])
    assert nothing_left(tmp_path)


def test_config_of_another_model(runs, tmp_path, capsys) -> None:
    config = tmp_path / "config"
    LlamaConfig(**dict(LLAMA_CONFIG, intermediate_size=48)).save_pretrained(config)
    assert_refused(
        capsys,
        tmp_path,
        runs["untied"].ckpt,
        "--config",
        str(config),
        says=[
            "does not fit the config's LlamaForCausalLM",
            "model.layers.0.mlp.gate_proj.weight: [64, 32] saved, [48, 32]",
        ],
    )
    assert nothing_left(tmp_path)


def test_optimizer_state_asked_of_a_save_without_it(runs, tmp_path, capsys) -> None:
    assert_refused(capsys, tmp_path, runs["untied"].other_save, "--optimizer", says=["saved without optimizer state"])
    assert nothing_left(tmp_path)


def test_output_folder_holding_a_model(runs, tmp_path, capsys) -> None:
    run = runs["untied"]
    out = tmp_path / "out"
    consolidate(run.ckpt, out, config=run.config, max_shard_size="40KB", progress=False)
    (out / "tokenizer.json").write_text("{}")  # not a model file: kept
    before = sorted(p.name for p in out.iterdir())
    assert_refused(capsys, tmp_path, run.ckpt, out=out, says=[f"{out}: already holds a model", "model-00001-of-"])
    assert sorted(p.name for p in out.iterdir()) == before
    assert (
        cli.main(["consolidate", str(run.ckpt), str(out), "--no-progress", "--config", str(run.config), "--overwrite"])
        == 0
    )
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]  # no stale shards
    assert_loads_the_trained_model(out, run)


def test_a_failure_while_writing_leaves_nothing(runs, tmp_path, capsys, monkeypatch) -> None:
    real, calls = consolidate_module.write_safetensors, []

    def fail_in_second_file(path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device (simulated)", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(consolidate_module, "write_safetensors", fail_in_second_file)
    assert_refused(
        capsys, tmp_path, runs["untied"].ckpt, "--max-shard-size", "40KB", says=["No space left on device (simulated)"]
    )
    assert len(calls) == 2 and nothing_left(tmp_path)


@pytest.mark.parametrize(
    "option,says",
    [(["--dtype", "int8"], "invalid choice: 'int8'"), (["--max-shard-size", "5XB"], "Unit 'XB' not supported")],
)
def test_bad_arguments(runs, tmp_path, capsys, option, says) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["consolidate", str(runs["untied"].ckpt), str(tmp_path / "out"), *option])
    assert exit_.value.code == 2 and says in capsys.readouterr().err
    assert nothing_left(tmp_path)
