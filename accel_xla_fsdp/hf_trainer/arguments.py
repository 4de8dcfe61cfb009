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


# Batches padded to a multiple of this many tokens (at most max_length): what TRL does on Neuron,
# which like XLA compiles a program per input shape.
PAD_MULTIPLE = 128


def fixed_shapes(args: Any) -> Optional[str]:
    """TRL's data settings made to give a bounded number of batch shapes (``args`` is the Trainer's
    own copy); what was changed, for the log, or None. Refused: the flattened batches made for
    FlashAttention (``padding_free``, and BFD packing, which turns it on), one new shape a step.

    TRL pads each batch to its longest row (``pad_to_multiple_of="auto"`` is None off Neuron): on XLA
    every new length is a new program, and on XLA:CPU replicas whose rows differ compile programs of
    their own, each in its turn, which aborts the run at the first collective (seen)."""
    packing_strategy = getattr(args, "packing_strategy", None)
    if getattr(args, "padding_free", False) or (getattr(args, "packing", False) and packing_strategy != "wrapped"):
        setting = (
            "padding_free=True" if getattr(args, "padding_free", False) else f"packing_strategy={packing_strategy!r}"
        )
        raise ValueError(
            f"{type(args).__name__}({setting}) flattens each batch into one row of a new length every step (made for "
            "FlashAttention): on XLA each is a new program. Use packing=True with packing_strategy='wrapped' (fixed "
            "rows of max_length tokens), or packing=False with padding_free=False"
        )
    if not hasattr(args, "pad_to_multiple_of") or args.pad_to_multiple_of is not None:
        return None
    max_length = getattr(args, "max_length", None)
    args.pad_to_multiple_of = min(PAD_MULTIPLE, max_length) if max_length else PAD_MULTIPLE
    return f"pad_to_multiple_of={args.pad_to_multiple_of} (was None: one program per batch length)"
