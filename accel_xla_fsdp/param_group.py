"""A group of parameters that are gathered, freed and reduce-scattered together as one shard.

[Note: full parameters and shards]
The modules keep using ordinary ``nn.Parameter`` objects (the *full parameters*), but these are
no longer registered with their modules, and between uses the XLA tensor behind each is a
1-element placeholder. Gathering points them at slices of an all-gathered tensor; freeing points
them back at the placeholder, so nothing in Python holds the gathered value and the compiler can
reuse its memory. Autograd only ever sees the full parameters as leaves: their ``.grad`` is the
full gradient of this replica's batch, which is reduce-scattered into the ``.grad`` of the group's
shard, the one ``nn.Parameter`` the optimizer sees. The collectives themselves, for one group or
several of a unit at once, are in collectives.py.

Two layouts:
* flat: the group's parameters (one, or all of a unit's when ``flatten_parameters``) are
  flattened, concatenated, padded to a multiple of ``world_size * shard_size_multiple`` elements
  and split evenly: replica r holds elements [r * s, (r + 1) * s).
* dim 0: one parameter, padded along dim 0 to a multiple of ``world_size`` rows and split by rows,
  so each shard keeps the parameter's trailing shape.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Set, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import _xla
from .options import FsdpOptions, ShardingGroup

SHARD_NAME_SEPARATOR = "_FSDP_SHARD_SEPARATOR_"


@dataclass
class ParamSlot:
    """One full parameter inside a group."""

    param: nn.Parameter
    name: str  # relative to the unit's wrapped module, e.g. "mlp.fc1.weight"
    shape: torch.Size
    offset: int  # into the unpadded flat tensor (flat layout)
    aliases: Tuple[str, ...] = ()  # other names of the same (tied) parameter, relative likewise

    @property
    def numel(self) -> int:
        return self.shape.numel()


@dataclass(frozen=True)
class ShardSpec:
    """How to reassemble a group's full tensor from its shards: what a checkpoint must record.

    Its fields follow torch_xla's shard metadata: ``orig_name`` is the tensor's name under the
    unit (``_fsdp_wrapped_module.<param>`` or ``_fsdp_wrapped_module.flat_param_<i>``) and
    ``orig_size`` its unpadded size. A flat parameter also lists what it concatenates.
    """

    shard_name: str
    orig_name: str
    orig_size: torch.Size
    dim0: bool
    flat_names: Optional[Tuple[str, ...]] = None
    flat_shapes: Optional[Tuple[torch.Size, ...]] = None


def shard_param_name(orig_name: str) -> str:
    """The registered name of a shard: torch_xla's, which its consolidation tool recognizes."""
    return f"_fsdp_shard.{orig_name}".replace(".", SHARD_NAME_SEPARATOR)


class ShardedParamGroup:
    """Full parameters (``slots``) and this replica's shard of them (``shard``)."""

    def __init__(
        self,
        slots: List[ParamSlot],
        full_values: Sequence[torch.Tensor],
        spec: ShardSpec,
        options: FsdpOptions,
        sharding: ShardingGroup,
        device: torch.device,
        requires_grad: bool,
    ) -> None:
        self.slots = slots
        self.spec = spec
        self.options = options
        self.sharding = sharding
        self.gathered = False
        # The root's vocabulary table computed from the shard (sharded_tables.py): not gathered
        # for compute; set by the root state.
        self.kept_sharded = False
        self._grads_seen = 0
        self._requires_grad = requires_grad
        self.grad_hooked: Set[int] = set()  # ids of the full parameters whose gradient is hooked
        self._rank_index: Optional[torch.Tensor] = None  # made on first write-back
        self._placeholder = torch.zeros(1, dtype=options.compute_dtype, device=device)
        if any(v.is_meta for v in full_values):
            # A ShardSource fills the shard (the unit sets its data): only its layout is needed,
            # and real values beside meta ones (a new head beside pretrained weights) cannot be joined.
            full_values = [v.to("meta") for v in full_values]
        with torch.no_grad():
            shard = self._local_shard(self._pad(self._join(full_values)))
            if shard.is_meta:  # built on the meta device: the unit sets the shard's data
                shard = torch.zeros(shard.shape, dtype=shard.dtype, device=device)
            self.shard = nn.Parameter(shard.to(device), requires_grad=requires_grad)
        _xla.replace_data(self.full_params, [self._placeholder] * len(slots))

    # -- layout -----------------------------------------------------------------------------

    def _join(self, values: Sequence[torch.Tensor]) -> torch.Tensor:
        if self.spec.dim0:
            return values[0]
        flat = [v if v.dim() == 1 else v.reshape(-1) for v in values]
        # Every traced op costs each replica host time: a per-parameter group has nothing to join.
        return flat[0] if len(flat) == 1 else torch.cat(flat)

    def _pad(self, full: torch.Tensor) -> torch.Tensor:
        """Pad dim 0 so that it splits evenly (flat: into shard_size_multiple tiles; dim 0: into
        the platform's rows, ``_xla.dim0_rows_multiple``)."""
        rows = _xla.dim0_rows_multiple(full.shape[1:].numel()) if self.spec.dim0 else self.options.shard_size_multiple
        multiple = self.sharding.world_size * rows
        missing = -full.size(0) % multiple
        if missing == 0:
            return full
        return F.pad(full, [0, 0] * (full.dim() - 1) + [0, missing])

    def _local_shard(self, padded: torch.Tensor) -> torch.Tensor:
        rows = padded.size(0) // self.sharding.world_size
        start = self.sharding.rank * rows
        return padded[start : start + rows].clone()

    @functools.cached_property
    def _split_sizes(self) -> List[int]:
        """Flat layout: the slots' lengths in the gathered tensor, then its padding."""
        sizes = [slot.numel for slot in self.slots]
        return sizes + [self.shard.numel() * self.sharding.world_size - sum(sizes)]

    def _views(self, full: torch.Tensor) -> List[torch.Tensor]:
        """Each full parameter's part of the gathered tensor ``full``."""
        if self.spec.dim0:
            return [full[: self.slots[0].shape[0]]]
        # Every traced op costs each replica host time: one split for all slots, none for one
        # parameter without padding, and no view where the piece has the shape already (1-D).
        pieces = [full] if self._split_sizes[1:] == [0] else full.split(self._split_sizes)
        return [piece if len(slot.shape) == 1 else piece.view(slot.shape) for piece, slot in zip(pieces, self.slots)]

    # -- gather and free --------------------------------------------------------------------

    def gather_input(self, shard: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
        """This replica's ``shard`` (``self.shard`` or its barriered stand-in) as the all-gather
        takes it (``collectives.gather_groups``, under ``no_grad``: no detach to trace).

        In ``dtype`` (default: the compute dtype; ``summon_full_params`` gathers in the shard's
        own), and on a TPU's flat layout in torch_xla's (-1, 128) tiles, which gather faster than
        a long vector.
        """
        shard = _in_dtype(shard, dtype or self.options.compute_dtype)
        if self._tiled:
            return shard.view(-1, self.options.shard_size_multiple)
        return shard

    def full_views(self, gathered: torch.Tensor) -> List[torch.Tensor]:
        """Each full parameter's part of the all-gathered ``gather_input``."""
        return self._views(gathered.flatten() if self._tiled else gathered)

    @functools.cached_property
    def _tiled(self) -> bool:
        return not self.spec.dim0 and self.options.shard_size_multiple > 1

    @property
    def full_params(self) -> List[nn.Parameter]:
        return [slot.param for slot in self.slots]

    def local_values(self, read: Callable[[ParamSlot, int, int], torch.Tensor]) -> torch.Tensor:
        """This replica's shard built on the CPU from ``read(slot, start, stop)``, which gives
        elements ``[start, stop)`` of a slot's parameter flattened; padding is zero.

        The shard is elements ``[rank * n, (rank + 1) * n)`` of the group's parameters
        flattened end to end, then padding: see [Note: the virtual full tensor].
        """
        size = self.shard.numel()
        lo, hi = self.sharding.rank * size, (self.sharding.rank + 1) * size
        out = torch.zeros(size, dtype=self.shard.dtype)
        for slot in self.slots:
            start, stop = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if start < stop:
                out[start - lo : stop - lo] = read(slot, start - slot.offset, stop - slot.offset)
        return out.view(self.shard.shape)

    @torch.no_grad()
    def write_back(self) -> None:
        """Copy this replica's part of the (possibly edited) full parameters into the shard.

        The slice is taken at a rank held in a device tensor, not baked into the graph as a
        constant: every replica must trace the same program (see the platform note).
        """
        full = self._pad(self._join([slot.param.detach() for slot in self.slots]))
        world = self.sharding.world_size
        rows = full.size(0) // world
        if self._rank_index is None:
            self._rank_index = torch.tensor([self.sharding.rank], device=self.shard.device)
        local = full.reshape(world, rows, *full.shape[1:]).index_select(0, self._rank_index)[0]
        self.shard.copy_(local.to(self.shard.dtype))

    def follow_requires_grad(self) -> bool:
        """Adopt a freeze or unfreeze made after wrapping, on the shard or on the full parameters;
        returns whether there was one.

        The optimizer sees the shard, the modules the full parameters: whichever of the two the
        user changed, both must agree, or gradients would be computed for a frozen shard (and
        the optimizer would update it) or never computed for a trainable one.
        """
        want = self.shard.requires_grad
        if want == self._requires_grad:
            if all(slot.param.requires_grad == want for slot in self.slots):
                return False  # every forward of every unit asks: the common case first
            flags = {slot.param.requires_grad for slot in self.slots}
            if len(flags) > 1:
                names = ", ".join(f"'{s.name}'={s.param.requires_grad}" for s in self.slots)
                raise ValueError(
                    f"the parameters of one flat shard ({self.spec.orig_name}) disagree on requires_grad "
                    f"({names}): they are sharded together and must be frozen or unfrozen together. "
                    "Freeze the whole unit (unit.requires_grad_(False)), or set requires_grad before "
                    "wrapping, when flatten_parameters keeps frozen and trainable parameters apart."
                )
            want = flags.pop()
            self.shard.requires_grad_(want)
        for slot in self.slots:
            slot.param.requires_grad_(want)
        self._requires_grad = want
        return True

    # -- gradients --------------------------------------------------------------------------

    def note_grad_ready(self) -> bool:
        """Count one full parameter's finished gradient; True once the whole group has one."""
        self._grads_seen += 1
        return self._grads_seen == len(self.slots)

    def forget_grads_seen(self) -> None:
        """End of a backward that keeps its full gradients (no_sync): count afresh next time."""
        self._grads_seen = 0

    @property
    def requires_grad(self) -> bool:
        return self._requires_grad

    @property
    def has_pending_grads(self) -> bool:
        return any(slot.param.grad is not None for slot in self.slots)

    def take_full_grad(self) -> Optional[torch.Tensor]:
        """The full gradients, padded and joined as the reduce-scatter takes them, in the reduce
        dtype; they are dropped from the full parameters. None when no parameter of the group
        received a gradient. Call under ``torch.no_grad()``."""
        self._grads_seen = 0
        grads = [slot.param.grad for slot in self.slots]
        if all(g is None for g in grads):
            return None
        for slot in self.slots:
            slot.param.grad = None
        return _in_dtype(self._pad(self._join(self._fill_missing(grads))), self.options.reduce_dtype)

    def _fill_missing(self, grads: List[Optional[torch.Tensor]]) -> List[torch.Tensor]:
        ref = next(g for g in grads if g is not None)
        return [g if g is not None else ref.new_zeros(s.shape) for g, s in zip(grads, self.slots)]

    def reduce_linear_weight_grad(self, grad_output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
        """This replica's reduced shard of the gradient ``grad_output.t() @ input`` of this group's
        (dim-0, 2-D) weight, in the reduce dtype, computed and reduce-scattered chunk by chunk
        (``_xla.reduce_scatter_row_chunks``): the full gradient is never whole. Call under
        ``torch.no_grad()``.

        ``grad_output`` passes an optimization barrier with the chunk before's gradient, and each
        chunk's columns are taken after it: without the barrier the TPU compiler merged the chunks'
        products back into one full gradient (docs/tpu.md).
        """
        reduced: List[torch.Tensor] = []
        previous: Optional[torch.Tensor] = None
        for start, stop in _xla.reduce_scatter_row_chunks(self.shard.size(0), input.size(1)):
            if previous is not None:  # the columns taken after the barrier, as in sharded_tables.py
                (grad_output,) = _xla.optimization_barrier_([previous], read_only=[grad_output])
            previous = self.weight_grad_chunk(self.chunk_columns(grad_output, start, stop), input)
            reduced.append(self.reduce_scatter(previous, 1.0 / self.sharding.world_size))
        return reduced[0] if len(reduced) == 1 else torch.cat(reduced)

    def chunk_columns(self, grad_output: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """The columns of ``grad_output`` (2-D, a column per row of this group's weight) for rows
        [start, stop) of every replica's part, one chunk of the reduce-scatter, as [tokens,
        replicas, stop - start]; the padding rows' columns are zero.

        Taken a replica's slice at a time: viewing the whole of ``grad_output`` as [tokens,
        replicas, rows of a part] is a second copy of it on a TPU when a part's rows are not whole
        128-wide tiles (Llama-3's 128,256 rows on 8 chips are 16,032 a part; docs/tpu.md, "v6e")."""
        parts = []
        for first, last in self.chunk_column_spans(start, stop, grad_output.size(1)):
            part = grad_output[:, first:last]
            if last - first < stop - start:
                part = F.pad(part, [0, stop - start - (last - first)])
            parts.append(part)
        return torch.stack(parts, dim=1)

    def chunk_column_spans(self, start: int, stop: int, columns: int) -> List[Tuple[int, int]]:
        """For each replica, the columns ``[first, last)`` that rows [start, stop) of its part are
        among ``columns`` (the weight's rows without the padding; an empty span for padding)."""
        rows = self.shard.size(0)
        return [
            (min(replica * rows + start, columns), min(replica * rows + stop, columns))
            for replica in range(self.sharding.world_size)
        ]

    def weight_grad_chunk(self, columns: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
        """One chunk of the weight's gradient as every replica's part holds it: ``columns`` (a chunk
        of ``chunk_columns``) times ``input``, as rows, in the reduce dtype."""
        full = torch.einsum("str,sw->trw", columns, input).reshape(-1, input.size(1))
        return _in_dtype(full, self.options.reduce_dtype)

    def reduce_scatter(self, full: torch.Tensor, scale: float) -> torch.Tensor:
        """This replica's rows of ``full`` summed over the sharding group (a reduce-scatter), times
        ``scale`` (1 / world: the mean)."""
        world = self.sharding.world_size
        pin = self.options.pin_layout_in_collective_ops
        return _xla.reduce_scatter_sum(full, world, scale, self.sharding.groups, pin)

    def add_reduced_grad(self, reduced: torch.Tensor, barrier: bool) -> torch.Tensor:
        """Accumulate this replica's reduced shard of the gradient (in the reduce dtype) into
        ``shard.grad`` (in the shard's); returns it in the narrower of the two dtypes, as it
        passed the barrier. Call under ``torch.no_grad()``."""
        # The barrier takes the gradient in the narrower dtype, and a cast to a wider one comes
        # after it: the TPU compiler makes the value the barrier holds there and keeps it until
        # the optimizer reads it. Cast to f32 before the barrier, a bf16 step of f32 shards held
        # every finished gradient in f32, twice the bytes (issue 25's Llama, checkpointed, v5e-8:
        # 223.6 MB per chip, 220.1 now; docs/tpu.md, "Gradients held in the narrower dtype").
        if reduced.element_size() > self.shard.element_size():
            reduced = reduced.to(self.shard.dtype)
        if barrier:
            _xla.optimization_barrier_([reduced])
        grad = _in_dtype(reduced, self.shard.dtype)
        if self.shard.grad is None:
            self.shard.grad = grad
        else:
            self.shard.grad += grad
        return reduced


def _in_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor.to(dtype)``, without the call when it is in ``dtype`` already (the usual case):
    the call is a dispatch every replica pays for in host time, several times per parameter."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def adopt_gathered(groups: Sequence[ShardedParamGroup], gathered: Sequence[torch.Tensor]) -> None:
    """Point every full parameter of ``groups`` at its slice of its group's ``gathered`` tensor."""
    params: List[nn.Parameter] = []
    views: List[torch.Tensor] = []
    for group, full in zip(groups, gathered):
        params.extend(group.full_params)
        views.extend(group.full_views(full))
        group.gathered = True
    _xla.replace_data(params, views)


def free_groups(groups: Sequence[ShardedParamGroup]) -> None:
    """Point the full parameters of ``groups`` back at their placeholder."""
    gathered = [g for g in groups if g.gathered]
    if not gathered:
        return
    params = [p for g in gathered for p in g.full_params]
    _xla.replace_data(params, [g._placeholder for g in gathered for _ in g.slots])
    for group in gathered:
        group.gathered = False
