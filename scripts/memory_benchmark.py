"""Memory of a stock fine-tuning script, stage by stage, as a multiple of the model's size (issue 27).

Makes a Llama of the size asked (fp32 weights, ``save_pretrained`` into a folder, once per shape),
runs scripts/memory_stages.py on it under ``accelerate launch`` with XLA FSDP on N XLA:CPU
replicas (plugins/xla_fsdp_cpu.yaml: ``fsdp_cpu_ram_efficient_loading``, per-parameter shards, one unit
per decoder block), then ``accel-xla-fsdp consolidate`` on its checkpoint, sampling the resident
memory of the whole process tree every 50 ms. Prints each stage's peak and its resident memory
when it ends, in M (the model's size in fp32), the process's own memory before loading included;
beside them the same script on Accelerate's stock DDP (torchrun, gloo, N processes), when it
fits in the memory available (it holds about 32 M at 0.16 B; otherwise skipped, and said so).
With ``--trainer``, also scripts/memory_trainer_stages.py, the transformers ``Trainer``: 2 steps
that write ``checkpoint-2``, ``save_model``, then a second launch that resumes for one more step.

    .venv/bin/python scripts/memory_benchmark.py --preset 0.16b
    .venv/bin/python scripts/memory_benchmark.py --preset 1.1b --ddp no   # TinyLlama, 19 GiB: alone
    .venv/bin/python scripts/memory_benchmark.py --hidden 512 --intermediate 1376 --layers 4 --heads 8 --kv-heads 8
    .venv/bin/python scripts/memory_benchmark.py --preset 0.48b --config_file MY_CONFIG.yaml   # other plugin settings
    .venv/bin/python scripts/memory_benchmark.py --preset 0.16b --trainer   # and the Trainer

Above 3 GiB, on a shared machine, run it under the machine's lock (``flock LOCKFILE ...``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import psutil

ROOT = Path(__file__).resolve().parent.parent
STAGES_SCRIPT = ROOT / "scripts" / "memory_stages.py"
TRAINER_SCRIPT = ROOT / "scripts" / "memory_trainer_stages.py"
BIN = Path(sys.executable).parent
STAGES = ["from_pretrained", "prepare", "train", "save_state", "stock save", "load_state", "step after load"]
TRAINER_STAGES = ["prepare + 2 steps", "checkpoint-2", "save_model", "load checkpoint-2", "step after resume"]
PRESETS: Dict[str, Dict[str, int]] = {
    "0.16b": dict(hidden=1024, intermediate=2816, layers=8, heads=16, kv_heads=8, vocab=32000),
    "0.48b": dict(hidden=2048, intermediate=5632, layers=8, heads=32, kv_heads=4, vocab=32000),
    "1.1b": dict(hidden=2048, intermediate=5632, layers=22, heads=32, kv_heads=4, vocab=32000),  # TinyLlama
}
DDP_HOLDS_M = 33.0  # measured: 31.6 M at 0.16 B (issue 27), and some margin


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS))
    for name in ("hidden", "intermediate", "layers", "heads", "kv-heads", "vocab"):
        p.add_argument(f"--{name}", type=int)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument(
        "--ddp", choices=["auto", "yes", "no"], default="auto", help="run stock DDP beside (auto: if it fits)"
    )
    p.add_argument(
        "--config_file",
        type=Path,
        default=ROOT / "plugins" / "xla_fsdp_cpu.yaml",
        help="the accelerate launch config whose plugin settings are measured (its num_processes becomes --replicas)",
    )
    p.add_argument(
        "--trainer", action="store_true", help="also the Trainer: 2 steps, checkpoint-2, save_model, a resume"
    )
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "accel-xla-fsdp-memory")
    args = p.parse_args()
    shape = dict(PRESETS[args.preset]) if args.preset else {}
    for key in ("hidden", "intermediate", "layers", "heads", "kv_heads", "vocab"):
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    missing = {"hidden", "intermediate", "layers", "heads", "kv_heads", "vocab"} - set(shape)
    if missing:
        p.error(f"give --preset or every size: missing {', '.join(sorted(missing))}")
    args.shape = shape
    return args


# -- the model -----------------------------------------------------------------------------------


def make_model(shape: Dict[str, int], folder: Path) -> None:
    """A Llama of ``shape`` saved in fp32 into ``folder`` (in a process of its own: building a
    1.1 B model takes 4.4 GB that the measured runs must not inherit)."""
    if (folder / "config.json").is_file():
        return
    code = f"""
import torch
from transformers import LlamaConfig, LlamaForCausalLM
s = {shape!r}
config = LlamaConfig(hidden_size=s["hidden"], intermediate_size=s["intermediate"], num_hidden_layers=s["layers"],
    num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], vocab_size=s["vocab"],
    max_position_embeddings=2048, tie_word_embeddings=False)
torch.manual_seed(0)
LlamaForCausalLM(config).save_pretrained({str(folder)!r})
"""
    subprocess.run([sys.executable, "-c", code], check=True)


def parameter_count(shape: Dict[str, int]) -> Tuple[int, int]:
    """All parameters, and those of the largest unit (the outer one: embedding, lm_head, norm)."""
    h, i, v = shape["hidden"], shape["intermediate"], shape["vocab"]
    kv = h // shape["heads"] * shape["kv_heads"]
    block = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    outer = 2 * v * h + h
    return shape["layers"] * block + outer, max(outer, block)


# -- sampling ------------------------------------------------------------------------------------


class TreeSampler:
    """Resident memory of a process and all its descendants, every 50 ms, in a thread."""

    def __init__(self, pid: int) -> None:
        self.root = psutil.Process(pid)
        self.samples: List[Tuple[float, int]] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.is_set():
            total = 0
            try:
                for proc in [self.root, *self.root.children(recursive=True)]:
                    try:
                        total += proc.memory_info().rss
                    except psutil.Error:
                        pass
            except psutil.Error:
                pass
            self.samples.append((time.time(), total))
            self.stopped.wait(0.05)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()

    def peak(self, start: float = 0.0, end: float = float("inf")) -> int:
        return max((rss for t, rss in self.samples if start <= t <= end), default=0)

    def at(self, when: float) -> int:
        before = [rss for t, rss in self.samples if t <= when]
        return before[-1] if before else 0


def run_sampled(command: List[str], env: Dict[str, str], log: Path) -> TreeSampler:
    with open(log, "w") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        sampler = TreeSampler(proc.pid)
        code = proc.wait()
    sampler.stop()
    if code != 0:
        sys.exit(f"{' '.join(command)} failed ({code}): see {log}")
    return sampler


def stage_figures(sampler: TreeSampler, marks: Path, stages: List[str] = STAGES) -> Dict[str, Tuple[int, int, int]]:
    """Each stage's (resident memory as it began, peak, resident memory as it ended), in bytes."""
    edges = {}
    for line in marks.read_text().splitlines():
        mark = json.loads(line)
        edges[(mark["stage"], mark["edge"])] = mark["time"]
    figures = {}
    for stage in stages:
        if (stage, "begin") in edges and (stage, "end") in edges:
            begin, end = sampler.at(edges[(stage, "begin")]), sampler.at(edges[(stage, "end")])
            # a stage shorter than the 50 ms between samples has none of its own
            peak = max(sampler.peak(edges[(stage, "begin")], edges[(stage, "end")]), begin, end)
            figures[stage] = (begin, peak, end)
    return figures


# -- the runs ------------------------------------------------------------------------------------


def launch(script: Path, args: List[str], config: Path, marks: Path, log: Path) -> TreeSampler:
    """``accelerate launch --config_file config script args``, sampled."""
    env = dict(os.environ, MEMORY_BENCH_MARKS=str(marks), HF_HUB_OFFLINE="1")
    command = [str(BIN / "accelerate"), "launch", "--config_file", str(config), str(script), *args]
    return run_sampled(command, env, log)


def launch_config(work: Path, replicas: int, config_file: Path) -> Path:
    """A copy of ``config_file`` in ``work`` that launches ``replicas`` processes."""
    config = work / "xla_fsdp.yaml"
    config.write_text(re.sub(r"(?m)^num_processes: *\d+", f"num_processes: {replicas}", config_file.read_text()))
    return config


def xla_fsdp_run(pretrained: Path, work: Path, config: Path) -> Tuple[Dict[str, Tuple[int, int, int]], int]:
    out, marks = work / "fsdp", work / "fsdp-marks.jsonl"
    shutil.rmtree(out, ignore_errors=True)
    marks.unlink(missing_ok=True)
    sampler = launch(STAGES_SCRIPT, [str(pretrained), str(out)], config, marks, work / "fsdp.log")
    figures = stage_figures(sampler, marks)
    consolidated = work / "consolidated"
    shutil.rmtree(consolidated, ignore_errors=True)
    command = [str(BIN / "accel-xla-fsdp"), "consolidate", str(out / "state"), str(consolidated)]
    consolidate_peak = run_sampled(command, dict(os.environ, HF_HUB_OFFLINE="1"), work / "consolidate.log").peak()
    # The checkpoints are only measured, and hold about 7 M of disk (27 GB at 1.0 B): a full disk
    # fails whatever runs next on this machine, CI's install included.
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(consolidated, ignore_errors=True)
    return figures, consolidate_peak


def trainer_run(pretrained: Path, work: Path, config: Path) -> Tuple[Dict[str, Tuple[int, int, int]], List[int]]:
    """The Trainer script launched twice, as a user resumes: 2 steps and saves, then a resume.
    Returns each stage's figures and each launch's whole peak."""
    out, marks = work / "trainer", work / "trainer-marks.jsonl"
    shutil.rmtree(out, ignore_errors=True)
    marks.unlink(missing_ok=True)
    first = launch(TRAINER_SCRIPT, [str(pretrained), str(out)], config, marks, work / "trainer.log")
    figures = stage_figures(first, marks, TRAINER_STAGES)
    marks.unlink()
    resumed = launch(TRAINER_SCRIPT, [str(pretrained), str(out), "--resume"], config, marks, work / "resume.log")
    figures.update(stage_figures(resumed, marks, TRAINER_STAGES))
    shutil.rmtree(out, ignore_errors=True)
    return figures, [first.peak(), resumed.peak()]


def ddp_run(pretrained: Path, work: Path, replicas: int) -> Dict[str, Tuple[int, int, int]]:
    out, marks = work / "ddp", work / "ddp-marks.jsonl"
    shutil.rmtree(out, ignore_errors=True)
    marks.unlink(missing_ok=True)
    env = dict(
        os.environ,
        MEMORY_BENCH_MARKS=str(marks),
        MEMORY_BENCH_ENGINE="ddp",
        USE_TORCH_XLA="0",
        ACCELERATE_USE_CPU="1",
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
    )
    command = [str(BIN / "torchrun"), f"--nproc_per_node={replicas}", str(STAGES_SCRIPT), str(pretrained), str(out)]
    figures = stage_figures(run_sampled(command, env, work / "ddp.log"), marks)
    shutil.rmtree(out, ignore_errors=True)
    return figures


def main() -> None:
    args = parse()
    shape = args.shape
    tag = "-".join(f"{k}{v}" for k, v in sorted(shape.items()))
    work = args.work / tag
    work.mkdir(parents=True, exist_ok=True)
    pretrained = work / "pretrained"
    make_model(shape, pretrained)
    params, largest_unit = parameter_count(shape)
    m = params * 4
    floor = 4 * m + args.replicas * largest_unit * 4
    ddp_fits = DDP_HOLDS_M * m < psutil.virtual_memory().available * 0.9
    run_ddp = args.ddp == "yes" or (args.ddp == "auto" and ddp_fits)
    config = launch_config(work, args.replicas, args.config_file)
    ours, consolidate_peak = xla_fsdp_run(pretrained, work, config)
    ddp: Optional[Dict[str, Tuple[int, int, int]]] = ddp_run(pretrained, work, args.replicas) if run_ddp else None
    trainer = trainer_run(pretrained, work, config) if args.trainer else None

    def fmt(b: int) -> str:
        return f"{b / m:.1f} M"

    print(f"model: {shape} -> {params / 1e9:.3f} B parameters, M = {m / 2**30:.2f} GiB (fp32)")
    print(
        f"{args.replicas} XLA:CPU replicas; floor (4 M + one largest unit per replica, above the process "
        f"before loading) = {floor / m:.2f} M"
    )
    base = ours["from_pretrained"][0] if "from_pretrained" in ours else 0
    print(f"process before loading: {fmt(base)} ({base / 2**30:.2f} GiB); peaks and rests include it")
    ddp_head = " stock DDP peak |" if ddp else ""
    print(f"\n| stage | peak | at rest after | peak above rest before |{ddp_head}")
    print("| --- | --- | --- | --- |" + (" --- |" if ddp else ""))
    for stage in STAGES:
        if stage not in ours:
            continue
        before, peak, after = ours[stage]
        row = f"| {stage} | {fmt(peak)} | {fmt(after)} | {fmt(peak - before)} |"
        if ddp:
            row += f" {fmt(ddp[stage][1])} |" if stage in ddp else " |"
        print(row)
    print(f"| consolidate (own process) | {fmt(consolidate_peak)} | | |" + (" |" if ddp else ""))
    for stage in ("train", "step after load"):
        if stage in ours:
            print(f"{stage}: {(ours[stage][1] - base) / floor:.2f}x the floor above the process before loading")
    if trainer:
        stages, whole = trainer
        print("\nthe Trainer (scripts/memory_trainer_stages.py), launched twice:\n")
        print("| stage | peak | at rest after | peak above rest before |")
        print("| --- | --- | --- | --- |")
        for stage, (before, peak, after) in stages.items():
            print(f"| {stage} | {fmt(peak)} | {fmt(after)} | {fmt(peak - before)} |")
        for run, peak in zip(("first", "resumed"), whole):
            print(f"| whole {run} run | {fmt(peak)} | | |")
        steps = max(stages[s][1] for s in ("prepare + 2 steps", "step after resume") if s in stages)
        print(f"Trainer steps: {(steps - base) / floor:.2f}x the floor above the process before loading")
    if not run_ddp:
        why = (
            "--ddp no"
            if args.ddp == "no"
            else (
                f"it holds about {DDP_HOLDS_M:.0f} M = {DDP_HOLDS_M * m / 2**30:.1f} GiB, "
                f"{psutil.virtual_memory().available / 2**30:.1f} GiB available"
            )
        )
        print(f"\nstock DDP not run: {why}")


if __name__ == "__main__":
    main()
