"""Fully Sharded Data Parallel on XLA devices, for Hugging Face Accelerate."""

from ._xla import sync
from .checkpoint import CheckpointError, ShardedCheckpoint, consolidate, load_sharded, pretrained_weights, save_sharded
from .checkpointing import checkpoint_module
from .fsdp import XlaFullyShardedDataParallel
from .options import FsdpOptions
from .runner import DevicePool, ReplicaError, run_on_devices, seeded
from .wrap import (
    TransformerBlockPolicy,
    lambda_auto_wrap_policy,
    predicate_policy,
    size_based_auto_wrap_policy,
    size_policy,
    transformer_auto_wrap_policy,
    transformer_block_policy,
)
from .xla_cpu import patches

__all__ = [
    "Accelerator",
    "XlaFsdpPlugin",
    "Trainer",
    "Seq2SeqTrainer",
    "XlaFsdpTrainerMixin",
    "XlaFullyShardedDataParallel",
    "checkpoint_module",
    "save_sharded",
    "load_sharded",
    "pretrained_weights",
    "consolidate",
    "ShardedCheckpoint",
    "CheckpointError",
    "sync",
    "FsdpOptions",
    "run_on_devices",
    "DevicePool",
    "ReplicaError",
    "seeded",
    "TransformerBlockPolicy",
    "transformer_block_policy",
    "size_policy",
    "predicate_policy",
    "transformer_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "lambda_auto_wrap_policy",
]

# What must be in place before torch_xla's launcher starts replica threads (xla_cpu/patches.py).
patches.install(patches.Stage.PACKAGE)


def __getattr__(name: str) -> object:
    """``Accelerator`` and ``XlaFsdpPlugin`` import Accelerate, ``Trainer``, ``Seq2SeqTrainer`` and
    ``XlaFsdpTrainerMixin`` transformers' Trainer too: only when asked for."""
    if name in ("Accelerator", "XlaFsdpPlugin"):
        from . import hf_accelerate

        return getattr(hf_accelerate, name)
    if name in ("Trainer", "Seq2SeqTrainer", "XlaFsdpTrainerMixin"):
        from . import hf_trainer

        return getattr(hf_trainer, name)
    raise AttributeError(f"module 'accel_xla_fsdp' has no attribute {name!r}")
