"""The root's vocabulary tables computed from their dim-0 shards, never gathered whole
(``keep_vocabulary_sharded``).

FSDP gathers a unit's parameters whole for its computation. In the root of a causal LM those are
the embedding and lm_head, vocabulary x hidden each: the largest values in a TPU step's plan, and
under gradient checkpointing all that separates ours from SPMD FSDPv2's (docs/tpu.md). With dim-0
shards replica r holds rows [r * R, (r + 1) * R) of a table (padded to N * R rows), and both
modules can be computed from those rows:

* Embedding: every replica's token ids are all-gathered; each replica looks them up in its own
  rows (zero for the others') and the rows are reduce-scattered back to the replicas whose tokens
  they are. A token's vector comes from one replica and zeros from the rest: the sum is exact.
  Backward all-gathers the tokens' gradient rows, and each replica adds up those of the ids in its
  rows: the reduce-scatter of the replicas' dense gradient tables, restricted to its shard, in
  another order of addition. When the replicas' tokens outnumber the table's rows, that moves and
  holds more than the table itself, and the table is gathered whole as FSDP does.
* Linear (lm_head): its rows are gathered a chunk at a time, the same rows of every replica's
  shard (``_xla.reduce_scatter_row_chunks``), each chunk multiplied into its columns of the output
  and dropped. Backward gathers each chunk again, adds its part of the input's gradient and
  reduce-scatters its part of the weight's gradient as it is made. Optimization barriers chain the
  chunks: without them the TPU compiler merged per-chunk products back into one whole table
  (docs/tpu.md).

The shard is the autograd input, so its gradient arrives reduced (the mean over replicas, as the
reduce-scatter gives) through autograd's own accumulation: under ``no_sync`` it is reduced at every
micro-batch. The module's full parameter stays unused (the unit does not gather it for compute);
``summon_full_params`` and state dicts gather it as before.

Every replica traces the same program: a replica's first row is a device tensor, not a constant
(see the platform note).
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import _xla
from .param_group import ShardedParamGroup

_TABLE = "_accel_xla_fsdp_sharded_table"


class ShardedTable:
    """One module's table kept as its group's shard; set on the module (``attach``)."""

    def __init__(self, group: ShardedParamGroup) -> None:
        self.group = group
        self.rows = group.slots[0].shape[0]  # the table's own rows, without the padding
        self._first_row: Optional[torch.Tensor] = None  # this replica's first row, on the device

    @property
    def world(self) -> int:
        return self.group.sharding.world_size

    def weight(self, shard: torch.Tensor) -> torch.Tensor:
        return shard.to(self.group.options.compute_dtype)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        sharding, options = self.group.sharding, self.group.options
        return _xla.all_gather(tensor, sharding.groups, options.pin_layout_in_collective_ops)

    def local_ids(self, ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Every replica's ``ids`` (flat), as rows of this replica's shard (0 where not its own),
        and which of them are its own."""
        every = self.all_gather(ids.to(torch.int32))  # int32: what a TPU's collectives move natively
        part_rows = self.group.shard.size(0)
        if self._first_row is None:
            start = self.group.sharding.rank * part_rows
            self._first_row = torch.tensor(start, dtype=torch.int32, device=ids.device)
        local = every - self._first_row
        mine = (local >= 0) & (local < part_rows)
        return torch.where(mine, local, 0).long(), mine


def attach(module: nn.Module, group: ShardedParamGroup) -> None:
    setattr(module, _TABLE, ShardedTable(group))


def table_of(module: nn.Module) -> Optional[ShardedTable]:
    """``module``'s table, when its group is kept sharded now (only the root's is)."""
    table = module.__dict__.get(_TABLE)
    return table if table is not None and table.group.kept_sharded else None


# -- embedding ------------------------------------------------------------------------------


def embedding(table: ShardedTable, ids: torch.Tensor, padding_idx: Optional[int]) -> torch.Tensor:
    shard = table.group.shard
    if torch.is_grad_enabled() and shard.requires_grad:
        return _EmbeddingFromShard.apply(ids, shard, table, padding_idx)
    with torch.no_grad():
        return _EmbeddingFromShard.forward(NoBackward(), ids, shard, table, padding_idx)


class NoBackward:
    """Stands for autograd's context where there is no backward (evaluation)."""

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        pass


class _EmbeddingFromShard(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, ids: torch.Tensor, shard: torch.Tensor, table: ShardedTable, padding_idx: Optional[int]
    ) -> torch.Tensor:
        flat = ids.reshape(-1)
        weight = table.weight(shard)
        ctx.table, ctx.padding_idx, ctx.whole = table, padding_idx, flat.numel() >= shard.size(0)
        if ctx.whole:  # more tokens than rows: the table moves less (module docstring)
            ctx.save_for_backward(flat)
            out = F.embedding(flat, table.all_gather(weight))
        else:
            local, mine = table.local_ids(flat)
            ctx.save_for_backward(flat, local, mine)
            rows = F.embedding(local, weight).masked_fill(~mine.unsqueeze(1), 0)
            out = table.group.reduce_scatter(rows, 1.0)  # one replica's row and zeros: exact
        return out.view(*ids.shape, weight.size(1))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        table: ShardedTable = ctx.table
        flat = ctx.saved_tensors[0]
        rows = grad.reshape(-1, grad.size(-1)).to(table.group.options.reduce_dtype)
        if ctx.padding_idx is not None:  # rows of padding ids add nothing, as in autograd's backward
            rows = rows.masked_fill((flat == ctx.padding_idx).unsqueeze(1), 0)
        part_rows, world = table.group.shard.size(0), table.world
        if ctx.whole:
            dense = rows.new_zeros(world * part_rows, rows.size(1)).index_put((flat,), rows, accumulate=True)
            return None, table.group.reduce_scatter(dense, 1.0 / world), None, None
        _, local, mine = ctx.saved_tensors
        every = table.all_gather(rows).masked_fill(~mine.unsqueeze(1), 0)
        grad_shard = every.new_zeros(part_rows, rows.size(1)).index_put((local,), every, accumulate=True)
        return None, grad_shard * (1.0 / world), None, None


# -- linear ---------------------------------------------------------------------------------


def linear(table: ShardedTable, input: torch.Tensor) -> torch.Tensor:
    """``input @ weight.T`` for the table's Linear, its weight gathered in chunks (no bias)."""
    shard = table.group.shard
    if torch.is_grad_enabled() and (shard.requires_grad or input.requires_grad):
        return _LinearFromShard.apply(input, shard, table)
    with torch.no_grad():
        return _LinearFromShard.forward(NoBackward(), input, shard, table)


def row_chunks(table: ShardedTable, width: int) -> List[Tuple[int, int]]:
    return _xla.reduce_scatter_row_chunks(table.group.shard.size(0), width)


def chunk_product(table: ShardedTable, x: torch.Tensor, rows: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """``x`` times a chunk's gathered ``rows`` (rows [start, stop) of every replica's part): its
    columns of the output, as [tokens, replicas, stop - start]."""
    return torch._C._nn.linear(x, rows).view(x.size(0), table.world, stop - start)


def chained_after(previous: List[torch.Tensor], tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    """``tensors``, barriered with ``previous`` (the chunk before's results, when there is one)
    as stand-ins, so the compiler keeps the chunks apart and in order."""
    return _xla.optimization_barrier_(previous, read_only=tensors) if previous else tensors


# Logits of at most this many bytes a chip are written a chunk at a time with index_copy_, which
# torch_xla traces as a scatter the TPU compiler does in place and keeps on chip: issue 25's Llama
# (512 tokens, vocabulary 32,000; 65.5 MB in f32) then plans less than SPMD FSDPv2 on v5e-8, where
# the slice assignments' select fusions put the f32 logits in HBM at the step's peak (232 MB less
# over 10 of its 16 steps on four slices, 26 MB more over 6). Larger ones (a real model's: 525 MB
# for Llama-3 at 2,048 tokens in bf16) cannot be on chip, and in place they planned more
# (Llama-3.1-8B on v5e-8, Llama-3.2-1B in fp32), so they keep the slice assignments (docs/tpu.md,
# "Small logits written in place").
IN_PLACE_LOGITS_BYTES = 64 << 20


class _LinearFromShard(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, shard: torch.Tensor, table: ShardedTable) -> torch.Tensor:
        x = input.reshape(-1, input.size(-1))
        weight = table.weight(shard)
        ctx.save_for_backward(x, shard)
        ctx.table, ctx.input_shape = table, input.shape
        # The logits as [tokens, vocabulary], each chunk's columns assigned into them: built as
        # [tokens, replica, row of its part] they were a second copy on a TPU, where a part's rows
        # are not whole 128-wide tiles (docs/tpu.md, "v6e"). torch_xla traces a slice assignment as
        # a pad and a select, not in place; small logits are written in place instead (below).
        columns = x.new_empty(x.size(0), table.rows)
        in_place = columns.numel() * columns.element_size() <= IN_PLACE_LOGITS_BYTES
        previous: List[torch.Tensor] = []
        for start, stop in row_chunks(table, x.size(1)):
            (part,) = chained_after(previous, [weight[start:stop]])
            product = chunk_product(table, x, table.all_gather(part), start, stop)
            spans = table.group.chunk_column_spans(start, stop, table.rows)
            if in_place:
                # Only the last replica's part has padding rows, at its end: the chunk's own
                # columns are a prefix of the product's, replica by replica.
                index = torch.cat([torch.arange(first, last, device=x.device) for first, last in spans])
                columns.index_copy_(1, index, product.reshape(x.size(0), -1)[:, : index.numel()])
            else:
                for replica, (first, last) in enumerate(spans):
                    if first < last:
                        columns[:, first:last] = product[:, replica, : last - first]
            previous = [columns]
        # A barrier on the logits: without it the TPU compiler fused their making with the loss's
        # `logits.float()` into an f32 copy of the logits, held until the loss's backward read it
        # (docs/tpu.md, "v6e").
        (columns,) = _xla.optimization_barrier_([], read_only=[columns])
        return columns.reshape(*input.shape[:-1], table.rows)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        x, shard = ctx.saved_tensors
        table: ShardedTable = ctx.table
        weight = table.weight(shard)
        grad = grad.reshape(-1, grad.size(-1))
        grads = ChunkGradients(table, x, *ctx.needs_input_grad[:2])
        previous: List[torch.Tensor] = []
        for start, stop in row_chunks(table, x.size(1)):
            # The gradient passes the barrier whole and the chunk's columns are taken after it:
            # taken before, the TPU compiler took every chunk's columns as soon as the gradient was
            # made and held them all, a second copy of it (docs/tpu.md, "The logits' gradient").
            part, grad = chained_after(previous, [weight[start:stop], grad])
            columns = table.group.chunk_columns(grad, start, stop)
            previous = grads.add(columns, lambda: table.all_gather(part), start, stop)
        return (*grads.result(ctx.input_shape), None)


class ChunkGradients:
    """lm_head's gradients made a chunk at a time in its backward: the input's, the sum of the
    chunks' products in f32, and the weight's shard, each chunk's reduced rows written into it."""

    def __init__(self, table: ShardedTable, x: torch.Tensor, for_input: bool, for_weight: bool) -> None:
        self.table, self.x, self.for_input, self.for_weight = table, x, for_input, for_weight
        self.input: Optional[torch.Tensor] = None
        # Written in place as the chunks arrive: made as torch.cat of the chunks, the TPU compiler
        # held every chunk apart until it built the shard late in backward (+246 MB temp for
        # Llama-3.1-8B's dimensions on v5p-8; docs/tpu.md, "lm_head's gradient shard written in
        # place").
        self.weight: Optional[torch.Tensor] = None

    def add(
        self, columns: torch.Tensor, rows: Callable[[], torch.Tensor], start: int, stop: int
    ) -> List[torch.Tensor]:
        """Add chunk [start, stop)'s part: ``columns`` its columns of the output's gradient
        ([tokens, replicas, stop - start]), ``rows()`` its gathered rows of the weight (gathered
        only for the input's gradient). Returns the values the next chunk is ordered after."""
        made = []
        if self.for_input:
            partial = columns.reshape(columns.size(0), -1).mm(rows()).float()
            self.input = partial if self.input is None else self.input + partial
            made.append(self.input)
        if self.for_weight:
            group = self.table.group
            reduced = group.reduce_scatter(group.weight_grad_chunk(columns, self.x), 1.0 / self.table.world)
            if self.weight is None:
                self.weight = reduced.new_zeros(group.shard.size(0), reduced.size(1))
            self.weight[start:stop] = reduced
            made.append(self.weight)
        return made

    def result(self, input_shape: torch.Size) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The input's gradient (in the input's dtype and shape) and the weight's shard."""
        grad_input = None if self.input is None else self.input.to(self.x.dtype).view(input_shape)
        return grad_input, self.weight
