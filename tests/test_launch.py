"""Training launched by torch_xla's own launcher, with nothing of ours starting the replicas.

``launch_train.py`` runs in a subprocess with 4 XLA:CPU devices: under ``pjrt.run_multiprocess``
(what ``xmp.spawn`` and ``accelerate launch`` use), then in its main thread. Importing
``accel_xla_fsdp`` must be all it takes for the replicas to take turns at every sync, so that
each program is compiled once in the process, not once per replica; a thread that is not one of
several replicas must sync exactly as torch_xla does. The subprocess runs beside the runner's
reference run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Iterator

import pytest
import torch
from launch_train import replica
from test_runner import _run_guarded

from accel_xla_fsdp import _xla

TESTS = Path(__file__).resolve().parent
DEADLINE_S = 180.0  # each run takes 10 to 30 s; a hang lasts for ever


class Script:
    """``launch_train.py`` in its own process group (the launcher starts a worker process of its
    own, which must die with it)."""

    def __init__(self) -> None:
        env = {
            **os.environ,
            **_xla.cpu_device_env(4),
            "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS), os.environ.get("PYTHONPATH", "")]),
        }
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            [sys.executable, str(TESTS / "launch_train.py")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.result: Dict | None = None

    def finish(self) -> Dict:
        """The script's result; fails the test if it hangs past the deadline or fails."""
        if self.result is not None:
            return self.result
        remaining = DEADLINE_S - (time.monotonic() - self.started)
        try:
            out, err = self.process.communicate(timeout=max(remaining, 1.0))
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"launch_train.py hung: still running after {DEADLINE_S:.0f} s")
        assert self.process.returncode == 0, f"launch_train.py failed:\n{err[-4000:]}"
        line = next(x for x in reversed(out.splitlines()) if x.startswith("RESULT "))
        self.result = json.loads(line[len("RESULT ") :])
        return self.result

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.communicate()


@pytest.fixture(scope="module")
def script() -> Iterator[Script]:
    started = Script()
    yield started
    started.kill()


def test_training_under_torch_xla_launcher_takes_turns(script, pools) -> None:
    """Under ``pjrt.run_multiprocess`` the replicas train exactly as under our runner, and every
    program is compiled once: as many compilations as the same training on one device."""
    reference, error, _ = _run_guarded(pools[4], replica, 4)
    assert error is None, error
    launched, single = script.finish()["launcher"], script.finish()["main_thread"]

    assert len(launched["losses"]) == 4
    for rank, (got, want) in enumerate(zip(launched["losses"], reference)):
        torch.testing.assert_close(
            torch.tensor(got), torch.tensor(want["losses"]), rtol=0, atol=1e-6, msg=lambda m: f"replica {rank}: {m}"
        )
    assert launched["compiles"] == single["compiles"], (
        f"{launched['compiles']} programs compiled under the launcher, {single['compiles']} on one device"
    )
    # The mean of the replicas' losses is the loss of the whole batch on one device.
    mean = torch.tensor(launched["losses"]).mean(0)
    torch.testing.assert_close(mean, torch.tensor(single["losses"]), rtol=0, atol=1e-5)


def test_main_thread_syncs_exactly_as_torch_xla(script) -> None:
    """A single-device script, and the main thread of a process whose replication spans 4
    devices: each sync reaches torch_xla's step marker with torch_xla's own arguments, after the
    ``before_graph_cut`` callbacks, and waits for no other replica (the sync timeout was 1 s)."""
    result = script.finish()["main_thread"]
    assert result["devices"] == 4
    calls = result["calls"]
    assert len(calls) == result["callbacks"] > result["single_device_syncs"] > 0
    for call in calls[: result["single_device_syncs"]]:  # torch_xla.sync()
        assert call == ["xla:0", [], {"wait": False, "reset_scope": True}]
    assert calls[-1] == ["xla:0", [], {"wait": True, "reset_scope": True}]  # torch_xla.sync(wait=True)
    assert result["x"] == [2.0, 2.0, 2.0]
    assert not result["turns_made"]
