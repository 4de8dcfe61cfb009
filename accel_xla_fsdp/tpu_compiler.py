"""Compile an exported program for a TPU topology with the real TPU compiler, no TPU needed.

Run in the compiler's own venv (``bash scripts/ensure_tpu_venv.sh`` makes ``.tpu-venv``), as a
file, never imported by the library: it imports JAX and libtpu and no torch (torch_xla and jaxlib
each carry an XLA), and nothing from this package.

    .tpu-venv/bin/python accel_xla_fsdp/tpu_compiler.py STEP.hlo --topology v5e-4 [--json]

Prints per chip: the compiler's memory plan (argument, output, alias, temp, generated code, and
peak = argument + output - alias + temp) and the collectives of the optimized program, each kind
with its count, its bytes and its traffic per the ring model. ``--smallest-hbm`` finds instead
the smallest HBM each program compiles in ([Note: the smallest HBM a step compiles in]). How the
TPU compiler is driven is in /work/shared/notes/tpu-compiler.md and docs/tpu.md.

[Note: counting TPU collectives]
The TPU compiler makes collectives asynchronous: ``all-gather-start``/``all-gather-done``, and it
runs some (v5e) as a chain of fusions (start, continuations, done), each of whose bodies holds
the collective again, marked ``chain_id="k"``. So a collective is counted by its ``-done`` (or
its synchronous opcode), once per chain id, else once per distinct instruction text (which names
its operands, and is the same wherever a computation is printed again). Its bytes
are those of the full (unsharded) tensor: an all-gather's or an all-reduce's result (a tuple when
the compiler combined several), a reduce-scatter's result times the group size (the optimized HLO
prints operands without their shapes).

Traffic per the ring model, per chip, for a group of n: an all-gather or a reduce-scatter of a
full tensor of S bytes sends (n - 1) / n * S; an all-reduce sends twice that (a reduce-scatter,
then an all-gather).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple, Union

# name -> (topology_name, chip_config_name): the slices users rent, by chips. A "v4-8" is 4 chips
# of two cores each, "megacore" making each chip one device, as on a real v4 slice.
TOPOLOGIES: Dict[str, Tuple[str, Optional[str]]] = {
    "v4-8": ("v4:2x2x1", "megacore"),
    "v4-16": ("v4:2x2x2", "megacore"),
    "v5e-4": ("v5e:2x2", None),
    "v5e-8": ("v5e:2x4", None),
    "v5p-8": ("v5p:2x2x1", "megacore"),
    "v6e-4": ("v6e:2x2", None),
    "v6e-8": ("v6e:2x4", None),
}

# Per chip, bytes of high-bandwidth memory (Google Cloud's TPU docs).
HBM_BYTES = {"v4": 32 << 30, "v5e": 16 << 30, "v5p": 95 << 30, "v6e": 32 << 30}
MIB = 1 << 20
# [Note: the scheduler's memory target]
# The TPU compiler's latency-hiding scheduler plans a step's order for speed within a share of HBM,
# this flag, 95 (%) by default in libtpu 0.0.42.1 (its dump's tpu_comp_env.txt). With HBM to
# spare by that measure it makes every AdamW update at the step's end, so each layer's reduced
# gradient shard is held from its backward to there (SPMD FSDPv2's updates follow their gradients).
# Far lower, it makes them earlier: issue 25's checkpointed fp32 step on v5e-8 at 1 has 11 of its
# 39 updates before the median reduce-scatter, none at 95. Qwen2.5-7B, fp32, checkpointed, on
# v5e-8: refused at 95 and 100 ("HLO temporaries (15.96G) exceeds available HBM (15.75G)"),
# compiled at 90, where 15 more updates come in the 7th and 8th tenths of the schedule and one
# vocabulary table's 14,000 steps earlier, so its peak holds 16 fewer layers' gradient shards and
# its heap is 713 MB smaller; and at 1 with 1.7 GB less temp than at 90 (docs/tpu.md).
SCHEDULER_MEMORY_FLAG = "xla_tpu_scheduler_percent_shared_memory_limit"


def libtpu_init_args(scheduler_memory_percent: Optional[int], given: str = "") -> str:
    """``LIBTPU_INIT_ARGS`` with the scheduler's memory target set, then ``given`` (the user's own,
    which libtpu reads last: a value of theirs for the same flag wins)."""
    ours = f"--{SCHEDULER_MEMORY_FLAG}={scheduler_memory_percent}" if scheduler_memory_percent is not None else ""
    return f"{ours} {given}".strip()


# Per chip, the HBM the compiler plans a step in, and refuses one beyond: the chip's less what the
# TPU runtime keeps for itself. As libtpu 0.0.42.1 words it refusing a step too large for any
# slice ("exceeds available HBM (15.75G)"), to 0.01 GiB; v5e's is exact, its refusals under a cap
# listing "reserved 258.00M". v5p's is above the 95 GB of Google's page.
COMPILER_HBM_BYTES = {
    "v4": round(30.75 * 1024) * MIB,
    "v5e": (16 * 1024 - 258) * MIB,
    "v5p": round(95.74 * 1024) * MIB,
    "v6e": round(31.25 * 1024) * MIB,
}

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
                "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}  # fmt: skip
_ARRAY = re.compile(r"\b(?P<dtype>pred|[sufb]f?\d+)\[(?P<dims>[0-9,]*)\]")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+) = (?P<shape>.*?) (?P<opcode>[a-z][a-z0-9-]*)\((?P<rest>.*)$"
)
_GROUPS = re.compile(r"replica_groups=(\{\{[0-9,{}]*\}\}|\[[0-9,]+\]<=\[[0-9,]+\][^,\s]*)")
_CHAIN = re.compile(r'chain_id="(\d+)"')
_KINDS = {
    "all-gather": "all-gather",
    "all-gather-done": "all-gather",
    "reduce-scatter": "reduce-scatter",
    "reduce-scatter-done": "reduce-scatter",
    "all-reduce": "all-reduce",
    "all-reduce-done": "all-reduce",
    "all-to-all": "all-to-all",
    "collective-permute": "collective-permute",
    "collective-permute-done": "collective-permute",
}
_STARTS = {"all-gather-start", "all-reduce-start", "collective-permute-start", "reduce-scatter-start"}


@dataclass
class CollectiveKind:
    count: int = 0
    bytes: int = 0  # the full (unsharded) tensors they gather, scatter or reduce
    ring_bytes: float = 0.0  # sent per chip, ring model


@dataclass
class Report:
    topology: str
    chips: int
    argument: int
    output: int
    alias: int
    temp: int
    code: int
    peak: int
    hbm: int
    collectives: Dict[str, CollectiveKind] = field(default_factory=dict)

    @property
    def ring_bytes(self) -> float:
        return sum(c.ring_bytes for c in self.collectives.values())

    def to_json(self) -> dict:
        return {**asdict(self), "ring_bytes": self.ring_bytes}

    @classmethod
    def from_json(cls, figures: dict) -> "Report":
        known = {k: v for k, v in figures.items() if k in cls.__dataclass_fields__}
        known["collectives"] = {k: CollectiveKind(**c) for k, c in known["collectives"].items()}
        return cls(**known)


def array_bytes(shape: str) -> List[int]:
    """The bytes of each array an HLO shape text names (``f32[8,128]``, a tuple's or a
    signature's several)."""
    return [_DTYPE_BYTES.get(m["dtype"], 4) * _numel(m["dims"]) for m in _ARRAY.finditer(shape)]


def _numel(dims: str) -> int:
    n = 1
    for d in dims.split(","):
        if d:
            n *= int(d)
    return n


def _group_size(rest: str, chips: int) -> int:
    m = _GROUPS.search(rest)
    if not m:
        return chips
    groups = m.group(1)
    if groups.startswith("{{"):
        return len(groups[2:].split("}")[0].split(","))
    # iota form [G,n]<=[...]
    return int(groups[1:].split("]")[0].split(",")[-1])


def count_collectives(optimized_hlo: str, chips: int) -> Dict[str, CollectiveKind]:
    """Each collective of the optimized program once (see [Note: counting TPU collectives])."""
    seen = set()
    starts: Dict[str, str] = {}  # name of a -start -> its operand text (a -done names its start)
    kinds: Dict[str, CollectiveKind] = {}
    lines = optimized_hlo.splitlines()
    for line in lines:
        m = _INSTRUCTION.match(line)
        if m and m["opcode"] in _STARTS:
            starts[m["name"]] = line
    for line in lines:
        m = _INSTRUCTION.match(line)
        if not m or m["opcode"] not in _KINDS:
            continue
        kind = _KINDS[m["opcode"]]
        if m["opcode"].endswith("-done"):
            # `x-done(%x-start)`: the start names the operands and the replica groups
            start_name = re.match(r"\s*%?([\w.\-]+)", m["rest"])
            start = starts.get(start_name.group(1), "") if start_name else ""
            key = start.split(" = ", 1)[-1] or m["rest"]
            rest = start or m["rest"]
        else:
            key = line.split(" = ", 1)[-1]
            rest = m["rest"]
        chain = _CHAIN.search(rest)
        if chain:  # one collective run as a chain of fusions (start, continuations, done)
            key = f"{kind} chain {chain.group(1)}"
        if key in seen:
            continue
        seen.add(key)
        n = _group_size(rest, chips)
        result = sum(array_bytes(m["shape"]))  # a combined collective's result is a tuple
        full = result * n if kind == "reduce-scatter" else result
        entry = kinds.setdefault(kind, CollectiveKind())
        entry.count += 1
        entry.bytes += full
        entry.ring_bytes += (2 if kind == "all-reduce" else 1) * (n - 1) / n * full
    return kinds


def compile_program(
    hlo_text: str, topology: str, spmd: bool = False, dump_to: Optional[str] = None
) -> Tuple[Report, str]:
    """Compile ``hlo_text`` and report its memory plan and collectives; also the optimized HLO.

    ``hlo_text`` is a program of one replica (``num_replicas`` = the topology's chips), or with
    ``spmd`` the whole program of an SPMD trace (torch_xla's ``xr.use_spmd()``), which the
    compiler partitions (``num_partitions`` = the chips; GSPMD, as torch_xla's HLO carries GSPMD
    sharding annotations, not Shardy's). ``dump_to``: a directory for the compiler's dumps (the
    optimized HLO and its buffer assignment, which names what the temp holds)."""
    # libtpu guards a TPU with /tmp/libtpu_lockfile and refuses to start while another process has
    # libtpu loaded, with "Internal error when accessing libtpu multi-process lockfile". A compile
    # uses no TPU, and our LOCK already queues compiles; without this, a compile that started as
    # another process ended failed now and then (seen in a plan run beside the test suite).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    import numpy as np
    from jax._src import compiler
    from jax._src.interpreters import mlir
    from jax._src.lib import _jax, xla_client
    from jax.experimental import topologies
    from jaxlib import _hlo  # noqa: F401  (the HLO parser)
    from jaxlib.mlir import ir

    name, config = TOPOLOGIES.get(topology, (topology, None))
    kwargs = {"chip_config_name": config} if config else {}
    topo = topologies.get_topology_desc(platform="tpu", topology_name=name, **kwargs)
    devices = topo.devices
    chips = len(devices)
    proto = _hlo.hlo_module_from_text(hlo_text).as_serialized_hlo_module_proto()
    with mlir.make_ir_context():
        module = ir.Module.parse(_jax.mlir.hlo_to_stablehlo(proto))
        replicas, partitions = (1, chips) if spmd else (chips, 1)
        options = compiler.get_compile_options(
            num_replicas=replicas,
            num_partitions=partitions,
            device_assignment=np.array(devices, dtype=object).reshape(replicas, partitions),
        )
        build = options.executable_build_options
        build.use_spmd_partitioning = spmd
        build.use_shardy_partitioner = False
        if dump_to:
            build.debug_options.xla_dump_to = dump_to
            build.debug_options.xla_dump_hlo_as_text = True
        executable = devices[0].client.compile(
            module, executable_devices=xla_client.DeviceList(tuple(devices)), compile_options=options
        )
    stats = executable.get_compiled_memory_stats()
    optimized = executable.hlo_modules()[0].to_string()
    generation = name.split(":")[0]
    report = Report(
        topology=topology,
        chips=chips,
        argument=stats.argument_size_in_bytes,
        output=stats.output_size_in_bytes,
        alias=stats.alias_size_in_bytes,
        temp=stats.temp_size_in_bytes,
        code=stats.generated_code_size_in_bytes,
        peak=stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        - stats.alias_size_in_bytes
        + stats.temp_size_in_bytes,
        hbm=HBM_BYTES.get(generation, 0),
        collectives=count_collectives(optimized, chips),
    )
    return report, optimized


_ALLOCATION = re.compile(r"^allocation \d+: size (?P<size>\d+), (?P<kind>.*)$")
_VALUE = re.compile(
    r"^ value: <\d+ (?P<name>[^\s>]+) @\d+> \(size=(?P<size>\d+),offset=(?P<offset>\d+)\): (?P<shape>\S+)"
)
_LIVE = re.compile(r"^\s+(?P<name>[^\s:]+):(?P<start>\d+)-(?P<end>\d+)$")


@dataclass(frozen=True)
class LiveValue:
    name: str  # the optimized HLO's instruction (and tuple index)
    shape: str
    size: int
    offset: int  # in the temp allocation: values updated in place share one
    start: int  # its live range, in the schedule's steps
    end: int


@dataclass(frozen=True)
class TempPeak:
    """The main temp allocation (HBM: color 0) at its peak. Its size (``heap``) is where the heap
    simulator packed the values; ``heap - live`` of it is unused at the peak, what the compiler's
    out-of-memory report calls fragmentation. The temp it reports is the heap plus that
    fragmentation, ``2 * heap - live`` (to within 1 MB in 31 steps of 38 MB to 13 GB; not in all of
    the tests' steps, of 3-4 MB: the dim0 step's is reported as 0), where what it checks against the chip holds
    the heap once ([Note: the smallest HBM a step compiles in]; docs/tpu.md, "What the
    compiler's temp is")."""

    step: int  # of the schedule
    live: int  # bytes of the values live there
    heap: int  # bytes of the allocation
    held: List[LiveValue]  # those values, largest first


def temp_at_peak(dump_dir: str) -> TempPeak:
    """What the temp holds at its peak, from a compile's dumps (``--dump-to``): the step of the
    schedule where the live values of the main temp allocation add up most, that sum, and those
    values. Sizes as the buffer assignment gives them (tiled). An op that updates a buffer in place
    (a dynamic-update-slice, or the select torch_xla traces a slice assignment as) ends one value
    and starts the next at the same step and offset: the buffer counts once, listed as the newer
    value."""
    import glob

    def one(pattern: str) -> str:
        found = sorted(glob.glob(os.path.join(dump_dir, pattern)))
        if not found:
            raise FileNotFoundError(f"no {pattern} in {dump_dir}: compile with --dump-to")
        return open(found[-1]).read()

    places: Dict[str, Tuple[int, int, str]] = {}
    in_temp, heap = False, 0
    for line in one("*after_optimizations-buffer-assignment.txt").splitlines():
        allocation = _ALLOCATION.match(line)
        if allocation:
            in_temp = allocation["kind"] == "preallocated-temp:"  # color 0; others say "color N, "
            if in_temp:
                heap = int(allocation["size"])
            continue
        value = _VALUE.match(line) if in_temp else None
        if value:
            name = value["name"] if "{" in value["name"] else value["name"] + "{}"
            places[name] = (int(value["size"]), int(value["offset"]), value["shape"].lstrip("(").split("{")[0])
    live: List[LiveValue] = []
    for line in one("*after_optimizations-live-range.txt").split("BufferLiveRange:", 1)[-1].splitlines():
        m = _LIVE.match(line)
        if m and m["name"] in places:
            size, offset, shape = places[m["name"]]
            live.append(LiveValue(m["name"], shape, size, offset, int(m["start"]), int(m["end"])))
    steps = max((v.end for v in live), default=0) + 2
    events: List[List[Tuple[Tuple[int, int], int]]] = [[] for _ in range(steps)]
    for v in live:
        events[v.start].append(((v.offset, v.size), 1))
        events[v.end + 1].append(((v.offset, v.size), -1))
    holders: Dict[Tuple[int, int], int] = {}  # a buffer's live values
    total, peak, at = 0, 0, 0
    for step, changes in enumerate(events):
        for buffer, change in sorted(changes, key=lambda c: c[1]):  # the values ended before the step first
            before = holders.get(buffer, 0)
            holders[buffer] = before + change
            if before == 0 or holders[buffer] == 0:
                total += buffer[1] * change
        if total > peak:
            peak, at = total, step
    newest: Dict[Tuple[int, int], LiveValue] = {}
    for v in sorted((v for v in live if v.start <= at <= v.end), key=lambda v: v.start):
        newest[(v.offset, v.size)] = v
    return TempPeak(at, peak, heap, sorted(newest.values(), key=lambda v: -v.size))


def format_report(report: Report) -> str:
    lines = [
        f"{report.topology} ({report.chips} chips), per chip:",
        f"  argument {report.argument / MIB:,.1f} MiB, output {report.output / MIB:,.1f} MiB, "
        f"alias {report.alias / MIB:,.1f} MiB, temp {report.temp / MIB:,.1f} MiB, code {report.code / MIB:,.1f} MiB",
        f"  peak {report.peak / MIB:,.1f} MiB of {report.hbm / MIB:,.0f} MiB HBM",
    ]
    for kind, c in sorted(report.collectives.items()):
        lines.append(f"  {kind}: {c.count}, {c.bytes / MIB:,.2f} MiB, ring traffic {c.ring_bytes / MIB:,.2f} MiB")
    lines.append(f"  ring traffic in all: {report.ring_bytes / MIB:,.2f} MiB")
    return "\n".join(lines)


def format_temp(peak: TempPeak, top: int) -> str:
    mb = 1e6
    lines = [
        f"  temp at its peak (step {peak.step}): {peak.live / mb:,.1f} MB live in {len(peak.held)} values, "
        f"in a heap of {peak.heap / mb:,.1f} MB ({(peak.heap - peak.live) / mb:,.1f} MB unused there); the largest:"
    ]
    for v in peak.held[:top]:
        lines.append(f"    {v.size / mb:8,.1f} MB  {v.shape:<24} {v.name} (live {v.start}-{v.end})")
    return "\n".join(lines)


# [Note: the smallest HBM a step compiles in]
# With HBM to spare the compiler plans loosely. It keeps generated code in HBM ("overlays": 129
# MiB for issue 25's Llama, fp32, checkpointed, on v5e-8; 31 MiB under a cap), and it leaves room
# in the temp heap. Its ``temp_size_in_bytes`` is that heap plus the heap's fragmentation at its
# peak, while what it checks against the chip is arguments + heap + overlays + scoped + global
# (its own out-of-memory report names each; docs/tpu.md, "What the compiler's temp is"). Under
# --xla_tpu_max_hbm_size_mib=N (LIBTPU_INIT_ARGS, read as libtpu loads: one process per cap) it
# packs to fit N MiB of usable HBM, or refuses with what it used. The smallest N a step compiles
# under is what the step needs; a chip's usable HBM is its HBM less the runtime's reserve (v5e:
# 15.75 GiB of 16).

# Its refusals of a step beyond HBM, in its two wordings: the temporaries over the HBM it has (a
# check it makes early, seconds into a compile), and all it used, when it planned the step and
# found it too large. "M" is MiB, "G" GiB.
_OUT_OF_HBM = (
    re.compile(
        r"Ran out of memory on HBM, [^\n]*?\((?P<required>[0-9.]+)(?P<required_unit>[KMG])\) "
        r"exceeds available HBM \((?P<available>[0-9.]+)(?P<available_unit>[KMG])\)"
    ),
    re.compile(
        r"Ran out of memory in memory space hbm\. Used (?P<required>[0-9.]+)(?P<required_unit>[KMG]) "
        r"of (?P<available>[0-9.]+)(?P<available_unit>[KMG]) hbm"
    ),
)
# The second wording goes on with what it used, by part: "    HLO temp   39.75M (100.0% ...)".
_PART = re.compile(r"^\s+(?P<kind>arguments|program|HLO temp|overlays|scoped|global)\s+(?P<words>[0-9.]+[KMG].*)$")
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


@dataclass(frozen=True)
class Refusal:
    refused: str  # the compiler's words
    required: float  # bytes it needed at least; with HBM capped, what it used when it gave up
    available: float  # bytes of HBM it had
    parts: Dict[str, str] = field(default_factory=dict)  # its words for each part of what it used


@dataclass(frozen=True)
class SmallestHbm:
    cap_mib: int  # the smallest --xla_tpu_max_hbm_size_mib the step compiles under
    report: Report  # its plan under that cap
    refusal: Optional[Refusal]  # the compiler's account 1 MiB below, when it was compiled there
    compiles: int


def compiler_refusal(stderr: str) -> Optional[Refusal]:
    """The compiler's refusal of a step beyond HBM, from a failed compile's output; None if it
    refused none."""
    for pattern in _OUT_OF_HBM:
        found = pattern.search(stderr)
        if found:
            required = float(found["required"]) * _UNITS[found["required_unit"]]
            available = float(found["available"]) * _UNITS[found["available_unit"]]
            parts: Dict[str, str] = {}
            for line in stderr.splitlines():
                part = _PART.match(line)
                if part:
                    parts.setdefault(part["kind"], " ".join(part["words"].split()))
            return Refusal(found[0], required, available, parts)
    return None


def compile_capped(program: str, topology: str, spmd: bool, cap_mib: Optional[int]) -> Union[Report, Refusal]:
    """Compile ``program`` in a process of its own, under ``cap_mib`` of HBM if given: its
    report, or the compiler's refusal."""
    env = dict(os.environ)
    if cap_mib is not None:
        env["LIBTPU_INIT_ARGS"] = f"{env.get('LIBTPU_INIT_ARGS', '')} --xla_tpu_max_hbm_size_mib={cap_mib}".strip()
    cmd = [sys.executable, os.path.abspath(__file__), program, "--topology", topology, "--json"]
    done = subprocess.run(cmd + (["--spmd"] if spmd else []), env=env, capture_output=True, text=True)
    if done.returncode == 0:
        return Report.from_json(json.loads(done.stdout.splitlines()[-1]))
    refusal = compiler_refusal(done.stderr)
    if refusal is None:
        raise RuntimeError(f"compiling {program} for {topology} failed:\n{done.stderr[-3000:]}")
    return refusal


def smallest_hbm(program: str, topology: str, spmd: bool = False) -> SmallestHbm:
    """The smallest HBM cap, to the MiB, under which the compiler accepts ``program``: a search
    between its arguments (too little) and its plan with HBM to spare, trying first, after each
    refusal, what the compiler said it used."""
    free = compile_capped(program, topology, spmd, None)
    if isinstance(free, Refusal):
        raise RuntimeError(f"the compiler refused {program} for {topology} with all of HBM: {free.refused}")
    low = free.argument // MIB
    high = math.ceil((free.peak + free.code) / MIB) + 16
    refusals: Dict[int, Refusal] = {}
    compiled = compile_capped(program, topology, spmd, high)
    while isinstance(compiled, Refusal):  # capped at its plan with room to spare, it may not fit: widen
        refusals[high] = compiled
        low, high = high, math.ceil(high * 1.25)
        compiled = compile_capped(program, topology, spmd, high)
    best, compiles = compiled, 2 + len(refusals)
    while high - low > 1:
        hint = math.ceil(refusals[low].required / MIB) if low in refusals else None
        cap = hint if hint is not None and low < hint < high else (low + high) // 2
        outcome = compile_capped(program, topology, spmd, cap)
        compiles += 1
        if isinstance(outcome, Refusal):
            low, refusals[cap] = cap, outcome
        else:
            high, best = cap, outcome
    return SmallestHbm(high, best, refusals.get(high - 1), compiles)


def format_smallest(found: SmallestHbm) -> str:
    r = found.report
    lines = [
        f"  smallest HBM it compiles in: {found.cap_mib:,} MiB ({found.compiles} compiles); under that cap: "
        f"temp {r.temp / MIB:,.1f} MiB, code {r.code / MIB:,.1f} MiB, peak {r.peak / MIB:,.1f} MiB"
    ]
    if found.refusal:
        parts = "; ".join(f"{kind} {words}" for kind, words in found.refusal.parts.items())
        lines.append(f"  1 MiB less refused: {found.refusal.refused}: {parts}")
    return "\n".join(lines)


# One compiling process at a time on a machine: a large model's compile takes many GB here.
LOCK = "/tmp/accel_xla_fsdp_tpu_compiler.lock"


def print_smallest(args: argparse.Namespace) -> int:
    # No lock here: each compile is a process of its own, which takes it.
    for path in args.programs:
        for topology in args.topology:
            found = smallest_hbm(path, topology, spmd=args.spmd)
            if args.json:
                refusal = asdict(found.refusal) if found.refusal else None
                figures = {"smallest_hbm_mib": found.cap_mib, "compiles": found.compiles, "refused_below": refusal}
                print(json.dumps({"program": path, "topology": topology, **figures, "at_cap": found.report.to_json()}))
            else:
                print(f"{path}: {topology}\n{format_smallest(found)}", flush=True)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("programs", nargs="+", help="HLO text files (tpu_program.export_step)")
    parser.add_argument("--topology", action="append", required=True, help=f"{', '.join(TOPOLOGIES)} or a raw name")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--hlo-out", help="write the optimized HLO of each compile to PREFIX.<n>.txt")
    parser.add_argument("--spmd", action="store_true", help="the programs are SPMD traces (xr.use_spmd())")
    parser.add_argument("--dump-to", help="the compiler's dumps (buffer assignment) go into DIR/<n>/")
    parser.add_argument(
        "--temp", type=int, metavar="N", help="print the N largest values live at the temp's peak (needs --dump-to)"
    )
    parser.add_argument(
        "--smallest-hbm",
        action="store_true",
        help="find the smallest HBM (MiB) each program compiles in, one capped compile per process",
    )
    args = parser.parse_args(argv)
    if args.smallest_hbm and (args.hlo_out or args.dump_to or args.temp):
        parser.error("--smallest-hbm compiles each program many times: run --hlo-out, --dump-to and --temp apart")
    if args.smallest_hbm:
        return print_smallest(args)
    lock = open(LOCK, "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    n = 0
    for path in args.programs:
        text = open(path).read()
        for topology in args.topology:
            dump = f"{args.dump_to}/{n}" if args.dump_to else None
            report, optimized = compile_program(text, topology, spmd=args.spmd, dump_to=dump)
            if args.hlo_out:
                with open(f"{args.hlo_out}.{n}.txt", "w") as f:
                    f.write(optimized)
            n += 1
            held = temp_at_peak(dump) if args.temp and dump else None
            if args.json:
                extra = {"temp_at_peak": format_temp(held, top=args.temp)} if held else {}
                print(json.dumps({"program": path, **report.to_json(), **extra}), flush=True)
            else:
                print(f"{path}: {format_report(report)}", flush=True)
                if held:
                    print(format_temp(held, top=args.temp), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
