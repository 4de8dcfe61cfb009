"""One replica's host time per training step: what tracing and launching its step costs in Python.

On a TPU every replica is a process on its own cores, so the host time the engine adds to one
replica's step is what users pay. Here the replicas are threads of one process sharing two cores
and one GIL, so a replica's wall time while the others trace is not its host time. This script
makes it measurable without that contention:

* the replicas trace their step one at a time: a lock is held from the step's first op until just
  before its sync (backward runs on autograd's device thread, not the replica's: wall time with
  the lock held includes it, thread CPU time would not);
* the launch (the sync) is timed inside the turn the replica takes at the graph boundary
  (``_xla._launch_in_turn``), so waiting there for the other replicas is not counted: a
  measuring hook on ``_xla._original_step_marker``, installed by this script only;
* between steps every replica waits for its step's result and then for the other replicas, so
  no device computation runs while a replica traces;
* every replica also trains the unwrapped model, traced in turn with the variant at every step
  (``--no-paired``: not): ``host / unwrapped, paired`` is the median over steps of the two host
  times' ratio, which the other load on the machine moves far less than the ratio of medians
  taken minutes apart (``host / base``, against the unwrapped model's own run on one device).

Every variant runs the benchmark's model (``scripts/benchmark.py``'s ``Settings``,
``build_model``, ``global_batches``, ``local_rows`` and wrappers) at the same LOCAL batch
(``--local-batch`` sequences per replica; the global batch is N times that), each in a fresh
process. Figures are medians over the steps after ``--warmup``; ``host / base`` is against the
unwrapped model on one device.

    python scripts/host_time.py                      # the table (about 3.5 min on 2 cores)
    python scripts/host_time.py --variants ours-flat:4 --profile out/host-flat4.prof
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmark.py, also in the device process

import torch
import torch_xla

from benchmark import WRAPPERS, Settings, build_model, global_batches, local_rows

import accel_xla_fsdp
from accel_xla_fsdp import _xla, seeded

# (label, benchmark variant, devices)
DEFAULT_VARIANTS: Tuple[Tuple[str, str, int], ...] = (
    ("unwrapped, 1 device (base)", "no-sharding", 1),
    ("ours flat, 1 device", "ours-flat", 1),
    ("ours flat, 2 devices", "ours-flat", 2),
    ("ours flat, 4 devices", "ours-flat", 4),
    ("ours per-parameter, 4 devices", "ours", 4),
)


# ---------------------------------------------------------------------------------------------
# In the device process


@dataclass
class StepTimes:
    """Seconds, every step (warm-up included): wall time, and CPU time (``*_cpu``)."""

    tracing: List[float] = field(default_factory=list)
    launch: List[float] = field(default_factory=list)
    tracing_cpu: List[float] = field(default_factory=list)  # of the process: only this replica runs
    launch_cpu: List[float] = field(default_factory=list)  # of the replica's thread
    ir_nodes: List[int] = field(default_factory=list)  # in the graph the last sync cuts
    losses: List[float] = field(default_factory=list)
    digest: str = ""  # of the parameters after the last step (the shards, for FSDP)


_TRACING = threading.Lock()  # one replica traces at a time
_STEP_BARRIERS: Dict[int, threading.Barrier] = {}
_SETUP = threading.Lock()
_launch = threading.local()


def _install_launch_timer() -> None:
    """Time torch_xla's step marker, which ``_xla`` calls inside the replica's turn at the graph
    boundary (after its wait for the others), or directly with one replica. A measuring hook of
    this script only; the library's sync is unchanged."""
    launch = _xla._original_step_marker
    if getattr(launch, "_host_time_timed", False):
        return

    def timed_launch(*args: Any, **kwargs: Any) -> None:
        start, start_cpu = time.perf_counter(), time.thread_time()
        try:
            launch(*args, **kwargs)
        finally:
            _launch.seconds = time.perf_counter() - start
            _launch.cpu_seconds = time.thread_time() - start_cpu

    timed_launch._host_time_timed = True
    _xla._original_step_marker = timed_launch


def _step_barrier(world: int) -> threading.Barrier:
    with _SETUP:
        _install_launch_timer()
        return _STEP_BARRIERS.setdefault(world, threading.Barrier(world))


def _ir_nodes(tensors: List[torch.Tensor]) -> int:
    """Nodes of the pending graph that computes ``tensors`` (device data included)."""
    pending = [t for t in tensors if t is not None and t.device.type == "xla"]
    text = torch_xla._XLAC._get_xla_tensors_text(pending)
    return sum(1 for line in text.splitlines() if line.lstrip().startswith("%"))


def _graph_outputs(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss: torch.Tensor) -> List[torch.Tensor]:
    """What the step's graph computes: the loss, parameters, gradients and optimizer state."""
    params = list(model.parameters())
    state = [v for p in params for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
    return [loss] + params + [p.grad for p in params] + state


@dataclass
class Trainee:
    """A model this replica trains, its optimizer and its figures."""

    model: torch.nn.Module
    after_backward: Callable[[], None]
    optimizer: torch.optim.Optimizer
    times: StepTimes = field(default_factory=StepTimes)


def _trainee(variant: str, s: Settings) -> Trainee:
    with seeded(0):
        model = build_model(s)
    model, after_backward = WRAPPERS[variant](model)
    return Trainee(model, after_backward, torch.optim.AdamW(model.parameters(), lr=s.lr))


def replica(
    rank: int, variant: str, s: Settings, paired: bool, count_ir: bool, profile: Optional[str]
) -> Tuple[StepTimes, Optional[StepTimes]]:
    """This replica's figures for ``variant`` and, ``paired``, for the unwrapped model traced in
    turn with it at every step (the same local batch)."""
    world = _xla.world_size()
    barrier = _step_barrier(world)
    trainees = [_trainee(variant, s)] + ([_trainee("no-sharding", s)] if paired else [])
    device = _xla.device()
    profiler = _profiler(profile, rank)
    for step, batch in enumerate(global_batches(s)):
        ids = local_rows(batch, rank, world).to(device)
        # alternate which goes first, so that neither always follows the other's program
        for t in trainees if step % 2 == 0 else trainees[::-1]:
            profiling = profiler is not None and step >= s.warmup_steps and t is trainees[0]
            _step(t, ids, profiler if profiling else None, count_ir and step == s.steps - 1)
            barrier.wait()  # no replica traces while another's program runs
    if profiler is not None:
        profiler.dump_stats(f"{profile}.rank{rank}")
    trainees[0].times.digest = _digest(trainees[0].model.parameters())
    return trainees[0].times, trainees[1].times if paired else None


def _step(t: Trainee, ids: torch.Tensor, profiler: Optional[Any], count_ir: bool) -> None:
    """One training step: traced under the lock, launched in turn, run to its end."""
    times = t.times
    with _TRACING:
        if profiler is not None:
            profiler.enable()
        start, start_cpu = time.perf_counter(), time.process_time()
        loss = t.model(input_ids=ids, labels=ids).loss
        # cProfile sees one thread: when profiling, backward runs on this one, not autograd's
        with torch.autograd.set_multithreading_enabled(profiler is None):
            loss.backward()
        t.after_backward()
        t.optimizer.step()
        t.optimizer.zero_grad()
        times.tracing.append(time.perf_counter() - start)
        times.tracing_cpu.append(time.process_time() - start_cpu)
        if profiler is not None:
            profiler.disable()
        if count_ir:  # under the lock: C++ holding the GIL
            times.ir_nodes.append(_ir_nodes(_graph_outputs(t.model, t.optimizer, loss)))
    accel_xla_fsdp.sync()
    times.launch.append(_launch.seconds)
    times.launch_cpu.append(_launch.cpu_seconds)
    times.losses.append(loss.item())  # waits for the step's program


def _digest(params: Iterable[torch.Tensor]) -> str:
    """To check that a change to the engine leaves results bit-identical."""
    flat = torch.cat([p.detach().cpu().reshape(-1) for p in params])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]


def _profiler(path: Optional[str], rank: int):
    """cProfile of rank 0's tracing after the warm-up (``--profile``)."""
    if path is None or rank != 0:
        return None
    import cProfile

    return cProfile.Profile()


# ---------------------------------------------------------------------------------------------
# In the caller


@dataclass
class Result:
    """Medians (ms) over every timed step of every replica and run of one variant."""

    label: str
    runs: List[List[StepTimes]]  # per run, every replica's
    paired: List[List[StepTimes]]  # the same, for the unwrapped model traced in turn (if asked)
    warmup: int

    def median_ms(self, attr: str) -> float:
        steps = [t for run in self.runs for r in run for t in getattr(r, attr)[self.warmup :]]
        return 1e3 * statistics.median(steps)

    def host_ms(self, cpu: bool) -> float:
        suffix = "_cpu" if cpu else ""
        return self.median_ms("tracing" + suffix) + self.median_ms("launch" + suffix)

    @property
    def ir_nodes(self) -> Optional[int]:
        nodes = self.runs[0][0].ir_nodes
        return nodes[-1] if nodes else None

    def paired_ratio(self, cpu: bool) -> Optional[float]:
        """Median over steps and replicas of host time / the unwrapped model's at the same step."""
        if not self.paired:
            return None
        suffix = "_cpu" if cpu else ""

        def host(t: StepTimes) -> List[float]:
            return [a + b for a, b in zip(getattr(t, "tracing" + suffix), getattr(t, "launch" + suffix))][self.warmup :]

        pairs = [(x, y) for run, base in zip(self.runs, self.paired) for r, b in zip(run, base) for x, y in zip(host(r), host(b))]
        return statistics.median(x / y for x, y in pairs)

    def losses(self) -> List[float]:
        """Every step's loss, the mean over the replicas (of the last run)."""
        run = self.runs[-1]
        return [statistics.fmean(r.losses[i] for r in run) for i in range(len(run[0].losses))]


def measure(variant: str, devices: int, args: argparse.Namespace) -> Tuple[List[StepTimes], List[StepTimes]]:
    """One run of ``variant`` on ``devices`` devices, in a fresh process: every replica's times,
    and those of the unwrapped model traced in turn with it (none for the unwrapped variant or
    with ``--no-paired``)."""
    s = dataclasses.replace(
        Settings(), global_batch=args.local_batch * devices, warmup_steps=args.warmup, timed_steps=args.steps
    )
    paired = args.paired and variant != "no-sharding"
    replicas = accel_xla_fsdp.run_on_devices(replica, devices, args=(variant, s, paired, args.ir, args.profile))
    return [r for r, _ in replicas], [b for _, b in replicas if b is not None]


def table(results: List[Result]) -> str:
    base_wall, base_cpu = results[0].host_ms(cpu=False), results[0].host_ms(cpu=True)
    lines = [
        "| variant | tracing ms | launch ms | host ms | host / base | CPU: tracing ms | launch ms | host ms | host / base "
        "| host / unwrapped, paired: wall | CPU | IR nodes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        wall, cpu = r.host_ms(cpu=False), r.host_ms(cpu=True)
        paired = [r.paired_ratio(cpu=c) for c in (False, True)]
        cells = [
            r.label, f"{r.median_ms('tracing'):.1f}", f"{r.median_ms('launch'):.1f}", f"{wall:.1f}",
            f"{wall / base_wall:.2f}", f"{r.median_ms('tracing_cpu'):.1f}", f"{r.median_ms('launch_cpu'):.1f}",
            f"{cpu:.1f}", f"{cpu / base_cpu:.2f}", *("" if x is None else f"{x:.2f}" for x in paired),
            "" if r.ir_nodes is None else str(r.ir_nodes),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_variant(text: str) -> Tuple[str, str, int]:
    variant, _, devices = text.partition(":")
    if variant not in WRAPPERS or not devices.isdigit():
        raise argparse.ArgumentTypeError(f"expected VARIANT:DEVICES with VARIANT one of {sorted(WRAPPERS)}")
    return (f"{variant}, {devices} device(s)", variant, int(devices))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", type=parse_variant, nargs="+", help="VARIANT:DEVICES (default: the table's five)")
    p.add_argument("--local-batch", type=int, default=2, help="sequences per replica (default 2)")
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the medians (default 3)")
    p.add_argument("--steps", type=int, default=8, help="timed steps (default 8)")
    p.add_argument("--repeat", type=int, default=1, help="runs of every variant, in rounds (default 1)")
    p.add_argument("--no-ir", dest="ir", action="store_false", help="do not count the step graph's IR nodes")
    p.add_argument("--no-paired", dest="paired", action="store_false",
                   help="do not also trace the unwrapped model in turn with each variant")
    p.add_argument("--losses", action="store_true", help="also print every step's loss and a digest of each "
                   "replica's final parameters (to check that results are bit-identical)")
    p.add_argument("--profile", help="cProfile rank 0's tracing after the warm-up into PROFILE.rank0")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    variants = args.variants or DEFAULT_VARIANTS
    runs: Dict[str, List[List[StepTimes]]] = {label: [] for label, _, _ in variants}
    paired: Dict[str, List[List[StepTimes]]] = {label: [] for label, _, _ in variants}
    for round_ in range(args.repeat):  # in rounds, so that a slow spell of the machine hits every variant
        for label, variant, devices in variants:
            times, base = measure(variant, devices, args)
            runs[label].append(times)
            if base:
                paired[label].append(base)
            r = Result(label, runs[label][-1:], paired[label][-1:], args.warmup)
            print(
                f"round {round_ + 1}, {label}: tracing {r.median_ms('tracing'):.1f} ms "
                f"(CPU {r.median_ms('tracing_cpu'):.1f}), launch {r.median_ms('launch'):.1f} ms "
                f"(CPU {r.median_ms('launch_cpu'):.1f})",
                flush=True,
            )
            if args.losses:
                print("  losses " + " ".join(repr(x) for x in r.losses()), flush=True)
                print("  parameters " + " ".join(t.digest for t in runs[label][-1]), flush=True)
    results = [Result(label, runs[label], paired[label], args.warmup) for label, _, _ in variants]
    print(table(results))


if __name__ == "__main__":
    main()
