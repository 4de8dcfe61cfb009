"""The replica threads of one process: how they meet, and how a failing one ends the run.

On XLA:CPU every replica is a thread of one process (see the platform note in ``_xla``), and a
thread that waits can be neither stopped nor told to stop from outside. So:

* a replica that raises ends the process at once (``fail``), its traceback written to stderr
  first: the others may be blocked inside a device collective that will never complete, where
  only the end of the process reaches them. Under torch_xla's launcher (``xmp.spawn``,
  ``accelerate launch``) the parent then sees its worker process die and exits non-zero;
* replicas meet (``Meeting``) while every replica of the run is still running: a meeting that
  waits for a replica which has returned breaks at once, naming it, instead of waiting out its
  timeout; a meeting that times out names the replicas that did not come and where each of them
  is (its Python stack);
* if XLA:CPU aborts the process (a replica waited more than its fixed 10 s at a collective),
  ``faulthandler`` prints every thread's Python stack, and each replica's outermost frame is
  named after its rank (``replica_2``): the stacks say which replica was where. What leads to
  that abort is said on stderr before it: replicas that come to one meeting from different
  places (their programs differ), and a replica that compiles a program of its own in its turn.

Pure Python: graph_boundaries.py supplies the ranks.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
import traceback
import types
from typing import Any, Callable, Dict, List, NoReturn, Optional, Set, Tuple

# One condition for the run's state and every meeting: a replica returning wakes every waiter.
_state = threading.Condition()
_threads: Dict[int, int] = {}  # rank -> ident of the replica's thread, for its stack
_returned: Set[int] = set()  # ranks whose function has returned in this run
_failing = threading.Lock()
OWN_PROGRAM_REPORT_S = 2.0  # below, a compile of its own is too short to endanger a collective


class ReplicaGone(RuntimeError):
    """A meeting cannot complete: a replica it waits for has returned, or never came in time."""


def begin_run() -> None:
    """A new set of replica threads is about to start (the previous set, if any, has ended)."""
    with _state:
        _threads.clear()
        _returned.clear()
    if not faulthandler.is_enabled():
        faulthandler.enable(all_threads=True)  # XLA:CPU's abort is a SIGABRT: print who was where


OnFailure = Callable[[int, int, BaseException], NoReturn]


def run_replica(rank: int, world: int, fn: Callable[[], Any], on_failure: Optional[OnFailure] = None) -> Any:
    """``fn()`` as replica ``rank`` of ``world``. If it raises, ``on_failure(rank, world, exc)``
    ends the process (by default ``fail``)."""
    # faulthandler names each frame by its code's name: this thread's outermost one says its rank.
    named = types.FunctionType(_run_as_replica.__code__.replace(co_name=f"replica_{rank}"), globals())
    return named(rank, world, fn, on_failure or fail)


def _run_as_replica(rank: int, world: int, fn: Callable[[], Any], on_failure: OnFailure) -> Any:
    with _state:
        _threads[rank] = threading.get_ident()
    try:
        result = fn()
    except BaseException as exc:  # noqa: BLE001 - any failure must end the run, not hang it
        on_failure(rank, world, exc)
    with _state:
        _returned.add(rank)
        _state.notify_all()
    return result


def fail(rank: int, world: int, exc: BaseException) -> NoReturn:
    """Write replica ``rank``'s traceback to stderr and end the process (status 1)."""
    text = "".join(traceback.format_exception(exc))
    with _failing:  # the first failure is the one reported; a second waits here for the end
        sys.stdout.flush()
        sys.stderr.write(
            f"accel_xla_fsdp: replica {rank} of {world} failed; ending the process, whose other "
            f"replicas cannot be stopped otherwise.\n{text}"
        )
        sys.stderr.flush()
        os._exit(1)


Site = Tuple[Tuple[str, int, str], ...]  # (file, line, function) of the frames a replica came from


class Meeting:
    """A reusable barrier for the ``parties`` replica threads of this process.

    Not ``threading.Barrier``: a replica that has returned must break a meeting at once, and
    aborting a Barrier also breaks it for the threads of a meeting that just completed but have
    not woken yet. Replicas that come to one meeting from different places (``site``) are said
    on stderr, once: they are at different points of their programs.
    """

    def __init__(self, parties: int) -> None:
        self.parties = parties
        self.generation = 0
        self.present: Dict[int, Site] = {}
        self.divergence_said = False

    def wait(self, rank: int, where: str, timeout_s: float, site: Site = ()) -> None:
        """Wait until every replica has come here; ``where`` names the place in errors."""
        with _state:
            generation = self.generation
            self.present[rank] = site
            if len(self.present) == self.parties:
                self._check_sites(where)
                self.present = {}
                self.generation += 1
                _state.notify_all()
                return
            deadline = time.monotonic() + timeout_s
            while self.generation == generation:
                gone = sorted(_returned - set(self.present))
                remaining = deadline - time.monotonic()
                if gone or remaining <= 0:
                    del self.present[rank]
                    raise ReplicaGone(self._missing_message(rank, where, gone, timeout_s))
                _state.wait(remaining)

    def _check_sites(self, where: str) -> None:
        by_site: Dict[Site, List[int]] = {}
        for rank, site in sorted(self.present.items()):
            by_site.setdefault(site, []).append(rank)
        if len(by_site) == 1 or self.divergence_said:
            return
        self.divergence_said = True
        places = "".join(
            f"replica(s) {ranks} came from:\n" + "".join(f'  File "{f}", line {n}, in {fn}\n' for f, n, fn in site)
            for site, ranks in by_site.items()
        )
        sys.stderr.write(
            f"accel_xla_fsdp: the replicas came to {where} from different places (said once): their "
            "programs differ, collectives in them do not match, and XLA:CPU aborts the run when a replica "
            f"waits at one more than 15 s for the others.\n{places}"
        )
        sys.stderr.flush()

    def _missing_message(self, rank: int, where: str, gone: List[int], timeout_s: float) -> str:
        missing = [r for r in range(self.parties) if r not in self.present and r != rank]
        if gone:
            head = f"replica {rank} waits at {where} for replica(s) {gone}, which have returned and will never come."
        else:
            head = f"replica {rank} waited {timeout_s:.0f} s at {where} for replica(s) {missing}."
        return f"{head} Every replica must reach it the same number of times.\n{whereabouts(missing)}"


def whereabouts(ranks: List[int]) -> str:
    """Where each of these replicas is: its Python stack, or that it has returned."""
    frames = sys._current_frames()
    lines = []
    for rank in ranks:
        frame = frames.get(_threads.get(rank, -1))
        if rank in _returned:
            lines.append(f"replica {rank} has returned.")
        elif frame is None:
            lines.append(f"replica {rank} has not started.")
        else:
            lines.append(f"replica {rank} is at:\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(lines)


class Turns:
    """Replicas meet, then take turns in rank order, at every graph boundary."""

    def __init__(self, num_replicas: int) -> None:
        self.num_replicas = num_replicas
        self.meeting = Meeting(num_replicas)
        self.turn = 0

    def wait_for(self, rank: int, timeout_s: float, site: Site = ()) -> None:
        where = f"graph boundary {self.meeting.generation + 1} (xm.mark_step / torch_xla.sync)"
        self.meeting.wait(rank, where, timeout_s, site)
        # Every replica has come, so each takes its turn. The one whose turn it is may still never
        # pass it on (it returned, or its sync hangs inside torch_xla): the others then name it
        # instead of waiting for ever. The clock restarts whenever the turn moves on.
        with _state:
            holder, deadline = self.turn, time.monotonic() + timeout_s
            while self.turn != rank:
                if self.turn != holder:
                    holder, deadline = self.turn, time.monotonic() + timeout_s
                remaining = deadline - time.monotonic()
                if holder in _returned or remaining <= 0:
                    raise ReplicaGone(self._turn_message(rank, holder, where, timeout_s))
                _state.wait(remaining)

    def _turn_message(self, rank: int, holder: int, where: str, timeout_s: float) -> str:
        if holder in _returned:
            head = f"replica {rank} waits for its turn at {where} after replica {holder}, which has returned."
        else:
            head = f"replica {rank} waited {timeout_s:.0f} s for its turn at {where}: replica {holder}'s sync there "
            head += "has not finished."
        return f"{head}\n{whereabouts([holder])}"

    def note_own_program(self, rank: int, seconds: float) -> None:
        """Replica ``rank`` compiled a program in its turn. The replicas share compiled programs,
        so the ones before it traced another: any collective they launched waited for it that
        long, and XLA:CPU aborts the run past 15 s (the ``Termination timeout`` of 10 s after a
        5-s warning). Said on stderr from ``OWN_PROGRAM_REPORT_S`` on, with where it synced."""
        if seconds < OWN_PROGRAM_REPORT_S:
            return
        sys.stderr.write(
            f"accel_xla_fsdp: replica {rank} compiled its own program for {seconds:.1f} s at graph boundary "
            f"{self.meeting.generation} (the replicas before it traced another one, and waited at any "
            f"collective in theirs meanwhile). It synced at:\n{''.join(traceback.format_stack()[-10:-3])}"
        )
        sys.stderr.flush()

    def done(self) -> None:
        with _state:
            self.turn = (self.turn + 1) % self.num_replicas
            _state.notify_all()
