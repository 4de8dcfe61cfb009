"""Sharded checkpoints in safetensors: save, load (any world size and layout), consolidate."""

from .consolidate import consolidate
from .format import CheckpointError, ShardedCheckpoint
from .pretrained import pretrained_weights
from .sharded import load_sharded, save_sharded

__all__ = ["CheckpointError", "ShardedCheckpoint", "consolidate", "load_sharded", "pretrained_weights", "save_sharded"]
