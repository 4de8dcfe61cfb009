"""``accelerator.unwrap_model(model).save_pretrained(dir, is_main_process=...)``: the whole model
written as it is gathered, by the writing replica only.

[Note: saves written as gathered]
Every replica calls it (the stock scripts do, and the gathers need them all). When one replica
writes a transformers model the stock way (``PreTrainedModel.save_pretrained`` itself, no state
dict given, no adapters, no quantizer), nothing is gathered while transformers lays out the
files: ``state_dict()`` gives the writing replica an empty host tensor standing in for each
parameter (never written to, so no memory behind it is touched) and the others an empty dict
(state_dict.values_deferred), and transformers' safetensors writer (``safe_save_file`` in
``transformers.modeling_utils``, patched: xla_cpu/patches.py) writes each file's header and
buffers and leaves a hole for each parameter's bytes. Then every replica gathers the model a
piece at a time (state_dict.stream_params) and the writing one writes each piece into its hole
at once: it holds one program's pieces, never the model (issue 27: holding it was 1.2 M above the
live state). The files are byte for byte what safetensors writes from the full state dict.

Any other save (PEFT's save_pretrained, a model's own, one given a state dict, every replica
writing) gets the state dict streamed into host tensors on the writing replicas only
([Note: streamed full state dicts]); so does a save whose files would hold a tensor that is
neither a stand-in nor a buffer (a weight conversion made it from stand-ins): it is done again
that way. Freed memory goes back to the system once the files are written (host_memory.py).
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import struct
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .. import host_memory
from ..checkpoint.errors import CheckpointError
from ..checkpoint.format import SAFETENSORS_DTYPES
from ..checkpoint.sharded import sum_over_replicas
from ..fsdp import WHOLE_MODEL_STATE_DICT, XlaFullyShardedDataParallel
from ..state_dict import StandIns, kept_on_this_replica, stream_params, values_deferred
from ..xla_cpu.rendezvous import agree

# safetensors' order of dtypes in a file, first to last (larger elements first, so that every
# tensor starts aligned; measured with safetensors 0.8): tensors go by it, then by name.
SAFETENSORS_ORDER = "U64 I64 F64 F32 U32 I32 BF16 F16 U16 I16 F8_E4M3 F8_E5M2 I8 U8 BOOL".split()

_writing = threading.local()  # .files: the GatheredFiles of this replica's save, while transformers lays it out


def route_save_pretrained(wrapper: XlaFullyShardedDataParallel) -> None:
    """Give the root ``wrapper``'s module (if its class has ``save_pretrained``) one that writes
    the model as it is gathered, or else keeps the state dict only where it is written."""
    inner = wrapper.module
    own = getattr(type(inner), "save_pretrained", None)
    if own is None:
        return
    signature = inspect.signature(own)

    @functools.wraps(own)
    def save_pretrained(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(inner, *args, **kwargs)
        writes = bool(bound.arguments.get("is_main_process", True))
        try:
            if _stock_save(inner, own, bound.arguments):
                agree(WHOLE_MODEL_STATE_DICT)  # every replica is here (else a clear error), before a collective
                if sum_over_replicas([int(writes)])[0] == 1:
                    done, result = _written_as_gathered(wrapper, writes, lambda: own(inner, *args, **kwargs))
                    if done:
                        return result
            with kept_on_this_replica(writes):
                return own(inner, *args, **kwargs)
        finally:
            host_memory.give_back()

    inner.save_pretrained = save_pretrained  # type: ignore[assignment]  # per instance, over the class's method


def _stock_save(inner: Any, own: Any, arguments: Dict[str, Any]) -> bool:
    """transformers' own ``save_pretrained``, asked for the model's state dict (the same answer
    on every replica)."""
    from transformers import PreTrainedModel

    return (
        own is PreTrainedModel.save_pretrained
        and arguments.get("state_dict") is None
        and not arguments.get("distributed_checkpoint", False)
        and not arguments.get("push_to_hub", False)  # it uploads the files before their holes are filled
        and not getattr(inner, "_hf_peft_config_loaded", False)
        and getattr(inner, "hf_quantizer", None) is None
    )


class _NotStandIns(Exception):
    """A file would hold a tensor made from stand-ins: the save is done again, gathered first."""


def _written_as_gathered(
    wrapper: XlaFullyShardedDataParallel, writes: bool, save: Callable[[], Any]
) -> Tuple[bool, Any]:
    """Run ``save`` with stand-ins, then gather the model into the files' holes; every replica.
    Returns (done, what ``save`` returned); not done: the files need a tensor that is not a
    stand-in, and the caller saves again the usual way."""
    files = GatheredFiles() if writes else None
    error: Optional[BaseException] = None
    result = None
    redo = False
    _writing.files = files
    try:
        with kept_on_this_replica(writes), values_deferred(files.stand_ins if files else StandIns()):
            result = save()
    except _NotStandIns:
        redo = True
    except Exception as e:  # noqa: BLE001 - every replica must hear of it
        error = e
    finally:
        _writing.files = None
    failed, again = sum_over_replicas([int(error is not None), int(redo)])
    if failed or again:
        if files is not None:
            files.close()
        if error is not None:
            raise error
        if failed:
            raise CheckpointError(
                "save_pretrained: the writing process could not lay out the files (its error says why)"
            )
        return False, None
    stream_params(wrapper.unit_state, files.write if files else None)
    if files is not None:
        files.finish()
    failed = sum_over_replicas([int(files is not None and files.error is not None)])[0]
    if files is not None and files.error is not None:
        raise files.error
    if failed:
        raise CheckpointError("save_pretrained: the writing process could not write the files (its error says why)")
    return True, result


class GatheredFiles:
    """The files of one save written as the model is gathered: their holes, by parameter name."""

    def __init__(self) -> None:
        self.stand_ins = StandIns()
        self.holes: Dict[str, Tuple[int, int, int]] = {}  # name -> (file descriptor, offset, bytes)
        self.fds: List[int] = []
        self.left = 0  # bytes of holes not written yet
        self.error: Optional[BaseException] = None

    def lay_out(self, tensors: Dict[str, torch.Tensor], filename: Any, metadata: Optional[Dict[str, str]]) -> None:
        """What transformers' ``safe_save_file(tensors, filename, metadata)`` writes, with a hole
        for each stand-in (the file has its full size; the holes hold no blocks yet)."""
        kinds = {name: self._kind(name, t) for name, t in tensors.items()}
        order = sorted(tensors, key=lambda n: (SAFETENSORS_ORDER.index(SAFETENSORS_DTYPES[tensors[n].dtype]), n))
        header: Dict[str, Any] = {} if metadata is None else {"__metadata__": metadata}
        offset = 0
        for name in order:
            t = tensors[name]
            nbytes = t.numel() * t.element_size()
            header[name] = {
                "dtype": SAFETENSORS_DTYPES[t.dtype],
                "shape": list(t.shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        start = 8 + len(raw)
        fd = os.open(os.fspath(filename), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        self.fds.append(fd)
        _write_at(fd, struct.pack("<Q", len(raw)) + raw, 0)
        for name in order:
            t = tensors[name]
            begin, end = header[name]["data_offsets"]
            if kinds[name] == "stand-in":
                self.holes[name] = (fd, start + begin, end - begin)
                self.left += end - begin
            elif end > begin:
                _write_at(fd, t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data, start + begin)
        os.ftruncate(fd, start + offset)

    def _kind(self, name: str, tensor: torch.Tensor) -> str:
        ptr = tensor.data_ptr()
        stand_in = self.stand_ins.params.get(ptr)
        if stand_in is not None and stand_in[1:] == (tensor.numel(), tensor.dtype) and tensor.is_contiguous():
            return "stand-in"
        if ptr in self.stand_ins.buffers:
            return "value"
        raise _NotStandIns(name)

    def write(self, names: Tuple[str, ...], first: int, values: torch.Tensor) -> None:
        """Write a gathered piece of a parameter (elements from ``first``) into its hole."""
        if self.error is not None:
            return  # the gathers go on (every replica takes part); the error is raised after
        data = values.contiguous().view(torch.uint8).numpy().data
        try:
            for name in names:
                if name in self.holes:
                    fd, offset, _ = self.holes[name]
                    _write_at(fd, data, offset + first * values.element_size())
                    self.left -= len(data)
        except OSError as e:
            self.error = e

    def finish(self) -> None:
        self.close()
        if self.error is None and self.left:
            self.error = CheckpointError(f"save_pretrained: {self.left} bytes of parameters were not written")

    def close(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError as e:
                self.error = self.error or e
        self.fds.clear()


def _write_at(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def written_as_gathered(original: Callable[..., Any]) -> Callable[..., Any]:
    """transformers' ``safe_save_file``: within a save written as gathered, the file laid out
    with holes for the stand-ins (``GatheredFiles.lay_out``); otherwise itself."""

    @functools.wraps(original)
    def safe_save_file(
        tensors: Dict[str, torch.Tensor], filename: Any, metadata: Optional[Dict[str, str]] = None
    ) -> Any:
        files: Optional[GatheredFiles] = getattr(_writing, "files", None)
        if files is None:
            return original(tensors, filename, metadata=metadata)
        files.lay_out(tensors, filename, metadata)
        return None

    return safe_save_file
