"""What the TPU compiler makes of one collective of a given form and size (the evidence for the
TPU forms in accel_xla_fsdp/_xla.py, [Note: TPU reduce-scatter shapes]; docs/tpu.md).

    bash scripts/ensure_tpu_venv.sh
    .venv/bin/python scripts/tpu_collective_probe.py --chips 4 --topology v5e-4 --mib 4 12 16 --forms flat rows

Forms: ``flat`` a 1-D reduce-scatter (torch_xla's FSDP form); ``rows`` the same elements as
(-1, 128) rows; ``rowspin`` rows with ``pin_layout=True``; ``ag`` an unpinned all-gather of a
shard; ``agpin`` a pinned one (torch_xla's all-reduce form). Sizes are the full tensor's, rounded
down to whole 128-element rows per chip; ``--tiles`` rounds each chip's part to whole (16, 128)
tiles instead. Each probe is its own program (the collective token reset between them).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

import torch
import torch_xla

from accel_xla_fsdp import _xla, tpu_program

ROOT = Path(__file__).resolve().parent.parent


DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def probe(form: str, numel: int, chips: int, dtype: torch.dtype) -> torch.Tensor:
    # device data, a parameter of the program as a shard or a gradient is: the compiler turned a
    # gather of a constant into an all-reduce where it gathered parameters as all-gathers
    full = torch.full((numel,), 2.0, dtype=dtype).to(_xla.device())
    if form in ("ag", "agpin"):
        return _xla.all_gather(full[: numel // chips].view(-1, 128), None, form == "agpin")
    tensor = full if form == "flat" else full.view(-1, 128)
    # 2-D operands go to torch_xla as they are; the 1-D one as torch_xla's FSDP issues it
    return _xla._native_reduce_scatter(tensor, chips, 1.0 / chips, [list(range(chips))], form == "rowspin")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chips", type=int, default=4)
    parser.add_argument("--topology", action="append", required=True)
    parser.add_argument("--mib", type=float, nargs="+", default=[4, 12, 16])
    parser.add_argument("--forms", nargs="+", default=["flat", "rows", "ag", "agpin"])
    parser.add_argument("--tiles", action="store_true")
    parser.add_argument("--rows", type=int, nargs="+", help="each chip's part, in 128-element rows")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="f32")
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]
    size = dtype.itemsize
    out = Path(tempfile.mkdtemp())
    unit = 128 * (16 if args.tiles else 1) * args.chips
    paths = []
    device = str(torch_xla.device())
    with _xla.tracing_replica(0, args.chips, "TPU"):
        token = torch_xla._XLAC._get_all_reduce_token(device)
        sizes = {f"{r}rows": r * 128 * args.chips for r in args.rows or []}
        sizes = sizes or {f"{mib}MiB": int(mib * (1 << 20)) // size // unit * unit for mib in args.mib}
        for name, numel in sizes.items():
            for form in args.forms:
                torch_xla._XLAC._set_all_reduce_token(device, token)
                path = out / f"{form}_{args.dtype}_{name}.hlo"
                tpu_program.export_step([probe(form, numel, args.chips, dtype)], None, path)
                paths.append(str(path))
    topologies = [a for t in args.topology for a in ("--topology", t)]
    python = ROOT / ".tpu-venv" / "bin" / "python"
    done = subprocess.run(
        [str(python), str(ROOT / "accel_xla_fsdp" / "tpu_compiler.py"), *paths, *topologies, "--json"],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise SystemExit(f"tpu_compiler.py failed ({done.returncode}):\n{done.stderr[-3000:]}")
    print("| probe | topology | compiled to |")
    print("| --- | --- | --- |")
    for line in done.stdout.splitlines():
        r = json.loads(line)
        kinds = ", ".join(f"{k} x{c['count']}" for k, c in sorted(r["collectives"].items()))
        print(f"| {Path(r['program']).stem} | {r['topology']} | {kinds} |")


if __name__ == "__main__":
    main()
