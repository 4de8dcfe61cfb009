"""A stock TRL script (``SFTTrainer``, ``DPOTrainer``), launched by tests/test_trl.py.

Nothing of accel_xla_fsdp in it: ``accel-xla-fsdp launch`` runs it on the engine, ``torchrun`` with
``USE_TORCH_XLA=0 ACCELERATE_USE_CPU=1`` on the CPU (the reference). Each ``--task`` trains a tiny
Llama from ``--model`` (a folder with a tokenizer, made by ``save_model``) on word rows made here,
with TRL's defaults but for those the test compares under (float32, ``logging_steps=1``), and
writes (main process) the log history, the Trainer's final model or adapter (``--save``), and what
the engine counted (programs compiled, graph cuts per optimizer step) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Dict, List

import torch
from datasets import Dataset
from tiny_llama import TINY_LLAMA
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, TrainerCallback

WORDS = [f"w{i}" for i in range(40)]
SPECIAL = ["<pad>", "<unk>", "<s>", "</s>"]
TASKS = ("sft", "sft-lora", "sft-packing", "dpo", "dpo-peft")


def tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS)}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=raw, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def save_model(folder: Path) -> None:
    """The tiny Llama and its tokenizer the runs start from (called by the test, before the launches)."""
    tok = tokenizer()
    config = LlamaConfig(
        **TINY_LLAMA,
        vocab_size=len(tok),
        max_position_embeddings=64,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        use_cache=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)


def _sentence(g: torch.Generator, low: int, high: int) -> str:
    n = int(torch.randint(low, high, (1,), generator=g))
    return " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (n,), generator=g))


def sft_rows(rows: int, seed: int = 1) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    return Dataset.from_dict({"text": [_sentence(g, 4, 14) for _ in range(rows)]})


def dpo_rows(rows: int, seed: int = 2) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    records = [(_sentence(g, 2, 6), _sentence(g, 2, 7), _sentence(g, 2, 7)) for _ in range(rows)]
    return Dataset.from_dict(
        {"prompt": [r[0] for r in records], "chosen": [r[1] for r in records], "rejected": [r[2] for r in records]}
    )


class _Counts(TrainerCallback):
    """Programs compiled and graph cuts at each optimizer step (under the engine: its counters)."""

    def __init__(self) -> None:
        self.per_step: List[Dict[str, int]] = []

    def on_step_end(self, args, state, control, **kwargs) -> None:  # noqa: ANN001
        counts = _engine_counts()
        if counts is not None:
            self.per_step.append(counts)


def _engine_counts() -> Dict[str, int] | None:
    if os.environ.get("USE_TORCH_XLA") == "0":
        return None
    import torch_xla.debug.metrics as met

    return {"compiles": int(met.metric_data("CompileTime")[0]), "executions": int(met.metric_data("ExecuteTime")[0])}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--tasks", required=True, help=f"comma-separated, run one after the other: {', '.join(TASKS)}")
    p.add_argument("--model", required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--save", default=None, help="trainer.save_model(this folder/TASK) after training")
    p.add_argument("--steps", type=int, default=6)
    return p.parse_args()


def main() -> None:
    cli = parse()
    records = {task: train(task, cli) for task in cli.tasks.split(",")}
    if all(record is not None for record in records.values()):  # the main process
        Path(cli.out).write_text(json.dumps(records))


def train(task: str, cli: argparse.Namespace) -> Dict | None:
    """One trainer's run; its record on the main process (None elsewhere)."""
    from peft import LoraConfig

    if task not in TASKS:
        raise SystemExit(f"unknown task {task!r}: one of {TASKS}")

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    common = dict(
        output_dir=f"{cli.output_dir}/{task}",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=cli.steps,
        learning_rate=3e-3,
        logging_steps=1,
        report_to="none",
        seed=7,
        disable_tqdm=True,
        bf16=False,  # the comparison is in float32: TRL's bf16 default is bf16 autocast on the CPU
        save_strategy="no",
    )
    callback = _Counts()
    if task.startswith("sft"):
        from trl import SFTConfig, SFTTrainer

        packing = task == "sft-packing"
        args = SFTConfig(**common, max_length=16, packing=packing, packing_strategy="wrapped" if packing else "bfd")
        trainer = SFTTrainer(
            model=cli.model,
            args=args,
            # Packed, 96 rows make 3.6 steps of rows: 192 keep the 6 steps in one epoch (an epoch's last,
            # smaller batch is a new shape: its programs are compiled once more).
            train_dataset=sft_rows(192 if packing else 96),
            peft_config=lora if task == "sft-lora" else None,
            callbacks=[callback],
        )
    else:
        from trl import DPOConfig, DPOTrainer

        args = DPOConfig(**common, max_length=24)
        trainer = DPOTrainer(
            model=cli.model,
            args=args,
            train_dataset=dpo_rows(64),
            peft_config=lora if task == "dpo-peft" else None,
            callbacks=[callback],
        )
    trainer.train()
    if cli.save:
        trainer.save_model(f"{cli.save}/{task}")
    if not trainer.is_world_process_zero():
        return None
    return {
        "log_history": trainer.state.log_history,
        "world": trainer.args.world_size,
        "counts": callback.per_step,
        "trainer_class": [c.__name__ for c in type(trainer).__mro__[:3]],
        "ref_model": type(getattr(trainer, "ref_model", None)).__name__,
    }


if __name__ == "__main__":
    main()
