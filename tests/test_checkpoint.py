"""Sharded checkpoints: exact resume, resharding N->M across layouts, atomic saves, bad input.

Each run trains a few steps with AdamW, saves with ``save_sharded``, and trains on; another run
(any world size, any layout) loads the checkpoint into a freshly built model and optimizer and
trains the same steps. Same world size and layout: the same losses and parameters bit for bit.
Otherwise: equal to float32 round-off (reductions sum in another order).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import weakref
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
from models import LLAMA_CONFIG, build, compute_loss, global_batch, wrap
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM

from accel_xla_fsdp import (
    CheckpointError,
    ReplicaError,
    ShardedCheckpoint,
    _xla,
    host_memory,
    load_sharded,
    pretrained_weights,
    save_sharded,
    seeded,
    transformer_block_policy,
)
from accel_xla_fsdp import XlaFullyShardedDataParallel as FSDP
from accel_xla_fsdp.checkpoint import sharded
from accel_xla_fsdp.checkpoint.format import find_saves

LAYOUTS = {"flat": {"flatten_parameters": True}, "per-parameter": {}, "dim0": {"shard_param_on_dim_0": True}}
BEFORE, AFTER = 2, 2


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


GLOBAL_ROWS = 4  # the same global batch on 1, 2 and 4 devices, so runs on any world size compare


def local_rows(name: str, step: int, rank: int, world: int) -> List[torch.Tensor]:
    rows = GLOBAL_ROWS // world
    return [t[rank * rows : (rank + 1) * rows] for t in global_batch(name, step, 0, GLOBAL_ROWS // 2)]


def train(model, optimizer, name: str, rank: int, world: int, steps: range) -> List[torch.Tensor]:
    losses = []
    for step in steps:
        x, y = (t.to(_xla.device()) for t in local_rows(name, step, rank, world))
        loss = compute_loss(name, model, x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        _xla.sync()
        losses.append(loss.detach())
    return losses


def kwargs_for(layout: str, bf16: bool) -> Dict[str, Any]:
    return dict(LAYOUTS[layout], **({"compute_dtype": torch.bfloat16} if bf16 else {}))


def save_then_train(rank: int, world: int, name: str, layout: str, directory: str, bf16: bool) -> Dict[str, Any]:
    model = wrap(name, build(name), rank, world, kwargs_for(layout, bf16))
    optimizer = adamw(model)
    train(model, optimizer, name, rank, world, range(BEFORE))
    save_sharded(model, optimizer, directory)
    losses = train(model, optimizer, name, rank, world, range(BEFORE, BEFORE + AFTER))
    return {"losses": torch.stack(losses), "state": model.full_state_dict()}


def load_then_train(rank: int, world: int, name: str, layout: str, directory: str, bf16: bool) -> Dict[str, Any]:
    model = wrap(name, build(name), rank, world, kwargs_for(layout, bf16))
    optimizer = adamw(model)
    load_sharded(model, optimizer, directory)
    losses = train(model, optimizer, name, rank, world, range(BEFORE, BEFORE + AFTER))
    return {"losses": torch.stack(losses), "state": model.full_state_dict()}


def mean_losses(results: List[Dict[str, Any]]) -> torch.Tensor:
    return torch.stack([r["losses"] for r in results]).mean(0)


@pytest.mark.parametrize(
    "name,layout,bf16",
    [
        ("llama", "flat", False),
        ("llama", "per-parameter", False),
        ("tied_transformer", "dim0", False),
        ("frozen_odd", "flat", False),
        ("llama", "flat", True),
    ],
    ids=lambda v: str(v),
)
def test_resume_on_the_same_ranks_is_bit_exact(pool, tmp_path, name: str, layout: str, bf16: bool) -> None:
    world = pool.num_devices
    unbroken = pool.run(save_then_train, world, name, layout, str(tmp_path), bf16)
    resumed = pool.run(load_then_train, world, name, layout, str(tmp_path), bf16)
    for a, b in zip(unbroken, resumed):
        assert torch.equal(a["losses"], b["losses"])
        assert sorted(a["state"]) == sorted(b["state"])
        for k in a["state"]:
            assert torch.equal(a["state"][k], b["state"][k]), k


RESHARD = [
    (4, "flat", 2, "flat"),
    (2, "per-parameter", 4, "per-parameter"),
    (4, "flat", 1, "flat"),
    (4, "per-parameter", 2, "flat"),
    (2, "dim0", 4, "flat"),
    (4, "flat", 2, "dim0"),
]


@pytest.mark.parametrize("saved_on,saved_layout,loaded_on,loaded_layout", RESHARD, ids=lambda v: str(v))
def test_resharding_to_another_world_size_and_layout(
    pools, tmp_path, saved_on, saved_layout, loaded_on, loaded_layout
) -> None:
    unbroken = pools[saved_on].run(save_then_train, saved_on, "llama", saved_layout, str(tmp_path), False)
    resumed = pools[loaded_on].run(load_then_train, loaded_on, "llama", loaded_layout, str(tmp_path), False)
    torch.testing.assert_close(mean_losses(resumed), mean_losses(unbroken), rtol=1e-5, atol=1e-6)
    for k, v in unbroken[0]["state"].items():
        torch.testing.assert_close(resumed[0]["state"][k], v, rtol=1e-5, atol=1e-5, msg=lambda m: f"{k}: {m}")


# ---------------------------------------------------------------------------------------------
# The files themselves


def test_rank_files_are_plain_safetensors_with_their_layout(pools, tmp_path) -> None:
    pools[2].run(save_then_train, 2, "tied_transformer", "flat", str(tmp_path), False)
    record = record_of(tmp_path)
    assert record["world_size"] == 2 and len(record["files"]) == 2
    with safe_open(str(tmp_path / record["files"][1]), framework="pt") as f:
        meta = json.loads(f.metadata()["accel_xla_fsdp"])
        names = set(f.keys())
    assert meta["rank"] == 1 and meta["world_size"] == 2
    params = {p["name"]: p for g in meta["groups"] for p in g["params"]}
    assert params["embed_tokens.weight"]["aliases"] == ["output_proj.weight"]  # tied, stored once
    assert "buffer/long_buffer" in names and any(n.startswith("optim/") and n.endswith("/exp_avg") for n in names)
    ckpt = ShardedCheckpoint(tmp_path)
    full = build("tied_transformer").state_dict()
    assert ckpt.read_param("encoder.layers.0.linear1.weight").shape == (
        full["encoder.layers.0.linear1.weight"].numel(),
    )


class HostCopies:
    """The host copies a save makes of device tensors, counted by wrapping ``sharded.host_copy``:
    how many, and the most bytes of them alive at once in the process (every replica's); and
    whether the heap was given back (``host_memory.give_back``) after the last of them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.copies = self.live = self.most = self.largest = 0
        self.given_back_after_last_copy = False

    def install(self) -> None:
        real, real_give_back = sharded.host_copy, host_memory.give_back

        def restore() -> None:
            sharded.host_copy, host_memory.give_back = real, real_give_back

        self.restore = restore

        def give_back() -> None:
            real_give_back()
            self.given_back_after_last_copy = True

        host_memory.give_back = give_back

        def counted(tensor: Any) -> torch.Tensor:
            copy = real(tensor)
            if copy.device == tensor.value.device:
                return copy  # on the host already (AdamW's step): nothing copied
            with self.lock:
                self.copies += 1
                self.given_back_after_last_copy = False
                self.live += copy.nbytes
                self.most = max(self.most, self.live)
                self.largest = max(self.largest, copy.nbytes)
            weakref.finalize(copy, self.freed, copy.nbytes)
            return copy

        sharded.host_copy = counted

    def freed(self, nbytes: int) -> None:
        with self.lock:
            self.live -= nbytes


_COPIES = HostCopies()


def save_counting_host_copies(rank: int, world: int, directory: str) -> Dict[str, int]:
    from accel_xla_fsdp.xla_cpu.rendezvous import agree

    model = wrap("llama", build("llama"), rank, world, LAYOUTS["flat"])
    optimizer = adamw(model)
    train(model, optimizer, "llama", rank, world, range(BEFORE))
    agree("install the counter")
    if rank == 0:
        _COPIES.__init__()  # type: ignore[misc]
        _COPIES.install()
    agree("counter installed")
    try:
        save_sharded(model, optimizer, directory)
    finally:
        agree("saved")
        if rank == 0:
            _COPIES.restore()
    return {
        "copies": _COPIES.copies,
        "most": _COPIES.most,
        "largest": _COPIES.largest,
        "given_back": _COPIES.given_back_after_last_copy,
    }


def test_a_save_holds_one_tensor_on_the_host_at_a_time(pools, tmp_path) -> None:
    counted = pools[4].run(save_counting_host_copies, 4, str(tmp_path))[0]
    record = record_of(tmp_path)
    on_device, total = 0, 0
    for name in record["files"]:
        with safe_open(str(tmp_path / name), framework="pt") as f:
            for key in f.keys():
                if not key.endswith("/step"):
                    on_device += 1
                    total += f.get_tensor(key).nbytes
    # every tensor copied twice (hashed, then written), one at a time over the 4 replicas: the
    # most alive at once is the largest tensor, where copying first held all of them (total)
    assert counted["copies"] == 2 * on_device
    assert counted["most"] == counted["largest"]
    assert counted["most"] < total / 8
    # and what they took is given back to the system (the Trainer's checkpoints save here, with
    # no give_back of their own; glibc would keep it: docs/accelerate.md#memory-stage-by-stage)
    assert counted["given_back"]


def save_twice_dying(rank: int, world: int, directory: str, where: str) -> None:
    """Save once, train a step, then die (SIGKILL) in the middle of the second save."""
    model = wrap("llama", build("llama"), rank, world, LAYOUTS["flat"])
    optimizer = adamw(model)
    train(model, optimizer, "llama", rank, world, range(1))
    save_sharded(model, optimizer, directory)
    train(model, optimizer, "llama", rank, world, range(1, 2))
    die = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
    if where == "writing":  # rank files partly written
        real = sharded.write_rank_file
        sharded.write_rank_file = lambda f, *args: (real(f, *args), f.flush(), f.truncate(100), die())
    else:  # every rank file of the new save written, the record not yet
        sharded._commit = die
    save_sharded(model, optimizer, directory)


def state_after_load(rank: int, world: int, directory: str) -> Dict[str, torch.Tensor]:
    model = wrap("llama", build("llama"), rank, world, LAYOUTS["flat"])
    optimizer = adamw(model)
    load_sharded(model, optimizer, directory)
    return model.full_state_dict()


def state_after_one_step(rank: int, world: int) -> Dict[str, torch.Tensor]:
    model = wrap("llama", build("llama"), rank, world, LAYOUTS["flat"])
    train(model, adamw(model), "llama", rank, world, range(1))
    return model.full_state_dict()


@pytest.mark.parametrize("where", ["writing", "before_commit"])
def test_a_save_killed_midway_leaves_the_previous_checkpoint(pools, tmp_path, where: str) -> None:
    with pytest.raises(ReplicaError, match="SIGKILL"):
        pools[2].run(save_twice_dying, 2, str(tmp_path), where)
    loaded = pools[2].run(state_after_load, 2, str(tmp_path))[0]
    want = pools[2].run(state_after_one_step, 2)[0]
    for k, v in want.items():
        assert torch.equal(loaded[k], v), k
    assert record_of(tmp_path)["save_id"] == "save-000000"
    assert find_saves(tmp_path).incomplete == ("save-000001",)  # skipped, named


# ---------------------------------------------------------------------------------------------
# Bad input


@pytest.fixture(scope="module")
def saved(pools, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("ckpt")
    pools[2].run(save_then_train, 2, "nested_linear", "flat", str(directory), False)
    return directory


def copy_of(saved: Path, tmp_path: Path) -> Path:
    import shutil

    target = tmp_path / "copy"
    shutil.copytree(saved, target)
    return target


def record_of(directory: Path) -> Dict[str, Any]:
    """The newest complete save's record (``save-<n>/checkpoint.json``)."""
    return json.loads(find_saves(directory).record_path.as_path().read_text())


def test_missing_rank_file_is_named(saved, tmp_path) -> None:
    d = copy_of(saved, tmp_path)
    (d / record_of(d)["files"][1]).unlink()
    with pytest.raises(CheckpointError, match="rank 1's file of save save-000000 is missing"):
        ShardedCheckpoint(d)


def test_truncated_rank_file_is_named(saved, tmp_path) -> None:
    d = copy_of(saved, tmp_path)
    path = d / record_of(d)["files"][0]
    path.write_bytes(path.read_bytes()[:-64])
    with pytest.raises(CheckpointError, match=f"{path.name}: not a readable safetensors file"):
        ShardedCheckpoint(d)


def test_files_of_another_save_are_refused(saved, tmp_path) -> None:
    d = copy_of(saved, tmp_path)
    record = record_of(d)
    (d / "save-000000").rename(d / "save-000007")  # its record and files, under another save's name
    record["save_id"] = "save-000007"
    record["files"] = [f.replace("save-000000", "save-000007") for f in record["files"]]
    (d / "save-000007" / "checkpoint.json").write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match="files of different saves are mixed"):
        ShardedCheckpoint(d)


def test_no_record_means_no_checkpoint(tmp_path) -> None:
    with pytest.raises(CheckpointError, match="no checkpoint.json"):
        ShardedCheckpoint(tmp_path)


def load_other_model(rank: int, world: int, directory: str) -> str:
    model = wrap("llama", build("llama"), rank, world, LAYOUTS["flat"])
    try:
        load_sharded(model, None, directory)
    except CheckpointError as e:
        return str(e)
    return "no error"


def test_a_checkpoint_of_another_model_is_refused(pools, saved) -> None:
    for message in pools[2].run(load_other_model, 2, str(saved)):
        assert "a checkpoint of another model" in message and "missing ['lm_head.weight'" in message


def load_into_the_wrong_optimizer(rank: int, world: int, saved: str, without_optimizer: str) -> List[str]:
    model = wrap("nested_linear", build("nested_linear"), rank, world, LAYOUTS["flat"])
    save_sharded(model, None, without_optimizer)
    messages = []
    for directory, optimizer in (
        (saved, torch.optim.SGD(model.parameters(), lr=0.1)),
        (without_optimizer, adamw(model)),
    ):
        try:
            load_sharded(model, optimizer, directory)
        except CheckpointError as e:
            messages.append(str(e))
        else:
            messages.append("no error")
    return messages


def test_optimizer_state_that_does_not_fit_is_refused(pools, saved, tmp_path) -> None:
    for other_type, no_state in pools[2].run(load_into_the_wrong_optimizer, 2, str(saved), str(tmp_path)):
        assert "saved with a AdamW of 1 param group(s), loading into a SGD of 1" in other_type
        assert "saved without optimizer state" in no_state and "load with optimizer=None" in no_state


# ---------------------------------------------------------------------------------------------
# Pretrained weights straight into shards

_BUILT: Dict[int, threading.Barrier] = {}


def pretrained_into_shards(rank: int, world: int, folder: str, layout: str, tied: bool) -> Dict[str, Any]:
    from accelerate import init_empty_weights

    # init_empty_weights patches nn.Module for every thread of the process: every replica builds
    # its empty model before any of them wraps (wrapping registers parameters too).
    with seeded(0), init_empty_weights():
        model = LlamaForCausalLM(
            LlamaConfig(**dict(LLAMA_CONFIG, tie_word_embeddings=tied), attn_implementation="eager")
        )
    _BUILT.setdefault(world, threading.Barrier(world)).wait()
    on_meta = all(p.is_meta for p in model.parameters())
    try:
        wrapped = FSDP(
            model,
            auto_wrap_policy=transformer_block_policy(),
            param_init_fn=pretrained_weights(folder),
            **LAYOUTS[layout],
        )
    except CheckpointError as e:
        return {"error": str(e)}
    return {"on_meta": on_meta, "state": wrapped.full_state_dict()}


def save_pretrained_llama(folder: Path, tied: bool, **kw: Any) -> Dict[str, torch.Tensor]:
    with seeded(3):
        model = LlamaForCausalLM(
            LlamaConfig(**dict(LLAMA_CONFIG, tie_word_embeddings=tied), attn_implementation="eager")
        )
    model.save_pretrained(folder, safe_serialization=True, **kw)
    return {n: p.detach() for n, p in model.named_parameters()}  # a tied weight once, as full_state_dict has it


@pytest.mark.parametrize(
    "layout,tied,max_shard_size", [("flat", False, None), ("per-parameter", True, "20KB"), ("dim0", False, "20KB")]
)
def test_pretrained_weights_load_straight_into_shards(pool, tmp_path, layout, tied, max_shard_size) -> None:
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    want = save_pretrained_llama(tmp_path, tied, **kw)
    assert (tmp_path / "model.safetensors.index.json").exists() == bool(max_shard_size)
    for r in pool.run(pretrained_into_shards, pool.num_devices, str(tmp_path), layout, tied):
        assert r.get("on_meta"), r.get("error")
        for name, value in want.items():
            assert torch.equal(r["state"][name], value), name


def test_pretrained_weights_of_another_shape_are_refused(pools, tmp_path) -> None:
    with seeded(3):
        other = LlamaForCausalLM(LlamaConfig(**dict(LLAMA_CONFIG, intermediate_size=48), attn_implementation="eager"))
    other.save_pretrained(tmp_path, safe_serialization=True)
    for r in pools[2].run(pretrained_into_shards, 2, str(tmp_path), "flat", False):
        assert "has shape [48, 32], the model's parameter [64, 32]" in r["error"]
        assert "model.safetensors" in r["error"]
