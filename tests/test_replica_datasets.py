"""Replica threads loading data at once, as transformers' examples do before ``prepare()``:
``datasets.load_dataset`` runs tqdm's ``thread_map``, whose ``ensure_lock`` is not thread-safe."""

from __future__ import annotations

import threading
import time
from typing import Callable, List

import pytest
from tqdm.auto import tqdm
from tqdm.contrib import concurrent

from accel_xla_fsdp import Accelerator, _xla  # noqa: F401  (the import a script makes)
from accel_xla_fsdp.integration import tqdm_lock


def overlap_in_threads(ensure_lock: Callable, threads: int = 4) -> List[BaseException]:
    """``threads`` plain threads inside ``ensure_lock(tqdm)`` at the same time; their errors."""
    errors: List[BaseException] = []
    inside = threading.Barrier(threads, timeout=5)

    def enter() -> None:
        try:
            with ensure_lock(tqdm):
                try:
                    inside.wait(timeout=0.5)  # every thread inside at once, unless they take turns
                except threading.BrokenBarrierError:
                    pass
                time.sleep(0.05)
        except BaseException as exc:  # noqa: BLE001 - the test reports what a thread met
            errors.append(exc)

    workers = [threading.Thread(target=enter) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return errors


@pytest.fixture
def no_tqdm_lock() -> None:
    """tqdm as a fresh process has it: no class-wide lock yet (the case that breaks)."""
    if hasattr(tqdm, "_lock"):
        del tqdm._lock


def test_tqdm_itself_breaks_when_threads_overlap(no_tqdm_lock) -> None:
    assert tqdm_lock._original is not None, "importing accel_xla_fsdp installs the patch"
    errors = overlap_in_threads(tqdm_lock._original)
    assert any(isinstance(e, AttributeError) and "_lock" in str(e) for e in errors), errors


def test_replica_threads_take_turns_through_tqdm_lock(no_tqdm_lock, monkeypatch) -> None:
    assert getattr(concurrent.ensure_lock, "accel_xla_fsdp", False), "importing accel_xla_fsdp installs it"
    monkeypatch.setattr(_xla, "replicas_are_threads", lambda: True)
    assert overlap_in_threads(concurrent.ensure_lock) == []
    assert not hasattr(tqdm, "_lock"), "tqdm is left as it was found"
