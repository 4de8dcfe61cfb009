"""``XlaFsdpPlugin``: every XLA FSDP setting an Accelerate run takes, and where it comes from.

A setting is read, first to last, from: the plugin's constructor (code), its environment
variable, the ``fsdp_config`` section of the ``accelerate launch`` config file, its default.
Settings that mean what one of Accelerate's FSDP keys means use that key (``fsdp_auto_wrap_policy``,
``fsdp_transformer_layer_cls_to_wrap``, ...) and Accelerate's environment variable; the engine's
other options (the ``FsdpOptions`` table in options.py) are ``xla_fsdp_<option>`` /
``XLA_FSDP_<OPTION>``. The plugin's fields are built from two tables: ``WRAP_SETTINGS`` below and
the engine's options, so an engine option is configurable the moment it is in ``FsdpOptions``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, fields
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch
import torch.nn as nn

from ..checkpointing import checkpoint_module
from ..construction import FlatShardKey, ParamInitFn
from ..fsdp import XlaFullyShardedDataParallel
from ..options import FsdpOptions, argument_name
from ..wrap import Policy, size_policy, transformer_block_policy

# Set by the launcher process of ``accelerate launch`` (launch.py) for the replicas it starts.
CONFIG_FILE_ENV = "ACCEL_XLA_FSDP_CONFIG_FILE"


@dataclass(frozen=True)
class Setting:
    """One plugin field: its config key, environment variable, default, help and parser."""

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
    names = value.split(",") if isinstance(value, str) else list(value)
    names = tuple(str(n).strip() for n in names if str(n).strip())
    if not names:
        raise ValueError(f"{key}: expected one or more class names (comma-separated), got {value!r}")
    return names


WRAP_POLICIES = ("transformer_based_wrap", "size_based_wrap", "no_wrap")


def parse_wrap_policy(key: str, value: Any) -> Any:
    if callable(value):
        return value
    policy = str(value).strip().lower()
    if policy not in WRAP_POLICIES:
        raise ValueError(f"{key}: expected one of {[p.upper() for p in WRAP_POLICIES]} or a policy callable, got {value!r}")
    return policy


def parse_reshard(key: str, value: Any) -> bool:
    """A bool (FSDP2's form), or FSDP1's sharding strategy names that mean one."""
    strategies = {"full_shard": True, "1": True, "shard_grad_op": False, "2": False}
    text = str(value).strip().lower()
    if text in strategies:
        return strategies[text]
    if text in ("no_shard", "3", "hybrid_shard", "4", "hybrid_shard_zero2", "5"):
        raise ValueError(f"{key}: {value!r} is not offered by XLA FSDP; use FULL_SHARD (true) or SHARD_GRAD_OP (false)")
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


WRAP_SETTINGS: Tuple[Setting, ...] = (
    Setting(
        "auto_wrap_policy", "fsdp_auto_wrap_policy", "FSDP_AUTO_WRAP_POLICY", None,
        "Which submodules become FSDP units of their own: TRANSFORMER_BASED_WRAP (the block classes "
        "below), SIZE_BASED_WRAP (by fsdp_min_num_params), NO_WRAP (one unit), or a policy callable. "
        "Unset: TRANSFORMER_BASED_WRAP for a model that names its blocks (transformers' "
        "_no_split_modules) or when classes are given, else NO_WRAP.",
        parse_wrap_policy,
    ),
    Setting(
        "transformer_cls_names_to_wrap", "fsdp_transformer_layer_cls_to_wrap", "FSDP_TRANSFORMER_CLS_TO_WRAP", None,
        "Block class names to wrap, comma-separated (default: the model's _no_split_modules).",
        parse_class_names,
    ),
    Setting(
        "min_num_params", "fsdp_min_num_params", "FSDP_MIN_NUM_PARAMS", 100_000_000,
        "SIZE_BASED_WRAP: wrap a module once this many of its parameters are not yet wrapped.",
        parse_int,
    ),
    Setting(
        "activation_checkpointing", "fsdp_activation_checkpointing", "FSDP_ACTIVATION_CHECKPOINTING", False,
        "Checkpoint every wrapped block (recompute its activations in backward, in a form the XLA "
        "compiler cannot undo).",
        parse_bool,
    ),
    Setting(
        "state_dict_type", "fsdp_state_dict_type", "FSDP_STATE_DICT_TYPE", "sharded_state_dict",
        "What save_state writes: SHARDED_STATE_DICT (each rank its shard, loadable on any number of "
        "ranks) or FULL_STATE_DICT (that, plus the consolidated model in the Hugging Face layout).",
        parse_state_dict_type,
    ),
    Setting(
        "cpu_ram_efficient_loading", "fsdp_cpu_ram_efficient_loading", "FSDP_CPU_RAM_EFFICIENT_LOADING", False,
        "from_pretrained builds the model on the meta device and prepare() reads each replica's shards "
        "from the weight files: the model is never whole in host memory (pretrained_loading.py).",
        parse_bool,
    ),
    Setting(
        "sync_module_states", "fsdp_sync_module_states", "FSDP_SYNC_MODULE_STATES", True,
        "Give every replica rank 0's initial weights before sharding.",
        parse_bool,
    ),
)

# The engine's options that an Accelerate run sets some other way: the compute dtype from
# ``mixed_precision``, the sharding groups (a per-replica position) in code only.
_NOT_CONFIGURABLE = ("compute_dtype", "sharding_groups", "sharding_rank", "sharding_world_size")
_SPECIAL_PARSERS = {"reshard_after_forward": parse_reshard, "backward_prefetch": parse_prefetch}
_TYPE_PARSERS = {"bool": parse_bool, "Optional[int]": parse_int, "Optional[float]": parse_float, "Optional[torch.dtype]": parse_dtype}


def _engine_settings() -> Tuple[Setting, ...]:
    settings = []
    for f in fields(FsdpOptions):
        if f.name in _NOT_CONFIGURABLE:
            continue
        key = f.metadata["accelerate"] or f"xla_fsdp_{argument_name(f).lstrip('_')}"
        parse = _SPECIAL_PARSERS.get(f.name) or _TYPE_PARSERS[str(f.type)]
        settings.append(Setting(f.name, key, key.upper(), f.metadata["accelerate_default"], f.metadata["help"], parse))
    return tuple(settings)


ENGINE_SETTINGS = _engine_settings()
SETTINGS = WRAP_SETTINGS + ENGINE_SETTINGS

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
    """Every ``fsdp_config`` key with its environment variable, default and help (README table)."""
    return {s.key: f"{s.env} (default {_show(s.default)}): {s.help}" for s in SETTINGS}


def _show(value: Any) -> str:
    return "unset" if value is None else str(value)


class _PluginBase:
    """What every ``XlaFsdpPlugin`` does; its fields are made from ``SETTINGS`` below."""

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
        if self.shard_param_on_dim_0 and "flatten_parameters" in defaulted:
            self.flatten_parameters = False  # dim-0 shards are per parameter: asking for them says so
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
            return size_policy(self.min_num_params)
        return None

    def wrap(
        self, model: nn.Module, compute_dtype: torch.dtype, checkpoint_blocks: bool,
        flat_shard_key: Optional[FlatShardKey] = None, param_init_fn: Optional[ParamInitFn] = None,
    ) -> XlaFullyShardedDataParallel:
        """``model`` sharded by these settings (block class names checked against it); with
        ``checkpoint_blocks``, every unit the policy makes (or the whole model) checkpointed.
        ``flat_shard_key``, ``param_init_fn``: see ``XlaFullyShardedDataParallel``."""
        options = self.engine_options(compute_dtype)
        policy = self.wrap_policy(model)
        wrapper = _checkpointed_unit if checkpoint_blocks else None
        root = checkpoint_module(model) if checkpoint_blocks and policy is None else model
        return XlaFullyShardedDataParallel(
            root, auto_wrap_policy=policy, auto_wrapper_callable=wrapper, flat_shard_key=flat_shard_key,
            param_init_fn=param_init_fn, **options.as_arguments(),
        )


def _checkpointed_unit(module: nn.Module, *args: Any, **kwargs: Any) -> XlaFullyShardedDataParallel:
    return XlaFullyShardedDataParallel(checkpoint_module(module), *args, **kwargs)


def _config_file_settings() -> Dict[str, Any]:
    """The ``fsdp_config`` section of the config file ``accelerate launch`` was given, checked."""
    path = os.environ.get(CONFIG_FILE_ENV)
    if not path:
        return {}
    from accelerate.commands.config.config_args import load_config_from_file

    section = load_config_from_file(path).fsdp_config or {}
    return check_config_section(section, source=path)


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


XlaFsdpPlugin = dataclasses.make_dataclass(
    "XlaFsdpPlugin",
    [(s.name, Any, dataclasses.field(default=None, metadata={"key": s.key, "env": s.env, "help": s.help})) for s in SETTINGS],
    bases=(_PluginBase,),
    namespace={"__doc__": _plugin_doc(), "__module__": __name__},
)

