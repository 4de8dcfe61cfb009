"""Local state dicts, shard metadata and full parameters.

A script written for torch_xla's FSDP saves ``{"model": state_dict(), "shard_metadata":
get_shard_metadata()}`` on every rank and consolidates them with torch_xla's own
``consolidate_sharded_model_checkpoints``: that must give the unwrapped model's state dict.
"""

from __future__ import annotations

import os
from typing import Dict, Tuple

import pytest
import torch
import torch.nn as nn
from models import build, compute_loss, global_batch, local_slice, make_optimizer, wrap
from torch_xla.distributed.fsdp import consolidate_sharded_model_checkpoints

from accel_xla_fsdp import _xla

LAYOUTS = {
    "flat": {"flatten_parameters": True},
    "per-parameter": {},
    "dim0": {"shard_param_on_dim_0": True},
}


def train_one_step(model: nn.Module, name: str, rank: int, world: int) -> None:
    optimizer = make_optimizer("sgd", model.parameters())
    x, y = (t.to(_xla.device()) for t in local_slice(global_batch(name, 0, 0, world), rank))
    compute_loss(name, model, x, y).backward()
    optimizer.step()
    _xla.sync()


def save_like_torch_xla(rank: int, world: int, name: str, kw: dict, directory: str) -> Dict[str, torch.Tensor]:
    """What a torch_xla FSDP training script does at the end, after one import changed."""
    model = wrap(name, build(name), rank, world, kw)
    train_one_step(model, name, rank, world)
    ckpt = {
        "model": {k: v.cpu() for k, v in model.state_dict().items()},
        "shard_metadata": model.get_shard_metadata(),
    }
    torch.save(ckpt, os.path.join(directory, f"final_ckpt_rank-{rank:08d}-of-{world:08d}.pth"))
    return model.full_state_dict()


@pytest.mark.parametrize("model_name", ["nested_linear", "llama"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_torch_xla_consolidates_our_shards(pool, tmp_path, layout: str, model_name: str) -> None:
    world = pool.num_devices
    full = pool.run(save_like_torch_xla, world, model_name, LAYOUTS[layout], str(tmp_path))
    consolidated, _ = consolidate_sharded_model_checkpoints(
        str(tmp_path / "final_ckpt"), "_rank-*-of-*.pth", save_model=False
    )
    unwrapped = build(model_name).state_dict()
    assert set(consolidated) <= set(unwrapped)
    assert set(unwrapped) - set(consolidated) <= {"lm_head.weight"} - set(consolidated)
    for key, value in consolidated.items():
        assert value.shape == unwrapped[key].shape, key
        torch.testing.assert_close(value, full[0][key], rtol=0, atol=0, msg=key)
    changed = [k for k in consolidated if not torch.equal(consolidated[k], unwrapped[k])]
    assert changed, "one training step should have changed the parameters"


def round_trip(rank: int, world: int) -> Tuple[bool, bool, bool]:
    """Save the local shards, train on, load them back: the full parameters are restored."""
    model = wrap("nested_linear", build("nested_linear"), rank, world, {"flatten_parameters": True})
    train_one_step(model, "nested_linear", rank, world)
    saved = {k: v.cpu().clone() for k, v in model.state_dict().items()}
    before = model.full_state_dict()
    train_one_step(model, "nested_linear", rank, world)
    moved = model.full_state_dict()
    model.load_state_dict(saved)
    _xla.sync()
    after = model.full_state_dict()
    same = all(torch.equal(before[k], after[k]) for k in before)
    differed = any(not torch.equal(before[k], moved[k]) for k in before)
    return same, differed, sorted(saved) == sorted(model.state_dict())


def test_load_state_dict_restores_the_local_shards(pool) -> None:
    for same, differed, keys_kept in pool.run(round_trip, pool.num_devices):
        assert differed and same and keys_kept


def summon(rank: int, world: int) -> Tuple[Dict[str, torch.Size], Dict[str, torch.Size], Dict[str, torch.Tensor]]:
    model = wrap("nested_linear", build("nested_linear"), rank, world, {"shard_param_on_dim_0": True})
    inner = model.module.module  # the unwrapped Sequential
    with model.summon_full_params():
        inside = {n: m.weight.shape for n, m in inner.named_modules() if isinstance(m, nn.Linear)}
        values = {n: m.weight.detach().cpu().clone() for n, m in inner.named_modules() if isinstance(m, nn.Linear)}
    outside = {n: m.weight.shape for n, m in inner.named_modules() if isinstance(m, nn.Linear)}
    return inside, outside, values


def unwrapped_name(name: str) -> str:
    return name.replace("._fsdp_wrapped_module", "").replace("_fsdp_wrapped_module.", "")


def test_summon_full_params_gathers_then_frees(pool) -> None:
    reference = {n: m.weight for n, m in build("nested_linear").module.named_modules() if isinstance(m, nn.Linear)}
    for inside, outside, values in pool.run(summon, pool.num_devices):
        assert {unwrapped_name(n) for n in inside} == set(reference)
        for n, shape in inside.items():
            plain = unwrapped_name(n)
            assert shape == reference[plain].shape
            torch.testing.assert_close(values[n], reference[plain], rtol=0, atol=0)
            assert outside[n] == torch.Size([1]), "full parameters are freed after the block"
