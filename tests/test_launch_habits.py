"""Stock scripts' habits through the real ``accelerate launch`` on XLA:CPU replica threads.

``stock_script.py`` runs under ``accelerate launch --config_file plugins/xla_fsdp_cpu.yaml``
(``fsdp_cpu_ram_efficient_loading: true``): its own logging, the main process's ``transformers``
logs, ``set_seed`` then ``from_config`` on every replica, a tied-embedding ``from_pretrained``
inside ``main()`` loaded straight into shards, ``accelerator.print`` and a progress bar with one
process; and the launcher's settings that cannot reach the replicas stop the run with what to do.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, Tuple

import pytest
import torch
from accelerate.utils import set_seed
from models import LAUNCH_LLAMA
from safetensors import safe_open
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from accel_xla_fsdp import seeded

ROOT = Path(__file__).resolve().parent.parent
CPU_CONFIG = ROOT / "plugins" / "xla_fsdp_cpu.yaml"
ACCELERATE = Path(sys.executable).parent / "accelerate"
CONFIG = dict(LAUNCH_LLAMA, tie_word_embeddings=True)


def launch(folder: Path, out: Path, *launch_args: str, late_import: bool = False) -> subprocess.CompletedProcess:
    ours = ("PJRT_", "CPU_NUM_DEVICES", "XLA_", "FSDP_", "ACCEL")
    env = {k: v for k, v in os.environ.items() if not k.startswith(ours)}
    env.update(HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    if late_import:
        env["STOCK_SCRIPT_LATE_IMPORT"] = "1"
    command = [
        str(ACCELERATE),
        "launch",
        "--config_file",
        str(CPU_CONFIG),
        *launch_args,
        str(ROOT / "tests" / "stock_script.py"),
        "--pretrained",
        str(folder),
        "--out",
        str(out),
    ]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)


def read(out: Path) -> Tuple[Dict[str, Dict[str, torch.Tensor]], Dict]:
    with safe_open(str(out), framework="pt") as f:
        record = json.loads(f.metadata()["record"])
        tensors: Dict[str, Dict[str, torch.Tensor]] = {"pretrained": {}, "from_config": {}}
        for key in f.keys():
            kind, name = key.split("/", 1)
            tensors[kind][name] = f.get_tensor(key)
    return tensors, record


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("pretrained")
    with seeded(3):
        LlamaForCausalLM(LlamaConfig(**CONFIG)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def four_replicas(pretrained, tmp_path_factory) -> Iterator[Tuple[subprocess.CompletedProcess, Path]]:
    out = tmp_path_factory.mktemp("run") / "out.safetensors"
    done = launch(pretrained, out)
    out.with_suffix(".stderr").write_text(done.stderr)
    assert done.returncode == 0, done.stderr[-6000:]
    yield done, out


def test_logs_print_as_on_the_cpu(four_replicas) -> None:
    done, _ = four_replicas
    # the script's own basicConfig took effect
    assert done.stderr.count("INFO - stock_script - [RANK 0] script log line: 4 processes") == 1
    # transformers' INFO line of the main process's from_pretrained, once: the other replicas set
    # verbosity "error" after it set "info"
    assert done.stderr.count("[transformers] loading weights file") == 1, done.stderr[-3000:]
    assert done.stdout.count("accelerator.print reached the output") == 1


def test_set_seed_then_from_config_builds_the_same_model_everywhere(four_replicas, pretrained) -> None:
    tensors, record = read(four_replicas[1])
    set_seed(42)  # the same calls in a process of its own (this one)
    reference = AutoModelForCausalLM.from_config(LlamaConfig.from_pretrained(pretrained)).state_dict()
    for name, value in reference.items():
        assert torch.equal(tensors["from_config"][name], value), name
    sums = torch.tensor(record["from_config sums by replica"])
    assert torch.equal(sums, sums[:1].expand_as(sums)), "every replica built rank 0's model"


def test_tied_from_pretrained_inside_main_loads_into_shards(four_replicas, pretrained) -> None:
    tensors, _ = read(four_replicas[1])
    plain = LlamaForCausalLM.from_pretrained(pretrained)
    for name, value in plain.state_dict().items():
        if name == "lm_head.weight":  # tied: the embedding
            name = "model.embed_tokens.weight"
        assert torch.equal(tensors["pretrained"][name], value), name


def test_one_process_prints_and_shows_progress(pretrained, tmp_path: Path) -> None:
    done = launch(pretrained, tmp_path / "out.safetensors", "--num_processes", "1")
    assert done.returncode == 0, done.stderr[-6000:]
    assert done.stdout.count("accelerator.print reached the output") == 1
    assert "progress bar: 100%" in done.stderr
    assert "script log line: 1 processes" in done.stderr


def test_import_inside_main_stops_with_what_to_do(pretrained, tmp_path: Path) -> None:
    """The launcher never imported accel_xla_fsdp: XLA:CPU started one device; the replica reads
    the config from the launcher's command line, finds 4 processes asked for, and stops."""
    done = launch(pretrained, tmp_path / "out.safetensors", late_import=True)
    assert done.returncode != 0
    assert "asked for 4 processes" in done.stderr and "1 XLA device(s) run" in done.stderr
    assert "at module level" in done.stderr


def test_device_count_other_than_asked_stops(monkeypatch) -> None:
    from accel_xla_fsdp.hf_accelerate import launch as launch_settings

    monkeypatch.setenv(launch_settings.NUM_PROCESSES_ENV, "4")
    monkeypatch.setenv("CPU_NUM_DEVICES", "2")
    monkeypatch.delenv(launch_settings.READ_LATE_ENV, raising=False)
    launch_settings.check_device_count(4)
    with pytest.raises(RuntimeError, match="asked for 4 processes.*2 XLA device.*unset CPU_NUM_DEVICES"):
        launch_settings.check_device_count(2)
    monkeypatch.setenv(launch_settings.READ_LATE_ENV, "1")
    with pytest.raises(RuntimeError, match="at module level"):
        launch_settings.check_device_count(1)


def test_launcher_command_line_is_recognised_behind_the_interpreter() -> None:
    from accel_xla_fsdp.hf_accelerate.launch import launch_arguments

    argv = ["/venv/bin/python3.11", "/venv/bin/accelerate", "launch", "--config_file", "c.yaml", "s.py"]
    assert launch_arguments(argv) == ["--config_file", "c.yaml", "s.py"]
    assert launch_arguments(["/venv/bin/python", "train.py"]) is None


def test_torch_xla_basic_config_handler_is_dropped(monkeypatch) -> None:
    from accel_xla_fsdp.xla_cpu.script_logging import without_torch_xla_basic_config

    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])
    monkeypatch.setattr(root, "level", logging.WARNING)
    logging.basicConfig()  # what import torch_xla does
    root.handlers = without_torch_xla_basic_config(root.handlers)  # what the patch table installs
    assert root.handlers == []
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the script's own now takes effect
    assert root.level == logging.INFO and len(root.handlers) == 1
    custom = root.handlers[0]
    assert without_torch_xla_basic_config(root.handlers) == [custom]  # a configured root is left alone
