"""FSDP on 1, 2 and 4 XLA devices trains exactly like one plain model on the same global batch.

Each case trains a few steps both ways and compares the loss at every step and every parameter
and buffer at the end. The tolerances are float32 round-off from summing gradients in another
order: a wrong gradient scale, a wrong or misaligned shard, or a missing reduction fails them.
"""

from __future__ import annotations

import functools
from typing import Dict, List

import pytest
import torch
from models import Case, Trace, train_fsdp, train_moe_reference, train_reference

RTOL, ATOL = 1e-5, 1e-6
# Adam divides each gradient by its own running magnitude, so on an element whose gradient is
# nearly zero it turns float32 round-off into updates of up to lr. Adam is also blind to a wrong
# gradient scale: the SGD cases, with the tight tolerance, are the ones that catch that.
ADAM_ATOL = 1e-5

FLAT = (("flatten_parameters", True),)
DIM0 = (("shard_param_on_dim_0", True),)
NO_RESHARD = (("reshard_after_forward", False),)
COALESCE = (("coalesce_all_gather_ops", True),)
# The tiny Llama's decoder block holds 9280 parameters (37 KB of float32 gradients): 1 MiB makes
# one bucket per unit, 0.01 MiB (10.5 KB) several.
BUCKET_1MB = (("reduce_scatter_bucket_size_mb", 1),)
SMALL_BUCKETS = (("reduce_scatter_bucket_size_mb", 0.01),)
# The root's Linear weights' gradients reduced in chunks in their backward (param_group.py).
LINEAR_RS = DIM0 + (("reduce_scatter_in_linear_backward", True),)
# The root's Embeddings and Linears computed from their shards (sharded_tables.py).
KEEP_SHARDED = DIM0 + (("keep_vocabulary_sharded", True),)

CASES = [
    # Every sharding layout, with and without resharding after forward.
    Case("nested_linear", FLAT),
    Case("nested_linear"),
    Case("nested_linear", DIM0),
    Case("nested_linear", FLAT + NO_RESHARD),
    Case("nested_linear", DIM0 + NO_RESHARD),
    # Tied weights and buffers; Adam; gradient accumulation; gradient clipping.
    Case("tied_transformer", FLAT, optimizer="adam", accumulation=2),
    Case("tied_transformer", optimizer="sgd", clip=0.5),
    # Experts sharded in groups of one beside shared parameters sharded across all.
    Case("moe"),
    Case("moe", FLAT, optimizer="adam"),
    # Frozen parameters and sizes that divide by no world size.
    Case("frozen_odd", DIM0),
    Case("frozen_odd", FLAT, optimizer="adam", accumulation=2),
    # A transformers causal LM wrapped per decoder block by class.
    Case("llama", FLAT, optimizer="adamw", accumulation=2),
    Case("llama", DIM0 + NO_RESHARD, optimizer="sgd", clip=1.0),
    # ... with activation checkpointing in every block, and with backward prefetch.
    Case("llama", optimizer="sgd", checkpoint=True),
    Case("llama", FLAT + (("backward_prefetch", True),), optimizer="sgd"),
    # Per-parameter shards gathered in one collective per unit, reduced in buckets (collectives.py);
    # sharding groups (buckets are per unit); frozen parameters and dim-0 shards of several shapes.
    Case("llama", COALESCE),
    Case("llama", SMALL_BUCKETS, optimizer="adamw", accumulation=2),
    Case("llama", COALESCE + BUCKET_1MB, optimizer="sgd", clip=1.0),
    Case("moe", COALESCE + SMALL_BUCKETS),
    Case("frozen_odd", DIM0 + COALESCE + BUCKET_1MB),
    # Gradients reduce-scattered chunk by chunk in the Linear's backward: several chunks; lm_head
    # (padded rows), accumulated over micro-batches; nested units' Linears left to autograd; a head
    # tied to the embedding (its part reduced in its backward, the embedding's at the end).
    Case("wide_head", LINEAR_RS),
    Case("llama", LINEAR_RS, optimizer="sgd", accumulation=2),
    Case("nested_linear", LINEAR_RS + NO_RESHARD),
    Case("tied_transformer", LINEAR_RS, optimizer="sgd", accumulation=2),  # the head is the embedding
    # The root's tables never gathered whole: lm_head in several chunks; the embedding from its
    # rows (llama: fewer tokens than rows) or gathered whole (tied_transformer: more), under
    # no_sync too, tied, checkpointed; nested units' Linears left to FSDP's gathers.
    Case("wide_head", KEEP_SHARDED),
    Case("llama", KEEP_SHARDED, optimizer="sgd", accumulation=2),
    Case("llama", KEEP_SHARDED, optimizer="adamw", checkpoint=True),
    Case("tied_transformer", KEEP_SHARDED, optimizer="sgd", accumulation=2),
    # ... but gathered whole for an embedding of its own forward that holds it too (Gemma-2's)
    Case("scaled_tied", KEEP_SHARDED, optimizer="sgd"),
    Case("nested_linear", KEEP_SHARDED + NO_RESHARD),
    # The optimizer stepping each unit in backward ([Note: the optimizer in backward]): the step
    # after backward steps the rest (the tables kept sharded); over micro-batches; several
    # buckets per unit; a head tied to the embedding, stepped once both parts are in.
    Case("llama", DIM0, optimizer="adamw", accumulation=2, in_backward=True),
    Case("llama", KEEP_SHARDED, optimizer="adamw", checkpoint=True, in_backward=True),
    Case("llama", FLAT + SMALL_BUCKETS, optimizer="adam", in_backward=True),
    Case("tied_transformer", LINEAR_RS, optimizer="sgd", in_backward=True),
]


@functools.cache
def reference(world: int, case: Case):
    if case.model == "moe":
        return train_moe_reference(world, case)
    return train_reference(world, case), None


def mean_over_replicas(traces: List[Trace], attr: str) -> torch.Tensor:
    return torch.stack([torch.stack(getattr(t, attr)) for t in traces]).mean(0)


def assert_states_close(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor], atol: float) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=RTOL, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_fsdp_matches_single_device(pool, case: Case) -> None:
    world = pool.num_devices
    traces = pool.run(train_fsdp, world, case)
    ref, ref_experts = reference(world, case)
    atol = ATOL if case.optimizer == "sgd" else ADAM_ATOL

    torch.testing.assert_close(mean_over_replicas(traces, "losses"), torch.stack(ref.losses), rtol=RTOL, atol=ATOL)
    if case.clip:
        for t in traces:  # every replica computes the same total norm
            torch.testing.assert_close(torch.stack(t.grad_norms), torch.stack(ref.grad_norms), rtol=RTOL, atol=ATOL)
    if ref_experts is None:
        for t in traces:
            assert_states_close(t.state, ref.state, atol)
        return
    for rank, t in enumerate(traces):
        expert = {k: v for k, v in t.state.items() if k.startswith("module.2.")}
        shared = {k: v for k, v in t.state.items() if k not in expert}
        assert_states_close(shared, ref.state, atol)
        assert_states_close(expert, ref_experts[rank], atol)
