"""Fuzzing the checkpoint readers: random mutations of a valid checkpoint's record, safetensors
headers, layout metadata and tensor bytes (and of torch_xla rank files' dicts), each of which must
end in a ``CheckpointError`` or in exactly the model the unmutated files give: never another
exception, a hang, or unbounded memory.

The cases run in a child process with its address space limited, every case under an alarm,
and report how they ended; the child's peak resident memory above its start is asserted too.
Seeded: the same cases every run.
"""

from __future__ import annotations

import copy
import json
import os
import random
import resource
import shutil
import signal
import struct
import subprocess
import sys
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
from safetensors.torch import load_file
from stores import record_file
from test_checkpoint_safety import torch_xla_files, two_runs

from accel_xla_fsdp import CheckpointError, consolidate
from accel_xla_fsdp.checkpoint.consolidate import convert_torch_xla
from accel_xla_fsdp.checkpoint.format import META_KEY, read_header

REPO = Path(__file__).resolve().parents[1]
SEED = 18
OURS, THEIRS = 2000, 400  # cases: our format, torch_xla's
CASE_SECONDS = 20
ADDRESS_SPACE_HEADROOM = 2 * 2**30  # the child may map at most this much more than at its start
PEAK_ABOVE_START = 400 * 2**20


# ---------------------------------------------------------------------------------------------
# Mutations


WEIRD: List[Any] = [
    None,
    True,
    False,
    -1,
    0,
    1,
    7,
    1.5,
    float("nan"),
    2**63,
    10**30,
    -(10**30),
    "",
    "x",
    "0",
    "\udc80",
    "a/b",
    [],
    [0],
    [-1, 2],
    [1.5],
    {},
    {"x": 1},
    ["\udc80"],
    [[[[[]]]]],
    "save-000000",
    "float32",
    "F32",
]


def paths_of(node: Any, at: Tuple = ()) -> List[Tuple]:
    """Every path into a JSON tree (the root included)."""
    found = [at]
    if isinstance(node, dict):
        for k, v in node.items():
            found += paths_of(v, at + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            found += paths_of(v, at + (i,))
    return found


def strings_of(node: Any) -> List[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return list(node) + [s for v in node.values() for s in strings_of(v)]
    if isinstance(node, list):
        return [s for v in node for s in strings_of(v)]
    return []


def mutate_tree(rng: random.Random, tree: Any) -> Any:
    """One random change to a JSON tree: a value of another type or size, a key or element
    removed, duplicated or added, a number moved, a string swapped for another of the tree's."""
    tree = copy.deepcopy(tree)
    path = rng.choice(paths_of(tree))
    if not path:
        return rng.choice(WEIRD + [[tree], {"x": tree}])
    parent = tree
    for key in path[:-1]:
        parent = parent[key]
    key, value = path[-1], parent[path[-1]]
    op = rng.randrange(7)
    if op == 0:
        parent[key] = rng.choice(WEIRD)
    elif op == 1:
        del parent[key]
    elif op == 2 and isinstance(value, (list, dict)) and value:
        if isinstance(value, list):
            value.insert(rng.randrange(len(value) + 1), copy.deepcopy(rng.choice(value)))
        else:
            value[rng.choice(["x", "\udc80", "shard_numel", "params", "format"])] = rng.choice(WEIRD)
    elif op == 3 and isinstance(value, int) and not isinstance(value, bool):
        parent[key] = rng.choice([value + 1, value - 1, value * 2, -value, value + 2**32, 0])
    elif op == 4 and isinstance(value, str):
        parent[key] = rng.choice(strings_of(tree) + [value + "x", value[:-1], value.upper()])
    elif op == 5:
        nested: Any = rng.choice([0, "x"])
        for _ in range(rng.choice([10, 200, 900])):
            nested = [nested]
        parent[key] = nested
    else:
        parent[key] = [value, value] if rng.random() < 0.5 else {"v": value}
    return tree


def mutate_text(rng: random.Random, text: str) -> str:
    """A change to JSON text: cut short, a character changed or inserted, a key repeated,
    nesting deeper than any parser should follow."""
    op = rng.randrange(5)
    at = rng.randrange(len(text) + 1)
    if op == 0:
        return text[:at]
    if op == 1 and text:
        at = min(at, len(text) - 1)
        return text[:at] + rng.choice('{}[]",:0\\x\udc80') + text[at + 1 :]
    if op == 2:
        return text[:at] + rng.choice(['"', "{", "]", "\\u0000", "1e999999", "9" * 5000]) + text[at:]
    if op == 3 and text.startswith("{"):
        first_key = text[1 : text.index(",")] if "," in text else '"k": 1'
        return "{" + first_key + "," + text[1:]
    return "[" * 50_000 + text + "]" * 50_000


def rewrite_header(path: Path, header: Dict[str, Any], length: Any = None) -> None:
    """``path`` with another header JSON (and the same data bytes); ``length`` overrides the
    8-byte length field."""
    old = read_header(path)
    data = path.read_bytes()[old.data_start :]
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8", "surrogatepass")
    field = len(raw) if length is None else length
    path.write_bytes(struct.pack("<Q", field % 2**64) + raw + data)


def header_json(path: Path) -> Dict[str, Any]:
    (length,) = struct.unpack("<Q", path.read_bytes()[:8])
    return json.loads(path.read_bytes()[8 : 8 + length])


def mutate_checkpoint(rng: random.Random, ckpt: Path) -> str:
    """One random mutation of one file of ``ckpt`` (in place); returns what was done."""
    record = record_file(ckpt)
    files = [ckpt / f for f in json.loads(record.read_text())["files"]]
    path = rng.choice(files)
    kind = rng.choice(
        ["record", "record text", "meta", "meta text", "header", "header length", "header byte", "data byte"]
    )
    if kind == "record":
        record.write_text(json.dumps(mutate_tree(rng, json.loads(record.read_text()))))
    elif kind == "record text":
        record.write_text(mutate_text(rng, record.read_text()), errors="surrogatepass")
    elif kind in ("meta", "meta text"):
        header = header_json(path)
        text = header["__metadata__"][META_KEY]
        new = json.dumps(mutate_tree(rng, json.loads(text))) if kind == "meta" else mutate_text(rng, text)
        header["__metadata__"][META_KEY] = new
        rewrite_header(path, header)
    elif kind == "header":
        rewrite_header(path, mutate_tree(rng, header_json(path)))
    elif kind == "header length":
        header = header_json(path)
        true = len(json.dumps(header, separators=(",", ":")))
        rewrite_header(path, header, rng.choice([0, 1, true - 1, true + 1, 2**63, 2**64 - 1, 100_000_001]))
    else:
        data = bytearray(path.read_bytes())
        (length,) = struct.unpack("<Q", data[:8])
        lo, hi = (8, 8 + length) if kind == "header byte" else (8 + length, len(data))
        if hi > lo:
            data[rng.randrange(lo, hi)] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
    return f"{kind} of {path.name if 'record' not in kind else record.name}"


def mutate_torch_xla(rng: random.Random) -> Callable[[int, Dict[str, Any]], None]:
    """An edit of one rank's torch_xla dict: its metadata tree (as plain containers) or its tensors."""
    target = rng.randrange(2)
    kind = rng.choice(["metadata", "metadata", "tensor dtype", "tensor shape", "tensor key", "top"])

    def edit(rank: int, ckpt: Dict[str, Any]) -> None:
        if rank != target:
            return
        edit.what = f"{kind} of rank {target}"
        if kind == "metadata":
            meta = ckpt["shard_metadata"]
            plain = json.loads(json.dumps(meta, default=lambda v: list(v)))
            mutated = mutate_tree(rng, plain)
            ckpt["shard_metadata"] = mutated
            edit.what += f": {str(mutated)[:300]}"
        elif kind == "top":
            ckpt.pop(rng.choice(["model", "shard_metadata"])) if rng.random() < 0.5 else ckpt.update(
                model=rng.choice(WEIRD)
            )
        else:
            key = next(iter(ckpt["model"]))
            value = ckpt["model"][key]
            if kind == "tensor dtype":
                ckpt["model"][key] = value.to(rng.choice([torch.float16, torch.int32, torch.float64, torch.bool]))
            elif kind == "tensor shape":
                ckpt["model"][key] = rng.choice(
                    [value[:-1], value.reshape(2, -1), torch.cat([value, value]), value[:0]]
                )
            else:
                ckpt["model"][rng.choice(["", "\udc80", key + "x", "_fsdp_shard"])] = ckpt["model"].pop(key)

    return edit


# ---------------------------------------------------------------------------------------------
# The child: run the cases, report


class Timeout(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise Timeout()


def outcome(run: Callable[[Path], Path], check: Callable[[Path], bool], out: Path) -> Tuple[str, str]:
    signal.alarm(CASE_SECONDS)
    try:
        written = run(out)
        return ("correct", "") if check(written) else ("WRONG RESULT", "")
    except CheckpointError as e:
        return "refused", str(e)
    except Timeout:
        return "HANG", ""
    except BaseException as e:  # noqa: BLE001 - what the fuzz is looking for
        return f"CRASH {type(e).__name__}", traceback.format_exc()[-1500:]
    finally:
        signal.alarm(0)
        shutil.rmtree(out, ignore_errors=True)


def same_model(want: Dict[str, torch.Tensor]) -> Callable[[Path], bool]:
    def check(out: Path) -> bool:
        got = load_file(out / "model.safetensors")
        return sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)

    return check


def fuzz(pristine: Path, scratch: Path) -> Dict[str, Any]:
    signal.signal(signal.SIGALRM, _alarm)
    rng = random.Random(SEED)
    results: Counter = Counter()
    kinds: Counter = Counter()
    failures: List[str] = []
    reference = consolidate(pristine, scratch / "reference", progress=False)
    want = load_file(reference / "model.safetensors")
    start = time.perf_counter()
    for case in range(OURS):
        ckpt = scratch / "ckpt"
        shutil.rmtree(ckpt, ignore_errors=True)
        shutil.copytree(pristine, ckpt)
        what = mutate_checkpoint(rng, ckpt)
        optimizer = rng.random() < 0.5
        result, detail = outcome(
            lambda out: consolidate(ckpt, out, optimizer=optimizer, progress=False), same_model(want), scratch / "out"
        )
        results[result] += 1
        kinds[what.split(" of ")[0] + (" " + result if result in ("refused", "correct") else "")] += 1
        if result not in ("refused", "correct"):
            failures.append(f"case {case} ({what}): {result} {detail}")
    theirs = scratch / "torch_xla"
    weight = torch_xla_files(theirs / "pristine")
    for case in range(THEIRS):
        shutil.rmtree(theirs / "in", ignore_errors=True)
        edit = mutate_torch_xla(rng)
        try:
            torch_xla_files(theirs / "in", edit)
        except Exception:  # noqa: BLE001 - a mutation torch.save cannot write
            results["unwritable mutation"] += 1
            continue
        result, detail = outcome(
            lambda out: convert_torch_xla(theirs / "in", out, progress=False),
            same_model({"weight": weight}),
            scratch / "out",
        )
        results[f"torch_xla {result}"] += 1
        if result not in ("refused", "correct"):
            failures.append(f"torch_xla case {case} ({getattr(edit, 'what', '')}): {result} {detail}")
    return {
        "results": dict(results),
        "kinds": dict(kinds),
        "failures": failures[:10],
        "seconds": time.perf_counter() - start,
    }


def vm_bytes() -> int:
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmSize"].split()[0]) * 1024


def peak_rss() -> int:
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmHWM"].split()[0]) * 1024


def child_main(pristine: str, scratch: str) -> None:
    limit = vm_bytes() + ADDRESS_SPACE_HEADROOM
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    rss_start = (
        int(
            dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)[
                "VmRSS"
            ].split()[0]
        )
        * 1024
    )
    report = fuzz(Path(pristine), Path(scratch))
    report["peak above start"] = peak_rss() - rss_start
    print("REPORT " + json.dumps(report))


# ---------------------------------------------------------------------------------------------
# The test


@pytest.fixture(scope="module")
def pristine(pools, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fuzz")
    pools[2].run(two_runs, 2, str(root / "ckpt"), str(root / "other"))
    return root / "ckpt"


def test_mutated_checkpoints_are_refused_by_name_or_read_correctly(pristine, tmp_path) -> None:
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        "import test_checkpoint_fuzz as f; f.child_main(*sys.argv[1:])"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", code, str(pristine), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("REPORT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    report = json.loads(lines[-1][len("REPORT ") :])
    print(json.dumps(report, indent=1))  # with -s: how many cases ended how
    results = report["results"]
    assert not report["failures"], "\n".join(report["failures"])
    assert results.get("refused", 0) + results.get("correct", 0) == OURS
    assert (
        results.get("torch_xla refused", 0)
        + results.get("torch_xla correct", 0)
        + results.get("unwritable mutation", 0)
        == THEIRS
    )
    assert results.get("refused", 0) > OURS // 2 and results.get("correct", 0) > 0  # both outcomes are exercised
    assert report["peak above start"] < PEAK_ABOVE_START, report["peak above start"]
