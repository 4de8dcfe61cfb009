"""Consolidation of a >= 1 GB model from 4 rank files: ours (streaming) against torch_xla's.

    .venv/bin/python scripts/consolidate_benchmark.py [--repeat 2] [--layers 14] [--dir DIR]

1. Makes the inputs without training (a child process): a ``LlamaForCausalLM`` config (hidden
   1024, 16 heads, MLP 4096, vocabulary 32000, 14 decoder layers, untied embeddings: 300 M
   float32 parameters, 1.2 GB) built on the meta device, every parameter filled with random
   numbers on the CPU and cut into 4 per-parameter shards (flattened, padded to a multiple of 4,
   as both FSDPs shard without flattening), written twice:
   - our format: 4 safetensors rank files with their layout metadata and ``checkpoint.json``,
     in the form ``save_sharded`` writes (``format.RankMeta`` with a run token and a CRC-32 per
     tensor, which the consolidation checks; one root unit, per-parameter shards), with the
     non-persistent rotary buffers ``save_sharded`` also stores (zeros here: they are not written
     out);
   - torch_xla's: 4 ``torch.save`` files ``{"model": state_dict, "shard_metadata": ...}`` with
     the keys and metadata torch_xla's FSDP gives a root unit (``_fsdp_shard...`` names,
     ``shard_info`` with ``_orig_name``/``_orig_size``).
2. Times each consolidation in a fresh process, alternating which goes first: ours,
   ``accel_xla_fsdp.consolidate(ckpt, out, config=...)`` (what ``accel-xla-fsdp consolidate``
   runs, with its progress bar), and torch_xla's ``consolidate_sharded_model_checkpoints``
   (loads every rank file, concatenates, ``torch.save``). Each child imports everything first,
   then resets its peak resident memory (``/proc/self/clear_refs``), and reports the time and
   the peak (VmHWM) above its resident memory at that point.
3. Checks that both outputs hold the same tensors, prints a table, and deletes every file.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

MODEL = dict(
    vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_attention_heads=16, num_key_value_heads=16,
    max_position_embeddings=2048, tie_word_embeddings=False,
)
WORLD = 4


def llama_config(layers: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**MODEL, num_hidden_layers=layers)


# ---------------------------------------------------------------------------------------------
# Inputs


def make_inputs(root: Path, layers: int) -> None:
    import torch
    from transformers import LlamaForCausalLM
    from safetensors.torch import save_file

    from accel_xla_fsdp.checkpoint.format import (
        FORMAT, META_KEY, MODEL as MODEL_PREFIX, BUFFER, RECORD, GroupEntry, ParamEntry, RankMeta, Record, rank_file_name,
        tensor_checksum,
    )
    from accel_xla_fsdp.param_group import shard_param_name

    config = llama_config(layers)
    config.save_pretrained(root / "config")
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(0)
    ours: List[Dict[str, torch.Tensor]] = [{} for _ in range(WORLD)]
    xla: List[Dict[str, torch.Tensor]] = [{} for _ in range(WORLD)]
    groups, shard_info = [], {}
    for name, param in model.named_parameters():
        numel = param.numel()
        shard = math.ceil(numel / WORLD)
        full = torch.zeros(shard * WORLD)
        full[:numel] = torch.randn(numel, generator=generator) * 0.02
        orig_name = f"_fsdp_wrapped_module.{name}"  # torch_xla's name of it under the root unit
        key = shard_param_name(orig_name)
        for r in range(WORLD):
            ours[r][f"{MODEL_PREFIX}/{key}"] = xla[r][key] = full[r * shard : (r + 1) * shard].clone()
        groups.append(GroupEntry(key, shard, WORLD, "float32", True, (ParamEntry(name, tuple(param.shape), 0),)))
        shard_info[key] = {"_orig_size": param.shape, "_orig_name": orig_name}
        del full
    buffers = {}
    for name, buf in model.named_buffers():  # non-persistent (rotary): in our files, as save_sharded stores them
        for r in range(WORLD):
            ours[r][f"{BUFFER}/{name}"] = torch.zeros(buf.shape, dtype=buf.dtype)
        buffers[name] = str(buf.dtype).removeprefix("torch.")
    save_id, token = "save-000000", "0123456789abcdef0123456789abcdef"
    (root / "ours" / save_id).mkdir(parents=True)
    (root / "xla").mkdir()
    for r in range(WORLD):
        checksums = {name: tensor_checksum(t) for name, t in ours[r].items()}
        meta = RankMeta(FORMAT, save_id, r, WORLD, tuple(groups), buffers, None, token=token, checksums=checksums)
        save_file(ours[r], str(root / "ours" / save_id / rank_file_name(r, WORLD)), metadata={META_KEY: meta.to_json()})
        ours[r] = None
        metadata = {"shard_info": {"": shard_info}, "flatten_info": {}, "buffer_info": {}, "world_size": WORLD, "rank": r}
        torch.save({"model": xla[r], "shard_metadata": metadata}, root / "xla" / f"rank-{r:05d}-of-{WORLD:05d}.pth")
        xla[r] = None
    files = [f"{save_id}/{rank_file_name(r, WORLD)}" for r in range(WORLD)]
    (root / "ours" / RECORD).write_text(Record(FORMAT, save_id, token, WORLD, tuple(files), (save_id,)).to_json())
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    (root / "model.json").write_text(json.dumps({"parameters": sum(p.numel() for p in model.parameters()), "bytes": nbytes}))


# ---------------------------------------------------------------------------------------------
# One measured run (a fresh process)


def status() -> Dict[str, int]:
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}


def reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        return True
    except OSError:
        return False


def measure(which: str, root: Path) -> None:
    import torch  # noqa: F401 - imported before the baseline, like everything the run uses
    import transformers  # noqa: F401

    import accel_xla_fsdp
    from torch_xla.distributed.fsdp import consolidate_sharded_model_checkpoints

    if which == "ours":
        transformers.LlamaForCausalLM  # noqa: B018 - transformers imports a model class on first use

    reset = reset_peak()
    base = status()
    start = time.perf_counter()
    if which == "ours":
        accel_xla_fsdp.consolidate(root / "ours", root / "out-ours", config=root / "config")
    else:
        (root / "out-xla").mkdir()
        consolidate_sharded_model_checkpoints(str(root / "xla" / "rank-"), "*.pth", save_path=str(root / "out-xla" / "consolidated.pth"))
    seconds = time.perf_counter() - start
    end = status()
    baseline = base["VmRSS"] if reset else base["VmHWM"]
    print("RESULT " + json.dumps({"seconds": seconds, "baseline": base["VmRSS"], "peak": end["VmHWM"], "above": end["VmHWM"] - baseline, "reset": reset}))


def check(root: Path) -> None:
    """Both outputs hold the same tensors, bit for bit."""
    import torch
    from safetensors import safe_open

    theirs = torch.load(root / "out-xla" / "consolidated.pth", mmap=True, weights_only=True)["model"]
    with safe_open(str(root / "out-ours" / "model.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == sorted(theirs), (sorted(set(f.keys()) ^ set(theirs))[:5])
        for name in f.keys():
            assert torch.equal(f.get_tensor(name), theirs[name]), name
    print(f"RESULT {json.dumps({'tensors': len(theirs)})}")


# ---------------------------------------------------------------------------------------------
# The driver


def child(*args: str) -> Dict[str, Any]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(args)}: exit status {done.returncode}\n{done.stdout}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    result = json.loads(lines[-1][len("RESULT ") :]) if lines else {}
    result["process"] = time.perf_counter() - start
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=14, help="decoder layers (14: 300 M parameters, 1.2 GB)")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--dir", help="where to put the files (default: a new temporary directory, deleted)")
    parser.add_argument("--child", nargs=2, metavar=("WHAT", "ROOT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        what, root = args.child[0], Path(args.child[1])
        {"make": lambda: make_inputs(root, args.layers), "check": lambda: check(root)}.get(what, lambda: measure(what, root))()
        return

    root = Path(tempfile.mkdtemp(prefix="consolidate-benchmark-", dir=args.dir))
    try:
        start = time.perf_counter()
        child("--layers", str(args.layers), "--child", "make", str(root))
        model = json.loads((root / "model.json").read_text())
        print(f"inputs: {model['parameters'] / 1e6:.1f} M parameters, {model['bytes'] / 1e9:.2f} GB, {WORLD} rank files "
              f"in each format, made in {time.perf_counter() - start:.0f} s", flush=True)
        runs: Dict[str, List[Dict[str, Any]]] = {"ours": [], "xla": []}
        for i in range(args.repeat):
            for which in (["ours", "xla"] if i % 2 == 0 else ["xla", "ours"]):
                shutil.rmtree(root / f"out-{which}", ignore_errors=True)
                runs[which].append(child("--child", which, str(root)))
                r = runs[which][-1]
                print(f"run {i + 1} {which}: {r['seconds']:.2f} s, peak RSS above baseline {r['above'] / 2**20:.0f} MiB", flush=True)
        checked = child("--child", "check", str(root))
        print(f"outputs equal: {checked['tensors']} tensors, bit for bit")
        print_table(runs, model["bytes"])
    finally:
        shutil.rmtree(root, ignore_errors=True)


def print_table(runs: Dict[str, List[Dict[str, Any]]], model_bytes: int) -> None:
    names = {"ours": "accel_xla_fsdp.consolidate (streaming)", "xla": "torch_xla consolidate_sharded_model_checkpoints"}
    xla_time = statistics.median(r["seconds"] for r in runs["xla"])
    print()
    print("| consolidation, 4 rank files | time s (median) | runs | x torch_xla | peak RSS above baseline MiB (max) | / model size | process s incl. imports (median) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for which in ("ours", "xla"):
        rs = runs[which]
        t = statistics.median(r["seconds"] for r in rs)
        above = max(r["above"] for r in rs)
        print(f"| {names[which]} | {t:.2f} | {', '.join('%.2f' % r['seconds'] for r in rs)} | {t / xla_time:.2f} | "
              f"{above / 2**20:.0f} | {above / model_bytes:.3f} | {statistics.median(r['process'] for r in rs):.1f} |")


if __name__ == "__main__":
    main()
