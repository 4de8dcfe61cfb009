"""Consolidate a sharded checkpoint into the Hugging Face layout, streaming.

[Note: streaming consolidation]
``consolidate`` turns a directory written by ``save_sharded`` into what ``save_pretrained``
writes: ``model.safetensors``, or numbered shards with ``model.safetensors.index.json`` above the
size limit (names and index from ``huggingface_hub``'s sharding helper), plus ``config.json``
when given a config, and optionally the full optimizer state.

It never holds the model: every output file is written here in the safetensors format (8-byte
little-endian header length, a JSON header of dtype, shape and byte range per tensor, then the
bytes in header order), tensor by tensor and, within a tensor, in pieces of at most
``CHUNK_BYTES``: ``ShardedCheckpoint.read_pieces`` gives the slices of the rank files that
``read_param`` would concatenate, as views of the files' memory maps, and they are written from
there without a copy (a cast goes through one reused buffer). Pages read through a memory map
count in the process's resident memory until it is unmapped, so the rank files are closed again
after every ``CHUNK_BYTES`` read. Peak memory is a few pieces, whatever the size of the model or
of an output file.

Everything is checked before anything is written: the rank files against their record and each
other, their metadata against their tensors, the checkpoint against the config's model, the
output directory (writable, room for the files). The tensor bytes are checked against their
checksums in a thread beside the writing. The files are written into a staging folder inside
the output directory and moved into place only once all are complete and checked ([Note:
committing a consolidation]); on any error the staging folder is removed, so the output
directory is left as it was.
"""

from __future__ import annotations

import copy
import fcntl
import json
import logging
import os
import re
import shutil
import struct
import threading
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import AbstractSet, Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from huggingface_hub import split_state_dict_into_shards_factory
from huggingface_hub.serialization._base import MAX_SHARD_SIZE, parse_size_to_int
from tqdm.auto import tqdm

from .files import check_free_space as _check_free_space
from .files import check_writable
from .format import (
    BUFFER,
    MODEL,
    OPTIM,
    SAFETENSORS_DTYPES,
    CheckpointError,
    GroupEntry,
    ParamEntry,
    ShardedCheckpoint,
    torch_dtype,
)
from .store import Location, PathLike
from .torch_xla_files import TorchXlaCheckpoint

logger = logging.getLogger(__name__)

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_PATTERN = "model{suffix}.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
OPTIMIZER_NAME = "optimizer.safetensors"
OPTIMIZER_JSON_NAME = "optimizer.json"
CHUNK_BYTES = 32 * 2**20  # one read; the rank files are closed again after each such amount read
CAST_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# Files that make a folder hold a model (transformers' weight names, any shard, any index).
_MODEL_FILE = re.compile(r"(model|pytorch_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?")

_SAFETENSORS_DTYPES = SAFETENSORS_DTYPES


def consolidate(
    checkpoint_dir: PathLike,
    output_dir: PathLike,
    *,
    max_shard_size: Union[int, str] = MAX_SHARD_SIZE,
    config: Any = None,
    dtype: Union[None, str, torch.dtype] = None,
    optimizer: bool = False,
    overwrite: bool = False,
    progress: bool = True,
) -> Union[Path, Location]:
    """Write the model of a ``save_sharded`` checkpoint in the Hugging Face layout; returns ``output_dir``.

    Args:
        checkpoint_dir: the directory given to ``save_sharded`` (holding ``checkpoint.json``).
        output_dir: where to write ``model.safetensors`` (or shards and their index). Created; a
            folder that already holds a model is refused unless ``overwrite``.
        max_shard_size: the largest output file, in bytes or as ``"5GB"``; a bigger model is
            split into ``model-00001-of-0000N.safetensors`` files (a single tensor larger than
            the limit gets a file of its own).
        config: a model config (``config.json``, a folder holding one, or a ``PretrainedConfig``),
            written beside the weights. It names the model class, which decides the names tied
            weights are written under and which buffers are persistent: without it, every
            parameter is written under its first name and no buffer is written. Names are the
            model's own (its state dict's): a class whose ``save_pretrained`` converts weights to
            another layout (transformers 5's conversion mappings, some mixture-of-experts
            models) is not converted back; only causal LMs without one (Llama) are tested.
        dtype: cast floating tensors to ``"bfloat16"``, ``"float16"`` or ``"float32"`` (the
            config's ``dtype`` says so too); default: as saved.
        optimizer: also write the full optimizer state: ``optimizer.safetensors`` with a tensor
            ``<parameter name>.<state>`` per parameter and state (``exp_avg``, ``step``, ...), in
            the dtype saved, and ``optimizer.json`` (optimizer type, hyper-parameters of each
            param group with its parameters' names, non-tensor state).
        overwrite: replace the model in ``output_dir`` (its weight files, shards included, are
            removed once the new files are complete).
        progress: show a progress bar (bytes written) on stderr.

    Raises:
        CheckpointError: bad input (the message names the file or key and what is wrong); nothing
        is written then.
    """
    ckpt = ShardedCheckpoint(checkpoint_dir)
    try:
        if optimizer:
            ckpt.optimizer_meta("leave out --optimizer")
        return write_hf_layout(ckpt, output_dir, max_shard_size, config, dtype, optimizer, overwrite, progress)
    finally:
        ckpt.close()


def convert_torch_xla(
    input_path: Union[str, os.PathLike],
    output_dir: PathLike,
    *,
    max_shard_size: Union[int, str] = MAX_SHARD_SIZE,
    config: Any = None,
    dtype: Union[None, str, torch.dtype] = None,
    overwrite: bool = False,
    progress: bool = True,
) -> Union[Path, Location]:
    """Write a torch_xla-format checkpoint (torch_xla FSDP rank files ``*_rank-<r>-of-<N>.pth``,
    or the Trainer's ``rank<r>-of-<N>-pytorch_model.bin``; ``input_path`` is their directory or
    one of them) in the Hugging Face layout, as ``consolidate`` does for ours. The files are
    read with ``torch.load(weights_only=True)``: one that needs code to load is refused."""
    ckpt = TorchXlaCheckpoint(input_path)
    return write_hf_layout(ckpt, output_dir, max_shard_size, config, dtype, False, overwrite, progress)


def write_hf_layout(
    ckpt: Any,
    output_dir: PathLike,
    max_shard_size: Union[int, str],
    config: Any,
    dtype: Union[None, str, torch.dtype],
    optimizer: bool,
    overwrite: bool,
    progress: bool,
) -> Union[Path, Location]:
    """The Hugging Face layout of ``ckpt`` (a ``ShardedCheckpoint`` or ``TorchXlaCheckpoint``), in
    a local folder (returned as a ``Path``) or a bucket (a ``Location``)."""
    target = Location.of(output_dir)
    out = Path(target.path)
    limit = parse_max_shard_size(max_shard_size)
    cast = parse_dtype(dtype)
    model = ModelInfo.from_config(config) if config is not None else None
    if model is None:  # a save_state checkpoint records no config: said, as the output is then weights only
        logger.warning(
            f"{output_dir}: no model config given, so no config.json is written and from_pretrained cannot "
            "load the folder alone: pass config (--config MODEL_DIR or config.json) for the Hugging Face layout"
        )
    names = output_names(ckpt, model)
    weights = model_tensors(ckpt, names, model, cast)
    files, extra = weight_files(weights, limit)
    optim_tensors, optim_json = optimizer_tensors(ckpt, names) if optimizer else ([], None)
    if optimizer:
        files[OPTIMIZER_NAME] = optim_tensors
    if optim_json is not None:
        extra[OPTIMIZER_JSON_NAME] = json.dumps(optim_json, indent=2) + "\n"
    if model is not None:
        extra.update(model.config_files(weights))
    written = set(files) | set(extra)
    if not target.local:
        check_store_output(target, overwrite)
        verifier = Verifier(ckpt, _to_verify(ckpt, model is not None, optimizer))
        upload_hf_layout(target, files, extra, verifier, ReadBudget(ckpt), progress, "consolidating")
        return target
    check_output_dir(out, written, overwrite)
    total = sum(t.nbytes for ts in files.values() for t in ts)
    check_writable(out, "the model")
    check_free_space(out, total, "the model")

    verifier = Verifier(ckpt, _to_verify(ckpt, model is not None, optimizer))
    budget = ReadBudget(ckpt)
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="consolidating", disable=not progress)
    with bar, staging_dir(out, written, overwrite) as stage:
        verifier.start()
        try:
            for name, tensors in files.items():
                write_safetensors(stage / name, tensors, budget, bar, check=verifier.check)
            for name, text in extra.items():
                (stage / name).write_text(text)
            verifier.finish()
        finally:
            verifier.cancel()
        commit(stage, out)
    return out


def weight_files(weights: List[OutTensor], limit: int) -> Tuple[Dict[str, List[OutTensor]], Dict[str, str]]:
    """The weight files (``model.safetensors``, or shards named and split by ``huggingface_hub``'s
    helper) with their tensors, and the index (file name -> text) when sharded."""
    split = split_state_dict_into_shards_factory(
        {t.name: t for t in weights},
        get_storage_size=lambda t: t.nbytes,
        filename_pattern=WEIGHTS_PATTERN,
        max_shard_size=limit,
    )
    by_name = {t.name: t for t in weights}
    files = {name: [by_name[n] for n in tensors] for name, tensors in split.filename_to_tensors.items()}
    extra: Dict[str, str] = {}
    if split.is_sharded:
        index = {
            "metadata": {"total_parameters": sum(t.numel for t in weights if not t.buffer), **split.metadata},
            "weight_map": split.tensor_to_filename,
        }
        extra[WEIGHTS_INDEX_NAME] = json.dumps(index, indent=2, sort_keys=True) + "\n"
    return files, extra


def parse_max_shard_size(size: Union[int, str]) -> int:
    if isinstance(size, int):
        value = size
    elif str(size).strip().isdigit():
        value = int(str(size).strip())
    else:
        try:
            value = parse_size_to_int(str(size))
        except ValueError as e:
            raise ValueError(f"max shard size {size!r}: {e}") from None
    if value <= 0:
        raise ValueError(f"max shard size {size!r}: must be positive")
    return value


def parse_dtype(dtype: Union[None, str, torch.dtype]) -> Optional[torch.dtype]:
    if dtype is None or isinstance(dtype, torch.dtype) and dtype in CAST_DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in CAST_DTYPES:
        return CAST_DTYPES[dtype.removeprefix("torch.")]
    raise ValueError(f"dtype {dtype!r}: cast to one of {', '.join(CAST_DTYPES)}")


# ---------------------------------------------------------------------------------------------
# Checking the input


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ---------------------------------------------------------------------------------------------
# The model the config describes


@dataclass
class ModelInfo:
    """What the config's model class says about names: its parameters (every name, tied ones
    included) and persistent buffers, in state-dict order, and its tied weights."""

    config: Any
    class_name: str
    params: Dict[str, Tuple[int, ...]]
    buffers: Dict[str, Tuple[int, ...]]
    tied: Dict[str, str]  # target -> source: transformers saves the source and re-ties the target
    order: Dict[str, int]
    generation_config: Optional[str] = None  # the text of generation_config.json

    @classmethod
    def from_config(cls, config: Any) -> ModelInfo:
        import transformers

        where = "the config given"
        generation = None
        if not isinstance(config, transformers.PretrainedConfig):
            path = Path(config)
            where = str(path)
            if not path.exists():
                raise CheckpointError(f"{path}: no such config file or folder")
            try:
                config = transformers.AutoConfig.from_pretrained(str(path))
            except Exception as e:  # OSError, ValueError, JSON errors: transformers' message says which
                raise CheckpointError(f"{path}: not a model config transformers can read ({e})") from None
            if path.is_dir() and (path / GENERATION_CONFIG_NAME).is_file():
                generation = (path / GENERATION_CONFIG_NAME).read_text()
        config = copy.deepcopy(config)
        try:
            model = _meta_model(config)
        except Exception as e:
            raise CheckpointError(f"{where}: no model can be built from it ({type(e).__name__}: {e})") from None
        params = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
        state = model.state_dict(keep_vars=True)
        buffers = {n: tuple(b.shape) for n, b in state.items() if n not in params}
        order = {n: i for i, n in enumerate(state)}
        for n in params:
            order.setdefault(n, len(order))
        expanded_tied_keys = getattr(model, "get_expanded_tied_weights_keys", None)
        if expanded_tied_keys is not None:  # transformers 5
            tied = dict(expanded_tied_keys(all_submodels=True))
        else:  # transformers 4: a list of the names dropped when tied
            keys = getattr(model, "_tied_weights_keys", None) or []
            tied = {k: "" for k in keys if k in params} if getattr(config, "tie_word_embeddings", False) else {}
        if not getattr(config, "architectures", None):
            config.architectures = [type(model).__name__]
        return cls(config, type(model).__name__, params, buffers, tied, order, generation)

    def config_files(self, weights: Sequence[OutTensor]) -> Dict[str, str]:
        """``config.json`` (its ``dtype`` that of the weights written, as ``save_pretrained`` records
        it; the text ``save_pretrained`` writes) and ``generation_config.json`` if there is one:
        file name -> text, written as the other files are, into a folder or a bucket."""
        floats = [t.dtype for t in weights if not t.buffer and t.dtype.is_floating_point]
        if floats:
            self.config.dtype = floats[0]
        files = {CONFIG_NAME: self.config.to_json_string(use_diff=True)}
        if self.generation_config is not None:
            files[GENERATION_CONFIG_NAME] = self.generation_config
        return files


def _meta_model(config: Any) -> torch.nn.Module:
    """The config's model with its parameters on the meta device (no memory, no initialization)."""
    import transformers

    classes = [getattr(transformers, a, None) for a in (getattr(config, "architectures", None) or [])]
    with torch.device("meta"):
        for model_class in classes:
            if model_class is not None:
                return model_class._from_config(config)
        try:
            return transformers.AutoModelForCausalLM.from_config(config)
        except ValueError:
            return transformers.AutoModel.from_config(config)


# ---------------------------------------------------------------------------------------------
# Planning the output


# Elements [start, stop) of a tensor, flattened, in pieces, in any dtype.
Reader = Callable[[int, int], List[torch.Tensor]]


@dataclass
class OutTensor:
    """One tensor of an output file: its name, shape and dtype as written, and where it comes from."""

    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    read: Reader
    buffer: bool = False

    @property
    def numel(self) -> int:
        return _numel(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def output_names(ckpt: ShardedCheckpoint, model: Optional[ModelInfo]) -> Dict[str, List[str]]:
    """For each parameter of the checkpoint (by its first name), the names it is written under.

    A tied parameter is one tensor with several names. Without a model: its first name. With
    one: the model's names for it, less the tied targets transformers re-ties on loading (for a
    causal LM with tied embeddings, ``model.embed_tokens.weight`` and not ``lm_head.weight``);
    a model that does not tie them gets each name, the same values under both.
    """
    if model is None:
        return {name: [name] for name in ckpt.params}
    where = ckpt.directory
    saved = {n: entry.shape for _, entry in ckpt.params.values() for n in (entry.name, *entry.aliases)}
    unexpected = [n for n in saved if n not in model.params]
    missing = [n for n in model.params if n not in saved]
    wrong = [
        f"{n}: {list(saved[n])} saved, {list(model.params[n])} in {model.class_name}"
        for n in saved
        if n in model.params and tuple(saved[n]) != model.params[n]
    ]
    if unexpected or missing or wrong:
        parts = [
            f"not in {model.class_name}: {unexpected[:5]}" if unexpected else "",
            f"missing: {missing[:5]}" if missing else "",
            *wrong[:5],
        ]
        raise CheckpointError(
            f"{where}: does not fit the config's {model.class_name} ({'; '.join(p for p in parts if p)})"
        )
    persistent = [n for n in model.buffers if n not in ckpt.buffer_names]
    if persistent:
        raise CheckpointError(
            f"{where}: has no buffer {persistent[0]!r}, a persistent buffer of the config's {model.class_name}"
        )
    names = {}
    for name, (_, entry) in ckpt.params.items():
        all_names = [entry.name, *entry.aliases]
        kept = [n for n in all_names if n not in model.tied]
        if not kept:
            source = model.tied[entry.name]
            raise CheckpointError(
                f"{where}: the config ties {entry.name!r} to {source!r}, but the checkpoint holds them as two "
                "parameters "
                "(trained untied): set tie_word_embeddings=False in the config"
            )
        names[name] = sorted(kept, key=lambda n: model.order.get(n, 0))
    return names


def model_tensors(
    ckpt: ShardedCheckpoint, names: Dict[str, List[str]], model: Optional[ModelInfo], cast: Optional[torch.dtype]
) -> List[OutTensor]:
    """The weights file's tensors: parameters (and, with a model, its persistent buffers), in the
    model's state-dict order, or the checkpoint's without one."""

    def out_dtype(saved: torch.dtype) -> torch.dtype:
        return cast if cast is not None and saved.is_floating_point else saved

    tensors: List[OutTensor] = []
    for name, (group, entry) in ckpt.params.items():
        for out in names[name]:
            tensors.append(
                OutTensor(out, entry.shape, out_dtype(torch_dtype(group.dtype)), _param_reader(ckpt, group, entry))
            )
    if model is not None:
        for name in model.buffers:
            shape, saved = ckpt.buffer_spec(name)
            tensors.append(OutTensor(name, shape, out_dtype(saved), _buffer_reader(ckpt, name), buffer=True))
        tensors.sort(key=lambda t: model.order[t.name])
    return tensors


def optimizer_tensors(ckpt: ShardedCheckpoint, names: Dict[str, List[str]]) -> Tuple[List[OutTensor], Dict[str, Any]]:
    """``optimizer.safetensors``: each state tensor shaped like the shards reassembled per
    parameter as the parameters are; the others (Adam's ``step``) copied for each parameter of
    their group. And ``optimizer.json``: type, param groups with their parameters' names, and
    the non-tensor state."""
    saved = ckpt.optimizer_meta("leave out --optimizer")
    states: Dict[str, List[str]] = {}
    for key in ckpt.tensor_names(0):
        if key.startswith(f"{OPTIM}/"):
            group_key, _, state = key[len(OPTIM) + 1 :].rpartition("/")
            states.setdefault(group_key, []).append(state)

    def out_names(entry: ParamEntry) -> List[str]:
        return names[entry.name]

    tensors: List[OutTensor] = []
    for group in ckpt.groups.values():
        shard_shape = ckpt.tensor_header(0, f"{MODEL}/{group.key}").shape
        for state in sorted(states.get(group.key, [])):
            header = ckpt.tensor_header(0, f"{OPTIM}/{group.key}/{state}")
            sharded = header.shape == shard_shape
            for entry in group.params:
                if sharded:
                    read = _optim_reader(ckpt, group, entry, state)
                    shape = entry.shape
                else:
                    read = _whole_reader(ckpt, f"{OPTIM}/{group.key}/{state}")
                    shape = header.shape
                tensors.extend(OutTensor(f"{n}.{state}", shape, header.dtype, read) for n in out_names(entry))
    params_of = {g.key: [n for e in g.params for n in out_names(e)] for g in ckpt.groups.values()}
    param_groups = [
        {
            **{k: v for k, v in pg.items() if k != "groups"},
            "params": [n for key in pg["groups"] for n in params_of[key]],
        }
        for pg in saved["param_groups"]
    ]
    scalars: Dict[str, Dict[str, Any]] = {}
    for key, value in saved.get("scalars", {}).items():
        group_key, _, state = key.rpartition("/")
        for n in params_of.get(group_key, []):
            scalars.setdefault(n, {})[state] = value
    return tensors, {"type": saved["type"], "param_groups": param_groups, "state": scalars}


def _param_reader(ckpt: ShardedCheckpoint, group: GroupEntry, entry: ParamEntry) -> Reader:
    return lambda a, b: ckpt.read_pieces(group, entry.offset + a, entry.offset + b)


def _buffer_reader(ckpt: ShardedCheckpoint, name: str) -> Reader:
    return lambda a, b: [ckpt.read_buffer(name).reshape(-1)[a:b]]


def _optim_reader(ckpt: ShardedCheckpoint, group: GroupEntry, entry: ParamEntry, state: str) -> Reader:
    return lambda a, b: ckpt.read_pieces(group, entry.offset + a, entry.offset + b, prefix=OPTIM, state=state)


def _whole_reader(ckpt: ShardedCheckpoint, key: str) -> Reader:
    return lambda a, b: [ckpt.read_whole(0, key).reshape(-1)[a:b]]


# ---------------------------------------------------------------------------------------------
# Writing


class ReadBudget:
    """Closes the checkpoint's files (unmapping what was read) after every ``CHUNK_BYTES`` read."""

    def __init__(self, ckpt: Optional[ShardedCheckpoint], limit: int = CHUNK_BYTES) -> None:
        self.ckpt, self.limit, self.read = ckpt, limit, 0  # no ckpt: tensors in memory, nothing to close

    def add(self, nbytes: int) -> None:
        self.read += nbytes
        if self.read >= self.limit and self.ckpt is not None:
            self.ckpt.close()
            self.read = 0


def safetensors_header(tensors: Sequence[OutTensor]) -> bytes:
    header: Dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"{t.name}: dtype {t.dtype} has no safetensors name")
        header[t.name] = {
            "dtype": _SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it


def write_safetensors(
    path: Path,
    tensors: Sequence[OutTensor],
    budget: ReadBudget,
    bar: Any,
    chunk_bytes: int = CHUNK_BYTES,
    check: Callable[[], None] = lambda: None,
) -> None:
    """Write a safetensors file tensor by tensor, each in pieces of at most ``chunk_bytes``.

    A piece in the dtype written goes from the rank file's memory map to the output file without
    a copy; one to cast is copied into a buffer reused for every piece. ``check`` runs after
    every piece (the checksum verifier's verdict so far)."""
    with open(path, "wb", buffering=0) as f:
        write_safetensors_to(f, path, tensors, budget, bar, chunk_bytes, check)


def write_safetensors_to(
    f: Any,
    path: Any,
    tensors: Sequence[OutTensor],
    budget: ReadBudget,
    bar: Any,
    chunk_bytes: int = CHUNK_BYTES,
    check: Callable[[], None] = lambda: None,
) -> int:
    """``write_safetensors`` into an open file (local, or one being uploaded); returns its size."""
    header = safetensors_header(tensors)
    casts: Dict[torch.dtype, torch.Tensor] = {}
    written = 0
    f.write(struct.pack("<Q", len(header)))
    f.write(header)
    for t in tensors:
        step = max(1, chunk_bytes // t.dtype.itemsize)
        for start in range(0, t.numel, step):
            stop = min(t.numel, start + step)
            done = 0
            for piece in t.read(start, stop):
                piece = piece.reshape(-1)
                if piece.dtype == t.dtype:
                    data = piece.contiguous()
                else:
                    if t.dtype not in casts or casts[t.dtype].numel() < piece.numel():
                        casts[t.dtype] = torch.empty(max(step, piece.numel()), dtype=t.dtype)
                    data = casts[t.dtype][: piece.numel()]
                    data.copy_(piece)
                if data.numel():
                    _write_all(f, data.view(torch.uint8).numpy().data)
                    written += data.numel() * t.dtype.itemsize
                done += piece.numel()
                bar.update(data.numel() * t.dtype.itemsize)
                budget.add(piece.numel() * piece.dtype.itemsize)
                del piece, data
                check()
            if done != stop - start:
                raise CheckpointError(
                    f"{t.name}: elements [{start}, {stop}) read as {done}: the rank files hold fewer than their "
                    "metadata says"
                )
    expected = 8 + len(header) + sum(t.nbytes for t in tensors)
    if 8 + len(header) + written != expected:
        raise CheckpointError(f"{path}: wrote {8 + len(header) + written} bytes, expected {expected}")
    return expected


def _write_all(f: Any, view: memoryview) -> None:
    while len(view):  # an unbuffered write may write less than asked
        n = f.write(view)
        view = view[len(view) if n is None else n :]


# ---------------------------------------------------------------------------------------------
# Into a bucket
#
# A bucket has no rename, so the files are written straight into OUT (each one upload, whole or
# not there): the weight shards, the optimizer files and the config first, then the file a
# loader starts from (the index, or ``model.safetensors``) last, once the checksums have found
# nothing. A consolidation that fails or is killed leaves no index or ``model.safetensors``:
# nothing that loads. A bucket location that already holds a model is refused, --overwrite or
# not (its files would be replaced one by one): consolidate into a new location.
# ``Accelerator.save_model`` to a URL writes the same way from the full state dict it gathered
# (``write_state_dict_to_store``): nothing goes through local disk.


def check_store_output(out: Location, overwrite: bool) -> None:
    present = [n for n in out.names() if _MODEL_FILE.fullmatch(n)]
    if present:
        raise CheckpointError(
            f"{out}: already holds a model ({', '.join(present[:4])}); a model in a bucket is not replaced "
            f"{'even with --overwrite ' if overwrite else ''}(it has no rename to do it all at once): consolidate "
            "into a new location"
        )


def upload_hf_layout(
    out: Location,
    files: Dict[str, List[OutTensor]],
    extra: Dict[str, str],
    verifier: Verifier,
    budget: ReadBudget,
    progress: bool,
    desc: str,
) -> None:
    """Write safetensors ``files`` and text files ``extra`` into ``out``, the index or
    ``model.safetensors`` last, after ``verifier`` has found nothing."""
    last = WEIGHTS_INDEX_NAME if WEIGHTS_INDEX_NAME in extra else WEIGHTS_NAME
    total = sum(t.nbytes for ts in files.values() for t in ts)
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, disable=not progress)
    with bar:
        verifier.start()
        try:
            for name, tensors in sorted(files.items(), key=lambda item: item[0] == last):
                target = out / name

                def write(
                    f: Any, target: Location = target, tensors: List[OutTensor] = tensors, name: str = name
                ) -> None:
                    write_safetensors_to(f, target, tensors, budget, bar, check=verifier.check)
                    if name == last:
                        verifier.finish()  # before the upload completes: a bad checksum leaves no model

                target.write_stream(write)
            for name in sorted(extra, key=lambda n: n == last):
                if name == last:
                    verifier.finish()
                (out / name).put(extra[name].encode())
            verifier.finish()
        finally:
            verifier.cancel()


def write_state_dict_to_store(
    state: Dict[str, torch.Tensor], module: torch.nn.Module, out: Location, max_shard_size: Union[int, str]
) -> None:
    """``Accelerator.save_model`` to a URL: the Hugging Face layout of ``module``'s full state dict
    written straight into ``out``, as ``consolidate`` writes it (tied weights under the names
    ``save_pretrained`` keeps, the config's persistent buffers, ``config.json`` and
    ``generation_config.json``). A model already there is replaced: its index or
    ``model.safetensors`` is removed first (what remains does not load), its other weight files
    once the new model is whole."""
    import transformers

    check_storable(module, out)
    where = type(module).__name__
    model = None
    if isinstance(module, transformers.PreTrainedModel):
        config = copy.deepcopy(module.config)
        config.architectures = [where]  # as save_pretrained records it
        model = ModelInfo.from_config(config)
        if module.can_generate() and module.generation_config is not None:
            model.generation_config = module.generation_config.to_json_string(use_diff=True)
    kept: Dict[str, torch.Tensor] = {}
    seen = set()
    for name, tensor in state.items():
        if model is not None and name in model.tied:
            continue  # re-tied by from_pretrained, as save_pretrained leaves it out
        if model is None and tensor.untyped_storage().data_ptr() in seen:
            continue  # shared: under its first name, as consolidate writes it without a config
        seen.add(tensor.untyped_storage().data_ptr())
        kept[name] = tensor
    buffers = set(model.buffers) if model is not None else set()
    weights = [  # in the state dict's order, which save_pretrained's shards follow
        OutTensor(n, tuple(t.shape), t.dtype, _tensor_reader(t), buffer=n in buffers) for n, t in kept.items()
    ]
    files, extra = weight_files(weights, parse_max_shard_size(max_shard_size))
    if model is not None:
        extra.update(model.config_files(weights))
    old = [n for n in out.names() if _MODEL_FILE.fullmatch(n)]
    for name in (WEIGHTS_INDEX_NAME, WEIGHTS_NAME):
        if name in old:
            (out / name).remove()
    upload_hf_layout(out, files, extra, Verifier(None, []), ReadBudget(None), False, "saving")
    for name in old:
        if name not in files and name not in extra:
            (out / name).remove()


def check_storable(module: torch.nn.Module, out: Location) -> None:
    """Refuse, before anything is gathered, a model ``write_state_dict_to_store`` cannot write as
    its ``save_pretrained`` would."""
    import transformers

    where = type(module).__name__
    if getattr(module, "_hf_peft_config_loaded", False) or (
        hasattr(module, "save_pretrained") and not isinstance(module, transformers.PreTrainedModel)
    ):
        raise CheckpointError(
            f"{out}: save_model to a URL writes transformers models and plain modules, not {where} (its own "
            "save_pretrained decides what is saved): save_model to a local folder and copy it to the bucket"
        )
    if getattr(module, "_auto_class", None) is not None:  # transformers' is_remote_code()
        raise CheckpointError(
            f"{out}: {where} is custom code (auto_map), whose code files save_model to a URL does not copy: "
            "save_model to a local folder and copy it to the bucket"
        )


def _tensor_reader(tensor: torch.Tensor) -> Reader:
    return lambda a, b: [tensor.reshape(-1)[a:b]]


# ---------------------------------------------------------------------------------------------
# Checksums, checked beside the writing


def _to_verify(ckpt: Any, buffers: bool, optimizer: bool) -> List[Tuple[int, List[str]]]:
    """(rank, tensor names) whose bytes the consolidation reads: every rank's model shards, rank
    0's buffers when they are written, every optimizer tensor with ``--optimizer``."""
    if not isinstance(ckpt, ShardedCheckpoint):
        return []  # torch_xla's files carry no checksums
    work = []
    for rank in range(len(ckpt.files)):
        names = [
            n
            for n in ckpt.tensor_names(rank)
            if n.startswith(f"{MODEL}/")
            or (optimizer and n.startswith(f"{OPTIM}/"))
            or (buffers and rank == 0 and n.startswith(f"{BUFFER}/"))
        ]
        work.append((rank, names))
    return work


class Verifier:
    """Checks tensor bytes against their checksums in a thread of its own while the main thread
    writes (file reads release the GIL, so it takes another core when there is one), reading
    the files through one reused buffer (no memory map: its pages would count as resident).
    The output is committed only after it is done and found nothing."""

    def __init__(self, ckpt: Any, work: List[Tuple[int, List[str]]]) -> None:
        self.ckpt, self.work = ckpt, work
        self.error: Optional[BaseException] = None
        self._cancelled = False
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        if self.work:
            self._thread = threading.Thread(target=self._run, name="accel-xla-fsdp checksums", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            for rank, names in self.work:
                self.ckpt.verify(rank, names, cancelled=lambda: self._cancelled)
        except CheckpointError as e:
            self.error = e
        except OSError as e:
            self.error = CheckpointError(
                f"{e.filename or self.ckpt.directory}: cannot be read to check its checksums ({e.strerror or e})"
            )
        except BaseException as e:  # noqa: BLE001 - reported in the main thread
            self.error = e

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def finish(self) -> None:
        if self._thread is not None:
            self._thread.join()
        self.check()

    def cancel(self) -> None:
        self._cancelled = True
        if self._thread is not None:
            self._thread.join()


# ---------------------------------------------------------------------------------------------
# The output directory
#
# [Note: committing a consolidation]
# The files are written into a staging folder inside OUT_DIR (``.consolidating-<pid>-<hex>``,
# locked with flock while its process runs), so that moving them into place is a rename within
# one filesystem, whatever OUT_DIR is (a mount point, a symbolic link to another disk). Only once
# every file is complete (and the checksums found nothing) a journal, COMMIT.json, is written in
# the staging folder and the files are renamed into OUT_DIR in an order that keeps a loader from
# mixing two models: weight shards first (an old index whose shard names the new files take is
# removed before them), then the index or ``model.safetensors`` (the switch), then the rest;
# then the old model's other weight files are removed. A consolidation killed before the journal
# leaves OUT_DIR as it was (plus the staging folder); one killed after it is finished by the next
# consolidation into OUT_DIR, which also removes staging folders of dead processes, and the
# ``.<OUT_DIR>.consolidating-*`` folders earlier versions staged beside OUT_DIR.

STAGING = re.compile(r"\.consolidating-\d+-[0-9a-f]{8}")
JOURNAL = "COMMIT.json"
_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def model_files(directory: Path) -> List[Path]:
    return sorted(p for p in directory.iterdir() if _MODEL_FILE.fullmatch(p.name)) if directory.is_dir() else []


def check_output_dir(out: Path, written: AbstractSet[str], overwrite: bool) -> None:
    if out.is_symlink() and not out.exists():
        raise CheckpointError(f"{out}: a symbolic link to nothing")
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out}: exists and is not a directory")
    if out.is_dir():
        present = sorted({p.name for p in model_files(out)} | {n for n in written if (out / n).exists()})
        if present and not overwrite:
            raise CheckpointError(
                f"{out}: already holds a model ({', '.join(present[:4])}{', ...' if len(present) > 4 else ''}); "
                "pass --overwrite (overwrite=True) to replace it"
            )


def check_free_space(out: Path, nbytes: int, what: str = "the output") -> None:
    _check_free_space(out, nbytes, what)


@contextmanager
def staging_dir(out: Path, written: AbstractSet[str] = frozenset(), overwrite: bool = True) -> Iterator[Path]:
    """A new folder inside ``out`` (created, with its parents, if missing) to write into,
    locked while we write; on error it is removed, and so are the folders this created.
    What killed consolidations left in ``out`` is cleaned up (or finished) first."""
    out = Path(os.path.abspath(out))
    created = []
    parent = out
    while not parent.exists() and not parent.is_symlink():
        created.append(parent)
        parent = parent.parent
    out.mkdir(parents=True, exist_ok=True)
    tmp: Optional[Path] = None
    lock = -1
    try:
        clean_leftovers(out)
        check_output_dir(out, written, overwrite)  # a finished commit may have put a model there
        tmp = out / f".consolidating-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        lock = os.open(tmp, os.O_RDONLY)
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield tmp
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        for d in created:  # innermost first
            try:
                d.rmdir()
            except OSError:
                break
        raise
    finally:
        if lock >= 0:
            os.close(lock)


def clean_leftovers(out: Path) -> None:
    """Finish (journal written) or remove the staging folders of consolidations that are no
    longer running (their lock is free), in ``out`` and, as earlier versions put them, beside it."""
    for path in sorted(out.iterdir()):
        if STAGING.fullmatch(path.name) and path.is_dir() and not path.is_symlink():
            _finish_or_remove(path, out)
    legacy = re.compile(rf"\.{re.escape(out.name)}\.consolidating-\d+-[0-9a-f]{{8}}")
    try:
        beside = sorted(out.parent.iterdir())
    except OSError:
        beside = []  # a parent we may not list: nothing of ours to find there
    for path in beside:
        if legacy.fullmatch(path.name) and path.is_dir() and not path.is_symlink():
            _finish_or_remove(path, None)


def _finish_or_remove(stage: Path, out: Optional[Path]) -> None:
    try:
        fd = os.open(stage, os.O_RDONLY)
    except OSError:
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # its consolidation is running
        except OSError:
            pass  # no locks on this filesystem: a staging folder of a process of ours that is gone
        journal = stage / JOURNAL
        if out is not None and journal.is_file():
            try:
                steps = json.loads(journal.read_text())
                _replay(stage, out, steps)
            except (ValueError, KeyError, TypeError, OSError):
                pass  # not ours after all, or damaged: removed below without touching OUT_DIR
        shutil.rmtree(stage, ignore_errors=True)
    finally:
        os.close(fd)


def commit(stage: Path, out: Path, overwrite: bool = True) -> None:
    """Put the finished files in place ([Note: committing a consolidation])."""
    new = sorted(p.name for p in stage.iterdir() if p.name != JOURNAL)
    old = {p.name for p in model_files(out)}
    first = (
        [WEIGHTS_INDEX_NAME]
        if WEIGHTS_INDEX_NAME in old and any(n in old for n in new if _SHARD_FILE.fullmatch(n))
        else []
    )
    shards = [n for n in new if _SHARD_FILE.fullmatch(n)]
    switch = [n for n in (WEIGHTS_INDEX_NAME, WEIGHTS_NAME) if n in new]
    rest = [n for n in new if n not in shards and n not in switch]
    steps = {"remove_first": first, "moves": shards + switch + rest, "remove": sorted(old - set(new))}
    (stage / JOURNAL).write_text(json.dumps(steps))
    _replay(stage, out, steps)
    shutil.rmtree(stage, ignore_errors=True)


def _replay(stage: Path, out: Path, steps: Dict[str, List[str]]) -> None:
    """Carry out (or finish) a commit; every step can be done again."""
    safe = lambda name: isinstance(name, str) and name == Path(name).name and not name.startswith(".")  # noqa: E731
    for name in filter(safe, steps["remove_first"]):
        _unlink(out / name)
    for name in filter(safe, steps["moves"]):
        if (stage / name).exists():
            os.replace(stage / name, out / name)
    for name in filter(safe, steps["remove"]):
        if _MODEL_FILE.fullmatch(name):
            _unlink(out / name)


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
