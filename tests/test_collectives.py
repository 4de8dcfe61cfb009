"""``coalesce_all_gather_ops`` and ``reduce_scatter_bucket_size_mb`` with per-parameter shards.

* The compiled program (exact figures, read as in test_compiled_program.py): L blocks of two
  Linear, each block a unit inside a root that owns the head, one group per parameter (4 per
  block, 2 for the root). Coalescing gathers each unit's groups in one collective: 2L + 1
  all-gathers instead of 4 * 2L + 2, the same bytes. A bucket larger than a unit's gradients
  reduce-scatters each unit once: L + 1 instead of 4L + 2, the same bytes. A bucket is reduced
  once it holds *more* than its limit (torch_xla's rule).
* Bucketed reductions are exact: every element is summed and scaled as in its own group's
  reduce-scatter, so a bucketed run equals the unbucketed one bit for bit, in float32 and in
  bfloat16 (with bf16 or fp32 reductions), under ``no_sync``, and when a unit's parameter gets no
  gradient. (Coalesced gathers move the same values, but XLA:CPU compiles the backward of the
  step around them differently: gradients then differ by float32 round-off, ~1e-8, so coalesced
  runs are compared with the parity tests' tolerance in tests/test_parity.py, not exactly.)
"""

from __future__ import annotations

import functools
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest
import torch
import torch.nn as nn
from hlo_dump import ProgramReport, StepDumper, TrainingStep
from models import (
    Case,
    ResidualBlock,
    build,
    compute_loss,
    global_batch,
    local_slice,
    make_optimizer,
    train_fsdp,
    train_reference,
    wrap,
)

from accel_xla_fsdp import XlaFullyShardedDataParallel as FSDP
from accel_xla_fsdp import _xla, seeded

Options = Tuple[Tuple[str, Any], ...]

BLOCKS, WIDTH, LOCAL_BATCH = 4, 64, 2
FLOAT_BYTES = 4
BLOCK_PARAMS = (WIDTH * WIDTH, WIDTH) * 2  # fc1.weight, fc1.bias, fc2.weight, fc2.bias
ROOT_PARAMS = (WIDTH, 1)  # the head, Linear(WIDTH, 1)

COALESCE: Options = (("coalesce_all_gather_ops", True),)
BUCKET_1MB: Options = (("reduce_scatter_bucket_size_mb", 1),)  # more than any unit's gradients
# Exactly one weight's gradient, 64 x 64 floats: a weight alone does not fill it, with a bias it does.
BUCKET_16KB: Options = (("reduce_scatter_bucket_size_mb", WIDTH * WIDTH * FLOAT_BYTES / 2**20),)
# The tiny Llama's blocks hold 37 KB of gradients: 0.01 MiB (10.5 KB) makes several buckets of each.
SMALL_BUCKETS: Options = (("reduce_scatter_bucket_size_mb", 0.01),)
NO_BARRIERS: Options = (("optimization_barrier_in_forward", False), ("optimization_barrier_in_backward", False))
BF16: Options = (("compute_dtype", torch.bfloat16),)
BF16_FP32_REDUCE: Options = BF16 + (("fp32_reduce_scatter", True),)


# ---------------------------------------------------------------------------------------------
# The compiled program


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(ResidualBlock(WIDTH) for _ in range(BLOCKS)))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def build_blocks(rank: int, world: int, options: Options) -> TrainingStep:
    """Every block wrapped, then the root, one group per parameter; SGD; a batch of ones."""
    with seeded(0):
        model = Blocks()
    for i in range(BLOCKS):
        model.blocks[i] = FSDP(model.blocks[i], **dict(options))
    wrapped = FSDP(model, **dict(options))
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    x = torch.ones(LOCAL_BATCH, WIDTH)
    return TrainingStep(wrapped, optimizer, lambda: wrapped(x.to(_xla.device())).square().mean())


class CompiledSteps:
    """The step's program for given options, compiled once per options in one device process."""

    def __init__(self, dumper: StepDumper) -> None:
        self.dumper = dumper
        self.world = dumper.num_devices
        self._programs: Dict[Options, ProgramReport] = {}

    def __call__(self, options: Options) -> ProgramReport:
        if options not in self._programs:
            self._programs[options] = self.dumper.report(functools.partial(build_blocks, options=options)).program
        return self._programs[options]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}dev")
def compiled(request) -> Iterator[CompiledSteps]:
    with StepDumper(request.param) as dumper:
        yield CompiledSteps(dumper)


def padded_bytes(numels: Tuple[int, ...], world: int, element_bytes: int = FLOAT_BYTES) -> int:
    """Full parameters of one unit, each padded to a multiple of ``world`` elements."""
    return element_bytes * sum(-(-n // world) * world for n in numels)


def gathered_bytes(world: int, element_bytes: int = FLOAT_BYTES) -> int:
    """The root once (it keeps its parameters for backward), every block twice."""
    return padded_bytes(ROOT_PARAMS, world, element_bytes) + 2 * BLOCKS * padded_bytes(
        BLOCK_PARAMS, world, element_bytes
    )


def reduced_bytes(world: int, element_bytes: int = FLOAT_BYTES) -> int:
    """Every unit's gradient shard, once."""
    return (
        padded_bytes(ROOT_PARAMS, world, element_bytes) + BLOCKS * padded_bytes(BLOCK_PARAMS, world, element_bytes)
    ) // world


def test_per_parameter_program_without_the_options(compiled: CompiledSteps) -> None:
    """The baseline: one all-gather per parameter per pass, one reduce-scatter per parameter."""
    program = compiled(())
    assert program.all_gathers.count == 2 * BLOCKS * len(BLOCK_PARAMS) + len(ROOT_PARAMS)
    assert program.all_gathers.result_bytes == gathered_bytes(compiled.world)
    assert program.reduce_scatters.count == BLOCKS * len(BLOCK_PARAMS) + len(ROOT_PARAMS)
    assert program.reduce_scatters.result_bytes == reduced_bytes(compiled.world)


def test_coalescing_gathers_each_unit_once_per_pass(compiled: CompiledSteps) -> None:
    program = compiled(COALESCE)
    assert program.all_gathers.count == 2 * BLOCKS + 1
    assert program.all_gathers.result_bytes == gathered_bytes(compiled.world)
    assert program.reduce_scatters == compiled(()).reduce_scatters
    assert program.all_reduces.count == 0


def test_bucket_above_a_units_gradients_reduces_each_unit_once(compiled: CompiledSteps) -> None:
    for options in (BUCKET_1MB, BUCKET_1MB + COALESCE):
        program = compiled(options)
        assert program.reduce_scatters.count == BLOCKS + 1
        assert program.reduce_scatters.result_bytes == reduced_bytes(compiled.world)
    assert compiled(BUCKET_1MB).all_gathers == compiled(()).all_gathers
    assert compiled(BUCKET_1MB + COALESCE).all_gathers == compiled(COALESCE).all_gathers


def test_bucket_is_reduced_once_it_holds_more_than_its_limit(compiled: CompiledSteps) -> None:
    """16 KiB, one weight's gradient: whatever order a block's gradients come in, a weight alone
    never fills it and a weight with any other group does, so each block makes two buckets; the
    root's two small groups make one."""
    program = compiled(BUCKET_16KB)
    assert program.reduce_scatters.count == 2 * BLOCKS + 1
    assert program.reduce_scatters.result_bytes == reduced_bytes(compiled.world)


def test_coalesced_gathers_are_still_ordered(compiled: CompiledSteps) -> None:
    """The barriers and, on XLA:CPU, ``_xla.order_after`` tie a coalesced gather to its unit's
    inputs as they tie separate gathers: no gathered block is live at the peak of the program.
    Without them the scheduler issues the gathers blocks ahead of their use, and the same
    program holds more than two blocks' full parameters at its peak."""
    ordered, unordered = compiled(COALESCE), compiled(COALESCE + NO_BARRIERS)
    two_blocks = padded_bytes(ROOT_PARAMS, compiled.world) + 2 * padded_bytes(BLOCK_PARAMS, compiled.world)
    assert ordered.opt_barriers_traced > 0
    assert ordered.peak_gathered_bytes <= two_blocks < unordered.peak_gathered_bytes
    assert ordered.total_bytes < unordered.total_bytes


@pytest.mark.parametrize("precision", [BF16, BF16_FP32_REDUCE], ids=["bf16-reduce", "fp32-reduce"])
def test_mixed_precision_with_both_options(compiled: CompiledSteps, precision: Options) -> None:
    """bf16 compute: the coalesced gathers move bf16, and the buckets reduce in the dtype asked
    for (read from the traced program: XLA:CPU widens a bf16 reduce-scatter to f32)."""
    program = compiled(precision + COALESCE + BUCKET_1MB)
    reduce_bytes = 4 if precision == BF16_FP32_REDUCE else 2
    assert program.all_gathers.count == 2 * BLOCKS + 1
    assert program.all_gathers.result_bytes == gathered_bytes(compiled.world, element_bytes=2)
    assert program.reduce_scatters_traced.count == BLOCKS + 1
    assert program.reduce_scatters_traced.result_bytes == reduced_bytes(compiled.world, element_bytes=reduce_bytes)


# ---------------------------------------------------------------------------------------------
# Bucketed reductions are exact


def assert_traces_equal(got: List[Any], want: List[Any]) -> None:
    for g, w in zip(got, want):
        assert torch.equal(torch.stack(g.losses), torch.stack(w.losses))
        assert sorted(g.state) == sorted(w.state)
        for name in w.state:
            assert torch.equal(g.state[name], w.state[name]), name


@pytest.mark.parametrize(
    "world, base",
    [(2, ()), (4, ()), (2, BF16 + COALESCE), (2, BF16_FP32_REDUCE + COALESCE)],
    ids=["fp32-2dev", "fp32-4dev", "bf16-coalesced-2dev", "bf16-fp32-reduce-coalesced-2dev"],
)
def test_bucketed_llama_equals_unbucketed_exactly(pools, world: int, base: Options) -> None:
    """The tiny Llama, per-parameter shards, several buckets per unit, 3 SGD steps; bf16 with
    coalesced gathers on both sides."""
    unbucketed = pools[world].run(train_fsdp, world, Case("llama", base))
    bucketed = pools[world].run(train_fsdp, world, Case("llama", base + SMALL_BUCKETS))
    assert_traces_equal(bucketed, unbucketed)


def train_with_no_sync(
    rank: int, world: int, options: Options
) -> Tuple[List[torch.Tensor], Dict[str, torch.Tensor], List[bool]]:
    """Two micro-batches per step, the first under ``no_sync``; SGD, 2 steps. Also returns, per
    step, whether any shard had a gradient after the ``no_sync`` backward (it must not)."""
    model = wrap("llama", build("llama"), rank, world, dict(options))
    optimizer = make_optimizer("sgd", model.parameters())
    dev, losses, reduced_early = _xla.device(), [], []
    for step in range(2):
        step_loss = torch.zeros((), device=dev)
        for micro in range(2):
            x, y = (t.to(dev) for t in local_slice(global_batch("llama", step, micro, world), rank))
            if micro == 0:
                with model.no_sync():
                    loss = compute_loss("llama", model, x, y) / 2
                    loss.backward()
                reduced_early.append(any(p.grad is not None for p in model.parameters()))
            else:
                loss = compute_loss("llama", model, x, y) / 2
                loss.backward()
            step_loss = step_loss + loss.detach()
        optimizer.step()
        optimizer.zero_grad()
        _xla.sync()
        losses.append(step_loss)
    return losses, model.full_state_dict(), reduced_early


def test_no_sync_reduces_nothing_then_the_sum(pools) -> None:
    """Under ``no_sync`` no bucket takes anything; the next backward reduces the accumulated
    gradients, in buckets exactly as without, and matches the plain model's accumulation."""
    world = 2
    unbucketed = pools[world].run(train_with_no_sync, world, COALESCE)
    bucketed = pools[world].run(train_with_no_sync, world, COALESCE + SMALL_BUCKETS)
    for (losses, state, early), (want_losses, want_state, _) in zip(bucketed, unbucketed):
        assert early == [False, False]
        assert torch.equal(torch.stack(losses), torch.stack(want_losses))
        for name in want_state:
            assert torch.equal(state[name], want_state[name]), name
    reference = train_reference(world, Case("llama", steps=2, accumulation=2))
    mean_losses = torch.stack([torch.stack(r[0]) for r in bucketed]).mean(0)
    torch.testing.assert_close(mean_losses, torch.stack(reference.losses), rtol=1e-5, atol=1e-6)
    for name, want in reference.state.items():
        torch.testing.assert_close(bucketed[0][1][name], want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


class SpareBlock(ResidualBlock):
    """A block with a parameter its forward never uses: it gets no gradient."""

    def __init__(self, width: int) -> None:
        super().__init__(width)
        self.spare = nn.Linear(width, width)


def grads_with_a_spare_parameter(rank: int, world: int, options: Options) -> Dict[str, Optional[torch.Tensor]]:
    """Every shard's gradient after one backward of blocks that each hold an unused Linear."""
    with seeded(0):
        model = nn.Sequential(*(SpareBlock(WIDTH) for _ in range(2)), nn.Linear(WIDTH, 1))
    for i in range(2):
        model[i] = FSDP(model[i], **dict(options))
    wrapped = FSDP(model, **dict(options))
    with seeded(1):
        x = torch.randn(LOCAL_BATCH, WIDTH)
    wrapped(x.to(_xla.device())).square().mean().backward()
    _xla.sync()  # one program for the step: a .cpu() of each pending gradient compiles one each
    return {n: None if p.grad is None else p.grad.detach().cpu() for n, p in wrapped.named_parameters()}


@pytest.mark.parametrize("layout", [(), (("flatten_parameters", True),)], ids=["per-parameter", "flat"])
@pytest.mark.parametrize("bucket", [BUCKET_1MB, BUCKET_16KB], ids=["1MB", "16KB"])
def test_parameter_without_gradient(pools, layout: Options, bucket: Options) -> None:
    """A unit whose parameter gets no gradient never has all its groups in: its bucket is reduced
    after the backward, exactly as the unbucketed groups are. Per parameter, the unused one has no
    shard gradient; flat, the unit's one group is reduced with zeros in the unused part."""
    world = 2
    unbucketed = pools[world].run(grads_with_a_spare_parameter, world, layout)
    bucketed = pools[world].run(grads_with_a_spare_parameter, world, layout + bucket)
    for got, want in zip(bucketed, unbucketed):
        assert sorted(got) == sorted(want)
        for name, grad in want.items():
            if grad is None:
                assert got[name] is None and "spare" in name, name
            else:
                assert torch.equal(got[name], grad), name
        assert sum(g is not None for g in got.values()) == (3 if layout else 2 * 4 + 2)
