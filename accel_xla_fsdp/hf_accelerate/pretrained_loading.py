"""``from_pretrained`` in replica threads, and pretrained models that are never whole in host memory.

Importing the Accelerate room patches ``transformers``' ``PreTrainedModel.from_pretrained`` (and
``_from_config``, which ``AutoModel*.from_config`` calls) twice over (the patch table,
``xla_cpu/patches.py``, installs them):

* Every call takes one process-wide lock (``xla_cpu/seeds.py``'s ``BUILDING``) and draws from the replica
  thread's own seed (xla_cpu/seeds.py). transformers 5 builds models inside process-wide contexts
  (the meta device, "do not tie weights yet"); on XLA:CPU the replicas are threads of one process,
  and four threads loading a tied-embedding model at once left ``lm_head.weight`` on the meta
  device, every time (measured). On a TPU (one process per chip) the lock is never contended.
* With ``fsdp_cpu_ram_efficient_loading`` on (Accelerate's key, ``FSDP_CPU_RAM_EFFICIENT_LOADING``),
  ``from_pretrained`` builds the model on the meta device as usual and then reads nothing: it
  remembers which safetensors file holds each parameter, by parameter object (so the names may
  change afterwards: a PEFT wrapping adds ``base_model.model.`` and ``.base_layer``). Parameters
  the files lack (a new classification head) are initialized by ``transformers`` as usual, buffers
  are computed (rotary ``inv_freq``) or read whole (persistent ones). ``Accelerator.prepare`` then
  shards the model with ``take_shard_source(model)`` as ``param_init_fn``: each replica reads only its
  slices of the files (``checkpoint/pretrained.py``). Until ``prepare`` the model's weights are on
  the meta device: it can be modified (frozen, given new modules with real values) but not run.
  A PEFT adapter added to it keeps its initial values (see the note on PEFT below); other
  modules added on the meta device are refused by ``prepare``, by name.

Accelerate's own path for this key (FSDP on GPUs) loads the whole model on rank 0 and broadcasts
it; here no replica holds it whole, and replicas that are threads share the one host.
"""

from __future__ import annotations

import re
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from ..checkpoint.pretrained import PretrainedWeights
from ..xla_cpu import patches, seeds
from ..xla_cpu.rendezvous import broadcast_from_rank0_, replicas_are_threads
from .plugin import configured

if TYPE_CHECKING:
    from transformers import PreTrainedModel

_deferring = threading.local()
# The models loaded with the key on, and the files of each (a wrapping model finds them through
# its modules: a PEFT model holds the loaded one).
_LOADED: "weakref.WeakKeyDictionary[nn.Module, Tuple[PretrainedWeights, RemovableHandle]]" = (
    weakref.WeakKeyDictionary()
)
_prepared = threading.local()  # this replica prepared a model: later loads are not deferred
_UNSUPPORTED_ARGUMENTS = (
    "device_map",
    "quantization_config",
    "gguf_file",
    "state_dict",
    "tp_plan",
    "distributed_config",
)


def take_shard_source(model: nn.Module) -> Optional[PretrainedWeights]:
    """For ``prepare()``: the weight files of ``model`` (or of the model inside it) if it was
    loaded with ``fsdp_cpu_ram_efficient_loading``, as the ``param_init_fn`` that fills its shards;
    else None. From now on this replica's ``from_pretrained`` loads as usual (a model loaded
    after training, to evaluate it on the CPU, is not prepared)."""
    _prepared.done = True
    loaded = [m for m in model.modules() if m in _LOADED]
    sources = {id(_LOADED[m][0]): _LOADED[m][0] for m in loaded}
    if len(sources) > 1:
        raise ValueError(
            "prepare(): this model holds several models loaded with fsdp_cpu_ram_efficient_loading; prepare "
            "each on its own, or load them with the key off"
        )
    for m in loaded:
        _LOADED.pop(m)[1].remove()  # its forward is FSDP's from now on
    source = next(iter(sources.values()), None)
    if source is not None:
        _restore_peft_adapters(model)
        source.remember_names(model)  # as it is now: wrapped, with new modules
        _refuse_valueless_parameters(model, source)
        _refuse_reshaped_parameters(model, source)
    return source


def _refuse_reshaped_parameters(model: nn.Module, source: PretrainedWeights) -> None:
    """Parameters whose shape changed after loading (``resize_token_embeddings``): their values
    would have to come partly from the files, partly from an initialization."""
    shapes = source.stored_shapes()
    for name, param in model.named_parameters():
        stored = source.stored_name(param)
        if param.is_meta and stored is not None and shapes[stored] != tuple(param.shape):
            raise ValueError(
                f"prepare(): {name!r} has shape {list(param.shape)}, but {source.folder} stores {stored!r} as "
                f"{list(shapes[stored])}: the model was changed after from_pretrained (resize_token_embeddings?). "
                "With fsdp_cpu_ram_efficient_loading the weights are read from the files as they are: load the model "
                "with the key off (FSDP_CPU_RAM_EFFICIENT_LOADING=false) to resize it"
            )


def _refuse_valueless_parameters(model: nn.Module, source: PretrainedWeights) -> None:
    """Parameters added after loading on the meta device, which the files do not hold either
    (a PEFT version that places adapters otherwise than the note above expects)."""
    valueless = source.unstored_meta_parameters(model)
    if valueless:
        raise ValueError(
            f"prepare(): {valueless[0]!r} (and {len(valueless) - 1} more) was added to a model loaded with "
            "fsdp_cpu_ram_efficient_loading, on the meta device, where it has no values, and the weight files do not "
            "hold it. Build new modules with real values (on the CPU) before prepare(), or load the model with "
            "fsdp_cpu_ram_efficient_loading off (FSDP_CPU_RAM_EFFICIENT_LOADING=false)"
        )


def share_rank0_real_tensors(model: nn.Module, device: torch.device) -> None:
    """``sync_module_states`` for a model loaded with the key on: rank 0's values of the tensors
    that hold values (parameters the files lack, buffers); the others come from the files."""
    real = [t for t in [*model.parameters(), *model.buffers()] if not t.is_meta]
    if not replicas_are_threads():
        for t in real:  # torch_xla's broadcast runs on the device
            t.data = t.data.to(device)
    broadcast_from_rank0_(real)


# ---------------------------------------------------------------------------------------------
# The patches


def locked_from_config(found: classmethod) -> classmethod:
    """The patch of ``PreTrainedModel._from_config`` (patches.py): built under the lock, from the
    replica thread's own seed."""
    original = found.__func__

    def locked(cls: type, *args: Any, **kwargs: Any) -> Any:
        with seeds.thread_generator():
            return original(cls, *args, **kwargs)

    locked.__doc__ = original.__doc__
    return classmethod(locked)


@dataclass
class _Deferral:
    """One ``from_pretrained`` call that reads no weights; ``source`` is what it found."""

    source: Optional[PretrainedWeights] = None


def locked_from_pretrained(found: classmethod) -> classmethod:
    """The patch of ``PreTrainedModel.from_pretrained`` (patches.py): built under the lock, from
    the replica thread's own seed; with ``fsdp_cpu_ram_efficient_loading``, deferred."""
    original = found.__func__

    def from_pretrained(cls: type, *args: Any, **kwargs: Any) -> Any:
        with seeds.thread_generator():
            if getattr(_prepared, "done", False) or not configured("cpu_ram_efficient_loading"):
                return original(cls, *args, **kwargs)
            return _load_deferred(original, cls, args, kwargs)

    from_pretrained.__doc__ = original.__doc__
    return classmethod(from_pretrained)


def _load_deferred(original: Callable[..., Any], cls: type, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    _refuse_unsupported(kwargs)
    outer, _deferring.call = getattr(_deferring, "call", None), _Deferral()  # a load inside a load keeps its own
    try:
        loaded = original(cls, *args, **kwargs)
        source = _deferring.call.source
    finally:
        _deferring.call = outer
    model = loaded[0] if isinstance(loaded, tuple) else loaded
    if source is not None:
        patches.install(patches.Stage.PEFT_LOAD)  # PEFT, if installed: see the note on PEFT below
        source.remember_names(model)  # tied now: the head is the embedding
        _LOADED[model] = (source, model.register_forward_pre_hook(_refuse_unprepared_forward))
    return loaded


# [Note: PEFT adapters on a model loaded into shards]
# PEFT initializes an adapter (LoRA's A at random, B at zero) on the CPU, then moves it to its
# base layer's device: the meta device here, where its values are lost. So the moment before
# that move, the adapter's values are kept (``_ADAPTER_VALUES``), and ``prepare()`` puts them
# back in place of the meta parameters (new objects: a meta tensor cannot take real data; an
# optimizer built on the old ones is mapped onto the shards by name, as always). Every replica
# then takes rank 0's values (``fsdp_sync_module_states``), as with any parameter the files lack.
_ADAPTER_VALUES: "weakref.WeakKeyDictionary[nn.Module, Dict[str, torch.Tensor]]" = weakref.WeakKeyDictionary()


def remembering_adapters(original: Callable[..., None]) -> Callable[..., None]:
    """The patch of PEFT's ``BaseTunerLayer._move_adapter_to_device_of_base_layer`` (patches.py;
    see the note above)."""

    def move_adapter(layer: Any, adapter_name: str, *args: Any, **kwargs: Any) -> None:
        if _waits_for_prepare(getattr(layer.get_base_layer(), "weight", None)):
            kinds = (*layer.adapter_layer_names, *layer.other_param_names)
            adapter = [(n, p) for n, p in layer.named_parameters() if n.split(".")[0] in kinds and not p.is_meta]
            _ADAPTER_VALUES.setdefault(layer, {}).update({n: p.detach().clone() for n, p in adapter})
        return original(layer, adapter_name, *args, **kwargs)

    move_adapter.__doc__ = original.__doc__
    return move_adapter


def _waits_for_prepare(weight: Optional[torch.Tensor]) -> bool:
    """A weight left on the meta device by this loading (which flags it initialized)."""
    return weight is not None and weight.is_meta and getattr(weight, "_is_hf_initialized", False)


def _restore_peft_adapters(model: nn.Module) -> None:
    for layer in model.modules():
        for name, value in _ADAPTER_VALUES.pop(layer, {}).items():
            owner_name, _, attr = name.rpartition(".")
            owner = layer.get_submodule(owner_name)
            old = owner._parameters.get(attr)
            if old is not None and old.is_meta and old.shape == value.shape:
                owner._parameters[attr] = nn.Parameter(value.to(old.dtype), requires_grad=old.requires_grad)


def _refuse_unprepared_forward(module: nn.Module, args: Any) -> None:
    raise RuntimeError(
        f"this {type(module).__name__} was loaded with fsdp_cpu_ram_efficient_loading: its weights are on the meta "
        "device until accelerator.prepare(model) reads them from the files into shards. Prepare it before running "
        "it, or load it with the key off (FSDP_CPU_RAM_EFFICIENT_LOADING=false) to use it unprepared"
    )


def _refuse_unsupported(kwargs: Dict[str, Any]) -> None:
    if kwargs.get("device_map") == "auto":
        # "place it where it fits", which prepare() does: TRL's create_model_from_path asks for it off the CPU.
        kwargs["device_map"] = None
    given = [name for name in _UNSUPPORTED_ARGUMENTS if kwargs.get(name) is not None]
    if given:
        raise ValueError(
            f"from_pretrained({given[0]}=...) with fsdp_cpu_ram_efficient_loading: the model is loaded straight "
            f"into FSDP shards by prepare(), which does not take {given[0]}. Drop the argument, or turn "
            "fsdp_cpu_ram_efficient_loading off (FSDP_CPU_RAM_EFFICIENT_LOADING=false) for this model"
        )


def deferred_or(found: staticmethod) -> staticmethod:
    """The patch of ``PreTrainedModel._load_pretrained_model`` (patches.py): inside a deferred
    ``from_pretrained``, the files remembered and nothing read."""
    original = found.__func__

    def load(
        model: PreTrainedModel, state_dict: Any, checkpoint_files: Any, load_config: Any, *args: Any, **kwargs: Any
    ) -> Any:
        call = getattr(_deferring, "call", None)
        if call is None:
            return original(model, state_dict, checkpoint_files, load_config, *args, **kwargs)
        info, call.source = _remember_files(model, checkpoint_files, load_config)
        return info, None

    return staticmethod(load)


def _remember_files(
    model: PreTrainedModel, checkpoint_files: Optional[List[str]], load_config: Any
) -> Tuple[Any, PretrainedWeights]:
    """The ``LoadStateDictInfo`` that ``_load_pretrained_model`` returns, having read nothing but
    the files' headers and the buffers they store, and the files, for ``prepare``."""
    from transformers.utils.loading_report import LoadStateDictInfo

    if not checkpoint_files:
        raise ValueError("fsdp_cpu_ram_efficient_loading: from_pretrained found no weight files to load from")
    folder = Path(checkpoint_files[0]).parent
    source = PretrainedWeights(folder, files=checkpoint_files)
    stored = set(source.stored_names())
    expected = set(model.state_dict().keys())
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    missing, unexpected = expected - stored - tied, stored - expected
    _refuse_renamed_weights(model, folder, missing, unexpected, load_config)
    _check_shapes(source, model, expected & stored)
    for name in expected & stored:
        tensor = model.get_parameter_or_buffer(name)
        if isinstance(tensor, nn.Parameter):
            # transformers' own mark of a loaded parameter, set on the fly (no declared attribute).
            tensor._is_hf_initialized = True  # type: ignore[attr-defined]  # stays on meta: prepare() reads its shards
        else:
            _set_buffer(model, name, source.read_whole(name, tensor))
    info = LoadStateDictInfo(
        missing_keys=missing,
        unexpected_keys=unexpected,
        mismatched_keys=set(),
        error_msgs=[],
        conversion_errors={},
        skipped_pp_keys=set(),
    )
    return info, source


def _refuse_renamed_weights(
    model: nn.Module, folder: Path, missing: Set[str], unexpected: Set[str], load_config: Any
) -> None:
    """Weights stored under other names than the model's, which transformers renames while
    loading (a legacy layout, the base model's prefix): prepare() reads tensors by name, and the
    renamed ones would keep random initial values. Weights the files lack and do not rename (a
    new head) are initialized by transformers, as when loading normally."""
    prefix = getattr(model, "base_model_prefix", "")
    for name in sorted(missing):
        stored = f"{prefix}.{name}" if f"{prefix}.{name}" in unexpected else name.removeprefix(f"{prefix}.")
        if prefix and stored in unexpected:
            _refuse_renamed(folder, stored, name)
    transforms = getattr(load_config, "weight_mapping", None) or []
    patterns = [re.compile(p) for t in transforms for p in getattr(t, "source_patterns", [])]
    for name in sorted(unexpected):
        if any(p.search(name) for p in patterns):
            _refuse_renamed(folder, name, "another name")


def _refuse_renamed(folder: Path, stored: str, name: str) -> None:
    raise ValueError(
        f"fsdp_cpu_ram_efficient_loading: {folder} stores {stored!r}, which transformers loads as {name} (it "
        "converts this checkpoint while loading), and prepare() reads the files' tensors by the model's names. "
        "Re-save the model with save_pretrained() after loading it normally, or turn fsdp_cpu_ram_efficient_loading "
        "off"
    )


def _check_shapes(source: PretrainedWeights, model: PreTrainedModel, names: Iterable[str]) -> None:
    shapes = source.stored_shapes()
    for name in sorted(names):
        want = tuple(model.get_parameter_or_buffer(name).shape)
        if shapes[name] != want:
            raise ValueError(
                f"fsdp_cpu_ram_efficient_loading: {source.folder}: tensor {name!r} has shape {list(shapes[name])}, "
                f"the model's {list(want)}; load with the config the weights were saved with"
            )


def _set_buffer(model: nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    owner._buffers[attr] = value


__all__: Tuple[str, ...] = ("take_shard_source", "share_rank0_real_tensors")
