"""transformers' SDPA mask check on XLA:CPU replica threads (xla_cpu/sdpa_mask.py): a Llama
with SDPA attention and an attention mask reads nothing back mid-forward, and computes what the
same model computes on the CPU."""

from __future__ import annotations

import torch
import torch_xla
from tiny_llama import TINY_LLAMA
from transformers import LlamaConfig, LlamaForCausalLM, masking_utils

from accel_xla_fsdp import Accelerator, _xla, seeded  # noqa: F401  (the import a script makes)

CONFIG = LlamaConfig(**TINY_LLAMA, vocab_size=64, max_position_embeddings=32, attn_implementation="sdpa")
IDS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
MASK = torch.ones(2, 8, dtype=torch.long)


def sdpa_logits(rank: int, world: int) -> tuple:
    device = torch_xla.device()
    mask = MASK.to(device).bool()
    skipped = masking_utils._ignore_causal_mask_sdpa(mask, 8, 8, 0, 0)  # the original reads the mask back
    with seeded(0):
        model = LlamaForCausalLM(CONFIG).to(device)
    logits = model(input_ids=IDS.to(device), attention_mask=MASK.to(device)).logits
    _xla.sync()  # the step at a boundary, where replicas take turns; the pool reads the logits back
    return skipped, logits


def test_sdpa_masks_are_built_without_a_read_back_on_replica_threads(pools) -> None:
    with seeded(0):
        reference = LlamaForCausalLM(CONFIG)(input_ids=IDS, attention_mask=MASK).logits
    assert masking_utils._ignore_causal_mask_sdpa(MASK.bool(), 8, 8, 0, 0)  # on the CPU: transformers' answer
    for skipped, logits in pools[2].run(sdpa_logits, 2):
        assert skipped is False
        torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)
