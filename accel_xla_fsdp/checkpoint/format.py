"""The sharded checkpoint format: plain safetensors files with their layout in JSON metadata.

[Note: checkpoint layout]
A checkpoint directory (a local folder or a URL: [Note: checkpoint locations]) holds saves:

    DIR/<save_id>/started.json                            rank 0's marker: a save of ours
    DIR/<save_id>/rank-00000-of-00004.safetensors         one file per rank
    ...
    DIR/<save_id>/checkpoint.json                         the save's record, written last

The newest save with a record is the checkpoint; ``checkpoint.json`` names the save, its run
token and its files with their sizes and checksums ([Note: committing a save]). Directories of
earlier versions hold one ``DIR/checkpoint.json`` naming the committed save (and, in format 2,
``saves``: the folders it made), still read.

Each rank file holds tensors named ``model/<group>`` (this rank's shard of a parameter group:
its name under the wrapped root, e.g. ``model.layers.0._fsdp_wrapped_module.flat_param_0``),
``optim/<group>/<state>`` (optimizer state of that shard: tensors shaped like the shard share its
layout, others such as Adam's ``step`` are copied whole) and ``buffer/<name>``. Its safetensors
metadata key ``accel_xla_fsdp`` holds JSON (``RankMeta``): the save id and the save's run token
(random, drawn by rank 0 and shared with every rank, so files of two runs never pass for one save
even when both are ``save-000000``), rank, world size, a checksum (XXH3-64) of every tensor's bytes, and for
every group the parameters it holds, each with its full name, shape and offset. Nothing is
pickled, and reading needs only ``safetensors`` and ``json``.

[Note: reading untrusted checkpoints]
Every field of the record, of each file's safetensors header and of its metadata is checked for
type and range before it is used: sizes and offsets against the file's size, shapes against
shard sizes, world sizes against the files present, names for valid UTF-8 and uniqueness, JSON
for duplicate keys and nesting. Anything else is a ``CheckpointError`` naming the file and the
field; nothing is allocated from a size that has not been checked against the bytes present.

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
import logging
import os
import re
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch
import xxhash
from safetensors import safe_open

from .errors import CheckpointError
from .store import Location, PathLike

logger = logging.getLogger(__name__)

FORMAT = "accel-xla-fsdp/2"
FORMAT_1 = "accel-xla-fsdp/1"  # before run tokens and checksums: still read, without those checks
READABLE = (FORMAT, FORMAT_1)
RECORD = "checkpoint.json"
META_KEY = "accel_xla_fsdp"
MODEL, OPTIM, BUFFER = "model", "optim", "buffer"
SAVE_NAME = re.compile(r"save-(\d{6,12})")
TOKEN = re.compile(r"[0-9a-f]{32}")
CHECKSUM = re.compile(r"xxh3_64:[0-9a-f]{16}")
MAX_RECORD_BYTES = 64 * 2**20
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
MAX_NAME_CHARS = 4096
VERIFY_CHUNK = 8 * 2**20


def rank_file_name(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.safetensors"


# ---------------------------------------------------------------------------------------------
# Dtypes

SAFETENSORS_DTYPES: Dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}
TORCH_DTYPES: Dict[str, torch.dtype] = {v: k for k, v in SAFETENSORS_DTYPES.items()}
_BY_NAME: Dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in SAFETENSORS_DTYPES}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    if not isinstance(name, str) or name not in _BY_NAME:
        raise CheckpointError(f"unknown dtype {_short(name)} in checkpoint metadata")
    return _BY_NAME[name]


# ---------------------------------------------------------------------------------------------
# Checked JSON


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Duplicate(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


def _no_duplicates(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Duplicate(key)
        out[key] = value
    return out


def parse_json(text: Any, where: str, what: str) -> Any:
    """``json.loads`` refusing duplicate keys, deep nesting and invalid UTF-8 with a ``CheckpointError``."""
    try:
        if isinstance(text, (bytes, bytearray)):
            text = bytes(text).decode("utf-8")
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except _Duplicate as e:
        raise CheckpointError(f"{where}: {what} has the key {_short(e.key)} twice") from None
    except RecursionError:
        raise CheckpointError(f"{where}: {what} is nested too deeply to be a checkpoint's") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{where}: {what} is not valid JSON ({_short(str(e), 120)})") from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(value: Any, where: str, lo: int = 0, hi: Optional[int] = None) -> int:
    if not _is_int(value) or value < lo or (hi is not None and value > hi):
        bound = f"from {lo} to {hi}" if hi is not None else f"of at least {lo}"
        raise CheckpointError(f"{where}: expected an integer {bound}, found {_short(value)}")
    return value


def check_name(value: Any, where: str) -> str:
    """A non-empty string that UTF-8 can encode (no lone surrogates from ``\\udc80`` escapes)."""
    if not isinstance(value, str) or not value or len(value) > MAX_NAME_CHARS:
        raise CheckpointError(f"{where}: expected a name (a non-empty string), found {_short(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise CheckpointError(f"{where}: {_short(value)} is not valid UTF-8") from None
    return value


def check_dict(
    value: Any, where: str, keys: Optional[Iterable[str]] = None, optional: Iterable[str] = ()
) -> Dict[str, Any]:
    if not isinstance(value, dict):
        raise CheckpointError(f"{where}: expected a JSON object, found {_short(value)}")
    if keys is not None:
        keys, optional = set(keys), set(optional)
        missing = sorted(keys - set(value))
        if missing:
            raise CheckpointError(f"{where}: has no field {missing[0]!r}")
        extra = sorted(set(value) - keys - optional, key=str)
        if extra:
            raise CheckpointError(f"{where}: unknown field {_short(extra[0])}")
    return value


def check_list(value: Any, where: str) -> List[Any]:
    if not isinstance(value, list):
        raise CheckpointError(f"{where}: expected a JSON list, found {_short(value)}")
    return value


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float)) or (isinstance(value, str) and _encodable(value))


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ---------------------------------------------------------------------------------------------
# The metadata


@dataclass(frozen=True)
class ParamEntry:
    name: str  # as in the unwrapped model's state dict
    shape: Tuple[int, ...]
    offset: int  # into the group's virtual full tensor
    aliases: Tuple[str, ...] = ()  # other names of a tied parameter

    @property
    def numel(self) -> int:
        return numel(self.shape)


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
    optimizer: Optional[Dict[str, Any]] = (
        None  # {"type", "param_groups": [{hyperparams, "groups": [keys]}], "scalars"}
    )
    token: Optional[str] = None  # the save's run token (32 hex digits); None in format 1
    checksums: Optional[Dict[str, str]] = None  # tensor name -> "xxh3_64:<16 hex digits>"; None in format 1

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str, where: str) -> RankMeta:
        """Parse and check every field's type and range (not yet against the file's tensors)."""
        what = f"its {META_KEY} metadata"
        try:
            raw = parse_json(text, where, "it")
        except CheckpointError as e:
            raise CheckpointError(
                f"{where}: {what} is not a valid {FORMAT} record ({str(e).removeprefix(f'{where}: it ')})"
            ) from None
        at = f"{where}: {what}"
        if not isinstance(raw, dict) or raw.get("format") not in READABLE:
            found = raw.get("format") if isinstance(raw, dict) else raw
            raise CheckpointError(f"{at}: format {_short(found)}, this version reads {FORMAT!r} (and {FORMAT_1!r})")
        new = raw["format"] == FORMAT
        base = {"format", "save_id", "rank", "world_size", "groups", "buffers", "optimizer"}
        check_dict(raw, at, base | ({"token", "checksums"} if new else set()))
        save_id = _check_save_name(raw["save_id"], f"{at}, field 'save_id'")
        world = check_int(raw["world_size"], f"{at}, field 'world_size'", 1)
        rank = check_int(raw["rank"], f"{at}, field 'rank'", 0, world - 1)
        groups, keys, names = [], set(), set()
        for i, g in enumerate(check_list(raw["groups"], f"{at}, field 'groups'")):
            group = _group(g, f"{at}, groups[{i}]", world)
            if group.key in keys:
                raise CheckpointError(f"{at}, groups[{i}]: group key {group.key!r} is listed twice")
            keys.add(group.key)
            for p in group.params:
                for name in (p.name, *p.aliases):
                    if name in names:
                        raise CheckpointError(f"{at}, groups[{i}] ({group.key!r}): parameter {name!r} is listed twice")
                    names.add(name)
            groups.append(group)
        buffers = check_dict(raw["buffers"], f"{at}, field 'buffers'")
        for name, dtype in buffers.items():
            check_name(name, f"{at}, buffers")
            try:
                torch_dtype(dtype)
            except CheckpointError as e:
                raise CheckpointError(f"{at}, buffer {name!r}: {e}") from None
        optimizer = _optimizer(raw["optimizer"], f"{at}, field 'optimizer'", keys)
        token = checksums = None
        if new:
            token = raw["token"]
            if not isinstance(token, str) or not TOKEN.fullmatch(token):
                raise CheckpointError(f"{at}, field 'token': expected 32 hexadecimal digits, found {_short(token)}")
            checksums = check_dict(raw["checksums"], f"{at}, field 'checksums'")
            for name, value in checksums.items():
                check_name(name, f"{at}, field 'checksums'")
                if not isinstance(value, str) or not CHECKSUM.fullmatch(value):
                    raise CheckpointError(
                        f"{at}, checksum of {name!r}: expected 'xxh3_64:<16 hex digits>', found {_short(value)}"
                    )
        return cls(raw["format"], save_id, rank, world, tuple(groups), dict(buffers), optimizer, token, checksums)


def _check_save_name(value: Any, where: str) -> str:
    if not isinstance(value, str) or not SAVE_NAME.fullmatch(value):
        raise CheckpointError(f"{where}: expected a save name like 'save-000003', found {_short(value)}")
    return value


def _group(raw: Any, where: str, world: int) -> GroupEntry:
    check_dict(raw, where, ("key", "shard_numel", "world_size", "dtype", "requires_grad", "params"))
    key = check_name(raw["key"], f"{where}, field 'key'")
    where = f"{where} ({key!r})"
    shard_numel = check_int(raw["shard_numel"], f"{where}, field 'shard_numel'")
    group_world = check_int(raw["world_size"], f"{where}, field 'world_size'", 1, world)
    try:
        torch_dtype(raw["dtype"])
    except CheckpointError as e:
        raise CheckpointError(f"{where}, field 'dtype': {e}") from None
    if not isinstance(raw["requires_grad"], bool):
        raise CheckpointError(
            f"{where}, field 'requires_grad': expected true or false, found {_short(raw['requires_grad'])}"
        )
    size = group_world * shard_numel
    params = []
    for j, p in enumerate(check_list(raw["params"], f"{where}, field 'params'")):
        at = f"{where}, params[{j}]"
        check_dict(p, at, ("name", "shape", "offset", "aliases"))
        name = check_name(p["name"], f"{at}, field 'name'")
        at = f"{where}, parameter {name!r}"
        shape = tuple(check_int(d, f"{at}, field 'shape'") for d in check_list(p["shape"], f"{at}, field 'shape'"))
        offset = check_int(p["offset"], f"{at}, field 'offset'")
        aliases = tuple(
            check_name(a, f"{at}, field 'aliases'") for a in check_list(p["aliases"], f"{at}, field 'aliases'")
        )
        params.append(ParamEntry(name, shape, offset, aliases))
    end = 0
    for p in sorted(params, key=lambda p: p.offset):
        if p.offset < end or p.offset + p.numel > size:
            raise CheckpointError(
                f"{where}: parameter {p.name!r} takes elements [{p.offset}, {p.offset + p.numel}), outside the "
                f"group's {size} ({group_world} x {shard_numel}) or overlapping another parameter"
            )
        end = p.offset + p.numel
    return GroupEntry(key, shard_numel, group_world, raw["dtype"], raw["requires_grad"], tuple(params))


def _optimizer(raw: Any, where: str, groups: set) -> Optional[Dict[str, Any]]:
    if raw is None:
        return None
    check_dict(raw, where, ("type", "param_groups", "scalars"))
    check_name(raw["type"], f"{where}, field 'type'")
    seen: set = set()
    for i, pg in enumerate(check_list(raw["param_groups"], f"{where}, field 'param_groups'")):
        at = f"{where}, param_groups[{i}]"
        check_dict(pg, at)
        if "groups" not in pg or "params" in pg:
            raise CheckpointError(f"{at}: expected a field 'groups' (and no 'params')")
        for key in check_list(pg["groups"], f"{at}, field 'groups'"):
            if not isinstance(key, str) or key not in groups:
                raise CheckpointError(f"{at}: names group {_short(key)}, which the model metadata does not list")
            if key in seen:
                raise CheckpointError(f"{at}: group {key!r} is in two param groups")
            seen.add(key)
        for name, value in pg.items():
            check_name(name, f"{at}, a hyper-parameter name")
            if name != "groups" and not (
                _is_scalar(value) or isinstance(value, list) and all(_is_scalar(v) for v in value)
            ):
                raise CheckpointError(
                    f"{at}, hyper-parameter {name!r}: expected a number, string or flat list, found {_short(value)}"
                )
    for name, value in check_dict(raw["scalars"], f"{where}, field 'scalars'").items():
        check_name(name, f"{where}, field 'scalars'")
        if "/" not in name or name.rsplit("/", 1)[0] not in groups or not name.rsplit("/", 1)[1]:
            raise CheckpointError(
                f"{where}, field 'scalars': {name!r} is not '<group>/<state>' of a group of the model metadata"
            )
        if not _is_scalar(value):
            raise CheckpointError(f"{where}, scalar {name!r}: expected a number or string, found {_short(value)}")
    return raw


# ---------------------------------------------------------------------------------------------
# The record
#
# [Note: committing a save]
# A save is complete when its record, ``<save_id>/checkpoint.json``, exists: written last, in one
# step, by rank 0, once every rank has written its file and confirmed it (its size as the store
# reports it, and the XXH3-64 of its bytes as written) over one collective; the record lists
# every rank file with that size and checksum. Rank 0 first writes ``<save_id>/started.json``
# (the run token), which marks the folder as a save of ours: a folder with it and without a
# record is an incomplete save, which loads skip (naming it) and the next save removes, file by
# file, only what a save writes (rank files, then the marker). Once the new record is written,
# older complete saves are removed the same way, record first (so a removal cut short leaves an
# incomplete save, never a record naming missing files). No file is ever renamed or replaced,
# and no host needs to see another's files, so the same protocol holds on a local disk, a
# shared filesystem and a bucket. Directories of earlier versions (one ``checkpoint.json`` at the
# top naming the committed save) are still read and saved over.

SAVE_MARKER = "started.json"


@dataclass(frozen=True)
class Record:
    """A save's record (``<save_id>/checkpoint.json``), or an earlier version's ``checkpoint.json``
    at the top (``saves``: the save folders it made; ``save_id`` None before the first commit)."""

    format: str
    save_id: Optional[str]
    token: Optional[str]
    world_size: int
    files: Tuple[str, ...]  # relative to the checkpoint directory: "<save_id>/rank-....safetensors"
    saves: Tuple[str, ...] = ()
    file_sizes: Tuple[int, ...] = ()
    file_checksums: Tuple[str, ...] = ()

    def to_json(self) -> str:
        raw: Dict[str, Any] = {"format": self.format, "save_id": self.save_id}
        if self.save_id is not None:
            raw.update(token=self.token, world_size=self.world_size, files=list(self.files))
        if self.file_sizes:
            raw.update(file_sizes=list(self.file_sizes), file_checksums=list(self.file_checksums))
        else:
            raw["saves"] = list(self.saves)
        return json.dumps(raw, indent=1)


def read_record(directory: PathLike, *, committed: bool = True, path: Optional[Location] = None) -> Optional[Record]:
    """The record at ``path`` (by default ``directory/checkpoint.json``, an earlier version's),
    every field checked. Missing: a ``CheckpointError`` if ``committed``, else None; with
    ``committed``, a record naming no save is refused too."""
    directory = Location.of(directory)
    path = path if path is not None else directory / RECORD
    if not path.isfile():
        if committed:
            raise CheckpointError(
                f"{directory}: no {RECORD}, so no complete checkpoint (a save that did not finish leaves none)"
            )
        return None
    text = path.read_bytes(MAX_RECORD_BYTES + 1)
    if len(text) > MAX_RECORD_BYTES:
        raise CheckpointError(f"{path}: larger than {MAX_RECORD_BYTES} bytes, not a checkpoint record")
    raw = parse_json(text, str(path), "the record")
    where = f"{path}"
    if not isinstance(raw, dict) or raw.get("format") not in READABLE:
        found = raw.get("format") if isinstance(raw, dict) else raw
        raise CheckpointError(f"{where}: format {_short(found)}, this version reads {FORMAT!r} (and {FORMAT_1!r})")
    new = raw["format"] == FORMAT
    if new and raw.get("save_id") is None:
        check_dict(raw, where, ("format", "save_id", "saves"))
        saves = _saves(raw["saves"], where)
        if committed:
            raise CheckpointError(
                f"{directory}: {RECORD} names no committed save yet (the first save into it did not finish)"
            )
        return Record(FORMAT, None, None, 0, (), saves)
    per_save = new and "file_sizes" in raw
    fields: Tuple[str, ...] = ("format", "save_id", "world_size", "files")
    if new:
        fields += ("token", "file_sizes", "file_checksums") if per_save else ("token", "saves")
    check_dict(raw, where, fields)
    save_id = _check_save_name(raw["save_id"], f"{where}, field 'save_id'")
    files = check_list(raw["files"], f"{where}, field 'files'")
    world = check_int(raw["world_size"], f"{where}, field 'world_size'", 1)
    if world != len(files):
        raise CheckpointError(f"{where}: lists {len(files)} rank files for a world of {world}")
    for rank, name in enumerate(files):
        folder, _, base = name.partition("/") if isinstance(name, str) else ("", "", "")
        if not SAVE_NAME.fullmatch(folder) or base != rank_file_name(rank, world) or (per_save and folder != save_id):
            want = f"{save_id}/{rank_file_name(rank, world)}"
            raise CheckpointError(f"{where}, files[{rank}]: expected a path like {want!r}, found {_short(name)}")
    token = None
    saves = (save_id,)
    sizes: Tuple[int, ...] = ()
    sums: Tuple[str, ...] = ()
    if new:
        token = raw["token"]
        if not isinstance(token, str) or not TOKEN.fullmatch(token):
            raise CheckpointError(f"{where}, field 'token': expected 32 hexadecimal digits, found {_short(token)}")
    if per_save:
        sizes = tuple(check_int(n, f"{where}, field 'file_sizes'") for n in check_list(raw["file_sizes"], where))
        sums = tuple(check_list(raw["file_checksums"], f"{where}, field 'file_checksums'"))
        if len(sizes) != world or len(sums) != world:
            raise CheckpointError(f"{where}: file_sizes and file_checksums must list one entry per rank file")
        for value in sums:
            if not isinstance(value, str) or not CHECKSUM.fullmatch(value):
                raise CheckpointError(f"{where}, field 'file_checksums': expected 'xxh3_64:<16 hex digits>'")
        saves = ()
    elif new:
        saves = _saves(raw["saves"], where)
    return Record(raw["format"], save_id, token, world, tuple(files), saves, sizes, sums)


def _saves(raw: Any, where: str) -> Tuple[str, ...]:
    names = tuple(_check_save_name(n, f"{where}, field 'saves'") for n in check_list(raw, f"{where}, field 'saves'"))
    if len(set(names)) != len(names):
        raise CheckpointError(f"{where}, field 'saves': lists a folder twice")
    return names


def save_folders(root: Location) -> List[Tuple[int, str]]:
    """(number, name) of the ``save-<n>`` entries in ``root``, lowest first."""
    found = [(int(m.group(1)), n) for n in root.names() if (m := SAVE_NAME.fullmatch(n))]
    return sorted(found)


@dataclass(frozen=True)
class SaveState:
    """What a checkpoint directory holds: its newest complete save (its record's location and the
    record), and the incomplete saves of ours newer than it (their folder names)."""

    record_path: Optional[Location]
    record: Optional[Record]
    incomplete: Tuple[str, ...]


def find_saves(root: PathLike) -> SaveState:
    """The newest complete save in ``root`` ([Note: committing a save]) and the incomplete ones
    above it; an earlier version's top-level record counts as its save's."""
    root = Location.of(root)
    legacy = read_record(root, committed=False)
    legacy_id = legacy.save_id if legacy is not None else None
    incomplete: List[str] = []
    for _, name in reversed(save_folders(root)):
        if name == legacy_id:
            return SaveState(root / RECORD, legacy, tuple(incomplete))
        entries = (root / name).names()
        if RECORD in entries:
            path = root / name / RECORD
            return SaveState(path, read_record(root, path=path), tuple(incomplete))
        if SAVE_MARKER in entries:
            incomplete.append(name)
    if legacy_id is not None:
        return SaveState(root / RECORD, legacy, tuple(incomplete))
    return SaveState(None, None, tuple(incomplete))


# ---------------------------------------------------------------------------------------------
# Safetensors headers, read and checked here (the same rules safetensors applies, and more)


@dataclass(frozen=True)
class TensorHeader:
    dtype: torch.dtype
    shape: Tuple[int, ...]
    begin: int  # byte offsets into the data section
    end: int

    @property
    def numel(self) -> int:
        return numel(self.shape)


@dataclass(frozen=True)
class FileHeader:
    path: Union[Path, Location]
    tensors: Dict[str, TensorHeader]
    metadata: Dict[str, str]
    data_start: int  # 8 + header length


def read_header(path: Union[Path, Location]) -> FileHeader:
    """The safetensors header of ``path``, every entry checked against the file's size (in a
    bucket: two ranged reads, the length and then the header)."""
    if isinstance(path, Location) and path.local:
        path = path.as_path()
    bad = f"{path}: not a readable safetensors file"
    try:
        if isinstance(path, Location):
            size = path.size()
            first = path.read_range(0, min(8, size))
        else:
            size = os.stat(path).st_size
            with open(path, "rb") as f:
                first = f.read(8)
        if len(first) < 8:
            raise CheckpointError(f"{bad} ({size} bytes, shorter than a header)")
        (length,) = struct.unpack("<Q", first)
        if length > MAX_HEADER_BYTES or 8 + length > size:
            raise CheckpointError(f"{bad} (its header claims {length} bytes; the file has {size})")
        if isinstance(path, Location):
            text = path.read_range(8, 8 + length)
        else:
            with open(path, "rb") as f:
                f.seek(8)
                text = f.read(length)
    except OSError as e:
        raise CheckpointError(f"{bad} ({e})") from None
    if not text.startswith(b"{"):
        raise CheckpointError(f"{bad} (its header is not a JSON object)")
    try:
        raw = parse_json(text, str(path), "its header")
    except CheckpointError as e:
        raise CheckpointError(f"{bad} ({str(e).removeprefix(f'{path}: ')})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{bad} (its header is not a JSON object)")
    metadata = raw.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{bad} (its __metadata__ is not an object of strings)")
    tensors: Dict[str, TensorHeader] = {}
    for name, info in raw.items():
        at = f"{bad} (tensor {_short(name)}"
        if not _encodable(name) or not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise CheckpointError(f"{at}: not a tensor entry)")
        dtype = TORCH_DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
        shape, offsets = info["shape"], info["data_offsets"]
        if dtype is None:
            raise CheckpointError(f"{at}: dtype {_short(info['dtype'])} is not one this version reads)")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise CheckpointError(f"{at}: shape {_short(shape)} is not a list of sizes)")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) and o >= 0 for o in offsets):
            raise CheckpointError(f"{at}: data_offsets {_short(offsets)} are not two byte offsets)")
        if offsets[1] - offsets[0] != numel(shape) * dtype.itemsize:
            raise CheckpointError(f"{at}: {offsets[1] - offsets[0]} bytes for shape {shape} of {info['dtype']})")
        tensors[name] = TensorHeader(dtype, tuple(shape), offsets[0], offsets[1])
    end = 0
    for name, t in sorted(tensors.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if t.begin != end:
            raise CheckpointError(f"{bad} (tensor {name!r} starts at byte {t.begin} of the data, not at {end})")
        end = t.end
    if 8 + length + end != size:
        raise CheckpointError(
            f"{bad} (its header describes {8 + length + end} bytes; the file has {size}: truncated or extended)"
        )
    return FileHeader(path, tensors, dict(metadata), 8 + length)


# ---------------------------------------------------------------------------------------------
# Checksums


# Checksums are XXH3-64 (the ``xxhash`` package), written "xxh3_64:<16 hex digits>" so that the
# value names its algorithm. It hashes at ~30-60 GB/s on this 2-core machine against zlib's CRC-32
# at ~5 GB/s: a consolidation checks the 1.2 GB of a 300 M-parameter model beside its writing,
# and with CRC-32 that cost 1.4-1.9x its time whenever no core was free.
def _formatted(digest: Any) -> str:
    return f"xxh3_64:{digest.hexdigest()}"


def tensor_checksum(tensor: torch.Tensor) -> str:
    """The checksum of a CPU tensor's bytes as safetensors writes them (contiguous, row-major)."""
    flat = tensor.detach().contiguous().reshape(-1)
    digest = xxhash.xxh3_64()
    if flat.numel():
        # An ndarray is a buffer; numpy's types say so only for Python 3.12 and later.
        digest.update(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]
    return _formatted(digest)


def file_checksum(
    path: Union[Path, Location],
    start: int,
    length: int,
    buffer: Optional[bytearray] = None,
    cancelled: Callable[[], bool] = lambda: False,
) -> str:
    """The checksum of ``length`` bytes of ``path`` from ``start``, read into one reused buffer."""
    buffer = buffer if buffer is not None else bytearray(min(VERIFY_CHUNK, max(length, 1)))
    view = memoryview(buffer)
    digest = xxhash.xxh3_64()
    if isinstance(path, Location) and path.local:
        path = path.as_path()
    if isinstance(path, Location):  # in a bucket: ranged reads of at most one buffer each
        while length > 0 and not cancelled():
            n = min(len(view), length)
            digest.update(path.read_range(start, start + n))
            start, length = start + n, length - n
        return _formatted(digest)
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        while length > 0 and not cancelled():
            n = f.readinto(view[: min(len(view), length)])
            if not n:
                raise CheckpointError(f"{path}: ends {length} bytes before its last tensor does (truncated)")
            digest.update(view[:n])
            length -= n
    return _formatted(digest)


# ---------------------------------------------------------------------------------------------
# Reading


class ShardedCheckpoint:
    """A committed checkpoint directory, read lazily: tensors come from the rank files in slices.

    Opening it reads ``checkpoint.json`` and every rank file's header and metadata, and checks
    every field and that they belong together ([Note: reading untrusted checkpoints]); nothing
    else is read until asked for. Tensor bytes are checked against their checksums by
    ``verify``.
    """

    def __init__(self, directory: PathLike) -> None:
        self.directory = Location.of(directory)
        found = find_saves(self.directory)
        self.skipped = found.incomplete  # incomplete saves newer than the one read
        record = found.record
        if record is None or record.save_id is None:
            raise CheckpointError(_no_checkpoint(self.directory, found))
        if found.incomplete:
            logger.warning(
                "%s: skipping incomplete save(s) %s (no %s: a save that did not finish); reading %s",
                self.directory,
                ", ".join(found.incomplete),
                RECORD,
                record.save_id,
            )
        self.format = record.format
        self.save_id: str = record.save_id
        self.token: Optional[str] = record.token
        self.world_size: int = record.world_size
        self.files = [self.directory / f for f in record.files]
        self._check_files_present()
        self.headers: List[FileHeader] = []
        self.metas: List[RankMeta] = []
        for rank, path in enumerate(self.files):
            header, meta = self._read_meta(rank, path)
            self.headers.append(header)
            self.metas.append(meta)
        self.params: Dict[str, Tuple[GroupEntry, ParamEntry]] = {
            p.name: (g, p) for g in self.metas[0].groups for p in g.params
        }
        self.groups: Dict[str, GroupEntry] = {g.key: g for g in self.metas[0].groups}
        self._check_layout()
        self._check_sizes(record)
        self._open: Dict[int, Any] = {}

    def _check_files_present(self) -> None:
        """Every rank file is here; the missing ones are named together (on a pod without a
        shared filesystem each host holds only its ranks' files)."""
        present = set(self.directory.__truediv__(self.save_id).names())
        missing = [r for r, f in enumerate(self.files) if f.name not in present]
        if len(missing) == 1:
            r = missing[0]
            raise CheckpointError(f"{self.files[r]}: rank {r}'s file of save {self.save_id} is missing")
        if missing:
            raise CheckpointError(
                f"{self.directory}: {len(missing)} of the {self.world_size} rank files of save {self.save_id} are "
                f"missing here: ranks {_ranges(missing)} ({', '.join(self.files[r].name for r in missing[:4])}"
                f"{', ...' if len(missing) > 4 else ''}). Each host of a pod writes its own ranks' files: without a "
                "shared filesystem, save to a bucket (s3://, gs://) or copy every host's files into this folder"
            )

    def _check_sizes(self, record: Record) -> None:
        """Each file has the size its save's record lists (after its header and metadata are
        checked, which name what is wrong inside a file)."""
        for rank, size in enumerate(record.file_sizes):
            found = self.headers[rank].data_start + max(
                (t.end for t in self.headers[rank].tensors.values()), default=0
            )
            if found != size:
                raise CheckpointError(
                    f"{self.files[rank]}: not a readable safetensors file ({found} bytes, its save's record lists "
                    f"{size}: truncated or replaced)"
                )

    def _read_meta(self, rank: int, path: Location) -> Tuple[FileHeader, RankMeta]:
        header = read_header(path)
        if META_KEY not in header.metadata:
            raise CheckpointError(f"{path}: no {META_KEY} metadata; not a file of this format")
        meta = RankMeta.from_json(header.metadata[META_KEY], str(path))
        if (meta.save_id, meta.rank, meta.world_size) != (self.save_id, rank, self.world_size):
            raise CheckpointError(
                f"{path}: belongs to save {meta.save_id!r} (rank {meta.rank} of {meta.world_size}), but "
                f"{self.directory / RECORD} names save {self.save_id!r} of {self.world_size} ranks: files of "
                "different saves are mixed"
            )
        if meta.format != self.format or meta.token != self.token:
            raise CheckpointError(
                f"{path}: belongs to another run than {self.directory / RECORD} (run token {meta.token} "
                f"in the file, {self.token} in the record), though both are named {self.save_id!r}, rank "
                f"{rank} of {self.world_size}: files of different runs are mixed"
            )
        if meta.checksums is not None and set(meta.checksums) != set(header.tensors):
            odd = sorted(set(meta.checksums) ^ set(header.tensors))[0]
            which = (
                "has no checksum for its tensor"
                if odd in header.tensors
                else "lists a checksum of a tensor it does not hold,"
            )
            raise CheckpointError(f"{path}: {which} {odd!r}")
        return header, meta

    def _check_layout(self) -> None:
        """Every rank file agrees with rank 0's layout and holds the tensors its metadata lists,
        with the element counts and dtypes it says. Headers only."""
        first, first_path = self.metas[0], self.files[0]
        optim_first: Optional[Dict[str, Tuple[Tuple[int, ...], torch.dtype]]] = None
        for rank, (path, header, meta) in enumerate(zip(self.files, self.headers, self.metas)):
            if (
                meta.groups != first.groups
                or meta.buffers != first.buffers
                or _optim_layout(meta.optimizer) != _optim_layout(first.optimizer)
            ):
                raise CheckpointError(
                    f"{path}: its layout metadata differs from rank 0's ({first_path.name}): "
                    f"{_first_difference(meta, first)}"
                )
            for g in meta.groups:
                _check_tensor(path, header, f"{MODEL}/{g.key}", g.shard_numel, torch_dtype(g.dtype))
            if rank == 0:
                for name, dtype in meta.buffers.items():
                    _check_tensor(path, header, f"{BUFFER}/{name}", None, torch_dtype(dtype))
            optim = {n: (t.shape, t.dtype) for n, t in header.tensors.items() if n.startswith(f"{OPTIM}/")}
            for name in optim:
                key, _, state = name[len(OPTIM) + 1 :].rpartition("/")
                if key not in self.groups or not state:
                    raise CheckpointError(
                        f"{path}: optimizer tensor {name!r} belongs to no group of the model metadata"
                    )
            if optim_first is None:
                optim_first = optim
            for name in sorted(set(optim) ^ set(optim_first)):
                where = "has" if name in optim else "lacks"
                raise CheckpointError(
                    f"{path}: {where} optimizer tensor {name!r}, unlike rank 0's file {first_path.name}"
                )
            for name, (shape, tensor_dtype) in optim.items():
                if (shape, tensor_dtype) != optim_first[name]:
                    raise CheckpointError(
                        f"{path}: optimizer tensor {name!r} is {tensor_dtype} {list(shape)}, rank 0's is "
                        f"{optim_first[name][1]} {list(optim_first[name][0])}"
                    )

    def optimizer_meta(self, remedy: str) -> Dict[str, Any]:
        """The optimizer metadata (asked for by ``--optimizer`` / ``load_sharded``); a checkpoint
        saved without one is refused, with ``remedy`` as what to do instead."""
        saved = self.metas[0].optimizer
        if saved is None:
            raise CheckpointError(
                f"{self.directory}: saved without optimizer state (save_sharded(model, None, ...)); {remedy}"
            )
        return saved

    # -- reading -------------------------------------------------------------------------

    def file(self, rank: int) -> Any:
        if rank not in self._open:
            if not self.files[rank].local:
                self._open[rank] = RangeReader(self.files[rank], self.headers[rank])
                return self._open[rank]
            try:
                self._open[rank] = safe_open(self.files[rank].path, framework="pt")
            except Exception as e:  # noqa: BLE001 - changed since its header was checked
                raise CheckpointError(f"{self.files[rank]}: not a readable safetensors file ({e})") from None
        return self._open[rank]

    def tensor_names(self, rank: int) -> List[str]:
        return list(self.headers[rank].tensors)

    def tensor_header(self, rank: int, name: str) -> TensorHeader:
        return self.headers[rank].tensors[name]

    def read_range(
        self, group: GroupEntry, start: int, stop: int, prefix: str = MODEL, state: str = ""
    ) -> torch.Tensor:
        """Elements ``[start, stop)`` of ``group``'s virtual full tensor (1-D, CPU), reading only
        the slices of the rank files that hold them. ``prefix``/``state`` pick the model or an
        optimizer state tensor of the same layout."""
        pieces = self.read_pieces(group, start, stop, prefix, state)
        return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch_dtype(group.dtype))

    def read_pieces(
        self, group: GroupEntry, start: int, stop: int, prefix: str = MODEL, state: str = ""
    ) -> List[torch.Tensor]:
        """``read_range`` as one piece per rank file, not copied: views into the files' memory maps
        (valid after ``close``, which only drops this object's references)."""
        key = f"{prefix}/{group.key}" + (f"/{state}" if state else "")
        size = group.shard_numel
        if stop <= start or size == 0:
            return []
        pieces = []
        for rank in range(start // size, (stop - 1) // size + 1):
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
        header = self.headers[0].tensors[f"{BUFFER}/{name}"]
        return header.shape, header.dtype

    def read_buffer(self, name: str) -> torch.Tensor:
        return _get_tensor(self.file(0), f"{BUFFER}/{name}", str(self.files[0]))

    def read_whole(self, rank: int, name: str) -> torch.Tensor:
        return _get_tensor(self.file(rank), name, str(self.files[rank]))

    def close(self) -> None:
        """Drop the open files. Each is a memory map, and every page read through it counts in
        this process's resident memory until it is unmapped; the next read opens the file again."""
        self._open.clear()

    # -- checksums -----------------------------------------------------------------------

    def verify(
        self, rank: int, names: Optional[Iterable[str]] = None, cancelled: Callable[[], bool] = lambda: False
    ) -> int:
        """Check the bytes of rank ``rank``'s tensors ``names`` (all by default) against the
        checksums in its metadata; returns the bytes read. Format 1 files have none: nothing is read."""
        meta, header, path = self.metas[rank], self.headers[rank], self.files[rank]
        if meta.checksums is None:
            return 0
        buffer = bytearray(VERIFY_CHUNK)
        read = 0
        for name in header.tensors if names is None else names:
            t = header.tensors[name]
            saved = meta.checksums[name]
            found = file_checksum(path, header.data_start + t.begin, t.end - t.begin, buffer, cancelled)
            if cancelled():
                return read
            if found != saved:
                raise CheckpointError(
                    f"{path}: the bytes of tensor {name!r} do not match the checksum in its metadata "
                    f"({found}, saved {saved}): the file is corrupt"
                )
            read += t.end - t.begin
        return read


def _check_tensor(path: Location, header: FileHeader, key: str, count: Optional[int], dtype: torch.dtype) -> None:
    if key not in header.tensors:
        raise CheckpointError(f"{path}: has no tensor {key!r}, which its metadata lists")
    t = header.tensors[key]
    if count is not None and t.numel != count:
        raise CheckpointError(
            f"{path}: tensor {key!r} has {t.numel} elements (shape {list(t.shape)}); its metadata says {count}"
        )
    if t.dtype != dtype:
        raise CheckpointError(f"{path}: tensor {key!r} is {SAFETENSORS_DTYPES[t.dtype]}; its metadata says {dtype}")


def _optim_layout(optim: Optional[Dict[str, Any]]) -> Any:
    return None if optim is None else (optim.get("type"), optim.get("param_groups"))


def _first_difference(meta: RankMeta, first: RankMeta) -> str:
    theirs = {g.key: g for g in first.groups}
    for g in meta.groups:
        if g.key not in theirs:
            return f"group {g.key!r} is not in rank 0's"
        if g != theirs[g.key]:
            return f"group {g.key!r} differs"
    if len(meta.groups) != len(first.groups):
        return f"{len(meta.groups)} groups, rank 0's has {len(first.groups)}"
    if meta.buffers != first.buffers:
        return "its buffers differ"
    return "its optimizer metadata differs"


def _get_tensor(f: Any, key: str, where: str) -> torch.Tensor:
    try:
        return f.get_tensor(key)
    except Exception as e:  # noqa: BLE001 - safetensors' own error types
        raise CheckpointError(f"{where}: tensor {key!r} cannot be read ({e})") from None


def read_flat_slice(f: Any, key: str, lo: int, hi: int, where: str) -> torch.Tensor:
    """Elements ``[lo, hi)`` of tensor ``key`` flattened, reading whole rows only where needed."""
    try:
        sliced = f.get_slice(key)
    except Exception:  # noqa: BLE001 - safetensors' own error types
        raise CheckpointError(f"{where}: has no tensor {key!r}") from None
    shape = sliced.get_shape()
    if not shape:
        return sliced[:].reshape(-1)[lo:hi]
    row = numel(shape[1:])
    if row == 0 or hi <= lo:
        return _get_tensor(f, key, where).reshape(-1)[lo:hi]
    first, last = lo // row, -(-hi // row)
    rows = sliced[first:last].reshape(-1)
    return rows[lo - first * row : hi - first * row]


def _no_checkpoint(directory: Location, found: SaveState) -> str:
    if found.incomplete:
        return (
            f"{directory}: no complete checkpoint: {', '.join(found.incomplete)} did not finish (no {RECORD} "
            "in it); the next save removes what it wrote"
        )
    return f"{directory}: no {RECORD}, so no complete checkpoint (a save that did not finish leaves none)"


def _ranges(numbers: List[int]) -> str:
    """[0, 1, 2, 5] as "0-2, 5"."""
    out, start = [], None
    for i, n in enumerate(numbers):
        if start is None:
            start = n
        if i + 1 == len(numbers) or numbers[i + 1] != n + 1:
            out.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ", ".join(out)


class RangeReader:
    """The two reading calls of ``safe_open`` that ``ShardedCheckpoint`` uses, for a file in a
    bucket: every tensor, or run of rows of one, is one ranged read of just its bytes."""

    def __init__(self, location: Location, header: FileHeader) -> None:
        self.location, self.header = location, header

    def get_tensor(self, key: str) -> torch.Tensor:
        return self.get_slice(key)[:]

    def get_slice(self, key: str) -> _RangeSlice:
        if key not in self.header.tensors:
            raise KeyError(key)
        return _RangeSlice(self, self.header.tensors[key])


class _RangeSlice:
    def __init__(self, reader: RangeReader, tensor: TensorHeader) -> None:
        self.reader, self.tensor = reader, tensor

    def get_shape(self) -> List[int]:
        return list(self.tensor.shape)

    def __getitem__(self, rows: slice) -> torch.Tensor:
        t = self.tensor
        if not t.shape:
            first, last, row_bytes = 0, 1, t.end - t.begin
        else:
            first, last, _ = rows.indices(t.shape[0])
            last = max(first, last)
            row_bytes = numel(t.shape[1:]) * t.dtype.itemsize
        start = self.reader.header.data_start + t.begin + first * row_bytes
        data = self.reader.location.read_range(start, start + (last - first) * row_bytes)
        flat = torch.frombuffer(bytearray(data), dtype=t.dtype) if data else torch.empty(0, dtype=t.dtype)
        return flat.reshape((last - first, *t.shape[1:]) if t.shape else ())
