"""The package's import graph, checked: no circle, and no module importing one above it.

Every ``import`` in ``accel_xla_fsdp`` counts, wherever it sits: at module level, inside a
function (run time) or under ``TYPE_CHECKING`` (types only). ``LAYERS`` orders the modules, lowest
first; a module may import only modules listed before it, or at its own position. A package's
``__init__`` is the package's own entry and sits above its submodules.

    python scripts/import_graph.py            # the graph, one module a line, and the verdict
    python scripts/import_graph.py --quiet    # the verdict only

Exits 1 on a circle, an upward edge or a module missing from ``LAYERS``.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

PACKAGE = "accel_xla_fsdp"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

# Lowest first. Entries on one line (a tuple) share a position: they may import each other
# only without a circle.
LAYERS: Tuple[Tuple[str, ...], ...] = (
    # the platform: the adapter over torch_xla, and XLA:CPU replica threads behaving as processes
    # tpu_compiler imports nothing of ours (run in .tpu-venv)
    ("xla_cpu.replica_run", "tpu_compiler", "host_memory"),
    ("_xla",),
    ("xla_cpu.graph_boundaries",),
    ("xla_cpu.rendezvous",),
    (
        "xla_cpu.seeds",
        "xla_cpu.host_collectives",
        "xla_cpu.script_logging",
        "xla_cpu.tqdm_lock",
        "xla_cpu.dill_capture",
        "xla_cpu.sdpa_mask",
    ),
    ("xla_cpu.patches",),  # names the rooms' patch functions by string: it imports none of them
    ("xla_cpu", "xla_cpu.__main__"),
    # the engine
    ("runner",),
    ("options",),
    ("param_group",),
    ("collectives",),
    ("sharded_tables",),  # the root's vocabulary tables, computed from their shards
    ("sharded_loss",),  # a causal LM's loss from lm_head's shard, a chunk at a time
    ("linear", "embedding", "checkpointing", "wrap"),
    ("unit_state",),
    ("state_dict",),
    ("construction",),
    ("fsdp",),
    ("tpu_program",),  # the TPU program of a step, traced here (docs/tpu.md)
    # checkpoints
    ("checkpoint.errors",),
    ("checkpoint.files",),
    ("checkpoint.store",),
    ("checkpoint.format",),
    ("checkpoint.torch_xla_files", "checkpoint.pretrained"),
    ("checkpoint.consolidate", "checkpoint.sharded"),
    ("checkpoint",),
    # the Accelerate room
    ("hf_accelerate.plugin",),
    ("hf_accelerate.launch", "hf_accelerate.optimizer", "hf_accelerate.accelerate_files"),
    (
        "hf_accelerate.pretrained_loading",
        "hf_accelerate.checkpoints",
        "hf_accelerate.unwrapped_generate",
        "hf_accelerate.unwrapped_save",
    ),
    ("hf_accelerate.accelerator",),
    ("hf_accelerate",),
    # the Trainer room (may import the Accelerate room, not the reverse)
    ("hf_trainer.arguments", "hf_trainer.resume", "hf_trainer.masked_reductions"),
    ("hf_trainer.trainer",),
    ("hf_trainer",),
    ("launcher",),  # accel-xla-fsdp launch: both rooms' names pointed at the engine
    ("plan",),  # accel-xla-fsdp plan: a step traced as the Accelerate plugin wraps it, compiled for TPU
    ("cli",),
    ("",),  # the package's __init__
    ("__main__",),
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> Dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def resolve(importer: str, is_package: bool, level: int, target: Optional[str]) -> Optional[str]:
    """The package module a relative import names (None for imports from outside the package)."""
    if level == 0:
        if target is None or not (target == PACKAGE or target.startswith(PACKAGE + ".")):
            return None
        return target[len(PACKAGE) + 1 :]
    base = importer.split(".") if importer else []
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def imports_of(name: str, path: Path, known: Dict[str, Path]) -> Set[str]:
    """The package modules ``name`` imports (``from . import x`` names module ``x`` when it is one)."""
    found: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = resolve(name, path.name == "__init__.py", 0, alias.name)
                if target is not None:
                    found.add(target)
        elif isinstance(node, ast.ImportFrom):
            target = resolve(name, path.name == "__init__.py", node.level, node.module)
            if target is None:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target else alias.name
                found.add(sub if sub in known else target)
    found.discard(name)
    return found


def position(name: str) -> Optional[int]:
    return next((i for i, layer in enumerate(LAYERS) if name in layer), None)


def circles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """One circle through each strongly connected set of modules that has one (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = []
            while True:
                w = stack.pop()
                members.append(w)
                if w == v:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def show(name: str) -> str:
    return name or "__init__"


def check(graph: Dict[str, Set[str]]) -> List[str]:
    """Every problem of ``graph`` (module -> the modules it imports): unplaced modules, upward
    imports, circles."""
    problems = [f"{show(name)} is not in LAYERS: place it" for name in sorted(graph) if position(name) is None]
    for name in sorted(graph):
        for target in sorted(graph[name]):
            if _upward(name, target):
                problems.append(f"upward import: {show(name)} -> {show(target)}")
    for members in circles(graph):
        problems.append(f"import circle among: {', '.join(show(m) for m in members)}")
    return problems


def _upward(name: str, target: str) -> bool:
    here, there = position(name), position(target)
    return here is not None and there is not None and there > here


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quiet", action="store_true", help="print the verdict only")
    args = parser.parse_args()
    known = modules()
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
    if not args.quiet:
        for name in sorted(graph, key=lambda n: (position(n) if position(n) is not None else len(LAYERS), n)):
            marks = [show(t) + (" (UPWARD)" if _upward(name, t) else "") for t in sorted(graph[name])]
            print(f"{show(name):34} -> {', '.join(marks) or '-'}")
    problems = check(graph)
    for problem in problems:
        print(problem)
    print("import graph: " + ("OK, no circle, no upward import" if not problems else f"{len(problems)} problem(s)"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
