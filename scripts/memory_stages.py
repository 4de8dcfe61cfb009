"""The stock fine-tuning script of issue 27, stage by stage, for scripts/memory_benchmark.py.

Written as a user writes it: ``from_pretrained(folder)``, ``prepare()``, 2 steps, ``save_state``,
the transformers examples' stock save (``unwrap_model(model).save_pretrained(...,
save_function=accelerator.save)``), ``load_state``, one more step. ``MEMORY_BENCH_ENGINE=ddp``
runs it on Accelerate's own ``Accelerator`` (for ``torchrun`` with gloo), else on
accel_xla_fsdp's (under ``accelerate launch``). The main process appends a line of JSON to
``MEMORY_BENCH_MARKS`` as each stage begins and ends (every replica between two barriers; with
XLA, after a sync: a stage's figure includes the programs it traced). ``MEMORY_BENCH_CENSUS=1``
also prints, as each stage ends, what Python holds on the XLA devices against what the process
holds once glibc has given back what it can (docs/accelerate.md, "What training holds beyond its
program").

    accelerate launch --config_file CONFIG scripts/memory_stages.py PRETRAINED_DIR OUT_DIR
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from typing import Any, Callable

import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoModelForCausalLM

if os.environ.get("MEMORY_BENCH_ENGINE") == "ddp":
    from accelerate import Accelerator
else:
    from accel_xla_fsdp import Accelerator

SEQ = 128
STEPS = 2


class StageMarks:
    """Appends ``{"stage", "edge", "time"}`` to ``MEMORY_BENCH_MARKS`` (main process) as a stage
    begins and ends, every replica between two barriers; with XLA, after a sync."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator
        self.path = os.environ["MEMORY_BENCH_MARKS"]
        self.xla = os.environ.get("MEMORY_BENCH_ENGINE") != "ddp"

    def mark(self, stage: str, edge: str) -> None:
        if edge == "end" and self.xla:
            # Run what the stage left pending: XLA runs a step's program only at the next sync,
            # and the training loop ends without one, so the last step ran (and peaked) inside
            # save_state's first collective, and the step after load never ran in its stage.
            import torch_xla

            torch_xla.sync()
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process and edge == "end" and os.environ.get("MEMORY_BENCH_CENSUS"):
            print(f"census, {stage}: {census()}", flush=True)
        if self.accelerator.is_main_process:
            with open(self.path, "a") as f:
                f.write(json.dumps({"stage": stage, "edge": edge, "time": time.time()}) + "\n")

    def stage(self, name: str, fn: Callable[[], Any]) -> Any:
        self.mark(name, "begin")
        result = fn()
        self.mark(name, "end")
        return result


def census() -> str:
    """Every XLA tensor Python holds (all replicas: they are threads of this process), in GiB, and
    the process's resident memory after ``malloc_trim(0)``."""
    from accel_xla_fsdp.host_memory import give_back

    gc.collect()
    xla = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.device.type == "xla"]
    held = sum(t.numel() * t.element_size() for t in xla)
    give_back()
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    return f"{len(xla)} XLA tensors of {held / 2**30:.3f} GiB; process {rss / 2**30:.3f} GiB after malloc_trim"


def main() -> None:
    pretrained, out = sys.argv[1], sys.argv[2]
    accelerator = Accelerator()
    stage = StageMarks(accelerator).stage

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
