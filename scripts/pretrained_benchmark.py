"""Host memory of 4 replicas loading a pretrained model: straight into shards, or the usual way.

    .venv/bin/python scripts/pretrained_benchmark.py            # a 1.08 GB LlamaForCausalLM

Saves a randomly initialized ``LlamaForCausalLM`` (271 M float32 parameters) with
``save_pretrained`` into a temporary folder, then, each in a fresh device process of 4 XLA:CPU
devices (one process, a thread per replica, as torch_xla runs them on the CPU):

* ``pretrained_weights``: every replica builds the model under ``init_empty_weights()`` and wraps
  it with ``param_init_fn=accel_xla_fsdp.pretrained_weights(folder)``: its shards are read from
  the files, slice by slice;
* ``from_pretrained``: every replica calls ``from_pretrained(folder)`` and wraps the loaded model;
* ``accelerate``/``accelerate efficient``: a stock Accelerate script's calls, ``Accelerator()``,
  ``AutoModelForCausalLM.from_pretrained(folder)``, ``AdamW``, ``prepare(model, optimizer)``, with
  ``fsdp_cpu_ram_efficient_loading`` off, then on (``FSDP_CPU_RAM_EFFICIENT_LOADING``).

Peak host memory: the process's peak resident set (VmHWM, reset through ``/proc/self/clear_refs``
once every replica has started) less its resident set at that moment, before any replica loads.
XLA:CPU device buffers live in host memory, so the shards themselves (1x the model in all, over 4
replicas) count too.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import accel_xla_fsdp
from accel_xla_fsdp import Accelerator, XlaFullyShardedDataParallel, run_on_devices, seeded, transformer_block_policy

WAYS = ("pretrained_weights", "from_pretrained", "accelerate", "accelerate efficient")

CONFIG = dict(
    vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
    num_attention_heads=16, num_key_value_heads=16, tie_word_embeddings=False, attn_implementation="eager",
)
_BUILT: Dict[int, threading.Barrier] = {}


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


_STARTED: Dict[int, threading.Barrier] = {}


def started(rank: int, world: int) -> int:
    """Once every replica is up: the peak reset (VmHWM := VmRSS), and the resident set then, in KiB."""
    barrier = _STARTED.setdefault(world, threading.Barrier(world))
    barrier.wait()
    if rank == 0:
        Path("/proc/self/clear_refs").write_text("5")
    baseline = status_kib("VmRSS")
    barrier.wait()
    return baseline


def replica(rank: int, world: int, folder: str, way: str) -> Dict[str, float]:
    if way.startswith("accelerate"):
        return stock_script(rank, world, folder)
    baseline = started(rank, world)  # the device runtime up, nothing built yet
    start = time.perf_counter()
    if way == "pretrained_weights":
        from accelerate import init_empty_weights

        with seeded(0), init_empty_weights():  # patches nn.Module process-wide: build, then wrap
            model = LlamaForCausalLM(LlamaConfig(**CONFIG))
        _BUILT.setdefault(world, threading.Barrier(world)).wait()
        init = accel_xla_fsdp.pretrained_weights(folder)
    else:
        model = LlamaForCausalLM.from_pretrained(folder)
        init = None
    wrapped = XlaFullyShardedDataParallel(
        model, auto_wrap_policy=transformer_block_policy(), flatten_parameters=True, param_init_fn=init
    )
    accel_xla_fsdp.sync()
    shard_bytes = sum(p.numel() * p.element_size() for p in wrapped.parameters())
    return {"seconds": time.perf_counter() - start, "hwm_kib": status_kib("VmHWM"), "shard_bytes": shard_bytes,
            "baseline_kib": baseline}


def stock_script(rank: int, world: int, folder: str) -> Dict[str, float]:
    from transformers import AutoModelForCausalLM

    accelerator = Accelerator()
    baseline = started(rank, world)
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model, optimizer = accelerator.prepare(model, optimizer)
    accel_xla_fsdp.sync()
    shard_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"seconds": time.perf_counter() - start, "hwm_kib": status_kib("VmHWM"), "shard_bytes": shard_bytes,
            "baseline_kib": baseline}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pretrained-") as folder:
        with seeded(0):
            model = LlamaForCausalLM(LlamaConfig(**CONFIG))
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        model.save_pretrained(folder, safe_serialization=True)
        del model
        print(f"model: {model_bytes / 1e9:.2f} GB ({model_bytes // 4 / 1e6:.0f} M float32 parameters), {args.devices} replicas")
        print(f"{'way':20} {'peak above baseline GB':>23} {'x model':>8} {'seconds':>8}")
        for way in args.ways:
            env = {"FSDP_CPU_RAM_EFFICIENT_LOADING": str(way == "accelerate efficient").lower()}
            results = run_on_devices(replica, args.devices, args=(args.devices, folder, way), env=env)
            above = (max(r["hwm_kib"] for r in results) - max(r["baseline_kib"] for r in results)) * 1024
            print(f"{way:20} {above / 1e9:23.2f} {above / model_bytes:8.2f} {max(r['seconds'] for r in results):8.1f}")


if __name__ == "__main__":
    main()
