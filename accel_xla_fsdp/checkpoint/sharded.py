"""Save and load sharded checkpoints from a wrapped model (see [Note: checkpoint layout]).

``save_sharded`` and ``load_sharded`` are called on every replica with the root unit. Loading
works across world sizes and layouts ([Note: the virtual full tensor]): each replica reads only
the slices its own shards need.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import struct
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Protocol, Sequence, Tuple, TypeVar

import torch
import torch.nn as nn
import xxhash

from .. import _xla, host_memory
from ..fsdp import XlaFullyShardedDataParallel
from ..param_group import ParamSlot, ShardedParamGroup
from ..state_dict import buffer_original_dtype, full_name, join, original_name
from .files import check_free_space, check_writable
from .format import (
    BUFFER,
    FORMAT,
    FORMAT_1,
    META_KEY,
    MODEL,
    OPTIM,
    RECORD,
    SAFETENSORS_DTYPES,
    SAVE_MARKER,
    CheckpointError,
    GroupEntry,
    ParamEntry,
    RankMeta,
    Record,
    ShardedCheckpoint,
    dtype_name,
    rank_file_name,
    read_record,
    save_folders,
    tensor_checksum,
)
from .store import Location, PathLike

logger = logging.getLogger(__name__)
T = TypeVar("T")


class ParamSource(Protocol):
    """Where full parameters come from, by name and flat element range."""

    def read_param(self, name: str, start: int = 0, stop: Optional[int] = None) -> torch.Tensor: ...


# ---------------------------------------------------------------------------------------------
# Saving


def save_sharded(
    model: XlaFullyShardedDataParallel, optimizer: Optional[torch.optim.Optimizer], directory: PathLike
) -> None:
    """Write this replica's shards (and optimizer state) into ``directory``; call on every replica.

    ``directory`` is a local folder or a URL (``s3://bucket/run/ckpt``, ``gs://...``, any fsspec
    protocol): every rank writes its own file straight there. All or nothing ([Note: committing
    a save]): the new save is complete once rank 0 writes its record, after every rank has
    confirmed its file; until then the checkpoint already in ``directory`` is the one loaded, and
    the older save is removed only after. Only what saves of ours wrote is ever removed; what a
    killed save left is removed by the next one. Checked on every rank before anything is
    written: a local directory is writable and has room for this rank's file. Any rank's failure
    ends the save on every rank (``CheckpointError``, or the failing rank's own error), nothing
    committed; store failures are retried when transient ([Note: store failures]).
    """
    _check_root(model)
    _xla.sync()  # the step's pending updates, so that the shards are values to copy
    rank, world = _xla.global_rank(), _xla.world_size()
    root = Location.of(directory)
    groups = list(_groups_of(model))
    tensors, layout = _rank_tensors(model, optimizer, groups)
    checksums = _checksums(tensors)  # the header needs them: a first pass ([Note: streamed rank files])
    nbytes = sum(t.nbytes for t in tensors.values())

    number: Optional[int] = None
    error: Optional[BaseException] = None
    try:
        if root.local:
            check_writable(root.as_path(), "the checkpoint")
            check_free_space(root.as_path(), nbytes, f"rank {rank}'s file")
        if rank == 0:
            number = _prepare(root)
    except (CheckpointError, OSError) as e:
        error = e
    # Rank 0's save number and run token, and everyone's failure, in one collective: every
    # rank goes on, or none.
    token = secrets.token_bytes(16) if rank == 0 else bytes(16)
    agreed = sum_over_replicas([number or 0, *token, *_flags(world, rank, error)])
    number, token_hex = agreed[0], bytes(agreed[1:17]).hex()
    _raise_if_failed(agreed[17:], error, root, "prepare the save (nothing was written)")
    save_id = f"save-{number:06d}"
    if rank == 0 and error is None:
        try:
            _mark(root, save_id, token_hex, world)
        except (CheckpointError, OSError) as e:
            error = e
    _raise_if_failed(
        sum_over_replicas(_flags(world, rank, error)), error, root, "prepare the save (nothing was written)"
    )

    meta = RankMeta(FORMAT, save_id, rank, world, *layout, token=token_hex, checksums=checksums)
    target = root / save_id / rank_file_name(rank, world)
    confirmed = [0] * _CONFIRM
    try:
        size, digest = target.write_stream(lambda f: write_rank_file(f, tensors, {META_KEY: meta.to_json()}))
        found = target.size()  # what the store holds, not what we sent
        if found != size:
            raise CheckpointError(f"{target}: the store holds {found} bytes, {size} were written")
        confirmed = [1, *_words(size), *_words(int(digest, 16))]
    except Exception as e:  # noqa: BLE001 - whatever it is, every rank must hear of it
        error = e
    tensors.clear()
    host_memory.give_back()  # the shards' host copies, written (the Trainer's checkpoints come here)
    slots = [0] * (_CONFIRM * world)
    slots[rank * _CONFIRM : (rank + 1) * _CONFIRM] = confirmed
    agreed = sum_over_replicas(slots)  # every rank's file is in the store, its size and checksum known
    files = [agreed[r * _CONFIRM : (r + 1) * _CONFIRM] for r in range(world)]
    failed = [int(not f[0]) for f in files]
    if any(failed) and rank == 0:
        _remove_quietly(root, save_id)  # the next save removes it if this cannot
    _raise_if_failed(failed, error, root, f"write its file of {save_id} (the previous checkpoint is as it was)")
    if rank == 0:
        sizes = tuple(_unwords(f[1:5]) for f in files)
        sums = tuple(f"xxh3_64:{_unwords(f[5:9]):016x}" for f in files)
        names = tuple(f"{save_id}/{rank_file_name(r, world)}" for r in range(world))
        try:
            _commit(root, Record(FORMAT, save_id, token_hex, world, names, (), sizes, sums))
        except Exception as e:  # noqa: BLE001
            error = e
    # No rank goes on before the save is committed, and every rank learns if it was not.
    _raise_if_failed(
        sum_over_replicas(_flags(world, rank, error)),
        error,
        root,
        f"commit {save_id} (the previous checkpoint is as it was)",
    )
    _remove_older(root, number, rank, world)


_CONFIRM = 9  # per rank: written (0/1), the file's size and its XXH3-64, each in four 16-bit words


def _words(value: int) -> List[int]:
    """A 64-bit value as four 16-bit words: a sum of int32 over ranks carries them exactly."""
    return [(value >> (16 * i)) & 0xFFFF for i in range(4)]


def _unwords(words: Sequence[int]) -> int:
    return sum(w << (16 * i) for i, w in enumerate(words))


# [Note: streamed rank files]
# A rank file is written from the device a tensor at a time: each shard, optimizer state and
# buffer is copied to the host, written and let go before the next is copied, one replica
# thread at a time (host_memory.STAGING; on XLA:CPU the replicas share one host). The header
# comes first and holds every tensor's checksum, so each tensor is copied twice: once to be
# hashed, once to be written. A replica holds at most one tensor on the host (two copies of it
# while torch_xla moves it); copying every tensor first, then writing, held this rank's whole
# shard of the model and its optimizer state (3 M over all replicas, with AdamW), and about as
# much again of transfer buffers not yet given back (issue 27: save_state 5.5 M above rest).


class DeviceTensor(NamedTuple):
    """A tensor of a rank file where it lives (its device), and the dtype it is written in."""

    value: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> Tuple[int, ...]:
        return tuple(self.value.shape)

    @property
    def nbytes(self) -> int:
        return self.value.numel() * self.dtype.itemsize


def host_copy(tensor: DeviceTensor) -> torch.Tensor:
    """``tensor`` copied to the host, in the dtype written, contiguous."""
    return tensor.value.detach().cpu().to(tensor.dtype).contiguous()


def _on_host(tensor: DeviceTensor, use: Callable[[torch.Tensor], T]) -> T:
    """``use(host copy of tensor)``, one replica at a time; the copy is gone when it returns."""
    with host_memory.STAGING:
        return use(host_copy(tensor))


def _checksums(tensors: Dict[str, DeviceTensor]) -> Dict[str, str]:
    return {name: _on_host(tensor, tensor_checksum) for name, tensor in tensors.items()}


def write_rank_file(f: Any, tensors: Dict[str, DeviceTensor], metadata: Dict[str, str]) -> Tuple[int, str]:
    """Write ``tensors`` as a safetensors file into ``f``, tensor by tensor from the device
    ([Note: streamed rank files]); returns the bytes written and their XXH3-64. Tensors are laid
    out as ``safetensors`` lays them out: larger element sizes first, so that each starts aligned."""
    order = sorted(tensors, key=lambda n: (-tensors[n].dtype.itemsize, n))
    header: Dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name in order:
        t = tensors[name]
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    digest = xxhash.xxh3_64()
    written = 0
    for chunk in (struct.pack("<Q", len(raw)), raw):
        f.write(chunk)
        digest.update(chunk)
        written += len(chunk)

    def write(copy: torch.Tensor) -> int:
        if not copy.numel():
            return 0
        # An ndarray is a buffer; numpy's types say so only for Python 3.12 and later.
        data = memoryview(copy.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
        f.write(data)
        digest.update(data)
        return len(data)

    for name in order:
        written += _on_host(tensors[name], write)
    return written, digest.hexdigest()


def _mark(root: Location, save_id: str, token: str, world: int) -> None:
    """Rank 0, before any rank file: the marker that makes the folder a save of ours."""
    (root / save_id / SAVE_MARKER).put(json.dumps({"token": token, "world_size": world}).encode())


def _commit(root: Location, record: Record) -> None:
    """Rank 0, once every rank has confirmed its file: the save is complete from here on."""
    (root / str(record.save_id) / RECORD).put(record.to_json().encode())


def _check_root(model: nn.Module) -> None:
    if not isinstance(model, XlaFullyShardedDataParallel) or not model.is_root:
        raise TypeError(
            f"save_sharded / load_sharded take the root XlaFullyShardedDataParallel (the outermost "
            f"wrapper), got {type(model).__name__}"
        )


# What a save of ours writes into its folder (and what earlier versions left there: temporary
# rank files), the only files ever removed from it.
_OURS = re.compile(r"rank-\d{5}-of-\d{5}\.safetensors|\.rank-\d+-of-\d+\.safetensors\.tmp-.+")
_RECORD_TMP = re.compile(r"\.checkpoint\.json\.tmp-.+")


def _prepare(root: Location) -> int:
    """Rank 0, before anything is written: the new save's number (above every ``save-<n>`` in
    ``root``, ours or not: never reused), then what killed saves of ours left is removed (folders
    with our marker and no record; earlier versions' uncommitted folders and temporary files)."""
    numbers = save_folders(root)
    number = max((n for n, _ in numbers), default=-1) + 1
    legacy = read_record(root, committed=False)
    legacy_ours = set(legacy.saves) - {legacy.save_id} if legacy else set()
    for _, name in numbers:
        entries = (root / name).names()
        if name in legacy_ours or (SAVE_MARKER in entries and RECORD not in entries):
            _remove_save(root, name, entries)
    for name in root.names():
        if _RECORD_TMP.fullmatch(name):
            (root / name).remove()
    root.makedirs()
    return number


def _remove_save(root: Location, name: str, entries: Optional[List[str]] = None) -> None:
    """Remove a save of ours file by file: its record first (it is then incomplete), its rank
    files, its marker last (so that a removal cut short is finished by the next save); a folder
    of the user's files in it stays."""
    folder = root / name
    entries = folder.names() if entries is None else entries
    if RECORD in entries:
        (folder / RECORD).remove()
    for entry in entries:
        if _OURS.fullmatch(entry):
            (folder / entry).remove()
    if SAVE_MARKER in entries:
        (folder / SAVE_MARKER).remove()
    folder.remove_dir_if_empty()


def _remove_quietly(root: Location, save_id: str) -> None:
    try:
        _remove_save(root, save_id)
    except (CheckpointError, OSError) as e:
        logger.warning("%s: could not remove the failed save %s yet (%s); the next save will", root, save_id, e)


def _remove_older(root: Location, number: int, rank: int, world: int) -> None:
    """After the commit: rank 0 removes the older saves of ours (complete ones, and an earlier
    version's), then every rank removes its own files of older saves that it still sees (on a
    pod without a shared filesystem only its host holds them). Failures are logged: the save is
    committed, and the next one removes what is left."""
    error: Optional[BaseException] = None
    try:
        if rank == 0:
            legacy = read_record(root, committed=False)
            if legacy is not None:
                (root / RECORD).remove()
            for n, name in save_folders(root):
                entries = (root / name).names()
                if n < number and (RECORD in entries or SAVE_MARKER in entries or (legacy and name in legacy.saves)):
                    _remove_save(root, name, entries)
    except (CheckpointError, OSError) as e:
        error = e
    sum_over_replicas([0])  # rank 0 is done: what the others find now is on their host only
    try:
        if rank != 0:
            for n, name in save_folders(root):
                own = root / name / rank_file_name(rank, world)
                if n < number and own.name in (root / name).names():
                    own.remove()
                    (root / name).remove_dir_if_empty()
    except (CheckpointError, OSError) as e:
        error = e
    if error is not None:
        logger.warning("%s: older saves not all removed (%s); the next save removes them", root, error)


def _flags(world: int, rank: int, error: Optional[BaseException]) -> List[int]:
    return [int(error is not None and r == rank) for r in range(world)]


def _raise_if_failed(failed: Sequence[int], error: Optional[BaseException], root: Location, what: str) -> None:
    if error is not None:
        raise error
    ranks = [r for r, f in enumerate(failed) if f]
    if ranks:
        raise CheckpointError(f"{root}: rank(s) {ranks[:8]} could not {what}; their own error says why")


def sum_over_replicas(values: List[int]) -> List[int]:
    """The sum over every replica of ``values`` (small non-negative integers), on every replica:
    one collective. Run at a sync, where replicas take turns (one compiles, the others reuse the
    program): read back directly, every replica would compile it at once, and a replica that
    reaches the collective over 10 s late ends the process on XLA:CPU."""
    summed = _xla.all_reduce(torch.tensor(values, dtype=torch.int32, device=_xla.device()), "sum", None, True)
    _xla.sync()
    return [int(v) for v in summed.cpu().tolist()]


def _groups_of(model: XlaFullyShardedDataParallel) -> Iterator[Tuple[str, str, ShardedParamGroup]]:
    """(unit prefix, group key, group) for every group of every unit, in a fixed order."""
    for prefix, unit in model.unit_state.named_units():
        for group in unit.param_groups:
            yield prefix, join(prefix, group.spec.shard_name), group


def _param_entries(prefix: str, group: ShardedParamGroup) -> Tuple[ParamEntry, ...]:
    return tuple(
        ParamEntry(full_name(prefix, s.name), tuple(s.shape), s.offset, tuple(full_name(prefix, a) for a in s.aliases))
        for s in group.slots
    )


# RankMeta's groups, buffers and optimizer fields.
_Layout = Tuple[Tuple[GroupEntry, ...], Dict[str, str], Optional[Dict[str, Any]]]


def _rank_tensors(
    model: XlaFullyShardedDataParallel,
    optimizer: Optional[torch.optim.Optimizer],
    groups: List[Tuple[str, str, ShardedParamGroup]],
) -> Tuple[Dict[str, DeviceTensor], _Layout]:
    """This rank's tensors, on their device, and its layout: (groups, buffers, optimizer) of ``RankMeta``."""
    tensors: Dict[str, DeviceTensor] = {}
    entries = []
    for prefix, key, group in groups:
        tensors[f"{MODEL}/{key}"] = DeviceTensor(group.shard, group.shard.dtype)
        entries.append(
            GroupEntry(
                key=key,
                shard_numel=group.shard.numel(),
                world_size=group.sharding.world_size,
                dtype=dtype_name(group.shard.dtype),
                requires_grad=group.shard.requires_grad,
                params=_param_entries(prefix, group),
            )
        )
    buffers = {}
    for name, buf in model.named_buffers():
        dtype = buffer_original_dtype(model.unit_state, name) or buf.dtype
        tensors[f"{BUFFER}/{original_name(name)}"] = DeviceTensor(buf, dtype)
        buffers[original_name(name)] = dtype_name(dtype)
    optim_meta = _optimizer_tensors(optimizer, groups, tensors) if optimizer is not None else None
    return tensors, (tuple(entries), buffers, optim_meta)


def _optimizer_tensors(
    optimizer: torch.optim.Optimizer,
    groups: List[Tuple[str, str, ShardedParamGroup]],
    tensors: Dict[str, DeviceTensor],
) -> Dict[str, Any]:
    key_of = {id(g.shard): key for _, key, g in groups}
    param_groups, scalars = [], {}
    for pg in optimizer.param_groups:
        unknown = [p for p in pg["params"] if id(p) not in key_of]
        if unknown:
            raise CheckpointError(
                f"the optimizer holds {len(unknown)} parameter(s) that are not shards of this model: build it "
                "from the wrapped model's parameters()"
            )
        hyper = {k: v for k, v in pg.items() if k != "params" and _is_json(v)}
        param_groups.append({**hyper, "groups": [key_of[id(p)] for p in pg["params"]]})
        for p in pg["params"]:
            for name, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    tensors[f"{OPTIM}/{key_of[id(p)]}/{name}"] = DeviceTensor(value, value.dtype)
                elif _is_scalar(value):
                    scalars[f"{key_of[id(p)]}/{name}"] = value
    return {"type": type(optimizer).__name__, "param_groups": param_groups, "scalars": scalars}


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _is_json(value: Any) -> bool:
    """A hyper-parameter the checkpoint can hold: a number, string, None, or a flat list of them."""
    return _is_scalar(value) or isinstance(value, (list, tuple)) and all(_is_scalar(v) for v in value)


# ---------------------------------------------------------------------------------------------
# Loading


def load_sharded(
    model: XlaFullyShardedDataParallel, optimizer: Optional[torch.optim.Optimizer], directory: PathLike
) -> None:
    """Load a checkpoint saved by ``save_sharded`` on any number of ranks, in any layout.

    Call on every replica. The model (and optimizer) must be the same as when saved, wrapped in
    any way; each replica reads only the slices of the rank files that its shards need.
    Everything is checked before the model or optimizer is changed: the record and every file's
    header and metadata ([Note: reading untrusted checkpoints]), that the files are of one save
    of one run, that they fit this model, and the tensor bytes against their checksums (the
    replicas share the files out, each reads its part, and all learn the outcome).
    """
    _check_root(model)
    ckpt = ShardedCheckpoint(directory)
    groups = list(_groups_of(model))
    _check_same_model(ckpt, groups, model)
    if optimizer is not None:
        _check_optimizer(optimizer, ckpt)
    _verify_together(ckpt, with_optimizer=optimizer is not None)
    with torch.no_grad():
        for prefix, _, group in groups:
            with host_memory.STAGING:
                fill_group(group, prefix, ckpt)
                _let_go(ckpt)
        for name, buf in model.named_buffers():
            buf.copy_(ckpt.read_buffer(original_name(name)).to(buf.dtype))
    if optimizer is not None:
        _load_optimizer(optimizer, groups, ckpt)
    ckpt.close()
    _xla.sync()


def _check_same_model(
    ckpt: ShardedCheckpoint, groups: List[Tuple[str, str, ShardedParamGroup]], model: nn.Module
) -> None:
    mine = {e.name: e.shape for prefix, _, g in groups for e in _param_entries(prefix, g)}
    theirs = {name: entry.shape for name, (_, entry) in ckpt.params.items()}
    missing, unexpected = sorted(set(mine) - set(theirs)), sorted(set(theirs) - set(mine))
    wrong = sorted(n for n in set(mine) & set(theirs) if mine[n] != theirs[n])
    if missing or unexpected or wrong:
        parts = [f"missing {missing[:5]}" if missing else "", f"unexpected {unexpected[:5]}" if unexpected else ""]
        parts += [f"{n}: {theirs[n]} saved, {mine[n]} here" for n in wrong[:5]]
        raise CheckpointError(
            f"{ckpt.directory}: a checkpoint of another model ({'; '.join(p for p in parts if p)}). Load it "
            "into the model it was saved from."
        )
    for name, buf in model.named_buffers():
        name = original_name(name)
        if name not in ckpt.metas[0].buffers:
            raise CheckpointError(f"{ckpt.files[0]}: has no buffer {name!r} of the model being loaded")
        saved_shape = ckpt.buffer_spec(name)[0]
        if saved_shape != tuple(buf.shape):
            raise CheckpointError(
                f"{ckpt.files[0]}: buffer {name!r} is {list(saved_shape)} saved, {list(buf.shape)} here"
            )


def _check_optimizer(optimizer: torch.optim.Optimizer, ckpt: ShardedCheckpoint) -> None:
    saved = ckpt.optimizer_meta("load with optimizer=None")
    if saved["type"] != type(optimizer).__name__ or len(saved["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError(
            f"{ckpt.directory}: saved with a {saved['type']} of {len(saved['param_groups'])} param group(s), "
            f"loading into a {type(optimizer).__name__} of {len(optimizer.param_groups)}"
        )


def _verify_together(ckpt: ShardedCheckpoint, with_optimizer: bool) -> None:
    """Check every rank file's tensor bytes (the optimizer's only if loaded) against its
    checksums: replica ``r`` reads files ``r``, ``r + world``, ...; one collective tells all."""
    if ckpt.format == FORMAT_1:
        return  # no checksums (the same on every replica: no collective to skip)
    rank, world = _xla.global_rank(), _xla.world_size()
    error: Optional[BaseException] = None
    flags = [0] * len(ckpt.files)
    for index in range(rank, len(ckpt.files), world):
        names = [n for n in ckpt.tensor_names(index) if with_optimizer or not n.startswith(f"{OPTIM}/")]
        try:
            ckpt.verify(index, names)
        except (CheckpointError, OSError) as e:
            error = (
                e if isinstance(e, CheckpointError) else CheckpointError(f"{ckpt.files[index]}: cannot be read ({e})")
            )
            flags[index] = 1
            break
    bad = [i for i, f in enumerate(sum_over_replicas(flags)) if f]
    if error is not None:
        raise error
    if bad:
        raise CheckpointError(
            f"{ckpt.files[bad[0]]}: its tensor bytes do not match the checksums in its metadata (read by replica "
            f"{bad[0] % world}, whose error names the tensor): the file is corrupt"
        )


def fill_group(group: ShardedParamGroup, prefix: str, source: ParamSource) -> None:
    """Put this replica's part of every parameter of ``group`` from ``source`` in its shard.

    The transferred tensor becomes the shard's data (the optimizer keeps the same parameter):
    the old shard is freed at once, where a ``copy_`` would hold it, and the transferred one,
    until the next sync, every group's together (issue 27: about 1 M above the live state)."""
    values = group.local_values(lambda slot, a, b: source.read_param(full_name(prefix, slot.name), a, b))
    group.shard.data = values.to(group.shard.device)


def _let_go(ckpt: ShardedCheckpoint) -> None:
    """Unmap the files read so far and give the staging memory back, between two shards.

    Pages read through a memory map count in the process's resident memory until it is unmapped
    (all rank files, 3 M with the optimizer, if kept to the end); ``close`` drops the maps, and
    the next read opens the file again."""
    ckpt.close()
    host_memory.give_back()


def _load_optimizer(
    optimizer: torch.optim.Optimizer, groups: List[Tuple[str, str, ShardedParamGroup]], ckpt: ShardedCheckpoint
) -> None:
    saved = ckpt.metas[0].optimizer
    assert saved is not None
    by_shard = {id(g.shard): (prefix, g) for prefix, _, g in groups}
    first_rank_names = ckpt.tensor_names(0)
    for pg, saved_pg in zip(optimizer.param_groups, saved["param_groups"]):
        pg.update({k: (tuple(v) if isinstance(pg.get(k), tuple) else v) for k, v in saved_pg.items() if k != "groups"})
        for p in pg["params"]:
            prefix, group = by_shard[id(p)]
            optimizer.state.pop(p, None)  # freed before the new state is staged
            with host_memory.STAGING:
                optimizer.state[p] = _state_for(group, prefix, ckpt, saved, first_rank_names)
                _let_go(ckpt)


def _state_for(
    group: ShardedParamGroup, prefix: str, ckpt: ShardedCheckpoint, saved: Dict[str, Any], names: List[str]
) -> Dict[str, Any]:
    """One shard's optimizer state: tensors shaped like the saved shards resharded element by
    element, the others (``step``) taken from the saved group holding this group's first parameter."""
    first = _param_entries(prefix, group)[0].name
    source_group, _ = ckpt.params[first]
    shard_shape = ckpt.tensor_header(0, f"{MODEL}/{source_group.key}").shape
    state: Dict[str, Any] = {}
    for name in names:
        if not name.startswith(f"{OPTIM}/"):
            continue
        key, _, state_name = name[len(OPTIM) + 1 :].rpartition("/")
        if key != source_group.key:
            continue
        if ckpt.tensor_header(0, name).shape == shard_shape:
            state[state_name] = group.local_values(_optim_reader(ckpt, prefix, state_name)).to(group.shard.device)
        else:
            state[state_name] = ckpt.read_whole(0, name).clone()  # the file's memory map is shared
    for name, value in saved["scalars"].items():
        key, _, state_name = name.rpartition("/")
        if key == source_group.key:
            state[state_name] = value
    return state


def _optim_reader(ckpt: ShardedCheckpoint, prefix: str, state: str) -> Callable[[ParamSlot, int, int], torch.Tensor]:
    def read(slot: ParamSlot, start: int, stop: int) -> torch.Tensor:
        group, saved = ckpt.params[full_name(prefix, slot.name)]
        return ckpt.read_range(group, saved.offset + start, saved.offset + stop, prefix=OPTIM, state=state)

    return read
