"""What ``TrainingArguments`` says about FSDP, as ``XlaFsdpPlugin`` settings.

``transformers`` reads ``TrainingArguments(fsdp=..., fsdp_config=...)`` two ways: with
``fsdp_config["xla"]`` it wraps the model with torch_xla's FSDP itself (``integrations/tpu.py``),
otherwise it builds Accelerate's GPU FSDP plugin from it. On our engine both mean the same
settings: each key the Trainer documents is mapped here to the plugin field that does what it
does on torch_xla, and a key that has no such field is refused by name. Settings given here win
over the ``accelerate launch`` config file's ``fsdp_config`` (code over config, as for
``XlaFsdpPlugin``); what is not given is read from there.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Dict, Mapping, Optional

from ..hf_accelerate.plugin import SETTINGS, XlaFsdpPlugin, check_config_section
from ..options import FsdpOptions, argument_name

# torch_xla's XlaFullyShardedDataParallel argument (``fsdp_config["xla_fsdp_settings"]``) -> field.
_TORCH_XLA_ARGUMENTS = {argument_name(f): f.name for f in fields(FsdpOptions)}
# Set another way on our engine: the compute dtype by ``bf16``, the sharding groups not at all.
_NOT_IN_SETTINGS = {
    "compute_dtype": "set bf16=True in TrainingArguments (bfloat16 is the compute dtype; fp32 without it)",
    "sharding_groups": "XLA FSDP shards over every replica here",
    "sharding_rank": "XLA FSDP shards over every replica here",
    "sharding_world_size": "XLA FSDP shards over every replica here",
}
# fsdp_config keys of the Trainer's own (not Accelerate's, which pass through with their prefix).
_TRAINER_KEYS = (
    "xla",
    "xla_fsdp_v2",
    "xla_fsdp_grad_ckpt",
    "xla_fsdp_settings",
    "min_num_params",
    "transformer_layer_cls_to_wrap",
    "cpu_offload",
)


def check_precision(args: Any) -> None:
    """fp16 refused: XLA devices have no fp16 loss scaling; bf16 is the engine's compute dtype."""
    for name in ("fp16", "fp16_full_eval"):
        if getattr(args, name, False) is True:
            raise ValueError(
                f"TrainingArguments({name}=True) is not offered with XLA FSDP (no fp16 loss scaling on XLA): "
                "use bf16=True (computation in bfloat16, float32 master weights and optimizer state)"
            )


def plugin_from_training_args(args: Any) -> Optional[Any]:
    """An ``XlaFsdpPlugin`` holding what ``args.fsdp_config`` sets (None without ``args.fsdp``)."""
    if not args.fsdp:
        return None
    config: Mapping[str, Any] = args.fsdp_config or {}
    if config.get("xla_fsdp_v2"):
        raise ValueError(
            "fsdp_config['xla_fsdp_v2'] asks for torch_xla's SPMD FSDP: accel_xla_fsdp's Trainer shards with "
            "its own XLA FSDP; drop the key (the other fsdp_config keys keep their meaning)"
        )
    fields_given = _trainer_keys(config)
    accelerate_keys = {f"fsdp_{k}": v for k, v in config.items() if k not in _TRAINER_KEYS}
    if config.get("cpu_offload"):
        accelerate_keys["fsdp_offload_params"] = True  # refused below, under Accelerate's name
    known = check_config_section(accelerate_keys, source="TrainingArguments.fsdp_config")
    by_key = {s.key: s.name for s in SETTINGS}
    fields_given.update({by_key[k]: v for k, v in known.items()})
    return XlaFsdpPlugin(**fields_given)


def _trainer_keys(config: Mapping[str, Any]) -> Dict[str, Any]:
    """The plugin fields that the Trainer's own keys (as its XLA FSDP path reads them) set."""
    given: Dict[str, Any] = {}
    if config.get("min_num_params", 0) > 0:
        given.update(auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=config["min_num_params"])
    if config.get("transformer_layer_cls_to_wrap"):
        given["transformer_cls_names_to_wrap"] = list(config["transformer_layer_cls_to_wrap"])
    if config.get("xla_fsdp_grad_ckpt"):
        given["activation_checkpointing"] = True
    for argument, value in (config.get("xla_fsdp_settings") or {}).items():
        given[_setting_for(argument)] = value
    return given


def _setting_for(argument: str) -> str:
    """The plugin field for one of torch_xla's ``XlaFullyShardedDataParallel`` arguments."""
    name = _TORCH_XLA_ARGUMENTS.get(argument)
    if name in _NOT_IN_SETTINGS:
        raise ValueError(f"fsdp_config['xla_fsdp_settings']['{argument}'] is not taken here: {_NOT_IN_SETTINGS[name]}")
    if name is None:
        valid = sorted(a for a, n in _TORCH_XLA_ARGUMENTS.items() if n not in _NOT_IN_SETTINGS)
        raise ValueError(
            f"fsdp_config['xla_fsdp_settings']['{argument}'] is not an XLA FSDP argument offered here; valid: {valid}"
        )
    return name
