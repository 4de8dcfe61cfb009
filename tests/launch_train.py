"""A short FSDP training written as a user would, for ``test_launch.py``.

``python launch_train.py`` first trains under torch_xla's own launcher
(``pjrt.run_multiprocess``: on XLA:CPU one worker process, one thread per device), nothing of
ours starting or lining up the replicas: ``accel_xla_fsdp`` is only imported, at module level.
Then, in its own main thread, it trains on one device and syncs with the replication set over
every device. It prints one line, ``RESULT <json>``. ``test_launch.py`` also runs ``replica``
under our runner.
"""

from __future__ import annotations

import json
from typing import Dict, List

import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
import torch_xla.runtime as xr
from models import LAUNCH_LLAMA
from torch_xla._internal import pjrt
from transformers import LlamaConfig, LlamaForCausalLM  # model classes before the replicas start

from accel_xla_fsdp import XlaFullyShardedDataParallel, seeded, transformer_block_policy
from accel_xla_fsdp.xla_cpu import graph_boundaries

STEPS = 3
GLOBAL_BATCH = 4
CONFIG = dict(LAUNCH_LLAMA, use_cache=False)


def compile_count() -> int:
    """Programs this process has compiled (the count of torch_xla's ``CompileTime`` metric)."""
    data = met.metric_data("CompileTime")
    return 0 if data is None else int(data[0])


def replica(rank: int, world: int) -> Dict[str, object]:
    """Train ``STEPS`` steps of SGD on rows ``rank::world`` of each global batch."""
    with seeded(0):
        model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    model = XlaFullyShardedDataParallel(model, auto_wrap_policy=transformer_block_policy(), flatten_parameters=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)  # stateless: one step program to compile
    device = torch_xla.device()
    batches = torch.randint(
        0, CONFIG["vocab_size"], (STEPS, GLOBAL_BATCH, 16), generator=torch.Generator().manual_seed(1)
    )
    losses = []
    for batch in batches:
        ids = batch[rank::world].to(device)
        # With an attention mask, transformers reads no tensor value to look for packed sequences:
        # a value read before the sync runs a graph of its own, which every replica compiles
        # (only syncs are lined up), and this test counts compilations.
        loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()
        losses.append(loss.item())
    return {"losses": losses, "compiles": compile_count()}


def _under_launcher() -> Dict[str, object]:
    return replica(xr.global_ordinal(), xr.world_size())


def launcher() -> Dict[str, object]:
    """Every replica's losses, and the programs compiled in the process once all have finished."""
    results = pjrt.run_multiprocess(_under_launcher)
    return {
        "losses": [results[r]["losses"] for r in sorted(results)],
        "compiles": max(r["compiles"] for r in results.values()),
    }


def main_thread() -> Dict[str, object]:
    """Syncs of the main thread go straight to torch_xla's step marker with their own arguments,
    as a single-device script (world size 1) and then as a launcher's main thread (the
    replication set over every device of the process, as torch_xla's launcher does)."""
    calls: List[object] = []
    original = graph_boundaries.torch_xla_step_marker

    def spy(*args: object, **kwargs: object) -> None:
        calls.append([args[0], list(args[1]), kwargs])
        original(*args, **kwargs)

    graph_boundaries.torch_xla_step_marker = spy
    cuts: List[int] = []
    graph_boundaries.before_graph_cut(lambda: cuts.append(1))
    graph_boundaries.set_sync_timeout(1.0)  # had this thread waited for other replicas, its sync would raise
    single = replica(0, 1)
    single_calls = len(calls)

    devices = xm.get_xla_supported_devices()
    xm.set_replication(torch_xla.device(), devices)
    x = torch.ones(3, device=torch_xla.device()) * 2
    torch_xla.sync(wait=True)
    return {
        **single,
        "devices": len(devices),
        "calls": calls,
        "single_device_syncs": single_calls,
        "callbacks": len(cuts),
        "x": x.cpu().tolist(),
        "turns_made": graph_boundaries.turns_made(),
    }


if __name__ == "__main__":
    launched = launcher()  # first: the launcher refuses to start once this process used a device
    print("RESULT " + json.dumps({"launcher": launched, "main_thread": main_thread()}), flush=True)
