"""A short FSDP training whose replica 1 raises, for ``test_replica_failure.py``.

``python failing_replica.py LAUNCHER WHEN`` runs it under torch_xla's ``pjrt.run_multiprocess``
(``pjrt``) or ``xmp.spawn`` (``xmp``); ``accelerate launch ... failing_replica.py accelerate
WHEN`` under Accelerate (through ``main``). Replica 1 raises ``WHEN``:

* ``step``: after its first training step, while the others go on to the next one and wait for
  it where the replicas meet (the next sync);
* ``collective``: while the others are inside a device collective, reading back a gathered
  tensor (a read-back runs its program at once, outside the replicas' turns).

Just before raising, replica 1 prints ``FAILING AT <time.time()>`` to stdout. ``late``: replica 1
raises nothing but comes to the collective 20 s after the others, and XLA:CPU aborts the process.
"""

from __future__ import annotations

import sys
import time

import torch
import torch_xla
import torch_xla.distributed.xla_multiprocessing as xmp
import torch_xla.runtime as xr
from models import LAUNCH_LLAMA
from torch_xla._internal import pjrt
from transformers import LlamaConfig, LlamaForCausalLM  # model classes before the replicas start

# Accelerator at module level: its import passes accelerate launch's settings to the replicas.
from accel_xla_fsdp import Accelerator, XlaFullyShardedDataParallel, _xla, seeded, transformer_block_policy

FAILING_RANK = 1
CONFIG = dict(LAUNCH_LLAMA, use_cache=False)


class ReplicaFailure(RuntimeError):
    pass


def fail(rank: int, when: str) -> None:
    print(f"FAILING AT {time.time()}", flush=True)
    raise ReplicaFailure(f"replica {rank} fails on purpose ({when})")


def build(wrap) -> tuple:
    with seeded(0):
        model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    model = wrap(model)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def wait_inside_a_collective(rank: int) -> None:
    x = torch.full((4,), float(rank)).to(torch_xla.device())
    _xla.all_gather(x, None, False).cpu()  # the others never come: XLA:CPU would abort in 15 s


def train(rank: int, when: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, backward) -> None:
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(rank))
    for _ in range(3):
        tokens = ids.to(torch_xla.device())
        loss = model(input_ids=tokens, attention_mask=torch.ones_like(tokens), labels=tokens).loss
        backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()
        if when == "late":
            if rank == FAILING_RANK:
                time.sleep(20.0)  # XLA:CPU aborts the others' collective after 15 s
            wait_inside_a_collective(rank)
        elif when == "collective":
            if rank == FAILING_RANK:
                time.sleep(1.0)  # the others are in the collective by then
                fail(rank, when)
            wait_inside_a_collective(rank)
        elif rank == FAILING_RANK:
            fail(rank, when)


def _under_torch_xla(when: str) -> None:
    rank = xr.global_ordinal()
    model, optimizer = build(
        lambda m: XlaFullyShardedDataParallel(m, auto_wrap_policy=transformer_block_policy(), flatten_parameters=True)
    )
    train(rank, when, model, optimizer, lambda loss: loss.backward())


def _under_xmp(index: int, when: str) -> None:
    _under_torch_xla(when)


def main() -> None:
    """Under ``accelerate launch``: the same training through Accelerate."""
    when = sys.argv[-1]
    accelerator = Accelerator()
    with seeded(0):
        model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    train(accelerator.process_index, when, model, optimizer, accelerator.backward)


if __name__ == "__main__":
    launcher, when = sys.argv[1:3]
    if launcher == "pjrt":
        pjrt.run_multiprocess(_under_torch_xla, when)
    elif launcher == "xmp":
        xmp.spawn(_under_xmp, args=(when,))
    else:
        raise SystemExit(f"unknown launcher {launcher!r}: pjrt or xmp (accelerate launch runs main)")
