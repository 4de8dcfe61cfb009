"""Benchmark: this engine against torch_xla's two FSDPs and no sharding, on 1, 2 and 4 XLA:CPU devices.

Every variant trains the same tiny Llama (``LlamaForCausalLM``: 8 decoder blocks, hidden 256) with
AdamW on the same global batch of random tokens, every decoder block its own FSDP unit, and
each (variant, device count) runs in a fresh process, so no compiled program, cache or allocator
is shared between them. The variants:

* ``ours-flat`` / ``ours``: ``accel_xla_fsdp.XlaFullyShardedDataParallel`` with
  ``flatten_parameters=True`` (one gather and one reduce-scatter per unit) and ``False`` (one per
  parameter), ``auto_wrap_policy=transformer_block_policy()``;
* ``torch_xla-fsdp``: torch_xla's ``XlaFullyShardedDataParallel`` (its defaults, so one gather per
  parameter), same wrapping. As shipped it hangs on XLA:CPU devices; this script, and only this
  script, gives it the CPU collective form (``give_torch_xla_fsdp_cpu_collectives``);
* ``torch_xla-spmd``: torch_xla's ``SpmdFullyShardedDataParallel`` over a mesh of the N devices,
  one Python thread driving them all (SPMD), batch sharded along the mesh;
* ``ddp``: the plain model on every replica, gradients averaged in one flat bucket
  (reduce-scatter + all-gather: the CPU has no working all-reduce); ``no-sharding``: the plain
  model on one device, the whole global batch.

The per-replica variants run under ``accel_xla_fsdp.run_on_devices`` (one thread per device,
replicas taking turns at every graph boundary); SPMD runs in a subprocess of this script.

Figures, per (variant, N): the median wall time of a training step after two warm-up steps (a
step ends when its loss is on the host; steps 1 and 2 compile, AdamW's first step creating its
state), the first step's time (tracing, compiling and running it), the bytes the compiler assigns
per device for the steady-state step program (``Total bytes used`` of its buffer assignment,
``XLA_FLAGS=--xla_dump_to``) against the ZeRO-3 ideal, and the collectives in that program.

    .venv/bin/python scripts/benchmark.py --repeat 2   # ~23 min: docs/benchmark.md, docs/benchmark.png
    .venv/bin/python scripts/benchmark.py --quick    # smoke run, 1 and 2 devices, into out/
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.nn as nn
import torch.nn.functional as F
from hlo_dump import Collectives, ProgramReport, StepReport, ideal_bytes, modules_in, parse_dump

# Model classes are imported before any replica thread starts: transformers' lazy imports are
# not thread-safe.
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import accel_xla_fsdp
from accel_xla_fsdp import _xla, seeded, transformer_block_policy

REPO = Path(__file__).resolve().parent.parent
FLOAT_BYTES = 4


# ---------------------------------------------------------------------------------------------
# What is measured


@dataclass(frozen=True)
class Settings:
    """The model, the data and the run; the same for every variant."""

    vocab: int = 512
    hidden: int = 256
    intermediate: int = 688
    layers: int = 8
    heads: int = 8
    seq_len: int = 64
    global_batch: int = 8
    lr: float = 1e-3
    warmup_steps: int = 2  # step 1 compiles (AdamW creates its state), step 2 compiles the steady step
    timed_steps: int = 8

    @property
    def steps(self) -> int:
        return self.warmup_steps + self.timed_steps


@dataclass(frozen=True)
class Variant:
    name: str
    label: str
    kind: str  # "replica": one thread per device (run_on_devices); "spmd": one thread, all devices
    device_counts: Tuple[int, ...] = (1, 2, 4)
    main: bool = True  # in this script's default run; False: only when named (docs/collectives.md's configurations)


VARIANTS: Dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("ours-flat", "ours, flatten_parameters=True", "replica"),
        Variant("ours", "ours, flatten_parameters=False", "replica"),
        Variant("ours-prefetch", "ours, flatten_parameters=True, backward_prefetch=True", "replica", (2, 4)),
        Variant("torch_xla-fsdp", "torch_xla XlaFullyShardedDataParallel (CPU collectives patched in)", "replica"),
        Variant("torch_xla-spmd", "torch_xla SpmdFullyShardedDataParallel", "spmd"),
        Variant("ddp", "no sharding, data parallel (one flat gradient bucket)", "replica", (2, 4)),
        Variant("no-sharding", "no sharding, one device, whole batch", "replica", (1,)),
        Variant(
            "ours-coalesce", "ours, flatten_parameters=False, coalesce_all_gather_ops=True", "replica", (2, 4), False
        ),
        Variant(
            "ours-bucket25",
            "ours, flatten_parameters=False, reduce_scatter_bucket_size_mb=25",
            "replica",
            (2, 4),
            False,
        ),
        Variant(
            "ours-coalesce-bucket25",
            "ours, flatten_parameters=False, coalesce_all_gather_ops=True, reduce_scatter_bucket_size_mb=25",
            "replica",
            (2, 4),
            False,
        ),
    )
}


@dataclass
class RunFigures:
    """What one (variant, N) run reports from its process (rank 0 for per-replica variants)."""

    step_times: List[float]  # every step, warm-up included
    host_times: List[float]  # of which tracing and launching (the rest: waiting for the devices)
    cpu_times: List[float]  # CPU seconds the process (every thread) spent in each step
    host_cpu_times: List[float]  # of which until the launch
    losses: List[float]  # global-batch loss of every step (mean over replicas)
    compiles_after_warmup: int  # programs compiled during the timed steps: should be 0
    compile_s: float  # compiler time of every program the process compiled
    step_program: Optional[str]  # the dump's module prefix of the steady-state step program
    programs_at_step_2: int  # programs compiled by step 2 (1 when the replicas share it)


# ---------------------------------------------------------------------------------------------
# The model and the data


def llama_config(s: Settings) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=s.vocab,
        hidden_size=s.hidden,
        intermediate_size=s.intermediate,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.heads,
        max_position_embeddings=max(128, s.seq_len),
        attn_implementation="eager",
        use_cache=False,
    )


def build_model(s: Settings) -> LlamaForCausalLM:
    """The same initial model in every variant (seed 0)."""
    return LlamaForCausalLM(llama_config(s))


def global_batches(s: Settings) -> torch.Tensor:
    """[steps, global_batch, seq_len] random tokens, the same for every variant."""
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, s.vocab, (s.steps, s.global_batch, s.seq_len), generator=gen)


def local_rows(batch: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Replica ``rank``'s contiguous rows: what SPMD's batch sharding gives device ``rank``."""
    rows = batch.size(0) // world
    return batch[rank * rows : (rank + 1) * rows]


def param_numels(s: Settings) -> Tuple[int, int]:
    """(all parameters, the largest wrapped unit's): a decoder block, or the root's embedding,
    final norm and head."""
    model = build_model(s)
    block = sum(p.numel() for p in model.model.layers[0].parameters())
    total = sum(p.numel() for p in model.parameters())
    return total, max(block, total - s.layers * block)


# ---------------------------------------------------------------------------------------------
# Wrapping, per variant (inside a replica thread)

AfterBackward = Callable[[], None]


def wrap_ours(
    model: nn.Module, flatten: bool, prefetch: bool = False, **options: object
) -> Tuple[nn.Module, AfterBackward]:
    wrapped = accel_xla_fsdp.XlaFullyShardedDataParallel(
        model,
        auto_wrap_policy=transformer_block_policy(),
        flatten_parameters=flatten,
        backward_prefetch=prefetch,
        **options,
    )
    return wrapped, lambda: None


def wrap_torch_xla_fsdp(model: nn.Module) -> Tuple[nn.Module, AfterBackward]:
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel
    from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy

    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    wrapped = XlaFullyShardedDataParallel(model.to(_xla.device()), auto_wrap_policy=policy)
    give_torch_xla_fsdp_cpu_collectives(wrapped)
    return wrapped, lambda: None


def wrap_ddp(model: nn.Module) -> Tuple[nn.Module, AfterBackward]:
    model = model.to(_xla.device())
    params = [p for p in model.parameters() if p.requires_grad]
    return model, functools.partial(average_gradients, params)


def wrap_plain(model: nn.Module) -> Tuple[nn.Module, AfterBackward]:
    return model.to(_xla.device()), lambda: None


WRAPPERS: Dict[str, Callable[[nn.Module], Tuple[nn.Module, AfterBackward]]] = {
    "ours-flat": functools.partial(wrap_ours, flatten=True),
    "ours": functools.partial(wrap_ours, flatten=False),
    "ours-prefetch": functools.partial(wrap_ours, flatten=True, prefetch=True),
    "ours-coalesce": functools.partial(wrap_ours, flatten=False, coalesce_all_gather_ops=True),
    "ours-bucket25": functools.partial(wrap_ours, flatten=False, reduce_scatter_bucket_size_mb=25),
    "ours-coalesce-bucket25": functools.partial(
        wrap_ours, flatten=False, coalesce_all_gather_ops=True, reduce_scatter_bucket_size_mb=25
    ),
    "torch_xla-fsdp": wrap_torch_xla_fsdp,
    "ddp": wrap_ddp,
    "no-sharding": wrap_plain,
}


def give_torch_xla_fsdp_cpu_collectives(root: nn.Module) -> None:
    """Make torch_xla's ``XlaFullyShardedDataParallel`` run on XLA:CPU devices (benchmark only).

    As shipped it hangs at its first collective there: it calls ``xm.all_gather`` /
    ``xm.reduce_scatter`` / ``xm.all_reduce`` without a channel id, and XLA:CPU then matches the
    participants of a collective by the compiled module's id, different in every replica thread
    (see the platform note, ``xla-cpu-multidevice.md``). Each unit keeps its collectives in three
    attributes; they are replaced, on every unit, by the engine's CPU form
    (``accel_xla_fsdp._xla``): a channel id numbered per graph (identical on every replica, the
    numbering restarting at every graph boundary under ``run_on_devices``),
    ``use_global_device_ids=True``, explicit groups, ``pin_layout=False``, and an all-reduce made
    of an all-gather and a sum. Nothing else of torch_xla's FSDP changes: its gathers keep their
    (-1, 128) tiles, its reduce-scatters their scale, one per parameter (bucket size 0).
    """
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel

    for unit in root.modules():
        if isinstance(unit, XlaFullyShardedDataParallel):
            groups = unit.sharding_groups
            unit.all_gather_op = lambda tensor, groups=groups: _xla.all_gather(tensor, groups, pin_layout=False)
            unit.all_reduce_op = _cpu_all_reduce
            unit.reduce_scatter_op = _CpuReduceScatter(unit.world_size, groups, unit.reduce_scatter_op.scale)


def _cpu_all_reduce(reduce_type: str, tensor: torch.Tensor, groups: Optional[List[List[int]]] = None) -> torch.Tensor:
    import torch_xla.core.xla_model as xm

    op = {xm.REDUCE_SUM: "sum", xm.REDUCE_MAX: "max"}[reduce_type]
    return _xla.all_reduce(tensor, op, groups, pin_layout=False)


class _CpuReduceScatter:
    """torch_xla FSDP's ``BucketizedReduceScatter`` with bucket size 0, in the CPU form."""

    def __init__(self, shard_count: int, groups: Optional[List[List[int]]], scale: float) -> None:
        self.shard_count, self.groups, self.scale = shard_count, groups, scale

    def __call__(self, tensor: torch.Tensor, callback: Callable[[torch.Tensor], None]) -> None:
        callback(_xla.reduce_scatter_sum(tensor, self.shard_count, self.scale, self.groups, pin_layout=False))

    def flush(self) -> None:
        pass


@torch.no_grad()
def average_gradients(params: Sequence[nn.Parameter]) -> None:
    """DDP's all-reduce of the gradients (mean), as one flat bucket: reduce-scatter + all-gather."""
    world = _xla.world_size()
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    flat = F.pad(flat, [0, -flat.numel() % world])
    shard = _xla.reduce_scatter_sum(flat, world, 1.0 / world, None, pin_layout=False)
    full = _xla.all_gather(shard, None, pin_layout=False)
    offset = 0
    for g in grads:
        g.copy_(full[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


# ---------------------------------------------------------------------------------------------
# The training loop, timed (the same for both kinds of variant)


@dataclass
class StepLog:
    times: List[float] = field(default_factory=list)
    host: List[float] = field(default_factory=list)  # until the step's program is launched
    cpu: List[float] = field(default_factory=list)  # CPU seconds of the whole process
    host_cpu: List[float] = field(default_factory=list)  # of which until the launch
    losses: List[float] = field(default_factory=list)
    compiles: List[int] = field(default_factory=list)  # programs compiled so far, after each step
    programs: List[List[str]] = field(default_factory=list)  # new in the dump, at each step


def train(
    model: nn.Module,
    after_backward: AfterBackward,
    batches: Sequence[torch.Tensor],
    prepare: Callable[[torch.Tensor], torch.Tensor],
    lr: float,
    dump_dir: Optional[Path],
) -> StepLog:
    """Train on ``batches``; time each step from its first op until its loss is on the host."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)  # after wrapping: the shards
    log, seen = StepLog(), dump_modules(dump_dir)
    for batch in batches:
        start, cpu_start = time.perf_counter(), time.process_time()
        input_ids = prepare(batch)
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        after_backward()
        optimizer.step()
        optimizer.zero_grad()
        _xla.sync()
        log.host.append(time.perf_counter() - start)
        log.host_cpu.append(time.process_time() - cpu_start)
        log.losses.append(loss.item())  # waits for the step's program to finish
        log.times.append(time.perf_counter() - start)
        log.cpu.append(time.process_time() - cpu_start)
        log.compiles.append(compile_count())
        now = dump_modules(dump_dir)
        log.programs.append(sorted(now - seen))
        seen = now
    return log


def compile_count() -> int:
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return 0 if data is None else int(data[0])


def compile_seconds() -> float:
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return 0.0 if data is None else data[1] / 1e9


def figures(log: StepLog, s: Settings) -> RunFigures:
    warm = s.warmup_steps
    step2 = log.programs[1] if len(log.programs) > 1 else []
    return RunFigures(
        step_times=log.times,
        host_times=log.host,
        cpu_times=log.cpu,
        host_cpu_times=log.host_cpu,
        losses=log.losses,
        compiles_after_warmup=log.compiles[-1] - log.compiles[warm - 1],
        compile_s=compile_seconds(),
        step_program=step2[-1] if step2 else None,
        programs_at_step_2=len(step2),
    )


def replica(rank: int, variant: str, s: Settings, dump_dir: Optional[str]) -> RunFigures:
    """One replica of a per-replica variant (``run_on_devices`` runs it on every device)."""
    world = _xla.world_size()
    with seeded(0):  # the replicas are threads sharing one RNG: build the same model on each
        model = build_model(s)
    model, after_backward = WRAPPERS[variant](model)
    device = _xla.device()
    log = train(
        model,
        after_backward,
        global_batches(s),
        lambda batch: local_rows(batch, rank, world).to(device),
        s.lr,
        Path(dump_dir) if dump_dir else None,
    )
    return figures(log, s)


# ---------------------------------------------------------------------------------------------
# SPMD: its own process, one thread driving every device


def spmd_worker(num_devices: int, s: Settings, dump_dir: Optional[str], result: Path) -> None:
    """torch_xla's SPMD FSDP, as its docs and tests set it up (``xr.use_spmd()``, a mesh with an
    'fsdp' axis over every device, the batch sharded along it, each decoder block wrapped)."""
    import numpy as np
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr
    from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel

    xr.use_spmd()
    assert xr.global_runtime_device_count() == num_devices
    mesh = xs.Mesh(np.arange(num_devices), (num_devices, 1), ("fsdp", "model"))
    torch.manual_seed(0)
    model = build_model(s)

    def shard_logits(output: object, mesh: xs.Mesh) -> None:  # the root's output is a ModelOutput
        logits = output if isinstance(output, torch.Tensor) else output.logits
        xs.mark_sharding(logits, mesh, ("fsdp",) + (None,) * (logits.dim() - 1))

    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    wrapped = SpmdFullyShardedDataParallel(model, mesh=mesh, shard_output=shard_logits, auto_wrap_policy=policy)
    device = torch_xla.device()

    def prepare(batch: torch.Tensor) -> torch.Tensor:
        ids = batch.to(device)
        xs.mark_sharding(ids, mesh, ("fsdp", None))
        return ids

    log = train(wrapped, lambda: None, global_batches(s), prepare, s.lr, Path(dump_dir) if dump_dir else None)
    result.write_text(json.dumps(dataclasses.asdict(figures(log, s))))


def run_spmd(num_devices: int, s: Settings, dump: Optional[Path], env: Dict[str, str], timeout_s: float) -> RunFigures:
    """``spmd_worker`` in a subprocess of this script with ``num_devices`` XLA:CPU devices."""
    with tempfile.TemporaryDirectory(prefix="bench-spmd-") as tmp:
        result = Path(tmp) / "figures.json"
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--spmd-worker",
            str(num_devices),
            "--settings",
            json.dumps(dataclasses.asdict(s)),
            "--dump",
            str(dump or ""),
            "--result",
            str(result),
        ]
        subprocess.run(cmd, env={**os.environ, **env}, check=True, timeout=timeout_s)
        return RunFigures(**json.loads(result.read_text()))


# ---------------------------------------------------------------------------------------------
# The compiler's figures (hlo_dump.py reads the dump) and the ideal

COLLECTIVE_KINDS = ("all_gathers", "reduce_scatters", "all_reduces")


def dump_modules(directory: Optional[Path]) -> set:
    return modules_in(directory) if directory is not None and directory.exists() else set()


@dataclass(frozen=True)
class Ideal:
    """``hlo_dump.ideal_bytes`` for every device count: ``(parameters + gradients + AdamW state)
    / N + activations + the largest wrapped unit's full parameters and gradients``, the activations
    taken from the plain model's program compiled on one device for the local batch."""

    param_bytes: int
    unit_bytes: int
    unsharded_total_bytes: Dict[int, int]  # by device count (local batch = global batch / N)

    def for_devices(self, n: int) -> int:
        def report(devices: int, total: int, unit: int) -> StepReport:
            program = _program_using(total)
            # AdamW: exp_avg and exp_avg_sq (its step counts stay on the host)
            return StepReport(program, devices, self.param_bytes, self.param_bytes, 2 * self.param_bytes, unit)

        return ideal_bytes(report(n, 0, self.unit_bytes), report(1, self.unsharded_total_bytes[n], 0))

    def strict_for_devices(self, n: int) -> int:
        """The issue's wording taken literally: the activations are the unsharded program's bytes
        minus *all* its states, its full gradients included (``ideal_bytes`` keeps the gradients
        in them, as temporaries of the compiled step)."""
        return self.for_devices(n) - self.param_bytes

    def activation_bytes(self, n: int) -> int:
        return self.for_devices(n) - 4 * self.param_bytes // n - 2 * self.unit_bytes


def _program_using(total_bytes: int) -> ProgramReport:
    """A report with only ``total_bytes`` (all ``ideal_bytes`` reads of a program)."""
    blank = {"Collectives": Collectives(0, 0), "str": ""}
    fields = {f.name: blank.get(str(f.type), 0) for f in dataclasses.fields(ProgramReport)}
    return ProgramReport(**{**fields, "total_bytes": total_bytes})


def over_ideal(row: Row, ideal: Optional[Ideal], strict: bool = False) -> float:
    """Compiled bytes per device / the ideal (nan without a dump)."""
    if ideal is None or not row.total_bytes:
        return float("nan")
    return row.total_bytes / (ideal.strict_for_devices if strict else ideal.for_devices)(row.devices)


# ---------------------------------------------------------------------------------------------
# Running every variant


@dataclass
class Row:
    variant: str
    devices: int
    median_s: float = float("nan")
    min_s: float = float("nan")
    max_s: float = float("nan")
    host_s: float = float("nan")  # median, of which tracing and launching
    cpu_s: float = float("nan")  # median CPU seconds of the process per step
    host_cpu_s: float = float("nan")  # of which until the launch
    first_s: float = float("nan")
    compile_s: float = float("nan")
    total_bytes: int = 0
    collectives: Dict[str, Tuple[int, int]] = field(default_factory=dict)
    final_loss: float = float("nan")
    recompiles: int = 0
    process_s: float = float("nan")
    run_medians: List[float] = field(default_factory=list)  # one per repeat (fresh process each)
    notes: List[str] = field(default_factory=list)  # anything that makes the row suspect
    dumped: bool = False  # the compiler wrote a dump (which slows compiling: first step, compile s)
    error: Optional[str] = None


def run_one(variant: str, n: int, s: Settings, dumps: str, timeout_s: float) -> Tuple[Row, Optional[ProgramReport]]:
    """One (variant, N) in a fresh process; its row and its steady-state step program.

    ``dumps``: "off" (times only), "on" (the compiler writes a dump, read and deleted), "keep".
    """
    dump = Path(tempfile.mkdtemp(prefix=f"bench-{variant}-{n}-")) if dumps != "off" else None
    env = {"XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text"} if dump else {}
    row, start = Row(variant, n, dumped=dump is not None), time.perf_counter()
    try:
        if VARIANTS[variant].kind == "spmd":
            per_rank = [run_spmd(n, s, dump, _xla.cpu_device_env(n, env), timeout_s)]
        else:
            per_rank = accel_xla_fsdp.run_on_devices(replica, n, args=(variant, s, dump and str(dump)), env=env)
        row.process_s = time.perf_counter() - start
        program = fill_row(row, per_rank, dump, s)
    except Exception as exc:  # noqa: BLE001 - one failing variant must not end the benchmark
        row.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
        program = None
    finally:
        if dump and dumps == "keep":
            print(f"    dump kept in {dump}", flush=True)
        elif dump:
            shutil.rmtree(dump, ignore_errors=True)
    return row, program


def fill_row(row: Row, per_rank: List[RunFigures], dump: Optional[Path], s: Settings) -> Optional[ProgramReport]:
    # The last replica launches last (the replicas take turns at each sync): its time until the
    # launch covers every replica's tracing, and the rest is the devices running the step.
    lead = per_rank[-1]
    timed = lead.step_times[s.warmup_steps :]
    if timed:
        row.median_s, row.min_s, row.max_s = statistics.median(timed), min(timed), max(timed)
        row.host_s = statistics.median(lead.host_times[s.warmup_steps :])
        row.cpu_s = statistics.median(lead.cpu_times[s.warmup_steps :])
        row.host_cpu_s = statistics.median(lead.host_cpu_times[s.warmup_steps :])
    row.first_s = lead.step_times[0]
    row.compile_s = lead.compile_s
    row.recompiles = lead.compiles_after_warmup
    if row.recompiles:
        row.notes.append(f"{row.recompiles} program(s) compiled after the warm-up")
    if dump is not None and lead.programs_at_step_2 != 1:
        row.notes.append(f"{lead.programs_at_step_2} programs compiled at step 2 (bytes: the last)")
    row.final_loss = statistics.fmean(f.losses[-1] for f in per_rank)
    module = lead.step_program  # the last replica syncs last: everything is compiled then
    if module is None or dump is None:
        return None
    program = parse_dump(dump, module)
    row.total_bytes = program.total_bytes
    row.collectives = {k: (getattr(program, k).count, getattr(program, k).result_bytes) for k in COLLECTIVE_KINDS}
    return program


def run_all(
    s: Settings, device_counts: Sequence[int], variants: Sequence[str], dumps: str, repeats: int, timeout_s: float
) -> Tuple[List[Row], Optional[Ideal]]:
    """Every (variant, N), device count by device count, ``repeats`` times over (the compiler
    dumps in the first round only: the programs are the same), then the ideal's references.
    Returns every run's row (``merged`` makes one per (variant, N))."""
    runs: List[Row] = []
    programs: Dict[Tuple[str, int], Optional[ProgramReport]] = {}
    for round_ in range(repeats):
        for n in device_counts:
            for name in (v for v in variants if n in VARIANTS[v].device_counts):
                print(f"[{time.strftime('%H:%M:%S')}] {name} on {n} device(s), round {round_ + 1}", flush=True)
                row, program = run_one(name, n, s, dumps if round_ == 0 else "off", timeout_s)
                print(f"    {summary(row)}", flush=True)
                runs.append(row)
                programs.setdefault((name, n), program)
    if dumps == "off":
        return runs, None
    return runs, measure_ideal(s, device_counts, programs.get(("no-sharding", 1)), dumps, timeout_s)


def merged(runs: Sequence[Row]) -> List[Row]:
    """One row per (variant, N), in the order they first ran."""
    groups: Dict[Tuple[str, int], List[Row]] = {}
    for r in runs:
        groups.setdefault((r.variant, r.devices), []).append(r)
    return [merge_runs(g) for g in groups.values()]


def merge_runs(runs: List[Row]) -> Row:
    """One row from repeated runs: medians of their figures, the compiler's figures from the run
    that dumped, and compile times from the runs that did not, if any (dumping slows compiling)."""
    ok = [r for r in runs if not r.error]
    if not ok:
        return runs[0]
    with_bytes = [r for r in ok if r.total_bytes] or ok
    undumped = [r for r in ok if not r.dumped] or ok
    row = dataclasses.replace(with_bytes[0], run_medians=[r.median_s for r in ok])
    for name in ("median_s", "host_s", "cpu_s", "host_cpu_s"):
        setattr(row, name, statistics.median(getattr(r, name) for r in ok))
    for name in ("first_s", "compile_s", "process_s"):
        setattr(row, name, statistics.median(getattr(r, name) for r in undumped))
    row.dumped = all(r.dumped for r in undumped)
    row.min_s, row.max_s = min(r.min_s for r in ok), max(r.max_s for r in ok)
    row.recompiles = max(r.recompiles for r in ok)
    row.notes = sorted({note for r in ok for note in r.notes})
    if len(ok) < len(runs):
        failed = [r.error for r in runs if r.error]
        row.notes.append(f"{len(failed)} of {len(runs)} runs failed: {failed[0]}")
    return row


def measure_ideal(
    s: Settings, device_counts: Sequence[int], unsharded: Optional[ProgramReport], dumps: str, timeout_s: float
) -> Ideal:
    """The ideal needs the plain model's program on one device for each local batch (global batch
    / N): the no-sharding run's for N = 1, a compile-only run's for the others."""
    params, unit = param_numels(s)
    totals = {}
    for n in device_counts:
        program = unsharded if n == 1 else None
        if program is None:
            print(
                f"[{time.strftime('%H:%M:%S')}] reference: no sharding, local batch {s.global_batch // n}", flush=True
            )
            local = dataclasses.replace(s, global_batch=s.global_batch // n, timed_steps=0)
            row, program = run_one("no-sharding", 1, local, dumps, timeout_s)
            if program is None:
                raise RuntimeError(f"the reference run for the ideal failed: {row.error}")
        totals[n] = program.total_bytes
    return Ideal(params * FLOAT_BYTES, unit * FLOAT_BYTES, totals)


def summary(row: Row) -> str:
    if row.error:
        return f"FAILED {row.error}"
    return (
        f"step {row.median_s:.3f} s (min {row.min_s:.3f}, max {row.max_s:.3f}), first {row.first_s:.1f} s, "
        f"{row.total_bytes / 2**20:.1f} MiB, loss {row.final_loss:.4f}, process {row.process_s:.0f} s"
    )


# ---------------------------------------------------------------------------------------------
# Output: a markdown table and a plot

MIB = 2**20


def reference_step(rows: Sequence[Row]) -> float:
    return next((r.median_s for r in rows if r.variant == "no-sharding" and not r.error), float("nan"))


def variant_list(rows: Sequence[Row]) -> str:
    ran = {r.variant for r in rows}
    return "\n".join(f"- **{v.name}**: {v.label}" for v in VARIANTS.values() if v.name in ran)


def markdown_table(rows: Sequence[Row], ideal: Optional[Ideal]) -> str:
    ref = reference_step(rows)
    kinds = [k for k in COLLECTIVE_KINDS if any(r.collectives.get(k, (0, 0))[0] for r in rows)]
    head = (
        [
            "variant",
            "N",
            "step s, median (min-max)",
            "x no-sharding",
            "host s",
            "CPU s (host)",
            "first step s",
            "compile s",
            "MiB/device",
            "ideal MiB",
            "/ideal",
            "/strict",
        ]
        + [f"{k.replace('_', '-')}: n, MiB" for k in kinds]
        + ["final loss", "notes"]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r.error:
            lines.append(f"| {r.variant} | {r.devices} | failed: {r.error} |" + " |" * (len(head) - 3))
            continue
        want = ideal.for_devices(r.devices) if ideal else float("nan")
        cells = [
            r.variant,
            str(r.devices),
            f"{r.median_s:.3f} ({r.min_s:.3f}-{r.max_s:.3f})",
            f"{r.median_s / ref:.2f}",
            f"{r.host_s:.3f}",
            f"{r.cpu_s:.2f} ({r.host_cpu_s:.2f})",
            f"{r.first_s:.1f}",
            f"{r.compile_s:.1f}",
            f"{r.total_bytes / MIB:.1f}",
            f"{want / MIB:.1f}",
            f"{over_ideal(r, ideal):.2f}",
            f"{over_ideal(r, ideal, strict=True):.2f}",
        ]
        cells += [f"{r.collectives[k][0]}, {r.collectives[k][1] / MIB:.1f}" for k in kinds]
        cells += [f"{r.final_loss:.4f}", "; ".join(r.notes)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratios_at(rows: Sequence[Row], ideal: Optional[Ideal], n: int) -> List[str]:
    """The issue's goals at ``n`` devices, as ratios."""
    at = {r.variant: r for r in rows if r.devices == n and not r.error}
    if "ours-flat" not in at:
        return []
    ours, ref = at["ours-flat"], reference_step(rows)
    lines = [f"At {n} devices (ours = ours-flat):"]
    for name in ("ours-flat", "ours", "ours-prefetch", "torch_xla-fsdp", "torch_xla-spmd", "ddp"):
        if name in at:
            lines.append(
                f"- compiled bytes / ideal, {name}: {over_ideal(at[name], ideal):.2f} "
                f"(strict: {over_ideal(at[name], ideal, strict=True):.2f})"
            )
    theirs = [at[k] for k in ("torch_xla-fsdp", "torch_xla-spmd") if k in at]
    if theirs:
        fastest = min(theirs, key=lambda r: r.median_s)
        lines.append(
            f"- step time, ours / the faster torch_xla FSDP ({fastest.variant}): "
            f"{ours.median_s / fastest.median_s:.2f}"
        )
        lines.append(
            f"- device part of the step (step - host), ours / {fastest.variant}: "
            f"{(ours.median_s - ours.host_s) / (fastest.median_s - fastest.host_s):.2f}"
        )
        first = min(theirs, key=lambda r: r.first_s)
        lines.append(
            f"- first step, ours / the faster of theirs ({first.variant}): {ours.first_s / first.first_s:.2f}"
        )
    lines.append(f"- step time, ours / no sharding on one device: {ours.median_s / ref:.2f}")
    lines.append("- first step (s): " + ", ".join(f"{k} {v.first_s:.1f}" for k, v in at.items()))
    return lines


def plot(rows: Sequence[Row], ideal: Optional[Ideal], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    ref = reference_step(rows)
    for name in VARIANTS:
        mine = [r for r in rows if r.variant == name and not r.error]
        if not mine or name == "no-sharding":
            continue
        ns = [r.devices for r in mine]
        med = [r.median_s for r in mine]
        err = [[m - r.min_s for m, r in zip(med, mine)], [r.max_s - m for m, r in zip(med, mine)]]
        axes[0].errorbar(ns, med, yerr=err, marker="o", capsize=3, label=name)
        line = axes[1].plot(ns, [over_ideal(r, ideal) for r in mine], marker="o", label=name)
        axes[1].plot(
            ns, [over_ideal(r, ideal, strict=True) for r in mine], marker="x", linestyle=":", color=line[0].get_color()
        )
        axes[2].plot(ns, [r.first_s for r in mine], marker="o", label=name)
    axes[0].axhline(ref, color="black", linestyle=":", label="no sharding, 1 device")
    axes[1].axhline(1.10, color="grey", linestyle="--", label="goal: 1.10")
    titles = (
        "median step time (s), min-max bars",
        "compiled bytes per device / ideal (x, dotted: strict)",
        "first step, compile included (s)",
    )
    for ax, title in zip(axes, titles):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("XLA:CPU devices")
        ax.set_xticks(sorted({r.devices for r in rows}))
        ax.grid(alpha=0.3)
    axes[0].set_ylim(bottom=0)
    axes[2].set_ylim(bottom=0)
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


@dataclass
class Report:
    """Everything the markdown and the plot are made from (saved as JSON, to render again)."""

    rows: List[Row]  # every run (``merged`` makes one row per variant and device count)
    ideal: Optional[Ideal]
    settings: Settings
    command: str
    library: str
    versions: str
    date: str
    loads: Tuple[float, float]  # load average before and after
    wall_s: float
    repeats: int

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(dataclasses.asdict(self), indent=1))

    @staticmethod
    def load(path: Path) -> Report:
        raw = json.loads(path.read_text())
        ideal = raw["ideal"] and Ideal(
            raw["ideal"]["param_bytes"],
            raw["ideal"]["unit_bytes"],
            {int(n): b for n, b in raw["ideal"]["unsharded_total_bytes"].items()},
        )
        rows = [Row(**{**r, "collectives": {k: tuple(v) for k, v in r["collectives"].items()}}) for r in raw["rows"]]
        return Report(
            **{
                **raw,
                "rows": rows,
                "ideal": ideal,
                "settings": Settings(**raw["settings"]),
                "loads": tuple(raw["loads"]),
            }
        )


def versions() -> str:
    import torch_xla

    return f"torch {torch.__version__}, torch_xla {torch_xla.__version__}, Python {platform.python_version()}"


def library_version() -> str:
    """Which accel_xla_fsdp was measured: its git commit, and whether files differed from it (the
    page is committed, so it names no path of the machine it ran on)."""
    where = Path(accel_xla_fsdp.__file__).resolve().parent
    try:

        def git(*args: str) -> str:
            return subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True, check=True).stdout

        commit = git("rev-parse", "--short=10", "HEAD").strip()
        return commit + (" with uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return "not a git checkout"


def write_markdown(report: Report, path: Path, plot_path: Path) -> None:
    rows, ideal, s = merged(report.rows), report.ideal, report.settings
    params, unit = param_numels(s)
    n_max = max(r.devices for r in rows)
    activation = (
        "not measured: run without dumps"
        if ideal is None
        else ", ".join(
            f"N={n}: {ideal.activation_bytes(n) / MIB:.1f} MiB" for n in sorted(ideal.unsharded_total_bytes)
        )
        + f"; parameters + gradients + AdamW state {4 * ideal.param_bytes / MIB:.1f} MiB"
    )
    strict_activation = (
        ""
        if ideal is None
        else ", ".join(
            f"{(ideal.activation_bytes(n) - ideal.param_bytes) / MIB:.1f} MiB at N={n}"
            for n in sorted(ideal.unsharded_total_bytes)
        )
    )
    text = f"""# Benchmark: FSDP on XLA:CPU devices

Written by `{report.command}` ({report.date}, {report.wall_s / 60:.1f} min; do not edit by hand).
accel_xla_fsdp {report.library}; {report.versions}; {os.cpu_count()} cores shared by every device
and by whatever else the machine ran (load average {report.loads[0]:.1f} before, {report.loads[1]:.1f} after).

Model: `LlamaForCausalLM`, {s.layers} decoder blocks, hidden {s.hidden}, intermediate {s.intermediate},
{s.heads} heads, vocabulary {s.vocab}, eager attention, {params / 1e6:.2f} M parameters (largest unit
{unit / 1e6:.2f} M); AdamW; global batch {s.global_batch} x {s.seq_len} random tokens, split across the
devices; every decoder block wrapped. Each (variant, N) ran in a fresh process, {report.repeats} time(s), in
rounds over the whole table.

- **step s**: median over {s.timed_steps} steps after {s.warmup_steps} warm-up steps (of the runs'
  medians when repeated; min-max of every timed step in brackets); a step ends when its loss is on
  the host. **x no-sharding**: against the plain model on
  one device. **host s**: of the step, the median time until its program was launched on every
  device (tracing it, on every replica, and launching); the rest is the devices running it.
  **CPU s**: median CPU seconds the whole process (every thread) spent per step, in brackets
  until the launch ({os.cpu_count()} cores: at most {os.cpu_count()}x the step time; less sensitive
  than wall time to the other load on the machine).
  **first step**: trace, compile and run of step 1; **compile s**: the compiler's time
  for every program of the process (`CompileTime` metric; the steady step is compiled at step 2);
  both from the runs without a compiler dump when there are any (writing the dump slows compiling).
- **MiB/device**: `Total bytes used` of the steady-state step program's buffer assignment.
  **ideal** (`hlo_dump.ideal_bytes`): (parameters + gradients + AdamW state) / N + activations +
  the largest unit's full parameters and gradients; activations are the plain model's program on
  one device for the local batch, minus its parameters and AdamW state ({activation}).
  **/strict**: against the same ideal less the full gradients, i.e. with the activations taken as
  the unsharded program's bytes minus all its states, gradients included. The unsharded program
  never holds its full gradients (its peak, where backward begins, holds one: the output
  layer's), so this ideal credits activations with {strict_activation}, less than they take at
  that peak, and no program of this model reaches it: see `hlo_dump.ideal_bytes`.
- **collectives**: in that program, with the bytes of their results per device.
- **torch_xla-fsdp** is torch_xla's `XlaFullyShardedDataParallel`, which hangs on XLA:CPU devices
  as shipped: this benchmark replaces its collectives by the CPU form (channel ids, global device
  ids, explicit groups, no pinned layout, all-reduce as all-gather + sum), nothing else
  (`give_torch_xla_fsdp_cpu_collectives` in `scripts/benchmark.py`).
- **torch_xla-spmd** is `SpmdFullyShardedDataParallel` under `xr.use_spmd()`, one thread driving
  every device; the others run one thread per device (`run_on_devices`).

{variant_list(rows)}

{markdown_table(rows, ideal)}

{chr(10).join(ratios_at(rows, ideal, n_max))}

![benchmark]({plot_path.name})
"""
    path.write_text(text)


# ---------------------------------------------------------------------------------------------
# Command line


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: 1 and 2 devices, 2 timed steps, into out/")
    p.add_argument("--devices", type=int, nargs="+", help="device counts (default 1 2 4)")
    p.add_argument(
        "--variants", nargs="+", choices=list(VARIANTS), default=[v.name for v in VARIANTS.values() if v.main]
    )
    p.add_argument("--steps", type=int, help=f"timed steps after the warm-up (default {Settings.timed_steps})")
    p.add_argument("--markdown", type=Path, help="default docs/benchmark.md (--quick: out/benchmark-quick.md)")
    p.add_argument("--plot", type=Path, help="default: the markdown's path with .png")
    p.add_argument("--json", type=Path, help="where the raw figures go (default out/benchmark.json)")
    p.add_argument("--render", type=Path, help="no run: write the markdown and plot from saved raw figures")
    p.add_argument(
        "--dumps",
        choices=("on", "off", "keep"),
        default="on",
        help="off: times only (no compiler dump, no bytes); keep: keep each run's dump directory",
    )
    p.add_argument("--repeat", type=int, default=1, help="run every (variant, N) this many times, in rounds")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds, for the SPMD subprocess")
    p.add_argument("--spmd-worker", type=int, help=argparse.SUPPRESS)
    p.add_argument("--settings", help=argparse.SUPPRESS)
    p.add_argument("--dump", help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> None:
    started = time.perf_counter()
    args = parse_args()
    if args.spmd_worker is not None:
        settings = Settings(**json.loads(args.settings))
        spmd_worker(args.spmd_worker, settings, args.dump or None, args.result)
        return
    stem = "out/benchmark-quick" if args.quick else "docs/benchmark"
    markdown = args.markdown or REPO / f"{stem}.md"
    plot_path = args.plot or markdown.with_suffix(".png")
    json_path = args.json or REPO / f"out/{Path(stem).name}.json"
    if args.render:
        report = Report.load(args.render)
    else:
        report = run(args, started)
        json_path.parent.mkdir(parents=True, exist_ok=True)
        report.save(json_path)
    markdown.parent.mkdir(parents=True, exist_ok=True)
    write_markdown(report, markdown, plot_path)
    plot(merged(report.rows), report.ideal, plot_path)
    print(markdown.read_text())
    print(f"wrote {markdown} and {plot_path} (raw figures: {args.render or json_path})")


def run(args: argparse.Namespace, started: float) -> Report:
    s = Settings()
    if args.quick:
        s = dataclasses.replace(s, timed_steps=2)
    if args.steps is not None:
        s = dataclasses.replace(s, timed_steps=args.steps)
    devices = args.devices or ([1, 2] if args.quick else [1, 2, 4])
    if any(s.global_batch % n for n in devices):
        raise SystemExit(f"the global batch {s.global_batch} must split evenly across {devices} devices")
    load_before = os.getloadavg()[0]
    rows, ideal = run_all(s, devices, args.variants, args.dumps, args.repeat, args.timeout)
    return Report(
        rows=rows,
        ideal=ideal,
        settings=s,
        command=" ".join(["python scripts/benchmark.py"] + sys.argv[1:]),
        library=library_version(),
        versions=versions(),
        date=time.strftime("%Y-%m-%d"),
        loads=(load_before, os.getloadavg()[0]),
        wall_s=time.perf_counter() - started,
        repeats=args.repeat,
    )


if __name__ == "__main__":
    main()
