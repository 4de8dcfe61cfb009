"""The save part of ``push_to_hub`` through ``prepare()``, offline: the unwrapped model's
``save_pretrained(dir, push_to_hub=True, ...)`` on every replica, and the examples' own
``HfApi().upload_folder(folder_path=output_dir, ...)`` on the main one after their stock save.
huggingface_hub's ``create_repo``, ``create_commit`` and ``upload_folder`` are replaced in the
device process by recorders that copy what would be uploaded; the test then loads each copy with
``from_pretrained`` and compares it with the trained model, and counts the uploads."""

from __future__ import annotations

import shutil
import threading
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List

import accelerate_train as script
import torch
from accelerate import PartialState
from huggingface_hub import HfApi
from test_stock_save import train
from transformers import LlamaForCausalLM

from accel_xla_fsdp import Accelerator

_lock = threading.Lock()


class RecordingHub:
    """Stands in for the Hub: each upload's files are copied to ``out/upload_<n>``."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.calls: List[Dict[str, Any]] = []
        self.saved = {name: getattr(HfApi, name) for name in ("create_repo", "create_commit", "upload_folder")}

    def __enter__(self) -> RecordingHub:
        hub = self

        def create_repo(api: HfApi, repo_id: str, **kwargs: Any) -> Any:
            hub.record("create_repo", repo_id, {})
            return SimpleNamespace(repo_id=repo_id)

        def create_commit(api: HfApi, repo_id: str, operations: Any, **kwargs: Any) -> Any:
            files = {op.path_in_repo: Path(op.path_or_fileobj) for op in operations}
            return hub.record("create_commit", repo_id, files)

        def upload_folder(api: HfApi, *, folder_path: str, repo_id: str, **kwargs: Any) -> Any:
            files = {str(p.relative_to(folder_path)): p for p in Path(folder_path).rglob("*") if p.is_file()}
            return hub.record("upload_folder", repo_id, files)

        HfApi.create_repo, HfApi.create_commit, HfApi.upload_folder = create_repo, create_commit, upload_folder
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self.saved.items():
            setattr(HfApi, name, original)

    def record(self, call: str, repo_id: str, files: Dict[str, Path]) -> None:
        with _lock:
            copy = self.out / f"upload_{len(self.calls)}"
            for name, path in files.items():
                (copy / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(path, copy / name)
            self.calls.append(
                {
                    "call": call,
                    "repo": repo_id,
                    "rank": PartialState().process_index,
                    "files": sorted(files),
                    "copy": str(copy),
                }
            )


def pushes(rank: int, world: int, out: str) -> Dict[str, Any]:
    acc = Accelerator()
    model = script.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = acc.prepare(model, optimizer)
    train(acc, model, optimizer, rank, world)
    hub = RecordingHub(out) if rank == 0 else None  # one process: rank 0's recorder sees every replica's calls
    acc.wait_for_everyone()
    with hub or nullcontext():
        acc.unwrap_model(model).save_pretrained(
            f"{out}/pushed",
            push_to_hub=True,
            repo_id="someone/tiny-llama",
            is_main_process=acc.is_main_process,
            save_function=acc.save,
        )
        # transformers' *_no_trainer.py examples: the stock save, then the main process uploads the folder
        acc.unwrap_model(model).save_pretrained(
            f"{out}/example", is_main_process=acc.is_main_process, save_function=acc.save
        )
        if acc.is_main_process:
            HfApi().upload_folder(folder_path=f"{out}/example", repo_id="someone/tiny-llama", repo_type="model")
        acc.wait_for_everyone()
    return {"full": model.model_state_dict(), "calls": hub.calls if hub else None}


def test_push_to_hub_uploads_the_whole_model_once(pools, tmp_path: Path) -> None:
    results = pools[2].run(pushes, 2, str(tmp_path))
    calls, full = results[0]["calls"], results[0]["full"]
    assert [(c["call"], c["rank"]) for c in calls] == [("create_repo", 0), ("create_commit", 0), ("upload_folder", 0)]
    for upload in calls[1:]:
        assert "model.safetensors" in upload["files"] and "config.json" in upload["files"], upload["files"]
        loaded = LlamaForCausalLM.from_pretrained(upload["copy"]).state_dict()
        assert set(loaded) == set(full)
        for name, value in full.items():
            assert torch.equal(loaded[name], value), name
    assert "README.md" in calls[1]["files"]  # the model card push_to_hub writes
