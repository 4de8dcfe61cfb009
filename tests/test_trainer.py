"""``accel_xla_fsdp.Trainer``, driven through the real ``accelerate launch``, against the stock Trainer.

``trainer_train.py`` (a stock Trainer script but for its ``Trainer`` import) runs under ``accelerate
launch --config_file plugins/xla_fsdp_cpu.yaml`` (4 XLA:CPU replicas) and, as the reference, with
``transformers.Trainer`` under ``torchrun --nproc_per_node 4`` with gloo on the CPU: the same global
batch, evaluation every 3 steps, gradient accumulation, clipping, a warmup schedule, checkpoints
every 3 steps with ``save_total_limit=2``. The logged losses, gradient norms, learning rates and
evaluation losses must agree to round-off; the saved model must load with ``from_pretrained``; a
run resumed from ``checkpoint-6`` (by ``resume_from_checkpoint=True``, past a ``checkpoint-8`` left
incomplete) must repeat the unbroken run bit for bit on 4 replicas and to
round-off on 2 (with its settings from ``TrainingArguments(fsdp_config=...)``, flat shards,
resharding the per-parameter checkpoint, and ``activation_checkpointing``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest
import torch
import trainer_train as script
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, TrainingArguments

from accel_xla_fsdp._xla import cpu_device_env
from accel_xla_fsdp.hf_trainer.arguments import check_precision, plugin_from_training_args

ROOT = Path(__file__).resolve().parent.parent
CPU_CONFIG = ROOT / "plugins" / "xla_fsdp_cpu.yaml"
BIN = Path(sys.executable).parent
SCRIPT = ROOT / "tests" / "trainer_train.py"


def _env(**extra: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PJRT_", "CPU_NUM_DEVICES", "XLA_", "ACCEL"))}
    env.update(HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **extra)
    return env


# The CPU reference (torchrun, gloo, stock script) aborted once as its process exited, its results
# written: gloo's threads torn down at interpreter exit (destroy_process_group at the end hung
# instead). That abort alone, after a complete result file, is not a failed reference run.
_EXIT_TEARDOWN = "terminate called without an active exception"


def _run(command: List[str], env: Dict[str, str], out: Path, reference: bool = False) -> Dict:
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, cwd=out.parent)
    out.with_suffix(".stderr").write_text(done.stderr)
    stderr = out.with_suffix(".stderr")
    torn_down = reference and _EXIT_TEARDOWN in done.stderr and out.is_file()
    # A device process that dies of a segmentation fault inside torch_xla is rerun once, as the
    # suite reruns its own device processes' (pyproject.toml, docs/xla-cpu.md).
    assert "Fatal Python error: Segmentation fault" not in done.stderr, f"the run died of signal SIGSEGV: {stderr}"
    assert done.returncode == 0 or torn_down, f"{command[0]} failed (whole stderr: {stderr}):\n{done.stderr[-6000:]}"
    for divergence in ("from different places", "compiled its own program"):
        assert divergence not in done.stderr, done.stderr[done.stderr.index(divergence) - 200 :][:3000]
    return json.loads(out.read_text())


def free_port() -> int:
    """A port for torchrun's rendezvous (other runs on the machine may hold its default)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    out: Path, model: Path, output_dir: Path, *script_args: str, launch_args: tuple = (), script: Path = SCRIPT
) -> Dict:
    command = [
        str(BIN / "accelerate"),
        "launch",
        "--config_file",
        str(CPU_CONFIG),
        *launch_args,
        str(script),
        "--model",
        str(model),
        "--output-dir",
        str(output_dir),
        "--out",
        str(out),
        *script_args,
    ]
    return _run(command, _env(), out)


def on_cpu(out: Path, model: Path, output_dir: Path, *script_args: str, script: Path = SCRIPT) -> Dict:
    command = [
        str(BIN / "torchrun"),
        "--master_port",
        str(free_port()),
        "--nproc_per_node",
        "4",
        str(script),
        "--model",
        str(model),
        "--output-dir",
        str(output_dir),
        "--out",
        str(out),
        *script_args,
    ]
    return _run(command, _env(USE_TORCH_XLA="0", ACCELERATE_USE_CPU="1"), out, reference=True)


def by_step(record: Dict, key: str) -> Dict[int, float]:
    """``key`` logged at each step: the first time (a final ``evaluate()`` logs at the last step again)."""
    logged: Dict[int, float] = {}
    for entry in record["log_history"]:
        if key in entry:
            logged.setdefault(entry["step"], entry[key])
    return logged


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Dict:
    tmp = tmp_path_factory.mktemp("trainer")
    script.save_model(tmp / "model")
    common = ("--save-total-limit", "2")
    cpu = on_cpu(tmp / "cpu.json", tmp / "model", tmp / "cpu_out", *common)
    xla = launch(tmp / "xla.json", tmp / "model", tmp / "xla_out", *common, "--save-model", str(tmp / "final"))
    return {"tmp": tmp, "cpu": cpu, "xla": xla}


def test_losses_match_the_cpu_trainer(runs) -> None:
    cpu, xla = runs["cpu"], runs["xla"]
    assert xla["world"] == cpu["world"] == 4 and xla["flatten_parameters"] is False and xla["checkpointed"] == 0
    for key in ("loss", "grad_norm", "learning_rate", "eval_loss"):
        theirs, ours = by_step(cpu, key), by_step(xla, key)
        assert sorted(ours) == sorted(theirs) and len(ours) >= 3, (key, sorted(ours))
        torch.testing.assert_close(
            torch.tensor([ours[s] for s in sorted(ours)], dtype=torch.float64),
            torch.tensor([theirs[s] for s in sorted(theirs)], dtype=torch.float64),
            rtol=1e-5,
            atol=1e-7,
            msg=lambda m: f"{key}: {m}",
        )
    assert sorted(by_step(xla, "loss")) == list(range(1, 9)) and sorted(by_step(xla, "eval_loss")) == [3, 6, 8]
    assert min(by_step(xla, "grad_norm").values()) > 0.5, "max_grad_norm=0.5 must clip every step"
    losses = by_step(xla, "loss")
    assert losses[8] < losses[1] - 0.05, "the model must train"
    assert xla["final"]["eval_loss"] == pytest.approx(cpu["final"]["eval_loss"], rel=1e-6)
    assert by_step(xla, "total_flos") == by_step(cpu, "total_flos")


def test_checkpoints_rotate_and_hold_the_sharded_state(runs) -> None:
    xla_out, cpu_out = runs["tmp"] / "xla_out", runs["tmp"] / "cpu_out"
    kept = ["checkpoint-6", "checkpoint-8"]
    assert sorted(p.name for p in xla_out.iterdir()) == sorted(p.name for p in cpu_out.iterdir()) == kept
    files = {p.name for p in (xla_out / "checkpoint-6").iterdir()}
    expected = {"xla_fsdp_0", "trainer_state.json", "scheduler.pt", "training_args.bin", "config.json"}
    assert expected | {f"rng_state_{r}.pth" for r in range(4)} <= files, sorted(files)
    assert not files & {"optimizer.pt", "model.safetensors"}, "no rank-0-only optimizer, no whole model per checkpoint"
    assert (xla_out / "checkpoint-6" / "xla_fsdp_0" / "save-000000" / "checkpoint.json").is_file()


def test_save_model_writes_what_from_pretrained_loads(runs) -> None:
    # written as it was gathered (the stock save's path), not from a whole state dict
    # (every replica thread wraps the function once, so rank 0's record may hold several answers)
    assert runs["xla"]["save_model_streamed"] and all(runs["xla"]["save_model_streamed"])
    model = AutoModelForCausalLM.from_pretrained(runs["tmp"] / "final")
    reference = load_file(str(runs["tmp"] / "cpu_out" / "checkpoint-8" / "model.safetensors"))
    state = model.state_dict()
    for name, value in reference.items():
        torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert eval_loss(model) == pytest.approx(runs["cpu"]["final"]["eval_loss"], rel=1e-5)


def test_resume_on_the_same_replicas_is_bit_exact(runs, tmp_path) -> None:
    # checkpoint-8 as a save killed midway leaves it (no trainer_state.json, no committed sharded
    # model): resume_from_checkpoint=True skips it, names it, and resumes from checkpoint-6.
    out = tmp_path / "out"
    shutil.copytree(runs["tmp"] / "xla_out", out)
    shutil.rmtree(out / "checkpoint-8")
    shutil.copytree(out / "checkpoint-6", out / "checkpoint-8")
    (out / "checkpoint-8" / "trainer_state.json").unlink()
    next((out / "checkpoint-8" / "xla_fsdp_0").glob("save-*/checkpoint.json")).unlink()
    resumed = launch(tmp_path / "run.json", runs["tmp"] / "model", out, "--resume", "last")
    for key in ("loss", "grad_norm", "eval_loss"):
        assert by_step(resumed, key) == by_step(runs["xla"], key), key
    assert resumed["final"] == {**resumed["final"], "eval_loss": runs["xla"]["final"]["eval_loss"]}
    stderr = (tmp_path / "run.stderr").read_text()
    assert stderr.count(f"Not resuming from {out / 'checkpoint-8'}: ") == 1, "one warning, by the main process"
    assert "Resuming from checkpoint-6 instead" in stderr


def test_resume_on_two_replicas_with_settings_from_training_args(runs, tmp_path) -> None:
    # Also activation_checkpointing=True: the Trainer's checkpointing of the Llama blocks becomes
    # the engine's (the same gradients).
    shutil.copytree(runs["tmp"] / "xla_out", tmp_path / "out")
    settings = {
        "xla": True,
        "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
        "xla_fsdp_settings": {"flatten_parameters": True},
    }
    resumed = launch(
        tmp_path / "run.json",
        runs["tmp"] / "model",
        tmp_path / "out",
        "--per-device-batch",
        "4",
        "--resume",
        str(tmp_path / "out" / "checkpoint-6"),
        "--fsdp-config",
        json.dumps(settings),
        "--activation-checkpointing",
        launch_args=("--num_processes", "2"),
    )
    assert resumed["world"] == 2 and resumed["flatten_parameters"] is True and resumed["checkpointed"] == 2
    for key in ("loss", "grad_norm", "eval_loss"):
        ours, unbroken = by_step(resumed, key), by_step(runs["xla"], key)
        assert sorted(ours) == sorted(unbroken)
        for step in ours:
            assert ours[step] == pytest.approx(unbroken[step], rel=1e-5), (key, step)


def test_the_trainers_own_xla_fsdp_files_convert(runs, tmp_path) -> None:
    # rank0-of-2-pytorch_model.bin, rank1-of-2-...: written by transformers' own XLA FSDP save.
    env = {**_env(), **cpu_device_env(2)}
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tests" / "trainer_xla_save.py"),
            str(runs["tmp"] / "model"),
            str(tmp_path / "ckpt"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    rank_files = sorted(p.name for p in (tmp_path / "ckpt").glob("rank*"))
    assert rank_files == [f"rank{r}-of-2-pytorch_model.bin" for r in (0, 1)]
    converted = tmp_path / "converted"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "accel_xla_fsdp",
            "convert-torch-xla",
            str(tmp_path / "ckpt"),
            str(converted),
            "--config",
            str(runs["tmp"] / "model" / "config.json"),
        ],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    original = AutoModelForCausalLM.from_pretrained(runs["tmp"] / "model").state_dict()
    loaded = AutoModelForCausalLM.from_pretrained(converted).state_dict()
    assert sorted(loaded) == sorted(original)
    for name, value in original.items():
        assert torch.equal(loaded[name], value), name


def eval_loss(model: torch.nn.Module) -> float:
    """The Trainer's evaluation loss of ``model`` on the script's evaluation rows, on the CPU."""
    rows = script.dataset(16, 2).with_format("torch")
    with torch.no_grad():
        batches = [{k: rows[i : i + 2][k] for k in ("input_ids", "attention_mask", "labels")} for i in range(0, 16, 2)]
        return torch.stack([model(**batch).loss for batch in batches]).mean().item()


def test_peft_adapter_saves_what_it_trained(runs, tmp_path) -> None:
    from peft import PeftModel

    run = launch(
        tmp_path / "run.json",
        runs["tmp"] / "model",
        tmp_path / "out",
        "--lora",
        "--steps",
        "4",
        "--learning-rate",
        "5e-2",
        "--save-model",
        str(tmp_path / "adapter"),
    )
    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert saved and all("lora_" in name for name in saved), sorted(saved)
    assert any(v.abs().max() > 0 for n, v in saved.items() if "lora_B" in n), "the adapter must have trained"
    base = AutoModelForCausalLM.from_pretrained(runs["tmp"] / "model")
    ids = script.dataset(2, 2).with_format("torch")[0:2]["input_ids"]
    with torch.no_grad():
        untrained = base(input_ids=ids).logits
    tuned = PeftModel.from_pretrained(base, tmp_path / "adapter")
    assert eval_loss(tuned) == pytest.approx(run["final"]["eval_loss"], rel=1e-6)
    with torch.no_grad():
        assert (tuned(input_ids=ids).logits - untrained).abs().max() > 1e-3, "the adapter must change the model"


def _args(**kwargs) -> TrainingArguments:
    return TrainingArguments(output_dir="unused", report_to="none", **kwargs)


def test_fsdp_config_keys_mean_what_the_trainer_documents(monkeypatch) -> None:
    monkeypatch.delenv("ACCEL_XLA_FSDP_CONFIG_FILE", raising=False)
    plugin = plugin_from_training_args(
        _args(
            fsdp=True,
            fsdp_config={
                "xla": True,
                "transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
                "xla_fsdp_grad_ckpt": True,
                "xla_fsdp_settings": {"flatten_parameters": False, "reshard_after_forward": False},
            },
        )
    )
    assert plugin.transformer_cls_names_to_wrap == ("LlamaDecoderLayer",) and plugin.activation_checkpointing
    assert (plugin.flatten_parameters, plugin.reshard_after_forward) == (False, False)
    plugin = plugin_from_training_args(_args(fsdp="shard_grad_op", fsdp_config={"min_num_params": 1000}))
    wrapping = (plugin.auto_wrap_policy, plugin.min_num_params, plugin.reshard_after_forward)
    assert wrapping == ("size_based_wrap", 1000, False)
    assert plugin_from_training_args(_args()) is None


@pytest.mark.parametrize(
    "args, message",
    [
        (dict(fsdp=True, fsdp_config={"xla": True, "xla_fsdp_v2": True}), "xla_fsdp_v2"),
        (dict(fsdp=True, fsdp_config={"xla": True, "xla_fsdp_settings": {"compute_dtype": "bfloat16"}}), "bf16=True"),
        (dict(fsdp=True, fsdp_config={"xla_fsdp_settings": {"flatten_params": 1}}), "'flatten_params'.*valid"),
        (dict(fsdp="full_shard offload"), "fsdp_offload_params"),
        (dict(fsdp=True, fsdp_config={"limit_all_gatherz": True}), "unknown fsdp_config key.*limit_all_gatherz"),
    ],
)
def test_what_xla_fsdp_does_not_take_is_refused_by_name(monkeypatch, args, message) -> None:
    monkeypatch.delenv("ACCEL_XLA_FSDP_CONFIG_FILE", raising=False)
    with pytest.raises(ValueError, match=message):
        plugin_from_training_args(_args(**args))


def test_fp16_is_refused() -> None:
    args = _args()
    args.fp16 = True  # TrainingArguments itself refuses fp16 without a GPU
    with pytest.raises(ValueError, match="fp16=True.*use bf16=True"):
        check_precision(args)


def test_the_stock_script_under_accel_xla_fsdp_launch_is_the_same_run(runs, tmp_path) -> None:
    """trainer_train.py with its import reverted to ``from transformers import Trainer``, through
    ``accel-xla-fsdp launch`` (the same arguments): the run of the one-line import, bit for bit."""
    stock = tmp_path / "trainer_train.py"
    text = SCRIPT.read_text()
    assert text.count("    from accel_xla_fsdp import Trainer\n") == 1
    stock.write_text(
        text.replace("    from accel_xla_fsdp import Trainer\n", "    from transformers import Trainer\n")
    )
    command = [str(BIN / "accel-xla-fsdp"), "launch", "--config_file", str(CPU_CONFIG), str(stock)]
    command += ["--model", str(runs["tmp"] / "model"), "--output-dir", str(tmp_path / "out")]
    command += ["--out", str(tmp_path / "run.json"), "--save-total-limit", "2"]
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), env["PYTHONPATH"]])  # tiny_llama
    launched = _run(command, env, tmp_path / "run.json")
    assert launched["flatten_parameters"] is False  # our Accelerator's plugin, from the config file
    for key in ("loss", "grad_norm", "learning_rate", "eval_loss"):
        assert by_step(launched, key) == by_step(runs["xla"], key), key
    assert launched["final"]["eval_loss"] == runs["xla"]["final"]["eval_loss"]
