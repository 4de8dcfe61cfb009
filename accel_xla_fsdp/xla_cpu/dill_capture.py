"""dill's ``temp.capture`` in several replica threads at once (``datasets`` fingerprints a function
passed to ``.map`` with dill, whose ``detect.nestedglobals`` disassembles it under ``capture``).

``capture('stdout')`` swaps the process-wide ``sys.stdout`` for a ``StringIO`` and puts back what it
found on leaving. Replica threads inside it at once (TRL's dataset preparation, every replica) put
back each other's ``StringIO``: the process's later prints (the Trainer's ``{'loss': ...}`` lines)
went nowhere, and a bytecode listing went to the real stdout (TRL's ``sft.py`` on 4 replicas, 2
logs of 3). On replica threads the stream is swapped once, for a router that sends each thread's
writes to that thread's capture, or to the stream it replaced when the thread captures nothing;
the last capture to leave puts the stream back. Elsewhere it is dill's own.
"""

from __future__ import annotations

import io
import sys
import threading
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List

from .rendezvous import replicas_are_threads

_SWAP = threading.Lock()


class _Router:
    """Stands for one ``sys`` stream while replica threads capture it: ``write`` and ``flush`` go
    to the calling thread's capture, if any; anything else (``encoding``, ``fileno``) is the stream's."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.users = 0
        self._captures = threading.local()

    def stack(self) -> List[io.StringIO]:
        if not hasattr(self._captures, "stack"):
            self._captures.stack = []
        return self._captures.stack

    def _target(self) -> Any:
        stack = self.stack()
        return stack[-1] if stack else self.stream

    def write(self, text: str) -> int:
        return self._target().write(text)

    def flush(self) -> None:
        self._target().flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


_ROUTERS: Dict[str, _Router] = {}


def per_thread(original: Callable[..., Any]) -> Callable[..., Any]:
    """The patch of ``dill.temp.capture`` (patches.py)."""

    @contextmanager
    def capture(stream: str = "stdout") -> Iterator[io.StringIO]:
        if not replicas_are_threads():
            with original(stream) as out:
                yield out
            return
        with _SWAP:
            router = _ROUTERS.get(stream)
            if router is None:
                router = _ROUTERS[stream] = _Router(getattr(sys, stream))
                setattr(sys, stream, router)
            router.users += 1
        out = io.StringIO()
        router.stack().append(out)
        try:
            yield out
        finally:
            router.stack().pop()
            with _SWAP:
                router.users -= 1
                if router.users == 0:
                    setattr(sys, stream, router.stream)
                    del _ROUTERS[stream]

    capture.__doc__ = original.__doc__
    return capture
