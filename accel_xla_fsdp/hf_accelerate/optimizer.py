"""The user's optimizer, moved onto the shards; and its Accelerate wrapper, which must not reduce.

A script builds its optimizer on the unwrapped model's parameters, often in param groups (no
weight decay for biases and norms). Wrapping replaces those parameters by shards, so ``prepare``
points each group at the shards of its parameters, in place: the optimizer object, its class,
hyper-parameters and groups stay the user's.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from accelerate.optimizer import AcceleratedOptimizer

from .. import _xla
from ..construction import FlatShardKey


def parameter_names(model: nn.Module) -> Dict[int, str]:
    """``id(parameter) -> name`` for the unwrapped model (a tied parameter under its first name)."""
    return {id(p): name for name, p in reversed(list(model.named_parameters(remove_duplicate=False)))}


def param_group_key(optimizers: Sequence[torch.optim.Optimizer]) -> FlatShardKey:
    """A ``flat_shard_key`` that tells the param groups of ``optimizers`` apart (a parameter in
    none of them gets ``None``): flat shards then never mix two groups' hyper-parameters."""
    group_of: Dict[int, Tuple[int, int]] = {}
    for i, optimizer in enumerate(optimizers):
        for j, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                group_of.setdefault(id(p), (i, j))
    return lambda p: group_of.get(id(p))


def holds_any(optimizer: torch.optim.Optimizer, params: Dict[int, Any]) -> bool:
    """Whether ``optimizer`` holds one of ``params`` (keyed by ``id``)."""
    return any(id(p) in params for group in optimizer.param_groups for p in group["params"])


def move_onto_shards(
    optimizer: torch.optim.Optimizer, names: Dict[int, str], shard_of: Dict[int, nn.Parameter]
) -> None:
    """Point ``optimizer``'s groups at the shards holding their parameters.

    ``names`` names the unwrapped models' parameters (by ``id``), ``shard_of`` gives each one's
    shard. A flat shard holds several parameters: they must all be in groups with the same
    hyper-parameters (``prepare`` splits flat shards by the groups of the optimizers prepared
    with the model).
    """
    if optimizer.state:
        raise ValueError(
            f"{type(optimizer).__name__} has already stepped: prepare it before its first step, together "
            f"with the model, so that it can be moved onto the shards"
        )
    owner: Dict[int, int] = {}  # id(shard) -> index of the group that holds it
    new_params: List[List[nn.Parameter]] = []
    for index, group in enumerate(optimizer.param_groups):
        params: List[nn.Parameter] = []
        for p in group["params"]:
            shard = _shard_holding(p, shard_of, optimizer)
            first = owner.setdefault(id(shard), index)
            if first == index and all(s is not shard for s in params):
                params.append(shard)
            elif first != index:
                _check_same_hyperparameters(optimizer, first, index, names[id(p)])
        new_params.append(params)
    for group, params in zip(optimizer.param_groups, new_params):
        group["params"] = params


def _shard_holding(
    p: torch.Tensor, shard_of: Dict[int, nn.Parameter], optimizer: torch.optim.Optimizer
) -> nn.Parameter:
    shard = shard_of.get(id(p))
    if shard is None:
        raise ValueError(
            f"{type(optimizer).__name__} holds a parameter of shape {tuple(p.shape)} that is not in the "
            "model being prepared: build the optimizer from this model's parameters"
        )
    return shard


def _check_same_hyperparameters(optimizer: torch.optim.Optimizer, first: int, other: int, name: str) -> None:
    a, b = ({k: v for k, v in optimizer.param_groups[i].items() if k != "params"} for i in (first, other))
    if a != b:
        raise ValueError(
            f"'{name}' shares a flat shard with parameters of another param group whose settings differ "
            f"({_difference(a, b)}): one shard takes one set of hyper-parameters. Prepare the optimizer "
            "in the same prepare() call as its model (flat shards are then split by param group), set "
            "xla_fsdp_flatten_parameters: false (one shard per parameter), or use the same settings."
        )


def _difference(a: Dict, b: Dict) -> str:
    return ", ".join(f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))


class XlaFsdpOptimizer(AcceleratedOptimizer):
    """Accelerate's optimizer wrapper without its XLA all-reduce of gradients, whose update is
    in place.

    On XLA, ``AcceleratedOptimizer.step`` all-reduces every gradient before stepping. Under FSDP
    each replica's gradients are already the reduced gradients of its own shards: averaging them
    with other replicas' (different) shards would be wrong, so that reduction is marked done.

    After an update, the parameters and the optimizer state are written once more in the order
    in which the step's sync numbers their donated buffers, from the loss that
    ``Accelerator.backward`` saw on (``_xla.write_in_donation_order``): else the compiler copies
    most of them for the whole step.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loss: Optional[torch.Tensor] = None  # the step's loss (Accelerator.backward)

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        self.gradient_state.is_xla_gradients_synced = True
        loss, self.loss = self.loss, None
        if loss is None or not self.gradient_state.sync_gradients:
            return super().step(closure)
        donated = _xla.tensor_ids(self._updated_tensors())
        result = super().step(closure)
        _xla.write_in_donation_order([loss], donated, self._updated_tensors())
        return result

    def _updated_tensors(self) -> List[torch.Tensor]:
        """What a step writes on the device: the parameters and the optimizer's tensor state."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        state = [t for p in params for t in self.optimizer.state.get(p, {}).values() if isinstance(t, torch.Tensor)]
        return [t for t in params + state if _xla.is_xla_device(t.device)]
