"""Bytes per chip of one training step as the TPU compiler plans it: ours against torch_xla's FSDPs.

One run traces, for each topology and precision, the same training step (forward, backward, AdamW
with its state present) of issue 25's Llama six ways, compiles each with libtpu for the topology
(``accel_xla_fsdp/tpu_compiler.py`` in ``.tpu-venv``), and prints a table of MB per chip
(argument, output, alias, temp, peak) and collectives, and draws them into a plot:

* **ours, flat**, **ours, per-parameter** (1-D shards), **ours, dim 0** (per-parameter shards on
  dim 0) and **ours, TPU default** (dim 0 with the vocabulary's tables kept sharded, the
  Accelerate plugin's TPU default): this engine, each decoder layer a unit, traced as replica 0
  of the chips in the TPU form (``_xla.tracing_replica``);
* **torch_xla FSDP**: ``torch_xla.distributed.fsdp.XlaFullyShardedDataParallel`` with its own
  defaults, each decoder layer a unit, traced as replica 0 with explicit sharding groups (it then
  never asks the one-replica runtime here for its rank; ``XLA_ALWAYS_ALLREDUCE`` keeps its
  all-reduces, which torch_xla skips for one replica);
* **torch_xla SPMD FSDPv2**: ``SpmdFullyShardedDataParallel`` over a mesh of the chips (XLA:CPU
  devices here, one per chip), batch sharded along it, each decoder layer wrapped, as in
  ``scripts/benchmark.py``; its program is the whole SPMD program, which the compiler partitions
  (``tpu_program.export_spmd_training_step``, as ``accel-xla-fsdp plan --compare spmd`` traces it).

bf16 compute: ``compute_dtype=torch.bfloat16`` for the FSDPs (parameters, gradients and AdamW state
stay f32), ``torch.autocast("xla", torch.bfloat16)`` for SPMD (it has no compute dtype).

    bash scripts/ensure_tpu_venv.sh
    .venv/bin/python scripts/tpu_benchmark.py --topology v5e-8 --plot docs/tpu_benchmark.png

Every trace and compile is a process of its own (a fresh model, torch_xla and jaxlib apart);
``--lock FILE`` runs each under ``flock FILE`` (a shared machine's large-memory lock: a 4-layer
step needs 2-4 GB). Peak = argument + output - alias + temp, per chip, as ``tpu_compiler`` reports.
``--smallest-hbm`` adds the smallest HBM each step compiles in, the compiler capped (``tpu_compiler``'s
[Note: the smallest HBM a step compiles in]): what the step needs, where the peak is what the
compiler plans with HBM to spare.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
CHIPS = {"v4-8": 4, "v4-16": 8, "v5e-4": 4, "v5e-8": 8, "v5p-8": 4, "v6e-4": 4, "v6e-8": 8}


@dataclass(frozen=True)
class Variant:
    label: str
    spmd: bool = False  # an SPMD program (partitioned by the compiler), else one replica's


VARIANTS: Dict[str, Variant] = {
    "ours-flat": Variant("ours, flat"),
    "ours": Variant("ours, per-parameter"),
    "ours-dim0": Variant("ours, dim 0"),
    "ours-tpu": Variant("ours, TPU default"),
    "torch_xla-fsdp": Variant("torch_xla FSDP"),
    "torch_xla-spmd": Variant("torch_xla SPMD FSDPv2", spmd=True),
}
PRECISIONS = ("fp32", "bf16")


# ---------------------------------------------------------------------------------------------
# Tracing (each in a process of its own: ``--trace VARIANT``)


def llama_config(args: argparse.Namespace):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 64,
        vocab_size=args.vocab,
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation="eager",
    )


def checkpointed(wrapper: Any, checkpoint_module: Any) -> Any:
    """An ``auto_wrapper_callable`` that checkpoints each unit it wraps."""
    return lambda m, *a, **kw: wrapper(checkpoint_module(m), *a, **kw)


def trace_ours(args: argparse.Namespace, path: Path, flat: bool, dim0: bool, keep_vocabulary: bool) -> float:
    import torch
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from accel_xla_fsdp import XlaFullyShardedDataParallel as FSDP
    from accel_xla_fsdp import _xla, checkpoint_module, predicate_policy, seeded, tpu_program, transformer_block_policy

    with _xla.tracing_replica(0, args.chips, "TPU"):
        with seeded(0):
            model = LlamaForCausalLM(llama_config(args))
        policy = transformer_block_policy()
        if args.embedding_units:
            ends = (model.get_input_embeddings(), model.get_output_embeddings())
            policy = predicate_policy(lambda m: isinstance(m, LlamaDecoderLayer) or any(m is e for e in ends))
        wrapper = checkpointed(FSDP, checkpoint_module) if args.checkpoint else None
        model = FSDP(
            model,
            auto_wrap_policy=policy,
            auto_wrapper_callable=wrapper,
            flatten_parameters=flat,
            shard_param_on_dim_0=dim0,
            compute_dtype=torch.bfloat16 if args.precision == "bf16" else None,
            **{"keep_vocabulary_sharded": keep_vocabulary, **json.loads(args.options)},
        )
        ids = _xla.placeholder((1, args.seq), torch.long)
        tpu_program.export_training_step(model, ids, path, optimizer_in_backward=args.optimizer_in_backward)
        return tpu_program.communication_floor(model)


def trace_torch_xla_fsdp(args: argparse.Namespace, path: Path) -> None:
    import torch
    import torch_xla
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel, checkpoint_module
    from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from accel_xla_fsdp import _xla, tpu_program

    torch.manual_seed(0)
    device = torch_xla.device()
    model = LlamaForCausalLM(llama_config(args)).to(device)
    replica = {"sharding_groups": [list(range(args.chips))], "sharding_rank": 0, "sharding_world_size": args.chips}
    if args.precision == "bf16":
        replica["compute_dtype"] = torch.bfloat16
    wrapper = (
        (lambda m, *a, **kw: XlaFullyShardedDataParallel(checkpoint_module(m), *a, **kw)) if args.checkpoint else None
    )
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    model = XlaFullyShardedDataParallel(model, auto_wrap_policy=policy, auto_wrapper_callable=wrapper, **replica)
    ids = _xla.placeholder((1, args.seq), torch.long)
    tpu_program.export_training_step(model, ids, path)


def trace_spmd(args: argparse.Namespace, path: Path) -> None:
    import torch
    from transformers import LlamaForCausalLM

    from accel_xla_fsdp import tpu_program

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(args))
    tpu_program.export_spmd_training_step(
        model, args.chips, 1, args.seq, path, checkpoint=args.checkpoint, autocast=args.precision == "bf16"
    )


def trace(args: argparse.Namespace) -> None:
    path = Path(args.out)
    floor = None
    if args.trace.startswith("ours"):
        dim0 = args.trace in ("ours-dim0", "ours-tpu")
        floor = trace_ours(args, path, args.trace == "ours-flat", dim0, keep_vocabulary=args.trace == "ours-tpu")
    elif args.trace == "torch_xla-fsdp":
        trace_torch_xla_fsdp(args, path)
    else:
        trace_spmd(args, path)
    path.with_suffix(".json").write_text(json.dumps({"floor": floor}))


# ---------------------------------------------------------------------------------------------
# The run: traces and compiles as processes, the table and the plot


def _locked(cmd: List[str], lock: Optional[str]) -> List[str]:
    return ["flock", lock, *cmd] if lock else cmd


def trace_env(variant: str, chips: int) -> Dict[str, str]:
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    if variant == "torch_xla-spmd":
        sys.path.insert(0, str(ROOT))
        from accel_xla_fsdp import _xla

        env.update(_xla.cpu_device_env(chips))
    if variant == "torch_xla-fsdp":
        env["XLA_ALWAYS_ALLREDUCE"] = "1"  # torch_xla skips all-reduces when its runtime has one replica
    return env


def run_trace(args: argparse.Namespace, variant: str, precision: str, chips: int, out: Path) -> Path:
    path = out / f"{variant}.{precision}.{chips}.hlo"
    model = ["--hidden", args.hidden, "--intermediate", args.intermediate, "--layers", args.layers]
    model += ["--vocab", args.vocab, "--seq", args.seq, "--options", args.options]
    cmd = [sys.executable, __file__, "--trace", variant, "--precision", precision, "--chips", str(chips)]
    cmd += [str(a) for a in model] + ["--out", str(path)] + (["--checkpoint"] if args.checkpoint else [])
    cmd += ["--embedding-units"] if args.embedding_units else []
    cmd += ["--optimizer-in-backward"] if args.optimizer_in_backward else []
    print(f"tracing {variant} {precision} for {chips} chips", file=sys.stderr, flush=True)
    subprocess.run(_locked(cmd, args.lock), env=trace_env(variant, chips), check=True, capture_output=not args.verbose)
    return path


def run_compile(
    args: argparse.Namespace, programs: Sequence[Path], topology: str, spmd: bool, smallest: bool = False
) -> List[dict]:
    """The compiler's report of each program; with ``smallest``, the smallest HBM each compiles in."""
    python = ROOT / ".tpu-venv" / "bin" / "python"
    cmd = [str(python), str(ROOT / "accel_xla_fsdp" / "tpu_compiler.py"), *map(str, programs)]
    cmd += ["--topology", topology, "--json"] + (["--spmd"] if spmd else [])
    if smallest:
        cmd += ["--smallest-hbm"]
    elif args.dump_to:
        cmd += ["--dump-to", f"{args.dump_to}/{topology}{'-spmd' if spmd else ''}", "--temp", str(args.temp)]
    what = "the smallest HBM of" if smallest else "compiling"
    print(f"{what} {len(programs)} programs for {topology}", file=sys.stderr, flush=True)
    done = subprocess.run(_locked(cmd, args.lock), capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"compiling failed:\n{done.stderr[-4000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def collectives(report: dict) -> str:
    kinds = sorted(report["collectives"].items())
    return ", ".join(f"{c['count']} {kind}" for kind, c in kinds) or "none"


def table(rows: List[dict]) -> str:
    mb = 1e6
    smallest = any("smallest_hbm_mib" in r for r in rows)
    head = "| topology | precision | program | argument | output | alias | temp | peak |"
    rule = "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"
    head += " smallest HBM (MiB) |" if smallest else ""
    rule += " ---: |" if smallest else ""
    lines = [head + " collectives | ring traffic |", rule + " --- | ---: |"]
    for r in rows:
        figures = " | ".join(f"{r[k] / mb:,.1f}" for k in ("argument", "output", "alias", "temp", "peak"))
        figures += f" | {r.get('smallest_hbm_mib', '')}" if smallest else ""
        floor = f" ({r['ring_bytes'] / r['floor']:.3f}x floor)" if r.get("floor") else ""
        lines.append(
            f"| {r['topology']} | {r['precision']} | {VARIANTS[r['variant']].label} | {figures} | "
            f"{collectives(r)} | {r['ring_bytes'] / mb:,.1f}{floor} |"
        )
    return "\n".join(lines)


def plot(rows: List[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["topology"], r["precision"]) for r in rows}, key=lambda g: (g[0], PRECISIONS.index(g[1])))
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 4.2), sharey=True, squeeze=False)
    parts = (("argument", "arguments (shards, optimizer state, batch)", "tab:blue"), ("temp", "temp", "tab:orange"))
    for ax, (topology, precision) in zip(axes[0], groups):
        mine = [r for r in rows if (r["topology"], r["precision"]) == (topology, precision)]
        labels = [VARIANTS[r["variant"]].label.replace(", ", "\n").replace("torch_xla ", "torch_xla\n") for r in mine]
        bottom = [0.0] * len(mine)
        for key, label, color in parts:
            values = [r[key] / 1e6 for r in mine]
            ax.bar(labels, values, bottom=bottom, label=label, color=color)
            bottom = [b + v for b, v in zip(bottom, values)]
        extra = [(r["output"] - r["alias"]) / 1e6 for r in mine]
        ax.bar(labels, extra, bottom=bottom, label="output not aliased", color="tab:gray")
        for x, r in enumerate(mine):
            ax.text(x, r["peak"] / 1e6, f"{r['peak'] / 1e6:,.0f}", ha="center", va="bottom", fontsize=8)
        ax.set_title(f"{topology}, {precision}")
        ax.tick_params(axis="x", labelsize=7)
    axes[0][0].set_ylabel("MB per chip (peak = stacked bars)")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The traced Llama's shape (issue 25's by default) and its gradient checkpointing."""
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--checkpoint", action="store_true", help="checkpoint each decoder layer")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--topology", action="append", help="v5e-8 (default), v4-8, ... (tpu_compiler.TOPOLOGIES)")
    p.add_argument("--variant", action="append", choices=list(VARIANTS), help="default: all six")
    p.add_argument("--precision", action="append", choices=PRECISIONS, help="default: fp32 and bf16")
    add_model_arguments(p)
    p.add_argument("--options", default="{}", help="more of our FSDP options, as JSON (ours only)")
    p.add_argument("--embedding-units", action="store_true", help="ours: the embedding and lm_head units of their own")
    p.add_argument("--optimizer-in-backward", action="store_true", help="ours: AdamW steps each unit in backward")
    p.add_argument("--lock", help="run each trace and compile under `flock LOCK`")
    p.add_argument("--dump-to", help="keep the compiler's dumps (buffer assignments) under this directory")
    p.add_argument("--temp", type=int, default=8, help="with --dump-to: print the N largest values at the temp's peak")
    p.add_argument("--keep", help="keep the traced programs in this directory")
    p.add_argument(
        "--smallest-hbm",
        action="store_true",
        help="also the smallest HBM each step compiles in (tpu_compiler.py --smallest-hbm; 5-10 compiles each)",
    )
    p.add_argument("--plot", help="write the plot here (png)")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--verbose", action="store_true", help="show the traces' output")
    p.add_argument("--trace", choices=list(VARIANTS), help=argparse.SUPPRESS)
    p.add_argument("--chips", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trace:
        args.precision = args.precision[0]
        trace(args)
        return
    topologies = args.topology or ["v5e-8"]
    variants = args.variant or list(VARIANTS)
    precisions = args.precision or list(PRECISIONS)
    out = Path(args.keep or tempfile.mkdtemp(prefix="tpu-benchmark-"))
    out.mkdir(parents=True, exist_ok=True)
    rows: List[dict] = []
    for topology in topologies:
        chips = CHIPS[topology]
        traced = {(v, pr): run_trace(args, v, pr, chips, out) for pr in precisions for v in variants}
        for spmd in (False, True):
            mine = {k: path for k, path in traced.items() if VARIANTS[k[0]].spmd == spmd}
            if not mine:
                continue
            reports = run_compile(args, list(mine.values()), topology, spmd)
            smallest = []
            if args.smallest_hbm:
                smallest = run_compile(args, list(mine.values()), topology, spmd, smallest=True)
            for n, ((variant, precision), report) in enumerate(zip(mine, reports)):
                floor = json.loads(mine[variant, precision].with_suffix(".json").read_text())["floor"]
                rows.append({**report, "variant": variant, "precision": precision, "floor": floor})
                if smallest:
                    rows[-1]["smallest_hbm_mib"] = smallest[n]["smallest_hbm_mib"]
    order = {v: i for i, v in enumerate(VARIANTS)}
    rows.sort(key=lambda r: (r["topology"], PRECISIONS.index(r["precision"]), order[r["variant"]]))
    model = f"Llama hidden {args.hidden}, intermediate {args.intermediate}, {args.layers} layers, vocab {args.vocab}"
    model += f", seq {args.seq}, batch 1 per chip{', checkpointed' if args.checkpoint else ''}"
    print(f"{model}: MB per chip (peak = argument + output - alias + temp)\n")
    print(table(rows))
    for r in rows:
        if "temp_at_peak" in r:
            print(f"\n{r['topology']}, {r['precision']}, {VARIANTS[r['variant']].label}:\n{r['temp_at_peak']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.plot:
        plot(rows, Path(args.plot), f"One training step per chip as libtpu plans it\n{model}")


if __name__ == "__main__":
    main()
