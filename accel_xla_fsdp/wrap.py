"""Which submodules become their own FSDP unit: policies, and the recursive wrap that applies them.

A policy has torch_xla's signature, ``policy(module=, recurse=, unwrapped_params=) -> bool``:
with ``recurse=True`` it says whether to look inside ``module``; with ``recurse=False`` whether to
wrap it, given the parameters not yet wrapped below it. torch_xla's policy callables work as they
are. The three factories below make the common ones.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any, Callable, Dict, Iterable, Optional, Set, Tuple, Type, Union

import torch.nn as nn

Policy = Callable[..., bool]
BlockClasses = Iterable[Union[Type[nn.Module], str]]

# Containers without a forward of their own are never units.
_NEVER_WRAPPED = (nn.ModuleList, nn.ModuleDict)
# Modules whose forward reads their children's parameters directly are never looked into.
_LEAVES = (nn.MultiheadAttention,)


def transformer_auto_wrap_policy(
    module: nn.Module, recurse: bool, unwrapped_params: int, transformer_layer_cls: Set[Type[nn.Module]]
) -> bool:
    """Wrap every instance of ``transformer_layer_cls`` (torch_xla's policy of the same name)."""
    return True if recurse else isinstance(module, tuple(transformer_layer_cls))


def size_based_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    unwrapped_params: int,
    min_num_params: int = int(1e8),
    force_leaf_modules: Optional[Set[Type[nn.Module]]] = None,
    exclude_wrap_modules: Optional[Set[Type[nn.Module]]] = None,
) -> bool:
    """Wrap a module once at least ``min_num_params`` of its parameters are not yet wrapped.

    Never looks inside ``force_leaf_modules`` (default ``nn.MultiheadAttention``, whose forward
    reads ``out_proj.weight`` directly, so ``out_proj`` must not become a unit of its own) and
    never wraps ``exclude_wrap_modules`` (default ``nn.ModuleList``, ``nn.ModuleDict``): torch_xla's
    arguments and defaults.
    """
    leaves = tuple(force_leaf_modules if force_leaf_modules is not None else _LEAVES)
    excluded = tuple(exclude_wrap_modules if exclude_wrap_modules is not None else _NEVER_WRAPPED)
    if recurse:
        return unwrapped_params >= min_num_params and not isinstance(module, leaves)
    return unwrapped_params >= min_num_params and not isinstance(module, excluded)


def lambda_auto_wrap_policy(
    module: nn.Module, recurse: bool, unwrapped_params: int, lambda_fn: Callable[[nn.Module], bool]
) -> bool:
    """Wrap every module for which ``lambda_fn(module)`` is true."""
    return True if recurse else bool(lambda_fn(module))


class TransformerBlockPolicy:
    """Wrap each transformer block; without named classes, those in ``model._no_split_modules``.

    ``_no_split_modules`` is how ``transformers`` names a model's blocks (``"LlamaDecoderLayer"``).
    Classes may be given as types or class names.
    """

    def __init__(self, block_classes: Optional[BlockClasses] = None) -> None:
        self.block_classes = None if block_classes is None else tuple(block_classes)

    def for_model(self, model: nn.Module) -> Policy:
        named = self.block_classes is not None
        wanted = self.block_classes if self.block_classes is not None else _no_split_modules(model)
        names = {c if isinstance(c, str) else c.__name__ for c in wanted}
        classes = {type(m) for m in model.modules() if type(m).__name__ in names}
        missing = names - {c.__name__ for c in classes}
        # _no_split_modules may list classes of a model's other variants (an encoder's blocks in
        # a decoder-only model): only the classes named by the user must all be there.
        if (named and missing) or not classes:
            present = sorted(
                {type(m).__name__ for m in model.modules() if m is not model}
                - {"ModuleList", "ModuleDict", "Sequential"}
            )
            raise ValueError(
                f"no module of class {sorted(missing)} in {type(model).__name__}; name block classes "
                f"that it has: {present}"
            )
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=classes)
        if named:
            return policy
        # Blocks from _no_split_modules that share a parameter with the rest of the model (BERT's
        # BertEmbeddings, whose word embedding is the tied MLM decoder) stay in the outer unit, as
        # GPT-2's embeddings do: a tied parameter must live in one unit.
        tied = {id(m) for m in model.modules() if type(m) in classes and _shares_parameters_outside(m, model)}
        return functools.partial(_all_but, policy=policy, kept=frozenset(tied)) if tied else policy

    def __call__(self, module: nn.Module, recurse: bool, unwrapped_params: int) -> bool:
        raise TypeError("TransformerBlockPolicy must be bound to its model: pass it as auto_wrap_policy")


def _all_but(module: nn.Module, recurse: bool, unwrapped_params: int, policy: Policy, kept: frozenset) -> bool:
    """``policy``, except that the modules in ``kept`` (by id) are never wrapped themselves."""
    if not recurse and id(module) in kept:
        return False
    return policy(module=module, recurse=recurse, unwrapped_params=unwrapped_params)


def _shares_parameters_outside(block: nn.Module, model: nn.Module) -> bool:
    """Whether a parameter of ``block`` is also registered somewhere in ``model`` outside it."""
    inside = Counter(id(p) for _, p in block.named_parameters(remove_duplicate=False))
    everywhere = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    return any(everywhere[key] > count for key, count in inside.items())


def _no_split_modules(model: nn.Module) -> Tuple[str, ...]:
    for m in model.modules():
        names = getattr(m, "_no_split_modules", None)
        if names:
            return tuple(names)
    raise ValueError(
        f"{type(model).__name__} has no _no_split_modules to take its block classes from; "
        "pass them: transformer_block_policy([MyBlock])"
    )


def transformer_block_policy(block_classes: Optional[BlockClasses] = None) -> TransformerBlockPolicy:
    """Wrap by block class; with none named, the model's ``_no_split_modules``."""
    return TransformerBlockPolicy(block_classes)


def size_policy(min_num_params: int) -> Policy:
    """Wrap by parameter count."""
    return functools.partial(size_based_auto_wrap_policy, min_num_params=min_num_params)


def predicate_policy(predicate: Callable[[nn.Module], bool]) -> Policy:
    """Wrap every module the predicate accepts."""
    return functools.partial(lambda_auto_wrap_policy, lambda_fn=predicate)


def resolve_policy(policy: Any, model: nn.Module) -> Policy:
    """Bind a policy that needs the model (``TransformerBlockPolicy``) to it."""
    return policy.for_model(model) if hasattr(policy, "for_model") else policy


def recursive_wrap(
    root: nn.Module, policy: Policy, wrapper: Callable[..., nn.Module], wrapper_kwargs: Dict[str, Any]
) -> None:
    """Replace, in place, the submodules of ``root`` that ``policy`` picks by ``wrapper(submodule,
    **wrapper_kwargs)``, innermost first. ``root`` itself is never wrapped here."""
    _wrap(root, policy, wrapper, wrapper_kwargs, is_root=True)


def _wrap(
    module: nn.Module, policy: Policy, wrapper: Callable[..., nn.Module], kwargs: Dict[str, Any], is_root: bool
) -> Tuple[nn.Module, int]:
    """Returns the (maybe wrapped) module and how many of its parameters are now wrapped."""
    num_params = sum(p.numel() for p in module.parameters())
    if not policy(module=module, recurse=True, unwrapped_params=num_params):
        return module, 0
    wrapped = 0
    for name, child in list(module.named_children()):
        new_child, child_wrapped = _wrap(child, policy, wrapper, kwargs, is_root=False)
        if new_child is not child:
            setattr(module, name, new_child)
        wrapped += child_wrapped
    if not is_root and policy(module=module, recurse=False, unwrapped_params=num_params - wrapped):
        return wrapper(module, **kwargs), num_params
    return module, wrapped
