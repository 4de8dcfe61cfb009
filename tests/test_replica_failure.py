"""A replica that raises ends the whole run promptly, under every launcher, its traceback first.

``failing_replica.py`` trains a tiny Llama on 4 XLA:CPU devices and its replica 1 raises, under
torch_xla's ``pjrt.run_multiprocess`` and ``xmp.spawn`` and under ``accelerate launch`` (our
own runner: ``test_runner.py``). Without ``xla_cpu/replica_run.py`` the other replicas waited 600 s where
the replicas meet, or until XLA:CPU aborted a collective, and the failing traceback came last if
at all. Each run's measured time from the failure to the end of the process is printed (``-s``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import pytest

from accel_xla_fsdp import _xla

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
ACCELERATE = Path(sys.executable).parent / "accelerate"
EXIT_WITHIN_S = 30.0
HANG_DEADLINE_S = 300.0  # imports and a first compile, then the failure


def command(launcher: str, when: str) -> List[str]:
    script = str(TESTS / "failing_replica.py")
    if launcher == "accelerate":
        config = str(ROOT / "plugins" / "xla_fsdp_cpu.yaml")
        return [str(ACCELERATE), "launch", "--config_file", config, script, "accelerate", when]
    return [sys.executable, script, launcher, when]


def run(launcher: str, when: str, devices: int = 4) -> tuple:
    """(exit status, stderr, seconds from the failure to the end of the run)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PJRT_", "CPU_NUM_DEVICES", "XLA_"))}
    if launcher != "accelerate":  # accelerate launch takes the device count from the config file
        env.update(_xla.cpu_device_env(devices))
    python_path = os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")])
    env.update(HF_HUB_OFFLINE="1", PYTHONPATH=python_path)
    process = subprocess.Popen(
        command(launcher, when),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the launcher's worker process dies with it
    )
    try:
        out, err = process.communicate(timeout=HANG_DEADLINE_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        pytest.fail(f"{launcher} run hung: still running after {HANG_DEADLINE_S:.0f} s")
    ended = time.time()
    failing = re.search(r"FAILING AT ([0-9.]+)", out)
    return process.returncode, err, ended - float(failing.group(1)) if failing else None


@pytest.mark.parametrize(
    "launcher, when",
    [("pjrt", "collective"), ("xmp", "step"), ("accelerate", "step"), ("accelerate", "collective")],
)
def test_failing_replica_ends_the_run_with_its_traceback_first(launcher: str, when: str) -> None:
    status, err, seconds = run(launcher, when)
    assert seconds is not None, f"replica 1 never reached its failure:\n{err[-4000:]}"
    print(f"\n{launcher} / {when}: exit status {status}, {seconds:.1f} s from the failure to the end")
    assert status != 0
    assert seconds < EXIT_WITHIN_S, f"the run took {seconds:.1f} s to end after replica 1 failed:\n{err[-4000:]}"
    first = err.index("Traceback (most recent call last)")
    assert "replica 1 of 4 failed" in err[:first], err[: first + 2000]
    second = err.find("Traceback (most recent call last)", first + 1)
    first_traceback = err[first : second if second > 0 else len(err)]
    assert f"ReplicaFailure: replica 1 fails on purpose ({when})" in first_traceback, first_traceback[-4000:]


def test_xla_abort_names_the_replica_that_was_late_and_where_each_was() -> None:
    """XLA:CPU's 10-s abort at a collective is a SIGABRT from C++: faulthandler prints the
    threads' Python stacks, and each replica's outermost frame carries its rank.

    Two devices, so one replica waits and one thread aborts. With more, every waiting replica
    reaches XLA's limit within microseconds and aborts: the first abort's dump runs with the
    default handler already restored (faulthandler's way), and a second abort can end the process
    mid-dump or before its first line (seen in CI with 4 devices)."""
    status, err, _ = run("pjrt", "late", devices=2)
    assert status != 0
    assert "Termination timeout" in err, err[-4000:]
    assert "Fatal Python error: Aborted" in err, err[-4000:]
    threads = err[err.index("Fatal Python error: Aborted") :].split("Thread 0x")
    waiting = [t for t in threads if " in replica_0\n" in t]
    late = [t for t in threads if " in replica_1\n" in t]
    assert len(waiting) == 1 and len(late) == 1, err[-4000:]
    assert "in wait_inside_a_collective" in waiting[0], waiting[0]
    assert "in wait_inside_a_collective" not in late[0], late[0]  # still sleeping, in train
