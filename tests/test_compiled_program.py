"""What the compiler makes of ZeRO-3 over L wrapped blocks, read from the optimized HLO.

The model is L identical blocks, each its own FSDP unit, inside a root unit that owns the head;
``flatten_parameters=True`` gives one all-gather per unit per pass and one reduce-scatter per unit.
With ``reshard_after_forward=True`` every block frees its full parameters after its forward and
gathers them again in its backward: 2L block all-gathers. The root keeps its parameters from
forward to backward (``disable_reshard_on_root=True``, the default: its backward starts right
after its forward), so it gathers once: 2L + 1 all-gathers and L + 1 reduce-scatters in all.

Switching the barriers off does *not* let XLA:CPU merge a block's backward all-gather into its
forward one (measured, torch_xla 2.9): torch_xla threads a token through every collective of a
graph (a collective's operand is ``input + token``, the next token ``token * result[0]``), so no
two all-gathers have the same operand and CSE has nothing to merge. And XLA:CPU removes the
barriers (``OptimizationBarrierExpander``, right after its first CSE pass) before fusion and
scheduling. Left to itself its scheduler then issued each gather up to two blocks early; the
engine therefore also ties a gather to its unit's inputs on XLA:CPU (``_xla.order_after``, on
the same switch as the barriers), and what switching them off shows is the forward holding more
blocks' full parameters at its peak. What the count catches is a program that keeps full
parameters from forward to backward: ``reshard_after_forward=False`` compiles to L + 1
all-gathers, and uses more bytes.

Each configuration compiles once, in one device process per device count.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, Iterator, Tuple

import pytest
import torch
import torch.nn as nn
from hlo_dump import ProgramReport, StepDumper, TrainingStep
from models import ResidualBlock

from accel_xla_fsdp import XlaFullyShardedDataParallel as FSDP
from accel_xla_fsdp import _xla, seeded

BLOCKS, WIDTH, LOCAL_BATCH = 4, 64, 2
FLOAT_BYTES = 4
BLOCK_NUMEL = 2 * (WIDTH * WIDTH + WIDTH)  # two Linear(WIDTH, WIDTH)
ROOT_NUMEL = WIDTH + 1  # the head, Linear(WIDTH, 1)

ZERO3: Dict[str, Any] = {}
NO_BARRIERS = dict(optimization_barrier_in_forward=False, optimization_barrier_in_backward=False)
NO_RESHARD = dict(reshard_after_forward=False)


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(ResidualBlock(WIDTH) for _ in range(BLOCKS)))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def build(rank: int, world: int, options: Tuple[Tuple[str, Any], ...]) -> TrainingStep:
    """Every block wrapped, then the root; SGD; this replica's batch of ones."""
    with seeded(0):
        model = Blocks()
    kwargs = dict(options, flatten_parameters=True)
    for i in range(BLOCKS):
        model.blocks[i] = FSDP(model.blocks[i], **kwargs)
    wrapped = FSDP(model, **kwargs)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    x = torch.ones(LOCAL_BATCH, WIDTH)
    return TrainingStep(wrapped, optimizer, lambda: wrapped(x.to(_xla.device())).square().mean())


class CompiledSteps:
    """The step's program for given FSDP options, compiled once per options in one device process."""

    def __init__(self, dumper: StepDumper) -> None:
        self.dumper = dumper
        self.world = dumper.num_devices
        self._programs: Dict[Tuple[Tuple[str, Any], ...], ProgramReport] = {}

    def __call__(self, options: Dict[str, Any]) -> ProgramReport:
        key = tuple(sorted(options.items()))
        if key not in self._programs:
            self._programs[key] = self.dumper.report(functools.partial(build, options=key)).program
        return self._programs[key]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}dev")
def compiled(request) -> Iterator[CompiledSteps]:
    with StepDumper(request.param) as dumper:
        yield CompiledSteps(dumper)


def padded(numel: int, world: int) -> int:
    return -(-numel // world) * world


def expected_gather_bytes(world: int, gathered_blocks: int) -> int:
    """The root's full parameters once, and each gathered block's."""
    return FLOAT_BYTES * (padded(ROOT_NUMEL, world) + gathered_blocks * padded(BLOCK_NUMEL, world))


def expected_reduced_bytes(world: int) -> int:
    """Every unit's gradient shard, once."""
    return FLOAT_BYTES * (padded(ROOT_NUMEL, world) + BLOCKS * padded(BLOCK_NUMEL, world)) // world


@pytest.mark.parametrize("options", [ZERO3, NO_BARRIERS], ids=["barriers", "no_barriers"])
def test_every_block_gathers_again_for_backward(compiled: CompiledSteps, options: Dict[str, Any]) -> None:
    program = compiled(options)
    assert program.all_gathers.count == 2 * BLOCKS + 1
    assert program.all_gathers.result_bytes == expected_gather_bytes(compiled.world, 2 * BLOCKS)
    assert program.reduce_scatters.count == BLOCKS + 1
    assert program.reduce_scatters.result_bytes == expected_reduced_bytes(compiled.world)
    assert program.all_reduces.count == 0


def test_barriers_are_traced_and_gone_after_optimization(compiled: CompiledSteps) -> None:
    """The engine's switch works (barriers in the traced HLO), and XLA:CPU removes them all before
    fusion and scheduling; what orders the gathers there is ``_xla.order_after``, which goes with
    the same switch: without it the program holds more."""
    with_barriers, without = compiled(ZERO3), compiled(NO_BARRIERS)
    assert with_barriers.opt_barriers_traced > 0
    assert without.opt_barriers_traced == 0
    assert with_barriers.opt_barriers == without.opt_barriers == 0
    assert with_barriers.total_bytes < without.total_bytes


def test_keeping_full_parameters_for_backward_shows_in_the_program(compiled: CompiledSteps) -> None:
    """The control that would fail the ZeRO-3 test: no block gathers again for its backward, and
    the full parameters kept from forward to backward cost bytes."""
    program = compiled(NO_RESHARD)
    assert program.all_gathers.count == BLOCKS + 1
    assert program.all_gathers.result_bytes == expected_gather_bytes(compiled.world, BLOCKS)
    assert program.reduce_scatters.count == BLOCKS + 1
    assert program.total_bytes > compiled(ZERO3).total_bytes


def test_forward_holds_at_most_two_blocks_full_parameters(compiled: CompiledSteps) -> None:
    """At the peak: the root's full parameters, the block computing and the next one gathered.
    Without the barriers (and the dependencies that stand in for them on XLA:CPU) the scheduler
    issues gathers blocks ahead of their use, so the same bound fails."""
    assert compiled(ZERO3).peak_gathered_bytes <= expected_gather_bytes(compiled.world, 2)
    assert compiled(NO_BARRIERS).peak_gathered_bytes > expected_gather_bytes(compiled.world, 2)


BF16 = dict(compute_dtype=torch.bfloat16)
BF16_FP32_REDUCE = dict(compute_dtype=torch.bfloat16, fp32_reduce_scatter=True)


def test_mixed_precision_gathers_bf16_and_reduces_as_asked(compiled: CompiledSteps) -> None:
    """``compute_dtype=bfloat16``: every gather moves half the bytes of the fp32 program's, and so
    does every gradient reduction the engine asks for, unless ``fp32_reduce_scatter`` asks for
    fp32 there. (XLA:CPU then widens a bf16 reduce-scatter to f32 itself: in the optimized
    program all three reduce in f32, so the request is read from the traced program.)"""
    fp32, bf16, fp32_reduce = compiled(ZERO3), compiled(BF16), compiled(BF16_FP32_REDUCE)
    for program in (bf16, fp32_reduce):
        assert program.all_gathers.count == fp32.all_gathers.count
        assert 2 * program.all_gathers.result_bytes == fp32.all_gathers.result_bytes
        assert program.reduce_scatters_traced.count == fp32.reduce_scatters_traced.count
    assert 2 * bf16.reduce_scatters_traced.result_bytes == fp32.reduce_scatters_traced.result_bytes
    assert fp32_reduce.reduce_scatters_traced.result_bytes == fp32.reduce_scatters_traced.result_bytes
    assert bf16.reduce_scatters.result_bytes == fp32.reduce_scatters.result_bytes  # widened
