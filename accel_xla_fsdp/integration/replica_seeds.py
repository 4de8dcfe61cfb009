"""``set_seed`` then building a model, in replica threads: each replica draws from its own seed.

On XLA:CPU the replicas are threads of one process and share torch's one CPU generator: a
``set_seed(42)`` in every replica followed by ``from_config`` interleaves the replicas' seeding
and drawing, and gave another initial model on every run (0.13 max weight difference between two
identical runs, measured). torch's generator cannot be made per-thread, so the model builders
are: ``torch.manual_seed`` (which Accelerate's and transformers' ``set_seed`` call) in a replica
thread also remembers the seeded state for that thread, and a model built by ``from_config`` or
``from_pretrained`` (its newly initialized weights) in that thread draws from the thread's state,
under the lock that builds one model at a time, continuing where its last build stopped. So
every replica builds the model a process of its own seeded with that seed would, on every run,
as long as nothing else in the thread drew from torch's generator between the seed and the
build (such draws come from the shared generator, as before). On a TPU (one process per chip)
none of this is used.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from .. import _xla

# One model is built at a time in the process (transformers 5's loading is not thread-safe
# either: see pretrained_loading.py); seeding waits for a build in progress.
BUILDING = threading.RLock()
_thread_states: "weakref.WeakKeyDictionary[threading.Thread, torch.Tensor]" = weakref.WeakKeyDictionary()


def install() -> None:
    """Patch ``torch.manual_seed`` (once per process)."""
    if getattr(torch.manual_seed, "accel_xla_fsdp", False):
        return
    patched = _remembering_seed(torch.manual_seed)
    torch.manual_seed = torch.random.manual_seed = patched


def _remembering_seed(original: Callable[[int], Any]) -> Callable[[int], Any]:
    def manual_seed(seed: int) -> Any:
        if not _xla.replicas_are_threads():
            return original(seed)
        with BUILDING:
            _thread_states[threading.current_thread()] = torch.Generator().manual_seed(int(seed)).get_state()
            return original(seed)

    manual_seed.__doc__ = original.__doc__
    manual_seed.accel_xla_fsdp = True
    return manual_seed


@contextmanager
def thread_generator() -> Iterator[None]:
    """Under ``BUILDING``: torch's CPU generator holds this replica thread's own state (if it
    seeded one) for the block, and the process's state again after it."""
    with BUILDING:
        own = _thread_states.get(threading.current_thread())
        if own is None:
            yield
            return
        shared = torch.get_rng_state()
        torch.set_rng_state(own)
        try:
            yield
        finally:
            _thread_states[threading.current_thread()] = torch.get_rng_state()
            torch.set_rng_state(shared)
