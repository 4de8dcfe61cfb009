"""The patch table (accel_xla_fsdp/xla_cpu/patches.py) is what is installed: nothing more, nothing
less, on XLA:CPU and on a TPU; ``uninstall()`` puts every original back (compared by identity
with what the names held before ``accel_xla_fsdp`` was imported); the command prints it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

from accel_xla_fsdp.xla_cpu.patches import PATCHES, Platforms

HERE = Path(__file__).resolve().parent
# Found by scanning modules and classes for our functions: every target but the root logger's
# handler list, which holds a list, and the names that hold our Accelerator class, not functions of ours.
NOT_FUNCTIONS = {"logging:root.handlers", "accelerate:Accelerator", "accelerate.accelerator:Accelerator"}


def _check(platform: str) -> Dict[str, List[str]]:
    env = {**os.environ, "PJRT_DEVICE": platform}
    run = subprocess.run(
        [sys.executable, str(HERE / "patch_check.py"), json.dumps([p.target for p in PATCHES])],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=HERE.parent,
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stdout + run.stderr
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.mark.parametrize("platform", ["CPU", "TPU"])
def test_what_is_installed_is_the_table_and_uninstall_restores_it(platform: str) -> None:
    result = _check(platform)
    every = {p.target for p in PATCHES if p.platforms is Platforms.EVERY}
    if platform == "TPU":
        assert set(result["installed"]) <= every, "on a TPU only what every platform needs"
    assert result["installed"] == result["listed"]
    assert result["holding"] == result["installed"]
    assert result["present"] == sorted(set(result["installed"]) - NOT_FUNCTIONS)
    assert result["not_restored"] == [] and result["still_ours"] == []


def test_the_command_prints_the_table() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "accel_xla_fsdp.xla_cpu", "--patches"], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    for patch in PATCHES:
        assert patch.target in run.stdout
    assert f"{len(PATCHES)} patched names" in run.stdout
