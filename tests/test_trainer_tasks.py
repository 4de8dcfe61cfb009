"""``Seq2SeqTrainer`` with ``predict_with_generate`` and a sequence classification with
``compute_metrics`` and ``load_best_model_at_end``, through the real ``accelerate launch`` (4 XLA:CPU
replicas), against transformers' own classes under ``torchrun`` on the CPU (``trainer_tasks.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict

import pytest
import trainer_tasks as script
from test_trainer import by_step, launch, on_cpu

SCRIPT = Path(script.__file__)


def both(tmp: Path, out: Path, task: str) -> Dict:
    """Both runs of ``task``, into the test's own ``out`` (a rerun after a SIGSEGV starts clean);
    the models, made once, in the module's ``tmp``."""
    models = tmp / "models"
    if not models.is_dir():
        script.save_models(models)
    cpu = on_cpu(out / f"cpu_{task}.json", models, out / f"cpu_{task}", "--task", task, script=SCRIPT)
    xla = launch(out / f"xla_{task}.json", models, out / f"xla_{task}", "--task", task, script=SCRIPT)
    return {"cpu": cpu, "xla": xla}


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tasks")


def assert_same_history(cpu: Dict, xla: Dict, keys: tuple) -> None:
    for key in keys:
        theirs, ours = by_step(cpu, key), by_step(xla, key)
        assert sorted(ours) == sorted(theirs) and ours, key
        for step in ours:
            assert ours[step] == pytest.approx(theirs[step], rel=1e-5, abs=1e-7), (key, step, ours[step], theirs[step])


def test_seq2seq_predict_with_generate(tmp, tmp_path) -> None:
    runs = both(tmp, tmp_path, "seq2seq")
    cpu, xla = runs["cpu"], runs["xla"]
    assert xla["world"] == 4
    assert_same_history(cpu, xla, ("loss", "grad_norm", "eval_loss", "eval_token_accuracy", "eval_token_sum"))
    assert sorted(by_step(xla, "eval_token_sum")) == [3, 6]
    # The generated tokens themselves, row for row (the stock Trainer's 16 rows for 14 as well).
    assert len(xla["predictions"]) == len(cpu["predictions"]) >= 14 and xla["predictions"] == cpu["predictions"]
    assert len({tuple(row) for row in xla["predictions"]}) > 1, "generation must depend on the input"
    for key in ("test_loss", "test_token_accuracy", "test_token_sum"):
        assert xla["metrics"][key] == pytest.approx(cpu["metrics"][key], rel=1e-5)


def test_classification_compute_metrics_and_best_model(tmp, tmp_path) -> None:
    runs = both(tmp, tmp_path, "classify")
    cpu, xla = runs["cpu"], runs["xla"]
    assert_same_history(cpu, xla, ("loss", "grad_norm", "eval_loss", "eval_accuracy"))
    assert set(by_step(xla, "eval_rows").values()) == {14.0}, "gather_for_metrics drops the padding rows"
    # The best is the first evaluation; load_best_model_at_end brings its weights back, and the
    # rotation (save_total_limit=1) kept its checkpoint.
    eval_losses = by_step(xla, "eval_loss")
    assert min(eval_losses, key=eval_losses.get) == 2 and eval_losses[6] > eval_losses[2]
    assert Path(xla["best_model_checkpoint"]).name == Path(cpu["best_model_checkpoint"]).name == "checkpoint-2"
    assert xla["final"]["eval_loss"] == eval_losses[2]
    assert xla["final"]["eval_accuracy"] == cpu["final"]["eval_accuracy"]
    kept = sorted(p.name for p in (tmp_path / "xla_classify").iterdir())
    assert kept == sorted(p.name for p in (tmp_path / "cpu_classify").iterdir()) and "checkpoint-2" in kept
