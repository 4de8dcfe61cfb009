"""Every setting of an FSDP unit, defined once: name, default, help, and where else it is spelled.

``FsdpOptions`` is the table. Each field is one of torch_xla's ``XlaFullyShardedDataParallel``
arguments (same name, same default; the field metadata gives the argument's spelling where
torch_xla's starts with an underscore) or one of ours, and carries its help text and, where
Accelerate has a key meaning the same thing, that key. The wrapper's signature
(``wrapper_signature``), its documentation and the Accelerate plugin's config keys are all derived
from these fields, so a new option is one new field.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, fields
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

import torch

from . import _xla

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


_SAME = object()


def _option(
    default: Any,
    help: str,
    *,
    accelerate: Optional[str] = None,
    argument: Optional[str] = None,
    accelerate_default: Any = _SAME,
) -> Any:
    """A field of the table: ``argument`` is the wrapper's spelling when it is not the field name;
    ``accelerate_default`` the Accelerate plugin's default where it differs from torch_xla's."""
    metadata = {
        "help": help,
        "accelerate": accelerate,
        "argument": argument,
        "accelerate_default": default if accelerate_default is _SAME else accelerate_default,
    }
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class FsdpOptions:
    """The settings of one FSDP unit (shared by every unit an auto-wrap creates).

    The wrapper takes these fields as its keyword arguments (torch_xla's spelling) and keeps them
    as ``unit.options``. ``None`` defaults are resolved when the options are made
    (``compute_dtype`` to float32, ``buffer_dtype`` to the compute dtype, ``shard_size_multiple``
    to the platform's): those fields are typed as what they hold after that, never ``None``.
    """

    reshard_after_forward: bool = _option(
        True,
        "Free full parameters after forward and gather them again for backward (ZeRO-3).",
        accelerate="fsdp_reshard_after_forward",
    )
    flatten_parameters: bool = _option(
        False,
        "One flat shard per unit (one gather, one reduce-scatter) instead of one per parameter; "
        "trainable and frozen parameters are flattened separately, and under Accelerate so are the "
        "param groups of the optimizers prepared with the model. torch_xla's default is per "
        "parameter. Accelerate's (None): flat on XLA:CPU, a faster step and less host time there "
        "(docs/performance.md), but more memory (the unit's gradients are reduce-scattered together "
        "once all are in: 1.34x the memory floor against 1.18x per parameter at 0.48 B, "
        "docs/accelerate.md#memory-stage-by-stage), so plugins/xla_fsdp_cpu.yaml sets false; per "
        "parameter on a TPU, where the compiler holds flat units' full "
        "buffers longer and relays them out (docs/tpu.md: 1.5x the temp of per-parameter shards). "
        "Per parameter to freeze single parameters after prepare() or to shard on dim 0.",
        accelerate="xla_fsdp_flatten_parameters",
        accelerate_default=None,
    )
    execute_sharding_on_init: bool = _option(
        True,
        "Run the sharding program at once when wrapping, freeing the full parameters.",
    )
    optimization_barrier_in_forward: bool = _option(
        True,
        "Optimization barriers around each forward gather and free, so the compiler can neither "
        "merge the backward gather into the forward one nor move gathers across other units.",
    )
    optimization_barrier_in_backward: bool = _option(
        True,
        "Optimization barriers around each backward gather and reduce-scatter (same reason); none "
        "over every gradient at the end of backward, where torch_xla's FSDP puts one (docs/tpu.md).",
    )
    sync_on_finalization: bool = _option(
        False,
        "Cut the graph after backward, before the optimizer step.",
    )
    disable_reshard_on_root: bool = _option(
        True,
        "The root unit keeps its parameters from forward to backward, which starts right after it.",
    )
    compute_dtype: torch.dtype = _option(
        None,
        "Dtype of gathered parameters and floating inputs (None: float32). Shards, gradients and "
        "optimizer state stay in the parameters' own dtype.",
    )
    buffer_dtype: torch.dtype = _option(
        None,
        "Dtype of floating buffers (None: the compute dtype).",
    )
    fp32_reduce_scatter: bool = _option(
        False,
        "Reduce gradients in float32 when computing in a lower precision.",
    )
    sharding_groups: Optional[List[List[int]]] = _option(
        None,
        "The replicas each parameter is sharded across, as groups of global ranks (None: all).",
    )
    sharding_rank: Optional[int] = _option(None, "This replica's position in its sharding group.")
    sharding_world_size: Optional[int] = _option(None, "The size of each sharding group.")
    shard_param_on_dim_0: bool = _option(
        False,
        "Without flattening, shard each parameter along dim 0, keeping its trailing shape. "
        "Accelerate's default (None): on a TPU unless flatten_parameters is set (each gradient is "
        "then reduce-scattered in its own rows, where a 1-D shard's is first relaid out whole: "
        "Llama-3.1-8B on v5e-8, compiled at full depth, checkpointed in bf16 with the tables gathered "
        "whole, plans 9.98 against 11.65 GiB per chip at 835d897, docs/tpu.md); elsewhere off.",
        accelerate="xla_fsdp_shard_param_on_dim_0",
        accelerate_default=None,
    )
    pin_layout_in_collective_ops: bool = _option(
        False,
        "torch_xla's layout pinning of collectives: a pinned all-gather is traced as an all-reduce "
        "of a zero-padded full tensor (twice the traffic on a TPU). Off by default: pinning guards "
        "against replicas compiling different programs, and ours trace one (docs/tpu.md). The "
        "XLA:CPU form never pins.",
    )
    reduce_scatter_bucket_size_mb: Optional[float] = _option(
        0,
        "Reduce-scatter a unit's gradients in buckets, one collective per bucket: a bucket is "
        "reduced once it holds more than this many MiB (torch_xla's rule), the rest when the unit's "
        "backward ends (0: one reduce-scatter per parameter group). torch_xla takes an int; a float "
        "is accepted too, for blocks smaller than 1 MiB.",
    )
    coalesce_all_gather_ops: bool = _option(
        False,
        "Gather all of a unit's parameter groups in one collective (on XLA:CPU, their shards "
        "packed into one all-gather).",
    )
    backward_prefetch: bool = _option(
        False,
        "In a unit's pre-backward hook also gather the unit backward needs next (PyTorch's "
        "BACKWARD_PRE). Off by default: measured on the benchmark's Llama it holds one more block's "
        "full parameters (+4% bytes at 2 devices, +10% at 4) for a step-time gain that did not hold "
        "at 4 devices.",
        accelerate="fsdp_backward_prefetch",
    )
    shard_size_multiple: int = _option(
        None,
        "Pad shards to a multiple of this many elements per replica, gathered as rows of that "
        "width (None: 2048 on a TPU, whole (16, 128) tiles, which its compiler keeps as "
        "reduce-scatters where torch_xla's 128 became all-reduces (docs/tpu.md); 1 elsewhere and "
        "with shard_param_on_dim_0).",
        argument="_shard_size_multiple",
    )
    use_xla_patched_linear: bool = _option(
        True,
        "Give nn.Linear a backward that reads the weight parameter itself, not the forward's "
        "gathered copy (pytorch/xla#3811).",
        accelerate="xla_fsdp_use_patched_linear",
        argument="_use_xla_patched_linear",
    )
    reduce_scatter_in_linear_backward: bool = _option(
        False,
        "With shard_param_on_dim_0 and the patched nn.Linear: in the root unit (lm_head's), a "
        "Linear's backward computes its weight's gradient chunk by chunk, in the chunks a TPU "
        "reduce-scatters it in, and reduces each as it is made, so the full gradient (vocabulary x "
        "hidden) is never whole (under no_sync it is, as before); a tied head's part is reduced at "
        "once, the embedding's at the end. Off by default: on v5e-8 it lowers the plan of issue "
        "25's 4-layer Llama in bf16 from 493.1 to 362.2 MB per chip (SPMD FSDPv2: 358.9) and tied "
        "Llama-3.2-1B's from 4.53 to 3.23 GiB (for 1.08x the traffic floor: the tied table is "
        "reduce-scattered twice), but not untied real models' (Llama-3.1-8B in bf16: 48.89 against "
        "48.83 GiB, 8.78 against 8.70 checkpointed), whose peak lies elsewhere (docs/tpu.md).",
    )
    keep_vocabulary_sharded: bool = _option(
        False,
        "With shard_param_on_dim_0: the root unit computes its Embeddings and patched Linears "
        "(a causal LM's embedding and lm_head) from their weights' shards, never gathered whole: "
        "the embedding looks up every replica's tokens in each replica's rows and reduce-scatters "
        "them (all-gathers the tokens' gradient rows in backward), lm_head gathers its rows a chunk "
        "at a time in forward and again in backward (sharded_tables.py). Their gradients arrive "
        "reduced, also under no_sync. Off in the engine. Accelerate's default (None): on a TPU "
        "with dim-0 shards, where the compiler plans less with it in every step re-run: on v5e-8, "
        "checkpointed, at 835d897, Llama-3.2-1B (lm_head tied to the embedding) in bf16 2.52 "
        "against 3.68 GiB per chip (SPMD FSDPv2: 3.13), Qwen2.5-7B 8.35 against 8.87 (9.51), "
        "Llama-3.1-8B 9.70 against 9.98 (12.34) and in fp32 11.12 against 13.73 (13.26); issue "
        "25's 4-layer Llama, not checkpointed, 325.6 MB (358.9) (docs/tpu.md); elsewhere off.",
        accelerate_default=None,
    )
    lm_loss_in_chunks: bool = _option(
        False,
        "With keep_vocabulary_sharded: a transformers causal LM's loss (ForCausalLMLoss, through "
        "the model's loss_function) computed from lm_head's shard a chunk at a time, the logits "
        "and their gradient never whole: forward gathers each chunk of lm_head's rows and keeps a "
        "running log-sum-exp and the labels' logits; backward computes each chunk's logits again "
        "and makes its part of the gradients from them (sharded_loss.py). The logits the model "
        "returns are computed only if the script keeps them. Equal to transformers' loss to "
        "rounding, not bit for bit. Off by default: on v5e-8 issue 25's 4-layer Llama plans 439.5 "
        "MB per chip with it in fp32 against the default's 427.5 (SPMD FSDPv2: 428.6; small logits "
        "are written in place) and 252.4 against 252.6 checkpointed, and the real models' "
        "checkpointed steps a little more (Llama-3.1-8B: fp32 on v6e-8 temp 4,760.6 against 4,547.9 "
        "MiB, bf16 on v5e-8 9.83 against 9.70 GiB), the compiler packing their heaps no tighter for "
        "the logits gone. Without checkpointing Llama-3.2-1B's fp32 step plans 13.36 against 13.94 "
        "GiB on v5e-8, at 1.089x the traffic floor: lm_head's own forward gathers stay in the "
        "program; its bf16 step (sdpa) 11.87 against 11.86 (docs/tpu.md).",
    )

    def __post_init__(self) -> None:
        compute = _check_dtype("compute_dtype", self.compute_dtype or torch.float32)
        object.__setattr__(self, "compute_dtype", compute)
        object.__setattr__(self, "buffer_dtype", _check_dtype("buffer_dtype", self.buffer_dtype or compute))
        if self.flatten_parameters and self.shard_param_on_dim_0:
            raise ValueError(
                "flatten_parameters=True and shard_param_on_dim_0=True contradict each other: a flat "
                "shard has no dim 0 of its own. Choose one."
            )
        if self.keep_vocabulary_sharded and not self.shard_param_on_dim_0:
            raise ValueError(
                "keep_vocabulary_sharded=True needs shard_param_on_dim_0=True: a table is computed from "
                "the rows of its shard. Set shard_param_on_dim_0=True too, or leave "
                "keep_vocabulary_sharded off."
            )
        if self.lm_loss_in_chunks and not self.keep_vocabulary_sharded:
            raise ValueError(
                "lm_loss_in_chunks=True needs keep_vocabulary_sharded=True: the loss is computed from "
                "lm_head's shard a chunk at a time. Set keep_vocabulary_sharded=True too, or leave "
                "lm_loss_in_chunks off."
            )
        multiple = self.shard_size_multiple
        if multiple is None:
            multiple = 1 if self.shard_param_on_dim_0 else _xla.default_shard_size_multiple()
        if multiple < 1:
            raise ValueError(f"_shard_size_multiple must be at least 1, got {multiple}")
        object.__setattr__(self, "shard_size_multiple", multiple)
        if (self.reduce_scatter_bucket_size_mb or 0) < 0:
            raise ValueError(
                f"reduce_scatter_bucket_size_mb must be 0 or more, got {self.reduce_scatter_bucket_size_mb}"
            )
        _check_sharding_arguments(self.sharding_groups, self.sharding_rank, self.sharding_world_size)

    @property
    def reduce_dtype(self) -> torch.dtype:
        return torch.float32 if self.fp32_reduce_scatter else self.compute_dtype

    @property
    def bucket_bytes(self) -> int:
        return int((self.reduce_scatter_bucket_size_mb or 0) * 2**20)

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any]) -> FsdpOptions:
        """The options from wrapper arguments spelled as in the signature (``_shard_size_multiple``):
        the shared object (``sharing_options``) when they are exactly its own values."""
        values = {f.name: arguments[argument_name(f)] for f in fields(cls) if argument_name(f) in arguments}
        shared = _SHARED.get()
        if shared is not None and len(values) == len(fields(cls)):
            if all(getattr(shared, name) is value for name, value in values.items()):
                return shared
        return cls(**values)

    def as_arguments(self) -> Dict[str, Any]:
        """These options as wrapper keyword arguments (for the units an auto-wrap creates)."""
        return {argument_name(f): getattr(self, f.name) for f in fields(self)}


# The options the wrappers made in this context share (one per replica thread: each thread has
# its own context).
_SHARED: ContextVar[Optional[FsdpOptions]] = ContextVar("accel_xla_fsdp_shared_options", default=None)


@contextmanager
def sharing_options(options: FsdpOptions) -> Iterator[None]:
    """Inside, a wrapper given exactly ``options.as_arguments()`` keeps ``options`` itself instead
    of making an equal object: the units an auto-wrap makes share their parent's options."""
    token = _SHARED.set(options)
    try:
        yield
    finally:
        _SHARED.reset(token)


def argument_name(f: Any) -> str:
    return f.metadata["argument"] or f.name


def _check_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be one of {FLOAT_DTYPES}, got {dtype}")
    return dtype


def _check_sharding_arguments(
    groups: Optional[List[List[int]]], rank: Optional[int], world_size: Optional[int]
) -> None:
    if groups is None and (rank is not None or world_size is not None):
        raise ValueError("sharding_rank and sharding_world_size go with sharding_groups; pass all three")
    if groups is not None and (rank is None or world_size is None):
        raise ValueError(
            "sharding_groups needs sharding_rank and sharding_world_size too (this replica's "
            "position in its group and the group size)"
        )


# ---------------------------------------------------------------------------------------------
# The wrapper's signature, derived from the table

# torch_xla's construction arguments that are not unit settings, in its order.
CONSTRUCTION_ARGUMENTS: Tuple[Tuple[str, Any], ...] = (
    ("auto_wrap_policy", None),
    ("auto_wrapper_callable", None),
    ("param_init_fn", None),
)
# Ours, beside torch_xla's: with flatten_parameters, parameters whose keys differ go into separate
# flat shards (the Accelerate integration keys them by optimizer param group).
EXTENSION_ARGUMENTS: Tuple[Tuple[str, Any], ...] = (("flat_shard_key", None),)
# torch_xla's debugging switches: accepted so that scripts run unchanged. The dummy-op ones
# replace real work by nothing and are refused when turned on; the message ones only print.
DEBUG_ARGUMENTS: Tuple[Tuple[str, Any], ...] = (
    ("_debug_dummy_forward_pass", False),
    ("_debug_msg", "xla_fsdp"),
    ("_debug_print", False),
    ("_debug_dummy_all_gather_op", False),
    ("_debug_dummy_all_reduce_op", False),
    ("_debug_dummy_reduce_scatter_op", False),
    ("_debug_dummy_optimization_barrier_op", False),
)


def wrapper_signature() -> inspect.Signature:
    """``(self, module, <every option>, auto_wrap_policy, auto_wrapper_callable, param_init_fn,
    flat_shard_key, <torch_xla's debugging switches>)``."""
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = [inspect.Parameter("self", kind), inspect.Parameter("module", kind)]
    params += [inspect.Parameter(argument_name(f), kind, default=f.default) for f in fields(FsdpOptions)]
    extra = CONSTRUCTION_ARGUMENTS + EXTENSION_ARGUMENTS + DEBUG_ARGUMENTS
    params += [inspect.Parameter(name, kind, default=d) for name, d in extra]
    return inspect.Signature(params)


def check_debug_arguments(arguments: Mapping[str, Any]) -> None:
    for name, default in DEBUG_ARGUMENTS:
        if name.startswith("_debug_dummy") and arguments.get(name, default):
            raise ValueError(
                f"{name}=True replaces real work by a dummy op (a torch_xla debugging aid), which "
                "this FSDP does not offer; leave it False"
            )


def options_help() -> Dict[str, str]:
    """Each option's argument name and help text, in signature order (for docs and error messages)."""
    return {argument_name(f): f.metadata["help"] for f in fields(FsdpOptions)}


# ---------------------------------------------------------------------------------------------
# Sharding groups


@dataclass(frozen=True)
class ShardingGroup:
    """Which replicas one parameter shard is split across, and this replica's place among them.

    ``groups=None`` means every replica, in rank order.
    """

    rank: int
    world_size: int
    groups: Optional[List[List[int]]] = None

    @classmethod
    def for_replica(cls, options: FsdpOptions) -> ShardingGroup:
        """This replica's group: every replica by default, else the checked ``sharding_groups``."""
        if options.sharding_groups is None:
            return cls(rank=_xla.global_rank(), world_size=_xla.world_size())
        groups, rank, world_size = options.sharding_groups, options.sharding_rank, options.sharding_world_size
        # FsdpOptions checked that sharding_groups comes with both of these.
        assert rank is not None and world_size is not None
        check_sharding_groups(groups, rank, world_size, _xla.global_rank(), _xla.world_size())
        return cls(rank=rank, world_size=world_size, groups=[list(g) for g in groups])


def check_sharding_groups(
    groups: List[List[int]], rank: int, world_size: int, replica: int, num_replicas: int
) -> None:
    """Groups must split the replicas into equal parts that cover each replica exactly once."""
    members = sorted(r for g in groups for r in g)
    if members != list(range(num_replicas)):
        raise ValueError(
            f"sharding_groups {groups} must cover each of the {num_replicas} replicas "
            f"(0..{num_replicas - 1}) exactly once"
        )
    sizes = {len(g) for g in groups}
    if sizes != {world_size}:
        raise ValueError(
            f"sharding_groups {groups} have sizes {sorted(sizes)}, but sharding_world_size is {world_size}"
        )
    mine = next(g for g in groups if replica in g)
    if mine.index(replica) != rank:
        raise ValueError(
            f"replica {replica} is at position {mine.index(replica)} of its sharding group {mine}, "
            f"but sharding_rank is {rank}"
        )
