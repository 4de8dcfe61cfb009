"""A script's logging in replica threads prints as it does in a process per replica.

Two things silence a stock script's logs on XLA:CPU, where the replicas are threads of one process:

* ``import torch_xla`` calls ``logging.basicConfig()``, which gives the root logger a handler,
  so the script's own ``logging.basicConfig(level=INFO, format=...)`` later does nothing and its
  ``logger.info`` lines (an example's per-epoch perplexity) are dropped at the root's WARNING.
  ``drop_torch_xla_basic_config`` removes that handler again, when it is still the only one and
  untouched (the default format, the root at WARNING); warnings then print through Python's
  last-resort handler until the script configures logging.
* Scripts set ``transformers``' (and ``datasets``') verbosity per process: "info" on the main
  one, "error" on the others. That level is process-wide, so the last replica to set it decided
  for all (0 transformers log lines against 13 on the CPU, measured). ``per_thread_verbosity``
  keeps the level each replica thread asked for, sets the library's logger to the lowest, and
  its handlers drop a record below the level of the thread that logged it.

On a TPU (one process per chip) nothing changes: the levels are the process's own.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
from types import ModuleType
from typing import Dict

from .. import _xla

_LIBRARIES = ("transformers.utils.logging", "datasets.utils.logging")


def drop_torch_xla_basic_config() -> None:
    root = logging.getLogger()
    if "torch_xla" not in sys.modules or root.level != logging.WARNING or len(root.handlers) != 1:
        return
    handler = root.handlers[0]
    is_default = (
        type(handler) is logging.StreamHandler
        and handler.stream is sys.stderr
        and handler.formatter is not None
        and handler.formatter._fmt == logging.BASIC_FORMAT
    )
    if is_default:
        root.removeHandler(handler)


def per_thread_verbosity() -> None:
    """Patch the verbosity setters of ``transformers`` and, once it is imported, ``datasets``."""
    for name in _LIBRARIES:
        if name.split(".")[0] in sys.modules or name.startswith("transformers"):
            _patch_library(importlib.import_module(name))


def _patch_library(module: ModuleType) -> None:
    if getattr(module.set_verbosity, "accel_xla_fsdp", False):
        return
    levels: Dict[int, int] = {}  # thread ident -> the verbosity it set
    original = module.set_verbosity
    root = module._get_library_root_logger

    def set_verbosity(verbosity: int) -> None:
        if not _xla.replicas_are_threads():
            return original(verbosity)
        alive = {t.ident for t in threading.enumerate()}
        for ident in [i for i in levels if i not in alive]:
            del levels[ident]
        levels[threading.get_ident()] = verbosity
        original(min(levels.values()))
        for handler in root().handlers:
            if not any(isinstance(f, _ThreadLevel) for f in handler.filters):
                handler.addFilter(_ThreadLevel(levels))

    set_verbosity.__doc__ = original.__doc__
    set_verbosity.accel_xla_fsdp = True
    module.set_verbosity = set_verbosity  # set_verbosity_info() and the others call it by this name


class _ThreadLevel(logging.Filter):
    """Drops a record below the verbosity its replica thread set (other threads' records pass)."""

    def __init__(self, levels: Dict[int, int]) -> None:
        super().__init__()
        self.levels = levels

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= self.levels.get(record.thread, 0)
