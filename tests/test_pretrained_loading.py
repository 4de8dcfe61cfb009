"""``fsdp_cpu_ram_efficient_loading``: a stock ``from_pretrained`` then ``prepare()`` reads each
replica's shards from the weight files, and gives the model a plain ``from_pretrained`` gives.

The replicas run in a device process of their own with ``FSDP_CPU_RAM_EFFICIENT_LOADING=true``
(the key is read process-wide, as Accelerate reads it); the reference is a plain
``from_pretrained`` in the test process. The host-memory figure is in docs/accelerate.md (a one-off measurement).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Dict, Iterator

import pytest
import torch
from models import LAUNCH_LLAMA
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

from accel_xla_fsdp import Accelerator, DevicePool, seeded

WORLD = 2
CONFIG = dict(LAUNCH_LLAMA, pad_token_id=0)


@pytest.fixture(scope="module")
def efficient_pool() -> Iterator[DevicePool]:
    with DevicePool(WORLD, env={"FSDP_CPU_RAM_EFFICIENT_LOADING": "true"}) as pool:
        yield pool


def save_model(folder: Path, tied: bool, dtype: torch.dtype = torch.float32, max_shard_size: str = "5GB") -> None:
    with seeded(1):
        model = LlamaForCausalLM(LlamaConfig(**CONFIG, tie_word_embeddings=tied))
    model.to(dtype).save_pretrained(folder, max_shard_size=max_shard_size)


def assert_same_model(state: Dict[str, torch.Tensor], plain: torch.nn.Module) -> None:
    """``state`` (``get_state_dict`` of the prepared model) holds ``plain``'s weights exactly. Read
    into a copy of ``plain``, so that a tied head and non-persistent buffers count as the model does."""
    copy = type(plain)(plain.config).to(plain.dtype)
    copy.load_state_dict(state, strict=False)
    for name, value in plain.state_dict().items():
        assert name in state or name == "lm_head.weight" and plain.config.tie_word_embeddings, f"{name} missing"
        assert copy.state_dict()[name].dtype == value.dtype and torch.equal(copy.state_dict()[name], value), name


def ids() -> torch.Tensor:
    return torch.randint(1, CONFIG["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(0))


def load_and_prepare(rank: int, world: int, folder: str, model_class: str, dtype: str) -> Dict[str, Any]:
    """What a stock script does: Accelerator, from_pretrained, AdamW, prepare; what came out."""
    acc = Accelerator()
    cls = {"causal": LlamaForCausalLM, "classifier": LlamaForSequenceClassification}[model_class]
    model = cls.from_pretrained(folder, torch_dtype=getattr(torch, dtype))
    on_meta = sorted(n for n, p in model.named_parameters() if p.is_meta)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = acc.prepare(model, optimizer)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids().to(acc.device)).logits.cpu()
    return {
        "on meta": on_meta,
        "state": acc.get_state_dict(model),
        "logits": logits,
        "shard dtypes": sorted({str(p.dtype) for p in model.parameters()}),
    }


@pytest.mark.parametrize(
    "tied, max_shard_size", [(True, "5GB"), (False, "20KB")], ids=["tied", "untied, sharded files"]
)
def test_shards_come_from_the_files_and_equal_the_plain_model(
    efficient_pool, tmp_path: Path, tied: bool, max_shard_size: str
) -> None:
    save_model(tmp_path, tied, max_shard_size=max_shard_size)
    assert (len(list(tmp_path.glob("*.safetensors"))) > 1) == (not tied)
    plain = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    results = efficient_pool.run(load_and_prepare, WORLD, str(tmp_path), "causal", "float32")
    with torch.no_grad():
        want_logits = plain(input_ids=ids()).logits
    for out in results:
        assert out["on meta"] == sorted(n for n, _ in plain.named_parameters()), "whole model loaded before prepare"
        assert_same_model(out["state"], plain)
        # rotary inv_freq is computed, not stored: the logits show it is right
        torch.testing.assert_close(out["logits"], want_logits, rtol=1e-5, atol=1e-5)


def test_bfloat16_weights_stay_bfloat16_when_asked(efficient_pool, tmp_path: Path) -> None:
    save_model(tmp_path, tied=True, dtype=torch.bfloat16)
    for dtype in ("bfloat16", "float32"):
        plain = LlamaForCausalLM.from_pretrained(tmp_path, torch_dtype=getattr(torch, dtype))
        out = efficient_pool.run(load_and_prepare, WORLD, str(tmp_path), "causal", dtype)[0]
        assert out["shard dtypes"] == [f"torch.{dtype}"]
        assert_same_model(out["state"], plain)


def test_a_new_head_is_initialized_once_and_shared(efficient_pool, tmp_path: Path) -> None:
    """A classifier loaded from a causal LM: the files lack ``score.weight``; transformers
    initializes it, and every replica takes rank 0's."""
    save_model(tmp_path, tied=False)
    plain = LlamaForSequenceClassification.from_pretrained(tmp_path)
    results = efficient_pool.run(load_and_prepare, WORLD, str(tmp_path), "classifier", "float32")
    assert "score.weight" not in results[0]["on meta"]
    plain.score.weight.data = results[0]["state"]["score.weight"]  # the one weight not from the files
    assert_same_model(results[0]["state"], plain)
    assert torch.equal(results[0]["state"]["score.weight"], results[1]["state"]["score.weight"])
    assert results[0]["state"]["score.weight"].abs().sum() > 0


def lora_prepared(rank: int, world: int, folder: str) -> Dict[str, Any]:
    """PEFT's LoRA on a model loaded into shards: its adapters keep their initial values."""
    from peft import LoraConfig, get_peft_model

    acc = Accelerator()
    model = LlamaForCausalLM.from_pretrained(folder)
    with seeded(0):
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model, optimizer = acc.prepare(model, optimizer)
    stepped = sum(p.numel() for group in optimizer.param_groups for p in group["params"])
    return {"state": acc.get_state_dict(model), "optimizer elements": stepped * world}


def test_peft_lora_on_a_model_loaded_into_shards(efficient_pool, tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model

    save_model(tmp_path, tied=True)
    plain = LlamaForCausalLM.from_pretrained(tmp_path)
    with seeded(0):
        plain = get_peft_model(plain, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    want = plain.state_dict()
    assert any("lora_A" in name for name in want) and any(".base_layer." in name for name in want)
    assert any(v.abs().sum() > 0 for n, v in want.items() if "lora_A" in n)
    for out in efficient_pool.run(lora_prepared, WORLD, str(tmp_path)):
        for name, value in want.items():
            if name.endswith("lm_head.weight"):  # tied: the embedding
                continue
            assert torch.equal(out["state"][name], value), name
        lora = sum(v.numel() for n, v in want.items() if "lora_" in n)
        assert lora <= out["optimizer elements"] < lora + 2 * WORLD * 4, "the optimizer holds the adapters only"


def prepare_resized(rank: int, world: int, folder: str) -> str:
    acc = Accelerator()
    model = LlamaForCausalLM.from_pretrained(folder)
    model.resize_token_embeddings(CONFIG["vocab_size"] + 8, mean_resizing=False)  # with it: .item() on meta
    try:
        acc.prepare(model)
    except ValueError as e:
        return str(e)
    return "prepared"


def test_a_resized_embedding_is_refused_by_name(efficient_pool, tmp_path: Path) -> None:
    save_model(tmp_path, tied=True)
    message = efficient_pool.run(prepare_resized, WORLD, str(tmp_path))[0]
    assert "'model.embed_tokens.weight' has shape [72, 32]" in message and "resize_token_embeddings" in message


def prepare_with_a_meta_module(rank: int, world: int, folder: str) -> str:
    acc = Accelerator()
    model = LlamaForCausalLM.from_pretrained(folder)
    model.extra = torch.nn.Linear(4, 4, device="meta")
    try:
        acc.prepare(model)
    except ValueError as e:
        return str(e)
    return "prepared"


def test_a_module_without_values_is_refused_by_name(efficient_pool, tmp_path: Path) -> None:
    save_model(tmp_path, tied=True)
    message = efficient_pool.run(prepare_with_a_meta_module, WORLD, str(tmp_path))[0]
    assert "'extra.weight' (and 1 more)" in message and "FSDP_CPU_RAM_EFFICIENT_LOADING=false" in message


def run_unprepared(rank: int, world: int, folder: str) -> str:
    model = LlamaForCausalLM.from_pretrained(folder)
    try:
        model(input_ids=ids())
    except RuntimeError as e:
        return str(e)
    return "ran"


def test_running_a_model_before_prepare_says_what_to_do(efficient_pool, tmp_path: Path) -> None:
    save_model(tmp_path, tied=True)
    message = efficient_pool.run(run_unprepared, WORLD, str(tmp_path))[0]
    assert "fsdp_cpu_ram_efficient_loading" in message and "accelerator.prepare(model)" in message


def test_unsupported_loading_arguments_are_refused(monkeypatch, tmp_path: Path) -> None:
    import accel_xla_fsdp.hf_accelerate  # noqa: F401 - installs the patch

    save_model(tmp_path, tied=True)
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "true")
    with pytest.raises(ValueError, match="device_map.*fsdp_cpu_ram_efficient_loading"):
        LlamaForCausalLM.from_pretrained(tmp_path, device_map="cpu")


_START = threading.Barrier(4)


def load_tied(rank: int, world: int, folder: str) -> Dict[str, Any]:
    _START.wait()  # all at once
    model = LlamaForCausalLM.from_pretrained(folder)
    return {
        "on meta": [n for n, p in model.named_parameters(remove_duplicate=False) if p.is_meta],
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
        "state": model.state_dict(),
    }


def test_from_pretrained_on_four_replica_threads_at_once(pools, tmp_path: Path) -> None:
    """The key off: every replica loads the whole model, all at once (transformers 5's loading is
    not thread-safe: without the lock the tied head stayed on the meta device)."""
    save_model(tmp_path, tied=True)
    plain = LlamaForCausalLM.from_pretrained(tmp_path)
    for out in pools[4].run(load_tied, 4, str(tmp_path)):
        assert out["on meta"] == [] and out["tied"]
        for name, value in plain.state_dict().items():
            assert torch.equal(out["state"][name], value), name


def test_the_key_set_in_code_reaches_from_pretrained(monkeypatch) -> None:
    """As Accelerate's FSDP plugin does, the plugin exports the key for ``from_pretrained``."""
    from accel_xla_fsdp import XlaFsdpPlugin
    from accel_xla_fsdp.hf_accelerate.plugin import configured

    monkeypatch.delenv("FSDP_CPU_RAM_EFFICIENT_LOADING", raising=False)
    assert configured("cpu_ram_efficient_loading") is False
    assert XlaFsdpPlugin(cpu_ram_efficient_loading=True).cpu_ram_efficient_loading is True
    assert configured("cpu_ram_efficient_loading") is True
