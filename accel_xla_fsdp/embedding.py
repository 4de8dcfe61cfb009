"""nn.Embedding whose weight gradient, on XLA:CPU, is built when backward reaches it (issue 27).

[Note: the embedding gradient's zeros]
An embedding's weight gradient is the incoming gradient's rows scatter-added, in the ids' order,
into a [V, H] tensor of zeros. Traced from autograd's ``embedding_dense_backward``, those zeros
depend on nothing, and XLA:CPU's scheduler computes them at the program's start: V x H floats
held through the whole forward and backward, on every replica (Llama 0.16 B, vocab 32000, hidden
1024: 131 MB per replica, measured with torch_xla 2.9 in the step's buffer assignment). On the
CPU, ``EmbeddingFunction`` makes the same scatter-add into zeros that take an exact zero computed
from the incoming gradient (``_xla.order_after``), so the compiler cannot make them before
backward reaches the embedding. The gradient is autograd's bit for bit (tests/test_memory.py).
Elsewhere autograd's own backward stays: a TPU's scheduler plans memory and needs no help.
In the root, FSDP may compute the embedding from its weight's shard instead (sharded_tables.py).

The patch replaces the ``forward`` of each stock ``nn.Embedding`` instance, as linear.py does for
``nn.Linear``: replica threads share one interpreter, so there is no global patch.
"""

from __future__ import annotations

from types import MethodType
from typing import Any, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import _xla, sharded_tables


class EmbeddingFunction(torch.autograd.Function):
    """``F.embedding(ids, weight, padding_idx)`` whose weight gradient's zeros follow the incoming
    gradient (see [Note: the embedding gradient's zeros])."""

    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, weight: torch.Tensor, padding_idx: Optional[int]) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.num_weights, ctx.padding_idx = weight.size(0), padding_idx
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        (ids,) = ctx.saved_tensors
        flat_ids, rows = ids.reshape(-1), grad.reshape(-1, grad.size(-1))
        if ctx.padding_idx is not None:  # rows of padding ids add nothing, as in autograd's backward
            rows = rows.masked_fill((flat_ids == ctx.padding_idx).unsqueeze(1), 0)
        with torch.no_grad():
            zero = _xla.ordering_zero([grad])
        zeros = _xla.order_after(rows.new_zeros(ctx.num_weights, rows.size(1)), zero)
        return None, zeros.index_put((flat_ids,), rows, accumulate=True), None


def _patched_forward(self: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    table = sharded_tables.table_of(self)
    if table is not None:  # FSDP's root computes it from the weight's shard
        return sharded_tables.embedding(table, ids, self.padding_idx)
    if not (torch.is_grad_enabled() and self.weight.requires_grad and _xla.on_cpu()):
        # No weight gradient to build (and an autograd.Function cannot run under inference_mode),
        # or not on the CPU: autograd's own.
        return F.embedding(ids, self.weight, self.padding_idx)
    return EmbeddingFunction.apply(ids, self.weight, self.padding_idx)


def _is_stock_embedding(m: nn.Module) -> bool:
    """An ``nn.Embedding`` running ``nn.Embedding.forward``, whose backward is the dense one that
    reads only ids and gradient: no ``max_norm`` (that forward rewrites the weight), no
    ``scale_grad_by_freq``, no sparse gradient."""
    return (
        isinstance(m, nn.Embedding)
        and type(m).forward is nn.Embedding.forward
        and "forward" not in m.__dict__
        and m.max_norm is None
        and not m.scale_grad_by_freq
        and not m.sparse
    )


def patch_embedding_modules(module: nn.Module) -> int:
    """Give every stock ``nn.Embedding`` under ``module`` the patched forward (``EmbeddingFunction``
    on XLA:CPU, or the root's table from its shard); returns how many."""
    patched = 0
    for m in module.modules():
        if _is_stock_embedding(m):
            m.forward = MethodType(_patched_forward, m)  # per instance, on purpose
            patched += 1
    return patched


def is_patched(m: nn.Module) -> bool:
    """Whether ``m`` runs the patched forward (``patch_embedding_modules``)."""
    return isinstance(m, nn.Embedding) and getattr(m.forward, "__func__", None) is _patched_forward
