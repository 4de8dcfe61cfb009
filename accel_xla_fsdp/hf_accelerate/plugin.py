"""``XlaFsdpPlugin``: every XLA FSDP setting an Accelerate run takes, and where it comes from.

A setting is read, first to last, from: the plugin's constructor (code), its environment
variable, the ``fsdp_config`` section of the ``accelerate launch`` config file, its default.
Settings that mean what one of Accelerate's FSDP keys means use that key (``fsdp_auto_wrap_policy``,
``fsdp_transformer_layer_cls_to_wrap``, ...) and Accelerate's environment variable; the engine's
other options (the ``FsdpOptions`` table in options.py) are ``xla_fsdp_<option>`` /
``XLA_FSDP_<OPTION>``. ``XlaFsdpPlugin`` is a plain typed dataclass: Accelerate's wrap settings,
then one field per configurable engine option, whose key, default, help and parser come from
its ``FsdpOptions`` field (tests/test_structure.py checks that the two agree).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from .. import _xla
from ..checkpointing import checkpoint_module
from ..construction import FlatShardKey, ParamInitFn, ShardSource
from ..fsdp import XlaFullyShardedDataParallel
from ..options import FsdpOptions, argument_name, sharing_options
from ..wrap import Policy, size_policy, transformer_block_policy

# Set by the launcher process of ``accelerate launch`` (launch.py) for the replicas it starts.
CONFIG_FILE_ENV = "ACCEL_XLA_FSDP_CONFIG_FILE"
# Set with it, to the same path, when the launcher has put that file's ``fsdp_config`` into the
# settings' environment variables (``settings_environment``): the replicas need not read the file.
CONFIG_EXPORTED_ENV = "ACCEL_XLA_FSDP_CONFIG_EXPORTED"


@dataclass(frozen=True)
class Setting:
    """One plugin field: its config key, environment variable, default, help and parser (a
    field's ``metadata["setting"]``)."""

    name: str
    key: str
    env: str
    default: Any
    help: str
    parse: Callable[[str, Any], Any]


def parse_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise ValueError(f"{key}: expected true or false, got {value!r}")


def parse_int(key: str, value: Any) -> int:
    try:
        return int(float(value))
    except (TypeError, ValueError):
        raise ValueError(f"{key}: expected a whole number, got {value!r}") from None


def parse_percent(key: str, value: Any) -> int:
    percent = parse_int(key, value)
    if not 1 <= percent <= 100:
        raise ValueError(f"{key}: expected a percentage from 1 to 100, got {value!r}")
    return percent


def parse_float(key: str, value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key}: expected a number, got {value!r}") from None


def parse_dtype(key: str, value: Any) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, str(value).strip().replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{key}: expected a dtype such as bfloat16 or float32, got {value!r}")
    return dtype


def parse_class_names(key: str, value: Any) -> Tuple[str, ...]:
    given = value.split(",") if isinstance(value, str) else list(value)
    names = tuple(str(n).strip() for n in given if str(n).strip())
    if not names:
        raise ValueError(f"{key}: expected one or more class names (comma-separated), got {value!r}")
    return names


WRAP_POLICIES = ("transformer_based_wrap", "size_based_wrap", "no_wrap")


def parse_wrap_policy(key: str, value: Any) -> Any:
    if callable(value):
        return value
    policy = str(value).strip().lower()
    if policy not in WRAP_POLICIES:
        raise ValueError(
            f"{key}: expected one of {[p.upper() for p in WRAP_POLICIES]} or a policy callable, got {value!r}"
        )
    return policy


def parse_reshard(key: str, value: Any) -> bool:
    """A bool (FSDP2's form), or FSDP1's sharding strategy names that mean one."""
    strategies = {"full_shard": True, "1": True, "shard_grad_op": False, "2": False}
    text = str(value).strip().lower()
    if text in strategies:
        return strategies[text]
    if text in ("no_shard", "3", "hybrid_shard", "4", "hybrid_shard_zero2", "5"):
        raise ValueError(
            f"{key}: {value!r} is not offered by XLA FSDP; use FULL_SHARD (true) or SHARD_GRAD_OP (false)"
        )
    return parse_bool(key, value)


def parse_prefetch(key: str, value: Any) -> bool:
    if isinstance(value, bool) or value is None:
        return bool(value)
    text = str(value).strip().lower()
    if text in ("backward_pre", "true", "1"):
        return True
    if text in ("no_prefetch", "none", "false", "0"):
        return False
    raise ValueError(f"{key}: {value!r} is not offered by XLA FSDP; use BACKWARD_PRE or NO_PREFETCH")


STATE_DICT_TYPES = ("sharded_state_dict", "full_state_dict")


def parse_state_dict_type(key: str, value: Any) -> str:
    text = str(value).strip().lower()
    if text not in STATE_DICT_TYPES:
        raise ValueError(f"{key}: expected one of {[t.upper() for t in STATE_DICT_TYPES]}, got {value!r}")
    return text


def _setting(key: str, env: str, default: Any, help: str, parse: Callable[[str, Any], Any]) -> Any:
    """A plugin field that is one of Accelerate's FSDP settings (its key and variable)."""
    return field(default=None, metadata={"setting": Setting("", key, env, default, help, parse)})


# The engine's options an Accelerate run sets some other way: the compute dtype from
# ``mixed_precision``, the sharding groups (a per-replica position) in code only.
NOT_CONFIGURABLE = ("compute_dtype", "sharding_groups", "sharding_rank", "sharding_world_size")
_OPTION_FIELDS = {f.name: f for f in fields(FsdpOptions)}
_OPTION_TYPES = typing.get_type_hints(FsdpOptions)
_TYPE_PARSERS: Dict[type, Callable[[str, Any], Any]] = {
    bool: parse_bool,
    int: parse_int,
    float: parse_float,
    torch.dtype: parse_dtype,
}


def value_type(annotation: Any) -> Any:
    """``T`` of ``Optional[T]`` (``annotation`` itself if not optional)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if typing.get_origin(annotation) is typing.Union and len(args) == 1 else annotation


def _option(name: str, parse: Optional[Callable[[str, Any], Any]] = None) -> Any:
    """A plugin field that is the engine's option ``name`` (``FsdpOptions``): its help, its
    Accelerate key or ``xla_fsdp_<option>``, its Accelerate default, a parser for its type."""
    f = _OPTION_FIELDS[name]
    key = f.metadata["accelerate"] or f"xla_fsdp_{argument_name(f).lstrip('_')}"
    parse = parse or _TYPE_PARSERS[value_type(_OPTION_TYPES[name])]
    setting = Setting(name, key, key.upper(), f.metadata["accelerate_default"], f.metadata["help"], parse)
    return field(default=None, metadata={"setting": setting, "option": name})


@dataclass
class XlaFsdpPlugin:
    """Every XLA FSDP setting of an Accelerate run (the listing below is generated)."""

    # Accelerate's FSDP settings that say what to wrap and how to save and load.
    auto_wrap_policy: Optional[Union[str, Policy]] = _setting(
        "fsdp_auto_wrap_policy",
        "FSDP_AUTO_WRAP_POLICY",
        None,
        "Which submodules become FSDP units of their own: TRANSFORMER_BASED_WRAP (the block classes "
        "below), SIZE_BASED_WRAP (by fsdp_min_num_params), NO_WRAP (one unit), or a policy callable. "
        "Unset: TRANSFORMER_BASED_WRAP for a model that names its blocks (transformers' "
        "_no_split_modules) or when classes are given, else NO_WRAP.",
        parse_wrap_policy,
    )
    transformer_cls_names_to_wrap: Optional[Union[str, Sequence[str]]] = _setting(
        "fsdp_transformer_layer_cls_to_wrap",
        "FSDP_TRANSFORMER_CLS_TO_WRAP",
        None,
        "Block class names to wrap, comma-separated (default: the model's _no_split_modules).",
        parse_class_names,
    )
    min_num_params: Optional[int] = _setting(
        "fsdp_min_num_params",
        "FSDP_MIN_NUM_PARAMS",
        100_000_000,
        "SIZE_BASED_WRAP: wrap a module once this many of its parameters are not yet wrapped.",
        parse_int,
    )
    activation_checkpointing: Optional[bool] = _setting(
        "fsdp_activation_checkpointing",
        "FSDP_ACTIVATION_CHECKPOINTING",
        False,
        "Checkpoint every wrapped block (recompute its activations in backward, in a form the XLA "
        "compiler cannot undo).",
        parse_bool,
    )
    state_dict_type: Optional[str] = _setting(
        "fsdp_state_dict_type",
        "FSDP_STATE_DICT_TYPE",
        "sharded_state_dict",
        "What save_state writes: SHARDED_STATE_DICT (each rank its shard, loadable on any number of "
        "ranks) or FULL_STATE_DICT (that, plus the consolidated model in the Hugging Face layout).",
        parse_state_dict_type,
    )
    cpu_ram_efficient_loading: Optional[bool] = _setting(
        "fsdp_cpu_ram_efficient_loading",
        "FSDP_CPU_RAM_EFFICIENT_LOADING",
        False,
        "from_pretrained builds the model on the meta device and prepare() reads each replica's shards "
        "from the weight files: the model is never whole in host memory (pretrained_loading.py).",
        parse_bool,
    )
    tpu_scheduler_memory_percent: Optional[int] = _setting(
        "xla_fsdp_tpu_scheduler_memory_percent",
        "XLA_FSDP_TPU_SCHEDULER_MEMORY_PERCENT",
        None,
        "On a TPU: the share of HBM (%) the compiler's scheduler plans a step within, passed to the "
        "replicas as LIBTPU_INIT_ARGS=--xla_tpu_scheduler_percent_shared_memory_limit=N by the "
        "launcher (unset: libtpu's, 95). Lower, the compiler plans for memory: Qwen2.5-7B and "
        "Llama-3.1-8B, fp32, checkpointed, compile for v5e-8 at 90, not at 95 "
        "(accel-xla-fsdp plan, docs/tpu.md). Its cost in step time is not measured.",
        parse_percent,
    )
    optimizer_in_backward: Optional[bool] = _setting(
        "xla_fsdp_optimizer_in_backward",
        "XLA_FSDP_OPTIMIZER_IN_BACKWARD",
        False,
        "Make the optimizer's update of each unit in backward, as soon as its gradients are reduced "
        "(apply_optimizer_in_backward): a TPU's compiler otherwise holds every reduced gradient to the "
        "step's end. Qwen2.5-7B and Llama-3.1-8B, fp32, checkpointed, on v5e-8: refused with libtpu's "
        "defaults, planned at 14.17 and 15.24 GiB per chip with it (SPMD FSDPv2: 15.29 and 16.07; "
        "docs/tpu.md). No gradient clipping (the Trainer: max_grad_norm=0); gradient accumulation under "
        "no_sync, as Accelerate's accumulate() does with several replicas.",
        parse_bool,
    )
    sync_module_states: Optional[bool] = _setting(
        "fsdp_sync_module_states",
        "FSDP_SYNC_MODULE_STATES",
        True,
        "Give every replica rank 0's initial weights before sharding.",
        parse_bool,
    )
    # The engine's options, in FsdpOptions' order, each typed Optional[its type there]
    # (tests/test_structure.py checks them against FsdpOptions).
    reshard_after_forward: Optional[bool] = _option("reshard_after_forward", parse_reshard)
    flatten_parameters: Optional[bool] = _option("flatten_parameters")
    execute_sharding_on_init: Optional[bool] = _option("execute_sharding_on_init")
    optimization_barrier_in_forward: Optional[bool] = _option("optimization_barrier_in_forward")
    optimization_barrier_in_backward: Optional[bool] = _option("optimization_barrier_in_backward")
    sync_on_finalization: Optional[bool] = _option("sync_on_finalization")
    disable_reshard_on_root: Optional[bool] = _option("disable_reshard_on_root")
    buffer_dtype: Optional[torch.dtype] = _option("buffer_dtype")
    fp32_reduce_scatter: Optional[bool] = _option("fp32_reduce_scatter")
    shard_param_on_dim_0: Optional[bool] = _option("shard_param_on_dim_0")
    pin_layout_in_collective_ops: Optional[bool] = _option("pin_layout_in_collective_ops")
    reduce_scatter_bucket_size_mb: Optional[float] = _option("reduce_scatter_bucket_size_mb")
    coalesce_all_gather_ops: Optional[bool] = _option("coalesce_all_gather_ops")
    backward_prefetch: Optional[bool] = _option("backward_prefetch", parse_prefetch)
    shard_size_multiple: Optional[int] = _option("shard_size_multiple")
    use_xla_patched_linear: Optional[bool] = _option("use_xla_patched_linear")
    reduce_scatter_in_linear_backward: Optional[bool] = _option("reduce_scatter_in_linear_backward")
    keep_vocabulary_sharded: Optional[bool] = _option("keep_vocabulary_sharded")
    lm_loss_in_chunks: Optional[bool] = _option("lm_loss_in_chunks")

    def __post_init__(self) -> None:
        config = _config_file_settings()
        defaulted = set()
        for setting in SETTINGS:
            value = getattr(self, setting.name)
            if value is None and setting.env in os.environ:
                value = os.environ[setting.env]
            if value is None:
                value = config.get(setting.key)
            if value is not None:
                value = setting.parse(setting.key, value)
            else:
                defaulted.add(setting.name)
            setattr(self, setting.name, setting.default if value is None else value)
        if "cpu_ram_efficient_loading" not in defaulted:
            # As Accelerate's FSDP plugin does: from_pretrained reads the environment variable.
            os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = str(self.cpu_ram_efficient_loading).lower()
        on_tpu = _xla.platform() == "TPU"
        if self.shard_param_on_dim_0 is None:
            # On a TPU, dim-0 shards: the compiler plans real models' steps in less memory than
            # with 1-D shards, whose large gradients it relays out whole (docs/tpu.md). Asking for
            # flat shards says otherwise.
            self.shard_param_on_dim_0 = on_tpu and not self.flatten_parameters
        if self.flatten_parameters is None:
            # dim-0 shards are per parameter: asking for them says so. On a TPU per-parameter
            # shards cost the compiler less memory than flat ones (docs/tpu.md), on XLA:CPU flat
            # ones are faster (docs/performance.md).
            self.flatten_parameters = not self.shard_param_on_dim_0 and not on_tpu
        if self.keep_vocabulary_sharded is None:
            # On a TPU with dim-0 shards, the embedding and lm_head computed from their shards: the
            # compiler plans real models' steps in less memory, and they move less (the figures
            # are in the option's help, FsdpOptions.keep_vocabulary_sharded; docs/tpu.md).
            self.keep_vocabulary_sharded = on_tpu and bool(self.shard_param_on_dim_0)
        self._check_consistent()

    def _check_consistent(self) -> None:
        policy = self.auto_wrap_policy
        if policy == "size_based_wrap" and self.transformer_cls_names_to_wrap is not None:
            raise ValueError(
                "fsdp_auto_wrap_policy SIZE_BASED_WRAP and fsdp_transformer_layer_cls_to_wrap contradict each "
                "other: drop the class names, or use TRANSFORMER_BASED_WRAP"
            )
        if policy == "no_wrap" and self.activation_checkpointing:
            raise ValueError(
                "fsdp_activation_checkpointing checkpoints the wrapped blocks, and fsdp_auto_wrap_policy "
                "NO_WRAP wraps none: choose TRANSFORMER_BASED_WRAP or turn checkpointing off"
            )
        self.engine_options(torch.float32)  # the engine's own checks (flattening and dim 0, ...)

    def engine_options(self, compute_dtype: torch.dtype) -> FsdpOptions:
        return FsdpOptions(compute_dtype=compute_dtype, **{s.name: getattr(self, s.name) for s in ENGINE_SETTINGS})

    def wrap_policy(self, model: nn.Module) -> Optional[Policy]:
        policy = self.auto_wrap_policy
        if callable(policy):
            return policy
        if policy is None:
            names_blocks = any(getattr(m, "_no_split_modules", None) for m in model.modules())
            policy = "transformer_based_wrap" if names_blocks or self.transformer_cls_names_to_wrap else "no_wrap"
        if policy == "transformer_based_wrap":
            return transformer_block_policy(self.transformer_cls_names_to_wrap)
        if policy == "size_based_wrap":
            assert self.min_num_params is not None  # __post_init__ gave it its default
            return size_policy(self.min_num_params)
        return None

    def wrap(
        self,
        model: nn.Module,
        compute_dtype: torch.dtype,
        checkpoint_blocks: bool,
        flat_shard_key: Optional[FlatShardKey] = None,
        param_init_fn: Optional[Union[ParamInitFn, ShardSource]] = None,
    ) -> XlaFullyShardedDataParallel:
        """``model`` sharded by these settings (block class names checked against it); with
        ``checkpoint_blocks``, every unit the policy makes (or the whole model) checkpointed.
        ``flat_shard_key``, ``param_init_fn``: see ``XlaFullyShardedDataParallel``."""
        options = self.engine_options(compute_dtype)
        policy = self.wrap_policy(model)
        wrapper = _checkpointed_unit if checkpoint_blocks else None
        root = checkpoint_module(model) if checkpoint_blocks and policy is None else model
        with sharing_options(options):  # the wrappers keep this object: options are made once
            return XlaFullyShardedDataParallel(
                root,
                auto_wrap_policy=policy,
                auto_wrapper_callable=wrapper,
                flat_shard_key=flat_shard_key,
                param_init_fn=param_init_fn,
                **options.as_arguments(),
            )


SETTINGS: Tuple[Setting, ...] = tuple(
    dataclasses.replace(f.metadata["setting"], name=f.name) for f in fields(XlaFsdpPlugin)
)
ENGINE_SETTINGS = tuple(s for s, f in zip(SETTINGS, fields(XlaFsdpPlugin)) if "option" in f.metadata)


# Accelerate's FSDP keys that say nothing here, accepted so that a GPU FSDP config runs as it is,
# with the values that mean what XLA FSDP does anyway.
_ACCEPTED_KEYS: Dict[str, Tuple[Any, ...]] = {
    "fsdp_version": (1, 2),
    "fsdp_use_orig_params": (True, False),
    "fsdp_offload_params": (False,),
    "fsdp_forward_prefetch": (False,),
    "fsdp_activation_checkpointing_offload": (False,),
}


def config_help() -> Dict[str, str]:
    """Every ``fsdp_config`` key with its environment variable, default and help (the table in
    docs/configuration.md, written by scripts/config_table.py)."""
    return {s.key: f"{s.env} (default {_show(s.default)}): {s.help}" for s in SETTINGS}


def _show(value: Any) -> str:
    return "unset" if value is None else str(value)


def _checkpointed_unit(module: nn.Module, *args: Any, **kwargs: Any) -> XlaFullyShardedDataParallel:
    return XlaFullyShardedDataParallel(checkpoint_module(module), *args, **kwargs)


def _config_file_settings() -> Dict[str, Any]:
    """The ``fsdp_config`` section of the config file ``accelerate launch`` was given, checked.

    Parsed once per process and file version: every replica thread of a process, every plugin
    and every ``configured()`` call read the same parse."""
    path = os.environ.get(CONFIG_FILE_ENV)
    if not path or os.environ.get(CONFIG_EXPORTED_ENV) == path:
        return {}
    try:
        stat = os.stat(path)
        version: Tuple[Optional[int], Optional[int]] = (stat.st_mtime_ns, stat.st_size)
    except OSError:
        version = (None, None)  # not cached in effect: the parse below raises Accelerate's error
    return dict(_parsed_config_section(path, *version))


@functools.lru_cache(maxsize=8)
def _parsed_config_section(path: str, mtime_ns: Optional[int], size: Optional[int]) -> Dict[str, Any]:
    from accelerate.commands.config.config_args import load_config_from_file

    section = load_config_from_file(path).fsdp_config or {}
    return check_config_section(section, source=path)


def settings_environment(section: Mapping[str, Any]) -> Dict[str, str]:
    """A checked ``fsdp_config`` section as the settings' environment variables, each value parsed
    (a bad one stops here) and written as its parser reads it back. The launcher exports them, as
    Accelerate's launcher does for its own FSDP, under a variable the user has not set already."""
    env = {}
    for setting in SETTINGS:
        value = section.get(setting.key)
        if value is not None:
            env[setting.env] = _as_text(setting.parse(setting.key, value))
    return env


def _as_text(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return ",".join(value)  # class names
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    return str(value)


def configured(name: str) -> Any:
    """One setting as a plugin built now without arguments would hold it (environment variable,
    then the launch config file, then its default), without building one."""
    setting = next(s for s in SETTINGS if s.name == name)
    value = os.environ.get(setting.env)
    if value is None:
        value = _config_file_settings().get(setting.key)
    return setting.default if value is None else setting.parse(setting.key, value)


def check_config_section(section: Mapping[str, Any], source: str) -> Dict[str, Any]:
    """``section`` without the accepted no-op keys; a clear error for any other unknown key or value."""
    known = {s.key for s in SETTINGS}
    unknown = sorted(k for k in section if k not in known and k not in _ACCEPTED_KEYS)
    if unknown:
        raise ValueError(
            f"{source}: unknown fsdp_config key(s) {unknown}. Valid keys: {sorted(known)} "
            f"(and Accelerate's {sorted(_ACCEPTED_KEYS)}, which change nothing here)"
        )
    for key, allowed in _ACCEPTED_KEYS.items():
        if key in section and _normalized(section[key]) not in allowed:
            raise ValueError(f"{source}: {key}: {section[key]!r} is not offered by XLA FSDP; allowed: {list(allowed)}")
    return {k: v for k, v in section.items() if k in known}


def _normalized(value: Any) -> Any:
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("true", "false"):
            return text == "true"
        return int(text) if text.isdigit() else text
    return value


def _plugin_doc() -> str:
    lines = [
        "Every XLA FSDP setting of an Accelerate run (config key, environment variable, default).",
        "",
        "Pass it as ``Accelerator(fsdp_plugin=XlaFsdpPlugin(...))``; a field left ``None`` is read from",
        "its environment variable, then from the ``fsdp_config`` section of the ``accelerate launch``",
        "config file, then takes its default.",
        "",
    ]
    for s in SETTINGS:
        lines.append(f"{s.name} ({s.key}, {s.env}; default {_show(s.default)}): {s.help}")
    return "\n".join(lines)


XlaFsdpPlugin.__doc__ = _plugin_doc()
