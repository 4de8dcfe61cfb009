"""Everything a training script does besides forward, backward and step, against one plain model.

Each scenario runs the same steps twice: FSDP on 1, 2 and 4 XLA:CPU devices (flat and
per-parameter shards) and one plain model on the CPU with whole global batches; losses, outputs
and the final parameters must agree to 1e-5 relative. Scenarios: gradient accumulation with
``no_sync()`` / ``set_requires_gradient_sync()``, without (two forward/backward pairs; two
forwards, one backward of the summed losses), evaluation inside training, ``generate()``,
freezing and unfreezing a unit, ``summon_full_params(writeback=True)``, an inner unit called
first, a forward that raises midway, and a model built on the meta device.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.nn as nn
from hlo_dump import modules_in, parse_dump
from models import (
    LLAMA_CONFIG,
    Case,
    NestedLinear,
    build,
    compute_loss,
    global_batch,
    local_slice,
    make_llama,
    make_optimizer,
    train_reference,
    wrap,
)

from accel_xla_fsdp import DevicePool, _xla
from accel_xla_fsdp import XlaFullyShardedDataParallel as FSDP

RTOL, ATOL = 1e-5, 1e-6
LAYOUTS = {"flat": {"flatten_parameters": True}, "per-parameter": {}}


def assert_close(got: Any, want: Any, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def assert_states_close(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert_close(got[name], want[name], name)


def local_batch(name: str, step: int, micro: int, rank: int, world: int) -> Tuple[torch.Tensor, ...]:
    return tuple(t.to(_xla.device()) for t in local_slice(global_batch(name, step, micro, world), rank))


def held_full_params(model: FSDP) -> List[str]:
    """Full parameters still holding gathered values (a freed one holds a 1-element placeholder)."""
    return [
        slot.name
        for unit in model.modules()
        if isinstance(unit, FSDP)
        for group in unit.param_groups
        for slot in group.slots
        if slot.numel > 1 and slot.param.shape == slot.shape
    ]


# ---------------------------------------------------------------------------------------------
# Gradient accumulation

MICRO = {"no_sync": 4, "set_requires_gradient_sync": 4, "pairs": 2, "summed_losses": 2}


def accumulate(rank: int, world: int, name: str, layout: str, mode: str) -> Dict[str, Any]:
    model = wrap(name, build(name), rank, world, LAYOUTS[layout])
    optimizer = make_optimizer("sgd", model.parameters())
    losses, micro = [], MICRO[mode]
    for step in range(2):
        batches = [local_batch(name, step, m, rank, world) for m in range(micro)]
        if mode == "summed_losses":
            loss = sum(compute_loss(name, model, x, y) for x, y in batches) / micro
            loss.backward()
        else:
            loss = torch.zeros((), device=_xla.device())
            for m, (x, y) in enumerate(batches):
                last = m == micro - 1
                if mode == "set_requires_gradient_sync":
                    model.set_requires_gradient_sync(last)
                with model.no_sync() if mode == "no_sync" and not last else nullcontext():
                    micro_loss = compute_loss(name, model, x, y) / micro
                    micro_loss.backward()
                loss = loss + micro_loss.detach()
        optimizer.step()
        optimizer.zero_grad()
        _xla.sync()
        losses.append(loss.detach())
    return {"losses": torch.stack(losses), "state": model.full_state_dict(), "held": held_full_params(model)}


@functools.cache
def reference_training(world: int, name: str, accumulation: int, steps: int = 2):
    return train_reference(world, Case(name, steps=steps, accumulation=accumulation))


@pytest.mark.parametrize("mode", sorted(MICRO))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_gradient_accumulation_matches_plain_model(pool, layout: str, mode: str) -> None:
    world = pool.num_devices
    results = pool.run(accumulate, world, "nested_linear", layout, mode)
    ref = reference_training(world, "nested_linear", MICRO[mode])
    assert_close(torch.stack([r["losses"] for r in results]).mean(0), torch.stack(ref.losses), "losses")
    for r in results:
        assert_states_close(r["state"], ref.state)
        assert r["held"] == []


def test_no_sync_on_a_transformers_model(pool) -> None:
    world = pool.num_devices
    results = pool.run(accumulate, world, "llama", "flat", "no_sync")
    ref = reference_training(world, "llama", MICRO["no_sync"])
    assert_close(torch.stack([r["losses"] for r in results]).mean(0), torch.stack(ref.losses), "losses")
    for r in results:
        assert_states_close(r["state"], ref.state)


# ---------------------------------------------------------------------------------------------
# Evaluation inside training, generate()


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits  # see models.compute_loss


def evaluate_between_steps(rank: int, world: int, layout: str) -> Dict[str, Any]:
    model = wrap("llama", build("llama"), rank, world, LAYOUTS[layout])
    optimizer = make_optimizer("sgd", model.parameters())
    out: Dict[str, Any] = {"losses": [], "held": {}}
    for step in range(2):
        x, _ = local_batch("llama", step, 0, rank, world)
        loss = compute_loss("llama", model, x, x)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        _xla.sync()
        out["losses"].append(loss.detach())
        if step == 0:
            ids, _ = local_batch("llama", 7, 0, rank, world)
            with torch.no_grad():
                out["no_grad"] = logits(model, ids)
            with torch.inference_mode():
                out["inference_mode"] = logits(model, ids).clone()
            model.eval()
            out["eval_with_grad"] = logits(model, ids).detach()  # forward with grad, no backward
            model.train()
            _xla.sync()
            out["held"] = held_full_params(model)
    out["losses"] = torch.stack(out["losses"])
    out["state"] = model.full_state_dict()
    return out


def reference_evaluation(world: int) -> Dict[str, Any]:
    model = build("llama")
    optimizer = make_optimizer("sgd", model.parameters())
    out: Dict[str, Any] = {"losses": []}
    for step in range(2):
        x, _ = global_batch("llama", step, 0, world)
        loss = compute_loss("llama", model, x, x)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        out["losses"].append(loss.detach())
        if step == 0:
            ids, _ = global_batch("llama", 7, 0, world)
            with torch.no_grad():
                out["logits"] = logits(model, ids)
    out["losses"] = torch.stack(out["losses"])
    out["state"] = dict(model.state_dict())
    return out


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_evaluation_inside_training(pool, layout: str) -> None:
    world = pool.num_devices
    results = pool.run(evaluate_between_steps, world, layout)
    ref = reference_evaluation(world)
    assert_close(torch.stack([r["losses"] for r in results]).mean(0), ref["losses"], "losses")
    for rank, r in enumerate(results):
        want = local_slice((ref["logits"],), rank)[0]
        for kind in ("no_grad", "inference_mode", "eval_with_grad"):
            assert_close(r[kind], want, kind)
        assert r["held"] == [], "a unit kept its full parameters past the graph cut"
        assert_states_close({k: r["state"][k] for k in ref["state"]}, ref["state"])


PROMPT = torch.tensor([[5, 17, 3, 60, 2, 9], [41, 8, 8, 33, 70, 1]])


def generate_tokens(rank: int, world: int, layout: str) -> torch.Tensor:
    model = wrap("llama", build("llama"), rank, world, LAYOUTS[layout])
    ids = PROMPT.to(_xla.device())
    return model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, use_cache=True, pad_token_id=0)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_generate_matches_the_unwrapped_model(pool, layout: str) -> None:
    want = build("llama").generate(input_ids=PROMPT, max_new_tokens=4, do_sample=False, use_cache=True, pad_token_id=0)
    for got in pool.run(generate_tokens, pool.num_devices, layout):
        assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------
# Freezing, writing back, odd call orders


def inner_units(model: nn.Module) -> List[nn.Module]:
    """nested_linear's units below the root: module[1] (holding module[1][0]) and module[2]."""
    seq = model.module.module if isinstance(model, FSDP) else model.module
    return [seq[1], seq[2]]


def train_steps(model: nn.Module, optimizer, rank: int, world: int, steps: range, on_xla: bool) -> List[torch.Tensor]:
    losses = []
    for step in steps:
        if on_xla:
            x, y = local_batch("nested_linear", step, 0, rank, world)
        else:
            x, y = global_batch("nested_linear", step, 0, world)
        loss = compute_loss("nested_linear", model, x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if on_xla:
            _xla.sync()
        losses.append(loss.detach())
    return losses


def staged(model: nn.Module, rank: int, world: int, on_xla: bool) -> List[torch.Tensor]:
    """Train with module[2] frozen for a step, then unfrozen; module[1] frozen for the last."""
    optimizer = make_optimizer("sgd", model.parameters())
    losses = train_steps(model, optimizer, rank, world, range(0, 1), on_xla)
    inner_units(model)[1].requires_grad_(False)
    losses += train_steps(model, optimizer, rank, world, range(1, 2), on_xla)
    inner_units(model)[1].requires_grad_(True)
    inner_units(model)[0].requires_grad_(False)
    losses += train_steps(model, optimizer, rank, world, range(2, 4), on_xla)
    return losses


def staged_fsdp(rank: int, world: int, layout: str) -> Dict[str, Any]:
    model = wrap("nested_linear", build("nested_linear"), rank, world, LAYOUTS[layout])
    return {"losses": torch.stack(staged(model, rank, world, True)), "state": model.full_state_dict()}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_freezing_and_unfreezing_units_after_wrapping(pool, layout: str) -> None:
    world = pool.num_devices
    ref_model = build("nested_linear")
    ref_losses = torch.stack(staged(ref_model, 0, world, False))
    results = pool.run(staged_fsdp, world, layout)
    assert_close(torch.stack([r["losses"] for r in results]).mean(0), ref_losses, "losses")
    for r in results:
        assert_states_close(r["state"], dict(ref_model.state_dict()))


def freeze_part_of_a_flat_shard(rank: int, world: int) -> str:
    model = wrap("nested_linear", build("nested_linear"), rank, world, LAYOUTS["flat"])
    model.module.module[3].weight.requires_grad_(False)  # a full parameter inside the root's flat shard
    x, _ = local_batch("nested_linear", 0, 0, rank, world)
    try:
        model(x)
    except ValueError as e:
        return str(e)
    return "no error"


def test_freezing_part_of_a_flat_shard_is_refused(pools) -> None:
    for message in pools[2].run(freeze_part_of_a_flat_shard, 2):
        assert "disagree on requires_grad" in message and "'module.3.weight'=False" in message
        assert "Freeze the whole unit" in message


def double_weights(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.weight.mul_(2.0)
            m.bias.add_(0.5)


WRITEBACK_LAYOUTS = dict(LAYOUTS, dim0={"shard_param_on_dim_0": True})


def summon_edit_train(rank: int, world: int, layout: str) -> Dict[str, Any]:
    model = wrap("nested_linear", build("nested_linear"), rank, world, WRITEBACK_LAYOUTS[layout])
    with model.summon_full_params(writeback=True):
        double_weights(model)
    optimizer = make_optimizer("sgd", model.parameters())
    losses = train_steps(model, optimizer, rank, world, range(2), True)
    return {"losses": torch.stack(losses), "state": model.full_state_dict()}


@pytest.mark.parametrize("layout", sorted(WRITEBACK_LAYOUTS))
def test_summon_full_params_writeback_reaches_the_shards(pool, layout: str) -> None:
    world = pool.num_devices
    ref_model = build("nested_linear")
    with torch.no_grad():
        double_weights(ref_model)
    ref_losses = torch.stack(
        train_steps(ref_model, make_optimizer("sgd", ref_model.parameters()), 0, world, range(2), False)
    )
    results = pool.run(summon_edit_train, world, layout)
    assert_close(torch.stack([r["losses"] for r in results]).mean(0), ref_losses, "losses")
    for r in results:
        assert_states_close(r["state"], dict(ref_model.state_dict()))


def inner_first(rank: int, world: int, failing: bool) -> Dict[str, Any]:
    """Call an inner unit before the root (forward and backward), or make a forward raise
    midway; then train as usual."""
    model = wrap("nested_linear", build("nested_linear"), rank, world, LAYOUTS["flat"])
    optimizer = make_optimizer("sgd", model.parameters())
    out: Dict[str, Any] = {}
    if failing:
        boom = inner_units(model)[1].module.register_forward_pre_hook(_raise)
        x, _ = local_batch("nested_linear", 0, 0, rank, world)
        try:
            model(x).sum().backward()
        except RuntimeError as e:
            out["error"] = str(e)
        boom.remove()
        out["held"] = held_full_params(model)
        out["states"] = sorted({u.training_state.name for u in model.modules() if isinstance(u, FSDP)})
    else:
        x16 = torch.linspace(-1, 1, 2 * 16).reshape(2, 16).to(_xla.device())
        y = inner_units(model)[1](x16)
        y.sum().backward()
        out["inner_out"] = y.detach()
        optimizer.zero_grad()
    out["losses"] = torch.stack(train_steps(model, optimizer, rank, world, range(2), True))
    out["state"] = model.full_state_dict()
    return out


def _raise(module: nn.Module, args: tuple) -> None:
    raise RuntimeError("boom: raised inside the forward of an inner unit")


@pytest.mark.parametrize("failing", [False, True], ids=["inner_unit_first", "forward_raises"])
def test_odd_call_orders_leave_the_model_usable(pool, failing: bool) -> None:
    world = pool.num_devices
    ref_model = build("nested_linear")
    ref_inner = ref_model.module[2](torch.linspace(-1, 1, 2 * 16).reshape(2, 16))
    ref_losses = torch.stack(
        train_steps(ref_model, make_optimizer("sgd", ref_model.parameters()), 0, world, range(2), False)
    )
    results = pool.run(inner_first, world, failing)
    for r in results:
        if failing:
            assert r["error"].startswith("boom")
            assert r["held"] == [] and r["states"] == ["IDLE"]
        else:
            assert_close(r["inner_out"], ref_inner.detach(), "inner unit output")
        assert_states_close(r["state"], dict(ref_model.state_dict()))
    assert_close(torch.stack([r["losses"] for r in results]).mean(0), ref_losses, "losses")


# ---------------------------------------------------------------------------------------------
# A model built on the meta device


def from_meta(rank: int, world: int, layout: str) -> Dict[str, Any]:
    """Build on the meta device and fill every unit from a state dict, as a pretrained load would."""
    source = dict(build("nested_linear").state_dict())
    with torch.device("meta"):
        model = NestedLinear()
    names = {id(m): n for n, m in model.named_modules()}

    def fill(m: nn.Module) -> None:
        m.to_empty(device="cpu", recurse=False)
        prefix = names[id(m)]
        with torch.no_grad():
            for n, p in m.named_parameters(recurse=False):
                p.copy_(source[f"{prefix}.{n}" if prefix else n])

    kw = dict(LAYOUTS[layout], param_init_fn=fill)
    model = model.wrap(**kw)
    optimizer = make_optimizer("sgd", model.parameters())
    losses = train_steps(model, optimizer, rank, world, range(2), True)
    return {"losses": torch.stack(losses), "state": model.full_state_dict()}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_param_init_fn_materializes_a_meta_model(pool, layout: str) -> None:
    world = pool.num_devices
    ref = reference_training(world, "nested_linear", 1)
    results = pool.run(from_meta, world, layout)
    assert_close(torch.stack([r["losses"] for r in results]).mean(0), torch.stack(ref.losses), "losses")
    for r in results:
        assert_states_close(r["state"], ref.state)


def meta_defaults(rank: int, world: int) -> Dict[str, str]:
    with torch.device("meta"):
        linear = nn.Linear(4, 3)
        llama = make_llama()
    wrapped = FSDP(linear)
    out = {"linear": str(sorted({p.device.type for p in wrapped.parameters()}))}
    try:
        FSDP(llama.model.norm)
    except ValueError as e:
        out["norm"] = str(e)
    return out


def test_meta_modules_default_to_reset_parameters_else_a_clear_error(pools) -> None:
    for r in pools[2].run(meta_defaults, 2):
        assert r["linear"] == "['xla']"
        assert "has tensors on the meta device" in r["norm"] and "pass param_init_fn" in r["norm"]


# ---------------------------------------------------------------------------------------------
# What the compiled program holds after a forward without backward


def forward_without_backward(rank: int, world: int, dump_dir: str) -> Dict[str, Any]:
    model = wrap("llama", build("llama"), rank, world, LAYOUTS["flat"])
    last = rank == world - 1
    _xla.sync()
    before = modules_in(Path(dump_dir)) if last else set()
    x, _ = local_batch("llama", 0, 0, rank, world)
    value = logits(model, x).float().sum().detach()  # gradients enabled; no backward follows
    _xla.sync()
    after = modules_in(Path(dump_dir)) if last else set()
    return {"value": value, "programs": sorted(after - before), "ids_bytes": x.numel() * 8}


def test_a_forward_without_backward_leaves_no_full_parameters_in_the_program(tmp_path) -> None:
    """The program cut after it outputs only the scalar: the root, which keeps its gathered
    parameters for backward after a forward with gradients, freed them before the cut."""
    flags = f"--xla_dump_to={tmp_path} --xla_dump_hlo_as_text"
    with DevicePool(2, env={"XLA_FLAGS": flags}) as pool:
        results = pool.run(forward_without_backward, 2, str(tmp_path))
    # transformers' mask code may run small programs of its own (a comparison read on the host).
    (report,) = [r for r in (parse_dump(tmp_path, m) for m in results[-1]["programs"]) if r.all_gathers.count]
    assert report.all_gathers.count == 1 + LLAMA_CONFIG["num_hidden_layers"]  # every unit gathered
    # Outputs: the f32 scalar and the input ids only. The barriers act on stand-ins of the shards
    # ([Note: donation order]), so no shard is an output; a gathered unit would add a whole
    # block's or the root's parameters.
    r = results[-1]
    assert report.output_bytes == 4 + r["ids_bytes"]
