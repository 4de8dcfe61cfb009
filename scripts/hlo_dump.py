"""What the compiler made of one training step: collectives, barriers and bytes, read from its dump.

A harness of the tests (test_memory.py, test_collectives.py, test_compiled_program.py,
test_training_loop.py), the benchmark and hlo_report.py, which import it by name (tests/conftest.py
puts scripts/ on the path); not part of the library.

[Note: reading an XLA:CPU dump]
With ``XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text"`` every program the device process
compiles leaves files ``DIR/module_<id>.<name>.<stage>``: the HLO as traced
(``before_optimizations.txt``), the HLO as compiled (``cpu_after_optimizations.txt``), the
compiler's ``cpu_after_optimizations-buffer-assignment.txt`` (every allocation, ``Total bytes
used``, and the values live at the peak of the schedule), LLVM IR and object files. torch_xla
names its programs ``SyncTensorsGraph.<n>``; ``<id>`` grows with every program compiled. Compiled
programs are cached per process, so the replicas of one device process share one program, and
one dump of it, when they trace the same graph.

What the optimized HLO of XLA:CPU shows (torch_xla 2.9):
* collectives are synchronous (``all-gather``, ``reduce-scatter``). A ``-start``/``-done`` pair,
  as other backends emit, is counted once, by its ``-done``;
* torch_xla threads a token through the collectives of a graph: a collective's operand is
  ``input + token`` and the next token is ``token * result[0]``. Collectives keep their traced
  order, and no two all-gathers have the same operand, so the compiler cannot merge the backward
  all-gather of a unit into its forward one, barriers or not;
* no ``opt-barrier`` is left: XLA:CPU's ``OptimizationBarrierExpander`` removes them right after
  its first CSE pass, before fusion and scheduling. The report also counts the barriers of the
  traced HLO, which say what the engine asked for.

``StepDumper`` finds the program of a training step by syncing before it: the step (forward,
backward and ``optimizer.step()``) is then the only program compiled by its final sync.
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, NamedTuple, Optional, Set, Tuple

import torch
import torch.nn as nn

from accel_xla_fsdp import DevicePool, XlaFullyShardedDataParallel, _xla

OPTIMIZED = "cpu_after_optimizations.txt"
TRACED = "before_optimizations.txt"
BUFFER_ASSIGNMENT = "cpu_after_optimizations-buffer-assignment.txt"

# `%name = shape opcode(`; the `%` is optional in newer XLA text, and a tuple shape holds spaces.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[^\s=]+) = (?P<shape>.*?) (?P<opcode>[a-z][a-z0-9-]*)\(", re.M)
_ARRAY = re.compile(r"(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[0-9,<=]*)\]")
_TOTAL = re.compile(r"^Total bytes used: (\d+)", re.M)
_ENTRY_RESULT = re.compile(r"^ENTRY [^\n]*-> (.*) \{$", re.M)
_PEAK = re.compile(r"^\s*Live ranges at \d+ \(peak\):\n((?:\s{4,}\S+: \d+ bytes.*\n)*)", re.M)
_PEAK_VALUE = re.compile(r"^\s*(?P<name>[^\s{]+)\{[^}]*\}: (?P<bytes>\d+) bytes", re.M)
_MODULE_ID = re.compile(r"^module_(\d+)\.")
_PARAMETER = re.compile(r"^\s*%?([^\s=]+) = \S+ parameter\(", re.M)
_COPY_OPERAND = re.compile(r" copy\(%?([^\s,)]+)\)")

_COLLECTIVES = {  # opcode -> the collective it completes
    "all-gather": "all-gather",
    "all-gather-done": "all-gather",
    "reduce-scatter": "reduce-scatter",
    "all-reduce": "all-reduce",
    "all-reduce-done": "all-reduce",
}


class _Instruction(NamedTuple):
    name: str
    shape: str
    opcode: str


@dataclass(frozen=True)
class Collectives:
    """Collectives of one kind in a program: how many, and the bytes of their results per device
    (an all-gather's result is the full tensor, a reduce-scatter's this device's shard)."""

    count: int
    result_bytes: int


@dataclass(frozen=True)
class ProgramReport:
    """The compiler's figures for one program, per device."""

    module: str  # the dump's file prefix, e.g. "module_0001.SyncTensorsGraph.643"
    all_gathers: Collectives
    reduce_scatters: Collectives
    all_reduces: Collectives
    opt_barriers: int  # left in the optimized HLO
    opt_barriers_traced: int  # in the HLO as traced, before the compiler's passes
    # As traced: what the engine asked for. XLA:CPU widens a bf16 reduce-scatter to f32.
    reduce_scatters_traced: Collectives
    total_bytes: int  # "Total bytes used": parameters, outputs and the peak of temporaries
    peak_gathered_bytes: int  # all-gather results live at the peak of the schedule
    output_bytes: int  # the program's results: every value still referenced when it was cut
    # Copies of the entry's parameters: a donated buffer that XLA gave to another tensor's output
    # ([Note: donation order], accel_xla_fsdp/_xla.py).
    parameter_copies: int


@dataclass(frozen=True)
class StepReport:
    """A training step's program, and what one replica held after the step (bytes per device)."""

    program: ProgramReport
    num_devices: int
    param_bytes: int  # the parameters the optimizer steps: shards under FSDP
    grad_bytes: int
    optimizer_state_bytes: int
    largest_unit_bytes: int  # full parameters of the largest FSDP unit; 0 without FSDP

    @property
    def state_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_state_bytes


@dataclass
class TrainingStep:
    """What a builder makes on each replica; ``loss()`` traces the forward on this replica's batch."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss: Callable[[], torch.Tensor]


# (rank, world_size) -> TrainingStep. Importable by name: it runs in the device process.
StepBuilder = Callable[[int, int], TrainingStep]


# ---------------------------------------------------------------------------------------------
# Reading a dump


def parse_dump(directory: Path, module: Optional[str] = None) -> ProgramReport:
    """The report of ``module`` (a file prefix such as ``module_0001.SyncTensorsGraph.643``), by
    default of the program compiled last into ``directory``."""
    module = module or max(modules_in(directory), key=lambda m: int(_MODULE_ID.match(m)[1]))
    optimized_text = (directory / f"{module}.{OPTIMIZED}").read_text()
    optimized = _instructions(optimized_text)
    traced = _instructions((directory / f"{module}.{TRACED}").read_text())
    assignment = (directory / f"{module}.{BUFFER_ASSIGNMENT}").read_text()
    gathered = {i.name for i in optimized if _COLLECTIVES.get(i.opcode) == "all-gather"}
    return ProgramReport(
        module=module,
        all_gathers=_collectives(optimized, "all-gather"),
        reduce_scatters=_collectives(optimized, "reduce-scatter"),
        all_reduces=_collectives(optimized, "all-reduce"),
        opt_barriers=sum(i.opcode == "opt-barrier" for i in optimized),
        opt_barriers_traced=sum(i.opcode == "opt-barrier" for i in traced),
        reduce_scatters_traced=_collectives(traced, "reduce-scatter"),
        total_bytes=_total_bytes(assignment),
        peak_gathered_bytes=sum(size for name, size in _peak_values(assignment) if name in gathered),
        output_bytes=shape_bytes(_ENTRY_RESULT.search(optimized_text)[1]),
        parameter_copies=_parameter_copies(optimized_text),
    )


def modules_in(directory: Path) -> Set[str]:
    """The file prefixes of the programs compiled into a dump directory."""
    suffix = f".{OPTIMIZED}"
    return {p.name[: -len(suffix)] for p in directory.glob(f"module_*{suffix}")}


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape (``f32[8320]{0}``, or a tuple of arrays)."""
    bits = 0
    for m in _ARRAY.finditer(shape):
        numel = 1
        for d in filter(None, m["dims"].split(",")):
            numel *= int(d.lstrip("<="))  # "<=8": a dynamic dimension, at its bound
        bits += _element_bits(m["dtype"]) * numel
    return bits // 8


def _element_bits(dtype: str) -> int:
    if dtype == "pred":
        return 8
    width = re.match(r"[a-z]+(\d+)", dtype)  # f32, bf16, s4, c64, f8e4m3fn, ...
    if width is None:
        raise ValueError(f"unknown HLO element type {dtype!r}")
    return int(width[1])


def _instructions(hlo: str) -> List[_Instruction]:
    return [_Instruction(m["name"], m["shape"], m["opcode"]) for m in _INSTRUCTION.finditer(hlo)]


def _collectives(instructions: List[_Instruction], kind: str) -> Collectives:
    shapes = [i.shape for i in instructions if _COLLECTIVES.get(i.opcode) == kind]
    return Collectives(len(shapes), sum(shape_bytes(s) for s in shapes))


def _parameter_copies(optimized_text: str) -> int:
    entry = optimized_text[optimized_text.index("\nENTRY ") :]
    params = set(_PARAMETER.findall(entry))
    return sum(operand in params for operand in _COPY_OPERAND.findall(entry))


def _total_bytes(assignment: str) -> int:
    m = _TOTAL.search(assignment)
    if m is None:
        raise ValueError("no 'Total bytes used' in the buffer assignment")
    return int(m[1])


def _peak_values(assignment: str) -> List[Tuple[str, int]]:
    m = _PEAK.search(assignment)
    if m is None:
        raise ValueError("no 'Live ranges at ... (peak)' in the buffer assignment")
    return [(v["name"], int(v["bytes"])) for v in _PEAK_VALUE.finditer(m[1])]


# ---------------------------------------------------------------------------------------------
# Compiling one training step


@dataclass(frozen=True)
class _ReplicaFigures:
    param_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int
    largest_unit_bytes: int
    programs: Optional[Set[str]]  # compiled by the step's sync (from the last replica only)


class StepDumper:
    """A device process of ``num_devices`` XLA:CPU devices that dumps every program it compiles
    (into ``dump_dir``, or a temporary directory), and reports one training step per ``report``.

    Programs are cached per process: a step whose graph an earlier ``report`` compiled is not
    compiled again, and has no program of its own to report.
    """

    def __init__(self, num_devices: int, dump_dir: Optional[Path] = None) -> None:
        self._tmp = None if dump_dir else tempfile.TemporaryDirectory(prefix="hlo-dump-")
        self.dump_dir = Path(dump_dir or self._tmp.name)
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        self.num_devices = num_devices
        flags = f"--xla_dump_to={self.dump_dir} --xla_dump_hlo_as_text"
        self._pool = DevicePool(num_devices, env={"XLA_FLAGS": flags})

    def __enter__(self) -> StepDumper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._pool.close()
        if self._tmp is not None:
            self._tmp.cleanup()

    def report(self, builder: StepBuilder, steady: bool = False, donation_order: bool = False) -> StepReport:
        """Build ``builder``'s model on every device, run one training step, report its program.

        ``steady``: a first step runs before, unreported, so that the optimizer's state is there
        and the step updates it in place, as every step after the first does.
        ``donation_order``: after ``optimizer.step()``, the step's outputs are written again in the
        order of their donated buffers, as our Accelerate optimizer does
        (``_xla.write_in_donation_order``).
        """
        figures = self._pool.run(_train_one_step, builder, str(self.dump_dir), steady, donation_order)
        programs = sorted(figures[-1].programs)
        if len(programs) != 1:
            raise ValueError(
                f"expected one new program in {self.dump_dir}, found {programs}. None: an earlier "
                "step in this process compiled the same graph. Several: the replicas traced "
                "different graphs (a rank baked into the graph, say), or the step ran a program "
                "of its own before its sync."
            )
        mine = figures[0]
        return StepReport(
            program=parse_dump(self.dump_dir, programs[0]),
            num_devices=self.num_devices,
            param_bytes=mine.param_bytes,
            grad_bytes=mine.grad_bytes,
            optimizer_state_bytes=mine.optimizer_state_bytes,
            largest_unit_bytes=mine.largest_unit_bytes,
        )


def _train_one_step(
    rank: int, builder: StepBuilder, dump_dir: str, steady: bool, donation_order: bool
) -> _ReplicaFigures:
    step = builder(rank, _xla.world_size())
    if steady:
        step.loss().backward()
        step.optimizer.step()
        step.optimizer.zero_grad()
    # Replicas take turns at every sync and compile there in rank order: once the last one is past
    # a sync, every program up to it is compiled and dumped, and none after it.
    last = rank == _xla.world_size() - 1
    before = _sync_and_list(Path(dump_dir), last)
    loss = step.loss()
    loss.backward()
    grad_bytes = sum(_bytes(p.grad) for p in step.model.parameters() if p.grad is not None)
    donated = _xla.tensor_ids(_updated_tensors(step))
    step.optimizer.step()
    if donation_order:  # the loss is then the sync's first output, as in a script that logs it
        _xla.write_in_donation_order([loss], donated, _updated_tensors(step))
    else:
        del loss
    step.optimizer.zero_grad()
    after = _sync_and_list(Path(dump_dir), last)
    return _ReplicaFigures(
        param_bytes=sum(_bytes(p) for p in step.model.parameters()),
        grad_bytes=grad_bytes,
        optimizer_state_bytes=_optimizer_state_bytes(step.optimizer),
        largest_unit_bytes=max((_unit_full_bytes(u) for u in _units(step.model)), default=0),
        programs=after - before if last else None,
    )


def _sync_and_list(dump_dir: Path, last: bool) -> Set[str]:
    _xla.sync()
    return modules_in(dump_dir) if last else set()


def _updated_tensors(step: TrainingStep) -> List[torch.Tensor]:
    return [*step.model.parameters(), *_device_state(step.optimizer)]


def _device_state(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    """Device tensors only: Adam's step count, for one, stays on the CPU."""
    return [
        t
        for state in optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor) and _xla.is_xla_device(t.device)
    ]


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(_bytes(t) for t in _device_state(optimizer))


def _units(model: nn.Module) -> List[XlaFullyShardedDataParallel]:
    return [m for m in model.modules() if isinstance(m, XlaFullyShardedDataParallel)]


def _unit_full_bytes(unit: XlaFullyShardedDataParallel) -> int:
    """The unit's gathered parameters: its own shards (padding included) times the shard count,
    in the compute dtype."""
    numel = sum(p.numel() for p in unit.parameters(recurse=False)) * unit.sharding.world_size
    return numel * torch.empty((), dtype=unit.options.compute_dtype).element_size()


# ---------------------------------------------------------------------------------------------
# The ideal


def ideal_bytes(sharded: StepReport, unsharded: StepReport) -> int:
    """The bytes per device a perfect ZeRO-3 step would use, for ``sharded``.

    ``(parameters + gradients + optimizer state) / N + activations + the largest unit's full
    parameters and gradients``. ``unsharded`` is the step of the same model, local batch and
    optimizer without FSDP on one device; its states are measured on the replica after the step.
    Its activations are its program's "Total bytes used" minus the states the program holds from
    step to step, its parameters and optimizer state (its inputs and outputs): what remains is
    activations, temporaries, the batch and the loss. Gradients are not subtracted: XLA applies
    each gradient to its parameter as soon as it is computed, so in one compiled step they are
    temporaries, never all live (measured: SGD on a small MLP, 152 KiB in all against 260 KiB of
    parameters and gradients). The gradients held at the unsharded program's peak are therefore
    counted in its activations, as they are in the sharded program's bytes.

    Measured on the benchmark's Llama (8 blocks, AdamW, 2 x 64 tokens, 25.1 MiB of parameters):
    the unsharded program's peak is where backward begins, and holds the parameters, the AdamW
    state, every block's saved activations and one gradient (the output layer's, 0.5 MiB).
    Subtracting all the gradients as well would leave 8.1 MiB for activations that take some
    25 MiB at that peak, an ideal no program of this model can reach.
    """
    activations = unsharded.program.total_bytes - unsharded.param_bytes - unsharded.optimizer_state_bytes
    full_unit = 2 * sharded.largest_unit_bytes  # parameters and their gradients
    return unsharded.state_bytes // sharded.num_devices + activations + full_unit
