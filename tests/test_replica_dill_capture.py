"""Replica threads fingerprinting functions at once, as TRL's dataset preparation does in every
replica (``datasets`` hashes a ``.map`` function with dill, whose ``detect.nestedglobals`` captures
``sys.stdout`` to disassemble it): prints made meanwhile must reach the real stdout."""

from __future__ import annotations

import io
import sys
import threading
from typing import List

import dill.detect
import dill.temp

from accel_xla_fsdp import Accelerator  # noqa: F401  (the import a script makes)
from accel_xla_fsdp.xla_cpu import dill_capture, patches

TARGET = "dill.temp:capture"


def tokenize(example: dict) -> dict:  # a .map function with globals to find
    return {"n": len(str(example)) + len(sys.argv)}


def fingerprint_and_print(monkeypatch, threads: int = 4, rounds: int = 200) -> List[str]:
    """``threads`` threads run dill's ``nestedglobals`` (under the ``capture`` installed now) in a
    loop while each prints a line per round; returns what went wrong (empty when nothing did)."""
    real = io.StringIO()
    monkeypatch.setattr(sys, "stdout", real)
    start = threading.Barrier(threads)
    wrong: List[str] = []
    alone = sorted(dill.detect.nestedglobals(tokenize))  # one thread at a time: what it finds

    def replica(rank: int) -> None:
        start.wait()
        for step in range(rounds):
            found = dill.detect.nestedglobals(tokenize)
            if sorted(found) != alone:
                wrong.append(f"rank {rank} step {step}: found {found}")
            sys.stdout.write(f"rank {rank} step {step}\n")  # one write: print makes two, which interleave

    workers = [threading.Thread(target=replica, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if sys.stdout is not real:
        wrong.append("sys.stdout is left a StringIO")
    printed = sorted(real.getvalue().splitlines())
    expected = sorted(f"rank {r} step {s}" for r in range(threads) for s in range(rounds))
    if printed != expected:
        wrong.append(
            f"{len(set(expected) - set(printed))} prints lost, {len(set(printed) - set(expected))} other lines"
        )
    return wrong


def test_dill_itself_loses_prints_of_threads_capturing_at_once(monkeypatch) -> None:
    assert TARGET in patches.installed(), "importing Accelerator installs the patch"
    monkeypatch.setattr(dill.temp, "capture", patches.original_of(TARGET))
    assert fingerprint_and_print(monkeypatch) != []


def test_replica_threads_each_capture_their_own_stdout(monkeypatch) -> None:
    assert dill.temp.capture is patches.installed()[TARGET], "importing Accelerator installs it"
    monkeypatch.setattr(dill_capture, "replicas_are_threads", lambda: True)
    assert fingerprint_and_print(monkeypatch) == []
