"""torch_xla's sharded checkpoints, read as a ``ShardedCheckpoint`` is: for conversion.

torch_xla's FSDP scripts save ``{"model": model.state_dict(), "shard_metadata":
model.get_shard_metadata()}`` per rank as ``<prefix>_rank-<r>-of-<N>.pth``; the Trainer's XLA FSDP
path saves the same dict as ``rank<r>-of-<N>-pytorch_model.bin``. Each shard of the state dict
is one group in the sense of [Note: the virtual full tensor]: the ranks' shards concatenated
along dim 0 (flattened for flat parameters, rows for ``shard_param_on_dim_0``), then trimmed to
``_orig_size``; a flat parameter lists what it concatenates in ``flatten_info``.

Files are read with ``torch.load(weights_only=True, mmap=True)``: nothing in them can run code,
and a rank's tensors are paged in as they are read, not loaded whole.
"""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch

from .format import SAFETENSORS_DTYPES, CheckpointError, GroupEntry, ParamEntry, check_name, dtype_name, numel

_PATTERNS = (
    re.compile(r"^(?P<prefix>.*)_rank-(?P<rank>\d+)-of-(?P<world>\d+)\.pth$"),
    re.compile(r"^rank(?P<rank>\d+)-of-(?P<world>\d+)-pytorch_model\.bin$"),
)
_WRAPPER_NAMES = ("_fsdp_wrapped_module.", "_fpw_module.")
# torch_xla pads a flattened parameter to a multiple of world_size * _shard_size_multiple (128 by
# default; 1 for shards on dim 0): padding beyond that means the metadata is not of these shards.
_SHARD_SIZE_MULTIPLE = 128


def holds_rank_files(directory: Path) -> bool:
    """Whether ``directory`` holds a file named as torch_xla's rank files are (names only)."""
    return directory.is_dir() and any(p.match(f.name) for f in directory.iterdir() for p in _PATTERNS)


def find_rank_files(path: Path) -> List[Path]:
    """The rank files at ``path`` (a directory holding them, or one of them), in rank order.
    The world size in a name is only believed up to the number of files present."""
    candidates = sorted(path.parent.iterdir()) if path.is_file() else sorted(path.iterdir()) if path.is_dir() else []
    found: Dict[Tuple[str, int], Dict[int, Path]] = {}
    for p in candidates:
        for pattern in _PATTERNS:
            m = pattern.match(p.name)
            if m:
                if len(m["rank"]) > 9 or len(m["world"]) > 9:
                    raise CheckpointError(
                        f"{p}: rank {m['rank']} of {m['world']} in its name is not a rank of a world size"
                    )
                rank, world = int(m["rank"]), int(m["world"])
                if not 0 <= rank < world:
                    raise CheckpointError(f"{p}: its name says rank {rank} of a world of {world}")
                ranks = found.setdefault((m.groupdict().get("prefix", ""), world), {})
                if rank in ranks:
                    raise CheckpointError(f"{p}: rank {rank} of {world} twice ({ranks[rank].name} too)")
                ranks[rank] = p
    if not found:
        raise CheckpointError(
            f"{path}: no torch_xla rank files (*_rank-<r>-of-<N>.pth, or the Trainer's "
            "rank<r>-of-<N>-pytorch_model.bin)"
        )
    if len(found) > 1:
        raise CheckpointError(
            f"{path}: rank files of several checkpoints ({sorted(found)[:4]}); give one file of the one to convert"
        )
    (((_, world), ranks),) = found.items()
    if world > len(ranks):
        missing = sorted(set(range(min(world, len(ranks) + 8))) - set(ranks))[:8]
        raise CheckpointError(
            f"{path}: the names say a world of {world} ranks, {len(ranks)} rank file(s) are present: "
            f"rank file(s) {missing}{' ...' if world - len(ranks) > len(missing) else ''} of {world} missing"
        )
    return [ranks[r] for r in range(world)]


def _load(path: Path) -> Dict[str, Any]:
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            # A legacy (not zip) torch.save file cannot be memory-mapped: read it whole.
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{path}: refused: loading it needs more than tensors and plain containers "
            f"(torch.load(weights_only=True) said: {str(e).splitlines()[0] if str(e) else e!r}); it could run code"
        ) from None
    except Exception as e:  # noqa: BLE001 - torch.load raises many types for a damaged file
        raise CheckpointError(
            f"{path}: not a readable torch checkpoint ({type(e).__name__}: {str(e)[:200]})"
        ) from None


def _shape(value: Any, where: str) -> Tuple[int, ...]:
    if not isinstance(value, (torch.Size, list, tuple)) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value
    ):
        raise CheckpointError(
            f"{where}: expected a shape (a list of sizes), found {type(value).__name__} {str(value)[:60]}"
        )
    return tuple(value)


def _dict(value: Any, where: str) -> Dict[Any, Any]:
    if not isinstance(value, dict):
        raise CheckpointError(f"{where}: expected a dict, found {type(value).__name__}")
    return value


class TorchXlaCheckpoint:
    """A torch_xla FSDP checkpoint (all its rank files) as parameters by name and element range.

    Every file is checked before anything is read from its tensors: the dict's keys and types,
    every rank's metadata against its name and rank 0's, the same tensors (names, dtypes,
    shapes) in every rank, each shard's ``_orig_size`` against the elements the shards hold."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.directory = Path(path)
        self.files = find_rank_files(self.directory)
        self.world_size = len(self.files)
        ckpts = [self._checked(rank, p) for rank, p in enumerate(self.files)]
        self._states = [c["model"] for c in ckpts]
        meta = ckpts[0]["shard_metadata"]
        self._check_same_metadata([c["shard_metadata"] for c in ckpts])
        self._check_same_tensors()
        self.groups: Dict[str, GroupEntry] = {}
        self.params: Dict[str, Tuple[GroupEntry, ParamEntry]] = {}
        self.buffers: Dict[str, Tuple[str, torch.dtype]] = {}  # name -> (state dict key, original dtype)
        buffer_info = _dict(meta.get("buffer_info", {}), f"{self.files[0]}: shard_metadata['buffer_info']")
        for key, tensor in self._states[0].items():
            if "_fsdp_shard" in key:
                self._add_group(key, tensor, meta)
            else:
                self._add_buffer(key, tensor, buffer_info)

    def _checked(self, rank: int, path: Path) -> Dict[str, Any]:
        ckpt = _load(path)
        if not isinstance(ckpt, dict) or "model" not in ckpt or "shard_metadata" not in ckpt:
            raise CheckpointError(f"{path}: not a torch_xla FSDP rank file (a dict with 'model' and 'shard_metadata')")
        meta = _dict(ckpt["shard_metadata"], f"{path}: shard_metadata")
        state = _dict(ckpt["model"], f"{path}: model")
        for key, value in state.items():
            check_name(key, f"{path}: a state dict key")
            if (
                not isinstance(value, torch.Tensor)
                or value.layout != torch.strided
                or value.dtype not in SAFETENSORS_DTYPES
            ):
                raise CheckpointError(
                    f"{path}: model[{key!r}] is not a dense tensor of a dtype safetensors holds "
                    f"({type(value).__name__})"
                )
        said = (meta.get("rank"), meta.get("world_size"))
        if not all(type(v) is int for v in said) or said != (rank, self.world_size):
            raise CheckpointError(
                f"{path}: its metadata says rank {str(meta.get('rank'))[:20]} of "
                f"{str(meta.get('world_size'))[:20]}, its name "
                f"rank {rank} of {self.world_size}: files of different checkpoints are mixed"
            )
        return ckpt

    def _check_same_metadata(self, metas: List[Dict[str, Any]]) -> None:
        """Every rank's shard_metadata is rank 0's but for its rank (torch_xla writes the same)."""
        first = {k: v for k, v in metas[0].items() if k != "rank"}
        for path, meta in zip(self.files[1:], metas[1:]):
            try:
                same = {k: v for k, v in meta.items() if k != "rank"} == first
            except RecursionError:  # unpickling nests without limit; comparing recurses
                raise CheckpointError(f"{path}: its shard_metadata is nested too deeply to be torch_xla's") from None
            except Exception:  # noqa: BLE001 - values that do not compare (tensors)
                same = False
            if not same:
                raise CheckpointError(
                    f"{path}: its shard_metadata differs from rank 0's ({self.files[0].name}): files of different "
                    "checkpoints are mixed"
                )

    def _check_same_tensors(self) -> None:
        """Every rank holds the tensors rank 0 does, of its dtype and shape ("shards of one dtype")."""
        first = {k: (v.dtype, tuple(v.shape)) for k, v in self._states[0].items()}
        for path, state in zip(self.files[1:], self._states[1:]):
            mine = {k: (v.dtype, tuple(v.shape)) for k, v in state.items()}
            for key in sorted(set(mine) ^ set(first)):
                raise CheckpointError(
                    f"{path}: {'has' if key in mine else 'lacks'} tensor {key!r}, unlike rank 0's file "
                    f"{self.files[0].name}"
                )
            for key, spec in mine.items():
                if spec != first[key]:
                    raise CheckpointError(
                        f"{path}: tensor {key!r} is {spec[0]} {list(spec[1])}, in rank 0's file "
                        f"{first[key][0]} {list(first[key][1])}"
                    )

    def _add_buffer(self, key: str, tensor: torch.Tensor, buffer_info: Dict[str, Any]) -> None:
        info = buffer_info.get(key)
        dtype = tensor.dtype
        if info is not None:
            orig_dtype = _dict(info, f"{self.files[0]}: buffer_info[{key!r}]").get("_orig_dtype")
            if orig_dtype not in SAFETENSORS_DTYPES:
                raise CheckpointError(
                    f"{self.files[0]}: buffer_info[{key!r}]['_orig_dtype'] is {str(orig_dtype)[:40]}, not a dtype"
                )
            dtype = orig_dtype
        name = _clean(key)
        if name in self.buffers or name in self.params:
            raise CheckpointError(f"{self.files[0]}: {name!r} is named twice")
        self.buffers[name] = (key, dtype)

    def _add_group(self, key: str, shard: torch.Tensor, meta: Dict[str, Any]) -> None:
        where = f"{self.files[0]}: shard {key!r}"
        parts = key.split(".")
        at = next(i for i, p in enumerate(parts) if "_fsdp_shard" in p)
        prefix, suffix = ".".join(parts[:at]), ".".join(parts[at:])
        shard_info = _dict(meta.get("shard_info"), f"{self.files[0]}: shard_metadata['shard_info']")
        info = _dict(shard_info.get(prefix), f"{where}: shard_info[{prefix!r}]").get(suffix)
        if info is None:
            raise CheckpointError(f"{where} has no entry in its shard_metadata")
        info = _dict(info, f"{where}: its shard_info")
        orig_name = check_name(info.get("_orig_name"), f"{where}: its '_orig_name'")
        orig_size = _shape(info.get("_orig_size"), f"{where}: its '_orig_size'")
        orig = ".".join(p for p in (prefix, orig_name) if p)
        if "_fsdp_wrapped_module.flat_param_" in orig:
            flat = _dict(meta.get("flatten_info"), f"{self.files[0]}: shard_metadata['flatten_info']").get(orig)
            if (
                not isinstance(flat, (tuple, list))
                or len(flat) != 3
                or not all(isinstance(x, (list, tuple)) for x in flat)
            ):
                raise CheckpointError(f"{where}: flatten_info[{orig!r}] is not (names, shapes, numels)")
            names, shapes, numels = flat
            shapes = [_shape(s, f"{where}: flatten_info[{orig!r}] shapes") for s in shapes]
            if len(names) != len(shapes) or len(numels) != len(shapes) or list(numels) != [numel(s) for s in shapes]:
                raise CheckpointError(
                    f"{where}: flatten_info[{orig!r}] lists names, shapes and numels that do not agree"
                )
            if sum(numels) != numel(orig_size):
                raise CheckpointError(
                    f"{where}: flatten_info[{orig!r}] holds {sum(numels)} elements, its '_orig_size' "
                    f"{numel(orig_size)}"
                )
            owner = orig.rsplit(".", 1)[0]
            members = [(f"{owner}.{check_name(n, f'{where}: flatten_info names')}", s) for n, s in zip(names, shapes)]
        else:
            members = [(orig, orig_size)]
        self._check_orig_size(where, orig_size, shard)
        entries, offset = [], 0
        for name, shape in members:
            entries.append(ParamEntry(_clean(name), shape, offset))
            offset += numel(shape)
        group = GroupEntry(key, shard.numel(), self.world_size, dtype_name(shard.dtype), True, tuple(entries))
        self.groups[key] = group
        for e in entries:
            if e.name in self.params or e.name in self.buffers:
                raise CheckpointError(f"{where}: parameter {e.name!r} is named twice")
            self.params[e.name] = (group, e)

    def _check_orig_size(self, where: str, orig_size: Tuple[int, ...], shard: torch.Tensor) -> None:
        """The shards hold the parameter and torch_xla's padding, no more and no less."""
        world, held, wanted = self.world_size, self.world_size * shard.numel(), numel(orig_size)
        if shard.dim() >= 2:  # shard_param_on_dim_0: rows padded to a multiple of the world size
            rows_ok = len(orig_size) == shard.dim() and tuple(orig_size[1:]) == tuple(shard.shape[1:])
            ok = rows_ok and 0 <= world * shard.shape[0] - orig_size[0] < world
        else:
            ok = 0 <= held - wanted < world * _SHARD_SIZE_MULTIPLE
        if not ok:
            raise CheckpointError(
                f"{where}: its '_orig_size' {list(orig_size)} ({wanted} elements) does not fit the {world} shards of "
                f"shape {list(shard.shape)} ({held} elements; torch_xla pads fewer than "
                f"{world} x {_SHARD_SIZE_MULTIPLE}): "
                "the metadata is not of these shards"
            )

    def read_pieces(self, group: GroupEntry, start: int, stop: int) -> List[torch.Tensor]:
        """Elements ``[start, stop)`` of ``group``'s virtual full tensor, as one piece per rank."""
        size = group.shard_numel
        pieces: List[torch.Tensor] = []
        if stop <= start or size == 0:
            return pieces
        for rank in range(start // size, (stop - 1) // size + 1):
            lo, hi = max(start, rank * size) - rank * size, min(stop, (rank + 1) * size) - rank * size
            pieces.append(self._states[rank][group.key].reshape(-1)[lo:hi])
        return pieces

    def read_range(self, group: GroupEntry, start: int, stop: int) -> torch.Tensor:
        pieces = self.read_pieces(group, start, stop)
        return torch.cat(pieces) if pieces else torch.empty(0, dtype=getattr(torch, group.dtype))

    def read_param(self, name: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        group, entry = self.params[name]
        stop = entry.numel if stop is None else stop
        return self.read_range(group, entry.offset + start, entry.offset + stop)

    @property
    def buffer_names(self) -> List[str]:
        return list(self.buffers)

    def buffer_spec(self, name: str) -> Tuple[Tuple[int, ...], torch.dtype]:
        key, dtype = self.buffers[name]
        return tuple(self._states[0][key].shape), dtype

    def read_buffer(self, name: str) -> torch.Tensor:
        key, dtype = self.buffers[name]
        return self._states[0][key].to(dtype)

    def close(self) -> None:
        """Nothing to close: the memory-mapped states stay until this object goes."""


def _clean(name: str) -> str:
    for wrapper in _WRAPPER_NAMES:
        name = name.replace(wrapper, "")
    return name
