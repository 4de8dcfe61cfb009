"""The stock fine-tuning script of issue 27, stage by stage, for scripts/memory_benchmark.py.

Written as a user writes it: ``from_pretrained(folder)``, ``prepare()``, 2 steps, ``save_state``,
the transformers examples' stock save (``unwrap_model(model).save_pretrained(...,
save_function=accelerator.save)``), ``load_state``, one more step. ``MEMORY_BENCH_ENGINE=ddp``
runs it on Accelerate's own ``Accelerator`` (for ``torchrun`` with gloo), else on
accel_xla_fsdp's (under ``accelerate launch``). The main process appends a line of JSON to
``MEMORY_BENCH_MARKS`` as each stage begins and ends (every replica between two barriers; with
XLA, after a sync: a stage's figure includes the programs it traced).

    accelerate launch --config_file CONFIG scripts/memory_stages.py PRETRAINED_DIR OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoModelForCausalLM

if os.environ.get("MEMORY_BENCH_ENGINE") == "ddp":
    from accelerate import Accelerator
else:
    from accel_xla_fsdp import Accelerator

SEQ = 128
STEPS = 2


def main() -> None:
    pretrained, out = sys.argv[1], sys.argv[2]
    accelerator = Accelerator()
    marks = os.environ["MEMORY_BENCH_MARKS"]

    def mark(stage: str, edge: str) -> None:
        if edge == "end" and os.environ.get("MEMORY_BENCH_ENGINE") != "ddp":
            # Run what the stage left pending: XLA runs a step's program only at the next sync,
            # and the training loop ends without one, so the last step ran (and peaked) inside
            # save_state's first collective, and the step after load never ran in its stage.
            import torch_xla

            torch_xla.sync()
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            with open(marks, "a") as f:
                f.write(json.dumps({"stage": stage, "edge": edge, "time": time.time()}) + "\n")

    def stage(name: str, fn):  # noqa: ANN001, ANN202
        mark(name, "begin")
        result = fn()
        mark(name, "end")
        return result

    model = stage("from_pretrained", lambda: AutoModelForCausalLM.from_pretrained(pretrained))
    vocab = model.config.vocab_size
    rows = torch.randint(
        0, vocab, (accelerator.num_processes * (STEPS + 1), SEQ), generator=torch.Generator().manual_seed(0)
    )
    loader = DataLoader(TensorDataset(rows), batch_size=1)  # one row per replica and step
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model, optimizer, loader = stage("prepare", lambda: accelerator.prepare(model, optimizer, loader))

    def steps(count: int) -> None:
        for step, (ids,) in enumerate(loader):
            if step == count:
                break
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()

    stage("train", lambda: steps(STEPS))
    stage("save_state", lambda: accelerator.save_state(f"{out}/state"))
    stage(
        "stock save",
        lambda: accelerator.unwrap_model(model).save_pretrained(
            f"{out}/stock", is_main_process=accelerator.is_main_process, save_function=accelerator.save
        ),
    )
    stage("load_state", lambda: accelerator.load_state(f"{out}/state"))
    stage("step after load", lambda: steps(1))


if __name__ == "__main__":
    main()
