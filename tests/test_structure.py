"""The package's shape: its import graph flows one way, the plugin's engine fields are
``FsdpOptions``' fields, the launch config reaches the replicas as environment variables, and
auto-wrapped units share their parent's options object."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
import typing
from dataclasses import fields
from pathlib import Path
from types import ModuleType
from typing import Any, Dict, Optional

import pytest
import torch.nn as nn

from accel_xla_fsdp import FsdpOptions, XlaFullyShardedDataParallel, transformer_block_policy
from accel_xla_fsdp.hf_accelerate import launch
from accel_xla_fsdp.hf_accelerate.plugin import CONFIG_EXPORTED_ENV, CONFIG_FILE_ENV, NOT_CONFIGURABLE, XlaFsdpPlugin

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "import_graph.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("import_graph", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_import_graph_has_no_circle_and_no_upward_edge() -> None:
    run = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "fsdp " in run.stdout and "OK, no circle, no upward import" in run.stdout


def test_import_graph_check_finds_circles_and_upward_edges() -> None:
    graph = _script()
    problems = graph.check({"fsdp": {"state_dict"}, "state_dict": {"fsdp"}, "options": {"hf_accelerate.plugin"}})
    assert "upward import: state_dict -> fsdp" in problems
    assert "upward import: options -> hf_accelerate.plugin" in problems
    assert "import circle among: fsdp, state_dict" in problems
    assert graph.check({"nowhere": set()}) == ["nowhere is not in LAYERS: place it"]
    assert graph.check({"fsdp": {"state_dict", "unit_state"}, "state_dict": {"unit_state"}, "unit_state": set()}) == []


def test_plugin_engine_fields_are_the_configurable_options() -> None:
    option_types = typing.get_type_hints(FsdpOptions)
    plugin_types = typing.get_type_hints(XlaFsdpPlugin)
    engine = [f for f in fields(XlaFsdpPlugin) if "option" in f.metadata]
    expected = [f.name for f in fields(FsdpOptions) if f.name not in NOT_CONFIGURABLE]
    assert [f.name for f in engine] == expected
    for f in engine:
        assert f.metadata["option"] == f.name
        assert plugin_types[f.name] == Optional[option_types[f.name]], f.name
    wrap = [f.name for f in fields(XlaFsdpPlugin) if "option" not in f.metadata]
    assert [f.name for f in fields(XlaFsdpPlugin)] == wrap + expected  # positional order: wrap settings first


def test_launcher_exports_the_config_as_the_settings_variables(tmp_path: Path, monkeypatch) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(
        "distributed_type: XLA\nnum_processes: 2\nfsdp_config:\n"
        "  fsdp_auto_wrap_policy: SIZE_BASED_WRAP\n  fsdp_min_num_params: 1e3\n"
        "  fsdp_reshard_after_forward: SHARD_GRAD_OP\n  fsdp_backward_prefetch: BACKWARD_PRE\n"
        "  xla_fsdp_buffer_dtype: bfloat16\n  xla_fsdp_reduce_scatter_bucket_size_mb: 0.5\n"
        "  xla_fsdp_flatten_parameters: false\n"
    )
    env = launch.launch_environment(["--config_file", str(config), "train.py"])
    assert env[CONFIG_EXPORTED_ENV] == env[CONFIG_FILE_ENV] == str(config.resolve())
    assert env["FSDP_MIN_NUM_PARAMS"] == "1000" and env["FSDP_RESHARD_AFTER_FORWARD"] == "false"
    for name in list(os.environ):
        if name.startswith(("FSDP_", "XLA_FSDP_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv(CONFIG_FILE_ENV, env[CONFIG_FILE_ENV])
    from_file = dataclasses.asdict(XlaFsdpPlugin())  # no marker: read from the file
    for name, value in env.items():
        if name.startswith(("FSDP_", "XLA_FSDP_", "ACCEL_XLA_FSDP_CONFIG")):
            monkeypatch.setenv(name, value)
    config.write_text("distributed_type: XLA\nfsdp_config:\n  fsdp_min_num_params: [not read]\n")
    assert dataclasses.asdict(XlaFsdpPlugin()) == from_file  # from the variables alone
    assert from_file["min_num_params"] == 1000 and from_file["reshard_after_forward"] is False


def test_launcher_puts_its_xla_flags_before_the_users(tmp_path: Path, monkeypatch) -> None:
    """torch_xla's import sets XLA_FLAGS itself, so ours join it, first ([Note: XNNPACK keeps the
    weights]): a user's flag after ours wins."""
    config = tmp_path / "config.yaml"
    config.write_text("distributed_type: XLA\nnum_processes: 2\n")
    monkeypatch.setattr(os, "environ", dict(os.environ))  # what the launcher exports goes with the test
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_xnnpack=true --xla_dump_to=/somewhere")
    monkeypatch.setattr(sys, "argv", ["accelerate", "launch", "--config_file", str(config), "train.py"])
    launch.export_launch_settings()
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_use_xnnpack=false --xla_cpu_use_xnnpack=true --xla_dump_to=/somewhere"
    monkeypatch.setenv("XLA_FLAGS", "")
    launch.export_launch_settings()
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_use_xnnpack=false"


def test_launcher_passes_the_schedulers_memory_target_to_libtpu(tmp_path: Path, monkeypatch) -> None:
    """xla_fsdp_tpu_scheduler_memory_percent reaches the replicas' libtpu as LIBTPU_INIT_ARGS, which
    it reads as a replica starts ([Note: the scheduler's memory target]): ours first, so a user's
    own value of the flag, after it, wins; the user's variable for the setting wins over the file."""
    config = tmp_path / "config.yaml"
    config.write_text(
        "distributed_type: XLA\nnum_processes: 2\nfsdp_config:\n  xla_fsdp_tpu_scheduler_memory_percent: 90\n"
    )
    monkeypatch.setattr(os, "environ", dict(os.environ))  # what the launcher exports goes with the test
    monkeypatch.delenv("XLA_FSDP_TPU_SCHEDULER_MEMORY_PERCENT", raising=False)
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_x=1")
    monkeypatch.setattr(sys, "argv", ["accelerate", "launch", "--config_file", str(config), "train.py"])
    launch.export_launch_settings()
    flag = "--xla_tpu_scheduler_percent_shared_memory_limit"
    assert os.environ["LIBTPU_INIT_ARGS"] == f"{flag}=90 --xla_tpu_x=1"
    assert os.environ["XLA_FSDP_TPU_SCHEDULER_MEMORY_PERCENT"] == "90"
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "")
    monkeypatch.setenv("XLA_FSDP_TPU_SCHEDULER_MEMORY_PERCENT", "70")
    launch.export_launch_settings()
    assert os.environ["LIBTPU_INIT_ARGS"] == f"{flag}=70"
    monkeypatch.setenv("XLA_FSDP_TPU_SCHEDULER_MEMORY_PERCENT", "101")
    with pytest.raises(ValueError, match="XLA_FSDP_TPU_SCHEDULER_MEMORY_PERCENT: expected a percentage from 1 to 100"):
        launch.export_launch_settings()
    monkeypatch.delenv("XLA_FSDP_TPU_SCHEDULER_MEMORY_PERCENT")
    config.write_text("distributed_type: XLA\nnum_processes: 2\n")  # unset: libtpu's own
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_x=1")
    launch.export_launch_settings()
    assert os.environ["LIBTPU_INIT_ARGS"] == "--xla_tpu_x=1"


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: Any) -> Any:
        return self.linear(x)


def _unit_options(rank: int) -> Dict[str, Any]:
    def blocks() -> nn.Module:
        return nn.Sequential(_Block(), _Block())

    policy = transformer_block_policy([_Block])
    model = XlaFullyShardedDataParallel(blocks(), auto_wrap_policy=policy, reduce_scatter_bucket_size_mb=0.5)
    units = [m for m in model.modules() if isinstance(m, XlaFullyShardedDataParallel)]

    def changed(module: nn.Module, *args: Any, **kwargs: Any) -> XlaFullyShardedDataParallel:
        return XlaFullyShardedDataParallel(module, *args, **dict(kwargs, fp32_reduce_scatter=True))

    other = XlaFullyShardedDataParallel(blocks(), auto_wrap_policy=policy, auto_wrapper_callable=changed)
    inner = [m for m in other.modules() if isinstance(m, XlaFullyShardedDataParallel) and m is not other]
    return {
        "units": len(units),
        "shared": all(u.options is model.options for u in units),
        "bucket": [u.options.reduce_scatter_bucket_size_mb for u in units],
        "changed_own": all(u.options is not other.options and u.options.fp32_reduce_scatter for u in inner),
        "names": [name for name, _ in model.unit_state.named_units()],
    }


def test_auto_wrapped_units_share_their_parents_options(pools) -> None:
    (result,) = pools[1].run(_unit_options)
    assert result["units"] == 3 and result["shared"], result
    assert result["bucket"] == [0.5] * 3
    assert result["changed_own"], "a unit whose auto_wrapper_callable changes an option gets its own"
    assert result["names"] == ["", "_fsdp_wrapped_module.0", "_fsdp_wrapped_module.1"]
