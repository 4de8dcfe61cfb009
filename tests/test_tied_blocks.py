"""A block class from ``_no_split_modules`` that holds a tied weight (BERT's ``BertEmbeddings``,
whose word embedding is the masked-LM decoder), and ``model.tie_weights()`` after ``prepare()``,
as transformers' ``run_mlm_no_trainer.py`` calls it on XLA.

transformers' model classes are imported at module level: its lazy imports are not thread-safe.
"""

from __future__ import annotations

from typing import Dict

import torch
from transformers import BertConfig, BertForMaskedLM
from transformers.models.bert.modeling_bert import BertEmbeddings, BertLayer

from accel_xla_fsdp import Accelerator, TransformerBlockPolicy, seeded


def tiny_bert() -> BertForMaskedLM:
    config = BertConfig(
        vocab_size=40,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    with seeded(0):
        return BertForMaskedLM(config)


def test_tied_block_stays_in_the_outer_unit() -> None:
    model = tiny_bert()
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    policy = TransformerBlockPolicy().for_model(model)  # BertEmbeddings and BertLayer, by _no_split_modules
    assert not policy(module=model.bert.embeddings, recurse=False, unwrapped_params=0)
    assert all(policy(module=layer, recurse=False, unwrapped_params=0) for layer in model.bert.encoder.layer)
    named = TransformerBlockPolicy([BertEmbeddings, BertLayer]).for_model(model)
    assert named(module=model.bert.embeddings, recurse=False, unwrapped_params=0), "classes named: as asked"


def masked_lm_logits(rank: int, world: int) -> Dict[str, torch.Tensor]:
    acc = Accelerator()
    plain = tiny_bert().eval()
    model = acc.prepare(tiny_bert())
    model.tie_weights()  # what the example does on XLA after prepare()
    model.eval()
    ids = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(rank))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        logits = model(input_ids=ids.to(acc.device), attention_mask=mask.to(acc.device)).logits.cpu()
        return {"logits": logits, "plain": plain(input_ids=ids, attention_mask=mask).logits}


def test_tied_bert_prepares_and_tie_weights_changes_nothing(pools) -> None:
    for out in pools[2].run(masked_lm_logits, 2):
        torch.testing.assert_close(out["logits"], out["plain"], rtol=1e-5, atol=1e-5)
