"""Accelerate integration, driven through the real ``accelerate launch`` and the real ``Accelerator``.

``accelerate_train.py`` (a stock Accelerate script but for its ``Accelerator`` import) runs in a
subprocess under ``accelerate launch --config_file plugins/xla_fsdp_cpu.yaml``: gradient
accumulation, clipping, a scheduler, a shuffled dataloader, ``save_state`` and ``load_state``.
Its losses, gradient norms and final parameters are checked against the same training of one
plain model on the CPU, fed the sample ids the run recorded; a resumed run against the unbroken
one, on the same number of replicas (bit for bit) and on another (resharded).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import accelerate_train as script
import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
CPU_CONFIG = ROOT / "plugins" / "xla_fsdp_cpu.yaml"
ACCELERATE = Path(sys.executable).parent / "accelerate"
STEPS, ACCUM, SAVE_AT = 6, 2, 3


def launch(out: Path, project: Path, *script_args: str, launch_args: tuple = (), config: Path = CPU_CONFIG) -> Dict:
    """Run the script under ``accelerate launch``; its record, with the final parameters."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PJRT_", "CPU_NUM_DEVICES", "XLA_"))}
    env.update(HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    command = [
        str(ACCELERATE),
        "launch",
        "--config_file",
        str(config),
        *launch_args,
        str(ROOT / "tests" / "accelerate_train.py"),
        "--out",
        str(out),
        "--project",
        str(project),
        "--steps",
        str(STEPS),
        "--accum",
        str(ACCUM),
        *script_args,
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    out.with_suffix(".stderr").write_text(done.stderr)
    assert done.returncode == 0, (
        f"accelerate launch failed (whole stderr: {out.with_suffix('.stderr')}):\n{done.stderr[-6000:]}"
    )
    # The replicas met at every boundary from the same place with the same program: what, when
    # not, XLA:CPU's 10-s abort under load comes from.
    for divergence in ("from different places", "compiled its own program"):
        assert divergence not in done.stderr, done.stderr[done.stderr.index(divergence) - 200 :][:3000]
    record = json.loads(out.read_text())
    record["params"] = load_file(str(out.with_suffix(".safetensors")))
    return record


def train_plain(steps: List[Dict], world: int) -> Dict:
    """The recorded steps on one plain model: per-replica losses, gradient norms, parameters."""
    model = script.build_model()
    optimizer = script.optimizer_for(model)
    scheduler = script.get_linear_schedule_with_warmup(optimizer, 2, 2 * STEPS)
    rows = script.dataset(script.ROWS)["input_ids"]
    losses, norms = [], []
    for step in steps:
        step_losses = []
        for ids in step["ids"]:
            per_replica = [
                model(input_ids=rows[part], labels=rows[part]).loss for part in torch.tensor(ids).chunk(world)
            ]
            (torch.stack(per_replica).mean() / ACCUM).backward()
            step_losses.append([loss.item() for loss in per_replica])
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), script.MAX_NORM).item())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(step_losses)
    return {"losses": losses, "norms": norms, "params": {k: v.detach() for k, v in model.state_dict().items()}}


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory) -> Dict:
    """4 replicas, fp32, saving its state after step SAVE_AT."""
    tmp = tmp_path_factory.mktemp("unbroken")
    record = launch(tmp / "run.json", tmp / "project", "--save-at", str(SAVE_AT))
    record["project"] = tmp / "project"
    return record


def check_params(
    params: Dict[str, torch.Tensor], reference: Dict[str, torch.Tensor], rtol: float, atol: float
) -> None:
    assert set(reference) <= set(params), sorted(set(reference) - set(params))
    for name, value in reference.items():
        torch.testing.assert_close(params[name], value, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def test_training_matches_one_plain_model(unbroken) -> None:
    assert unbroken["world"] == 4 and len(unbroken["steps"]) == STEPS and not unbroken["flatten_parameters"]
    ids = [sorted(i for micro in s["ids"] for i in micro) for s in unbroken["steps"]]
    assert all(len(set(i)) == 8 * ACCUM for i in ids), "each step takes distinct rows"
    reference = train_plain(unbroken["steps"], world=4)
    torch.testing.assert_close(
        torch.tensor([s["losses"] for s in unbroken["steps"]]), torch.tensor(reference["losses"]), rtol=1e-5, atol=1e-6
    )
    torch.testing.assert_close(
        torch.tensor([s["norm"] for s in unbroken["steps"]]), torch.tensor(reference["norms"]), rtol=1e-5, atol=1e-6
    )
    assert min(reference["norms"]) > script.MAX_NORM, "clipping must act in every step"
    check_params(unbroken["params"], reference["params"], rtol=1e-4, atol=1e-5)


def test_resume_on_the_same_replicas_is_bit_exact(unbroken, tmp_path) -> None:
    project = tmp_path / "project"
    shutil.copytree(unbroken["project"] / "checkpoints", project / "checkpoints")
    assert sorted(p.name for p in (project / "checkpoints").iterdir()) == ["checkpoint_0"]
    resumed = launch(tmp_path / "run.json", project, "--resume")
    assert resumed["steps"] == unbroken["steps"][SAVE_AT:]
    for name, value in resumed["params"].items():
        assert torch.equal(value, unbroken["params"][name]), name


def test_resume_on_two_replicas_reshards(unbroken, tmp_path) -> None:
    project = tmp_path / "project"
    shutil.copytree(unbroken["project"] / "checkpoints", project / "checkpoints")
    resumed = launch(tmp_path / "run.json", project, "--resume", launch_args=("--num_processes", "2"))
    assert resumed["world"] == 2
    assert [s["ids"] for s in resumed["steps"]] == [s["ids"] for s in unbroken["steps"][SAVE_AT:]]
    reference = train_plain(unbroken["steps"], world=4)
    check_params(resumed["params"], reference["params"], rtol=1e-4, atol=1e-5)


def test_resume_on_more_replicas_than_saved_reshards(tmp_path) -> None:
    # Replicas 2 and 3 find no random states of their own in a 2-replica checkpoint: they must
    # still resume at the saved step, or they run steps the others do not.
    saved = launch(
        tmp_path / "saved.json", tmp_path / "project", "--save-at", str(SAVE_AT), launch_args=("--num_processes", "2")
    )
    resumed = launch(tmp_path / "run.json", tmp_path / "project", "--resume")
    assert (saved["world"], resumed["world"]) == (2, 4)
    assert [s["ids"] for s in resumed["steps"]] == [s["ids"] for s in saved["steps"][SAVE_AT:]]
    reference = train_plain(saved["steps"], world=2)
    check_params(resumed["params"], reference["params"], rtol=1e-4, atol=1e-5)


def test_bf16_computes_in_bf16_and_tracks_fp32(tmp_path) -> None:
    # The config file alone says bf16, 2 devices, no resharding after forward and flat shards:
    # what reaches the replicas is what accelerate launch was given.
    text = CPU_CONFIG.read_text().replace("mixed_precision: 'no'", "mixed_precision: bf16")
    text = text.replace("num_processes: 4", "num_processes: 2").replace(
        "fsdp_reshard_after_forward: true", "fsdp_reshard_after_forward: false"
    )
    text = text.replace("xla_fsdp_flatten_parameters: false", "xla_fsdp_flatten_parameters: true")
    config = tmp_path / "bf16.yaml"
    config.write_text(text)
    run = launch(tmp_path / "run.json", tmp_path / "project", config=config)
    assert (run["mixed_precision"], run["world"], run["reshard_after_forward"], run["flatten_parameters"]) == (
        "bf16",
        2,
        False,
        True,
    )
    reference = train_plain(run["steps"], world=2)
    losses = torch.tensor([s["losses"] for s in run["steps"]])
    torch.testing.assert_close(losses, torch.tensor(reference["losses"]), rtol=1e-2, atol=0)
    assert not torch.allclose(losses, torch.tensor(reference["losses"]), rtol=1e-6, atol=0), "bf16 must differ"
    assert {v.dtype for v in run["params"].values()} == {torch.float32}, "master weights stay fp32"


def test_the_stock_script_under_accel_xla_fsdp_launch_is_the_same_run(unbroken, tmp_path) -> None:
    """accelerate_train.py with ``from accelerate import Accelerator`` (its import reverted), through
    ``accel-xla-fsdp launch`` with the same arguments: the run of the one-line import, bit for bit."""
    text = (ROOT / "tests" / "accelerate_train.py").read_text()
    ours = "from accel_xla_fsdp import Accelerator, seeded\n"
    assert text.count(ours) == 1
    stock = tmp_path / "accelerate_train.py"
    stock.write_text(text.replace(ours, "from accelerate import Accelerator\n\nfrom accel_xla_fsdp import seeded\n"))
    out = tmp_path / "run.json"
    command = [str(ACCELERATE.parent / "accel-xla-fsdp"), "launch", "--config_file", str(CPU_CONFIG), str(stock)]
    command += ["--out", str(out), "--project", str(tmp_path / "project"), "--steps", str(STEPS)]
    command += ["--accum", str(ACCUM), "--save-at", str(SAVE_AT)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PJRT_", "CPU_NUM_DEVICES", "XLA_"))}
    env.update(HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-6000:]
    launched = json.loads(out.read_text())
    assert not launched["flatten_parameters"] and launched["steps"] == unbroken["steps"]
    params = load_file(str(out.with_suffix(".safetensors")))
    assert set(params) == set(unbroken["params"])
    for name, value in params.items():
        assert torch.equal(value, unbroken["params"][name]), name
