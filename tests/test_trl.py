"""TRL's trainers, unchanged, through ``accel-xla-fsdp launch``, against the same script on the CPU.

``trl_train.py`` imports nothing of ours. It runs under ``accel-xla-fsdp launch --config_file
plugins/xla_fsdp_cpu.yaml`` (4 XLA:CPU replicas) and, as the reference, under ``torchrun
--nproc_per_node 4`` with gloo on the CPU (the same global batch). One launch per side runs the
SFT tasks one after the other (full, LoRA, packing in fixed rows), another the DPO tasks (the
implicit reference model, loaded again by TRL with ``device_map="auto"`` and RAM-efficient loading
on, and PEFT, whose reference is the model with its adapter off): each launch costs a minute or
more. The logged losses and gradient norms agree to round-off, the saved model or adapter loads
and gives the same loss, and the programs compiled stop growing after the first steps (SFT and
DPO, whose masked metrics are summed in programs of one shape: docs/launch.md).

The cheap tests (no launch) check the mixin's argument passing and the settings refused.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Dict, Tuple

import pytest
import torch
import trl_train as script
from test_trainer import BIN, CPU_CONFIG, _env, _run, free_port

SCRIPT = Path(script.__file__)
SFT_TASKS = "sft,sft-lora,sft-packing"
DPO_TASKS = "dpo,dpo-peft"
# TRL's logged DPO metrics compared, "logits/*" summed by hf_trainer/masked_reductions.py on XLA. Not
# "rewards/*": 0.1 x differences of log-probabilities near -20, they agree to 1e-7 absolute (round-off of
# the log-probabilities), up to 6e-5 relative to their small values.
DPO_METRICS = ("logits/chosen", "logits/rejected", "logps/chosen", "logps/rejected", "mean_token_accuracy", "entropy")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("trl_model")
    script.save_model(folder)
    return folder


def _both_sides(root: Path, model: Path, tasks: str) -> Dict[str, Dict]:
    arguments = ["--tasks", tasks, "--model", str(model), "--steps", "6"]
    launched = [str(BIN / "accel-xla-fsdp"), "launch", "--config_file", str(CPU_CONFIG), str(SCRIPT)]
    xla = _run(
        [*launched, *arguments, "--output-dir", str(root / "out_xla"), "--out", str(root / "xla.json")]
        + ["--save", str(root / "saved_xla")],
        _env(),
        root / "xla.json",
    )
    torchrun = [str(BIN / "torchrun"), "--master_port", str(free_port()), "--nproc_per_node", "4", str(SCRIPT)]
    cpu = _run(
        [*torchrun, *arguments, "--output-dir", str(root / "out_cpu"), "--out", str(root / "cpu.json")]
        + ["--save", str(root / "saved_cpu")],
        _env(USE_TORCH_XLA="0", ACCELERATE_USE_CPU="1"),
        root / "cpu.json",
        reference=True,
    )
    return {"xla": xla, "cpu": cpu, "root": root}


@pytest.fixture(scope="module")
def sft_runs(tmp_path_factory, model_dir) -> Dict:
    return _both_sides(tmp_path_factory.mktemp("trl_sft"), model_dir, SFT_TASKS)


@pytest.fixture(scope="module")
def dpo_runs(tmp_path_factory, model_dir) -> Dict:
    return _both_sides(tmp_path_factory.mktemp("trl_dpo"), model_dir, DPO_TASKS)


def _logged(record: Dict, key: str) -> Dict[int, float]:
    return {e["step"]: e[key] for e in record["log_history"] if key in e}


def _same_training(runs: Dict, task: str, metrics: Tuple[str, ...] = ()) -> None:
    xla, cpu = runs["xla"][task], runs["cpu"][task]
    assert xla["world"] == cpu["world"] == 4
    assert xla["trainer_class"][1] == "XlaFsdpTrainerMixin", xla["trainer_class"]  # put in front by the launcher
    for key in ("loss", "grad_norm", "learning_rate", *metrics):
        ours, reference = _logged(xla, key), _logged(cpu, key)
        assert sorted(ours) == sorted(reference) == list(range(1, 7)), (key, ours, reference)
        for step in ours:
            assert math.isclose(ours[step], reference[step], rel_tol=2e-5, abs_tol=1e-7), (task, key, step)


def _evaluation_loss(folder: Path, model_dir: Path) -> float:
    """The loss of the saved model (or the base model with the saved adapter) on fixed rows, on the CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (folder / "adapter_config.json").is_file():
        from peft import PeftModel

        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), folder)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = tokenizer(list(script.sft_rows(8, seed=99)["text"]), padding=True, return_tensors="pt")
    labels = rows["input_ids"].masked_fill(rows["attention_mask"] == 0, -100)
    with torch.no_grad():
        return float(model.eval()(**rows, labels=labels).loss)


def _same_saved(runs: Dict, task: str, model_dir: Path) -> None:
    ours = _evaluation_loss(runs["root"] / "saved_xla" / task, model_dir)
    reference = _evaluation_loss(runs["root"] / "saved_cpu" / task, model_dir)
    assert math.isclose(ours, reference, rel_tol=1e-5), (task, ours, reference)


@pytest.mark.parametrize("task", SFT_TASKS.split(","))
def test_sft_matches_the_cpu(sft_runs, model_dir, task: str) -> None:
    _same_training(sft_runs, task)
    _same_saved(sft_runs, task, model_dir)


@pytest.mark.parametrize("task", DPO_TASKS.split(","))
def test_dpo_matches_the_cpu(dpo_runs, model_dir, task: str) -> None:
    _same_training(dpo_runs, task, DPO_METRICS)
    _same_saved(dpo_runs, task, model_dir)
    # The reference model: loaded again by TRL and sharded as the policy (docs/trl.md); none with PEFT.
    assert dpo_runs["xla"][task]["ref_model"] == ("NoneType" if task == "dpo-peft" else "XlaFullyShardedDataParallel")


def _nothing_new_after_step_3(runs: Dict, tasks: str) -> None:
    """Programs compiled (every replica's, counted in the process) at each optimizer step: none new
    after step 3 in any task, and the executions (graph cuts) the same at every later step."""
    for task in tasks.split(","):
        counts = runs["xla"][task]["counts"]
        assert len(counts) == 6
        compiles = [c["compiles"] for c in counts]
        assert compiles[2:] == [compiles[2]] * 4, (task, compiles)
        executions = [b["executions"] - a["executions"] for a, b in zip(counts, counts[1:])]
        assert max(executions[2:]) - min(executions[2:]) <= 4 * 2, (task, executions)  # 4 replicas


def test_sft_compiles_nothing_new_after_the_first_steps(sft_runs) -> None:
    _nothing_new_after_step_3(sft_runs, SFT_TASKS)


def test_dpo_compiles_nothing_new_after_the_first_steps(dpo_runs) -> None:
    """DPO's ``logits/chosen`` and ``logits/rejected`` sum a boolean-mask selection, whose size is the
    token count: summed as a masked reduction of fixed shape (hf_trainer/masked_reductions.py), they
    compile no program per new count. DPO+PEFT runs after DPO in the same process, with the same
    batches: alone, it would have compiled them as DPO did."""
    _nothing_new_after_step_3(dpo_runs, DPO_TASKS)


# -- no launch ------------------------------------------------------------------------------------


def _masked_reductions(rank: int, world: int) -> Dict:
    """On an XLA device, under the mode DPO's loss runs in: whole sums and means of boolean-mask
    selections with as many different token counts as there are masks, their gradient, and the
    programs compiled for each; then the selection used otherwise (the true one)."""
    import torch_xla

    from accel_xla_fsdp import _xla
    from accel_xla_fsdp.hf_trainer.masked_reductions import FixedShapeMaskedReductions

    device = torch_xla.device()
    values, grads, compiles = [], [], []
    for x, mask in zip(MASKED_VALUES, MASKS):
        leaf = x.to(device).requires_grad_()
        with FixedShapeMaskedReductions():
            total, mean = leaf[mask.to(device)].sum(), leaf[mask.to(device)].mean()
        (total + 2 * mean).backward()
        values.append([float(total), float(mean)])
        grads.append(leaf.grad.cpu())
        compiles.append(_xla.uncached_compiles())
    with FixedShapeMaskedReductions():
        selected = MASKED_VALUES[0].to(device)[MASKS[0].to(device)]
        other = [(selected * 3).cpu(), selected.sum(0).cpu(), selected.shape[0]]
    return {"values": values, "grads": grads, "compiles": compiles, "other": other}


MASKED_VALUES = torch.randn(6, 4, 9, generator=torch.Generator().manual_seed(3))
MASKS = torch.rand(6, 4, 9, generator=torch.Generator().manual_seed(4)) < torch.linspace(0.2, 0.8, 6)[:, None, None]


def test_masked_sums_and_means_compile_one_program_for_every_token_count(pools) -> None:
    """hf_trainer/masked_reductions.py: the values and gradients of ``x[mask].sum()`` and
    ``.mean()`` on the CPU, to round-off, and no program compiled for a new token count."""
    assert len({int(m.sum()) for m in MASKS}) == len(MASKS)  # a new token count each time
    [got] = pools[1].run(_masked_reductions, 1)
    for i, (x, mask) in enumerate(zip(MASKED_VALUES, MASKS)):
        leaf = x.clone().requires_grad_()
        total, mean = leaf[mask].sum(), leaf[mask].mean()
        (total + 2 * mean).backward()
        torch.testing.assert_close(torch.tensor(got["values"][i]), torch.stack([total, mean]).detach())
        torch.testing.assert_close(got["grads"][i], leaf.grad)
    assert got["compiles"][1:] == [got["compiles"][1]] * (len(MASKS) - 1), got["compiles"]
    selected = MASKED_VALUES[0][MASKS[0]]
    torch.testing.assert_close(got["other"][0], selected * 3)
    torch.testing.assert_close(got["other"][1], selected.sum(0))
    assert got["other"][2] == int(MASKS[0].sum())


def test_the_mixin_finds_the_training_arguments_wherever_they_are() -> None:
    """``DPOTrainer(model, ref_model, args, ...)``: the arguments are found by type, replaced by a copy
    with ``fsdp`` off, everything else passed through as it is."""
    from transformers import TrainingArguments

    from accel_xla_fsdp.hf_trainer.trainer import _training_args_taken_over

    given = TrainingArguments(output_dir="unused", report_to="none", fsdp="full_shard")
    model, ref_model, extra = object(), object(), object()
    args, kwargs, found = _training_args_taken_over((model, ref_model, given), {"callbacks": extra})
    assert found is given and args[0] is model and args[1] is ref_model and kwargs == {"callbacks": extra}
    assert isinstance(args[2], TrainingArguments) and args[2] is not given and not args[2].fsdp and given.fsdp
    args, kwargs, found = _training_args_taken_over((model,), {"args": given})
    assert args == (model,) and kwargs["args"] is not given and found is given
    assert _training_args_taken_over((model, None), {}) == ((model, None), {}, None)


def test_every_trainer_class_gets_the_mixin_in_front_once() -> None:
    import transformers

    from accel_xla_fsdp import XlaFsdpTrainerMixin
    from accel_xla_fsdp.hf_trainer.trainer import _GenerateSharded, with_mixin

    class Mine(transformers.Trainer):
        pass

    made = with_mixin(Mine)
    assert made.__mro__[1:3] == (XlaFsdpTrainerMixin, Mine) and with_mixin(Mine) is made and with_mixin(made) is made
    assert made.__name__ == "Mine"
    assert _GenerateSharded in with_mixin(transformers.Seq2SeqTrainer).__mro__


@pytest.mark.parametrize(
    "settings, refused",
    [
        ({"padding_free": True}, "padding_free=True"),
        ({"packing": True}, "packing_strategy='bfd'"),
        ({"packing": True, "packing_strategy": "wrapped"}, None),
        ({}, None),
    ],
)
def test_trl_batches_of_new_lengths_are_padded_or_refused(settings: Dict, refused: str | None) -> None:
    from trl import SFTConfig

    from accel_xla_fsdp.hf_trainer.arguments import fixed_shapes

    args = SFTConfig(output_dir="unused", report_to="none", max_length=48, **settings)
    if refused:
        with pytest.raises(ValueError, match=f"{refused}.*packing_strategy='wrapped'"):
            fixed_shapes(args)
        return
    fixed_shapes(args)
    assert args.pad_to_multiple_of == 48  # at most max_length tokens: one batch shape


def test_a_script_that_uses_spmd_is_refused_at_start(tmp_path: Path) -> None:
    """Before any replica starts, naming the line and what to do."""
    spmd = tmp_path / "spmd.py"
    spmd.write_text("import torch_xla.runtime as xr\n\nxr.use_spmd()\n")
    done = subprocess.run(
        [sys.executable, "-m", "accel_xla_fsdp", "launch", "--config_file", str(CPU_CONFIG), str(spmd)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stderr
    assert f"{spmd}:3: the script calls torch_xla.runtime.use_spmd()" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_config_that_is_not_xla_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "gpu.yaml"
    config.write_text(json.dumps({"distributed_type": "MULTI_GPU", "num_processes": 2}))
    done = subprocess.run(
        [str(BIN / "accel-xla-fsdp"), "launch", "--config_file", str(config), str(SCRIPT), "--tasks", "sft"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1 and "accel-xla-fsdp launch runs on XLA devices" in done.stderr, done.stderr
