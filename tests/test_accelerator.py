"""``accel_xla_fsdp.Accelerator`` in replica threads: Accelerate's collectives on XLA:CPU devices,
evaluation and ``generate`` through the prepared model, the plugin's settings, and clear errors.

The training itself, launched by ``accelerate launch``, is in test_accelerate.py.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Dict, List

import accelerate_train as script
import pytest
import torch
from accelerate.utils import broadcast
from torch.utils.data import DataLoader

import accel_xla_fsdp
from accel_xla_fsdp import Accelerator, XlaFsdpPlugin, _xla, seeded
from accel_xla_fsdp.checkpoint import CheckpointError
from accel_xla_fsdp.hf_accelerate.plugin import CONFIG_FILE_ENV

_order: List[int] = []
_order_lock = threading.Lock()


def collectives(rank: int, world: int) -> Dict[str, Any]:
    acc = Accelerator()
    dev = acc.device
    out: Dict[str, Any] = {
        "gather": acc.gather(torch.tensor([rank, 10 + rank], device=dev)).cpu().tolist(),
        "gather scalar": acc.gather(torch.tensor(float(rank), device=dev)).cpu().tolist(),
        "gather dict": acc.gather({"a": torch.tensor([rank], device=dev)})["a"].cpu().tolist(),
        "reduce sum": acc.reduce(torch.tensor([1.0 + rank], device=dev)).cpu().tolist(),
        "reduce mean": acc.reduce(torch.tensor([1.0 + rank], device=dev), "mean").cpu().tolist(),
        "pad": acc.pad_across_processes(torch.ones(rank + 1, 2, device=dev), dim=0, pad_index=-1).cpu().tolist(),
        "broadcast": broadcast(torch.tensor([5.0 + rank], device=dev), from_process=1).tolist(),
        "main": acc.is_main_process,
        "local main": acc.is_local_main_process,
    }
    acc.wait_for_everyone()
    with acc.main_process_first():
        with _order_lock:
            _order.append(rank)
    acc.wait_for_everyone()
    out["main first"] = _order[0]
    # 10 samples over `world` replicas: the last batch is padded by repeating samples, which
    # gather_for_metrics drops again.
    loader = acc.prepare(DataLoader(torch.arange(10), batch_size=2, shuffle=True))
    seen = [acc.gather_for_metrics(batch).cpu() for batch in loader]
    out["metrics"] = sorted(torch.cat(seen).tolist())
    return out


def test_accelerate_collectives_on_replica_threads(pools) -> None:
    world = 4
    results = pools[world].run(collectives, world)
    for rank, out in enumerate(results):
        assert out["gather"] == [v for r in range(world) for v in (r, 10 + r)]
        assert out["gather scalar"] == [float(r) for r in range(world)]
        assert out["gather dict"] == list(range(world))
        assert out["reduce sum"] == [sum(1.0 + r for r in range(world))]
        assert out["reduce mean"] == [sum(1.0 + r for r in range(world)) / world]
        assert out["pad"] == [[1.0, 1.0]] * (rank + 1) + [[-1.0, -1.0]] * (world - rank - 1)
        assert out["broadcast"] == [6.0]
        assert (out["main"], out["local main"]) == (rank == 0, rank == 0)
        assert out["main first"] == 0
        assert out["metrics"] == list(range(10)), "every sample once, in a shuffled order shared by all"


def evaluation_and_generation(rank: int, world: int) -> Dict[str, torch.Tensor]:
    acc = Accelerator()
    plain = script.build_model().eval()
    model = acc.prepare(script.build_model())
    model.eval()
    ids = torch.randint(0, script.VOCAB, (2, 8), generator=torch.Generator().manual_seed(rank))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        logits = model(input_ids=ids.to(acc.device), attention_mask=mask.to(acc.device)).logits.cpu()
        tokens = model.generate(
            input_ids=ids.to(acc.device), attention_mask=mask.to(acc.device), max_new_tokens=4, do_sample=False
        ).cpu()
        plain_logits = plain(input_ids=ids, attention_mask=mask).logits
        plain_tokens = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    return {"logits": logits, "tokens": tokens, "plain logits": plain_logits, "plain tokens": plain_tokens}


def test_evaluation_and_generate_match_the_unwrapped_model(pools) -> None:
    for out in pools[2].run(evaluation_and_generation, 2):
        torch.testing.assert_close(out["logits"], out["plain logits"], rtol=1e-5, atol=1e-5)
        assert torch.equal(out["tokens"], out["plain tokens"])


def prepare_errors(rank: int, world: int, folder: str) -> Dict[str, str]:
    acc = Accelerator()
    errors: Dict[str, str] = {}

    def caught(name: str, fn: Any) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the message is what is tested
            errors[name] = f"{type(e).__name__}: {e}"

    other = torch.nn.Linear(4, 4)
    caught("other optimizer", lambda: acc.prepare(script.build_model(), torch.optim.AdamW(other.parameters())))
    caught(
        "block class",
        lambda: Accelerator(fsdp_plugin=XlaFsdpPlugin(transformer_cls_names_to_wrap="GPT2Block")).prepare(
            script.build_model()
        ),
    )
    flat = Accelerator(fsdp_plugin=XlaFsdpPlugin(flatten_parameters=True))
    model = script.build_model()
    optimizer = script.optimizer_for(model)
    flat.prepare(model)  # alone: its flat shards cannot be split by the optimizer's groups
    caught("flat groups", lambda: flat.prepare(optimizer))
    small = acc.prepare(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    caught("clip", lambda: acc.clip_grad_norm_(list(small.parameters())[:0], 1.0))
    caught("load other model", lambda: acc.load_state(folder))
    return errors


def test_prepare_errors_name_what_is_wrong(pools, tmp_path: Path) -> None:
    # a checkpoint of another model (4 -> 3 features, not 4 -> 4), saved by the Accelerator
    pools[2].run(save_small_model, 2, str(tmp_path / "small"))
    errors = pools[2].run(prepare_errors, 2, str(tmp_path / "small"))[0]
    assert "not in the model being prepared" in errors["other optimizer"]
    assert "GPT2Block" in errors["block class"] and "LlamaDecoderLayer" in errors["block class"]
    assert "xla_fsdp_flatten_parameters: false" in errors["flat groups"] and "weight_decay" in errors["flat groups"]
    assert "same prepare() call" in errors["flat groups"]
    assert "model.parameters()" in errors["clip"]
    assert (
        errors["load other model"].startswith(CheckpointError.__name__)
        and "another model" in errors["load other model"]
    )


STEPS = 3
LAYOUTS = {  # name: (flatten_parameters, optimizer prepared in a later prepare() call, in backward)
    "flat": (True, False, False),
    "per-parameter": (False, False, False),
    "per-parameter, optimizer later": (False, True, False),
    # xla_fsdp_optimizer_in_backward: each unit stepped in backward ([Note: the optimizer in backward])
    "flat, optimizer in backward": (True, False, True),
    "per-parameter, optimizer later, in backward": (False, True, True),
}


def batch(world: int) -> torch.Tensor:
    return torch.randint(0, script.VOCAB, (2 * world, script.SEQ), generator=torch.Generator().manual_seed(7))


def train_steps(acc: Accelerator, model: Any, optimizer: Any, ids: torch.Tensor, micro_steps: int) -> torch.Tensor:
    """``micro_steps`` steps of a script's loop under ``accumulate`` on ``ids``: their losses."""
    losses = []
    for _ in range(micro_steps):
        with acc.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.detach())
        accel_xla_fsdp.sync()
    return torch.stack(losses).cpu()


def train_with_decay_groups(rank: int, world: int, layout: str) -> Dict[str, Any]:
    """``STEPS`` AdamW steps on this replica's rows, the optimizer in two groups (weight decay 0.1
    and 0): its groups' shards, the losses and the final weights."""
    flatten, later, in_backward = LAYOUTS[layout]
    acc = Accelerator(fsdp_plugin=XlaFsdpPlugin(flatten_parameters=flatten, optimizer_in_backward=in_backward))
    model = script.build_model()
    optimizer = script.optimizer_for(model)
    if later:
        model = acc.prepare(model)
        optimizer = acc.prepare(optimizer)
    else:
        model, optimizer = acc.prepare(model, optimizer)
    stepping_in_backward = model.unit_state.root_state.optimizer_in_backward
    assert (stepping_in_backward is optimizer.optimizer) if in_backward else stepping_in_backward is None
    groups = [{id(p) for p in g["params"]} for g in optimizer.param_groups]
    shards = {id(p) for p in model.parameters()}
    losses = train_steps(acc, model, optimizer, batch(world)[rank::world].to(acc.device), STEPS)
    return {
        "shards": len(shards),
        "in groups": [len(g) for g in groups],
        "every shard in one group": groups[0] | groups[1] == shards and not groups[0] & groups[1],
        "losses": losses,
        "state": acc.get_state_dict(model),
    }


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_param_groups_keep_their_settings_in_every_layout(pools, layout: str) -> None:
    # One plain model on the whole batch: the reference.
    world = 2
    plain = script.build_model()
    optimizer = script.optimizer_for(plain)
    ids, plain_losses = batch(world), []
    for _ in range(STEPS):
        loss = plain(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        plain_losses.append(loss.item())
    results = pools[world].run(train_with_decay_groups, world, layout)
    blocks = script.model_config().num_hidden_layers
    for out in results:
        assert out["every shard in one group"]
        if LAYOUTS[layout][0]:  # flat: each unit's shard split in two, decayed matrices, undecayed norms
            assert (out["shards"], out["in groups"]) == (2 * (blocks + 1), [blocks + 1, blocks + 1])
        losses = torch.stack([r["losses"] for r in results]).mean(0)
        torch.testing.assert_close(losses, torch.tensor(plain_losses), rtol=1e-5, atol=1e-6)
        for name, value in plain.state_dict().items():  # Adam's tolerance (see test_accelerate.py)
            torch.testing.assert_close(out["state"][name], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def accumulate_in_backward(rank: int, world: int) -> Dict[str, Any]:
    """Two micro-batches per step under ``accumulate``, the optimizer stepping in backward: the
    losses and the final weights."""
    acc = Accelerator(gradient_accumulation_steps=2, fsdp_plugin=XlaFsdpPlugin(optimizer_in_backward=True))
    model = script.build_model()
    model, optimizer = acc.prepare(model, script.optimizer_for(model))
    losses = train_steps(acc, model, optimizer, batch(world)[rank::world].to(acc.device), 2 * STEPS)
    return {"losses": losses, "state": acc.get_state_dict(model)}


def test_accumulation_with_the_optimizer_in_backward_on_one_replica(pools) -> None:
    """On one replica Accelerate's ``accumulate`` syncs every micro-step; with the optimizer in
    backward ours uses the engine's ``no_sync`` there, so each step applies both micro-batches'
    gradients once, as the plain model's accumulation does."""
    plain = script.build_model()
    optimizer = script.optimizer_for(plain)
    ids, plain_losses = batch(1), []
    for micro in range(2 * STEPS):
        loss = plain(input_ids=ids, labels=ids).loss
        (loss / 2).backward()
        if micro % 2 == 1:
            optimizer.step()
            optimizer.zero_grad()
        plain_losses.append(loss.item())
    (out,) = pools[1].run(accumulate_in_backward, 1)
    torch.testing.assert_close(out["losses"], torch.tensor(plain_losses), rtol=1e-5, atol=1e-6)
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(out["state"][name], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def save_small_model(rank: int, world: int, folder: str) -> None:
    acc = Accelerator()
    acc.prepare(torch.nn.Sequential(torch.nn.Linear(4, 3)))
    acc.save_state(folder)


def test_fp16_is_refused() -> None:
    with pytest.raises(ValueError, match="fp16.*bf16"):
        Accelerator(mixed_precision="fp16")


def test_plugin_reads_code_then_environment_then_config_file(tmp_path: Path, monkeypatch) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(
        "distributed_type: XLA\nnum_processes: 4\nfsdp_config:\n  fsdp_min_num_params: 1000\n"
        "  fsdp_auto_wrap_policy: SIZE_BASED_WRAP\n  xla_fsdp_flatten_parameters: true\n  fsdp_version: 2\n"
    )
    monkeypatch.setenv(CONFIG_FILE_ENV, str(config))
    monkeypatch.setenv("FSDP_MIN_NUM_PARAMS", "2000")
    plugin = XlaFsdpPlugin(reduce_scatter_bucket_size_mb=0.5)
    assert (plugin.auto_wrap_policy, plugin.min_num_params, plugin.flatten_parameters) == (
        "size_based_wrap",
        2000,
        True,
    )
    assert plugin.reduce_scatter_bucket_size_mb == 0.5 and plugin.reshard_after_forward is True
    assert XlaFsdpPlugin(min_num_params=10).min_num_params == 10


def test_plugin_layout_default_is_the_platforms(monkeypatch) -> None:
    """Unset, flat shards on XLA:CPU (a faster step there) and per-parameter ones on dim 0 on a TPU
    (less temp as the TPU compiler plans a step: docs/tpu.md), in either precision; a value given
    stays."""
    monkeypatch.delenv(CONFIG_FILE_ENV, raising=False)
    monkeypatch.delenv("XLA_FSDP_FLATTEN_PARAMETERS", raising=False)
    monkeypatch.delenv("XLA_FSDP_SHARD_PARAM_ON_DIM_0", raising=False)

    def layout(dtype: torch.dtype = torch.float32, **given) -> tuple:
        options = XlaFsdpPlugin(**given).engine_options(dtype)
        return options.flatten_parameters, options.shard_param_on_dim_0

    assert layout() == layout(torch.bfloat16) == (True, False)
    assert layout(shard_param_on_dim_0=True) == (False, True)
    assert layout(flatten_parameters=False) == (False, False)
    with _xla.tracing_replica(0, 4, "TPU"):
        assert layout() == layout(torch.bfloat16) == layout(flatten_parameters=False) == (False, True)
        assert layout(flatten_parameters=True) == (True, False)
        assert layout(shard_param_on_dim_0=False) == (False, False)


def test_plugin_keeps_the_vocabulary_sharded_on_a_tpu(monkeypatch) -> None:
    """Unset, ``keep_vocabulary_sharded`` is on with dim-0 shards on a TPU (the compiler plans less
    with it: docs/tpu.md) and off on XLA:CPU; a value given stays."""
    monkeypatch.delenv(CONFIG_FILE_ENV, raising=False)
    for env in ("XLA_FSDP_FLATTEN_PARAMETERS", "XLA_FSDP_SHARD_PARAM_ON_DIM_0", "XLA_FSDP_KEEP_VOCABULARY_SHARDED"):
        monkeypatch.delenv(env, raising=False)

    def kept(**given) -> bool:
        return XlaFsdpPlugin(**given).engine_options(torch.bfloat16).keep_vocabulary_sharded

    assert not kept() and kept(shard_param_on_dim_0=True, keep_vocabulary_sharded=True)
    with _xla.tracing_replica(0, 4, "TPU"):
        assert kept() and not kept(keep_vocabulary_sharded=False)
        assert not kept(flatten_parameters=True) and not kept(shard_param_on_dim_0=False)


@pytest.mark.parametrize(
    "section, message",
    [
        (
            "  fsdp_min_num_param: 10\n",
            r"unknown fsdp_config key\(s\) \['fsdp_min_num_param'\]. Valid keys: .*fsdp_min_num_params",
        ),
        (
            "  fsdp_auto_wrap_policy: SIZE_BASED_WRAP\n  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer\n",
            "contradict",
        ),
        ("  xla_fsdp_flatten_parameters: true\n  xla_fsdp_shard_param_on_dim_0: true\n", "contradict"),
        ("  fsdp_offload_params: true\n", "fsdp_offload_params.*not offered"),
        ("  fsdp_backward_prefetch: BACKWARD_POST\n", "BACKWARD_POST.*BACKWARD_PRE"),
        ("  fsdp_min_num_params: many\n", "fsdp_min_num_params: expected a whole number"),
    ],
    ids=["misspelled", "size-and-classes", "flat-and-dim0", "offload", "prefetch", "value"],
)
def test_bad_config_is_refused(tmp_path: Path, monkeypatch, section: str, message: str) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("distributed_type: XLA\nnum_processes: 4\nfsdp_config:\n" + section)
    monkeypatch.setenv(CONFIG_FILE_ENV, str(config))
    with pytest.raises(ValueError, match=message):
        XlaFsdpPlugin()


def checkpointing_and_save_model(rank: int, world: int, folder: str) -> Dict[str, Any]:
    acc = Accelerator()
    ids = torch.randint(0, script.VOCAB, (2, 8), generator=torch.Generator().manual_seed(rank)).to(acc.device)
    out: Dict[str, Any] = {}
    for checkpointed in (False, True):
        model = script.build_model()
        if checkpointed:
            model.gradient_checkpointing_enable()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = acc.prepare(model, optimizer)
        loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        optimizer.step()
        out[checkpointed] = (loss.detach().cpu(), acc.get_state_dict(model))
    inner = acc.unwrap_model(model)
    out["taken over"] = (
        not any(getattr(m, "gradient_checkpointing", False) for m in inner.modules()),
        all("forward" in vars(unit.module) for unit in inner.model.layers),  # each layer is an FSDP unit
        "forward" not in vars(inner.model),
    )
    acc.save_model(model, folder)
    return out


def test_gradient_checkpointing_is_taken_over_and_save_model_loads(pools, tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    results = pools[2].run(checkpointing_and_save_model, 2, str(tmp_path / "model"))
    for out in results:
        assert out["taken over"] == (True, True, True), "transformers' checkpointing replaced on the blocks alone"
        torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-6, atol=1e-6)
        for name, value in out[False][1].items():
            torch.testing.assert_close(out[True][1][name], value, rtol=1e-6, atol=1e-6)
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "model")
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, results[0][True][1][name]), name


def save_plain_model(rank: int, world: int, folder: str) -> Dict[str, torch.Tensor]:
    acc = Accelerator()
    model = acc.prepare(torch.nn.Sequential(torch.nn.Linear(4, 3)))
    acc.save_model(model, folder)
    return acc.get_state_dict(model)


def test_save_model_of_a_model_without_save_pretrained_creates_its_folder(pools, tmp_path: Path) -> None:
    """huggingface_hub's writer does not create the folder (FileNotFoundError on the main replica,
    the others left waiting); Accelerate's save_model does, and so does ours."""
    from safetensors.torch import load_file

    folder = tmp_path / "new" / "model"
    state = pools[2].run(save_plain_model, 2, str(folder))[0]
    saved = load_file(folder / "model.safetensors")
    assert sorted(saved) == sorted(state) and all(torch.equal(saved[k], state[k]) for k in state)


def different_initial_models(rank: int, world: int) -> Dict[str, torch.Tensor]:
    acc = Accelerator()
    with seeded(rank):  # each replica its own random weights
        model = script.LlamaForCausalLM(script.model_config())
    return acc.get_state_dict(acc.prepare(model))


def test_sync_module_states_starts_every_replica_from_rank_0(pools) -> None:
    with seeded(0):
        rank0 = script.LlamaForCausalLM(script.model_config()).state_dict()
    for state in pools[2].run(different_initial_models, 2):
        for name, value in rank0.items():
            assert torch.equal(state[name], value), name


@pytest.mark.parametrize("where", ["local", "memory"])
def test_checkpoint_folders_commit_and_rotate(tmp_path: Path, where: str, caplog) -> None:
    """[Note: save_state folders] without devices: which checkpoint_<n> are complete, and what
    rotation removes (only saves of ours, record first; what a rotation cut short left too)."""
    import fsspec

    from accel_xla_fsdp.checkpoint.store import Location
    from accel_xla_fsdp.hf_accelerate import checkpoints

    url = str(tmp_path / "checkpoints") if where == "local" else f"memory://{tmp_path.name}/checkpoints"
    root = Location.of(url)

    def put(name: str, data: str = "ours") -> None:
        (root / name).put(data.encode())

    def saved(n: int, record: bool = True) -> None:
        put(f"checkpoint_{n}/state-000003/started.json")
        put(f"checkpoint_{n}/state-000003/xla_fsdp_0/save-000000/checkpoint.json")
        put(f"checkpoint_{n}/state-000003/random_states_0.pkl")
        if record:
            put(f"checkpoint_{n}/{checkpoints.STATE_RECORD}", '{"state": "state-000003"}')

    put("checkpoint_0/xla_fsdp_0/save-000000/checkpoint.json")  # an earlier version's folder
    put("checkpoint_0/random_states_0.pkl")
    put(f"checkpoint_0/{checkpoints.EARLIER_MANIFEST}", '{"written": ["xla_fsdp_0", "random_states_0.pkl"]}')
    put("checkpoint_0/logs/events", "the user's")
    saved(1, record=False)  # what a rotation cut short left: its record removed
    put("checkpoint_1/notes", "the user's")
    put("checkpoint_1/state-000009/notes", "the user's: no marker, not ours")
    for n in (2, 5, 10):
        saved(n)
    saved(11, record=False)  # a save killed before its record
    put("checkpoint_12.partial/x")  # never a checkpoint
    found = checkpoints.complete_checkpoints(root)
    assert [f.name for f in found] == ["checkpoint_0", "checkpoint_2", "checkpoint_5", "checkpoint_10"]
    assert "skipping incomplete checkpoint(s) checkpoint_11 (no accel_xla_fsdp_state.json" in caplog.text
    assert (
        checkpoints.complete_state(found[0]) == found[0]
        and checkpoints.complete_state(found[1]).name == "state-000003"
    )
    with pytest.raises(
        CheckpointError, match="checkpoint_11: no complete save_state checkpoint: state-000003 did not"
    ):
        checkpoints.complete_state(root / "checkpoint_11")
    put("checkpoint_10/state-000004/started.json")  # a newer save into checkpoint_10, killed
    assert checkpoints.complete_state(found[-1]).name == "state-000003"
    assert "checkpoint_10: skipping incomplete save(s) state-000004 (no accel_xla_fsdp_state.json names" in caplog.text
    checkpoints.rotate(root, total_limit=2)
    fs, path = fsspec.core.url_to_fs(url)
    left = sorted(str(p)[len(path.rstrip("/")) + 1 :] for p in fs.find(path))
    kept = [
        f"checkpoint_{n}/{f}"
        for n in (10, 11)
        for f in (
            "state-000003/random_states_0.pkl",
            "state-000003/started.json",
            "state-000003/xla_fsdp_0/save-000000/checkpoint.json",
        )
    ]
    assert left == sorted(
        [
            "checkpoint_0/logs/events",
            "checkpoint_1/notes",
            "checkpoint_1/state-000009/notes",
            "checkpoint_10/accel_xla_fsdp_state.json",
            "checkpoint_10/state-000004/started.json",
            "checkpoint_12.partial/x",
            "checkpoint_5/accel_xla_fsdp_state.json",
            *[f.replace("checkpoint_11", "checkpoint_5") for f in kept if f.startswith("checkpoint_11")],
            *kept,
        ]
    )
    if where == "local":
        assert not (tmp_path / "checkpoints" / "checkpoint_2").exists()  # nothing else was in it
