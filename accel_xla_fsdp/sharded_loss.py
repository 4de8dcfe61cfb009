"""A causal LM's loss computed from lm_head's shard a chunk at a time, its logits never whole
(``lm_loss_in_chunks``; with ``keep_vocabulary_sharded``).

transformers computes the loss from the logits (tokens x vocabulary), and autograd makes their
gradient whole, the softmax less the one-hot labels, before lm_head's backward reads it. On a TPU
the f32 logits and that gradient are the largest values of a step: for Llama-3.1-8B at sequence
2048, 1,051 MB and (as the bf16 operand of lm_head's matmuls) 525 MB per chip, both live at the
fp32 step's peak, the gradient held through lm_head's chunked backward (docs/tpu.md).

Here the loss takes lm_head's rows in the chunks of sharded_tables.py. Forward multiplies each
chunk into its columns of the logits, folds them into each token's running log-sum-exp and picks
the label's logit, then drops them. Backward computes each chunk's columns again, makes that
chunk of the logits' gradient from them and the saved log-sum-exp, and passes it straight into
the chunk's part of the input's gradient and the weight's reduce-scatter, as lm_head's own
backward does. lm_head's output (the model's ``logits``) is still traced, but nothing of the loss
reads it: unless the script keeps it, the compiler drops it.

It takes over transformers' ``ForCausalLMLoss`` only, through the model's own ``loss_function``
setter, and only for logits that are lm_head's output as it made them (``note_logits``): a loss
of the user's, a bias added to the logits or Gemma-2's soft-capping leave the loss to transformers.
The loss equals transformers' to rounding: the log-sum-exp is added up a chunk at a time.

Off by default: the TPU compiler planned issue 25's small Llama in less with it while its f32
logits were in HBM at the peak (since they are written in place, on chip, the default plans less),
and it plans the real models' checkpointed steps a little more: their peak moves into a decoder
layer's backward while the heap is packed no tighter (docs/tpu.md, "The loss from lm_head's
chunks").
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .sharded_tables import ChunkGradients, NoBackward, ShardedTable, chained_after, chunk_product, row_chunks

_LOGITS_OF = "_accel_xla_fsdp_logits_of"


def note_logits(logits: torch.Tensor, input: torch.Tensor, table: ShardedTable) -> torch.Tensor:
    """Note on lm_head's output what it was computed from, for the loss to start from."""
    setattr(logits, _LOGITS_OF, (input, table))
    return logits


def install(model: nn.Module) -> None:
    """Give ``model`` the loss of this module if its loss is transformers' ``ForCausalLMLoss``."""
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        return
    if getattr(model, "loss_function", None) is ForCausalLMLoss:  # not a loss of the user's, nor ours
        setattr(model, "loss_function", causal_lm_loss)  # transformers' own setter (PreTrainedModel.loss_function)


def installed(model: nn.Module) -> bool:
    """Whether ``model``'s loss is this module's (``install``)."""
    return getattr(model, "loss_function", None) is causal_lm_loss


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    num_items_in_batch: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    shift_labels: Optional[torch.Tensor] = None,
    **kwargs: Any,
) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss``, from lm_head's shard when ``logits`` are its output."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    made_from = getattr(logits, _LOGITS_OF, None)
    if made_from is None:
        return ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels, **kwargs)
    if shift_labels is None:  # tokens < n predict n, as ForCausalLMLoss shifts them
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    input, table = made_from
    targets = shift_labels.reshape(-1).to(logits.device)
    args = (input, table.group.shard, table, targets, ignore_index, num_items_in_batch)
    if torch.is_grad_enabled():
        return _CrossEntropyFromShard.apply(*args)
    return _CrossEntropyFromShard.forward(NoBackward(), *args)  # no autograd.Function under inference_mode


class _CrossEntropyFromShard(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        shard: torch.Tensor,
        table: ShardedTable,
        targets: torch.Tensor,
        ignore_index: int,
        num_items: Optional[torch.Tensor],
    ) -> torch.Tensor:
        x = input.reshape(-1, input.size(-1))
        weight = table.weight(shard)
        labels = targets.view(-1, 1, 1)
        # Per token: the largest logit so far, the sum of exp(logit - it), and the label's logit.
        top = x.new_full((x.size(0),), float("-inf"), dtype=torch.float32)
        total, picked = torch.zeros_like(top), torch.zeros_like(top)
        previous: List[torch.Tensor] = []
        for start, stop in row_chunks(table, x.size(1)):
            (part,) = chained_after(previous, [weight[start:stop]])
            ids, scores = _chunk_logits(table, x, table.all_gather(part), start, stop)
            scores = scores.masked_fill(ids >= table.rows, float("-inf"))
            new_top = torch.maximum(top, scores.amax(dim=(1, 2)))
            total = total * torch.exp(top - new_top) + torch.exp(scores - new_top.view(-1, 1, 1)).sum(dim=(1, 2))
            picked = picked + torch.where(ids == labels, scores, 0.0).sum(dim=(1, 2))
            top = new_top
            previous = [top, total, picked]
        log_sum_exp = top + torch.log(total)
        valid = targets != ignore_index
        # ForCausalLMLoss's reductions: the mean over the labels, or the sum over num_items.
        divisor = valid.sum() if num_items is None else torch.as_tensor(num_items, device=x.device)
        divisor = divisor.to(log_sum_exp.dtype)
        ctx.save_for_backward(input, shard, log_sum_exp, targets, valid, divisor)
        ctx.table = table
        return torch.where(valid, log_sum_exp - picked, 0.0).sum() / divisor

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        input, shard, log_sum_exp, targets, valid, divisor = ctx.saved_tensors
        table: ShardedTable = ctx.table
        x = input.reshape(-1, input.size(-1))
        weight = table.weight(shard)
        labels = targets.view(-1, 1, 1)
        log_sum_exp = log_sum_exp.view(-1, 1, 1)
        # d loss / d logit = scale * (softmax - one-hot), the scale per token (0 where ignored).
        scale = torch.where(valid, grad_loss / divisor, 0.0).view(-1, 1, 1)
        grads = ChunkGradients(table, x, *ctx.needs_input_grad[:2])
        previous: List[torch.Tensor] = []
        for start, stop in row_chunks(table, x.size(1)):
            (part,) = chained_after(previous, [weight[start:stop]])
            rows = table.all_gather(part)
            ids, scores = _chunk_logits(table, x, rows, start, stop)
            probs = torch.exp(scores - log_sum_exp).masked_fill(ids >= table.rows, 0.0)
            # The logits' gradient in their dtype (the compute dtype), as autograd's through the
            # upcast in ForCausalLMLoss.
            grad = (probs * scale - torch.where(ids == labels, scale, 0.0)).to(weight.dtype)
            previous = grads.add(grad, lambda: rows, start, stop)
        return (*grads.result(input.shape), None, None, None, None)


def _chunk_logits(
    table: ShardedTable, x: torch.Tensor, rows: torch.Tensor, start: int, stop: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """A chunk's columns of the logits, upcast as ForCausalLMLoss upcasts them ([tokens, replicas,
    stop - start]; ``rows`` its gathered rows of lm_head), and each column's vocabulary id."""
    return _column_ids(table, start, stop, x.device), chunk_product(table, x, rows, start, stop).float()


def _column_ids(table: ShardedTable, start: int, stop: int, device: torch.device) -> torch.Tensor:
    """The vocabulary id of each column of a chunk's logits, [1, replicas, stop - start]: replica
    r's rows [start, stop) of its part (ids from the table's rows on are padding)."""
    part_rows = table.group.shard.size(0)
    replicas = torch.arange(table.world, device=device).view(1, -1, 1) * part_rows
    return replicas + torch.arange(start, stop, device=device).view(1, 1, -1)
