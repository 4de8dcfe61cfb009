"""The sharded checkpoint format: plain safetensors files with their layout in JSON metadata.

[Note: checkpoint layout]
A checkpoint directory holds one committed save:

    DIR/checkpoint.json                                   the commit record, written last
    DIR/<save_id>/rank-00000-of-00004.safetensors         one file per rank
    ...

``checkpoint.json`` names the save and its files; it is replaced atomically once every rank has
written its file, so a save killed midway leaves the previous record, and the previous save's
files, untouched (the new save's directory is ignored and removed by the next save). A directory
without ``checkpoint.json`` holds no checkpoint.

Each rank file holds tensors named ``model/<group>`` (this rank's shard of a parameter group:
its name under the wrapped root, e.g. ``model.layers.0._fsdp_wrapped_module.flat_param_0``),
``optim/<group>/<state>`` (optimizer state of that shard: tensors shaped like the shard share its
layout, others such as Adam's ``step`` are copied whole) and ``buffer/<name>``. Its safetensors
metadata key ``accel_xla_fsdp`` holds JSON (``RankMeta``): the save id, rank, world size, and for
every group the parameters it holds, each with its full name, shape and offset. Nothing is
pickled, and reading needs only ``safetensors`` and ``json``.

[Note: the virtual full tensor]
Every group, whatever its layout, is read as one 1-D tensor of ``world_size * shard_numel``
elements: its parameters flattened and laid end to end from their ``offset`` (0 for a group of
one parameter), then zero padding. Rank ``r``'s shard, flattened, is elements
``[r * shard_numel, (r + 1) * shard_numel)``. That holds for flat shards, for per-parameter
shards, and for shards on dim 0 (rows padded at the end, row-major), so loading into any other
layout or world size is the same operation: for each parameter, copy the element ranges that
overlap the target shard's range.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
from safetensors import safe_open

FORMAT = "accel-xla-fsdp/1"
RECORD = "checkpoint.json"
META_KEY = "accel_xla_fsdp"
MODEL, OPTIM, BUFFER = "model", "optim", "buffer"


def rank_file_name(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.safetensors"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not fit: the message names the file or key."""


@dataclass(frozen=True)
class ParamEntry:
    name: str  # as in the unwrapped model's state dict
    shape: Tuple[int, ...]
    offset: int  # into the group's virtual full tensor
    aliases: Tuple[str, ...] = ()  # other names of a tied parameter

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class GroupEntry:
    key: str  # the shard's name under the root: model/<key> in the rank file
    shard_numel: int
    world_size: int  # of its sharding group (the whole world unless sharding_groups was used)
    dtype: str  # e.g. "float32"
    requires_grad: bool
    params: Tuple[ParamEntry, ...]


@dataclass(frozen=True)
class RankMeta:
    format: str
    save_id: str
    rank: int
    world_size: int
    groups: Tuple[GroupEntry, ...]
    buffers: Dict[str, str] = field(default_factory=dict)  # name -> dtype as saved
    optimizer: Optional[Dict[str, Any]] = None  # {"type", "param_groups": [{hyperparams, "groups": [keys]}], "scalars"}

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str, where: str) -> RankMeta:
        try:
            raw = json.loads(text)
            groups = tuple(
                GroupEntry(**{**g, "params": tuple(ParamEntry(**{**p, "shape": tuple(p["shape"]), "aliases": tuple(p["aliases"])}) for p in g["params"])})
                for g in raw.pop("groups")
            )
            meta = cls(**raw, groups=groups)
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{where}: its {META_KEY} metadata is not a valid {FORMAT} record ({e})") from None
        if meta.format != FORMAT:
            raise CheckpointError(f"{where}: format {meta.format!r}, this version reads {FORMAT!r}")
        return meta


_SAFETENSORS_NAMES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in checkpoint metadata")
    return dtype


# ---------------------------------------------------------------------------------------------
# Reading


class ShardedCheckpoint:
    """A committed checkpoint directory, read lazily: tensors come from the rank files in slices.

    Opening it reads ``checkpoint.json`` and every rank file's metadata and checks that they
    belong together; nothing else is read until asked for.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        record = read_record(self.directory)
        self.save_id: str = record["save_id"]
        self.world_size: int = record["world_size"]
        self.files = [self.directory / f for f in record["files"]]
        self.metas = [self._read_meta(rank, path) for rank, path in enumerate(self.files)]
        self.params: Dict[str, Tuple[GroupEntry, ParamEntry]] = {
            p.name: (g, p) for g in self.metas[0].groups for p in g.params
        }
        self.groups: Dict[str, GroupEntry] = {g.key: g for g in self.metas[0].groups}
        self._open: Dict[int, Any] = {}

    def _read_meta(self, rank: int, path: Path) -> RankMeta:
        if not path.is_file():
            raise CheckpointError(f"{path}: rank {rank}'s file of save {self.save_id} is missing")
        try:
            with safe_open(str(path), framework="pt") as f:
                metadata = f.metadata() or {}
        except Exception as e:  # safetensors raises its own error types for a bad header
            raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
        if META_KEY not in metadata:
            raise CheckpointError(f"{path}: no {META_KEY} metadata; not a file of this format")
        meta = RankMeta.from_json(metadata[META_KEY], str(path))
        if (meta.save_id, meta.rank, meta.world_size) != (self.save_id, rank, self.world_size):
            raise CheckpointError(
                f"{path}: belongs to save {meta.save_id!r} (rank {meta.rank} of {meta.world_size}), but "
                f"{self.directory / RECORD} names save {self.save_id!r} of {self.world_size} ranks: files of "
                "different saves are mixed"
            )
        return meta

    def file(self, rank: int) -> Any:
        if rank not in self._open:
            self._open[rank] = safe_open(str(self.files[rank]), framework="pt")
        return self._open[rank]

    def tensor_names(self, rank: int) -> List[str]:
        return list(self.file(rank).keys())

    def read_range(self, group: GroupEntry, start: int, stop: int, prefix: str = MODEL, state: str = "") -> torch.Tensor:
        """Elements ``[start, stop)`` of ``group``'s virtual full tensor (1-D, CPU), reading only
        the slices of the rank files that hold them. ``prefix``/``state`` pick the model or an
        optimizer state tensor of the same layout."""
        pieces = self.read_pieces(group, start, stop, prefix, state)
        return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch_dtype(group.dtype))

    def read_pieces(self, group: GroupEntry, start: int, stop: int, prefix: str = MODEL, state: str = "") -> List[torch.Tensor]:
        """``read_range`` as one piece per rank file, not copied: views into the files' memory maps
        (valid after ``close``, which only drops this object's references)."""
        key = f"{prefix}/{group.key}" + (f"/{state}" if state else "")
        pieces = []
        size = group.shard_numel
        for rank in range(start // size, (stop - 1) // size + 1 if stop > start else start // size):
            lo, hi = max(start, rank * size) - rank * size, min(stop, (rank + 1) * size) - rank * size
            pieces.append(read_flat_slice(self.file(rank), key, lo, hi, str(self.files[rank])))
        return pieces

    def read_param(self, name: str, start: int = 0, stop: Optional[int] = None) -> torch.Tensor:
        """Elements ``[start, stop)`` of parameter ``name`` flattened (all of it by default)."""
        group, entry = self.params[name]
        stop = entry.numel if stop is None else stop
        return self.read_range(group, entry.offset + start, entry.offset + stop)

    @property
    def buffer_names(self) -> List[str]:
        return list(self.metas[0].buffers)

    def buffer_spec(self, name: str) -> Tuple[Tuple[int, ...], torch.dtype]:
        """A buffer's shape and dtype as saved, from the file's header."""
        header = self.file(0).get_slice(f"{BUFFER}/{name}")
        return tuple(header.get_shape()), torch_dtype(_SAFETENSORS_NAMES[header.get_dtype()])

    def read_buffer(self, name: str) -> torch.Tensor:
        return self.file(0).get_tensor(f"{BUFFER}/{name}")

    def close(self) -> None:
        """Drop the open files. Each is a memory map, and every page read through it counts in
        this process's resident memory until it is unmapped; the next read opens the file again."""
        self._open.clear()


def read_record(directory: Path) -> Dict[str, Any]:
    path = directory / RECORD
    if not path.is_file():
        raise CheckpointError(f"{directory}: no {RECORD}, so no complete checkpoint (a save that did not finish leaves none)")
    try:
        record = json.loads(path.read_text())
        record["save_id"], record["world_size"], record["files"]  # noqa: B018 - required keys
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: not a valid checkpoint record ({e})") from None
    if record.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {record.get('format')!r}, this version reads {FORMAT!r}")
    return record


def read_flat_slice(f: Any, key: str, lo: int, hi: int, where: str) -> torch.Tensor:
    """Elements ``[lo, hi)`` of tensor ``key`` flattened, reading whole rows only where needed."""
    try:
        sliced = f.get_slice(key)
    except Exception:
        raise CheckpointError(f"{where}: has no tensor {key!r}") from None
    shape = sliced.get_shape()
    row = 1
    for d in shape[1:]:
        row *= d
    if not shape:
        return sliced[:].reshape(-1)[lo:hi]
    first, last = lo // row, -(-hi // row)
    rows = sliced[first:last].reshape(-1)
    return rows[lo - first * row : hi - first * row]
