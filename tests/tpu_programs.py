"""Export the TPU programs of the main configurations of a tiny Llama, for test_tpu_programs.py.

    .venv/bin/python tests/tpu_programs.py OUT_DIR WORLD

Traces replica 0 of WORLD in the TPU form (``_xla.tracing_replica``), one step per configuration,
and writes OUT_DIR/<name>.hlo (``tpu_program.export_step``) and OUT_DIR/manifest.json: for each
program its FSDP communication floor (``tpu_program.communication_floor``) and how many gathers
and reduce-scatters the floor holds. Run as a process of its own: tracing uses the process's
XLA:CPU device, and each configuration is a fresh model.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path
from typing import Callable, Dict, List, Tuple
from unittest import mock

import torch
import torch_xla
from accelerate import init_empty_weights
from models import LLAMA_CONFIG
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaMLP

from accel_xla_fsdp import XlaFullyShardedDataParallel as FSDP
from accel_xla_fsdp import _xla, checkpoint_module, seeded, sharded_tables, tpu_program, transformer_block_policy
from accel_xla_fsdp.construction import PlaceholderShards

SEQ, BATCH = 16, 2
WIDE = dict(hidden_size=128, intermediate_size=256)  # 4 heads of 32, 2 key-value heads: k_proj is 64 rows


def llama() -> LlamaForCausalLM:
    with seeded(0):
        return LlamaForCausalLM(LlamaConfig(**LLAMA_CONFIG, attn_implementation="eager"))


def per_layer(**kw) -> FSDP:
    return FSDP(llama(), auto_wrap_policy=transformer_block_policy(), **kw)


def dim0() -> FSDP:
    """Shards on dim 0 (the Accelerate plugin's TPU default in fp32) of a Llama whose rows are multiples
    of 128 elements wide, as real models' are: each gradient is reduce-scattered in its own shape."""
    with seeded(0):
        model = LlamaForCausalLM(LlamaConfig(**{**LLAMA_CONFIG, **WIDE}, attn_implementation="eager"))
    return FSDP(model, auto_wrap_policy=transformer_block_policy(), shard_param_on_dim_0=True)


def dim0_placeholders() -> FSDP:
    """dim0's model built on the meta device, its shards placeholders that hold no buffer
    (``PlaceholderShards``, as ``accel-xla-fsdp plan`` wraps a model): the same program."""
    with init_empty_weights(include_buffers=False):  # parameters on meta, buffers real
        model = LlamaForCausalLM(LlamaConfig(**{**LLAMA_CONFIG, **WIDE}, attn_implementation="eager"))
    return FSDP(
        model,
        auto_wrap_policy=transformer_block_policy(),
        shard_param_on_dim_0=True,
        param_init_fn=PlaceholderShards(),
    )


def dim0_lm_head(vocab: int = 16384, **options) -> FSDP:
    """dim0's Llama with a vocabulary of ``vocab`` rows. At 16384, lm_head's gradient is two
    reduce-scatter chunks on 4 chips, made and reduced one by one in its backward
    (``reduce_scatter_in_linear_backward``), or by autograd whole (the default); with
    ``keep_vocabulary_sharded`` lm_head is also gathered in those two chunks, and the embedding
    computed from its rows."""
    with seeded(0):
        config = LlamaConfig(**{**LLAMA_CONFIG, **WIDE, "vocab_size": vocab}, attn_implementation="eager")
        model = LlamaForCausalLM(config)
    return FSDP(model, auto_wrap_policy=transformer_block_policy(), shard_param_on_dim_0=True, **options)


def nested() -> FSDP:
    """Each layer's MLP a unit inside its layer's unit, inside the root."""
    model = llama()
    for layer in model.model.layers:
        layer.mlp = FSDP(layer.mlp)
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = FSDP(layer)
    return FSDP(model)


def checkpointed() -> FSDP:
    return FSDP(
        llama(),
        auto_wrap_policy=transformer_block_policy(),
        auto_wrapper_callable=lambda m, *a, **kw: FSDP(checkpoint_module(m), *a, **kw),
    )


def frozen_embedding() -> FSDP:
    model = llama()
    model.model.embed_tokens.weight.requires_grad_(False)
    return FSDP(model, auto_wrap_policy=transformer_block_policy())


# name -> (build, micro-batches, kind): "train" (one step, the first micro-batches under no_sync)
# or "eval" (a forward under no_grad).
CONFIGS: Dict[str, Tuple[Callable[[], FSDP], int, str]] = {
    "per_parameter": (lambda: per_layer(flatten_parameters=False), 1, "train"),
    "flat": (lambda: per_layer(flatten_parameters=True), 1, "train"),
    "nested": (nested, 1, "train"),
    "bf16": (lambda: per_layer(compute_dtype=torch.bfloat16), 1, "train"),
    # bf16 shards, gradients reduce-scattered in f32 (torch_xla's fp32_reduce_scatter)
    "bf16_shards_f32_reduce": (
        lambda: FSDP(
            llama().to(torch.bfloat16),
            auto_wrap_policy=transformer_block_policy(),
            compute_dtype=torch.bfloat16,
            fp32_reduce_scatter=True,
        ),
        1,
        "train",
    ),
    "checkpointed": (checkpointed, 1, "train"),
    "frozen": (frozen_embedding, 1, "train"),
    "dim0": (dim0, 1, "train"),
    "dim0_placeholders": (dim0_placeholders, 1, "train"),
    "lm_head_in_backward": (lambda: dim0_lm_head(reduce_scatter_in_linear_backward=True), 1, "train"),
    "lm_head_by_autograd": (lambda: dim0_lm_head(), 1, "train"),
    "vocabulary_sharded": (lambda: dim0_lm_head(keep_vocabulary_sharded=True), 1, "train"),
    # 4,000 rows per chip, not whole (16, 128) tiles, as Llama-3's 128,256 on 8 chips
    "vocabulary_sharded_bf16": (
        lambda: dim0_lm_head(16000, keep_vocabulary_sharded=True, compute_dtype=torch.bfloat16),
        1,
        "train",
    ),
    # the same, the loss from lm_head's chunks (lm_loss_in_chunks)
    "vocabulary_sharded_loss_in_chunks": (
        lambda: dim0_lm_head(
            16000, keep_vocabulary_sharded=True, lm_loss_in_chunks=True, compute_dtype=torch.bfloat16
        ),
        1,
        "train",
    ),
    "no_sync": (lambda: per_layer(), 2, "train"),
    # AdamW stepping each unit in backward (apply_optimizer_in_backward); the tables kept sharded
    # are stepped after backward
    "optimizer_in_backward": (lambda: dim0_lm_head(keep_vocabulary_sharded=True), 1, "train"),
    "eval": (lambda: per_layer(), 1, "eval"),
}
# Programs whose logits are written as a real model's are (slice assignments), though at 32 tokens
# they are small enough to be written in place (sharded_tables.IN_PLACE_LOGITS_BYTES).
AS_LARGE_LOGITS = {"vocabulary_sharded_bf16", "vocabulary_sharded_loss_in_chunks"}
# name -> (dtype, whole (16, 128) tiles of each chip's part): single gradients' reduce-scatters
# (reduce_scatter_sum, as FSDP issues them) that the old chunks of 12 MiB made all-reduces on 4
# chips: the compiler splits a part above 228 tiles into equal pieces ([Note: TPU reduce-scatter
# shapes]), and 229 tiles (one bf16 chunk of 3.8 MB) or 2 chunks of 229 (f32, 15 MB) do not split.
REDUCE_SCATTERS: Dict[str, Tuple[torch.dtype, int]] = {
    "reduce_scatter_bf16": (torch.bfloat16, 229),
    "reduce_scatter_f32": (torch.float32, 458),
}
assert LlamaDecoderLayer and LlamaMLP  # imported before any tracing: transformers' imports are lazy


def export(name: str, out: Path) -> dict:
    limit = -1 if name in AS_LARGE_LOGITS else sharded_tables.IN_PLACE_LOGITS_BYTES
    with mock.patch.object(sharded_tables, "IN_PLACE_LOGITS_BYTES", limit):
        return _export(name, out)


def _export(name: str, out: Path) -> dict:
    gc.collect()  # the previous configuration's tensors, pending collectives and all
    build, micro, kind = CONFIGS[name]
    model = build()
    ids = torch.arange(BATCH * SEQ).remainder(LLAMA_CONFIG["vocab_size"]).view(BATCH, SEQ).to(_xla.device())
    path = out / f"{name}.hlo"
    if kind == "eval":
        with torch.no_grad():
            loss = model(input_ids=ids, labels=ids).loss
        tpu_program.export_step([loss], None, path)
        return {"floor": tpu_program.communication_floor(model, training=False)}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    tpu_program.placeholder_optimizer_state(optimizer)
    donations = tpu_program.Donations.of_step(model, optimizer)
    if name == "optimizer_in_backward":
        model.apply_optimizer_in_backward(optimizer)
    for m in range(micro):
        if m < micro - 1:
            with model.no_sync():
                model(input_ids=ids, labels=ids).loss.backward()
        else:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    outputs: List[torch.Tensor] = [loss, *model.parameters(), *tpu_program.xla_tensors(optimizer)]
    exported = tpu_program.export_step(outputs, donations, path)
    floor = tpu_program.communication_floor(model, micro_batches=micro)
    return {"floor": floor, "aliased": exported.aliased, "kept_sharded": tpu_program.keeps_a_table_sharded(model)}


def export_reduce_scatter(name: str, out: Path, world: int, token) -> dict:
    """One gradient's reduce-scatter; its floor is one reduce-scatter of it per the ring model."""
    dtype, tiles = REDUCE_SCATTERS[name]
    device = _xla.device()
    torch_xla._XLAC._set_all_reduce_token(str(device), token)  # not chained to an earlier program
    grad = torch.full((world * tiles * _xla.TPU_SHARD_MULTIPLE,), 2.0, dtype=dtype).to(device)
    shard = _xla.reduce_scatter_sum(grad, world, 1.0 / world, None, pin_layout=False)
    tpu_program.export_step([shard], None, out / f"{name}.hlo")
    return {"floor": (world - 1) / world * grad.numel() * grad.element_size()}


def main() -> None:
    out, world = Path(sys.argv[1]), int(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    manifest = {}
    token = torch_xla._XLAC._get_all_reduce_token(str(_xla.device()))  # before any collective
    with _xla.tracing_replica(0, world, "TPU"):
        for name in CONFIGS:
            manifest[name] = export(name, out)
            print(name, manifest[name], flush=True)
        for name in REDUCE_SCATTERS:
            manifest[name] = export_reduce_scatter(name, out, world, token)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))


if __name__ == "__main__":
    main()
