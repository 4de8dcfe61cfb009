"""A masked-LM data pipeline after ``set_seed``, shared by test_replica_rng.py's replica threads and
its reference processes (this module imports nothing of accel_xla_fsdp)."""

from __future__ import annotations

import sys
import time
from typing import List

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from torch.utils.data import DataLoader
from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast, set_seed

WORDS = [f"w{i}" for i in range(40)]


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(["[PAD]", "[MASK]", "[UNK]", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", mask_token="[MASK]", unk_token="[UNK]")


def masked_batches(seed: int, epochs: int = 3) -> List[torch.Tensor]:
    """What a run draws after ``set_seed(seed)``: a shuffling dataloader (its per-epoch seed and
    order) whose collator masks 30% of the tokens, then a few state save/restore draws."""
    set_seed(seed)
    rows = [{"input_ids": [3 + (7 * i + j) % 40 for j in range(12)]} for i in range(10)]
    collator = DataCollatorForLanguageModeling(tokenizer(), mlm_probability=0.3)
    loader = DataLoader(rows, batch_size=4, shuffle=True, collate_fn=collator)
    drawn = []
    for _ in range(epochs):
        for batch in loader:
            drawn += [batch["input_ids"], batch["labels"]]
            time.sleep(0.002)  # let the other replica threads draw in between
    state = torch.get_rng_state()
    first = torch.rand(5)
    time.sleep(0.002)
    torch.set_rng_state(state)
    drawn += [first, torch.rand(5), torch.empty(3).uniform_(), torch.randperm(9)]
    return drawn


if __name__ == "__main__":  # the reference: a process of its own
    torch.save(masked_batches(int(sys.argv[1])), sys.argv[2])
