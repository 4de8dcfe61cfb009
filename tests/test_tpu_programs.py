"""The TPU programs of the main configurations, compiled by the real TPU compiler (no TPU needed).

A tiny Llama (2 decoder layers, each a unit, inside the root unit: 9 parameters per layer, 3 in
the root; 21 in all; 128 and 256 wide for dim-0 shards) is traced as replica 0 of 4 in the TPU
form (``tests/tpu_programs.py``, one process), and every program is compiled for 4 v4 chips and
4 v5e chips (``accel_xla_fsdp/tpu_compiler.py`` in ``.tpu-venv``, one process: compiles queue on
a lock, one at a time). What the TPU would run is asserted: only all-gathers and reduce-scatters (no
all-reduce: a pinned gather or a 1-D reduce-scatter would be one), as many as FSDP needs, and ring
traffic at the floor (``tpu_program.communication_floor``). The compiler's venv is made when
missing (``scripts/ensure_tpu_venv.sh``); if it cannot be, the tests fail saying what to install.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOPOLOGIES = ("v4-8", "v5e-4")  # 4 chips each: one export serves both
WORLD = 4
LAYER, ROOT_PARAMS, LAYERS = 9, 3, 2
PARAMS = LAYERS * LAYER + ROOT_PARAMS
TOKENS = 2 * 16  # tpu_programs.py's batch x sequence

# name -> (all-gathers, reduce-scatters). Every layer's parameter is gathered in forward and again
# in backward (a checkpointed layer's recomputation uses its backward gather), the root's once
# (disable_reshard_on_root); every trainable gradient is reduce-scattered once per step.
EXPECTED: Dict[str, Tuple[int, int]] = {
    "per_parameter": (2 * LAYERS * LAYER + ROOT_PARAMS, PARAMS),
    "flat": (2 * LAYERS + 1, LAYERS + 1),  # one flat group per unit
    "nested": (2 * LAYERS * LAYER + ROOT_PARAMS, PARAMS),  # each MLP a unit inside its layer's
    "bf16": (2 * LAYERS * LAYER + ROOT_PARAMS, PARAMS),
    "checkpointed": (2 * LAYERS * LAYER + ROOT_PARAMS, PARAMS),
    "frozen": (2 * LAYERS * LAYER + ROOT_PARAMS, PARAMS - 1),  # the embedding is frozen
    "dim0": (2 * LAYERS * LAYER + ROOT_PARAMS, PARAMS),  # 2-D gradients reduce-scattered as they are
    # a vocabulary of 16384: the embedding's and lm_head's gradients two chunks each
    "lm_head_in_backward": (2 * LAYERS * LAYER + ROOT_PARAMS, PARAMS + 2),
    "lm_head_by_autograd": (2 * LAYERS * LAYER + ROOT_PARAMS, PARAMS + 2),
    # "vocabulary_sharded": below the floor (test_vocabulary_tables_are_never_whole)
    "no_sync": (2 * (2 * LAYERS * LAYER + ROOT_PARAMS), PARAMS),  # two micro-batches, one reduce
    "eval": (PARAMS, 0),  # a forward under no_grad
}


def _run(cmd, what: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "CPU_NUM_DEVICES"}  # traced on one device
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        pytest.fail(f"{what} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done.stdout


@pytest.fixture(scope="module")
def tpu_python() -> Path:
    """The compiler's venv, made when missing; a failure says what to install, never skips."""
    done = subprocess.run(["bash", "scripts/ensure_tpu_venv.sh"], cwd=ROOT, capture_output=True, text=True)
    python = ROOT / ".tpu-venv" / "bin" / "python"
    if done.returncode != 0 or not python.exists():
        pytest.fail(
            "the TPU compiler is missing and could not be installed: run `bash scripts/ensure_tpu_venv.sh` "
            "(a venv .tpu-venv with pip install 'jax[tpu]==0.10.2', 1.3 GB; network access to PyPI needed)\n"
            + done.stderr[-2000:]
        )
    return python


@pytest.fixture(scope="module")
def compiled(tpu_python: Path, tmp_path_factory) -> Dict[Tuple[str, str], dict]:
    """(configuration, topology) -> the compiler's report, with the configuration's floor."""
    out = tmp_path_factory.mktemp("tpu_programs")
    _run([sys.executable, "tests/tpu_programs.py", str(out), str(WORLD)], "exporting the TPU programs")
    manifest = json.loads((out / "manifest.json").read_text())
    programs = [str(out / f"{name}.hlo") for name in manifest]
    topologies = [arg for t in TOPOLOGIES for arg in ("--topology", t)]
    optimized = out / "optimized"
    cmd = [
        str(tpu_python),
        "accel_xla_fsdp/tpu_compiler.py",
        *programs,
        *topologies,
        "--json",
        "--hlo-out",
        str(optimized),
    ]
    stdout = _run(cmd, "compiling")
    reports = {}
    for n, line in enumerate(stdout.splitlines()):  # one line per compile, in the order of --hlo-out's files
        report = json.loads(line)
        name = Path(report["program"]).stem
        reports[name, report["topology"]] = {**report, **manifest[name], "optimized": f"{optimized}.{n}.txt"}
    return reports


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("name", list(EXPECTED))
def test_collectives_at_the_floor(compiled, name: str, topology: str) -> None:
    report = compiled[name, topology]
    kinds = {kind: c["count"] for kind, c in report["collectives"].items()}
    gathers, reduce_scatters = EXPECTED[name]
    assert kinds == {"all-gather": gathers, **({"reduce-scatter": reduce_scatters} if reduce_scatters else {})}
    assert report["floor"] <= report["ring_bytes"] <= 1.05 * report["floor"]


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("name", ["reduce_scatter_bf16", "reduce_scatter_f32"])
def test_large_gradients_stay_reduce_scatters(compiled, name: str, topology: str) -> None:
    """Gradients whose parts per chip are above the compiler's piece of 228 tiles (4 chips) and
    not divisible into pieces ([Note: TPU reduce-scatter shapes]): chunked, each chunk at most
    128 tiles per chip, every chunk stays a reduce-scatter and the traffic is at the floor (the
    12 MiB chunks of before made each an all-reduce and a collective-permute)."""
    report = compiled[name, topology]
    kinds = {kind: c["count"] for kind, c in report["collectives"].items()}
    assert kinds == {"reduce-scatter": 2 if name == "reduce_scatter_bf16" else 4}
    assert report["ring_bytes"] == pytest.approx(report["floor"])


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_bf16_moves_half_the_bytes(compiled, topology: str) -> None:
    f32, bf16 = compiled["per_parameter", topology], compiled["bf16", topology]
    for kind in ("all-gather", "reduce-scatter"):
        assert bf16["collectives"][kind]["bytes"] * 2 == f32["collectives"][kind]["bytes"]


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_step_donates_parameters_and_optimizer_state(compiled, topology: str) -> None:
    """A step's parameters and AdamW moments alias their outputs (as a real sync donates them):
    the compiler then counts them once, not as argument and output."""
    step = compiled["per_parameter", topology]
    assert step["aliased"] == 3 * PARAMS
    assert step["alias"] > 0
    assert step["output"] - step["alias"] < 4096  # what is not donated: the loss
    assert "alias" not in compiled["eval", topology] or compiled["eval", topology]["alias"] == 0


def _entry(optimized: str) -> List[str]:
    """The lines of the compiled step's entry computation, in the order of its schedule."""
    return optimized[optimized.index("\nENTRY ") :].split("\n}", 1)[0].splitlines()[1:]


@pytest.mark.parametrize("name", ["per_parameter", "bf16", "checkpointed", "dim0", "vocabulary_sharded"])
def test_updates_need_not_wait_for_the_last_gradient(compiled, name: str) -> None:
    """No barrier holds every gradient to the end of backward (``RootState._finalize_backward``),
    so the compiler updates a unit's parameters once its gradients are reduced, before the step's
    last reduce-scatter, and frees them (SPMD FSDPv2's program does the same; with the barrier,
    torch_xla FSDP's, Llama-3.1-8B on v5p-8 held 3.4 GiB more, docs/tpu.md). On v5e; the v4
    compiler leaves some of this tiny model's updates at the end where nothing presses it."""
    updates, reduces = _update_and_reduce_positions(Path(compiled[name, "v5e-4"]["optimized"]).read_text())
    assert updates[0] < reduces[-1]


def _update_and_reduce_positions(optimized: str) -> Tuple[List[int], List[int]]:
    """In the compiled step's schedule: where each new parameter or AdamW moment is made, and
    where each reduce-scatter is."""
    from accel_xla_fsdp.tpu_compiler import _ARRAY, _INSTRUCTION, _KINDS

    made = {m["name"]: (i, m) for i, m in enumerate(map(_INSTRUCTION.match, _entry(optimized))) if m}
    reduces = sorted(i for i, m in made.values() if _KINDS.get(m["opcode"]) == "reduce-scatter")
    root = next(m for _, m in made.values() if m.string.lstrip().startswith("ROOT"))

    def producer(name: str) -> Tuple[int, str]:
        i, m = made[name]
        if m["opcode"] in ("get-tuple-element", "copy", "copy-done", "bitcast"):
            return producer(re.match(r"%?([\w.\-]+)", m["rest"]).group(1))
        return i, m["opcode"]

    names = re.findall(r"%([\w.\-]+)", root["rest"])
    arrays = [name for name, shape in zip(names, _ARRAY.finditer(root["shape"])) if shape["dims"]]
    updates = sorted(i for i, opcode in map(producer, arrays) if opcode != "parameter")
    return updates, reduces


def _gathers_after_an_update(program: str) -> int:
    """How many of the exported step's all-gathers read, through their operands, a value of an
    optimizer update (AdamW's ``sqrt`` of its second moment, an op no forward or backward of
    the model has: RMSNorm's is ``rsqrt``)."""
    entry = _entry(program)
    operands: Dict[str, List[str]] = {}
    opcodes: Dict[str, str] = {}
    for line in entry:
        m = re.match(r"\s*(?:ROOT )?%(\S+) = .*? ([a-z][\w\-]*)\((.*)$", line)
        if m:
            opcodes[m[1]] = m[2]
            operands[m[1]] = re.findall(r"%([\w.\-]+)", m[3].split(", metadata=")[0])
    after_update: Dict[str, bool] = {}
    for name in opcodes:  # in the program's order: operands come first
        after_update[name] = opcodes[name] == "sqrt" or any(after_update.get(o, False) for o in operands[name])
    return sum(after_update[n] for n, op in opcodes.items() if op == "all-gather")


def test_the_optimizer_in_backward_holds_each_gather_to_the_update_before(compiled) -> None:
    """[Note: the optimizer in backward]: the updated shards pass the barrier before the next
    unit's backward gather, so that gather reads the update, which the compiler must then make
    first; without it no gather does, and the compiler makes the updates at the step's end
    (Qwen2.5-7B, fp32, checkpointed, v5e-8: refused without, 14.17 GiB with it, docs/tpu.md)."""
    in_backward = Path(compiled["optimizer_in_backward", TOPOLOGIES[0]]["program"]).read_text()
    after_backward = Path(compiled["vocabulary_sharded", TOPOLOGIES[0]]["program"]).read_text()
    assert _gathers_after_an_update(after_backward) == 0
    assert _gathers_after_an_update(in_backward) > 0


def _casts_passing_barriers(program: str, to: str, source: str) -> int:
    """How many operands of the traced step's optimization barriers are casts to ``to`` (an HLO
    dtype: f32, bf16) of ``source`` values."""
    defined = {m[1]: line for line in program.splitlines() if (m := re.match(r"\s*(?:ROOT )?%(\S+) = ", line))}
    cast = re.compile(rf"= {to}\[[0-9,]*\]\S* convert\({source}\[")
    casts = 0
    for line in defined.values():
        if " opt-barrier(" in line:
            held = defined[re.findall(r"%([\w.\-]+)", line.split(" opt-barrier(")[1])[-1]]
            operands = re.findall(r"%([\w.\-]+)", held.split(" tuple(")[1])
            casts += sum(bool(cast.search(defined[o])) for o in operands)
    return casts


def test_gradients_pass_barriers_in_the_narrower_dtype(compiled) -> None:
    """Each reduced gradient passes its barrier in the narrower of the reduce and shard dtypes and
    is cast to a wider one after it, so the compiler holds the narrower value until AdamW reads it.
    bf16 compute over f32 shards: in bf16, cast to f32 after the barrier (cast before it, each of
    the 21 gradients until 894a0a5, every finished gradient was held in f32: issue 25's Llama, bf16,
    checkpointed, v5e-8, 223.6 against 220.1 MB per chip, docs/tpu.md). bf16 shards reduced in
    f32: cast to bf16 before it. The traced programs, so one topology's report serves."""
    bf16 = Path(compiled["bf16", TOPOLOGIES[0]]["program"]).read_text()
    assert " opt-barrier(" in bf16  # the check finds what it looks for
    assert _casts_passing_barriers(bf16, "f32", "bf16") == 0
    f32_reduce = Path(compiled["bf16_shards_f32_reduce", TOPOLOGIES[0]]["program"]).read_text()
    assert _casts_passing_barriers(f32_reduce, "bf16", "f32") >= PARAMS


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_per_parameter_shards_take_less_memory_than_flat(compiled, topology: str) -> None:
    """Why the Accelerate plugin picks per-parameter shards on a TPU (docs/tpu.md: on issue 25's
    Llama, 970 against 1,242 MB per chip in fp32): the compiler holds a flat unit's whole buffer
    and relays it out, where it frees each parameter's as the program stops reading it."""
    assert compiled["per_parameter", topology]["peak"] < compiled["flat", topology]["peak"]


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_placeholder_shards_compile_to_the_same_plan(compiled, topology: str) -> None:
    """A model built on meta with placeholder shards (no buffer: how ``plan`` traces any model at
    full depth) compiles to the very plan of the same model with real shards."""
    real, placeholders = compiled["dim0", topology], compiled["dim0_placeholders", topology]
    for figure in ("argument", "output", "alias", "temp", "peak", "ring_bytes", "collectives"):
        assert placeholders[figure] == real[figure], figure


# A product the size of lm_head's full gradient (vocabulary 16384 x hidden 128, or as 4 chips' parts)
# in the optimized HLO: the TPU compiler names a fusion after the convolution (dot) it holds.
_FULL_LM_HEAD_PRODUCT = re.compile(r"^\s*%\S*convolution\S* = f32\[(16384,128|4,4096,128)\]", re.M)


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_lm_head_gradient_is_never_whole(compiled, topology: str) -> None:
    """reduce_scatter_in_linear_backward: lm_head's gradient is made and reduce-scattered chunk by
    chunk, and the compiler keeps it so (without the barrier between chunks it merged them back into
    one product, docs/tpu.md); autograd's program computes it whole."""

    def full_products(name: str) -> int:
        return len(_FULL_LM_HEAD_PRODUCT.findall(Path(compiled[name, topology]["optimized"]).read_text()))

    assert full_products("lm_head_in_backward") == 0
    assert full_products("lm_head_by_autograd") == 1


# lm_head's or the embedding's whole table (vocabulary 16384 x hidden 128), gathered.
_WHOLE_TABLE_GATHER = re.compile(r"^\s*%\S+ = \w+\[16384,128\]\S* all-gather", re.M)


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_vocabulary_tables_are_never_whole(compiled, topology: str) -> None:
    """keep_vocabulary_sharded: lm_head is gathered, multiplied and reduce-scattered in its two
    chunks, forward and backward; the embedding looks up every chip's tokens in each chip's rows
    (an all-gather of the ids, a reduce-scatter of the rows) and gets its gradient from the tokens'
    rows (an all-gather): neither table is ever gathered, nor its gradient made, whole. That moves
    less than FSDP's floor. (Memory is measured on larger models, docs/tpu.md: this one's default
    step fits the chips' on-chip memory, temp 0, where the chunks' take 5.5 MiB of HBM.)"""
    kept, whole = compiled["vocabulary_sharded", topology], compiled["lm_head_by_autograd", topology]
    kinds = {kind: c["count"] for kind, c in kept["collectives"].items()}
    layers = 2 * LAYERS * LAYER  # each gathered in forward and backward
    # the final norm once, lm_head's 2 chunks twice, the embedding's gradient rows
    gathers = layers + 1 + 2 * 2 + 1
    # the layers' and the norm's gradients, lm_head's 2 chunks, the embedding's looked-up rows
    reduce_scatters = LAYERS * LAYER + 1 + 2 + 1
    # the ids' gather (4 x 32 int32), which the compiler makes an all-reduce of 128 zero-padded ids
    assert kept["kept_sharded"] and not whole["kept_sharded"]
    assert kinds == {"all-gather": gathers, "all-reduce": 1, "reduce-scatter": reduce_scatters}
    assert kept["collectives"]["all-reduce"]["bytes"] == 4 * 128
    assert kept["ring_bytes"] < kept["floor"]
    assert kept["ring_bytes"] < whole["ring_bytes"]

    def count(pattern: re.Pattern, name: str) -> int:
        return len(pattern.findall(Path(compiled[name, topology]["optimized"]).read_text()))

    assert count(_FULL_LM_HEAD_PRODUCT, "vocabulary_sharded") == 0
    assert count(_WHOLE_TABLE_GATHER, "vocabulary_sharded") == 0
    assert count(_WHOLE_TABLE_GATHER, "lm_head_by_autograd") == 2  # the check finds what it looks for


def _logits_sized(optimized: str, vocabulary: int) -> List[Tuple[str, List[int]]]:
    """The dtype and dims of each value the size of the logits that the compiled step's entry
    computation makes (its buffers: a fusion's inner values are not; these steps have no loops).
    lm_head's shard and its gradient's chunks are as many elements, but 128 wide (the hidden
    size), and are left out."""
    return [(dtype, dims) for _, dtype, dims in _logits_makers(optimized, vocabulary)]


def _logits_makers(optimized: str, vocabulary: int) -> List[Tuple[str, str, List[int]]]:
    """``_logits_sized``, with the name of the instruction making each."""
    from accel_xla_fsdp.tpu_compiler import _ARRAY, _INSTRUCTION

    sized = []
    for m in filter(None, map(_INSTRUCTION.match, _entry(optimized))):
        for array in _ARRAY.finditer(m["shape"]):
            dims = [int(d) for d in array["dims"].split(",") if d]
            if math.prod(dims) == TOKENS * vocabulary and dims[-1] != 128:
                sized.append((m["name"], array["dtype"], dims))
    return sized


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_bf16_logits_are_not_copied_to_f32(compiled, topology: str) -> None:
    """keep_vocabulary_sharded in bf16, a chip's rows not whole tiles: lm_head's logits are made
    behind a barrier, and the compiler makes no f32 copy of them for the loss's ``logits.float()``
    (without the barrier it fused that cast with the making of the logits, an f32 copy held to the
    loss's backward: Llama-3.2-1B on v6e-8, 0.55 GiB of peak, docs/tpu.md)."""
    optimized = Path(compiled["vocabulary_sharded_bf16", topology]["optimized"]).read_text()
    dtypes = [dtype for dtype, _ in _logits_sized(optimized, 16000)]
    assert "bf16" in dtypes  # the check finds what it looks for
    assert "f32" not in dtypes


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_the_loss_from_lm_heads_chunks_never_makes_the_logits(compiled, topology: str) -> None:
    """lm_loss_in_chunks: the loss and its gradient come from lm_head's chunks, so no value of the
    logits' size is left in the compiled step (the loss from the whole logits has them). Its
    collectives are the kept-sharded step's and two more gathers: lm_head's own forward gathers,
    whose logits nothing reads, stay in the program, chained to the next collective by
    torch_xla's numeric token (docs/tpu.md, "The loss from lm_head's chunks")."""
    chunked, whole = (
        compiled["vocabulary_sharded_loss_in_chunks", topology],
        compiled["vocabulary_sharded_bf16", topology],
    )
    assert _logits_sized(Path(whole["optimized"]).read_text(), 16000)  # the check finds what it looks for
    assert _logits_sized(Path(chunked["optimized"]).read_text(), 16000) == []
    kinds = {kind: c["count"] for kind, c in chunked["collectives"].items()}
    expected = {kind: c["count"] for kind, c in whole["collectives"].items()}
    assert kinds == {**expected, "all-gather": expected["all-gather"] + 2}


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_small_logits_are_written_in_place(compiled, topology: str) -> None:
    """keep_vocabulary_sharded, logits of at most ``IN_PLACE_LOGITS_BYTES`` a chip: each chunk's
    columns are scattered into them, which the compiler does in place, not assigned (a select
    fusion writing a new buffer the logits' size each time). Larger logits, a real model's, are
    assigned (the bf16 step here is traced as one): in place they planned more (docs/tpu.md, "Small
    logits written in place")."""

    def writes(name: str, vocabulary: int) -> List[str]:
        optimized = Path(compiled[name, topology]["optimized"]).read_text()
        makers = [maker for maker, _, _ in _logits_makers(optimized, vocabulary)]
        # fusions are named by their ops: scatter_fusion, pad_select_fusion.8, ...
        return sorted({op for maker in makers for op in ("scatter", "select") if op in maker.split("_")})

    assert writes("vocabulary_sharded", 16384) == ["scatter"]
    assert writes("vocabulary_sharded_bf16", 16000) == ["select"]


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_logits_are_made_as_tokens_by_vocabulary(compiled, topology: str) -> None:
    """keep_vocabulary_sharded, a chip's rows not whole tiles: lm_head writes each chunk's columns
    into the [tokens, vocabulary] logits and takes its gradient's columns from them alike. Built as
    [tokens, chip, row] (4 x 4,000 here), the whole logits and their gradient were each copied
    once more to be laid out (Qwen2.5-7B on v6e-8: 0.34 GiB of peak, docs/tpu.md)."""
    optimized = Path(compiled["vocabulary_sharded_bf16", topology]["optimized"]).read_text()
    sized = _logits_sized(optimized, 16000)
    assert sized  # the check finds what it looks for
    assert [dims for _, dims in sized if dims[-1] != 16000] == []


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_lm_head_takes_each_gradient_chunk_after_the_chunk_before(compiled, topology: str) -> None:
    """keep_vocabulary_sharded, bf16: lm_head's backward takes a chunk's columns of the logits'
    gradient ([tokens, chip, row of the chunk], 32 x 4 x 2,000 here) after the chunk before's
    barrier. Taken before it, the compiler made every chunk's columns as soon as the gradient was
    made and carried them through the barriers, all live at once: a second copy of the gradient
    (issue 25's Llama, bf16, v5e-8: 370.0 against 321.7 MB, docs/tpu.md). Here the second chunk's
    columns were copied for the barrier."""
    from accel_xla_fsdp.tpu_compiler import _INSTRUCTION

    optimized = Path(compiled["vocabulary_sharded_bf16", topology]["optimized"]).read_text()
    chunk = f"[{TOKENS},{WORLD},2000]"
    made = [m for m in map(_INSTRUCTION.match, _entry(optimized)) if m and chunk in m["shape"]]
    assert made  # the check finds what it looks for
    assert [m["name"] for m in made if 'op_name="opt-barrier' in m["rest"]] == []


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_lm_head_gradient_shard_is_written_in_place(compiled, topology: str) -> None:
    """keep_vocabulary_sharded, bf16: lm_head's backward writes each chunk's reduced rows into one
    gradient shard (bf16[4000,128]: 16,000 rows over 4 chips) as they arrive, a slice assignment
    (traced as a select). Made as torch.cat of the chunks, the compiler held every chunk apart
    until it built the shard late (Llama-3.1-8B's dimensions, 2 layers, v5p-8: 1,999.9 against
    1,754.4 MB of temp, docs/tpu.md). This test's program, made so (at a6839f3), had no shard at
    all, the chunks going to AdamW's update as they were; now it has the writes."""
    from accel_xla_fsdp.tpu_compiler import _INSTRUCTION

    optimized = Path(compiled["vocabulary_sharded_bf16", topology]["optimized"]).read_text()
    shards = [m for m in map(_INSTRUCTION.match, _entry(optimized)) if m and m["shape"].startswith("bf16[4000,128]")]
    assert [m["name"] for m in shards if 'op_name="select.' in m["rest"]], [m["name"] for m in shards]


def test_temp_at_peak_counts_a_buffer_updated_in_place_once(tmp_path: Path) -> None:
    """A value updated in place (``b`` from ``a``: torch_xla's slice assignment) ends and starts at
    the same step and offset: one buffer there, listed as the newer value; other memory spaces
    (color 1, VMEM) are left out. The heap is the main temp allocation's size."""
    from accel_xla_fsdp.tpu_compiler import temp_at_peak

    (tmp_path / "m.after_optimizations-buffer-assignment.txt").write_text(
        "BufferAssignment:\n"
        "allocation 5: size 3000, preallocated-temp:\n"
        " value: <1 a @0> (size=1000,offset=0): f32[250]{0}\n"
        " value: <2 b @0> (size=1000,offset=0): f32[250]{0}\n"
        " value: <3 c @0> (size=500,offset=1000): f32[125]{0}\n"
        " value: <4 d @0> (size=300,offset=1500): f32[75]{0}\n"
        "allocation 6: size 9000, color 1, preallocated-temp:\n"
        " value: <5 v @0> (size=9000,offset=0): f32[2250]{0}\n"
    )
    (tmp_path / "m.after_optimizations-live-range.txt").write_text(
        "HloLiveRange (max 6):\n  BufferLiveRange:\n    a{}:0-3\n    b{}:3-6\n    c{}:3-4\n    d{}:5-5\n    v{}:0-6\n"
    )
    peak = temp_at_peak(str(tmp_path))
    assert (peak.step, peak.live, peak.heap) == (3, 1500, 3000)  # counting a and b apart: 2500
    assert [(v.name, v.size) for v in peak.held] == [("b{}", 1000), ("c{}", 500)]


def test_the_smallest_hbm_a_step_compiles_in(compiled, tpu_python: Path) -> None:
    """``tpu_compiler.py --smallest-hbm``: the step compiles under the cap it finds and is refused
    1 MiB below, the compiler itemizing what it used; capped, it needs no more than it plans with
    HBM to spare (arguments, temp and code). A libtpu that stops reading the cap, or words its
    refusals otherwise, fails here."""
    free = compiled["flat", "v5e-4"]
    cmd = [str(tpu_python), "accel_xla_fsdp/tpu_compiler.py", free["program"], "--topology", "v5e-4"]
    found = json.loads(_run([*cmd, "--smallest-hbm", "--json"], "the smallest HBM search").splitlines()[-1])
    mib = 1 << 20
    refused = found["refused_below"]
    assert refused is not None and refused["available"] == (found["smallest_hbm_mib"] - 1) * mib
    assert refused["required"] > refused["available"] and "HLO temp" in refused["parts"]
    assert found["smallest_hbm_mib"] * mib <= free["peak"] + free["code"]
