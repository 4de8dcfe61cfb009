"""The ``accel-xla-fsdp`` command (installed with the package; also ``python -m accel_xla_fsdp``).

    accel-xla-fsdp launch [accelerate launch's arguments] SCRIPT [ARGS]
    accel-xla-fsdp consolidate CKPT_DIR OUT_DIR [--max-shard-size 5GB] [--config PATH]
                               [--dtype bfloat16] [--optimizer] [--overwrite]
    accel-xla-fsdp convert-torch-xla INPUT OUT_DIR [--max-shard-size 5GB] [--config PATH]
                                     [--dtype bfloat16] [--overwrite]
    accel-xla-fsdp plan MODEL --topology v5e-8 [--seq 2048] [--batch 1] [--precision bf16]
                        [--gradient-checkpointing] [--config_file FILE] [--json] [--hlo-out FILE]

Bad input (a ``CheckpointError``, an OS error) or bad arguments end the command with a message
and a non-zero exit status (1, or 2 for arguments), without a traceback.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, List, Optional

CONSOLIDATE_HELP = """\
Write the model of a sharded checkpoint (the directory given to save_sharded, or the folder given
to Accelerate's save_state: the first model of its complete save) in the Hugging Face layout:
OUT_DIR/model.safetensors, or model-0000i-of-0000N.safetensors files and
model.safetensors.index.json when the model is larger than --max-shard-size. Streams: tensors
are read and written in pieces of at most 32 MiB, so memory use does not grow with the model.

With --config, the config is written beside the weights (config.json) and its model class decides
the names: tied weights are written once under the name transformers keeps (e.g.
model.embed_tokens.weight, not lm_head.weight) and persistent buffers are written; the checkpoint
must fit that model. Without --config every parameter is written under its first name and NO
buffer is written (which buffers are persistent cannot be known): put the model's config.json
in OUT_DIR before from_pretrained(OUT_DIR), or pass --config.

OUT_DIR is left as it was on error: the files are written into OUT_DIR/.consolidating-* and
moved in (renamed) once complete and checked against the rank files' checksums; only then are
the files of a model it held removed. A consolidation killed midway leaves that folder, which the
next one into OUT_DIR removes or finishes. Everything else (the files belong together and to one
run, every metadata field, OUT_DIR writable with room) is checked before anything is written.
Bad input ends with a message naming the file and the field, and exit status 1.
"""


CONVERT_HELP = """\
Write a torch_xla-format FSDP checkpoint in the Hugging Face layout, as consolidate does for ours:
torch_xla FSDP scripts' rank files (*_rank-<r>-of-<N>.pth, {"model": ..., "shard_metadata": ...})
or the Trainer's rank<r>-of-<N>-pytorch_model.bin. INPUT is their directory or one of them. The
files are read with torch.load(weights_only=True, mmap=True): a file that would need code to
load is refused, never run.
"""


def _size(text: str) -> int:
    from .checkpoint.consolidate import parse_max_shard_size

    try:
        return parse_max_shard_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_output_options(parser: argparse.ArgumentParser) -> None:
    """The options of the Hugging Face folder written (both commands)."""
    parser.add_argument(
        "--max-shard-size",
        type=_size,
        default="5GB",
        metavar="SIZE",
        help="largest weights file, e.g. 5GB, 500MB or a number of bytes (default: 5GB)",
    )
    parser.add_argument(
        "--config",
        metavar="PATH",
        help="model config (config.json or a folder holding one) to write beside the weights; "
        "without it no buffers are written and tied weights keep their first name",
    )
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        help="cast floating tensors to this dtype (default: as saved)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a model already in OUT_DIR")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="accel-xla-fsdp", description="accel-xla-fsdp's tools: launch, checkpoints, plans for TPU slices."
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser(
        "launch",
        help="run a script unchanged on the engine (accelerate launch's arguments)",
        description=LAUNCH_HELP,
        add_help=False,
    )
    c = commands.add_parser(
        "consolidate",
        help="write a sharded checkpoint as a Hugging Face model folder",
        description=CONSOLIDATE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    c.add_argument(
        "checkpoint_dir",
        metavar="CKPT_DIR",
        help="the checkpoint directory given to save_sharded, or a folder given to Accelerate's save_state "
        "(its first model); a path or a URL: s3://, gs://, ...",
    )
    c.add_argument("output_dir", metavar="OUT_DIR", help="the folder to write the model into (created; or a URL)")
    _add_output_options(c)
    c.add_argument(
        "--optimizer",
        action="store_true",
        help="also write the full optimizer state: optimizer.safetensors (<param name>.<state>) "
        "and optimizer.json (type, hyper-parameters, parameter names)",
    )
    c.set_defaults(run=_consolidate)
    t = commands.add_parser(
        "convert-torch-xla",
        help="write torch_xla FSDP (or Trainer) rank files as a Hugging Face model folder",
        description=CONVERT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    t.add_argument("input", metavar="INPUT", help="the directory holding the rank files, or one of them")
    t.add_argument("output_dir", metavar="OUT_DIR", help="the folder to write the model into (created)")
    _add_output_options(t)
    t.set_defaults(run=_convert)
    from .plan import PLAN_HELP, add_arguments

    p = commands.add_parser(
        "plan",
        help="compile a training step for a TPU slice (no TPU, no weights): does the model fit?",
        description=PLAN_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(run=_plan)
    return parser


def _consolidate(args: argparse.Namespace) -> int:
    from .checkpoint.consolidate import consolidate

    out = consolidate(
        _sharded_model(args.checkpoint_dir),
        args.output_dir,
        max_shard_size=args.max_shard_size,
        config=args.config,
        dtype=args.dtype,
        optimizer=args.optimizer,
        overwrite=args.overwrite,
        progress=args.progress,
    )
    print(f"wrote {out}")
    return 0


def _sharded_model(checkpoint_dir: str) -> Any:
    """CKPT_DIR, or for a folder given to ``save_state`` the first model of its complete save
    (its ``state-<n>/`` changes with every save: [Note: save_state folders])."""
    from .checkpoint.store import Location
    from .hf_accelerate.checkpoints import STATE_RECORD, complete_state, sharded_dir

    folder = Location.of(checkpoint_dir)
    return sharded_dir(complete_state(folder), 0) if STATE_RECORD in folder.names() else checkpoint_dir


def _convert(args: argparse.Namespace) -> int:
    from .checkpoint.consolidate import convert_torch_xla

    out = convert_torch_xla(
        args.input,
        args.output_dir,
        max_shard_size=args.max_shard_size,
        config=args.config,
        dtype=args.dtype,
        overwrite=args.overwrite,
        progress=args.progress,
    )
    print(f"wrote {out}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from .plan import PlanError, run

    try:
        return run(args)
    except PlanError as e:
        print(f"accel-xla-fsdp plan: error: {e}", file=sys.stderr)
        return 1


LAUNCH_HELP = """\
Run SCRIPT unchanged on accel-xla-fsdp's engine: `accelerate launch`'s arguments and config file
(distributed_type: XLA, our fsdp_config keys), then the script and its arguments. Accelerate's
Accelerator, transformers' Trainer and every subclass of it (TRL's trainers) are accel-xla-fsdp's
in every replica. `accel-xla-fsdp launch --help` lists Accelerate's arguments."""


def _launch(argv: List[str]) -> int:
    from .launcher import LaunchError, launch

    try:
        return launch(argv)
    except LaunchError as e:
        print(f"accel-xla-fsdp launch: error: {e}", file=sys.stderr)
        return 1


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["launch"]:  # every argument after it is Accelerate's parser's
        return _launch(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    from .checkpoint.format import CheckpointError

    try:
        return args.run(args)
    except (CheckpointError, OSError) as e:
        print(f"accel-xla-fsdp {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"accel-xla-fsdp {args.command}: interrupted (nothing written)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
