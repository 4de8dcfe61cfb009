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

import pickle
import re
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch

from .format import CheckpointError, GroupEntry, ParamEntry, dtype_name

_PATTERNS = (
    re.compile(r"^(?P<prefix>.*)_rank-(?P<rank>\d+)-of-(?P<world>\d+)\.pth$"),
    re.compile(r"^rank(?P<rank>\d+)-of-(?P<world>\d+)-pytorch_model\.bin$"),
)
_WRAPPER_NAMES = ("_fsdp_wrapped_module.", "_fpw_module.")


def find_rank_files(path: Path) -> List[Path]:
    """The rank files at ``path`` (a directory holding them, or one of them), in rank order."""
    candidates = sorted(path.parent.iterdir()) if path.is_file() else sorted(path.iterdir()) if path.is_dir() else []
    found: Dict[Tuple[str, int], Dict[int, Path]] = {}
    for p in candidates:
        for pattern in _PATTERNS:
            m = pattern.match(p.name)
            if m:
                key = (m.groupdict().get("prefix", ""), int(m["world"]))
                found.setdefault(key, {})[int(m["rank"])] = p
    if not found:
        raise CheckpointError(
            f"{path}: no torch_xla rank files (*_rank-<r>-of-<N>.pth, or the Trainer's "
            "rank<r>-of-<N>-pytorch_model.bin)"
        )
    if len(found) > 1:
        raise CheckpointError(f"{path}: rank files of several checkpoints ({sorted(found)}); give one file of the one to convert")
    ((_, world), ranks), = found.items()
    missing = sorted(set(range(world)) - set(ranks))
    if missing:
        raise CheckpointError(f"{path}: rank file(s) {missing} of {world} missing")
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
            f"(torch.load(weights_only=True) said: {str(e).splitlines()[0]}); it could run code"
        ) from None
    except (RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable torch checkpoint ({e})") from None


class TorchXlaCheckpoint:
    """A torch_xla FSDP checkpoint (all its rank files) as parameters by name and element range."""

    def __init__(self, path: str | Path) -> None:
        self.directory = Path(path)
        self.files = find_rank_files(self.directory)
        self.world_size = len(self.files)
        ckpts = [self._checked(rank, p) for rank, p in enumerate(self.files)]
        self._states = [c["model"] for c in ckpts]
        meta = ckpts[0]["shard_metadata"]
        self.groups: Dict[str, GroupEntry] = {}
        self.params: Dict[str, Tuple[GroupEntry, ParamEntry]] = {}
        self.buffers: Dict[str, Tuple[str, torch.dtype]] = {}  # name -> (state dict key, original dtype)
        for key, tensor in self._states[0].items():
            if "_fsdp_shard" in key:
                self._add_group(key, tensor, meta)
            else:
                info = meta.get("buffer_info", {}).get(key)
                self.buffers[_clean(key)] = (key, info["_orig_dtype"] if info else tensor.dtype)

    def _checked(self, rank: int, path: Path) -> Dict[str, Any]:
        ckpt = _load(path)
        if not isinstance(ckpt, dict) or "model" not in ckpt or "shard_metadata" not in ckpt:
            raise CheckpointError(f"{path}: not a torch_xla FSDP rank file (a dict with 'model' and 'shard_metadata')")
        meta = ckpt["shard_metadata"]
        if (meta.get("rank"), meta.get("world_size")) != (rank, self.world_size):
            raise CheckpointError(
                f"{path}: its metadata says rank {meta.get('rank')} of {meta.get('world_size')}, its name "
                f"rank {rank} of {self.world_size}: files of different checkpoints are mixed"
            )
        return ckpt

    def _add_group(self, key: str, shard: torch.Tensor, meta: Dict[str, Any]) -> None:
        parts = key.split(".")
        at = next(i for i, p in enumerate(parts) if p.startswith("_fsdp_shard"))
        prefix, suffix = ".".join(parts[:at]), ".".join(parts[at:])
        try:
            info = meta["shard_info"][prefix][suffix]
        except KeyError:
            raise CheckpointError(f"{self.files[0]}: shard {key!r} has no entry in its shard_metadata") from None
        orig = ".".join(p for p in (prefix, info["_orig_name"]) if p)
        if "_fsdp_wrapped_module.flat_param_" in orig:
            names, shapes, numels = meta["flatten_info"][orig]
            owner = orig.rsplit(".", 1)[0]
            members = [(f"{owner}.{n}", tuple(s)) for n, s in zip(names, shapes)]
        else:
            members = [(orig, tuple(info["_orig_size"]))]
        entries, offset = [], 0
        for name, shape in members:
            entries.append(ParamEntry(_clean(name), shape, offset))
            offset += ParamEntry("", shape, 0).numel
        group = GroupEntry(key, shard.numel(), self.world_size, dtype_name(shard.dtype), True, tuple(entries))
        self.groups[key] = group
        for e in entries:
            self.params[e.name] = (group, e)

    def read_pieces(self, group: GroupEntry, start: int, stop: int) -> List[torch.Tensor]:
        """Elements ``[start, stop)`` of ``group``'s virtual full tensor, as one piece per rank."""
        size = group.shard_numel
        pieces = []
        for rank in range(start // size, (stop - 1) // size + 1 if stop > start else start // size):
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
