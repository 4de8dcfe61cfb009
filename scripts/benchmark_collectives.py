"""Per-parameter shards on the benchmark's Llama: does ``coalesce_all_gather_ops`` or
``reduce_scatter_bucket_size_mb=25`` (torch_xla's typical value) help on XLA:CPU devices?

The same runs as scripts/benchmark.py (its Settings, model, data and timing: each (variant, N) in
a fresh process, the median step after two warm-up steps), for four variants of
``flatten_parameters=False``: plain (``ours``), coalesced gathers, 25 MiB buckets, and both, at 2
and 4 devices. The first round dumps the compiled step (collectives, ``Total bytes used``); the
rounds after it only time. Writes a markdown table (default docs/collectives.md) and prints it.

    PYTHONPATH=. .venv/bin/python scripts/benchmark_collectives.py --repeat 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmark import MIB, REPO, Row, Settings, library_version, merged, run_one, summary, versions  # noqa: E402

VARIANTS = ("ours", "ours-coalesce", "ours-bucket25", "ours-coalesce-bucket25")
LABELS = {
    "ours": "plain",
    "ours-coalesce": "coalesce_all_gather_ops",
    "ours-bucket25": "reduce_scatter_bucket_size_mb=25",
    "ours-coalesce-bucket25": "both",
}


def run_rounds(s: Settings, devices: Sequence[int], repeats: int, timeout_s: float) -> List[Row]:
    """Every (variant, N) ``repeats`` times, in rounds over the whole table (spreading the other
    load on the machine over every variant); the compiler dumps in the first round only."""
    runs: List[Row] = []
    for round_ in range(repeats):
        for n in devices:
            for name in VARIANTS:
                print(f"[{time.strftime('%H:%M:%S')}] {name} on {n} devices, round {round_ + 1}", flush=True)
                row, _ = run_one(name, n, s, "on" if round_ == 0 else "off", timeout_s)
                print(f"    {summary(row)}", flush=True)
                runs.append(row)
    return runs


def table(rows: Sequence[Row]) -> str:
    plain: Dict[int, Row] = {r.devices: r for r in rows if r.variant == "ours" and not r.error}
    head = ["variant", "N", "step s: median of run medians (every run's)", "x plain", "host s", "CPU s", "x plain",
            "MiB/device", "x plain", "all-gathers: n, MiB", "reduce-scatters: n, MiB", "final loss"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r.error:
            lines.append(f"| {LABELS[r.variant]} | {r.devices} | failed: {r.error} |" + " |" * (len(head) - 3))
            continue
        base = plain.get(r.devices)
        runs = ", ".join(f"{m:.2f}" for m in r.run_medians)
        gathers, reduces = r.collectives["all_gathers"], r.collectives["reduce_scatters"]
        lines.append("| " + " | ".join([
            LABELS[r.variant], str(r.devices), f"{r.median_s:.3f} ({runs})",
            f"{r.median_s / base.median_s:.2f}" if base else "", f"{r.host_s:.3f}",
            f"{r.cpu_s:.2f}", f"{r.cpu_s / base.cpu_s:.2f}" if base else "", f"{r.total_bytes / MIB:.2f}", f"{r.total_bytes / base.total_bytes:.3f}" if base else "",
            f"{gathers[0]}, {gathers[1] / MIB:.2f}", f"{reduces[0]}, {reduces[1] / MIB:.2f}", f"{r.final_loss:.4f}",
        ]) + " |")
    return "\n".join(lines)


@dataclass
class Report:
    """What the markdown is made from (saved as JSON, to render again with ``--render``)."""

    rows: List[Row]  # every run (``merged`` makes one row per variant and device count)
    settings: Settings
    command: str
    library: str
    versions: str
    date: str
    loads: Tuple[float, float]  # load average before and after
    wall_s: float

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(dataclasses.asdict(self), indent=1))

    @staticmethod
    def load(path: Path) -> Report:
        raw = json.loads(path.read_text())
        rows = [Row(**{**r, "collectives": {k: tuple(v) for k, v in r["collectives"].items()}}) for r in raw["rows"]]
        return Report(**{**raw, "rows": rows, "settings": Settings(**raw["settings"]), "loads": tuple(raw["loads"])})


def markdown(report: Report) -> str:
    s, loads = report.settings, report.loads
    return f"""# Coalesced gathers and bucketed reduce-scatters, per-parameter shards

Written by `{report.command}` ({report.date}, {report.wall_s / 60:.1f} min; do not edit by hand).
accel_xla_fsdp {report.library}; {report.versions}; {os.cpu_count()} cores shared by every device and by
whatever else the machine ran (load average {loads[0]:.1f} before, {loads[1]:.1f} after).

scripts/benchmark.py's tiny Llama ({s.layers} decoder blocks, hidden {s.hidden}, intermediate
{s.intermediate}; AdamW; global batch {s.global_batch} x {s.seq_len} tokens), every decoder block a unit,
`flatten_parameters=False` (one group per parameter: 9 per block, 3 in the root). Step: median
over {s.timed_steps} steps after {s.warmup_steps} warm-up steps in each fresh process, then the median of
the runs' medians (each run's in brackets). host s: of the step, until its program was launched
(tracing on every replica). CPU s: CPU seconds the whole process spent per step (median), less
sensitive than wall time to the other load on the machine. MiB/device: `Total bytes used` of the
compiled step; collectives in that program, with their result bytes per device (from the first
round's dump).

{table(merged(report.rows))}
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, nargs="+", default=[2, 4])
    p.add_argument("--repeat", type=int, default=3, help="runs of every (variant, N), in rounds")
    p.add_argument("--steps", type=int, help=f"timed steps after the warm-up (default {Settings.timed_steps})")
    p.add_argument("--markdown", type=Path, default=REPO / "docs/collectives.md")
    p.add_argument("--json", type=Path, default=REPO / "out/collectives.json", help="where the raw figures go")
    p.add_argument("--render", type=Path, help="no run: write the markdown from saved raw figures")
    p.add_argument("--timeout", type=float, default=900.0)
    args = p.parse_args()
    if args.render:
        report = Report.load(args.render)
    else:
        report = run(args)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report.save(args.json)
    text = markdown(report)
    args.markdown.parent.mkdir(parents=True, exist_ok=True)
    args.markdown.write_text(text)
    print(text)
    print(f"wrote {args.markdown} (raw figures: {args.render or args.json})")


def run(args: argparse.Namespace) -> Report:
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    s = Settings() if args.steps is None else dataclasses.replace(Settings(), timed_steps=args.steps)
    rows = run_rounds(s, args.devices, args.repeat, args.timeout)
    return Report(
        rows=rows, settings=s, command=" ".join(["python scripts/benchmark_collectives.py"] + sys.argv[1:]),
        library=library_version(), versions=versions(), date=time.strftime("%Y-%m-%d"),
        loads=(load_before, os.getloadavg()[0]), wall_s=time.perf_counter() - started,
    )


if __name__ == "__main__":
    main()
