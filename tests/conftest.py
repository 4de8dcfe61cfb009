"""Shared fixtures: one device process per device count, reused by every test.

Starting a device process costs ~8 s (importing torch, torch_xla and transformers) and each new
program is compiled once per process, so every test of one device count runs in the same pool.
A test whose replica fails ends its pool; the next test starts a fresh one.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Dict, Iterator, List

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # test helper modules import by name in replicas
sys.path.append(str(Path(__file__).parents[1] / "scripts"))  # hlo_dump.py, shared with the benchmark

from quick_tier import select  # noqa: E402

from accel_xla_fsdp import DevicePool, runner  # noqa: E402

DEVICE_COUNTS = (1, 2, 4)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--quick", action="store_true", help="only the quick tier (tests/quick_tier.py)")


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    if not config.getoption("--quick"):
        return
    tests = Path(__file__).parent
    ids = [Path(item.path).relative_to(tests).as_posix() + item.nodeid[item.nodeid.index("::") :] for item in items]
    chosen, unmatched = select(ids)
    if unmatched and len({item.path for item in items}) == len(list(tests.glob("test_*.py"))):
        raise pytest.UsageError("tests/quick_tier.py names tests that do not exist: " + ", ".join(unmatched))
    config.hook.pytest_deselected(items=[item for item, keep in zip(items, chosen) if not keep])
    items[:] = [item for item, keep in zip(items, chosen) if keep]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The native stacks of every device process that died of SIGSEGV, whose test was then run
    again (pyproject.toml): the crash inside torch_xla is not understood (docs/xla-cpu.md), and
    a rerun that passes would otherwise hide them. The device process prints them (_xla)."""
    for report in terminalreporter.stats.get("rerun", []):
        start = report.capstderr.find("SIGSEGV(11)")
        if start >= 0:
            terminalreporter.write_sep("=", f"SIGSEGV in a device process, then rerun: {report.nodeid}")
            terminalreporter.write_line(report.capstderr[start:])


@pytest.fixture(scope="session")
def pools() -> Iterator[Dict[int, DevicePool]]:
    made = {n: DevicePool(n) for n in DEVICE_COUNTS}
    yield made
    for pool in made.values():
        pool.close()


@pytest.fixture(autouse=True)
def restored_environment() -> Iterator[None]:
    """Every test leaves the test process's environment as it found it. Code under test writes
    to it by design (the plugin exports ``FSDP_CPU_RAM_EFFICIENT_LOADING`` for ``from_pretrained``,
    as Accelerate's does), and a variable left behind changes what later tests load."""
    with runner.ENVIRONMENT_LOCK:  # not a copy taken while a background thread starts a pool
        saved = dict(os.environ)
    yield
    with runner.ENVIRONMENT_LOCK:
        if os.environ != saved:
            os.environ.clear()
            os.environ.update(saved)


@pytest.fixture(params=DEVICE_COUNTS, ids=lambda n: f"{n}dev")
def pool(request, pools) -> DevicePool:
    """A pool of 1, 2 and 4 XLA:CPU devices in turn."""
    return pools[request.param]
