"""Saving the way stock scripts and guides do, through ``prepare()``: the unwrapped model's
``save_pretrained`` without a state dict (every ``*_no_trainer.py`` example), ``get_state_dict``
with Accelerate's meaning, ``save_model``, a call on the main process only, and PEFT LoRA
adapters (trained exactly, saved both ways, loaded back with ``PeftModel.from_pretrained``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import accelerate_train as script
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaForCausalLM

from accel_xla_fsdp import Accelerator, XlaFsdpPlugin, seeded
from accel_xla_fsdp.state_dict import full_name

STEPS = 3
BATCH = 8  # global batch, split between the replicas


def tied_model() -> LlamaForCausalLM:
    config = script.model_config()
    config.tie_word_embeddings = True
    with seeded(0):
        model = LlamaForCausalLM(config)
    model.tie_weights()
    return model


def global_batch(step: int) -> torch.Tensor:
    return torch.randint(0, script.VOCAB, (BATCH, script.SEQ), generator=torch.Generator().manual_seed(100 + step))


def train(
    acc: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, world: int
) -> List[float]:
    """A few steps on this replica's rows of each global batch; the loss over every replica."""
    losses = []
    for step in range(STEPS):
        ids = global_batch(step)[rank::world].to(acc.device)
        loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(acc.reduce(loss.detach(), "mean").item())
    return losses


# -- the whole model -----------------------------------------------------------------------------


def stock_saves(rank: int, world: int, out: str, flatten: bool, tied: bool) -> Dict[str, Any]:
    acc = Accelerator(fsdp_plugin=XlaFsdpPlugin(flatten_parameters=flatten))
    model = tied_model() if tied else script.build_model()
    wanted = {name: value.dtype for name, value in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = acc.prepare(model, optimizer)
    train(acc, model, optimizer, rank, world)
    state = acc.get_state_dict(model)
    acc.wait_for_everyone()
    # transformers' examples, word for word but for the folder
    acc.unwrap_model(model).save_pretrained(
        f"{out}/stock", is_main_process=acc.is_main_process, save_function=acc.save
    )
    acc.save_model(model, f"{out}/save_model")
    return {"wanted": wanted, "state": state, "full": model.full_state_dict()}


@pytest.mark.parametrize(
    "world,flatten,tied", [(2, False, False), (4, True, True)], ids=["2dev-per-param", "4dev-flat-tied"]
)
def test_stock_save_pretrained_and_get_state_dict(
    pools, tmp_path: Path, world: int, flatten: bool, tied: bool
) -> None:
    results = pools[world].run(stock_saves, world, str(tmp_path), flatten, tied)
    first = results[0]
    wanted, state, full = first["wanted"], first["state"], first["full"]
    # get_state_dict: the unwrapped model's state_dict() keys (tied names, no computed rotary
    # buffer) and dtypes, on every replica
    assert set(state) == set(wanted)
    assert not any("inv_freq" in name for name in state)
    assert all(state[name].dtype == dtype for name, dtype in wanted.items())
    if tied:
        assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    tied_names = {"lm_head.weight", "model.embed_tokens.weight"} if tied else set()
    assert set(state) - set(full) <= tied_names, "full_state_dict has a tied weight under one name"
    for name in set(state) & set(full):
        assert torch.equal(state[name], full[name]), name
    for other in results[1:]:
        assert all(torch.equal(other["state"][name], value) for name, value in state.items())
    # both folders load with plain from_pretrained and hold the trained weights
    for folder in ("stock", "save_model"):
        loaded = LlamaForCausalLM.from_pretrained(tmp_path / folder).state_dict()
        assert set(loaded) == set(wanted), folder
        for name, value in state.items():
            assert torch.equal(loaded[name], value), f"{folder}: {name}"


def main_only_save(rank: int, world: int, out: str) -> Dict[str, Any]:
    acc = Accelerator()
    model = acc.prepare(script.build_model())
    start = time.monotonic()
    try:
        if acc.is_main_process:
            acc.unwrap_model(model).save_pretrained(out)
        acc.wait_for_everyone()
    except RuntimeError as e:
        return {"seconds": time.monotonic() - start, "error": str(e)}
    return {"seconds": time.monotonic() - start, "error": None}


def test_save_on_the_main_process_only_is_refused_at_once(pools, tmp_path: Path) -> None:
    results = pools[2].run(main_only_save, 2, str(tmp_path / "model"))
    for rank, result in enumerate(results):
        assert result["error"] is not None, f"replica {rank} went on"
        assert "state_dict() of the whole model" in result["error"] and "every process" in result["error"]
        assert result["seconds"] < 10, "refused at the rendezvous, not after a time-out"
    assert not (tmp_path / "model" / "model.safetensors").exists()


# -- PEFT LoRA ------------------------------------------------------------------------------------


def lora_model() -> torch.nn.Module:
    base = script.build_model()
    with seeded(1):  # LoRA's A matrices are drawn at random: the same on every replica
        return get_peft_model(
            base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
        )


def adapter_of(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}


def lora_on_replicas(rank: int, world: int, out: str, flatten: bool) -> Dict[str, Any]:
    acc = Accelerator(fsdp_plugin=XlaFsdpPlugin(flatten_parameters=flatten))
    model = lora_model()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer = acc.prepare(model, optimizer)
    losses = train(acc, model, optimizer, rank, world)
    state = acc.get_state_dict(model)
    unwrapped = acc.unwrap_model(model)
    unwrapped.save_pretrained(f"{out}/guide", state_dict=state, is_main_process=acc.is_main_process)
    unwrapped.save_pretrained(f"{out}/stock", is_main_process=acc.is_main_process)
    held = [p for group in optimizer.optimizer.param_groups for p in group["params"]]
    return {
        "losses": losses,
        "adapter": {n: v for n, v in state.items() if "lora_" in n},
        "optimizer numel": sum(p.numel() for p in held),
        "optimizer all trainable": all(p.requires_grad for p in held),
    }


def lora_reference() -> Dict[str, Any]:
    model = lora_model()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(STEPS):
        ids = global_batch(step)
        loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "adapter": adapter_of(model), "model": model.eval()}


@pytest.fixture(scope="module")
def reference() -> Dict[str, Any]:
    return lora_reference()


@pytest.mark.parametrize("world,flatten", [(2, True), (4, False)], ids=["2dev-flat", "4dev-per-param"])
def test_lora_trains_exactly_and_saves_its_adapter(
    pools, tmp_path: Path, reference, world: int, flatten: bool
) -> None:
    results = pools[world].run(lora_on_replicas, world, str(tmp_path), flatten)
    first = results[0]
    torch.testing.assert_close(torch.tensor(first["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=1e-6)
    assert set(first["adapter"]) == set(reference["adapter"])
    for name, value in reference["adapter"].items():
        torch.testing.assert_close(first["adapter"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    # the optimizer holds the adapter's shards only (padding aside)
    adapter_numel = sum(v.numel() for v in reference["adapter"].values())
    assert first["optimizer all trainable"]
    assert adapter_numel / world <= first["optimizer numel"] < adapter_numel / world + 128 * len(reference["adapter"])
    ids = global_batch(99)
    with torch.no_grad():
        expected = reference["model"](input_ids=ids).logits
    for folder in ("guide", "stock"):
        loaded = PeftModel.from_pretrained(script.build_model(), tmp_path / folder).eval()
        with torch.no_grad():
            torch.testing.assert_close(loaded(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5, msg=folder)
            merged = loaded.merge_and_unload()
            torch.testing.assert_close(merged(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-4, msg=folder)


# -- the stream -----------------------------------------------------------------------------------

PIECE_BYTES = 4096  # a quarter of the tiny model's embedding: every parameter of it in several programs


class StreamRecord:
    """What each replica's streamed state dicts did, recorded by wrapping state_dict.py's pieces."""

    def __init__(self) -> None:
        self.programs: Dict[int, List[Dict[str, int]]] = {}  # rank -> each program's figures
        self.placed: Dict[Tuple[int, str], int] = {}  # (rank, save) -> pieces copied into host tensors
        self.written: Dict[Tuple[int, str], int] = {}  # (rank, save) -> pieces written into files' holes
        self.save = ""  # the save being recorded

    def install(self, root_units: List[Any]) -> None:
        from accel_xla_fsdp import state_dict
        from accel_xla_fsdp.hf_accelerate.unwrapped_save import GatheredFiles

        record, drain, place, write = self, state_dict._PendingPieces.drain, state_dict._place, GatheredFiles.write
        self.restore = lambda: (
            setattr(state_dict._PendingPieces, "drain", drain),
            setattr(state_dict, "_place", place),
            setattr(GatheredFiles, "write", write),
            setattr(state_dict, "GATHER_BYTES", self.budget),
        )
        self.budget = state_dict.GATHER_BYTES

        def recorded_drain(pending: Any) -> None:
            if pending.pieces:
                units_holding = sum(any(g.gathered for g in unit.param_groups) for unit in root_units)
                record.programs.setdefault(_rank(), []).append({"bytes": pending.bytes, "units": units_holding})
            drain(pending)

        def recorded_place(*args: Any) -> None:
            key = (_rank(), record.save)
            record.placed[key] = record.placed.get(key, 0) + 1
            place(*args)

        def recorded_write(files: Any, *args: Any) -> None:
            key = (_rank(), record.save)
            record.written[key] = record.written.get(key, 0) + 1
            write(files, *args)

        state_dict._PendingPieces.drain = recorded_drain
        state_dict._place = recorded_place
        GatheredFiles.write = recorded_write  # type: ignore[method-assign]
        state_dict.GATHER_BYTES = PIECE_BYTES


def _rank() -> int:
    from accel_xla_fsdp import _xla

    return _xla.global_rank()


_RECORD = StreamRecord()


def streamed_stock_save(rank: int, world: int, out: str) -> Dict[str, Any]:
    from accel_xla_fsdp import _xla
    from accel_xla_fsdp.xla_cpu.rendezvous import agree

    acc = Accelerator(fsdp_plugin=XlaFsdpPlugin(flatten_parameters=True))
    model = tied_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = acc.prepare(model, optimizer)
    train(acc, model, optimizer, rank, world)
    units = [unit for _, unit in model.unit_state.named_units()]
    agree("install the recorder")
    if rank == 0:
        _RECORD.programs.clear()
        _RECORD.placed.clear()
        _RECORD.written.clear()
        _RECORD.save = "stock"
        _RECORD.install(units)
    agree("recorder installed")
    try:
        acc.unwrap_model(model).save_pretrained(
            f"{out}/stock", is_main_process=acc.is_main_process, save_function=acc.save
        )
        agree("stock save done")
        if rank == 0:
            _RECORD.save = "save_model"
        agree("recording save_model")
        acc.save_model(model, f"{out}/save_model")
    finally:
        agree("saved")
        if rank == 0:
            _RECORD.restore()
    # what the code before streaming gave: every unit gathered at once, then copied to the host
    with model.summon_full_params(writeback=False):
        _xla.sync()
        reference = {
            full_name(prefix, slot.name): slot.param.detach().cpu().clone()
            for prefix, unit in model.unit_state.named_units()
            for group in unit.param_groups
            for slot in group.slots
        }
    agree("reference taken")
    return {
        "programs": list(_RECORD.programs.get(rank, [])),
        "placed": {save: _RECORD.placed.get((rank, save), 0) for save in ("stock", "save_model")},
        "written": {save: _RECORD.written.get((rank, save), 0) for save in ("stock", "save_model")},
        "reference": reference,
    }


def test_stock_save_streams_and_writes_what_it_wrote_before(pools, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    results = pools[4].run(streamed_stock_save, 4, str(tmp_path))
    for rank, result in enumerate(results):
        programs = result["programs"]
        # two saves, each in many programs of at most PIECE_BYTES gathered, no unit's full
        # parameters gathered in any of them
        assert len(programs) >= 2 * 16, (rank, len(programs))
        assert max(p["bytes"] for p in programs) <= PIECE_BYTES, rank
        assert all(p["units"] == 0 for p in programs), rank
        # the stock save writes each piece into its file as it is gathered, and no replica
        # holds a full tensor; save_model keeps the state dict on the main replica only
        assert result["placed"]["stock"] == 0, f"replica {rank} copied full tensors to the host in the stock save"
        assert (result["written"]["stock"] > 0) == (rank == 0), (rank, result["written"])
        assert (result["placed"]["save_model"] > 0) == (rank == 0), (rank, result["placed"])
        assert result["written"]["save_model"] == 0, rank
    reference = results[0]["reference"]
    for folder in ("stock", "save_model"):
        saved = load_file(str(tmp_path / folder / "model.safetensors"))
        # the tied lm_head is saved once, under the embedding's name, as before
        assert set(saved) == set(reference) - {"lm_head.weight"}, folder
        for name, value in saved.items():
            assert value.dtype == reference[name].dtype and torch.equal(value, reference[name]), f"{folder}: {name}"
    # byte for byte what safetensors writes from the full state dict
    save_file(
        {name: reference[name] for name in saved}, str(tmp_path / "reference.safetensors"), metadata={"format": "pt"}
    )
    written = (tmp_path / "stock" / "model.safetensors").read_bytes()
    assert written == (tmp_path / "reference.safetensors").read_bytes()


def test_files_laid_out_with_holes_are_what_safetensors_writes(tmp_path: Path) -> None:
    """``GatheredFiles``: stand-ins become holes, filled piece by piece; buffers are written as
    they are; the file is byte for byte safetensors' own, dtypes mixed (its order of them)."""
    from safetensors.torch import save_file

    from accel_xla_fsdp.hf_accelerate.unwrapped_save import GatheredFiles

    values = {
        "w.bf16": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4),
        "w.f32": torch.linspace(0, 1, 10),
        "z.f16": torch.ones(5, dtype=torch.float16),
        "a.i64": torch.arange(3),
        "mask": torch.tensor([True, False, True]),
        "f8a": torch.zeros(4, dtype=torch.float8_e5m2),
        "f8b": torch.ones(4, dtype=torch.float8_e4m3fn),
    }
    params = {"w.bf16", "w.f32", "z.f16", "f8b"}
    files = GatheredFiles()
    laid_out = {}
    for name, value in values.items():
        if name in params:
            stand_in = torch.empty_like(value)
            files.stand_ins.params[stand_in.data_ptr()] = ((name,), value.numel(), value.dtype)
            laid_out[name] = stand_in
        else:
            files.stand_ins.buffers.add(value.data_ptr())
            laid_out[name] = value
    files.lay_out(laid_out, tmp_path / "ours.safetensors", {"format": "pt"})
    for name in sorted(params):
        flat = values[name].reshape(-1)
        for start in range(0, flat.numel(), 3):  # in pieces, out of order between parameters
            files.write((name, "an.alias.not.in.the.file"), start, flat[start : start + 3])
    files.finish()
    assert files.error is None
    save_file(values, str(tmp_path / "theirs.safetensors"), metadata={"format": "pt"})
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()


def test_a_file_with_a_tensor_made_from_stand_ins_is_saved_again_the_usual_way(tmp_path: Path) -> None:
    """A tensor that is neither a stand-in nor a buffer (a weight conversion's) ends the laying
    out: the save is then done again with the state dict gathered first (unwrapped_save.py)."""
    from accel_xla_fsdp.hf_accelerate.unwrapped_save import GatheredFiles, _NotStandIns

    files = GatheredFiles()
    stand_in = torch.empty(4)
    files.stand_ins.params[stand_in.data_ptr()] = (("w",), 4, torch.float32)
    with pytest.raises(_NotStandIns):
        files.lay_out({"w": stand_in, "w.converted": stand_in * 2}, tmp_path / "f.safetensors", None)
    with pytest.raises(_NotStandIns):  # a view of a stand-in is not the stand-in
        files.lay_out({"w": stand_in[:2]}, tmp_path / "g.safetensors", None)
    files.close()
