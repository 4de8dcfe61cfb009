"""What the TPU compiler makes of one training step of a Llama wrapped by this engine.

Traces replica 0 of the topology's chips in the TPU form (``_xla.tracing_replica``), exports the
step (``tpu_program.export_step``: forward, backward, AdamW with its state present, each decoder
layer a unit), compiles it for the topology in the compiler's venv and prints bytes per chip and
the collectives, with the ring traffic against the FSDP floor.

    bash scripts/ensure_tpu_venv.sh
    .venv/bin/python scripts/tpu_report.py --topology v5e-8 --chips 8 --hidden 1024 --layers 4

Defaults: the model of issue 25 (hidden 1024, intermediate 2816, 4 layers, vocab 32000, untied,
sequence 512, batch 1 per chip). A 117 M-parameter step needs about 4 GB to trace and compile.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

import tpu_benchmark  # scripts/ is this script's path

ROOT = Path(__file__).resolve().parent.parent


def export(args: argparse.Namespace, path: Path) -> float:
    """Export the step (as tpu_benchmark.py traces ours); returns its communication floor (bytes per chip)."""
    args.precision = "bf16" if args.bf16 else "fp32"
    args.options, args.embedding_units = "{}", False
    return tpu_benchmark.trace_ours(args, path, flat=args.flat, dim0=args.dim0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topology", default="v5e-8")
    parser.add_argument("--chips", type=int, default=8, help="the topology's chips (v4-8: 4, v5e-8: 8)")
    tpu_benchmark.add_model_arguments(parser)
    parser.add_argument("--flat", action="store_true", help="flat shards (default: per parameter)")
    parser.add_argument("--dim0", action="store_true", help="per-parameter shards on dim 0 (the plugin's TPU default)")
    parser.add_argument("--bf16", action="store_true", help="compute_dtype=torch.bfloat16")
    parser.add_argument("--hlo-out", help="keep the exported program here")
    args = parser.parse_args()
    path = Path(args.hlo_out or tempfile.mkdtemp()) / "step.hlo" if not args.hlo_out else Path(args.hlo_out)
    floor = export(args, path)
    python = ROOT / ".tpu-venv" / "bin" / "python"
    done = subprocess.run(
        [
            str(python),
            str(ROOT / "accel_xla_fsdp" / "tpu_compiler.py"),
            str(path),
            "--topology",
            args.topology,
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    report = json.loads(done.stdout.splitlines()[-1])
    mb = 1e6
    layout = "flat" if args.flat else "dim 0" if args.dim0 else "per-parameter"
    print(f"{args.topology}, {layout}, {'bf16' if args.bf16 else 'fp32'}"
          f"{', checkpointed' if args.checkpoint else ''}: MB per chip")  # fmt: skip
    for key in ("argument", "output", "alias", "temp", "code", "peak"):
        print(f"  {key}: {report[key] / mb:,.1f}")
    for kind, c in sorted(report["collectives"].items()):
        print(f"  {kind}: {c['count']}, {c['bytes'] / mb:,.1f} MB, ring {c['ring_bytes'] / mb:,.1f} MB")
    print(f"  ring traffic {report['ring_bytes'] / mb:,.1f} MB = {report['ring_bytes'] / floor:.3f}x the FSDP floor")


if __name__ == "__main__":
    main()
