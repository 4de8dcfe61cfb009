"""``accelerator.unwrap_model(model).generate(...)`` with beams on an encoder-decoder (transformers'
run_translation_no_trainer.py and run_summarization_no_trainer.py evaluate this way): the unwrapped
model gathers the whole model for the generation, as the prepared model's ``generate`` does, and both
give the plain model's tokens. Each replica has its own inputs."""

from __future__ import annotations

import copy
from typing import Dict

import torch
from transformers import T5Config, T5ForConditionalGeneration

from accel_xla_fsdp import Accelerator, seeded

CONFIG = dict(
    vocab_size=40,
    d_model=32,
    d_kv=16,
    d_ff=64,
    num_layers=2,
    num_decoder_layers=2,
    num_heads=2,
    dropout_rate=0.0,
    pad_token_id=0,
    eos_token_id=1,
    decoder_start_token_id=0,
)


def generations(rank: int) -> Dict[str, torch.Tensor]:
    acc = Accelerator()
    with seeded(0):
        model = T5ForConditionalGeneration(T5Config(**CONFIG))
    plain = copy.deepcopy(model).eval()
    model = acc.prepare(model)
    model.eval()
    ids = torch.randint(2, CONFIG["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(rank))
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    settings = dict(num_beams=2, max_length=5, suppress_tokens=[0, 1])  # beams over real tokens
    with torch.no_grad():
        on_device = dict(input_ids=ids.to(acc.device), attention_mask=mask.to(acc.device))
        unwrapped = acc.unwrap_model(model).generate(**on_device, **settings)
        prepared = model.generate(**on_device, **settings)
        loss = model(**on_device, labels=on_device["input_ids"]).loss  # after generate: sharded again
        expected = plain.generate(ids, attention_mask=mask, **settings)
        plain_loss = plain(input_ids=ids, attention_mask=mask, labels=ids).loss
    return {
        "unwrapped": unwrapped.cpu(),
        "prepared": prepared.cpu(),
        "expected": expected,
        "loss": loss.cpu(),
        "plain loss": plain_loss,
    }


def test_unwrapped_model_generates_with_beams_as_the_plain_model(pools) -> None:
    for rank, out in enumerate(pools[2].run(generations)):
        assert torch.equal(out["unwrapped"], out["expected"]), rank
        assert torch.equal(out["prepared"], out["expected"]), rank
        torch.testing.assert_close(out["loss"], out["plain loss"], rtol=1e-5, atol=1e-6)
