"""Print what XLA compiled for one FSDP training step: collectives, barriers, bytes per device.

Compiles one step of a model wrapped by this engine on each ``--devices`` count of XLA:CPU
devices, and one step of the same model unwrapped on one device (for the ideal, see
``hlo_dump.ideal_bytes``), and prints a markdown table.

    .venv/bin/python scripts/hlo_report.py --model llama --devices 2 4
    .venv/bin/python scripts/hlo_report.py --model blocks --layers 8 --no-barriers --devices 2

Models: ``llama``, a tiny ``transformers`` LlamaForCausalLM (byte vocabulary, one FSDP unit per
decoder layer, as tests/models.py wraps it); ``blocks``, ``--layers`` residual MLP blocks of width
``--hidden``, one unit each (as tests/test_compiled_program.py).
"""

from __future__ import annotations

import argparse
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.nn as nn
from hlo_dump import StepDumper, StepReport, TrainingStep, ideal_bytes

# Model classes are imported before the replica threads start: transformers' lazy imports are not
# thread-safe.
from transformers import LlamaConfig, LlamaForCausalLM

from accel_xla_fsdp import XlaFullyShardedDataParallel, _xla, seeded, transformer_block_policy

VOCAB = 256


@dataclass(frozen=True)
class Spec:
    model: str
    layers: int
    hidden: int
    batch: int  # per device
    seq_len: int
    optimizer: str
    flatten: bool
    barriers: bool


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Blocks(nn.Module):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(width) for _ in range(layers)))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def make_model(spec: Spec) -> nn.Module:
    with seeded(0):
        if spec.model == "blocks":
            return Blocks(spec.layers, spec.hidden)
        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=spec.hidden,
            intermediate_size=2 * spec.hidden,
            num_hidden_layers=spec.layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=max(64, spec.seq_len),
            tie_word_embeddings=False,
            use_cache=False,
            attn_implementation="eager",
        )
        return LlamaForCausalLM(config)


def wrap(model: nn.Module, spec: Spec) -> XlaFullyShardedDataParallel:
    kwargs = dict(
        flatten_parameters=spec.flatten,
        optimization_barrier_in_forward=spec.barriers,
        optimization_barrier_in_backward=spec.barriers,
    )
    if spec.model == "llama":
        return XlaFullyShardedDataParallel(model, auto_wrap_policy=transformer_block_policy(), **kwargs)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = XlaFullyShardedDataParallel(block, **kwargs)
    return XlaFullyShardedDataParallel(model, **kwargs)


def build(rank: int, world: int, spec: Spec, sharded: bool) -> TrainingStep:
    """The model (FSDP-wrapped, or plain on this device), its optimizer and its loss on one batch."""
    model = make_model(spec)
    model = wrap(model, spec) if sharded else model.to(_xla.device())
    params = model.parameters()
    optimizer = torch.optim.SGD(params, lr=0.1) if spec.optimizer == "sgd" else torch.optim.AdamW(params, lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    if spec.model == "blocks":
        x = torch.randn(spec.batch, spec.hidden, generator=gen)
        return TrainingStep(model, optimizer, lambda: model(x.to(_xla.device())).square().mean())
    ids = torch.randint(0, VOCAB, (spec.batch, spec.seq_len), generator=gen)
    return TrainingStep(
        model, optimizer, lambda: model(input_ids=ids.to(_xla.device()), labels=ids.to(_xla.device())).loss
    )


def report(spec: Spec, num_devices: int, sharded: bool, dump_dir: Optional[Path]) -> StepReport:
    with StepDumper(num_devices, dump_dir) as dumper:
        return dumper.report(functools.partial(build, spec=spec, sharded=sharded))


def kib(n: int) -> str:
    return f"{n / 1024:,.1f} KiB"


def table(spec: Spec, unsharded: StepReport, sharded: List[StepReport]) -> str:
    columns = [f"{r.num_devices} devices" for r in sharded] + ["1 device, no FSDP"]
    reports = sharded + [unsharded]

    def row(label: str, cell) -> str:
        return f"| {label} | " + " | ".join(cell(r) for r in reports) + " |"

    def collectives(kind: str):
        return lambda r: f"{getattr(r.program, kind).count} ({kib(getattr(r.program, kind).result_bytes)})"

    ideal = {r.num_devices: ideal_bytes(r, unsharded) for r in sharded}
    lines = [
        f"{spec.model}, {spec.layers} layers, hidden {spec.hidden}, {spec.optimizer}, flatten={spec.flatten}, "
        f"barriers={spec.barriers}, batch {spec.batch} per device"
        + (f" x {spec.seq_len} tokens" if spec.model == "llama" else ""),
        "",
        "| per device | " + " | ".join(columns) + " |",
        "| --- |" + " --- |" * len(columns),
        row("program", lambda r: f"`{r.program.module}`"),
        row("all-gathers (bytes of results)", collectives("all_gathers")),
        row("reduce-scatters (bytes of results)", collectives("reduce_scatters")),
        row("all-reduces (bytes of results)", collectives("all_reduces")),
        row("opt-barriers traced / compiled", lambda r: f"{r.program.opt_barriers_traced} / {r.program.opt_barriers}"),
        row("total bytes used", lambda r: kib(r.program.total_bytes)),
        row("all-gather results live at the peak", lambda r: kib(r.program.peak_gathered_bytes)),
        row("parameters + gradients + optimizer state", lambda r: kib(r.state_bytes)),
        row("ideal", lambda r: kib(ideal[r.num_devices]) if r in sharded else ""),
        row("total / ideal", lambda r: f"{r.program.total_bytes / ideal[r.num_devices]:.2f}x" if r in sharded else ""),
    ]
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, nargs="+", default=[2, 4], help="XLA:CPU device counts")
    p.add_argument("--model", choices=["llama", "blocks"], default="llama")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--batch", type=int, default=2, help="rows per device")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per row (llama)")
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    p.add_argument(
        "--flatten",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one flat shard per FSDP unit (flatten_parameters)",
    )
    p.add_argument(
        "--no-barriers",
        action="store_true",
        help="optimization_barrier_in_forward=False, optimization_barrier_in_backward=False",
    )
    p.add_argument("--dump-dir", type=Path, help="keep the dumps here (one subdirectory per run)")
    args = p.parse_args()
    if min(args.devices + [args.layers, args.hidden, args.batch, args.seq_len]) < 1:
        p.error("--devices, --layers, --hidden, --batch and --seq-len must be positive")
    return args


def main() -> None:
    args = parse_args()
    spec = Spec(
        model=args.model,
        layers=args.layers,
        hidden=args.hidden,
        batch=args.batch,
        seq_len=args.seq_len,
        optimizer=args.optimizer,
        flatten=args.flatten,
        barriers=not args.no_barriers,
    )
    dump = (lambda name: args.dump_dir / name) if args.dump_dir else (lambda name: None)
    unsharded = report(spec, 1, sharded=False, dump_dir=dump("unsharded"))
    sharded = [report(spec, n, sharded=True, dump_dir=dump(f"{n}dev")) for n in args.devices]
    print(table(spec, unsharded, sharded))


if __name__ == "__main__":
    main()
