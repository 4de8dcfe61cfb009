"""``accel-xla-fsdp plan MODEL --topology v5e-8``: does a model fine-tune on a TPU slice?

Answered on any machine, without a TPU and without weights: the model is built from its config on
the meta device, wrapped as the Accelerate plugin wraps it (``--config_file``), and one training
step (forward, backward, AdamW with its state) is traced as replica 0 of the slice's chips
(``_xla.tracing_replica``: shards sized for the slice, collectives in the TPU form) and compiled
by the real TPU compiler (``tpu_compiler.py`` in ``.tpu-venv``). The compiler's memory plan per
chip is set against the chip's HBM.

[Note: full depth, no buffers]
A trace reads shapes only: the parameter shards (``construction.PlaceholderShards``), SPMD's
parameters, AdamW's state and the batch are placeholders that hold no buffer
(``_xla.placeholder``), so any model is traced and compiled at its full depth, and nothing is
extrapolated. Until this was so, a trace held replica 0's shards, gradients and AdamW state here,
and deeper models were traced with 1 and 2 decoder layers and extrapolated linearly: exact for
arguments and traffic, but 43% low for the temp of Llama-3.1-8B (3.09 against 5.39 GiB: a short
model's temp does not grow as the full model's heap does; docs/plan.md).

[Note: steps beyond HBM]
A step whose arguments alone (parameter shards, AdamW state, batch: the exported program's
parameters, ``tpu_program.ExportedProgram.argument_bytes``) exceed the HBM the compiler has does not fit, whatever its
temp, and is not compiled: compiling a large model at full depth takes more memory than its size
suggests (Llama-3.1-70B on 8 chips: over 23 GiB here, killed), and would add nothing to that
verdict. SPMD FSDPv2 holds the same parameters and state per chip, so ``--compare`` is not
traced either. A step that needs more than the chip's HBM in all, the TPU compiler refuses
("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries
(19.64G) exceeds available HBM (15.75G)": Gemma-2-9B on v5e-8; or "Ran out of memory in memory
space hbm. Used 13.33G of 13.18G hbm", seen with its HBM capped); its verdict quotes the compiler,
the peak is at least the larger of the arguments and that figure, and the margin is against the
HBM the compiler had, which is less than the chip's (30.75 of v4's 32 GiB): a step refused at
31.27 does not fit.

[Note: what a step needs]
A step fits if the compiler accepts it for the chip: it plans every step in the HBM it has, the
chip's less the runtime's reserve (``tpu_compiler.COMPILER_HBM_BYTES``), and refuses one beyond.
The peak it reports (arguments + output - alias + temp) is its plan with whatever HBM it had to
spare, and its temp counts the heap's unused bytes twice (docs/tpu.md, "What the compiler's temp
is"): SPMD FSDPv2's Llama-3.1-8B step, fp32, checkpointed, on v5e-8, is accepted with a peak of
16.07 GiB, above the 15.75 the compiler has. So the margin is the HBM the compiler has less that
peak, a loose figure, and with ``--smallest-hbm`` less the smallest HBM the step compiles in
(``tpu_compiler.smallest_hbm``: 5-12 more compiles), what it needs. A step the compiler refuses
with libtpu's own scheduler target, when the request sets none, is compiled once more at 90 (%):
Qwen2.5-7B and Llama-3.1-8B, fp32, checkpointed, on v5e-8, are refused at libtpu's 95 and accepted
at 90 ([Note: the scheduler's memory target]), so their verdict is "fits with
``xla_fsdp_tpu_scheduler_memory_percent: 90``", the setting the user adds, not "does not fit".

[Note: torch_xla's SPMD FSDPv2 beside ours]
``--compare spmd`` also compiles the same step under torch_xla's ``SpmdFullyShardedDataParallel``
(``tpu_program.export_spmd_training_step``): the whole SPMD program, traced over one XLA:CPU
device per chip, partitioned by the TPU compiler. Its traffic is set against the same FSDP floor
as ours (the same parameters gathered and reduced). Its bf16 is ``torch.autocast``, which leaves
sdpa out: the query and key come out of the rotary embedding in f32, the value in bf16, and sdpa
refuses the mix. So with bf16 both engines are traced with eager attention (which autocasts its
matmuls, and materializes the attention's probabilities), and the output says so. SPMD computes
in its parameters' dtype unless autocast: with fp32 and a config in another dtype (bf16 for most
models), it would compute in bf16 where ours computes in f32, a smaller step. So with fp32 both
engines' parameters (and AdamW state) are made f32, and the output says so.

Each trace is a process of its own (``python -m accel_xla_fsdp.plan SPEC.json``): the XLA:CPU
runtime with one device, a fresh model; each compile too, in the compiler's venv.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from . import tpu_compiler  # its topology and HBM tables (importing it imports no JAX)

PACKAGE = Path(__file__).resolve().parent
TPU_PYTHON_ENV = "ACCEL_XLA_FSDP_TPU_PYTHON"
GIB = 1 << 30
FIGURES = ("argument", "output", "alias", "temp", "peak", "ring_bytes", "floor")
ENGINES = {"ours": "ours", "spmd": "torch_xla SPMD FSDPv2"}

PLAN_HELP = """\
Compile one training step of MODEL (forward, backward, AdamW with its state) for a TPU slice with
the real TPU compiler, here, with no TPU and no weights, and say whether it fits the chips' HBM.

MODEL is a folder holding config.json or the config file itself (a transformers causal LM). The
step is our engine's as `accelerate launch --config_file FILE` runs it (the plugin's fsdp_config,
mixed_precision and fsdp_activation_checkpointing; options below override them), sequence
--seq, --batch sequences per chip. Needs the TPU compiler: `bash scripts/ensure_tpu_venv.sh` in
the accel-xla-fsdp checkout, or ACCEL_XLA_FSDP_TPU_PYTHON naming a Python with jax[tpu]==0.10.2.

Any model is traced and compiled at its full depth: the trace holds no tensors (docs/plan.md).
--compare spmd: torch_xla's SPMD FSDPv2 on the same step, its figures beside ours."""


class PlanError(Exception):
    """Bad input to ``plan``: the message names it and what to do."""


@dataclass(frozen=True)
class Slice:
    name: str
    generation: str
    chips: int
    hbm: int  # per chip
    compiler_hbm: int  # per chip, what the compiler plans a step in: the chip's less the runtime's reserve


def topology(name: str) -> Slice:
    if name not in tpu_compiler.TOPOLOGIES:
        raise PlanError(f"unknown topology {name!r}: choose one of {', '.join(sorted(tpu_compiler.TOPOLOGIES))}")
    jax_name, _ = tpu_compiler.TOPOLOGIES[name]
    generation, shape = jax_name.split(":")
    chips = 1
    for d in shape.split("x"):
        chips *= int(d)
    hbm, compiler_hbm = tpu_compiler.HBM_BYTES[generation], tpu_compiler.COMPILER_HBM_BYTES[generation]
    return Slice(name, generation, chips, hbm, compiler_hbm)


def tpu_python() -> Path:
    """The compiler's Python: $ACCEL_XLA_FSDP_TPU_PYTHON, else the checkout's .tpu-venv."""
    configured = os.environ.get(TPU_PYTHON_ENV)
    python = Path(configured) if configured else PACKAGE.parent / ".tpu-venv" / "bin" / "python"
    if not python.exists():
        raise PlanError(
            f"the TPU compiler is missing: no {python}. Run `bash scripts/ensure_tpu_venv.sh` in the "
            "accel-xla-fsdp checkout (a venv .tpu-venv with pip install 'jax[tpu]==0.10.2', 1.3 GB), or set "
            f"{TPU_PYTHON_ENV} to a Python that has it"
        )
    return python


def load_config(model: str) -> Any:
    """MODEL's transformers config (a folder holding config.json, or the file), checked to be a
    causal LM transformers can build."""
    os.environ.setdefault("PJRT_DEVICE", "CPU")  # transformers imports torch_xla, which asks
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    path = Path(model)
    if path.is_dir() and not (path / "config.json").is_file():
        raise PlanError(f"{model}: no config.json in this folder (give a model folder or its config.json)")
    if not path.exists():
        raise PlanError(f"{model}: no such folder or file (give a model folder or its config.json)")
    try:
        config = AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError, KeyError) as e:
        raise PlanError(f"{model}: not a transformers config transformers knows: {e}") from None
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise PlanError(
            f"{model}: model_type {config.model_type!r} is not a causal language model transformers knows "
            "(AutoModelForCausalLM has no class for it)"
        )
    if not isinstance(getattr(config, "num_hidden_layers", None), int):
        raise PlanError(f"{model}: its config has no num_hidden_layers: cannot tell the model's depth")
    return config


def for_training(config: Any) -> Any:
    """A copy of ``config`` for a training step: no KV cache."""
    config = config.__class__.from_dict(config.to_dict())
    config.use_cache = False
    return config


def parameter_count(config: Any) -> Tuple[int, Any]:
    """Parameters of the model ``config`` describes, counted on the meta device (no memory), and
    their dtype: the config's (transformers 5 builds a model in it, as ``from_pretrained`` loads
    it), which AdamW's state takes too."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = list(_as_loaded(model).parameters())
    return sum(p.numel() for p in params), params[0].dtype


def _as_loaded(model: Any) -> Any:
    """``model`` with its weights tied as its config says. ``from_config`` leaves them apart
    (transformers 5); ``from_pretrained``, what users fine-tune, ties them: Llama-3.2-1B's and
    Gemma-2's lm_head is their embedding, one table, not two."""
    model.tie_weights()
    return model


# ---------------------------------------------------------------------------------------------
# The trace (a process of its own)


def trace(spec: Dict[str, Any]) -> Dict[str, float]:
    """Trace and export the step ``spec`` describes (``_trace_spec``); returns its FSDP
    communication floor (SPMD: 0, set to ours' by ``plan``: the same parameters) and, for ours,
    the bytes of its arguments per chip."""
    import torch
    from transformers import AutoConfig

    from . import _xla
    from .hf_accelerate.plugin import CONFIG_FILE_ENV

    if spec["config_file"]:
        os.environ[CONFIG_FILE_ENV] = spec["config_file"]
    config = for_training(AutoConfig.from_pretrained(spec["model"]))
    if spec["attention"]:
        config._attn_implementation = spec["attention"]
    if spec["parameter_dtype"]:
        config.dtype = getattr(torch, spec["parameter_dtype"])
    if spec["engine"] == "spmd":
        _trace_spmd(spec, config, program_path(spec))
        return {"floor": 0.0}
    with _xla.tracing_replica(0, spec["chips"], "TPU"):
        return _trace_one(spec, config, program_path(spec))


def _model_on_meta(config: Any) -> Any:
    """The causal LM of ``config``, its parameters on the meta device (a trace reads shapes), its
    buffers real."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config)
    return _as_loaded(model)  # outside: init_empty_weights makes the re-registered tied weight anew


def _trace_one(spec: Dict[str, Any], config: Any, out: Path) -> Dict[str, float]:
    import torch

    from . import _xla, sharded_loss, tpu_program
    from .construction import PlaceholderShards
    from .hf_accelerate.plugin import XlaFsdpPlugin

    compute_dtype = torch.bfloat16 if spec["precision"] == "bf16" else torch.float32
    model = _model_on_meta(config)
    plugin = XlaFsdpPlugin()
    wrapped = plugin.wrap(
        model, compute_dtype, checkpoint_blocks=spec["checkpointing"], param_init_fn=PlaceholderShards()
    )
    ids = _xla.placeholder((spec["batch"], spec["seq"]), torch.long)
    in_backward = bool(plugin.optimizer_in_backward)
    exported = tpu_program.export_training_step(wrapped, ids, out, optimizer_in_backward=in_backward)
    return {
        "floor": tpu_program.communication_floor(wrapped),
        "argument": exported.argument_bytes,
        "vocabulary_kept_sharded": tpu_program.keeps_a_table_sharded(wrapped),
        "lm_loss_in_chunks": sharded_loss.installed(wrapped.module),
        "optimizer_in_backward": in_backward,
    }


def _trace_spmd(spec: Dict[str, Any], config: Any, out: Path) -> None:
    """torch_xla's SPMD FSDPv2 on the step, the model built on the meta device (its parameters
    become sharded placeholders: ``tpu_program.export_spmd_training_step``)."""
    from . import tpu_program

    tpu_program.export_spmd_training_step(
        _model_on_meta(config),
        spec["chips"],
        spec["batch"],
        spec["seq"],
        out,
        checkpoint=spec["checkpointing"],
        autocast=spec["precision"] == "bf16",
    )


def program_path(spec: Dict[str, Any]) -> Path:
    return Path(spec["workdir"]) / f"step.{spec['engine']}.hlo"


# ---------------------------------------------------------------------------------------------
# The plan: a trace and a compile, each a process, and the verdict


@dataclass
class Step:
    """One compiled step's figures per chip (bytes), as ``tpu_compiler`` reports them, with the
    FSDP floor of its traffic."""

    argument: float
    output: float
    alias: float
    temp: float
    peak: float
    ring_bytes: float
    floor: float
    collectives: Dict[str, float] = field(default_factory=dict)  # kind -> count
    not_compiled: str = ""  # why, when the figures are a lower bound ([Note: steps beyond HBM])
    hbm_available: float = 0.0  # the HBM the compiler had for the step, when it refused it
    smallest_hbm: float = 0.0  # the smallest HBM it compiles in, when searched ([Note: what a step needs])
    # refused with libtpu's scheduler target and compiled at this one ([Note: the scheduler's memory target])
    fits_with_scheduler_memory_percent: Optional[int] = None
    refused_with_libtpu_default: str = ""  # the compiler's refusal then

    @classmethod
    def beyond_hbm(cls, argument: float, peak: float, floor: float, why: str, available: float = 0.0) -> Step:
        """A step not compiled, or refused by the compiler (with ``available``, the HBM it had):
        its peak at least ``peak``."""
        return cls(
            argument, argument, argument, peak - argument, peak, 0.0, floor, not_compiled=why, hbm_available=available
        )

    @classmethod
    def of(cls, report: Dict[str, Any], floor: float) -> Step:
        counts = {kind: float(c["count"]) for kind, c in report["collectives"].items()}
        figures: Dict[str, Any] = {k: float(report[k]) for k in FIGURES[:-1]}
        return cls(floor=floor, collectives=counts, **figures)


@dataclass(frozen=True)
class Request:
    model: str
    slice: Slice
    seq: int
    batch: int
    precision: str
    checkpointing: bool
    config_file: Optional[str]
    attention: Optional[str]  # the attention implementation, when not the config's
    parameter_dtype: Optional[str] = None  # the parameters' dtype ("float32"), when not the config's
    scheduler_memory_percent: Optional[int] = None  # [Note: the scheduler's memory target], when set


def _trace_spec(request: Request, engine: str, workdir: Path) -> Dict[str, Any]:
    return {
        "engine": engine,
        "model": request.model,
        "chips": request.slice.chips,
        "seq": request.seq,
        "batch": request.batch,
        "precision": request.precision,
        "checkpointing": request.checkpointing,
        "config_file": request.config_file,
        "attention": request.attention,
        "parameter_dtype": request.parameter_dtype,
        "workdir": str(workdir),
    }


def run_trace(request: Request, engine: str, workdir: Path) -> Tuple[Path, Dict[str, float]]:
    """The exported program, with its floor (and ours, its arguments' bytes), traced in a process
    of its own."""
    spec = _trace_spec(request, engine, workdir)
    spec_path = workdir / f"trace.{engine}.json"
    spec_path.write_text(json.dumps(spec))
    # ours: one XLA:CPU device (tracing_replica refuses several); SPMD: one per chip
    env = {k: v for k, v in os.environ.items() if k != "CPU_NUM_DEVICES"}
    env["PJRT_DEVICE"] = "CPU"
    chips = request.slice.chips
    if engine == "spmd":
        from . import _xla  # imports torch_xla: only when SPMD is asked for

        env.update(_xla.cpu_device_env(chips))
        print(f"plan: tracing {ENGINES[engine]} over {chips}", file=sys.stderr, flush=True)
    else:
        print(f"plan: tracing the step as replica 0 of {chips}", file=sys.stderr, flush=True)
    done = subprocess.run(
        [sys.executable, "-m", "accel_xla_fsdp.plan", str(spec_path)], env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise PlanError(f"tracing the step failed:\n{done.stderr[-4000:]}")
    return program_path(spec), json.loads(spec_path.with_suffix(".out.json").read_text())


def compiler_env(request: Request) -> Dict[str, str]:
    """The compiler's environment: ours, with the launcher's LIBTPU_INIT_ARGS for the settings."""
    env = dict(os.environ)
    if request.scheduler_memory_percent is not None:
        given = env.get("LIBTPU_INIT_ARGS", "")
        env["LIBTPU_INIT_ARGS"] = tpu_compiler.libtpu_init_args(request.scheduler_memory_percent, given)
    return env


def _run_compiler(
    python: Path, program: Path, request: Request, spmd: bool, *options: str
) -> Tuple[List[str], subprocess.CompletedProcess]:
    """``tpu_compiler.py`` on ``program`` for the request's slice, in the compiler's environment;
    ``spmd``: the program is an SPMD trace, which the compiler partitions over the chips."""
    cmd = [str(python), str(PACKAGE / "tpu_compiler.py"), str(program), "--topology", request.slice.name]
    cmd += [*options, "--json", *(["--spmd"] if spmd else [])]
    return cmd, subprocess.run(cmd, capture_output=True, text=True, env=compiler_env(request))


def _json_line(stdout: str) -> Dict[str, Any]:
    return next(json.loads(line) for line in stdout.splitlines() if line.startswith("{"))


def run_compile(python: Path, program: Path, request: Request, spmd: bool) -> Dict[str, Any]:
    """The compiler's report of the step, or its refusal ([Note: steps beyond HBM])."""
    print(f"plan: compiling the step for {request.slice.name}", file=sys.stderr, flush=True)
    cmd, done = _run_compiler(python, program, request, spmd)
    if done.returncode == -signal.SIGKILL:
        raise PlanError(
            "the TPU compiler was killed, most likely out of this machine's memory: compiling a large model "
            "takes more than the model's size suggests (Llama-3.1-70B's step on 8 chips: over 23 GiB here); "
            "run plan on a machine with more memory"
        )
    refused = tpu_compiler.compiler_refusal(done.stderr)
    if refused:  # [Note: steps beyond HBM]
        return asdict(refused)
    if done.returncode != 0:
        raise PlanError(f"the TPU compiler failed ({' '.join(cmd)}):\n{done.stderr[-4000:]}")
    return _json_line(done.stdout)


def compile_step(
    python: Path, program: Path, request: Request, engine: str, argument: float, floor: float
) -> Tuple[Step, Request]:
    """The engine's step as the compiler plans it, and the request it compiled with. A step refused
    with libtpu's own scheduler target (the request sets none) is compiled again at
    ``SCHEDULER_RETRY_PERCENT``, the setting a user would add ([Note: the scheduler's memory target])."""
    spmd = engine == "spmd"
    report = run_compile(python, program, request, spmd)
    if "refused" not in report:
        return Step.of(report, floor), request
    why = f"{REFUSED}: {report['refused']}"
    refused = Step.beyond_hbm(argument, max(argument, report["required"]), floor, why, report["available"])
    if request.scheduler_memory_percent is not None:
        return refused, request
    retry = replace(request, scheduler_memory_percent=SCHEDULER_RETRY_PERCENT)
    print(
        f"plan: refused; compiling again with {SCHEDULER_KEY}: {SCHEDULER_RETRY_PERCENT}", file=sys.stderr, flush=True
    )
    report = run_compile(python, program, retry, spmd)
    if "refused" in report:
        return replace(refused, not_compiled=f"{why}; with {SCHEDULER_KEY}: {SCHEDULER_RETRY_PERCENT} too"), request
    step = Step.of(report, floor)
    return replace(
        step, fits_with_scheduler_memory_percent=SCHEDULER_RETRY_PERCENT, refused_with_libtpu_default=why
    ), retry


def run_smallest_hbm(python: Path, program: Path, request: Request, spmd: bool) -> float:
    """[Note: what a step needs]: the smallest HBM the compiler accepts the step in, bytes."""
    print(f"plan: finding the smallest HBM the step compiles in on {request.slice.name}", file=sys.stderr, flush=True)
    cmd, done = _run_compiler(python, program, request, spmd, "--smallest-hbm")
    if done.returncode != 0:
        raise PlanError(f"the search for the smallest HBM failed ({' '.join(cmd)}):\n{done.stderr[-4000:]}")
    return float(_json_line(done.stdout)["smallest_hbm_mib"] * tpu_compiler.MIB)


def plan(args: argparse.Namespace) -> Dict[str, Any]:
    the_slice = topology(args.topology)
    python = tpu_python()
    config = load_config(args.model)
    precision, checkpointing, lm_head_in_backward, scheduler_percent = _launch_settings(args)
    model = str(Path(args.model).resolve())
    attention = args.attention
    if _eager_for_both(args.compare, precision):
        if attention == "sdpa":
            raise PlanError(
                "--compare spmd in bf16 traces eager attention (SPMD's autocast refuses sdpa): drop --attention sdpa"
            )
        attention = "eager"
    parameters, dtype = parameter_count(config)
    config_dtype = str(dtype).removeprefix("torch.")
    upcast = _f32_for_both(args.compare, precision, config_dtype)
    parameter_dtype = upcast or config_dtype
    request = Request(
        model,
        the_slice,
        args.seq,
        args.batch,
        precision,
        checkpointing,
        args.config_file,
        attention,
        upcast,
        scheduler_percent,
    )
    engines = ["ours", *([args.compare] if args.compare else [])]
    steps: Dict[str, Step] = {}
    kept_sharded = loss_in_chunks = in_backward = False
    with tempfile.TemporaryDirectory(prefix="accel-xla-fsdp-plan-") as tmp:
        for engine in engines:
            program, traced = run_trace(request, engine, Path(tmp))
            if engine == "ours":
                kept_sharded = bool(traced["vocabulary_kept_sharded"])
                loss_in_chunks = bool(traced["lm_loss_in_chunks"])
                in_backward = bool(traced["optimizer_in_backward"])
            if args.hlo_out and engine == "ours":
                shutil.copyfile(program, args.hlo_out)
            if engine == "ours" and traced["argument"] > the_slice.compiler_hbm:  # [Note: steps beyond HBM]
                why = (
                    f"its arguments alone (parameter shards, AdamW state, batch) take {traced['argument'] / GIB:.2f} "
                    f"GiB per chip, more than the {the_slice.compiler_hbm / GIB:.2f} GiB of HBM the compiler has"
                )
                steps["ours"] = Step.beyond_hbm(traced["argument"], traced["argument"], traced["floor"], why)
                break
            # SPMD: the same parameters and state per chip as ours
            argument = steps["ours"].argument if engine == "spmd" else traced["argument"]
            steps[engine], compiled_with = compile_step(python, program, request, engine, argument, traced["floor"])
            if args.smallest_hbm and not steps[engine].not_compiled:
                needed = run_smallest_hbm(python, program, compiled_with, spmd=engine == "spmd")
                steps[engine] = replace(steps[engine], smallest_hbm=needed)
    result: Dict[str, Any] = {
        "model": args.model,
        "model_type": config.model_type,
        "parameters": parameters,
        "layers": config.num_hidden_layers,
        "topology": the_slice.name,
        "chips": the_slice.chips,
        "hbm": the_slice.hbm,
        "compiler_hbm": the_slice.compiler_hbm,
        "seq": args.seq,
        "batch_per_chip": args.batch,
        "precision": precision,
        "gradient_checkpointing": checkpointing,
        "config_file": args.config_file,
        "tied_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
        "lm_head_gradient_in_backward": lm_head_in_backward,
        "vocabulary_kept_sharded": kept_sharded,
        "lm_loss_in_chunks": loss_in_chunks,
        "optimizer_in_backward": in_backward,
        "scheduler_memory_percent": scheduler_percent,
        "parameter_dtype": parameter_dtype,
        "config_dtype": config_dtype,
        "attention": attention or "the config's",
        "compare": args.compare,
        **engine_figures(steps["ours"], the_slice),
    }
    result["hints"] = hints(result)
    if args.compare in steps:
        # [Note: torch_xla's SPMD FSDPv2 beside ours]: the same floor
        result[args.compare] = engine_figures(steps[args.compare], the_slice, floor=result["floor"])
    if args.hlo_out:
        result["hlo_out"] = args.hlo_out
    return result


REFUSED = "the TPU compiler refused it"


def engine_figures(step: Step, the_slice: Slice, floor: Optional[float] = None) -> Dict[str, Any]:
    """One engine's figures with the verdict; ``floor``: the traffic's floor, when not the one its
    step carries."""
    if floor is not None:
        step = replace(step, floor=floor)
    # [Note: what a step needs]: a step fits if the compiler accepts it for the chip. A refused one
    # does not, though its lower bound may be below the chip's HBM: the compiler has less than all
    # of it (Gemma-2-9B on v4-8: 31.27 GiB needed, 30.75 available of 32).
    available = step.hbm_available or the_slice.compiler_hbm
    margin = available - (step.smallest_hbm or step.peak)
    return {**asdict(step), "fits": not step.not_compiled, "margin": margin}


LM_HEAD_KEY = "xla_fsdp_reduce_scatter_in_linear_backward"
SCHEDULER_KEY = "xla_fsdp_tpu_scheduler_memory_percent"
IN_BACKWARD_KEY = "xla_fsdp_optimizer_in_backward"
SCHEDULER_RETRY_PERCENT = 90  # a refused step is compiled again at it ([Note: what a step needs])


def _launch_settings(args: argparse.Namespace) -> Tuple[str, bool, bool, Optional[int]]:
    """Precision and gradient checkpointing: the options, else the launch config file's
    ``mixed_precision`` and ``fsdp_activation_checkpointing``, else fp32 and off; whether the
    config file reduces lm_head's gradient in its backward (for ``hints``); the scheduler's memory
    target, the option's, else the config file's, else None (libtpu's)."""
    precision, checkpointing = args.precision, args.gradient_checkpointing
    scheduler_percent = args.scheduler_memory_percent
    lm_head_in_backward = False
    if args.config_file:
        if not Path(args.config_file).is_file():
            raise PlanError(f"--config_file {args.config_file}: no such file")
        from accelerate.commands.config.config_args import load_config_from_file

        from .hf_accelerate.plugin import check_config_section, parse_bool, parse_percent

        try:
            launch = load_config_from_file(args.config_file)
            section = check_config_section(launch.fsdp_config or {}, source=args.config_file)
            configured_checkpointing = parse_bool(
                "fsdp_activation_checkpointing", section.get("fsdp_activation_checkpointing", False)
            )
            lm_head_in_backward = parse_bool(LM_HEAD_KEY, section.get(LM_HEAD_KEY, False))
            if scheduler_percent is None and section.get(SCHEDULER_KEY) is not None:
                scheduler_percent = parse_percent(SCHEDULER_KEY, section[SCHEDULER_KEY])
        except (ValueError, TypeError) as e:
            raise PlanError(f"--config_file {args.config_file}: {e}") from None
        if precision is None:
            mixed = str(launch.mixed_precision or "no").lower()
            if mixed not in ("no", "bf16"):
                raise PlanError(
                    f"--config_file {args.config_file}: mixed_precision {mixed!r}: XLA FSDP offers no or bf16"
                )
            precision = "bf16" if mixed == "bf16" else "fp32"
        if checkpointing is None:
            checkpointing = configured_checkpointing
    return precision or "fp32", bool(checkpointing), lm_head_in_backward, scheduler_percent


def hints(result: Dict[str, Any]) -> List[str]:
    """What would lower the peak, for a step that does not fit, among what it does not use yet."""
    if result["fits"]:
        return []
    found = []
    if result["precision"] == "fp32":
        found.append("bf16 compute (--precision bf16): gathered weights, activations and gradients in half the bytes")
    if not result["gradient_checkpointing"]:
        found.append("gradient checkpointing (--gradient-checkpointing): activations recomputed in backward")
    if result["batch_per_chip"] > 1:
        found.append("a smaller per-chip batch (--batch), with gradient accumulation for the same global batch")
    # Only in fp32 without checkpointing: checkpointed, the real models' steps planned more with it,
    # and Llama-3.2-1B's bf16 step no less (11.87 against 11.86 GiB on v5e-8; docs/tpu.md).
    loss_could_be_chunked = result["vocabulary_kept_sharded"] and not result["lm_loss_in_chunks"]
    if loss_could_be_chunked and result["precision"] == "fp32" and not result["gradient_checkpointing"]:
        found.append(
            "xla_fsdp_lm_loss_in_chunks: true in the --config_file: the loss computed from lm_head's "
            "chunks, the logits and their gradient never whole (Llama-3.2-1B, fp32, not checkpointed, "
            "on v5e-8: 13.36 against 13.94 GiB; docs/tpu.md)"
        )
    tied_and_gathered = result["tied_embeddings"] and not result["vocabulary_kept_sharded"]
    if tied_and_gathered and not result["lm_head_gradient_in_backward"]:
        found.append(
            f"{LM_HEAD_KEY}: true in the --config_file: this model's lm_head is its embedding, and the "
            "tied table's full gradient is then never held through backward (Llama-3.2-1B on v5e-8, its "
            "tables gathered whole: 3.23 against 4.53 GiB at full depth; docs/tpu.md)"
        )
    refused = result["not_compiled"].startswith(REFUSED)
    if refused and not result["optimizer_in_backward"]:
        found.append(
            f"{IN_BACKWARD_KEY}: true in the --config_file: each unit's AdamW update made in backward, so the "
            "compiler does not hold every reduced gradient to the step's end (Qwen2.5-7B, fp32, checkpointed, on "
            "v5e-8: 14.17 GiB with it, refused without; no gradient clipping; docs/tpu.md)"
        )
    tried = result["scheduler_memory_percent"] or SCHEDULER_RETRY_PERCENT  # plan retries a refusal at 90
    if refused and tried > 1:
        found.append(
            f"{SCHEDULER_KEY} below {tried} in the --config_file (plan --scheduler-memory-percent N to try one; "
            f"the launcher passes it to libtpu as --{tpu_compiler.SCHEDULER_MEMORY_FLAG}): the "
            "lower the share of HBM the TPU compiler's scheduler plans within, the more it orders the step for "
            "memory over overlap (Qwen2.5-7B, fp32, checkpointed, on v5e-8: temp 5,414 MiB at 90, 3,684 at 1; its "
            "cost in step time is not measured; docs/tpu.md)"
        )
    found.append(
        f"more chips: parameters and optimizer state take {result['argument'] / GIB:.1f} GiB per chip here and "
        "shrink with the chips they are sharded over (a larger slice, or a generation with more HBM: v5p has 95 GiB)"
    )
    return found


def format_plan(r: Dict[str, Any]) -> str:
    """The plan as text; with ``--compare``, the other engine's figures in a column beside ours."""

    def gib(x: float) -> str:
        return f"{x / GIB:,.2f} GiB" if abs(x) >= GIB else f"{x / (1 << 20):,.1f} MiB"

    engines = [("ours", r)] + [(ENGINES[k], r[k]) for k in ENGINES if k != "ours" and k in r]
    columns = [(label, e) for label, e in engines if not e["not_compiled"]]

    def prefix(label: str) -> str:
        return "" if len(engines) == 1 else f"{label}: "

    if r["parameter_dtype"] == r["config_dtype"]:
        state = f"parameters and AdamW state in {r['parameter_dtype']}, the config's dtype"
    else:
        state = (
            f"parameters and AdamW state in {r['parameter_dtype']} for both, not the config's {r['config_dtype']}: "
            "SPMD computes in its parameters' dtype"
        )
    precision = f"{'bf16' if r['precision'] == 'bf16' else 'fp32'} compute, {state}"
    depth = f"{r['layers']} decoder layers"
    lines = [
        f"{r['model']}: {r['model_type']}, {_count(r['parameters'])} parameters, {depth}",
        f"on {r['topology']}: {r['chips']} {r['topology'].split('-')[0]} chips of {gib(r['hbm'])} HBM",
        f"step: sequence {r['seq']}, batch {r['batch_per_chip']} per chip, {precision}, "
        f"gradient checkpointing {'on' if r['gradient_checkpointing'] else 'off'}, AdamW"
        + (", the vocabulary's tables kept sharded" if r["vocabulary_kept_sharded"] else "")
        + (", the loss from lm_head's chunks" if r["lm_loss_in_chunks"] else "")
        + (", AdamW stepping each unit in backward" if r["optimizer_in_backward"] else "")
        + (f", settings of {r['config_file']}" if r["config_file"] else ""),
        f"traced at full depth ({depth})" + _attention_note(r),
    ]
    if r["scheduler_memory_percent"] is not None:
        flag = tpu_compiler.libtpu_init_args(r["scheduler_memory_percent"])
        lines.append(f"compiled with LIBTPU_INIT_ARGS={flag} ({SCHEDULER_KEY}), every engine")
    lines += [f"{prefix(label)}not compiled: {e['not_compiled']}" for label, e in engines if e["not_compiled"]]
    for label, e in engines:
        if e["fits_with_scheduler_memory_percent"] is not None:
            flag = tpu_compiler.libtpu_init_args(e["fits_with_scheduler_memory_percent"])
            lines.append(
                f"{prefix(label)}{e['refused_with_libtpu_default']}, with libtpu's own scheduler target; "
                f"compiled again with LIBTPU_INIT_ARGS={flag}"
            )
    if r["compare"] and r["compare"] not in r:
        lines.append(f"{ENGINES[r['compare']]}: not traced (the same parameters and AdamW state per chip)")
    if columns:
        lines += ["", *_figures_table(columns, r["hbm"], gib, labelled=len(engines) > 1)]
    lines.append("")
    for label, e in engines:
        verdict = _verdict(e, r["compiler_hbm"], gib) + ("; to lower the peak:" if e is r and not e["fits"] else "")
        lines.append(f"verdict{'' if len(engines) == 1 else f', {label}'}: {verdict}")
        if e is r:
            lines += [f"  - {h}" for h in r["hints"]]
    lines.append(
        "(the compiler's plan of one step: the TPU runtime keeps some HBM for itself; numerics and speed are "
        "not shown, docs/plan.md)"
    )
    if "hlo_out" in r:
        lines.append(f"the exported program: {r['hlo_out']}")
    return "\n".join(lines)


def _verdict(e: Dict[str, Any], compiler_hbm: float, gib: Any) -> str:
    """One engine's verdict; for a step compiled again at a scheduler target, the setting it needs."""
    verdict = _margin_verdict(e, compiler_hbm, gib)
    percent = e["fits_with_scheduler_memory_percent"]
    if percent is None:
        return verdict
    return (
        f"fits with {SCHEDULER_KEY}: {percent} in the launch config's fsdp_config, and not without it; "
        f"with it, {verdict}"
    )


def _margin_verdict(e: Dict[str, Any], compiler_hbm: float, gib: Any) -> str:
    """Whether it fits, by its margin against the HBM the compiler has ([Note: what a step needs])."""
    available = e["hbm_available"] or compiler_hbm
    has = f"the {gib(available)} of HBM the compiler has per chip"
    if not e["fits"]:
        return f"does NOT fit, {'at least ' if e['not_compiled'] else ''}{gib(-e['margin'])} over {has}"
    if e["smallest_hbm"]:
        return f"fits in {gib(e['smallest_hbm'])} per chip at the least, {gib(e['margin'])} to spare of {has}"
    if e["margin"] >= 0:
        return f"fits, {gib(e['margin'])} to spare of {has} ({e['margin'] / available:.0%}), as planned"
    return (
        f"fits: the compiler accepted it for the {gib(available)} of HBM it has per chip; its peak as planned, "
        f"{gib(-e['margin'])} above that, counts the heap's unused bytes twice (--smallest-hbm: what it needs)"
    )


def _figures_table(columns: List[Tuple[str, Dict[str, Any]]], hbm: int, gib: Any, labelled: bool) -> List[str]:
    """The compiled engines' bytes per chip, a column each, and their traffic; ``labelled``: each
    column and traffic line names its engine (with ``--compare``, even when one was not compiled)."""
    rows = [
        ("arguments (parameter shards, AdamW state, batch)", lambda e: e["argument"]),
        ("output not donated", lambda e: e["output"] - e["alias"]),
        ("temp", lambda e: e["temp"]),
        ("peak", lambda e: e["peak"]),
    ]
    widths = [max(12, len(label)) + 2 for label, _ in columns] if labelled else [12]
    header = "".join(f"{label:>{w}}" for (label, _), w in zip(columns, widths)) if labelled else ""
    lines = [f"{'per chip, as the TPU compiler plans it:':<51}{header}".rstrip()]
    for name, figure in rows:
        cells = "".join(f"{gib(figure(e)):>{w}}" for (_, e), w in zip(columns, widths))
        lines.append(f"  {name:<49}{cells}")
    shares = ", ".join(f"{e['peak'] / hbm:.0%}" for _, e in columns)
    lines[-1] += f"  of {gib(hbm)} HBM ({shares})"
    for label, e in columns:
        counts = ", ".join(f"{c:,.0f} {kind}" for kind, c in e["collectives"].items()) or "none"
        lines.append(
            (f"{label}: " if labelled else "")
            + f"traffic per step, ring model: {gib(e['ring_bytes'])} sent per chip, "
            f"{e['ring_bytes'] / e['floor']:.2f}x the FSDP floor ({gib(e['floor'])}); {counts}"
        )
    return lines


def _count(n: int) -> str:
    return f"{n / 1e9:,.2f} B" if n >= 1e9 else f"{n / 1e6:,.1f} M"


def _eager_for_both(compare: Optional[str], precision: str) -> bool:
    """[Note: torch_xla's SPMD FSDPv2 beside ours]: in bf16 both are traced with eager attention."""
    return compare == "spmd" and precision == "bf16"


def _f32_for_both(compare: Optional[str], precision: str, config_dtype: str) -> Optional[str]:
    """[Note: torch_xla's SPMD FSDPv2 beside ours]: "float32" when fp32 beside SPMD needs both
    engines' parameters made f32 (``config_dtype``, as "bfloat16", is not), else None."""
    return "float32" if compare == "spmd" and precision == "fp32" and config_dtype != "float32" else None


def _attention_note(r: Dict[str, Any]) -> str:
    if r["attention"] == "the config's":
        return ""
    if _eager_for_both(r["compare"], r["precision"]):
        return ", with eager attention for both: SPMD's bf16 autocast needs it"
    return f", with {r['attention']} attention"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="a model folder holding config.json, or the config file")
    parser.add_argument("--topology", required=True, help=f"the slice: {', '.join(sorted(tpu_compiler.TOPOLOGIES))}")
    parser.add_argument("--seq", type=_positive, default=2048, help="sequence length (default 2048)")
    parser.add_argument("--batch", type=_positive, default=1, help="sequences per chip per step (default 1)")
    parser.add_argument(
        "--precision",
        choices=["fp32", "bf16"],
        help="bf16: compute in bfloat16; parameters and AdamW state stay in the config's dtype "
        "(default: the config file's mixed_precision, else fp32)",
    )
    parser.add_argument(
        "--gradient-checkpointing",
        action=argparse.BooleanOptionalAction,
        help="checkpoint every wrapped block (default: the config file's fsdp_activation_checkpointing, else off)",
    )
    parser.add_argument("--config_file", metavar="FILE", help="an `accelerate launch` config file (fsdp_config)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    parser.add_argument(
        "--hlo-out",
        metavar="FILE",
        help="write the exported program compiled (ours)",
    )
    parser.add_argument(
        "--attention",
        choices=["eager", "sdpa"],
        help="the attention implementation traced (default: the config's; eager for both with --compare spmd in bf16)",
    )
    parser.add_argument(
        "--scheduler-memory-percent",
        type=int,
        choices=range(1, 101),
        metavar="N",
        help="the TPU compiler's scheduler plans within N%% of HBM "
        f"(LIBTPU_INIT_ARGS=--{tpu_compiler.SCHEDULER_MEMORY_FLAG}=N; default: the config file's "
        f"{SCHEDULER_KEY}, else libtpu's 95)",
    )
    parser.add_argument(
        "--smallest-hbm",
        action="store_true",
        help="also find the smallest HBM per chip each step compiles in, for the margin (5-12 more compiles each)",
    )
    parser.add_argument(
        "--compare",
        choices=["spmd"],
        help="spmd: also compile torch_xla's SPMD FSDPv2 (SpmdFullyShardedDataParallel) on the same step, "
        "its figures beside ours",
    )


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be at least 1")
    return value


def run(args: argparse.Namespace) -> int:
    result = plan(args)
    print(json.dumps(result) if args.json else format_plan(result))
    return 0


if __name__ == "__main__":  # a trace: python -m accel_xla_fsdp.plan SPEC.json
    spec_file = Path(sys.argv[1])
    out = trace(json.loads(spec_file.read_text()))
    spec_file.with_suffix(".out.json").write_text(json.dumps(out))
