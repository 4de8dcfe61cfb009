"""nn.Linear with a backward that reads the weight parameter itself (pytorch/xla#3811, #3718).

Autograd's own linear saves ``weight.t()`` for backward: an intermediate that holds the gathered
full weight from forward until backward, defeating the freeing in between and letting backward
reuse the forward's gathered value instead of the re-gathered one. ``PatchedLinearFunction``
saves the weight *parameter*, a leaf whose data FSDP swaps, so backward reads whatever is
gathered when backward runs.

The patch replaces the ``forward`` of each ``nn.Linear`` instance (not ``F.linear`` globally):
replica threads share one interpreter, and a global patch entered and left by one thread would
change the others' forward mid-trace.

A weight may carry a gradient sink (``set_weight_grad_sink``): FSDP's, which computes the weight's
gradient in chunks and reduce-scatters each (``reduce_scatter_in_linear_backward``), so autograd
never holds it whole.
"""

from __future__ import annotations

from types import MethodType
from typing import Any, Callable, Optional, Tuple

import torch
import torch.nn as nn

from . import sharded_loss, sharded_tables

_ORIGINAL_FORWARD = "_accel_xla_fsdp_linear_forward"
_WEIGHT_GRAD_SINK = "_accel_xla_fsdp_weight_grad_sink"

# (grad_output, input), both 2-D -> whether it took the weight's gradient
WeightGradSink = Callable[[torch.Tensor, torch.Tensor], bool]


class PatchedLinearFunction(torch.autograd.Function):
    """``F.linear`` whose saved tensors are the input and the weight parameter."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        ctx.save_for_backward(input, weight)
        ctx.has_bias = bias is not None
        return torch._C._nn.linear(input, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        input, weight = ctx.saved_tensors
        grad_out_2d = grad_output.reshape(-1, grad_output.size(-1))
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = grad_out_2d.mm(weight).view(input.shape)
        if ctx.needs_input_grad[1]:
            input_2d = input.reshape(-1, input.size(-1))
            sink: Optional[WeightGradSink] = getattr(weight, _WEIGHT_GRAD_SINK, None)
            if sink is None or not sink(grad_out_2d, input_2d):
                grad_weight = grad_out_2d.t().mm(input_2d)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_out_2d.sum(0)
        return grad_input, grad_weight, grad_bias


def _patched_forward(self: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    table = sharded_tables.table_of(self)
    if table is not None:  # FSDP's root computes it from the weight's shard
        out = sharded_tables.linear(table, input)
        if self.bias is not None:
            return out + self.bias
        return sharded_loss.note_logits(out, input, table) if table.group.options.lm_loss_in_chunks else out
    if not torch.is_grad_enabled():
        # No backward to patch; and an autograd.Function cannot run under inference_mode.
        return torch._C._nn.linear(input, self.weight, self.bias)
    return PatchedLinearFunction.apply(input, self.weight, self.bias)


def patch_linear_modules(module: nn.Module) -> int:
    """Give every plain ``nn.Linear`` under ``module`` the patched forward; returns how many.

    A Linear whose forward was already replaced (by a user, by a checkpoint wrapper) is left alone,
    as is a subclass that defines its own forward.
    """
    patched = 0
    for m in module.modules():
        if isinstance(m, nn.Linear) and _is_stock_linear_forward(m):
            setattr(m, _ORIGINAL_FORWARD, m.forward)
            m.forward = MethodType(_patched_forward, m)  # type: ignore[method-assign]  # per instance, on purpose
            patched += 1
    return patched


def _is_stock_linear_forward(m: nn.Linear) -> bool:
    return "forward" not in m.__dict__ and type(m).forward is nn.Linear.forward


def is_patched(m: nn.Module) -> bool:
    """Whether ``m`` runs the patched forward (``patch_linear_modules``)."""
    return isinstance(m, nn.Linear) and hasattr(m, _ORIGINAL_FORWARD)


def set_weight_grad_sink(weight: nn.Parameter, sink: WeightGradSink) -> None:
    """Hand ``weight``'s gradient, as the rows of (grad_output, input), to ``sink`` in the patched
    backward; when the sink does not take it (returns False), autograd gets it as usual."""
    setattr(weight, _WEIGHT_GRAD_SINK, sink)


def has_weight_grad_sink(weight: torch.Tensor) -> bool:
    return hasattr(weight, _WEIGHT_GRAD_SINK)
