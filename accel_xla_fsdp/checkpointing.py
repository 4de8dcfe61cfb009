"""Activation checkpointing whose recomputation survives the XLA compiler.

Forward runs without keeping activations; backward runs the forward again and differentiates it.
In a lazy-tensor program both forwards land in one graph, and the compiler's common-subexpression
elimination would merge the recomputation back into the original forward, keeping every
activation alive after all. An optimization barrier over the recomputation's inputs, the incoming
gradients and the module's parameters and buffers makes the recomputed values depend on the
backward pass, so the compiler cannot merge them or hoist them before backward.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, List, Tuple

import torch
import torch.nn as nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from . import _xla

_state = threading.local()


def in_recompute() -> bool:
    """True while this thread recomputes a checkpointed forward for backward."""
    return getattr(_state, "recomputing", False)


@contextmanager
def _recomputing() -> Iterator[None]:
    previous = in_recompute()
    _state.recomputing = True
    try:
        yield
    finally:
        _state.recomputing = previous


def checkpoint_module(module: nn.Module) -> nn.Module:
    """Make ``module``'s forward checkpointed: activations are recomputed in backward.

    Returns the same module, with its instance ``forward`` replaced. Forward passes without
    gradients (evaluation) run as usual. The forward runs twice, so it must not change state
    that its second run would see: train a ``transformers`` model with ``use_cache=False``, or
    each block appends its keys and values to the cache again when recomputed.
    """
    original = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled() or not _any_input_requires_grad(args, kwargs):
            # Gradients reach the module's parameters only through the autograd function's
            # inputs, and under FSDP the parameters the module reads are not registered with it
            # (so they cannot be passed in): with no input requiring a gradient, checkpointing
            # would silently drop them. This forward runs uncheckpointed instead (as torch_xla's).
            return original(*args, **kwargs)
        return _checkpointed_call(module, original, args, kwargs)

    module.forward = forward
    return module


def _any_input_requires_grad(args: tuple, kwargs: dict) -> bool:
    leaves, _ = tree_flatten((args, kwargs))
    return any(isinstance(x, torch.Tensor) and x.requires_grad for x in leaves)


def _checkpointed_call(module: nn.Module, fn: Callable, args: tuple, kwargs: dict) -> Any:
    leaves, spec = tree_flatten((args, kwargs))
    tensor_positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    tensors = [leaves[i] for i in tensor_positions]
    out_spec: List[Any] = []  # filled by forward: how to rebuild the outputs
    call = _Call(module, fn, leaves, spec, tensor_positions, out_spec)
    out_tensors = _CheckpointFunction.apply(call, *tensors)
    out_leaves, out_tree = out_spec
    it = iter(out_tensors)
    return tree_unflatten([next(it) if is_t else leaf for leaf, is_t in out_leaves], out_tree)


class _Call:
    """The checkpointed call with its non-tensor arguments, to be replayed with new tensors."""

    def __init__(
        self,
        module: nn.Module,
        fn: Callable[..., Any],
        leaves: List[Any],
        spec: TreeSpec,
        tensor_positions: List[int],
        out_spec: List[Any],
    ) -> None:
        self.module, self.fn, self.leaves, self.spec = module, fn, leaves, spec
        self.tensor_positions, self.out_spec = tensor_positions, out_spec

    def __call__(self, tensors: Tuple[torch.Tensor, ...]) -> Any:
        leaves = list(self.leaves)
        for i, t in zip(self.tensor_positions, tensors):
            leaves[i] = t
        args, kwargs = tree_unflatten(leaves, self.spec)
        return self.fn(*args, **kwargs)

    def barrier_tensors(self) -> List[torch.Tensor]:
        own = list(self.module.parameters()) + list(self.module.buffers())
        return [t for t in own if _xla.is_xla_device(t.device)]


def _split_outputs(outputs: Any) -> Tuple[List[Tuple[Any, bool]], Any, List[torch.Tensor]]:
    leaves, tree = tree_flatten(outputs)
    marked = [(x, isinstance(x, torch.Tensor)) for x in leaves]
    return marked, tree, [x for x in leaves if isinstance(x, torch.Tensor)]


class _CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, call: _Call, *tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        ctx.call = call
        ctx.device = next((t.device for t in tensors if _xla.is_xla_device(t.device)), None)
        ctx.rng = _xla.rng_state(ctx.device) if ctx.device is not None else None
        ctx.save_for_backward(*tensors)
        with torch.no_grad():
            outputs = call(tensors)
        marked, tree, out_tensors = _split_outputs(outputs)
        call.out_spec[:] = [[(None if is_t else x, is_t) for x, is_t in marked], tree]
        return tuple(out_tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Tuple[Any, ...]:
        saved = ctx.saved_tensors
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in saved]
        _xla.optimization_barrier_(
            [t for t in inputs + list(grads) + ctx.call.barrier_tensors() if _xla.is_xla_device(t.device)]
        )
        with torch.enable_grad(), _recomputing(), _same_rng(ctx):
            outputs = ctx.call(tuple(inputs))
        _, _, out_tensors = _split_outputs(outputs)
        pairs = [(o, g) for o, g in zip(out_tensors, grads) if o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None,) + tuple(t.grad if t.requires_grad else None for t in inputs)


@contextmanager
def _same_rng(ctx: Any) -> Iterator[None]:
    """Replay the forward's random numbers (dropout masks) in the recomputation."""
    if ctx.rng is None:
        yield
        return
    current = _xla.rng_state(ctx.device)
    _xla.set_rng_state(ctx.rng, ctx.device)
    try:
        yield
    finally:
        _xla.set_rng_state(current, ctx.device)
