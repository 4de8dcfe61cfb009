"""The stock Trainer script of issue 27, stage by stage, for ``scripts/memory_benchmark.py --trainer``.

Written as a user writes it: ``from_pretrained(folder)``, a ``Trainer`` with its defaults (AdamW,
a checkpoint every 2 steps), ``train()`` for 2 steps, which writes ``checkpoint-2``, then
``save_model``; run again with ``--resume``, ``train(resume_from_checkpoint=...)`` for one more
step. The stages are marked as ``memory_stages.py`` marks them (``StageMarks``), from callbacks
inside ``train()``; the Trainer prepares the model inside ``train()``, so the first stage holds
``prepare`` too.

    accelerate launch --config_file CONFIG scripts/memory_trainer_stages.py PRETRAINED_DIR OUT_DIR [--resume]
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from datasets import Dataset
from memory_stages import SEQ, StageMarks
from transformers import AutoModelForCausalLM, TrainerCallback, TrainingArguments

from accel_xla_fsdp import Trainer

STEPS = 2


class MarkStages(TrainerCallback):
    """Ends and begins the stages that lie inside ``train()``, on every replica."""

    def __init__(self, marks: StageMarks, resume: bool) -> None:
        self.marks, self.resume = marks, resume

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.resume:  # the checkpoint is loaded before the loop begins
            self.marks.mark("load checkpoint-2", "end")
            self.marks.mark("step after resume", "begin")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.resume:
            self.marks.mark("step after resume", "end")
        elif state.global_step == STEPS:  # checkpoint-2 is written after this callback
            self.marks.mark("prepare + 2 steps", "end")
            self.marks.mark("checkpoint-2", "begin")

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.resume:
            self.marks.mark("checkpoint-2", "end")


def main() -> None:
    pretrained, out = sys.argv[1], sys.argv[2]
    resume = "--resume" in sys.argv[3:]
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=1,
        max_steps=STEPS + 1 if resume else STEPS,
        learning_rate=1e-5,
        save_strategy="steps",
        save_steps=STEPS,
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
    )
    model = AutoModelForCausalLM.from_pretrained(pretrained)
    rows = torch.randint(0, model.config.vocab_size, (args.world_size * (STEPS + 1), SEQ))
    data = Dataset.from_dict({"input_ids": rows.tolist(), "labels": rows.tolist()})
    trainer = Trainer(model=model, args=args, train_dataset=data)
    marks = StageMarks(trainer.accelerator)
    trainer.add_callback(MarkStages(marks, resume))
    if resume:
        marks.mark("load checkpoint-2", "begin")
        trainer.train(resume_from_checkpoint=f"{out}/checkpoint-{STEPS}")
    else:
        marks.mark("prepare + 2 steps", "begin")
        trainer.train()
        marks.stage("save_model", lambda: trainer.save_model(f"{out}/final"))


if __name__ == "__main__":
    main()
