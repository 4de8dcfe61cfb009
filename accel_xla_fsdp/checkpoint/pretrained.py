"""Pretrained weights straight into shards: each replica reads only its slices of the files.

    with accelerate.init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)        # parameters on the meta device
    model = XlaFullyShardedDataParallel(
        model, auto_wrap_policy=transformer_block_policy(),
        param_init_fn=accel_xla_fsdp.pretrained_weights("path/to/hf-folder"),
    )

The usual way, ``from_pretrained`` on every replica, holds the whole model in host memory once
per replica before wrapping shards it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List

import torch
import torch.nn as nn
from safetensors import safe_open

from .format import CheckpointError, FileHeader, check_dict, check_name, parse_json, read_flat_slice, read_header

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


class PretrainedWeights:
    """A ``param_init_fn`` (a ``ShardSource``) reading a Hugging Face safetensors folder: one
    ``model.safetensors``, or shards listed by ``model.safetensors.index.json``."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self._file_of = _tensor_files(self.folder)
        self._aliases: Dict[int, List[str]] = {}
        self._headers: Dict[Path, FileHeader] = {}

    def remember_names(self, model: nn.Module) -> None:
        """Every name of every parameter (tied ones have several), by object.

        A ``transformers`` model built under ``init_empty_weights()`` is not tied yet
        (``from_pretrained`` ties after loading): tie it as ``from_pretrained`` would, so that a
        tied head is the embedding, stored once in the files."""
        if callable(getattr(model, "tie_weights", None)):
            model.tie_weights()
        for name, param in model.named_parameters(remove_duplicate=False):
            self._aliases.setdefault(id(param), []).append(name)

    def read(self, param: nn.Parameter, start: int, stop: int) -> torch.Tensor:
        name = self._stored_name(param)
        # Opened per read: the file is memory-mapped, and pages of a mapping kept open stay in
        # the process's resident memory (4 replicas reading their quarters map the whole file).
        path = self._file_of[name]
        header = self._headers.get(path)
        if header is None:
            header = self._headers[path] = read_header(path)  # every entry checked, once per file
        if name not in header.tensors:
            raise CheckpointError(f"{path}: has no tensor {name!r}, which the index places there")
        with safe_open(str(path), framework="pt") as f:
            shape = tuple(f.get_slice(name).get_shape())
            if shape != tuple(param.shape):
                raise CheckpointError(
                    f"{self._file_of[name]}: tensor {name!r} has shape {list(shape)}, the model's parameter "
                    f"{list(param.shape)}: these weights are of another model (or another config)"
                )
            return read_flat_slice(f, name, start, stop, str(self._file_of[name])).to(param.dtype, copy=True)

    def _stored_name(self, param: nn.Parameter) -> str:
        """The parameter's name in the files; a tied parameter may be stored under any of its names."""
        names = self._aliases.get(id(param))
        if names is None:
            raise CheckpointError("a parameter the model was wrapped with was not in it when wrapping began")
        for name in names:
            if name in self._file_of:
                return name
        raise CheckpointError(f"{self.folder}: no tensor {' or '.join(map(repr, names))} in these weights")


def pretrained_weights(folder: str | Path) -> PretrainedWeights:
    """``param_init_fn`` that fills shards from a Hugging Face safetensors folder (see module doc)."""
    return PretrainedWeights(folder)


def _tensor_files(folder: Path) -> Dict[str, Path]:
    if (folder / INDEX).is_file():
        where = folder / INDEX
        try:
            text = where.read_bytes()
        except OSError as e:
            raise CheckpointError(f"{where}: cannot be read ({e})") from None
        index = check_dict(parse_json(text, str(where), "the index"), str(where))
        weight_map = check_dict(index.get("weight_map"), f"{where}, field 'weight_map'")
        files = {}
        for name, file in weight_map.items():
            check_name(name, f"{where}, field 'weight_map'")
            if not isinstance(file, str) or file != Path(file).name or file.startswith("."):
                raise CheckpointError(f"{where}: tensor {name!r} is in {str(file)[:60]!r}, not a file of {folder}")
            files[name] = folder / file
        return files
    if (folder / SINGLE).is_file():
        return {name: folder / SINGLE for name in read_header(folder / SINGLE).tensors}
    raise CheckpointError(f"{folder}: neither {SINGLE} nor {INDEX}; save the model with save_pretrained(safe_serialization=True)")
