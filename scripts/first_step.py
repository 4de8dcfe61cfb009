"""The first training step under torch_xla's own launcher, with and without turns at syncs.

On 4 XLA:CPU devices, a tiny ``LlamaForCausalLM`` (8 decoder blocks, hidden 256, intermediate
512, 4 heads, vocabulary 256), AdamW, a global batch of 8 x 64 random tokens, every decoder
block wrapped (``scripts/benchmark.py``'s model, data, wrapping and timed loop, with these
sizes), each variant in a fresh process:

* ``ours``: ``accel_xla_fsdp.XlaFullyShardedDataParallel``, flat shards, under
  ``pjrt.run_multiprocess`` (what ``xmp.spawn`` and ``accelerate launch`` use): the replicas take
  turns at every sync because the script imports ``accel_xla_fsdp``;
* ``ours-no-turns``: the same with ``ACCEL_XLA_FSDP_TURNS=0`` (a switch for this measurement):
  every replica launches, and compiles, on its own, as before the turns were installed on import;
* ``spmd``: torch_xla's ``SpmdFullyShardedDataParallel``, one thread driving every device.

Figures: the first step (trace, compile and run; for the per-replica variants the slowest
replica's), the median of the steps after the two warm-up steps (each the slowest replica's),
the programs the process compiled (torch_xla's ``CompileTime`` count) and the compiler's seconds.

    .venv/bin/python scripts/first_step.py   # a few minutes on 2 cores
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Tuple

from torch_xla._internal import pjrt

from accel_xla_fsdp import _xla
from benchmark import RunFigures, Settings, compile_count, replica, spmd_worker

DEVICES = 4
SETTINGS = dataclasses.replace(Settings(), vocab=256, intermediate=512, heads=4, warmup_steps=2, timed_steps=4)


@dataclass(frozen=True)
class Variant:
    name: str
    label: str
    env: Dict[str, str]


VARIANTS = (
    Variant("ours", "ours, flat shards, turns at every sync", {}),
    Variant("ours-no-turns", "ours, flat shards, no turns (ACCEL_XLA_FSDP_TURNS=0)", {"ACCEL_XLA_FSDP_TURNS": "0"}),
    Variant("spmd", "torch_xla SpmdFullyShardedDataParallel", {}),
)


# ---------------------------------------------------------------------------------------------
# In the variant's process


def _ours_replica() -> Tuple[dict, int]:
    """One replica under torch_xla's launcher: its figures, and the programs compiled in the
    process by the time it finished."""
    figures = replica(_xla.global_rank(), "ours-flat", SETTINGS, None)
    return dataclasses.asdict(figures), compile_count()


def run_variant(name: str) -> dict:
    """Every replica's figures (one for SPMD) and the programs the process compiled."""
    if name == "spmd":
        with tempfile.TemporaryDirectory(prefix="first-step-") as tmp:
            path = Path(tmp) / "figures.json"
            spmd_worker(DEVICES, SETTINGS, None, path)
            return {"figures": [json.loads(path.read_text())], "compiles": compile_count()}
    results = pjrt.run_multiprocess(_ours_replica)
    return {
        "figures": [results[r][0] for r in sorted(results)],
        "compiles": max(count for _, count in results.values()),  # the last to finish saw them all
    }


# ---------------------------------------------------------------------------------------------
# The driver


@dataclass
class Row:
    variant: Variant
    first_s: float = float("nan")
    later_s: float = float("nan")
    compiles: int = 0
    compile_s: float = float("nan")
    final_loss: float = float("nan")
    process_s: float = float("nan")
    error: str = ""


def measure(variant: Variant, timeout_s: float) -> Row:
    """``variant`` in a fresh process (its own process group: the launcher starts a worker)."""
    with tempfile.TemporaryDirectory(prefix="first-step-") as tmp:
        result, log = Path(tmp) / "result.json", Path(tmp) / "stderr.txt"
        env = {**os.environ, **_xla.cpu_device_env(DEVICES), "HF_HUB_OFFLINE": "1", **variant.env}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--variant", variant.name, "--result", str(result)]
        start = time.perf_counter()
        with log.open("w") as stderr:
            process = subprocess.Popen(cmd, env=env, stderr=stderr, start_new_session=True)
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                return Row(variant, error=f"still running after {timeout_s:.0f} s: killed")
        if process.returncode != 0:
            return Row(variant, error=failure(log.read_text(), process.returncode))
        raw = json.loads(result.read_text())
    return make_row(variant, [RunFigures(**f) for f in raw["figures"]], raw["compiles"], time.perf_counter() - start)


def failure(stderr: str, code: int) -> str:
    """Why a variant's process failed: XLA:CPU's rendezvous abort, or its last line of output."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    aborts = [line for line in lines if "Termination timeout" in line]
    if aborts:
        return "XLA:CPU aborted the process: a replica waited over 10 s at a collective (Termination timeout)"
    return f"exit code {code}: {lines[-1][:160] if lines else ''}"


def make_row(variant: Variant, per_replica: List[RunFigures], compiles: int, process_s: float) -> Row:
    """A step ends when the slowest replica has its loss on the host."""
    slowest = [max(f.step_times[i] for f in per_replica) for i in range(SETTINGS.steps)]
    return Row(
        variant=variant,
        first_s=slowest[0],
        later_s=statistics.median(slowest[SETTINGS.warmup_steps :]),
        compiles=compiles,
        compile_s=max(f.compile_s for f in per_replica),
        final_loss=statistics.fmean(f.losses[-1] for f in per_replica),
        process_s=process_s,
    )


def table(runs: List[Tuple[int, Row]]) -> str:
    head = (
        f"| variant | run | first step s | later steps s (median of {SETTINGS.timed_steps}) | programs compiled "
        "| compiler s | final loss | process s |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for run, r in runs:
        if r.error:
            lines.append(f"| {r.variant.label} | {run} | failed: {r.error} | | | | | |")
            continue
        lines.append(
            f"| {r.variant.label} | {run} | {r.first_s:.1f} | {r.later_s:.2f} | {r.compiles} | {r.compile_s:.1f} "
            f"| {r.final_loss:.4f} | {r.process_s:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per variant")
    p.add_argument("--repeat", type=int, default=1, help="run every variant this many times, in rounds")
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:
        args.result.write_text(json.dumps(run_variant(args.variant)))
        return
    load_before = os.getloadavg()[0]
    runs = []
    for run in range(1, args.repeat + 1):
        for variant in VARIANTS:
            print(f"[{time.strftime('%H:%M:%S')}] {variant.name}, run {run}", flush=True)
            runs.append((run, measure(variant, args.timeout)))
    print(
        f"\n{DEVICES} XLA:CPU devices, {os.cpu_count()} cores; load average {load_before:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after\n"
    )
    print(table(sorted(runs, key=lambda run_row: VARIANTS.index(run_row[1].variant))))


if __name__ == "__main__":
    main()
