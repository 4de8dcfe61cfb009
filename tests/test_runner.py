"""The device runner: results, failures, process death, slow replicas, ``seeded``.

Replica functions live at module level: the runner pickles them by reference and the device
process imports this module by name (conftest puts tests/ on sys.path).

A hang must never go unnoticed (pytest-timeout is not installed), so every call that could hang
goes through ``_run_guarded``: ``pool.run`` in a thread, joined with a deadline; past it the
pool's process is killed and the test fails.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
import traceback
from typing import Any, Optional, Tuple

import pytest
import torch
import torch.nn as nn

from accel_xla_fsdp import DevicePool, ReplicaError, XlaFullyShardedDataParallel, _xla, run_on_devices, seeded
from accel_xla_fsdp.xla_cpu.replica_run import ReplicaGone

# A failing or dying run must end within this long (it ends in about a second when the runner works;
# a hang would last for ever).
PROMPT_S = 15.0
HANG_DEADLINE_S = 120.0


def _run_guarded(
    pool: DevicePool, fn, *args: Any, deadline: float = HANG_DEADLINE_S
) -> Tuple[Any, Optional[BaseException], float]:
    """``pool.run(fn, *args)`` with a deadline: (results, exception, seconds)."""
    box: dict = {}

    def target() -> None:
        try:
            box["results"] = pool.run(fn, *args)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    start = time.monotonic()
    thread = threading.Thread(target=target, name=f"guarded-{fn.__name__}", daemon=True)
    thread.start()
    thread.join(deadline)
    elapsed = time.monotonic() - start
    if thread.is_alive():
        process = pool._process
        if process is not None:
            process.kill()  # unblocks pool.run (it sees the process die)
        thread.join(30)
        pytest.fail(f"pool.run({fn.__name__}) hung: still running after {deadline:.0f} s")
    return box.get("results"), box.get("error"), elapsed


def _warm(pool: DevicePool) -> None:
    """Start the pool's process (if needed) so timings below measure the run only."""
    results, error, _ = _run_guarded(pool, return_rank)
    assert error is None, error
    assert results == list(range(pool.num_devices))


# ---------------------------------------------------------------------------------------------
# Replica functions


def return_rank(rank: int) -> int:
    return rank


def gather_ranks(rank: int, k: int, tag: str) -> dict:
    """Each replica contributes ``k`` copies of its rank; the all-gather concatenates them."""
    dev = _xla.device()
    x = torch.full((k,), float(rank)).to(dev)  # device data, not a constant baked into the graph
    gathered = _xla.all_gather(x, None, False)
    _xla.sync()
    return {
        "rank": rank,
        "tag": tag,
        "global_rank": _xla.global_rank(),
        "world_size": _xla.world_size(),
        "device": str(dev),
        "gathered": gathered,
        "nested": [x * 2, (x + 1,)],
    }


def raise_in_replica_1(rank: int) -> torch.Tensor:
    x = torch.full((2,), float(rank)).to(_xla.device())
    if rank == 1:
        raise ValueError("replica one refuses")
    gathered = _xla.all_gather(x, None, False)  # replica 0 waits here for replica 1
    _xla.sync()
    return gathered


def slow_first_collective(rank: int, slow_rank: int, sleep_s: float) -> Tuple[int, torch.Tensor]:
    if rank == slow_rank:
        time.sleep(sleep_s)
    x = torch.arange(3, dtype=torch.float32).add(10 * rank).to(_xla.device())
    gathered = _xla.all_gather(x, None, False)
    _xla.sync()
    return rank, gathered


def build_seeded_linear(rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
    with seeded(0):
        lin = nn.Linear(64, 64)
    return lin.weight.detach(), lin.bias.detach()


def report_env(rank: int, k: int) -> dict:
    x = torch.full((k,), float(rank + 1)).to(_xla.device())
    gathered = _xla.all_gather(x, None, False)
    _xla.sync()
    return {
        "rank": rank,
        "gathered": gathered,
        "marker": os.environ.get("ACCEL_XLA_FSDP_TEST_MARKER"),
        "cpu_num_devices": os.environ.get("CPU_NUM_DEVICES"),
        "pid": os.getpid(),
    }


def exit_with_code_3(rank: int) -> None:
    if rank == _xla.world_size() - 1:
        os._exit(3)
    x = torch.zeros(2).to(_xla.device())
    _xla.all_gather(x, None, False)
    _xla.sync()


def sigkill_self(rank: int) -> None:
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    x = torch.zeros(2).to(_xla.device())
    _xla.all_gather(x, None, False)
    _xla.sync()


def segfault_in_replica_1(rank: int) -> None:
    if rank == 1:
        ctypes.string_at(0)  # reads address 0: a SIGSEGV in this replica's thread


class TwoArgError(Exception):
    """An exception that pickles but does not unpickle (its __init__ takes two arguments)."""

    def __init__(self, what: str, why: str) -> None:
        super().__init__(f"{what} failed: {why}")


def raise_two_arg_error(rank: int) -> None:
    raise TwoArgError("loading", "no such shard")


# ---------------------------------------------------------------------------------------------
# Tests (pools that die are at the end, so the session pools restart as rarely as possible)


def test_results_in_rank_order_on_cpu(pool: DevicePool) -> None:
    n = pool.num_devices
    results, error, _ = _run_guarded(pool, gather_ranks, 3, "hello")
    assert error is None, error
    assert isinstance(results, list) and len(results) == n
    expected = torch.arange(n, dtype=torch.float32).repeat_interleave(3)
    for rank, res in enumerate(results):
        assert res["rank"] == rank and res["global_rank"] == rank
        assert res["world_size"] == n
        assert res["tag"] == "hello"
        tensors = [res["gathered"], res["nested"][0], res["nested"][1][0]]
        assert all(t.device.type == "cpu" for t in tensors), [t.device for t in tensors]
        torch.testing.assert_close(res["gathered"], expected, rtol=0, atol=0)
        torch.testing.assert_close(res["nested"][0], torch.full((3,), 2.0 * rank))
        torch.testing.assert_close(res["nested"][1][0], torch.full((3,), rank + 1.0))
    assert len({res["device"] for res in results}) == n  # one device per replica


def test_seeded_builds_identical_models_on_every_replica(pools) -> None:
    results, error, _ = _run_guarded(pools[4], build_seeded_linear)
    assert error is None, error
    with seeded(0):
        reference = nn.Linear(64, 64)
    assert len(results) == 4
    for weight, bias in results:
        torch.testing.assert_close(weight, reference.weight.detach(), rtol=0, atol=0)
        torch.testing.assert_close(bias, reference.bias.detach(), rtol=0, atol=0)


def test_seeded_restores_the_outer_random_state() -> None:
    torch.manual_seed(1234)
    expected = torch.rand(5)
    torch.manual_seed(1234)
    with seeded(0):
        a = torch.rand(5)
    after = torch.rand(5)
    torch.testing.assert_close(after, expected, rtol=0, atol=0)
    with seeded(0):
        b = torch.rand(5)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.manual_seed(1234)
    with pytest.raises(KeyError):
        with seeded(7):
            raise KeyError("boom")
    torch.testing.assert_close(torch.rand(5), expected, rtol=0, atol=0)  # restored on error too


def test_replica_exception_ends_the_run_promptly_and_pool_recovers(pools) -> None:
    pool = pools[2]
    _warm(pool)
    results, error, elapsed = _run_guarded(pool, raise_in_replica_1)
    assert results is None
    assert type(error) is ValueError, f"{type(error).__name__}: {error}"
    assert str(error) == "replica one refuses"
    assert elapsed < PROMPT_S, f"the failure took {elapsed:.1f} s to surface"
    assert any("replica 1 of 2" in note for note in getattr(error, "__notes__", []))
    remote = "".join(traceback.format_exception(error))
    assert "replica 1 of 2" in remote
    assert "raise_in_replica_1" in remote  # the failing function's frame, from the device process
    assert 'raise ValueError("replica one refuses")' in remote

    # The same pool object runs again (in a fresh process).
    results, error, _ = _run_guarded(pool, gather_ranks, 2, "again")
    assert error is None, error
    torch.testing.assert_close(results[1]["gathered"], torch.tensor([0.0, 0.0, 1.0, 1.0]))


def return_without_syncing_in_replica_1(rank: int) -> None:
    if rank == 1:
        return
    torch.zeros(2).to(_xla.device()).add_(1)
    _xla.sync()  # replica 0 meets the others here, and replica 1 has returned


def test_replica_that_returned_ends_a_meeting_at_once(pools) -> None:
    """Not the 600 s sync timeout: replica 0 learns at once that replica 1 will never come."""
    pool = pools[2]
    _warm(pool)
    results, error, elapsed = _run_guarded(pool, return_without_syncing_in_replica_1)
    assert isinstance(error, ReplicaGone), f"{type(error).__name__}: {error}"
    assert "replica 0 waits at graph boundary 1 (xm.mark_step / torch_xla.sync) for replica(s) [1]" in str(error)
    assert "which have returned" in str(error)
    assert elapsed < PROMPT_S, f"the failure took {elapsed:.1f} s to surface"


def still_building_its_model(seconds: float) -> None:
    time.sleep(seconds)


def wrap_with_replica_1_late(rank: int) -> None:
    if rank == 1:
        still_building_its_model(30.0)
    XlaFullyShardedDataParallel(nn.Linear(4, 4))  # its init ends in a sync, where replica 0 waits


def test_sync_that_times_out_names_the_missing_replica_and_where_it_is() -> None:
    """The wait seen once at the sync that ends FSDP wrapping: should it happen again, the
    replica that waited says which one did not come and that one's Python stack."""
    pool = DevicePool(2, sync_timeout_s=2.0)
    try:
        _warm(pool)
        results, error, elapsed = _run_guarded(pool, wrap_with_replica_1_late)
    finally:
        pool.close()
    assert isinstance(error, ReplicaGone), f"{type(error).__name__}: {error}"
    assert str(error).startswith(
        "replica 0 waited 2 s at graph boundary 1 (xm.mark_step / torch_xla.sync) for replica(s) [1]."
    )
    assert "replica 1 is at:" in str(error) and "in still_building_its_model" in str(error)
    assert elapsed < PROMPT_S


def test_run_on_devices_one_shot() -> None:
    marker = "ACCEL_XLA_FSDP_TEST_MARKER"
    assert marker not in os.environ
    results = run_on_devices(report_env, 2, args=(2,), env={marker: "from-the-test"})
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        torch.testing.assert_close(r["gathered"], torch.tensor([1.0, 1.0, 2.0, 2.0]), rtol=0, atol=0)
        assert r["marker"] == "from-the-test"
        assert r["cpu_num_devices"] == "2"
    assert results[0]["pid"] != os.getpid()  # it ran in a child process
    assert marker not in os.environ  # the parent's environment is restored


@pytest.mark.parametrize(
    "slow_rank",
    [0, 1],
    ids=["rank0-slow", "rank1-slow"],
)
def test_replica_slow_to_reach_first_collective_does_not_abort(pools, slow_rank: int) -> None:
    """XLA:CPU aborts when a replica waits too long at a collective; the runner must prevent it.

    Measured: XLA:CPU warns after 5 s at a rendezvous and aborts 10 s later ("Termination timeout
    ... of 10 seconds exceeded"), i.e. 15 s after arriving. A 12-s lag therefore passes even with no
    line-up at all (checked), so the lag here is 18 s, with the program compiled beforehand so that
    the prompt replica reaches the collective at once: with nothing holding it back, this aborts.
    """
    pool = pools[2]
    results, error, _ = _run_guarded(pool, slow_first_collective, -1, 0.0)  # start and compile
    assert error is None, error
    sleep_s = 18.0
    results, error, elapsed = _run_guarded(pool, slow_first_collective, slow_rank, sleep_s)
    assert error is None, f"{type(error).__name__}: {error}"
    assert elapsed >= sleep_s
    expected = torch.tensor([0.0, 1.0, 2.0, 10.0, 11.0, 12.0])
    assert [r for r, _ in results] == [0, 1]
    for _, gathered in results:
        torch.testing.assert_close(gathered, expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    "devices, die, named",
    [(1, exit_with_code_3, "exit code 3"), (4, sigkill_self, "SIGKILL")],
    ids=["exit-code", "signal"],
)
def test_dead_pool_process_raises_replica_error_naming_the_cause(pools, devices: int, die, named: str) -> None:
    pool = pools[devices]
    _warm(pool)
    try:
        results, error, elapsed = _run_guarded(pool, die)
    finally:
        pool.close()  # reset the session pool even if the runner left it half-open
    assert isinstance(error, ReplicaError), f"{type(error).__name__}: {error}"
    assert named in str(error)
    assert elapsed < PROMPT_S, f"the death took {elapsed:.1f} s to surface"


def test_replica_dying_of_sigsegv_prints_native_then_python_stacks(capfd) -> None:
    """The SIGSEGV seen inside torch_xla in replica threads is not understood (docs/xla-cpu.md):
    the device process prints every thread's native stack, then faulthandler's Python stacks."""
    with DevicePool(2) as pool:
        with pytest.raises(ReplicaError, match="signal SIGSEGV"):
            pool.run(segfault_in_replica_1)
    err = capfd.readouterr().err
    native = err.find("SIGSEGV(11), PID:")
    assert native >= 0, err[-4000:]
    assert "c10::FatalSignalHandler::fatalSignalHandler" in err[native:], err[native:][:4000]
    python = err.find("Fatal Python error: Segmentation fault", native)
    assert python > native, err[-4000:]
    assert "in segfault_in_replica_1" in err[python:], err[python:][:4000]


def test_replica_exception_that_does_not_unpickle(pools) -> None:
    pool = pools[2]  # alive after the recovery above; the next user restarts it
    _warm(pool)
    try:
        results, error, elapsed = _run_guarded(pool, raise_two_arg_error)
        assert isinstance(error, (TwoArgError, ReplicaError)), f"{type(error).__name__}: {error}"
        text = "".join(traceback.format_exception(error))
        assert "loading failed: no such shard" in text and "raise_two_arg_error" in text
        assert elapsed < PROMPT_S
        results, error, _ = _run_guarded(pool, return_rank)
        assert error is None, f"pool unusable after the failure: {type(error).__name__}: {error}"
        assert results == [0, 1]
    finally:
        pool.close()  # whatever happened, leave the session pool in a state that restarts


def sync_inside_seeded(rank: int) -> None:
    with seeded(0):
        nn.Linear(4, 4)
        _xla.sync()


def test_sync_inside_seeded_is_refused_with_advice(pools) -> None:
    """Inside ``seeded`` the other replicas wait for the block to end, so a sync there could
    never complete: it is refused at once, saying what to do instead."""
    pool = pools[2]
    _warm(pool)
    results, error, elapsed = _run_guarded(pool, sync_inside_seeded)
    assert isinstance(error, RuntimeError), f"{type(error).__name__}: {error}"
    assert "inside `with seeded(...)`" in str(error) and "wrap or sync after it" in str(error)
    assert elapsed < PROMPT_S
