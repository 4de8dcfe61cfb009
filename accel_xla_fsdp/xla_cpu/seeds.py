"""torch's CPU generator in replica threads: each replica draws from its own, as a process would.

On XLA:CPU the replicas are threads of one process and share torch's one CPU generator. A
``set_seed(42)`` in every replica followed by ``from_config`` interleaved the replicas' seeding
and drawing, and gave another initial model on every run (0.13 max weight difference between two
identical runs, measured); ``DataCollatorForLanguageModeling`` drew each replica's masks from
the same shared stream, so which replica got which mask depended on thread timing. torch's
default generator cannot be made per-thread, so:

* ``torch.manual_seed`` (which Accelerate's and transformers' ``set_seed`` call) in a replica
  thread gives that thread a ``torch.Generator`` of its own, seeded alike (and seeds the
  process's as before).
* After that, torch's Python-level random functions called in the thread on CPU tensors without
  a generator (``torch.bernoulli``, ``rand``, ``randn``, ``randint``, ``randperm``, ``normal``,
  ``multinomial``, ``poisson`` and the ``Tensor`` methods ``random_``, ``uniform_``, ``normal_``,
  ``bernoulli_``, ... that ``nn.init`` and the dataloader's seed use) are given the thread's
  generator, and ``torch.get_rng_state``/``set_rng_state`` (Accelerate's ``save_state`` and
  ``load_state``) read and write it. A CPU generator with the same state gives the same numbers
  as the default one, so every replica draws what a process of its own seeded alike would.
* A model built by ``from_config`` or ``from_pretrained`` (hf_accelerate/pretrained_loading.py) draws
  with the process's generator holding the thread's state, under the lock that builds one model at a
  time, so draws inside C++ code are covered as well.

Not covered: draws made inside C++ without a Python call (``F.dropout`` on CPU tensors: on XLA
tensors dropout uses the XLA generator), Python's ``random`` and NumPy's global generators (one
per process; ``set_seed`` seeds them too). XLA tensors draw from the device's generator and are
left alone. On a TPU (one process per chip) none of this is used.
"""

from __future__ import annotations

import functools
import threading
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, Optional

import torch

from .rendezvous import replicas_are_threads

# One model is built at a time in the process (transformers 5's loading is not thread-safe
# either: see hf_accelerate/pretrained_loading.py); seeding waits for a build in progress.
BUILDING = threading.RLock()
_own = threading.local()  # .generator: this replica thread's, once it seeded; .building: in a build
# What the patch table (patches.py) routes to the thread's generator: torch functions, Tensor methods.
ROUTED_FUNCTIONS = ("bernoulli", "multinomial", "normal", "poisson", "rand", "randn", "randint", "randperm")
ROUTED_METHODS = (
    "bernoulli",
    "bernoulli_",
    "cauchy_",
    "exponential_",
    "geometric_",
    "log_normal_",
    "multinomial",
    "normal_",
    "random_",
    "uniform_",
)
# torch's own state functions, recorded when patched (thread_generator uses them)
_originals: Dict[str, Callable[..., Any]] = {
    "get_rng_state": torch.get_rng_state,
    "set_rng_state": torch.set_rng_state,
}


def thread_state_generator() -> Optional[torch.Generator]:
    """This replica thread's own CPU generator (None: it has not seeded one, or is in a build)."""
    if getattr(_own, "building", False):
        return None
    return getattr(_own, "generator", None)


def own_seed(original: Callable[[int], Any]) -> Callable[[int], Any]:
    """The patch of ``torch.manual_seed``: a replica thread seeds a generator of its own too."""

    @functools.wraps(original)
    def manual_seed(seed: int) -> Any:
        if not replicas_are_threads():
            return original(seed)
        with BUILDING:  # not while a build holds the process's generator
            _own.generator = torch.Generator().manual_seed(int(seed))
            return original(seed)

    return manual_seed


def own_get_state(original: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """The patch of ``torch.get_rng_state``: the replica thread's own state, once it seeded."""
    _originals["get_rng_state"] = original

    @functools.wraps(original)
    def get_rng_state() -> torch.Tensor:
        own = thread_state_generator()
        return original() if own is None else own.get_state()

    return get_rng_state


def own_set_state(original: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    """The patch of ``torch.set_rng_state``: the replica thread's own state, once it seeded."""
    _originals["set_rng_state"] = original

    @functools.wraps(original)
    def set_rng_state(new_state: torch.Tensor) -> None:
        own = thread_state_generator()
        if own is None:
            original(new_state)
        else:
            own.set_state(new_state)

    return set_rng_state


def routed(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` drawing from the calling replica thread's generator when it has one, the call
    names no generator (or ``generator=None``, as the collators and the dataloader pass) and the
    result lives on the CPU."""

    @functools.wraps(original)
    def routed(*args: Any, **kwargs: Any) -> Any:
        own = thread_state_generator()
        if own is not None and kwargs.get("generator") is None and _draws_on_cpu(args, kwargs):
            kwargs["generator"] = own
        return original(*args, **kwargs)

    return routed


def _draws_on_cpu(args: tuple, kwargs: Dict[str, Any]) -> bool:
    """Whether the call's tensors (the first one found) or its ``device`` are on the CPU."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type == "cpu"
    device = kwargs.get("device")
    return torch.device(device if device is not None else torch.get_default_device()).type == "cpu"


@contextmanager
def thread_generator() -> Iterator[None]:
    """Under ``BUILDING``: torch's CPU generator holds this replica thread's own state (if it
    seeded one) for the block, and the process's state again after it; the thread's generator
    continues where the block stopped. A block inside a block changes nothing."""
    with BUILDING:
        own = thread_state_generator()
        if own is None:
            yield
            return
        shared = _originals["get_rng_state"]()
        _originals["set_rng_state"](own.get_state())
        _own.building = True
        try:
            yield
        finally:
            _own.building = False
            own.set_state(_originals["get_rng_state"]())
            _originals["set_rng_state"](shared)
