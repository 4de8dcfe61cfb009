"""Memory, read from the compiled program: what sharding, the patched Linear and checkpointing save.

Every figure is the compiler's (XLA:CPU, torch_xla 2.9): ``Total bytes used`` of the training
step's program per device (its parameters, its outputs and the peak of its temporaries), and the
optimized HLO. They are deterministic, so the tests assert them exactly as well as the bounds
they stand for: a change in the engine or the compiler shows as a changed figure.

* Sharding: 8 blocks of two 128x128 Linear, each block its own unit, AdamW, two rows per device,
  so that parameters, gradients and Adam state dominate. ``ideal_bytes`` (scripts/hlo_dump.py) is the
  bound: the states divided by N, plus the activations of the unsharded step, plus one unit's
  full parameters and gradients. At 4 devices: unflattened 0.687x the ideal and 0.304 of 1
  device, flattened 0.816x and 0.354. (Before the engine tied each gather to its unit's input on
  XLA:CPU, ``_xla.order_after``, flattened 4 devices were at 1.226x and 0.530: gathers ran two
  blocks ahead.)
* The patched Linear: autograd's own linear saves ``weight.t()``, the weight gathered in forward,
  for backward; the patched one saves the weight parameter, whose data is by then the weight
  gathered again for backward. Without the patch the blocks' gathered weights live from forward
  to backward, and the backward all-gathers are still issued (torch_xla's token keeps them) but
  nothing reads their results.
* Checkpointing: each checkpointed block's tanh and first matmul run again after backward has
  begun, and its tanh output is not kept from forward to backward.
* The update in place: a steady step whose outputs are written in the order of their donated
  buffers (as XlaFsdpOptimizer writes them) copies none of its shards and AdamW moments; left as
  torch writes them, XLA:CPU copies nearly all (per parameter 103 of 108, flat 24 of 27), and
  the program takes 14% more bytes (per parameter 1,232,407 against 1,077,295).

Two device processes (2 and 4 devices); "1 device" runs in the 2-device process (see section 1).
Each configuration is compiled once, in the background from the start, so both processes compile
at once.
"""

from __future__ import annotations

import functools
import re
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Dict, Iterator, List

import pytest
import torch
import torch.nn as nn
from hlo_dump import OPTIMIZED, StepDumper, StepReport, TrainingStep, ideal_bytes
from models import ResidualBlock

from accel_xla_fsdp import XlaFullyShardedDataParallel as FSDP
from accel_xla_fsdp import _xla, checkpoint_module, seeded

FLOAT_BYTES = 4

# Parameters, gradients and Adam state dominate: 8 blocks of two 128x128 Linear, 2 rows per device.
BLOCKS, WIDTH, BATCH = 8, 128, 2
WEIGHT_BYTES = WIDTH * WIDTH * FLOAT_BYTES  # one gathered full weight
# Activations dominate: 4 blocks of two 64x64 Linear, 512 rows per device.
CKPT_BLOCKS, CKPT_WIDTH, CKPT_BATCH = 4, 64, 512


class Stack(nn.Module):
    """A stem (owned by the root unit, so that the blocks' inputs require gradients), the blocks,
    a head."""

    def __init__(self, blocks: int, width: int, stem: bool, vocab: int = 0) -> None:
        super().__init__()
        # with a vocabulary, a language model's ends: an embedding, and a head to logits
        self.stem: nn.Module = nn.Linear(width, width) if stem else nn.Identity()
        if vocab:
            self.stem = nn.Embedding(vocab, width, padding_idx=3)
        self.blocks = nn.Sequential(*(ResidualBlock(width) for _ in range(blocks)))
        self.head = nn.Linear(width, vocab or 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)))


@dataclass(frozen=True)
class Config:
    blocks: int = BLOCKS
    width: int = WIDTH
    batch: int = BATCH
    optimizer: str = "adamw"
    sharded: bool = True  # False: the plain model on one device, for the ideal
    flatten: bool = False
    patched_linear: bool = True
    checkpoint: bool = False
    stem: bool = True
    alone: bool = False  # every replica its own sharding group of one: FSDP on one device
    steady: bool = False  # a step with AdamW's state present (a first step runs before it)
    donation_order: bool = False  # outputs written again in donation order, as XlaFsdpOptimizer does
    vocab: int = 0  # the stem an nn.Embedding of this many rows, fed ids
    user_embedding: bool = False  # that embedding's forward a user's F.embedding: not patched


STATE_HEAVY = Config()
ACTIVATION_HEAVY = Config(blocks=CKPT_BLOCKS, width=CKPT_WIDTH, batch=CKPT_BATCH, optimizer="sgd")
CHECKPOINTED = replace(ACTIVATION_HEAVY, checkpoint=True)


def build(rank: int, world: int, config: Config) -> TrainingStep:
    """Every block its own unit (checkpointed if asked), then the root; this replica's batch of ones."""
    with seeded(0):
        model = Stack(config.blocks, config.width, config.stem, config.vocab)
    if config.user_embedding:
        embed = model.stem
        embed.forward = lambda ids: nn.functional.embedding(ids, embed.weight, embed.padding_idx)  # type: ignore[method-assign]
    if config.sharded:
        kwargs = dict(flatten_parameters=config.flatten, _use_xla_patched_linear=config.patched_linear)
        if config.alone:
            kwargs.update(sharding_groups=[[r] for r in range(world)], sharding_rank=0, sharding_world_size=1)
        for i, block in enumerate(model.blocks):
            model.blocks[i] = FSDP(checkpoint_module(block) if config.checkpoint else block, **kwargs)
        model = FSDP(model, **kwargs)
    else:
        model = model.to(_xla.device())
    params = model.parameters()
    if config.optimizer == "adamw":
        optimizer = torch.optim.AdamW(params, lr=1e-3)
    else:
        optimizer = torch.optim.SGD(params, lr=0.1)
    x = torch.ones(config.batch, config.width)
    if config.vocab:  # ids, repeated
        x = torch.arange(config.batch * config.width).reshape(config.batch, config.width) % 7 + rank
    return TrainingStep(model, optimizer, lambda: model(x.to(_xla.device())).square().mean())


# ---------------------------------------------------------------------------------------------
# The optimized HLO, instruction by instruction


@dataclass(frozen=True)
class Instruction:
    name: str
    shape: str
    opcode: str
    operands: List[str]
    calls: List[str]  # computations it calls (fusions, reductions, parallel calls)


_HEADER = re.compile(r"^(?:ENTRY )?%?(?P<name>[^\s(]+) .*\{$")
_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[^\s=]+) = (?P<shape>.*?) (?P<opcode>[a-z][a-z0-9-]*)\((?P<rest>.*)$")
_CALLED = re.compile(r"(?:calls|to_apply)=%?([\w.\-]+)")


@dataclass
class Program:
    """The optimized HLO of a step: its computations, the entry one in schedule order."""

    entry: List[Instruction]
    computations: Dict[str, List[Instruction]]

    @classmethod
    def parse(cls, text: str) -> Program:
        computations: Dict[str, List[Instruction]] = {}
        entry_name, current = None, None
        for line in text.splitlines():
            header = _HEADER.match(line)
            if header:
                current = computations.setdefault(header["name"], [])
                if line.startswith("ENTRY"):
                    entry_name = header["name"]
                continue
            m = _LINE.match(line)
            if m and current is not None:
                args, _, attributes = _split_operands(m["rest"])
                operands = [a.split()[-1].lstrip("%") for a in re.sub(r"/\*.*?\*/", "", args).split(",") if a.strip()]
                current.append(Instruction(m["name"], m["shape"], m["opcode"], operands, _CALLED.findall(attributes)))
        return cls(computations[entry_name], computations)

    def computes(self, inst: Instruction, opcode: str) -> bool:
        """Whether ``inst`` is, or calls a computation that contains, an ``opcode``."""
        return inst.opcode == opcode or any(
            self.computes(i, opcode) for c in inst.calls for i in self.computations.get(c, [])
        )

    def users(self, name: str) -> List[Instruction]:
        return [i for i in self.entry if name in i.operands]


def _split_operands(rest: str) -> tuple:
    """``a, b), attr=...`` -> (``a, b``, ``)``, ``attr=...``), at the parenthesis closing the call."""
    depth = 0
    for i, ch in enumerate(rest):
        if ch == "(":
            depth += 1
        elif ch == ")":
            if depth == 0:
                return rest[:i], ")", rest[i + 1 :]
            depth -= 1
    return rest, "", ""


def is_scalar(shape: str) -> bool:
    return re.match(r"^[a-z0-9]+\[\]", shape) is not None


# ---------------------------------------------------------------------------------------------
# Compiling


class CompiledSteps:
    """One device process of ``world`` devices; each configuration's step compiled once in it, in
    the background, in the order asked (``prefetch``), so that two processes compile at once."""

    def __init__(self, world: int) -> None:
        self.world = world
        self._dumper = StepDumper(world)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"compile-{world}dev")
        self._reports: Dict[Config, Future] = {}
        self._programs: Dict[Config, Program] = {}

    def prefetch(self, *configs: Config) -> None:
        for config in configs:
            if config not in self._reports:
                self._reports[config] = self._worker.submit(
                    self._dumper.report,
                    functools.partial(build, config=config),
                    steady=config.steady,
                    donation_order=config.donation_order,
                )

    def __call__(self, config: Config) -> StepReport:
        self.prefetch(config)
        return self._reports[config].result()

    def hlo(self, config: Config) -> Program:
        if config not in self._programs:
            module = self(config).program.module
            self._programs[config] = Program.parse((self._dumper.dump_dir / f"{module}.{OPTIMIZED}").read_text())
        return self._programs[config]

    def close(self) -> None:
        self._worker.shutdown(cancel_futures=True)
        self._dumper.close()


def total(report: StepReport) -> int:
    return report.program.total_bytes


# ---------------------------------------------------------------------------------------------
# 1. Bytes per device fall with the number of devices as sharding says
#
# "1 device" is measured in the 2-device process: the plain model (for the ideal), and FSDP with
# every replica its own sharding group of one. Neither has a collective, so each replica's
# program is the one a 1-device process compiles (measured in a 1-device process: the same
# 3,504,244, 3,503,732 and 3,521,136 bytes), and a third process (~10 s to start) is saved.

UNSHARDED = replace(STATE_HEAVY, sharded=False)
LAYOUTS = {"per_param": False, "flat": True}


def state_heavy(layout: str, devices: int) -> Config:
    return replace(STATE_HEAVY, flatten=LAYOUTS[layout], alone=devices == 1)


@pytest.fixture(scope="module")
def steps() -> Iterator[Dict[int, CompiledSteps]]:
    """Device processes of 2 and 4 devices, compiling every configuration below from the start."""
    made = {n: CompiledSteps(n) for n in (2, 4)}
    made[1] = made[2]  # see "1 device" above
    made[2].prefetch(
        UNSHARDED, *(state_heavy(layout, n) for layout in LAYOUTS for n in (1, 2)), ACTIVATION_HEAVY, CHECKPOINTED
    )
    made[4].prefetch(
        *(state_heavy(layout, 4) for layout in LAYOUTS),
        *(replace(state_heavy(layout, 4), patched_linear=False) for layout in LAYOUTS),
        replace(CHECKPOINTED, stem=False),
        *(steady(layout, d) for layout in LAYOUTS for d in (False, True)),
        *(replace(EMBEDDING_STEM, user_embedding=u) for u in (True, False)),
    )
    yield made
    for n in (2, 4):
        made[n].close()


# Measured, per device.
EXPECTED_TOTAL = {
    "unsharded": 3_504_244,
    ("per_param", 1): 3_503_843,
    ("per_param", 2): 1_918_355,
    ("per_param", 4): 1_059_347,
    ("flat", 1): 3_505_247,
    ("flat", 2): 1_953_223,
    ("flat", 4): 1_273_163,
}
EXPECTED_IDEAL = {2: 2_645_104, 4: 1_521_772}


def test_state_heavy_bytes_are_as_measured(steps: Dict[int, CompiledSteps]) -> None:
    unsharded = steps[1](UNSHARDED)
    measured = {
        key: total(unsharded if key == "unsharded" else steps[key[1]](state_heavy(*key))) for key in EXPECTED_TOTAL
    }
    ideal = {n: ideal_bytes(steps[n](state_heavy("per_param", n)), unsharded) for n in EXPECTED_IDEAL}
    assert (measured, ideal) == (EXPECTED_TOTAL, EXPECTED_IDEAL)


@pytest.mark.parametrize(
    "layout, devices",
    [
        ("per_param", 2),
        ("per_param", 4),
        ("flat", 2),
        ("flat", 4),
    ],
)
def test_bytes_per_device_within_110_percent_of_ideal(
    steps: Dict[int, CompiledSteps], layout: str, devices: int
) -> None:
    report = steps[devices](state_heavy(layout, devices))
    ideal = ideal_bytes(report, steps[1](UNSHARDED))
    assert total(report) <= 1.10 * ideal, f"{total(report):,} bytes, {total(report) / ideal:.3f}x the ideal {ideal:,}"
    assert total(report) < total(steps[devices // 2](state_heavy(layout, devices // 2)))


@pytest.mark.parametrize(
    "layout",
    ["per_param", "flat"],
)
def test_four_devices_use_at_most_40_percent_of_one(steps: Dict[int, CompiledSteps], layout: str) -> None:
    one, four = total(steps[1](state_heavy(layout, 1))), total(steps[4](state_heavy(layout, 4)))
    assert four <= 0.40 * one, f"4 devices: {four:,} bytes, {four / one:.3f} of 1 device's {one:,}"


# ---------------------------------------------------------------------------------------------
# 2. The patched Linear

EXPECTED_PATCH = {  # layout -> (patched, unpatched) bytes at 4 devices
    "per_param": (1_059_347, 1_975_955),
    "flat": (1_273_163, 2_190_731),
}


def weight_gathers(program: Program, flatten: bool, world: int) -> List[Instruction]:
    """The all-gathers of the blocks' weights (per parameter) or of whole blocks (flat)."""
    block_numel = 2 * (WIDTH * WIDTH + WIDTH)
    numel = -(-block_numel // world) * world if flatten else WIDTH * WIDTH
    return [i for i in program.entry if i.opcode == "all-gather" and i.shape.startswith(f"f32[{numel}]")]


def read_gathers(program: Program, gathers: List[Instruction]) -> int:
    """How many of ``gathers`` something reads, besides torch_xla's token (a scalar: token * x[0])."""
    return sum(any(not is_scalar(u.shape) for u in program.users(g.name)) for g in gathers)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_patched_linear_frees_full_weights_between_forward_and_backward(
    steps: Dict[int, CompiledSteps], layout: str
) -> None:
    compiled = steps[4]
    on = compiled(state_heavy(layout, 4))
    off = compiled(replace(state_heavy(layout, 4), patched_linear=False))
    # Without the patch, at least half of the blocks' gathered weights live from forward to backward
    # (measured: 14 weights' worth per parameter, 10 flattened).
    assert total(off) - total(on) >= BLOCKS * WEIGHT_BYTES, (total(on), total(off))
    assert (total(on), total(off)) == EXPECTED_PATCH[layout]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_patched_linear_backward_reads_the_weights_gathered_for_backward(
    steps: Dict[int, CompiledSteps], layout: str
) -> None:
    """Every block gathers twice (forward, backward) either way; only with the patch does
    backward read its gather. Without it, backward reads the forward's gathered weights."""
    compiled, flatten = steps[4], LAYOUTS[layout]
    # Per parameter, the root's stem weight has a block weight's shape; the root gathers it once.
    per_pass, root = (BLOCKS, 0) if flatten else (2 * BLOCKS, 1)
    for patched, read in ((True, 2 * per_pass + root), (False, per_pass + root)):
        program = compiled.hlo(replace(state_heavy(layout, 4), patched_linear=patched))
        gathers = weight_gathers(program, flatten, compiled.world)
        assert len(gathers) == 2 * per_pass + root
        assert read_gathers(program, gathers) == read, f"patched={patched}"


# ---------------------------------------------------------------------------------------------
# 3. Gradient checkpointing

EXPECTED_CHECKPOINT = {False: 1_587_679, True: 1_194_463}  # checkpointed -> bytes at 2 devices


def forward_ops(program: Program, opcode: str) -> tuple:
    """(how many entry instructions compute ``opcode``, how many of them after the first
    reduce-scatter: in backward)."""
    first_reduce = next(k for k, i in enumerate(program.entry) if i.opcode == "reduce-scatter")
    at = [k for k, i in enumerate(program.entry) if program.computes(i, opcode)]
    return len(at), sum(k > first_reduce for k in at)


def test_checkpointed_forward_runs_again_in_backward(steps: Dict[int, CompiledSteps]) -> None:
    """Each block's tanh and its first matmul run again after backward has begun (the second
    matmul's output is not needed for backward, so the compiler drops its recomputation)."""
    plain, checkpointed = steps[2].hlo(ACTIVATION_HEAVY), steps[2].hlo(CHECKPOINTED)
    assert forward_ops(plain, "tanh") == (CKPT_BLOCKS, 0)
    assert forward_ops(checkpointed, "tanh") == (2 * CKPT_BLOCKS, CKPT_BLOCKS)
    assert forward_ops(checkpointed, "dot")[0] - forward_ops(plain, "dot")[0] == CKPT_BLOCKS


def test_checkpointing_lowers_the_bytes(steps: Dict[int, CompiledSteps]) -> None:
    plain, checkpointed = total(steps[2](ACTIVATION_HEAVY)), total(steps[2](CHECKPOINTED))
    activation = CKPT_BATCH * CKPT_WIDTH * FLOAT_BYTES  # one block's tanh output, not kept
    assert plain - checkpointed >= (CKPT_BLOCKS - 1) * activation, (plain, checkpointed)
    assert {False: plain, True: checkpointed} == EXPECTED_CHECKPOINT


def test_checkpointed_blocks_get_gradients_when_the_input_needs_none(steps: Dict[int, CompiledSteps]) -> None:
    report = steps[4](replace(CHECKPOINTED, stem=False))
    assert report.program.reduce_scatters.count == 4 * CKPT_BLOCKS + 2


# ---------------------------------------------------------------------------------------------
# 4. The update in place
#
# A steady step (AdamW's state present) donates every shard, exp_avg and exp_avg_sq to its own
# update, but XLA pairs donated buffers with outputs by size and order alone ([Note: donation
# order], accel_xla_fsdp/_xla.py): left as torch writes them, most buffers go to another tensor's
# output and XLA:CPU copies them at the program's start. XlaFsdpOptimizer writes the outputs again
# in the donors' order, which the harness does here with ``donation_order``.

EXPECTED_STEADY = {  # layout -> ((bytes, copies of parameters) as written, in donation order), 4 devices
    "per_param": ((1_232_407, 103), (1_077_295, 2)),
    "flat": ((1_466_315, 24), (1_258_659, 0)),
}


def steady(layout: str, donation_order: bool) -> Config:
    return replace(state_heavy(layout, 4), steady=True, donation_order=donation_order)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_outputs_in_donation_order_update_in_place(steps: Dict[int, CompiledSteps], layout: str) -> None:
    plain, ordered = (steps[4](steady(layout, d)).program for d in (False, True))
    shards = BLOCKS + 1 if layout == "flat" else 4 * BLOCKS + 4  # the root: stem and head
    assert plain.parameter_copies >= 0.8 * 3 * shards, plain.parameter_copies  # of shards, exp_avg, exp_avg_sq
    assert ordered.parameter_copies <= 2, ordered.parameter_copies  # 2: per parameter, the head's 1-element bias
    assert ordered.total_bytes <= 0.9 * plain.total_bytes, (plain.total_bytes, ordered.total_bytes)
    measured = tuple((p.total_bytes, p.parameter_copies) for p in (plain, ordered))
    assert measured == EXPECTED_STEADY[layout]


# ---------------------------------------------------------------------------------------------
# 5. The embedding gradient's zeros
#
# The stem an embedding of 4096 rows (2 MiB of fp32, twice the blocks' parameters), in the root.
# Autograd's embedding backward scatter-adds into zeros that depend on nothing, and XLA:CPU makes
# them at the program's start; the engine's patched embedding (accel_xla_fsdp/embedding.py) makes
# them from the incoming gradient ([Note: the embedding gradient's zeros]).

EMBEDDING_STEM = replace(STATE_HEAVY, vocab=4096)
EMBEDDING_BYTES = 4096 * WIDTH * FLOAT_BYTES
EXPECTED_EMBEDDING = {"autograd's": 22_585_287, "patched": 20_488_141}  # bytes per device, 4 devices


def test_embedding_gradient_zeros_are_not_made_at_the_start(steps: Dict[int, CompiledSteps]) -> None:
    stock, patched = (total(steps[4](replace(EMBEDDING_STEM, user_embedding=u))) for u in (True, False))
    assert stock - patched >= 0.99 * EMBEDDING_BYTES, (stock, patched)  # the zeros, at the peak
    assert {"autograd's": stock, "patched": patched} == EXPECTED_EMBEDDING


def embedding_gradients(rank: int, world: int, user_embedding: bool) -> Dict[str, torch.Tensor]:
    step = build(rank, world, replace(EMBEDDING_STEM, user_embedding=user_embedding, vocab=40))
    step.loss().backward()
    _xla.sync()  # one program for the step: a .cpu() of each pending gradient compiles one each
    return {n: p.grad.detach().cpu() for n, p in step.model.named_parameters()}


def test_patched_embedding_gradient_is_autograds_bit_for_bit(pools) -> None:
    """Ids repeated (the scatter-add accumulates), every replica its own ids."""
    patched, stock = (pools[2].run(embedding_gradients, 2, u) for u in (False, True))
    for mine, theirs in zip(patched, stock):
        assert sorted(mine) == sorted(theirs)
        for name, grad in theirs.items():
            assert torch.equal(mine[name], grad), name
