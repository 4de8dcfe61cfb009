"""Run by tests/test_patches.py in a fresh process: what importing accel_xla_fsdp replaces.

``python patch_check.py TARGETS_JSON`` records each target's original (as stored) before
``accel_xla_fsdp`` is imported, imports the package and both rooms (and installs the PEFT, launcher and DPO stages),
then prints as JSON: the targets the table lists for this platform, those installed, those whose
name holds the installed replacement, every function of ours found in another library's modules
and classes (the patches actually present, listed or not), and after ``uninstall()`` the targets
whose original is not back (compared by identity) and what of ours is still found.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
from types import FunctionType, ModuleType
from typing import Any, List, Set, Tuple

PACKAGE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "accel_xla_fsdp")
LIBRARIES = (
    "torch",
    "torch_xla",
    "transformers",
    "accelerate",
    "tqdm",
    "datasets",
    "dill",
    "peft",
    "trl",
    "logging",
    "builtins",
)
_ABSENT = object()


def _resolve(target: str) -> Tuple[Any, str]:
    # patches.resolve's twin: originals are read before accel_xla_fsdp is imported (which installs)
    module, _, path = target.partition(":")
    owner: Any = importlib.import_module(module)
    *outer, attribute = path.split(".")
    for name in outer:
        owner = getattr(owner, name)
    return owner, attribute


def _stored(target: str) -> Any:
    try:
        owner, attribute = _resolve(target)
    except (ImportError, AttributeError):
        return _ABSENT
    return inspect.getattr_static(owner, attribute)


def _ours(value: Any) -> bool:
    func = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
    if not isinstance(func, FunctionType):
        return False
    inner = vars(func).get("__wrapped__")  # what @contextmanager made of ours, say
    return func.__code__.co_filename.startswith(PACKAGE_DIR) or (inner is not None and _ours(inner))


def _found_in_libraries() -> Set[str]:
    """``module:attribute`` (or ``module:Holder.attribute``) of every function of ours held by a
    module of another library, a class defined there, or a module it holds under a name of its
    own (``torch_xla._XLAC``, listed in ``sys.modules`` as ``_XLAC``)."""
    found: Set[str] = set()
    for name, module in list(sys.modules.items()):
        if not isinstance(module, ModuleType) or name.split(".")[0] not in LIBRARIES:
            continue
        for attribute, value in list(vars(module).items()):
            if _ours(value):
                found.add(f"{name}:{attribute}")
            elif (isinstance(value, type) and vars(value).get("__module__") == name) or (
                isinstance(value, ModuleType) and value.__name__.split(".")[0] not in LIBRARIES
            ):
                found.update(f"{name}:{attribute}.{inner}" for inner, member in vars(value).items() if _ours(member))
    return found


def main(targets: List[str]) -> None:
    import torch_xla  # noqa: F401  (imported before the originals are read, as by any script)

    originals = {target: _stored(target) for target in targets}
    import accel_xla_fsdp.hf_trainer  # noqa: F401  (the package, both rooms)
    from accel_xla_fsdp.xla_cpu import patches

    patches.install(patches.Stage.PEFT_LOAD)
    patches.install(patches.Stage.LAUNCHER)
    patches.install(patches.Stage.DPO_TRAINER)
    installed = patches.installed()
    result = {
        "listed": sorted(p.target for p in patches.PATCHES if p.applies() and _stored(p.target) is not _ABSENT),
        "installed": sorted(installed),
        "holding": sorted(t for t, r in installed.items() if patches.current(t) is r),
        "present": sorted(_found_in_libraries()),
    }
    patches.uninstall()
    result["not_restored"] = sorted(t for t in targets if _stored(t) is not originals[t])
    result["still_ours"] = sorted(_found_in_libraries())
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
