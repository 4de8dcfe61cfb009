"""``lm_loss_in_chunks``: transformers' causal-LM loss computed from lm_head's shard a chunk at a
time (sharded_loss.py), trained on 2 devices against the plain model on the CPU.

The vocabulary (8,300 rows on 2 replicas: 4,150 a part) takes two of lm_head's chunks at width 64
(4,096 rows each; ``_xla.reduce_scatter_row_chunks``), the second one padded; labels include
ignored tokens, and the second step passes ``num_items_in_batch`` as the Trainer does. Tied, the
table's shard takes the loss's gradient and the embedding's; under ``no_sync`` each micro-batch's
is reduced and added to the shard's gradient.
"""

from __future__ import annotations

import contextlib
from typing import Dict, List, Tuple

import pytest
import torch
from models import _plain_state
from tiny_llama import TINY_LLAMA
from transformers import LlamaConfig, LlamaForCausalLM  # at import time: not thread-safe later
from transformers.loss.loss_utils import ForCausalLMLoss

from accel_xla_fsdp import XlaFullyShardedDataParallel as FSDP
from accel_xla_fsdp import _xla, seeded, sharded_loss, transformer_block_policy

CONFIG = dict(TINY_LLAMA, hidden_size=64, vocab_size=8300, use_cache=False)
ROWS, TOKENS, STEPS = 2, 12, 2  # a replica's rows of each global batch


def build(tied: bool) -> LlamaForCausalLM:
    with seeded(0):
        return LlamaForCausalLM(LlamaConfig(**CONFIG, tie_word_embeddings=tied, attn_implementation="eager"))


def global_batch(step: int, world: int) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, CONFIG["vocab_size"], (ROWS * world, TOKENS), generator=g)
    labels = ids.masked_fill(torch.rand(ids.shape, generator=g) < 0.25, -100)  # ignored tokens
    return ids, labels


def replica_loss(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, step: int) -> torch.Tensor:
    """Step 0 the mean over the labels; step 1 their sum over num_items_in_batch (the Trainer's)."""
    kwargs = {}
    if step == 1:
        kwargs["num_items_in_batch"] = (labels[:, 1:] != -100).sum()
    return model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels, **kwargs)


def micro_batches(ids: torch.Tensor, labels: torch.Tensor, count: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    return list(zip(ids.chunk(count), labels.chunk(count)))


def train_fsdp(rank: int, world: int, chunked: bool, tied: bool = False, accumulate: int = 1) -> Dict[str, object]:
    """``accumulate`` micro-batches a step, all but the last under ``no_sync``."""
    model = FSDP(
        build(tied),
        auto_wrap_policy=transformer_block_policy(),
        shard_param_on_dim_0=True,
        keep_vocabulary_sharded=True,
        lm_loss_in_chunks=chunked,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    dev = _xla.device()
    losses: List[torch.Tensor] = []
    logits = None
    for step in range(STEPS):
        ids, labels = (t[rank * ROWS : (rank + 1) * ROWS].to(dev) for t in global_batch(step, world))
        for i, (part, part_labels) in enumerate(micro_batches(ids, labels, accumulate)):
            with model.no_sync() if i < accumulate - 1 else contextlib.nullcontext():
                out = replica_loss(model, part, part_labels, step)
                (out.loss / accumulate).backward()
            losses.append(out.loss.detach().cpu())
        optimizer.step()
        optimizer.zero_grad()
        _xla.sync()
        if step == 0:
            logits = out.logits.detach().cpu()  # the script reads them: computed as before
    return {
        "losses": losses,
        "logits": logits,
        "loss_function": model.module.loss_function,
        "state": model.full_state_dict(),
    }


def train_reference(world: int, tied: bool = False, accumulate: int = 1) -> Dict[str, object]:
    """The plain model on the CPU: each step the mean of the replicas' micro-batches' losses."""
    model = build(tied)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses: List[List[torch.Tensor]] = [[] for _ in range(world)]
    logits = []
    for step in range(STEPS):
        ids, labels = global_batch(step, world)
        outs = []
        for rank in range(world):
            part = slice(rank * ROWS, (rank + 1) * ROWS)
            for micro_ids, micro_labels in micro_batches(ids[part], labels[part], accumulate):
                outs.append(replica_loss(model, micro_ids, micro_labels, step))
                losses[rank].append(outs[-1].loss.detach())
        torch.stack([o.loss for o in outs]).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 0:
            logits = [outs[(rank + 1) * accumulate - 1].logits.detach() for rank in range(world)]
    return {"losses": losses, "logits": logits, "state": _plain_state(model)}


@pytest.mark.parametrize("tied, accumulate", [(False, 1), (True, 2)], ids=["untied", "tied-no_sync"])
def test_loss_from_lm_heads_chunks_trains_as_the_plain_model(pools, tied: bool, accumulate: int) -> None:
    world = 2
    assert len(_xla.reduce_scatter_row_chunks(4150, CONFIG["hidden_size"])) == 2  # what the test needs
    results = pools[world].run(train_fsdp, world, True, tied, accumulate)
    ref = train_reference(world, tied, accumulate)
    for rank, got in enumerate(results):
        assert got["loss_function"] is sharded_loss.causal_lm_loss
        torch.testing.assert_close(got["losses"], ref["losses"][rank], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["logits"], ref["logits"][rank], rtol=1e-5, atol=1e-6)
        assert sorted(got["state"]) == sorted(ref["state"])
        for name, want in ref["state"].items():
            torch.testing.assert_close(got["state"][name], want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_without_the_option_transformers_loss_is_left_alone(pools) -> None:
    (got, _) = pools[2].run(train_fsdp, 2, False)
    assert got["loss_function"] is ForCausalLMLoss
