"""A stock Accelerate training script, launched by the tests with the real ``accelerate launch``.

Its one change for XLA FSDP is the ``Accelerator`` import. It trains a tiny Llama with gradient
accumulation, clipping, a scheduler and a shuffled dataloader, can save and resume its state,
and writes (main process) what the test compares against one plain model: each optimizer step's
sample ids and per-replica losses, and the final full state dict.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration
from datasets import Dataset
from safetensors.torch import save_file
from tiny_llama import TINY_LLAMA
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM, get_linear_schedule_with_warmup

from accel_xla_fsdp import Accelerator, seeded

SEQ = 16
VOCAB = 128
MAX_NORM = 0.5
ROWS = 128  # 16 global batches: one epoch covers every run


def model_config() -> LlamaConfig:
    return LlamaConfig(
        **TINY_LLAMA, vocab_size=VOCAB, max_position_embeddings=SEQ, attn_implementation="eager", use_cache=False
    )


def dataset(rows: int) -> Dataset:
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(1234))
    return Dataset.from_dict({"input_ids": ids.tolist(), "idx": list(range(rows))}).with_format("torch")


def build_model() -> LlamaForCausalLM:
    with seeded(0):
        return LlamaForCausalLM(model_config())


def optimizer_for(model: torch.nn.Module) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=3e-3)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--project", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--batch", type=int, default=8, help="global batch, split between the replicas")
    p.add_argument("--save-at", type=int, default=0, help="save_state after this optimizer step")
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


def main() -> None:
    args = parse()
    # No set_seed here: on XLA:CPU the replicas are threads sharing one CPU generator, and one
    # replica reseeding it while another builds its model under seeded() would change that model.
    accelerator = Accelerator(
        gradient_accumulation_steps=args.accum,
        project_config=ProjectConfiguration(args.project, automatic_checkpoint_naming=True, total_limit=2),
        # Seedable sampler with its own seed: the same order on any number of replicas and in a
        # resumed run; split batches: the scheduler steps once per optimizer step.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=0, split_batches=True),
    )
    model = build_model()
    optimizer = optimizer_for(model)
    loader = DataLoader(dataset(ROWS), batch_size=args.batch, shuffle=True)
    scheduler = get_linear_schedule_with_warmup(optimizer, 2, 2 * args.steps)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    step, batches = 0, iter(loader)
    if args.resume:
        accelerator.load_state()
        step = accelerator.step // args.accum
        batches = iter(accelerator.skip_first_batches(loader, accelerator.step))
    record = {
        "steps": [],
        "world": accelerator.num_processes,
        "mixed_precision": accelerator.mixed_precision,
        "reshard_after_forward": model.options.reshard_after_forward,  # from the config file
        "flatten_parameters": model.options.flatten_parameters,
    }
    while step < args.steps:
        ids, losses, norms = [], [], []
        for _ in range(args.accum):
            batch = next(batches)
            with accelerator.accumulate(model):
                # The attention mask spares transformers 5 a value read back to the host
                # mid-forward, which would run the forward so far outside the replicas' turns.
                tokens = batch["input_ids"]
                out = model(input_ids=tokens, attention_mask=torch.ones_like(tokens), labels=tokens)
                accelerator.backward(out.loss)
                if accelerator.sync_gradients:
                    norms.append(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM).item())
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            ids.append(accelerator.gather(batch["idx"]).tolist())
            losses.append(accelerator.gather(out.loss.detach()).tolist())
        step += 1
        record["steps"].append({"ids": ids, "losses": losses, "norm": norms[0], "lr": scheduler.get_last_lr()[0]})
        if step == args.save_at:
            accelerator.save_state()
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        Path(args.out).write_text(json.dumps(record))
        save_file({k: v.contiguous() for k, v in state.items()}, str(Path(args.out).with_suffix(".safetensors")))
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
