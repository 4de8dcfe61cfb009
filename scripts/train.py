"""Train a tiny Llama with FSDP on several XLA:CPU devices and print the loss of every step.

The corpus (scripts/data/corpus.txt) goes through ``datasets``: one UTF-8 byte is one token
(vocabulary 256), and the tokens are packed into blocks of ``--seq-len``. Every step takes a
global batch of ``--batch-size`` blocks; replica ``r`` of ``N`` trains on rows ``r::N`` of it.
The step's loss is the mean of the replicas' losses (their batches are the same size).

    bash scripts/train.sh --devices 4 --steps 20
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # wall time includes the imports (torch, transformers: ~15 s)

import argparse
import os
from pathlib import Path
from typing import Dict, List

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local: never ask the hub
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import datasets
import torch
from datasets import Dataset, load_dataset

# Model classes are imported here, before the replica threads start: transformers' lazy
# imports are not thread-safe.
from transformers import LlamaConfig, LlamaForCausalLM

import accel_xla_fsdp
from accel_xla_fsdp import XlaFullyShardedDataParallel, seeded, sync, transformer_block_policy

CORPUS = Path(__file__).parent / "data" / "corpus.txt"
VOCAB = 256  # byte-level: token = UTF-8 byte


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=4, help="XLA:CPU devices (replicas)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8, help="global batch, in blocks")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per block")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument(
        "--flatten",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one flat shard per FSDP unit (flatten_parameters)",
    )
    args = p.parse_args()
    if min(args.devices, args.steps, args.batch_size, args.seq_len) < 1:
        p.error("--devices, --steps, --batch-size and --seq-len must be positive")
    if args.batch_size % args.devices:
        p.error(f"--batch-size {args.batch_size} must be a multiple of --devices {args.devices}")
    return args


def model_config(seq_len: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max(128, seq_len),
        attn_implementation="eager",
    )


def load_blocks(path: Path, seq_len: int) -> torch.Tensor:
    """The corpus as a [num_blocks, seq_len] tensor of byte tokens, via ``datasets``."""
    datasets.disable_progress_bars()
    lines: Dataset = load_dataset("text", data_files=str(path), split="train", keep_in_memory=True)
    lines = lines.filter(lambda row: bool(row["text"].strip()))
    tokens = lines.map(
        lambda row: {"input_ids": list((row["text"] + "\n").encode("utf-8"))},
        remove_columns=["text"],
    )

    def pack(batch: Dict[str, List[List[int]]]) -> Dict[str, List[List[int]]]:
        flat = [t for ids in batch["input_ids"] for t in ids]
        usable = len(flat) - len(flat) % seq_len
        return {"input_ids": [flat[i : i + seq_len] for i in range(0, usable, seq_len)]}

    blocks = tokens.map(pack, batched=True, batch_size=len(tokens))
    blocks.set_format("torch")
    return blocks["input_ids"]


def global_batches(blocks: torch.Tensor, steps: int, batch_size: int) -> torch.Tensor:
    """[steps, batch_size, seq_len]: the blocks in a seeded random order, reshuffled each epoch."""
    per_epoch = len(blocks) // batch_size
    if per_epoch == 0:
        raise ValueError(f"the corpus has {len(blocks)} blocks, fewer than one batch of {batch_size}")
    gen = torch.Generator().manual_seed(0)
    batches = []
    while len(batches) < steps:
        order = torch.randperm(len(blocks), generator=gen)[: per_epoch * batch_size]
        batches.extend(blocks[order].view(per_epoch, batch_size, -1))
    return torch.stack(batches[:steps])


def replica(
    rank: int, world: int, config: LlamaConfig, batches: torch.Tensor, lr: float, flatten: bool
) -> List[torch.Tensor]:
    """Train on this replica's rows of every global batch; return its loss at each step."""
    with seeded(0):  # the replicas are threads sharing one RNG: build the same model on each
        model = LlamaForCausalLM(config)
    wrapped = XlaFullyShardedDataParallel(
        model, auto_wrap_policy=transformer_block_policy(), flatten_parameters=flatten
    )
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=lr)  # after wrapping: the shards
    device = next(wrapped.parameters()).device
    losses = []
    for batch in batches:
        input_ids = batch[rank::world].to(device)
        loss = wrapped(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        sync()  # one graph per step
        losses.append(loss.detach())
    return losses


def main() -> None:
    args = parse_args()
    blocks = load_blocks(CORPUS, args.seq_len)
    batches = global_batches(blocks, args.steps, args.batch_size)
    config = model_config(args.seq_len)
    results = accel_xla_fsdp.run_on_devices(
        replica, args.devices, args=(args.devices, config, batches, args.lr, args.flatten)
    )
    losses = torch.stack([torch.stack(r) for r in results]).mean(0)  # mean over replicas
    for step, loss in enumerate(losses.tolist()):
        print(f"step {step:3d}  loss {loss:.4f}")
    wall = time.perf_counter() - STARTED
    print(
        f"steps {args.steps}  devices {args.devices}  global batch {args.batch_size} x {args.seq_len} "
        f"tokens  corpus {len(blocks)} blocks  wall time {wall:.1f} s"
    )


if __name__ == "__main__":
    main()
