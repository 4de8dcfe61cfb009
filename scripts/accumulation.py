"""Gradient accumulation with and without ``no_sync()``: compiled bytes and time per optimizer step.

The benchmark's tiny Llama (scripts/benchmark.py), flat shards, AdamW, on N XLA:CPU devices.
One optimizer step accumulates 4 micro-steps; every micro-step ends with a sync, as a data loader
that marks a step per batch (torch_xla's MpDeviceLoader, Accelerate's) does. Variants:
``reduce`` reduce-scatters every micro-step's gradients into the shards; ``no_sync`` keeps full
gradients through the first 3 and reduce-scatters their sum with the 4th.

    .venv/bin/python scripts/accumulation.py --devices 4

Each variant runs in a fresh device process that dumps its programs; the table gives the median
time of an optimizer step (4 micro-steps and the update), the largest program's bytes per device
(the compiler's "Total bytes used") and reduce-scatters per optimizer step.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmark import Settings, build_model, global_batches, local_rows, wrap_ours  # noqa: E402

from accel_xla_fsdp import _xla, run_on_devices, seeded  # noqa: E402
from accel_xla_fsdp.hlo_report import modules_in, parse_dump  # noqa: E402

MICRO_STEPS = 4


@dataclass
class Figures:
    step_times: List[float]
    losses: List[float]


def replica(rank: int, world: int, variant: str, s: Settings, optimizer_steps: int) -> Figures:
    with seeded(0):
        model = build_model(s)
    model, _ = wrap_ours(model, flatten=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=s.lr)
    batches = global_batches(Settings(**{**s.__dict__, "timed_steps": optimizer_steps * MICRO_STEPS}))
    times, losses = [], []
    for step in range(optimizer_steps):
        start = time.perf_counter()
        total = torch.zeros((), device=_xla.device())
        for micro in range(MICRO_STEPS):
            ids = local_rows(batches[step * MICRO_STEPS + micro], rank, world).to(_xla.device())
            keep = variant == "no_sync" and micro < MICRO_STEPS - 1
            with model.no_sync() if keep else contextlib.nullcontext():
                loss = model(input_ids=ids, labels=ids).loss / MICRO_STEPS
                loss.backward()
            total = total + loss.detach()
            _xla.sync()
        optimizer.step()
        optimizer.zero_grad()
        _xla.sync()
        losses.append(total.item())
        times.append(time.perf_counter() - start)
    return Figures(times, losses)


def measure(variant: str, devices: int, s: Settings, optimizer_steps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="accum-dump-") as dump:
        env = {"XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text"}
        figures = run_on_devices(replica, devices, args=(devices, variant, s, optimizer_steps), env=env)
        programs = [parse_dump(Path(dump), m) for m in sorted(modules_in(Path(dump)))]
    # The micro-step programs (forward and backward: they gather); compiled once each.
    micro = [p for p in programs if p.all_gathers.count > 0]
    return {
        "variant": variant,
        "step_s": statistics.median(figures[0].step_times[2:]),
        "programs": [(p.total_bytes, p.reduce_scatters.count) for p in micro],
        "loss": statistics.mean(f.losses[-1] for f in figures),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--optimizer-steps", type=int, default=6)
    args = parser.parse_args()
    s = Settings()
    rows = [measure(v, args.devices, s, args.optimizer_steps) for v in ("reduce", "no_sync")]
    print(f"{args.devices} devices, {MICRO_STEPS} micro-steps per optimizer step, tiny Llama "
          f"{s.layers} blocks hidden {s.hidden}, flat shards, AdamW")
    print(f"{'variant':10} {'step s (median)':>16} {'final loss':>11}  micro-step programs: MiB per device, reduce-scatters")
    for r in rows:
        progs = ", ".join(f"{b / 2**20:.2f} MiB {n} RS" for b, n in r["programs"])
        print(f"{r['variant']:10} {r['step_s']:16.3f} {r['loss']:11.4f}  {progs}")


if __name__ == "__main__":
    main()
