"""``accel-xla-fsdp launch [accelerate launch's arguments] SCRIPT [ARGS]``: a script unchanged, on the engine.

The command takes what ``accelerate launch`` takes (its own parser, ``launch_command_parser``, and
its reading of the config file, ``_validate_launch_command``), our ``fsdp_config`` keys included,
for a config whose ``distributed_type`` is XLA. Then, where ``accelerate launch`` would import the
script in the launcher and hand its ``main()`` to ``xmp.spawn``:

- the script is checked before anything starts: one that calls ``use_spmd()`` is refused with why;
- the launch settings are exported as ``accelerate launch`` + our import would (hf_accelerate/launch.py), and
  torch_xla's worker processes inherit them;
- ``xmp.spawn`` gets a ``ScriptReplica``. torch_xla starts its worker with ``spawn``: a fresh
  interpreter that unpickles the replica function, so it imports this module first, and
  ``ScriptReplica.__setstate__`` puts the engine in place (``install_engine``) before the
  script is imported or run there. Each replica then runs the script as ``__main__``, as
  ``accelerate launch`` runs it on GPUs and ``torchrun`` does: the ``if __name__ == "__main__":``
  block too, so scripts whose ``main`` takes arguments (TRL's) run. With ``--main_training_function
  NAME`` given on the command line, Accelerate's XLA form instead: the script is imported once per
  process and each replica calls ``NAME()``.

On XLA:CPU the replicas are threads of one worker: each runs the script in a namespace of its own
(module-level code runs once per replica, as in a process each); ``sys.modules["__main__"]`` is the
first replica's, where ``typing.get_type_hints`` looks up a dataclass's annotations.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import threading
import types
from pathlib import Path
from typing import Any, Dict, List, Optional

from .hf_accelerate.launch import launch_environment
from .xla_cpu import patches

SPMD_REASON = (
    "the script calls torch_xla.runtime.use_spmd(): SPMD shards with torch_xla's partitioner over one "
    "global device, while accel-xla-fsdp runs one replica per device and shards with its own FSDP. "
    "Run this script with `accelerate launch`, or drop use_spmd() (and its mesh and mark_sharding calls)"
)
# Calls a script cannot make on the engine, with the reason it is refused.
_REFUSED_CALLS = {re.compile(r"\buse_spmd\s*\("): SPMD_REASON}


def install_engine() -> None:
    """Both rooms' patches, then the launcher's (xla_cpu/patches.py, ``Stage.LAUNCHER``): Accelerate's
    and transformers' names pointed at the engine, before the script's first import."""
    from . import hf_trainer  # noqa: F401  (imports the Accelerate room too: both stages installed)

    patches.install(patches.Stage.LAUNCHER)


# -- the launcher's patches (their entries and reasons: xla_cpu/patches.py) ---------------------------


def our_accelerator(original: Any) -> Any:
    from .hf_accelerate.accelerator import Accelerator

    return Accelerator


def one_import_at_a_time(original: Any) -> Any:
    lock = threading.RLock()

    def import_(*args: Any, **kwargs: Any) -> Any:
        with lock:
            return original(*args, **kwargs)

    return import_


def refusing_spmd(original: Any) -> Any:
    def use_spmd(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(SPMD_REASON)

    return use_spmd


class LaunchError(RuntimeError):
    """The command cannot launch this script, or not with these arguments (the message says why)."""


def refuse_unsupported(script: Path) -> None:
    """Stop before anything starts if ``script`` calls what the engine cannot run beside."""
    try:
        text = script.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return  # a module (-m) or a file Python will fail on itself, with its own message
    for pattern, reason in _REFUSED_CALLS.items():
        match = pattern.search(text)
        if match is not None:
            line = text.count("\n", 0, match.start()) + 1
            raise LaunchError(f"{script}:{line}: {reason}")


class ScriptReplica:
    """torch_xla's replica function: the script run as ``__main__`` (or its ``main_function()``).

    Only ever called unpickled, in torch_xla's worker processes (``xmp.spawn`` pickles it even for
    one process), where unpickling installs the engine first."""

    def __init__(self, script: str, as_module: bool, main_function: Optional[str]) -> None:
        self.script, self.as_module, self.main_function = script, as_module, main_function

    def __getstate__(self) -> Dict[str, Any]:
        return {"script": self.script, "as_module": self.as_module, "main_function": self.main_function}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        """In torch_xla's worker, before any replica starts: the engine, then the script's module
        if its ``main_function`` is to be called (the script is imported after the engine)."""
        self.__dict__.update(state)
        install_engine()
        self._lock = threading.Lock()
        self._code: Optional[types.CodeType] = None
        self._main: Optional[types.ModuleType] = None
        if self.main_function is not None:
            module = importlib.import_module(self._module_name())
            if not callable(getattr(module, self.main_function, None)):
                raise LaunchError(f"{self.script} has no function {self.main_function!r} (--main_training_function)")

    def _module_name(self) -> str:
        return self.script if self.as_module else Path(self.script).stem

    def __call__(self, index: int) -> None:
        try:
            self._run()
        except SystemExit as exit_:
            if exit_.code not in (None, 0):  # `sys.exit(main())` ending well is a replica that returned
                raise

    def _run(self) -> None:
        if self.main_function is not None:
            getattr(importlib.import_module(self._module_name()), self.main_function)()
            return
        if self.as_module:
            import runpy

            runpy.run_module(self.script, run_name="__main__", alter_sys=False)  # alter_sys: not thread-safe
            return
        module = self._module()
        exec(self._compiled(), module.__dict__)

    def _compiled(self) -> types.CodeType:
        with self._lock:
            if self._code is None:
                source = Path(self.script).read_bytes()
                self._code = compile(source, self.script, "exec", dont_inherit=True)
            return self._code

    def _module(self) -> types.ModuleType:
        module = types.ModuleType("__main__")
        module.__file__ = self.script
        with self._lock:
            if self._main is None:
                self._main = module
                sys.modules["__main__"] = module
        return module


def _explicit_main_function(argv: List[str], script: str) -> bool:
    before_script = argv[: argv.index(script)] if script in argv else argv
    return any(a == "--main_training_function" or a.startswith("--main_training_function=") for a in before_script)


def launch(argv: List[str]) -> int:
    """Run ``accel-xla-fsdp launch ARGV`` (Accelerate's launch arguments, the script, its arguments)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import patch_environment
    from accelerate.utils.launch import prepare_tpu

    parser = launch_command_parser()
    parser.prog = "accel-xla-fsdp launch"
    args = parser.parse_args(argv)
    settings = launch_environment(argv)
    if not settings:
        raise LaunchError(
            "accel-xla-fsdp launch runs on XLA devices: pass --config_file with `distributed_type: XLA` "
            "(plugins/xla_fsdp_cpu.yaml: 4 XLA:CPU devices; plugins/xla_fsdp_tpu.yaml: a TPU host), or make such a "
            "config Accelerate's default (`accelerate config`)"
        )
    args, _, _ = _validate_launch_command(args)
    if args.tpu_use_cluster:
        raise LaunchError("accel-xla-fsdp launch runs on one host: --tpu_use_cluster (a TPU pod) is not offered")
    if args.no_python:
        raise LaunchError("--no_python: accel-xla-fsdp launch runs Python scripts")
    script = args.training_script
    if not args.module:
        refuse_unsupported(Path(script))
        script = str(Path(script).resolve())
    main_function = args.main_training_function if _explicit_main_function(argv, args.training_script) else None

    for name, value in settings.items():
        os.environ.setdefault(name, value)  # the user's own environment wins
    # As `python SCRIPT ARGS` sees them; spawn hands sys.argv and sys.path to torch_xla's workers.
    sys.argv = [script, *args.training_script_args]
    sys.path.insert(0, os.getcwd() if args.module else str(Path(script).parent))

    import torch_xla.distributed.xla_multiprocessing as xmp

    _, tpu_env = prepare_tpu(args, {})
    replica = ScriptReplica(script, args.module, main_function)
    with patch_environment(**tpu_env):
        xmp.spawn(replica, args=())
    return 0
