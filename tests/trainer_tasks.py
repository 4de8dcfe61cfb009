"""Stock Trainer scripts for two more tasks, launched by tests/test_trainer_tasks.py.

Their one change for XLA FSDP is the import (``USE_TORCH_XLA=0``, the CPU reference under
``torchrun``, imports transformers' classes):

- ``--task seq2seq``: a tiny T5 learns to reverse token rows with ``Seq2SeqTrainer``, evaluated
  with ``predict_with_generate`` and a ``compute_metrics`` on the generated tokens; the
  predictions of ``trainer.predict`` after training are recorded.
- ``--task classify``: a tiny Llama sequence classifier with ``compute_metrics`` (accuracy),
  checkpoints every 2 steps, ``save_total_limit=1`` and ``load_best_model_at_end`` (by the
  evaluation loss; the learning rate is high enough that the first evaluation is the best, not
  the last, so loading it shows).

The models are saved by the test first (``save_models``) and loaded with ``from_pretrained``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any, Dict, Tuple

import numpy as np
import torch
from datasets import Dataset
from tiny_llama import TINY_LLAMA
from transformers import (
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    LlamaConfig,
    LlamaForSequenceClassification,
    Seq2SeqTrainingArguments,
    T5Config,
    T5ForConditionalGeneration,
    TrainingArguments,
)

if os.environ.get("USE_TORCH_XLA") == "0":
    from transformers import Seq2SeqTrainer, Trainer
else:
    from accel_xla_fsdp import Seq2SeqTrainer, Trainer

SEQ = 8
VOCAB = 64
# Tokens generated after the decoder start token: the first half of each reversed row. Every new
# length is new programs for XLA (the decoder step, the stopping criteria): about 4 compiles a
# token, which the first evaluation pays; 4 tokens show the generation as well as 8 would.
GENERATED = SEQ // 2


def save_models(folder: Path) -> None:
    torch.manual_seed(0)
    T5ForConditionalGeneration(
        T5Config(
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            dropout_rate=0.0,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        )
    ).save_pretrained(folder / "t5")
    torch.manual_seed(0)
    LlamaForSequenceClassification(
        LlamaConfig(
            **TINY_LLAMA,
            vocab_size=VOCAB,
            max_position_embeddings=SEQ,
            num_labels=2,
            pad_token_id=0,
            use_cache=False,
        )
    ).save_pretrained(folder / "classifier")


def rows(count: int, seed: int) -> torch.Tensor:
    return torch.randint(2, VOCAB, (count, SEQ), generator=torch.Generator().manual_seed(seed))


def reversal(count: int, seed: int) -> Dataset:
    ids = rows(count, seed)
    return Dataset.from_dict(
        {"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist(), "labels": ids.flip(1).tolist()}
    )


def classification(count: int, seed: int) -> Dataset:
    ids = rows(count, seed)
    return Dataset.from_dict(
        {
            "input_ids": ids.tolist(),
            "attention_mask": torch.ones_like(ids).tolist(),
            "labels": (ids[:, 0] < VOCAB // 2).long().tolist(),
        }
    )


def token_accuracy(prediction) -> Dict[str, float]:
    """Generated tokens (after the decoder start token) equal to the labels, and a fingerprint."""
    generated, labels = np.asarray(prediction.predictions), np.asarray(prediction.label_ids)
    tokens = generated[:, 1 : 1 + GENERATED]
    return {"token_accuracy": float((tokens == labels[:, :GENERATED]).mean()), "token_sum": float(generated.sum())}


def accuracy(prediction) -> Dict[str, float]:
    logits, labels = np.asarray(prediction.predictions), np.asarray(prediction.label_ids)
    return {"accuracy": float((logits.argmax(-1) == labels).mean()), "rows": float(len(labels))}


def common(cli: argparse.Namespace) -> Dict:
    return dict(
        output_dir=cli.output_dir,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        max_steps=6,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        logging_steps=1,
        eval_strategy="steps",
        report_to="none",
        seed=3,
        disable_tqdm=True,
    )


def seq2seq(cli: argparse.Namespace) -> Tuple[Any, Dict]:
    args = Seq2SeqTrainingArguments(
        **common(cli),
        eval_steps=3,
        save_strategy="no",
        predict_with_generate=True,
        generation_max_length=1 + GENERATED,
        generation_num_beams=1,
    )
    model = AutoModelForSeq2SeqLM.from_pretrained(cli.model + "/t5")
    trainer = Seq2SeqTrainer(
        model=model,
        args=args,
        train_dataset=reversal(48, 1),
        eval_dataset=reversal(14, 2),
        compute_metrics=token_accuracy,
    )
    trainer.train()
    predicted = trainer.predict(reversal(14, 2))
    return trainer, {
        "log_history": trainer.state.log_history,
        "metrics": predicted.metrics,
        "predictions": np.asarray(predicted.predictions).tolist(),
    }


def classify(cli: argparse.Namespace) -> Tuple[Any, Dict]:
    args = TrainingArguments(
        **common(cli),
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        save_total_limit=1,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        # Adam moves a weight by about the learning rate whatever the size of its
        # gradient: where that is round-off, the runs would part by 1e-2 at once.
        adam_epsilon=1e-3,
    )
    model = AutoModelForSequenceClassification.from_pretrained(cli.model + "/classifier")
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=classification(48, 1),
        eval_dataset=classification(14, 2),
        compute_metrics=accuracy,
    )
    trainer.train()
    final = trainer.evaluate()
    return trainer, {
        "log_history": trainer.state.log_history,
        "final": final,
        "best_model_checkpoint": trainer.state.best_model_checkpoint,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--task", choices=("seq2seq", "classify"), required=True)
    p.add_argument("--model", required=True, help="the folder save_models wrote")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--out", required=True)
    cli = p.parse_args()
    trainer, record = seq2seq(cli) if cli.task == "seq2seq" else classify(cli)
    if trainer.is_world_process_zero():
        Path(cli.out).write_text(json.dumps({**record, "world": trainer.args.world_size}))


if __name__ == "__main__":
    main()
