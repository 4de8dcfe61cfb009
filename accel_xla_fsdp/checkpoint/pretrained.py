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
from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.nn as nn
from safetensors import safe_open

from .format import CheckpointError, FileHeader, check_dict, check_name, parse_json, read_flat_slice, read_header

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


class PretrainedWeights:
    """A ``param_init_fn`` (a ``ShardSource``) reading a Hugging Face safetensors folder: one
    ``model.safetensors``, or shards listed by ``model.safetensors.index.json`` (or the ``files``
    given). A parameter stored under none of its names that holds real values (not on the meta
    device: a head added after loading) is read from itself."""

    def __init__(self, folder: str | Path, files: Optional[Iterable[str | Path]] = None) -> None:
        self.folder = Path(folder)
        self._file_of = _tensor_files(self.folder) if files is None else _listed_files(files)
        self._aliases: Dict[int, List[str]] = {}
        self._headers: Dict[Path, FileHeader] = {}

    def stored_names(self) -> List[str]:
        return list(self._file_of)

    def stored_shapes(self) -> Dict[str, Tuple[int, ...]]:
        """Every stored tensor's shape, from the files' headers."""
        shapes: Dict[str, Tuple[int, ...]] = {}
        for file in sorted(set(self._file_of.values())):
            with safe_open(str(file), framework="pt") as f:
                shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
        return shapes

    def remember_names(self, model: nn.Module) -> None:
        """Every name of every parameter (tied ones have several), by object.

        A ``transformers`` model built under ``init_empty_weights()`` is not tied yet
        (``from_pretrained`` ties after loading): tie it as ``from_pretrained`` would, so that a
        tied head is the embedding, stored once in the files."""
        tie_weights = getattr(model, "tie_weights", None)
        if callable(tie_weights):
            tie_weights()
        for name, param in model.named_parameters(remove_duplicate=False):
            names = self._aliases.setdefault(id(param), [])
            if name not in names:
                names.append(name)

    def read(self, param: nn.Parameter, start: int, stop: int) -> torch.Tensor:
        name = self._stored_name(param)
        if name is None:
            return param.detach().reshape(-1)[start:stop].to(param.dtype, copy=True)
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

    def unstored_meta_parameters(self, model: nn.Module) -> List[str]:
        """Names of ``model``'s parameters on the meta device stored under none of their names."""
        return [
            n
            for n, p in model.named_parameters()
            if p.is_meta and not any(name in self._file_of for name in self._aliases.get(id(p), [n]))
        ]

    def read_whole(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """Tensor ``name`` of the files, whole, in ``like``'s dtype (for buffers)."""
        with safe_open(str(self._file_of[name]), framework="pt") as f:
            return f.get_tensor(name).to(like.dtype)

    def stored_name(self, param: nn.Parameter) -> Optional[str]:
        """The name ``param`` is stored under in the files, if any of its names is."""
        return next((name for name in self._aliases.get(id(param), []) if name in self._file_of), None)

    def _stored_name(self, param: nn.Parameter) -> Optional[str]:
        """The parameter's name in the files (a tied parameter may be stored under any of its
        names); None for one with real values stored under none."""
        names = self._aliases.get(id(param))
        if names is None:
            raise CheckpointError("a parameter the model was wrapped with was not in it when wrapping began")
        for name in names:
            if name in self._file_of:
                return name
        if not param.is_meta:
            return None
        raise CheckpointError(
            f"{self.folder}: no tensor {' or '.join(map(repr, names))} in these weights, and the parameter is on the "
            "meta device: a module added after building the model on the meta device has no values to shard. Give "
            "it real values (build it on the CPU) before wrapping, or build the model on the CPU"
        )


def pretrained_weights(folder: str | Path) -> PretrainedWeights:
    """``param_init_fn`` that fills shards from a Hugging Face safetensors folder (see module doc)."""
    return PretrainedWeights(folder)


def _listed_files(files: Iterable[str | Path]) -> Dict[str, Path]:
    found: Dict[str, Path] = {}
    for file in map(Path, files):
        if file.suffix != ".safetensors":
            raise CheckpointError(
                f"{file}: not a safetensors file; save the model with save_pretrained(safe_serialization=True)"
            )
        with safe_open(str(file), framework="pt") as f:
            found.update({name: file for name in f.keys()})
    return found


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
    raise CheckpointError(
        f"{folder}: neither {SINGLE} nor {INDEX}; save the model with save_pretrained(safe_serialization=True)"
    )
