"""A script's logging in replica threads prints as it does in a process per replica.

Two things silence a stock script's logs on XLA:CPU, where the replicas are threads of one process:

* ``import torch_xla`` calls ``logging.basicConfig()``, which gives the root logger a handler,
  so the script's own ``logging.basicConfig(level=INFO, format=...)`` later does nothing and its
  ``logger.info`` lines (an example's per-epoch perplexity) are dropped at the root's WARNING.
  ``without_torch_xla_basic_config`` removes that handler again, when it is still the only one and
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

import logging
import sys
import threading
from typing import Callable, Dict, List

from .rendezvous import replicas_are_threads


def _is_torch_xla_basic_config(handler: logging.Handler) -> bool:
    return (
        type(handler) is logging.StreamHandler
        and handler.stream is sys.stderr
        and handler.formatter is not None
        and handler.formatter._fmt == logging.BASIC_FORMAT
    )


def without_torch_xla_basic_config(original: List[logging.Handler]) -> List[logging.Handler]:
    """The patch of the root logger's ``handlers`` (patches.py): the list without the handler
    ``import torch_xla``'s ``basicConfig()`` gave it, when that is still the only one and untouched
    (the default format, the root at WARNING); otherwise the same handlers."""
    root = logging.getLogger()
    if "torch_xla" in sys.modules and root.level == logging.WARNING and len(original) == 1:
        return [h for h in original if not _is_torch_xla_basic_config(h)]
    return list(original)


def per_thread_verbosity(original: Callable[[int], None]) -> Callable[[int], None]:
    """The patch of ``transformers``' and ``datasets``' ``set_verbosity`` (patches.py):
    ``original`` at the lowest level any live replica thread asked for, its handlers filtering
    each record by the level of the thread that logged it."""
    module = sys.modules[original.__module__]
    levels: Dict[int, int] = {}  # thread ident -> the verbosity it set
    root = module._get_library_root_logger

    def set_verbosity(verbosity: int) -> None:
        if not replicas_are_threads():
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
    return set_verbosity  # set_verbosity_info() and the others call it by this name


class _ThreadLevel(logging.Filter):
    """Drops a record below the verbosity its replica thread set (other threads' records pass)."""

    def __init__(self, levels: Dict[int, int]) -> None:
        super().__init__()
        self.levels = levels

    def filter(self, record: logging.LogRecord) -> bool:
        return record.thread is None or record.levelno >= self.levels.get(record.thread, 0)
