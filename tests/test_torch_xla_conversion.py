"""torch_xla-format checkpoints (torch_xla's FSDP scripts, the Trainer's XLA FSDP path), read for
conversion: files made by torch_xla's own ``XlaFullyShardedDataParallel``."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest
import torch
from models import make_llama

from accel_xla_fsdp import CheckpointError, seeded
from accel_xla_fsdp.checkpoint.torch_xla_files import TorchXlaCheckpoint


def save_with_torch_xla_fsdp(rank: int, world: int, directory: str, flatten: bool, name_like: str) -> None:
    """What a torch_xla FSDP script (or the Trainer) writes, made by torch_xla's class itself.
    Wrapping shards without any collective, so torch_xla's FSDP runs here unchanged."""
    import functools

    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel
    from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    with seeded(0):
        model = make_llama()
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    wrapped = XlaFullyShardedDataParallel(model, auto_wrap_policy=policy, flatten_parameters=flatten)
    ckpt = {
        "model": {k: v.cpu() for k, v in wrapped.state_dict().items()},
        "shard_metadata": wrapped.get_shard_metadata(),
    }
    file = (
        f"final_ckpt_rank-{rank:08d}-of-{world:08d}.pth"
        if name_like == "script"
        else f"rank{rank}-of-{world}-pytorch_model.bin"
    )
    torch.save(ckpt, os.path.join(directory, file))


@pytest.mark.parametrize("flatten", [True, False], ids=["flat", "per-parameter"])
@pytest.mark.parametrize("name_like", ["script", "trainer"])
def test_torch_xla_rank_files_read_back_the_model(pools, tmp_path, flatten: bool, name_like: str) -> None:
    pools[2].run(save_with_torch_xla_fsdp, 2, str(tmp_path), flatten, name_like)
    with seeded(0):
        want = {n: p.detach() for n, p in make_llama().named_parameters()}
    ckpt = TorchXlaCheckpoint(tmp_path)
    assert sorted(ckpt.params) == sorted(want)
    for name, value in want.items():
        assert torch.equal(ckpt.read_param(name).view(value.shape), value), name


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


@pytest.mark.parametrize("writer", ["torch.save", "pickle.dump"])
def test_a_pickle_that_would_run_code_is_refused(tmp_path, writer: str) -> None:
    path = tmp_path / "ckpt_rank-00000000-of-00000001.pth"
    payload = {"model": _RunsCode(), "shard_metadata": {}}
    if writer == "torch.save":
        torch.save(payload, path)
    else:
        with open(path, "wb") as f:
            pickle.dump(payload, f)
    with pytest.raises(CheckpointError, match="refused: loading it needs more than tensors"):
        TorchXlaCheckpoint(path)


def test_missing_and_foreign_rank_files_are_named(tmp_path) -> None:
    (tmp_path / "x_rank-00000001-of-00000002.pth").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"rank file\(s\) \[0\] of 2 missing"):
        TorchXlaCheckpoint(tmp_path)
    with pytest.raises(CheckpointError, match="no torch_xla rank files"):
        TorchXlaCheckpoint(tmp_path / "nothing")


def test_convert_torch_xla_writes_a_model_from_pretrained_loads(pools, tmp_path) -> None:
    """The real command, on rank files written by torch_xla's FSDP; the config names the class."""
    from transformers import AutoModelForCausalLM

    rank_files = tmp_path / "torch_xla"
    rank_files.mkdir()
    pools[2].run(save_with_torch_xla_fsdp, 2, str(rank_files), True, "trainer")
    with seeded(0):
        model = make_llama()
    model.config.save_pretrained(tmp_path / "config")
    out = tmp_path / "hf"
    cmd = [
        sys.executable,
        "-m",
        "accel_xla_fsdp.cli",
        "convert-torch-xla",
        str(rank_files),
        str(out),
        "--config",
        str(tmp_path / "config"),
        "--no-progress",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    loaded = AutoModelForCausalLM.from_pretrained(out)
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 1 and "already holds" in again.stderr
