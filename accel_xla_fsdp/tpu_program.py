"""A training step's program as a TPU replica would hand it to its compiler, traced here.

Under ``_xla.tracing_replica(rank, world, "TPU")`` a step traced on this process's XLA:CPU device
is replica ``rank``'s TPU program (collectives in the TPU form, shards sized for ``world``). It is
never run: ``export_step`` writes its HLO, which ``tpu_compiler.py`` compiles for a TPU topology in
a process of its own (docs/tpu.md). Two things differ between the HLO torch_xla prints for pending
tensors and the program a real TPU sync compiles, and the export puts them right:

* **Aliasing.** A sync donates the buffer of every tensor it updates in place (parameters,
  optimizer state): torch_xla's graph executor marks each such output as aliasing its input.
  ``_get_xla_tensors_hlo`` prints no aliasing, and without it every such buffer counts twice
  (argument and output). Which HLO parameter holds which tensor: torch_xla numbers a graph's
  parameters in the post order of its device-data nodes, the order
  ``_get_tensors_xla_device_data_node`` lists them in (checked against the parameters' shapes).
* **Output shardings** (SPMD traces only). A sync compiles an SPMD program with each output's
  sharding; the printed HLO carries the parameters' but not the outputs', so the partitioner would
  make every output whole (and a donated sharded input could not alias it). The export annotates
  the root with each output's sharding (``_get_xla_sharding_spec``; none is replicated).
* **Placeholders** (``_xla.placeholder``). A trace reads shapes, so the parameters (shards, or
  SPMD's full parameters) and the optimizer state are placeholders that hold no buffer: a model
  of any size traces here. torch_xla cannot shard a placeholder's data (there is none), so an SPMD
  one carries its sharding as a ``Sharding`` custom call, and the export gives the parameter that
  sharding, as torch_xla prints a sharded buffer's.
* **f64.** Python scalars (learning rates, bias corrections) are traced as f64 on an XLA:CPU
  device and as f32 on a TPU (torch_xla's ``MaybeDowncastToXlaDeviceType``: TPUs have no f64).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

import torch
import torch_xla

from . import _xla, tpu_compiler

if TYPE_CHECKING:
    from .fsdp import XlaFullyShardedDataParallel

_ENTRY = re.compile(r"^ENTRY [^\n]*\((?P<params>[^)]*)\) -> ", re.M)
_PARAM_SHAPE = re.compile(r"(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[0-9,]*)\]")
_MODULE_LINE = re.compile(r"^HloModule (?P<name>[^\s,]+)", re.M)
_ENTRY_ROOT = re.compile(r"^(?P<root>  ROOT [^\n]* tuple\([^\n]*\))$", re.M)


def xla_tensors(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    """The optimizer's state tensors that live on an XLA device (what its step updates in place)."""
    return [
        t
        for state in optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor) and t.device.type == "xla"
    ]


def placeholder_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every trainable parameter of ``optimizer`` (Adam or AdamW) its state as after a first
    step, in placeholders (``_xla.placeholder``): a steady step reads and donates that state, and a
    trace reads its shapes only, so nothing is allocated or run. An SPMD parameter's state takes
    its sharding (as the state a real first step makes of it).
    """
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise TypeError(f"a traced step's optimizer state is made for Adam and AdamW, not {type(optimizer).__name__}")
    for group in optimizer.param_groups:
        if group["capturable"] or group["fused"]:
            raise ValueError("a traced step's optimizer state keeps AdamW's step on the CPU: no capturable or fused")
        moments = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group["amsgrad"] else [])
        for p in group["params"]:
            if p.requires_grad:
                sharding = torch_xla._XLAC._get_xla_op_sharding(p)
                state = {m: _xla.placeholder(p.shape, p.dtype, sharding) for m in moments}
                optimizer.state[p] = {"step": torch.tensor(1.0), **state}


class Donations:
    """The tensors a step updates in place, recorded before it is traced (an in-place update
    gives a tensor a new id, so the id it has now names its input buffer)."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.before: Dict[int, int] = {id(t): torch_xla._XLAC._xla_get_tensor_id(t) for t in tensors}

    @classmethod
    def of_step(cls, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> Donations:
        """A training step's: the model's parameters and the optimizer's state."""
        state = xla_tensors(optimizer) if optimizer is not None else []
        return cls([*model.parameters(), *state])


@dataclass(frozen=True)
class ExportedProgram:
    path: Path
    parameters: int
    outputs: int
    aliased: int  # outputs donated their input's buffer
    argument_bytes: int  # of its parameters: what a chip holds as its arguments (see export_step)


def export_step(outputs: Sequence[torch.Tensor], donations: Optional[Donations], path: Path) -> ExportedProgram:
    """Write the HLO of the pending graph that computes ``outputs`` to ``path``, as a real sync
    would compile it: each output that is a donated tensor aliases its input, f64 is f32.

    ``outputs``: what the sync would materialize (the loss, the parameters, the optimizer state;
    not gradients set to None). Nothing runs. The outputs then become placeholders of their shapes:
    their pending graph holds collectives that cannot run here, and may read placeholders, and a
    wrapped model outlives ``gc.collect()`` (its hooks on autograd's nodes close a cycle through
    C++ that Python's collector cannot see), so a later sync would run it. Drop the step's tensors
    all the same.
    """
    outputs = list(outputs)
    text = torch_xla._XLAC._get_xla_tensors_hlo(outputs)
    param_ids, param_data = torch_xla._XLAC._get_tensors_xla_device_data_node(outputs)
    _check_parameter_order(text, param_data)
    aliases = _aliases(outputs, param_ids, donations) if donations is not None else {}
    text = _with_aliases(text, aliases).replace("f64[", "f32[")
    text = _with_output_shardings(_with_parameter_shardings(text), outputs)
    path = Path(path)
    path.write_text(text)
    _xla.replace_data(outputs, [_xla.placeholder(t.shape, t.dtype) for t in outputs])
    _xla.traced_graph_exported()
    # The entry's parameters' bytes: the compiler's argument figure for ours, whose shards are
    # whole tiles (issue 25's Llama: 175.6 MB both).
    entry = _ENTRY.search(text)
    assert entry is not None, "an HLO module has an ENTRY computation"
    arguments: int = sum(tpu_compiler.array_bytes(entry["params"]))
    return ExportedProgram(path, len(param_ids), len(outputs), len(aliases), arguments)


def export_training_step(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    path: Path,
    autocast: bool = False,
    optimizer_in_backward: bool = False,
) -> ExportedProgram:
    """Trace one steady training step of a causal LM on ``input_ids`` (their own labels):
    forward, backward, AdamW with its state present (placeholders), and export it
    (``export_step``). Nothing runs. ``autocast``: under ``torch.autocast`` in bf16 (for a
    model that has no compute dtype of its own, as SPMD's). ``optimizer_in_backward``: ours,
    AdamW stepping each unit in backward (``apply_optimizer_in_backward``)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    placeholder_optimizer_state(optimizer)
    if optimizer_in_backward:
        model.apply_optimizer_in_backward(optimizer)  # type: ignore[operator]
    donations = Donations.of_step(model, optimizer)
    with torch.autocast("xla", dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return export_step([loss, *model.parameters(), *xla_tensors(optimizer)], donations, path)


def export_spmd_training_step(
    model: torch.nn.Module,
    chips: int,
    batch_per_chip: int,
    seq: int,
    path: Path,
    checkpoint: bool = False,
    autocast: bool = False,
) -> ExportedProgram:
    """torch_xla's SPMD FSDPv2 (``SpmdFullyShardedDataParallel``) on ``model``'s training step,
    exported whole (``export_training_step``) for the compiler to partition over ``chips``.

    Needs ``chips`` XLA:CPU devices in this process (``_xla.cpu_device_env``), one per chip, and
    no XLA tensor created before (``xr.use_spmd()`` must come first). ``model`` (on the CPU):
    each of its blocks (``_no_split_modules``) wrapped, checkpointed with ``checkpoint``, over a
    mesh ("fsdp", "model") of (chips, 1), the batch and the logits sharded along "fsdp", as in
    ``scripts/benchmark.py``. ``autocast``: bf16 under ``torch.autocast`` (SPMD has no compute
    dtype of its own).
    """
    import numpy as np
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr
    from torch_xla.distributed.fsdp import checkpoint_module
    from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel as SpmdFsdp

    xr.use_spmd()
    if xr.global_runtime_device_count() != chips:
        raise RuntimeError(f"{chips} XLA:CPU devices needed, one per chip (_xla.cpu_device_env({chips}))")
    mesh = xs.Mesh(np.arange(chips), (chips, 1), ("fsdp", "model"))
    _shard_as_placeholders(model, mesh)
    model = model.to(torch_xla.device())  # its buffers
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = {type(m) for m in model.modules() if type(m).__name__ in names}

    def shard_logits(output: object, mesh: xs.Mesh) -> None:
        logits = output if isinstance(output, torch.Tensor) else output.logits  # type: ignore[attr-defined]
        xs.mark_sharding(logits, mesh, ("fsdp",) + (None,) * (logits.dim() - 1))

    def wrap_block(m: torch.nn.Module, *args: Any, **kwargs: Any) -> SpmdFsdp:
        return SpmdFsdp(checkpoint_module(m) if checkpoint else m, *args, **kwargs)

    wrapped = SpmdFsdp(
        model,
        mesh=mesh,
        shard_output=shard_logits,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=blocks),
        auto_wrapper_callable=wrap_block,
    )
    ids = _xla.placeholder((chips * batch_per_chip, seq), torch.long, mesh.get_op_sharding(("fsdp", None)))
    return export_training_step(wrapped, ids, path, autocast=autocast)


def _shard_as_placeholders(model: torch.nn.Module, mesh: Any) -> None:
    """Replace ``model``'s parameters (tied ones stay one) by placeholders sharded on ``mesh`` as
    ``SpmdFullyShardedDataParallel`` shards a parameter (its largest dimension along "fsdp"),
    which then leaves them as they are: no chip's shard is ever in memory here."""
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import _prepare_spmd_partition_spec

    made: Dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is None:
                continue
            if id(p) not in made:
                sharding = mesh.get_op_sharding(_prepare_spmd_partition_spec(p, shard_maximal=True))
                made[id(p)] = torch.nn.Parameter(_xla.placeholder(p.shape, p.dtype, sharding), p.requires_grad)
            module._parameters[name] = made[id(p)]


def _aliases(outputs: List[torch.Tensor], param_ids: Sequence[int], donations: Donations) -> Dict[int, int]:
    """Output index -> the parameter number of the buffer it takes over."""
    parameter_of = {tensor_id: i for i, tensor_id in enumerate(param_ids)}
    aliases: Dict[int, int] = {}
    for index, tensor in enumerate(outputs):
        before = donations.before.get(id(tensor))
        if before is not None and before in parameter_of:
            aliases[index] = parameter_of[before]
    return aliases


def _check_parameter_order(text: str, param_data: Sequence[torch.Tensor]) -> None:
    """The device-data nodes and the entry's parameters agree in count and shapes (the aliasing
    rests on their order)."""
    entry = _ENTRY.search(text)
    assert entry is not None, "an HLO module has an ENTRY computation"
    shapes = [tuple(int(d) for d in m["dims"].split(",") if d) for m in _PARAM_SHAPE.finditer(entry["params"])]
    data_shapes = [tuple(t.shape) for t in param_data]
    if shapes != data_shapes:
        raise RuntimeError(
            "torch_xla's device-data nodes do not match the HLO's parameters "
            f"({len(data_shapes)} against {len(shapes)}): cannot tell which buffers a sync would donate"
        )


def _with_aliases(text: str, aliases: Dict[int, int]) -> str:
    if not aliases:
        return text
    entries = ", ".join(f"{{{out}}}: ({param}, {{}}, may-alias)" for out, param in sorted(aliases.items()))
    return _MODULE_LINE.sub(lambda m: f"HloModule {m['name']}, input_output_alias={{ {entries} }}", text, count=1)


_SHARDING_CALL = re.compile(
    r"custom-call\([^)%]*%(?P<param>[\w.-]+)\), custom_call_target=\"Sharding\", sharding=(?P<sharding>\{[^{}]*\})"
)


def _with_parameter_shardings(text: str) -> str:
    """Give each entry parameter read through a ``Sharding`` custom call (an SPMD placeholder,
    ``_xla.placeholder``) that sharding, as torch_xla prints a parameter whose data is sharded
    (the custom call stays: a no-op on a value already so sharded)."""
    sharding_of = {m["param"]: m["sharding"] for m in _SHARDING_CALL.finditer(text)}

    def annotate(line: re.Match) -> str:
        sharding = sharding_of.get(line["name"])
        return line[0] if sharding is None else f"{line[0]}, sharding={sharding}"

    return re.sub(r"^  %(?P<name>[\w.-]+) = [^\n]* parameter\(\d+\)$", annotate, text, flags=re.M)


def _with_output_shardings(text: str, outputs: List[torch.Tensor]) -> str:
    """Annotate the entry's root tuple with the outputs' SPMD shardings (unchanged when none is
    sharded: a replica's program)."""
    specs = [torch_xla._XLAC._get_xla_sharding_spec(t) for t in outputs]
    if not any(specs):
        return text
    entry = _ENTRY.search(text)
    root = _ENTRY_ROOT.search(text, entry.end()) if entry else None
    assert root is not None, "the entry computation returns a tuple"
    sharding = ", ".join(spec or "{replicated}" for spec in specs)
    return text[: root.end()] + f", sharding={{{sharding}}}" + text[root.end() :]


def communication_floor(root: XlaFullyShardedDataParallel, training: bool = True, micro_batches: int = 1) -> float:
    """The ring traffic per chip (bytes sent) below which no FSDP step of ``root`` goes: each
    parameter gathered once per forward and, training, once again per backward unless its unit
    keeps it (the root with ``disable_reshard_on_root``, or ``reshard_after_forward=False``; not
    a table kept sharded, ``keep_vocabulary_sharded``, which is gathered a chunk at a time), in
    the compute dtype; each trainable gradient reduce-scattered once per step (``micro_batches``
    minus one of them under ``no_sync``), in the reduce dtype. Tensors padded as sharded. On a
    ring of n chips a gather or a reduce-scatter of a full tensor of S bytes sends (n - 1) / n * S.
    """
    total = 0.0
    for _, unit in root.unit_state.named_units():
        n = unit.sharding.world_size
        options = unit.options
        keeps = not options.reshard_after_forward or (unit.is_root and options.disable_reshard_on_root)
        for group in unit.param_groups:
            gathers = (2 if training and not (keeps and not group.kept_sharded) else 1) * micro_batches
            full = group.shard.numel() * n
            total += gathers * (n - 1) / n * full * _dtype_bytes(options.compute_dtype)
            if training and group.requires_grad:
                total += (n - 1) / n * full * _dtype_bytes(options.reduce_dtype)
    return total


def keeps_a_table_sharded(root: XlaFullyShardedDataParallel) -> bool:
    """Whether a unit of ``root`` computes a table from its shard (``keep_vocabulary_sharded``)."""
    return any(group.kept_sharded for _, unit in root.unit_state.named_units() for group in unit.param_groups)


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
