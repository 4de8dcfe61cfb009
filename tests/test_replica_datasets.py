"""Replica threads loading data at once, as transformers' examples do before ``prepare()``:
``datasets.load_dataset`` runs tqdm's ``thread_map``, whose ``ensure_lock`` is not thread-safe."""

from __future__ import annotations

import threading
from typing import Callable, List

import pytest
from tqdm.auto import tqdm
from tqdm.contrib import concurrent

from accel_xla_fsdp import Accelerator  # noqa: F401  (the import a script makes)
from accel_xla_fsdp.xla_cpu import patches, tqdm_lock

TARGET = "tqdm.contrib.concurrent:ensure_lock"


def overlap_in_threads(ensure_lock: Callable, threads: int = 3) -> List[BaseException]:
    """``threads`` plain threads inside ``ensure_lock(tqdm)`` at once unless it makes them take
    turns: thread i enters after thread i-1 has entered and leaves after it has left (each waits at
    most 0.5 s for the other, the time a turn may take). Returns their errors."""
    errors: List[BaseException] = []
    entered = [threading.Event() for _ in range(threads)]
    left = [threading.Event() for _ in range(threads)]

    def enter(i: int) -> None:
        try:
            if i:
                entered[i - 1].wait(timeout=0.5)
            with ensure_lock(tqdm):
                entered[i].set()
                if i:
                    left[i - 1].wait(timeout=0.5)
                else:
                    entered[-1].wait(timeout=0.5)  # the others are inside too, unless they take turns
            left[i].set()
        except BaseException as exc:  # noqa: BLE001 - the test reports what a thread met
            errors.append(exc)

    workers = [threading.Thread(target=enter, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return errors


@pytest.fixture
def no_tqdm_lock(monkeypatch) -> None:
    """tqdm as a fresh process has it: no class-wide lock yet, on the class or its bases (the case
    that breaks); put back after the test."""
    for cls in tqdm.__mro__:
        if "_lock" in vars(cls):
            monkeypatch.delattr(cls, "_lock")


def lock_left_behind() -> bool:
    return any("_lock" in vars(cls) for cls in tqdm.__mro__)


def test_tqdm_itself_breaks_when_threads_overlap(no_tqdm_lock: None) -> None:
    """Threads entering one after another and leaving in the same order: the second puts back the
    lock the first deleted (two entering at the very same moment both delete it, and the second
    fails: AttributeError: ... has no attribute '_lock', as seen in load_dataset)."""
    assert TARGET in patches.installed(), "importing Accelerator installs the patch"
    errors = overlap_in_threads(patches.original_of(TARGET))
    assert lock_left_behind() or any(isinstance(e, AttributeError) and "_lock" in str(e) for e in errors), errors


def test_replica_threads_take_turns_through_tqdm_lock(no_tqdm_lock: None, monkeypatch) -> None:
    assert concurrent.ensure_lock is patches.installed()[TARGET], "importing Accelerator installs it"
    monkeypatch.setattr(tqdm_lock, "replicas_are_threads", lambda: True)
    assert overlap_in_threads(concurrent.ensure_lock) == []
    # On replica threads the lock made is kept for good (tqdm_lock.py: another replica's progress bar
    # outside thread_map may still be closing with it).
    assert lock_left_behind(), "the class-wide lock is kept after the last replica leaves"
