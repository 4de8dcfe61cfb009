"""tqdm's ``thread_map`` in several replica threads at once (``datasets.load_dataset`` uses it).

``tqdm.contrib.concurrent.ensure_lock`` sets a class-wide lock on entry and deletes it on exit when
there was none before; two replica threads inside it at once delete it twice, and the second fails
with ``AttributeError: type object 'tqdm' has no attribute '_lock'`` (seen with transformers'
``run_clm_no_trainer.py`` on 4 XLA:CPU replicas, whose replicas each call ``load_dataset``). On
replica threads the replicas take turns through it, and the class-wide lock, once made, is kept;
elsewhere it is tqdm's own. The turn is held for the whole ``thread_map``, which holds no collective.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from .rendezvous import replicas_are_threads

_TURN = threading.RLock()


def taking_turns(original: Callable[..., Any]) -> Callable[..., Any]:
    """The patch of ``tqdm.contrib.concurrent.ensure_lock`` (patches.py)."""

    @contextmanager
    def ensure_lock(*args: Any, **kwargs: Any) -> Iterator[Any]:
        if not replicas_are_threads():
            with original(*args, **kwargs) as lock:
                yield lock
            return
        # A lock made now is kept for good: tqdm deletes one it made on leaving, while another replica's
        # progress bar (datasets' download, outside thread_map) was closing with it: AttributeError:
        # type object 'tqdm' has no attribute '_lock' (seen, TRL's sft.py on 4 replicas).
        (args[0] if args else kwargs["tqdm_class"]).get_lock()
        with _TURN, original(*args, **kwargs) as lock:
            yield lock

    ensure_lock.__doc__ = original.__doc__
    return ensure_lock
