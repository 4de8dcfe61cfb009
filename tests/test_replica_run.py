"""Where replica threads meet (``xla_cpu/replica_run.py``), with plain threads: no device needed.

A meeting breaks at once when a replica it waits for has returned, and one that times out names
the replicas that did not come and where they are; a replica returning just after a meeting
completed breaks nothing.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from typing import Callable, Deque, Dict, List

import pytest
import torch

from accel_xla_fsdp import _xla, unit_state
from accel_xla_fsdp.xla_cpu import replica_run


def run_replicas(fns: List[Callable[[int], object]]) -> Dict[int, object]:
    """Each ``fns[rank](rank)`` as a replica thread; what each returned or raised, by rank."""
    replica_run.begin_run()
    outcome: Dict[int, object] = {}

    class Ended(Exception):
        pass

    def keep(rank: int, world: int, exc: BaseException) -> None:  # instead of ending the process
        outcome[rank] = exc
        raise Ended

    def target(rank: int) -> None:
        try:
            outcome[rank] = replica_run.run_replica(rank, len(fns), lambda: fns[rank](rank), keep)
        except Ended:
            pass

    threads = [threading.Thread(target=target, args=(rank,), daemon=True) for rank in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a replica thread is still waiting"
    return outcome


def test_meeting_waiting_for_a_returned_replica_breaks_at_once() -> None:
    meeting = replica_run.Meeting(3)
    started = time.monotonic()
    outcome = run_replicas(
        [
            lambda rank: meeting.wait(rank, "the test's meeting", 60.0),
            lambda rank: "returned without meeting",
            lambda rank: meeting.wait(rank, "the test's meeting", 60.0),
        ]
    )
    assert time.monotonic() - started < 5.0
    assert outcome[1] == "returned without meeting"
    for rank in (0, 2):
        assert isinstance(outcome[rank], replica_run.ReplicaGone), outcome[rank]
        message = str(outcome[rank])
        assert f"replica {rank} waits at the test's meeting for replica(s) [1], which have returned" in message
        assert "replica 1 has returned." in message


def test_replicas_meeting_from_different_places_are_said_once(capsys) -> None:
    meeting = replica_run.Meeting(3)
    here, there = (("train.py", 10, "step"),), (("train.py", 20, "save"),)
    run_replicas(
        [
            lambda rank: [meeting.wait(rank, "graph boundary 1", 30.0, site) for site in (here, here)],
            lambda rank: [meeting.wait(rank, "graph boundary 1", 30.0, site) for site in (there, here)],
            lambda rank: [meeting.wait(rank, "graph boundary 1", 30.0, site) for site in (here, there)],
        ]
    )
    said = capsys.readouterr().err
    assert said.count("from different places") == 1, said
    assert 'replica(s) [0, 2] came from:\n  File "train.py", line 10, in step' in said
    assert 'replica(s) [1] came from:\n  File "train.py", line 20, in save' in said


def sleeping_somewhere_recognizable(rank: int) -> None:
    time.sleep(4.0)


def test_meeting_that_times_out_names_the_missing_replica_and_where_it_is() -> None:
    meeting = replica_run.Meeting(2)
    started = time.monotonic()
    outcome = run_replicas([lambda rank: meeting.wait(rank, "graph boundary 7", 1.0), sleeping_somewhere_recognizable])
    assert 1.0 <= time.monotonic() - started < 10.0
    message = str(outcome[0])
    assert isinstance(outcome[0], replica_run.ReplicaGone), outcome[0]
    assert message.startswith("replica 0 waited 1 s at graph boundary 7 for replica(s) [1].")
    assert "replica 1 is at:" in message and "in sleeping_somewhere_recognizable" in message


def test_a_turn_that_is_never_passed_on_names_the_replica_holding_it() -> None:
    # Replica 0 met the others and took its turn, then never finished its sync (here: sleeps,
    # then returns without passing the turn on): replica 1 names it once its wait times out, and
    # replica 2 (whose turn comes after 1's) at once when 0 has returned.
    turns = replica_run.Turns(3)
    started = time.monotonic()

    def holds_its_turn(rank: int) -> None:
        turns.wait_for(rank, 30.0)
        sleeping_somewhere_recognizable(rank)

    outcome = run_replicas(
        [holds_its_turn, lambda rank: turns.wait_for(rank, 1.0), lambda rank: turns.wait_for(rank, 30.0)]
    )
    assert time.monotonic() - started < 10.0
    for rank in (1, 2):
        assert isinstance(outcome[rank], replica_run.ReplicaGone), outcome[rank]
    assert str(outcome[1]).startswith("replica 1 waited 1 s for its turn at graph boundary 1")
    assert "replica 0 is at:" in str(outcome[1]) and "in sleeping_somewhere_recognizable" in str(outcome[1])
    assert "after replica 0, which has returned" in str(outcome[2])


def test_replica_returning_right_after_a_meeting_breaks_nothing() -> None:
    """Replica 0 comes last, completing the meeting, and returns at once: the others leave the
    meeting normally, however late they wake."""
    meeting = replica_run.Meeting(3)

    def come_last_then_return(rank: int) -> str:
        time.sleep(0.05)
        meeting.wait(rank, "the meeting", 30.0)
        return "returned"

    def meet(rank: int) -> str:
        meeting.wait(rank, "the meeting", 30.0)
        return "met"

    for _ in range(20):
        outcome = run_replicas([come_last_then_return, meet, meet])
        assert outcome == {0: "returned", 1: "met", 2: "met"}, outcome


def test_a_failing_replica_reaches_on_failure_with_its_exception() -> None:
    def raise_it(rank: int) -> None:
        raise KeyError("mine")

    outcome = run_replicas([raise_it])
    assert isinstance(outcome[0], KeyError)


@pytest.mark.parametrize("rank", [0, 3])
def test_replica_frames_are_named_after_their_rank(rank: int) -> None:
    """faulthandler prints frame names only: a replica's outermost one is ``replica_<rank>``."""

    def frame_names(r: int) -> List[str]:
        frame, names = sys._getframe(), []
        while frame is not None:
            names.append(frame.f_code.co_name)
            frame = frame.f_back
        return names

    outcome = run_replicas([frame_names] * (rank + 1))
    assert f"replica_{rank}" in outcome[rank] and "replica_0" not in outcome[rank] or rank == 0, outcome[rank]
    assert f"replica_{rank}" in outcome[rank]


def sync_right_away(rank: int, world: int) -> float:
    x = torch.ones(2, device=_xla.device()) * rank
    _xla.sync()
    return float(x.sum().cpu())


def test_replicas_syncing_from_one_place_are_not_said_to_differ(pools, capfd) -> None:
    """A replica function that syncs at once has the replica entry (named per rank) among its
    innermost frames: the entry does not count as a place."""
    assert pools[2].run(sync_right_away, 2) == [0.0, 2.0]
    assert "from different places" not in capfd.readouterr().err


def test_live_roots_are_listed_safely_while_other_replicas_wrap() -> None:
    """Before a sync every replica lists the live FSDP roots while others may be wrapping (adding
    theirs): as a WeakSet this raised "Set changed size during iteration" at the sync that ends
    wrapping (once in ~110 runs of a reused 4-device pool); here it raised within a second."""

    class Root:
        pass

    saved, interval = list(unit_state._LIVE_ROOTS), sys.getswitchinterval()
    alive: Deque[Root] = collections.deque(maxlen=8)  # older roots die, as models are dropped
    stop = threading.Event()

    wrapped = 0

    def keep_wrapping() -> None:
        nonlocal wrapped
        while not stop.is_set():
            root = Root()
            alive.append(root)
            unit_state._track_root(root)
            wrapped += 1

    sys.setswitchinterval(1e-5)  # switch threads often: the race shows within a second
    wrapper = threading.Thread(target=keep_wrapping, daemon=True)
    wrapper.start()
    try:
        # A count of listings, not a time: on a loaded machine (CI) 1.5 s gave only 353 listings.
        deadline, listed = time.monotonic() + 120, 0
        while (listed < 1000 or wrapped < 1000) and time.monotonic() < deadline:
            roots = unit_state._live_roots()
            assert all(isinstance(r, Root) for r in roots[len(saved) :])  # live ones only, no dead reference
            listed += 1
    finally:
        stop.set()
        wrapper.join()
        sys.setswitchinterval(interval)
        unit_state._LIVE_ROOTS[:] = [r for r in unit_state._LIVE_ROOTS if r() in saved]
    assert listed >= 1000 and wrapped >= 1000, (listed, wrapped)  # both sides really ran at once
