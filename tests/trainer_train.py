"""A stock ``transformers`` Trainer script, launched by the tests (tests/test_trainer.py).

Its one change for XLA FSDP is the ``Trainer`` import: with ``USE_TORCH_XLA=0`` (the CPU
reference, under ``torchrun`` with gloo) it imports ``transformers.Trainer``. It fine-tunes a
tiny Llama saved by ``save_model`` (``from_pretrained`` from that folder) on generated token
rows, with evaluation, gradient accumulation, clipping, a warmup schedule and checkpoints, and
writes (main process) the Trainer's log history and the final evaluation to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from datasets import Dataset
from tiny_llama import TINY_LLAMA
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, TrainingArguments

if os.environ.get("USE_TORCH_XLA") == "0":
    from transformers import Trainer
else:
    from accel_xla_fsdp import Trainer

SEQ = 16
VOCAB = 128


def save_model(folder: Path) -> None:
    """The tiny Llama the runs start from (called by the test, before the launches)."""
    config = LlamaConfig(**TINY_LLAMA, vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)


def dataset(rows: int, seed: int) -> Dataset:
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(seed))
    return Dataset.from_dict(
        {"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist(), "labels": ids.tolist()}
    )


def with_lora(model: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--per-device-batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--save-steps", type=int, default=3)
    p.add_argument("--save-total-limit", type=int, default=None)
    p.add_argument("--resume", default=None, help="a checkpoint folder, or 'last'")
    p.add_argument("--save-model", default=None, help="trainer.save_model(this folder) after training")
    p.add_argument("--learning-rate", type=float, default=3e-3)
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--lora", action="store_true", help="train a LoRA adapter (peft) on q_proj and v_proj")
    p.add_argument("--bf16", action="store_true", help="TrainingArguments(bf16=True)")
    p.add_argument("--train-rows", type=int, default=64)
    p.add_argument("--eval-rows", type=int, default=16)
    p.add_argument("--data-seed", type=int, default=None, help="TrainingArguments(data_seed=...)")
    p.add_argument("--drop-last", action="store_true", help="TrainingArguments(dataloader_drop_last=True)")
    p.add_argument("--extra-column", action="store_true", help="rows carry a column the model does not take")
    p.add_argument("--fsdp-config", default=None, help="TrainingArguments(fsdp=True, fsdp_config=this JSON)")
    return p.parse_args()


def main() -> None:
    cli = parse()
    args = TrainingArguments(
        output_dir=cli.output_dir,
        per_device_train_batch_size=cli.per_device_batch,
        per_device_eval_batch_size=cli.per_device_batch,
        gradient_accumulation_steps=2,
        max_steps=cli.steps,
        learning_rate=cli.learning_rate,
        weight_decay=0.1,
        lr_scheduler_type="linear",
        warmup_steps=2,
        max_grad_norm=0.5,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=3,
        save_strategy="steps",
        save_steps=cli.save_steps,
        save_total_limit=cli.save_total_limit,
        report_to="none",
        seed=7,
        disable_tqdm=True,
        activation_checkpointing=cli.activation_checkpointing,
        bf16=cli.bf16,
        data_seed=cli.data_seed,
        dataloader_drop_last=cli.drop_last,
        fsdp=bool(cli.fsdp_config),
        fsdp_config=json.loads(cli.fsdp_config) if cli.fsdp_config else None,
    )
    model = AutoModelForCausalLM.from_pretrained(cli.model)
    if cli.lora:
        model = with_lora(model)
    train, evaluation = dataset(cli.train_rows, 1), dataset(cli.eval_rows, 2)
    if cli.extra_column:  # remove_unused_columns (on by default) drops it before the collator
        train = train.add_column("note", ["x"] * len(train))
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=evaluation)
    resume = True if cli.resume == "last" else cli.resume
    trainer.train(resume_from_checkpoint=resume)
    final = trainer.evaluate()
    streamed = []
    if cli.save_model:
        if os.environ.get("USE_TORCH_XLA") != "0":  # whether the whole model was written as it was gathered
            from accel_xla_fsdp.hf_accelerate import unwrapped_save

            def recorded(*args, _original=unwrapped_save._written_as_gathered):
                done, result = _original(*args)
                streamed.append(done)
                return done, result

            unwrapped_save._written_as_gathered = recorded
        trainer.save_model(cli.save_model)
    if trainer.is_world_process_zero():
        plugin = getattr(trainer.accelerator, "xla_fsdp_plugin", None)
        # checkpoint_module replaces a block's forward on the instance
        forwards = [vars(m).get("forward") for m in trainer.model.modules()]
        checkpointed = sum(1 for f in forwards if getattr(f, "__qualname__", "").startswith("checkpoint_module"))
        record = {
            "log_history": trainer.state.log_history,
            "final": final,
            "world": trainer.args.world_size,
            "flatten_parameters": getattr(plugin, "flatten_parameters", None),
            "checkpointed": checkpointed,
            "save_model_streamed": streamed,
        }
        Path(cli.out).write_text(json.dumps(record))


def _mp_fn(index: int) -> None:
    main()


if __name__ == "__main__":
    main()
