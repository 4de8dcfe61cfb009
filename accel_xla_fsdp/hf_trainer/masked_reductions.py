"""DPO's masked metrics in programs of one shape: ``x[mask].sum()`` as ``where(mask, x, 0).sum()``.

TRL 1.16's ``DPOTrainer._compute_loss`` logs ``logits/chosen`` and ``logits/rejected`` by
boolean-mask selection, ``chosen_mean_logits[chosen_mask.bool()].sum()`` (and loss type ``"sft"``
takes ``-logps[mask.bool()].mean()``, with a gradient). On XLA a boolean index is ``nonzero``
read on the host and a gather of the ``k`` elements the mask selects: the program that sums
them has ``k`` in its shape, so every new completion-token count compiled a new program, on
every replica (DPO full fine-tuning, 4 replicas: 4 to 5 new programs per optimizer step, 52 to 84
over 6 steps; now 0 after step 3, 52 in all: docs/launch.md). No TRL setting removes these metrics.

While TRL's ``_compute_loss`` runs (the patch ``reducing_masked_selections``, xla_cpu/patches.py),
a torch function mode (thread-local: one replica thread's mode is not another's) watches two
things. A selection ``x[mask]`` of an XLA tensor by a boolean mask of ``x``'s own shape is made as
usual (the true selection, a lazy gather that runs only if something uses it) and remembers
``x`` and ``mask``. ``.sum()`` or ``.mean()`` of such a selection, whole (no dim, no dtype), is
computed from them as a masked reduction of fixed shape: ``where(mask, x, 0).sum()`` (divided by
``mask.sum()`` for the mean), the same value to round-off (the zeros add nothing; only the order
of the additions may differ) and the same gradient (``mask``, or ``mask / k``). Any other use of
the selection gets the true selection. Nothing else is changed; off XLA the mode is not entered.

Why this and not another way (measured): TRL has no hook, output or setting for these metrics;
torch_xla's bounded dynamic shapes (``XLA_EXPERIMENTAL=nonzero:masked_select``) are process-wide,
experimental, change every boolean selection of the run and doubled the graph cuts of one
(docs/launch.md); and rewriting TRL's method would copy it. The selection itself is still made,
so ``nonzero`` still reads the mask on the host (a graph cut, of a program compiled once): what
is gone is the program per token count.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode

_SOURCE = "_accel_xla_fsdp_selected_from"  # on a selection: the (tensor, mask) it selects from
_SUM = (torch.Tensor.sum, torch.sum)
_MEAN = (torch.Tensor.mean, torch.mean)


class FixedShapeMaskedReductions(TorchFunctionMode):
    """Whole sums and means of boolean-mask selections of XLA tensors, as masked reductions."""

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: Tuple[Any, ...] = (), kwargs: Optional[Dict] = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.__getitem__ and _is_full_mask_selection(args):
            selected = func(*args, **kwargs)
            setattr(selected, _SOURCE, args)
            return selected
        if (func in _SUM or func in _MEAN) and len(args) == 1 and not kwargs:
            source = getattr(args[0], _SOURCE, None)
            if source is not None:
                tensor, mask = source
                total = torch.where(mask, tensor, 0).sum()
                return total if func in _SUM else total / mask.sum()
        return func(*args, **kwargs)


def _is_full_mask_selection(args: Tuple[Any, ...]) -> bool:
    """``tensor[mask]``: a floating XLA tensor indexed by a boolean mask of its own shape."""
    if len(args) != 2 or not isinstance(args[0], torch.Tensor) or not isinstance(args[1], torch.Tensor):
        return False
    tensor, mask = args
    return (
        mask.dtype == torch.bool
        and mask.shape == tensor.shape
        and tensor.is_floating_point()
        and tensor.device.type == "xla"
        and mask.device == tensor.device
    )


def reducing_masked_selections(original: Callable[..., Any]) -> Callable[..., Any]:
    """The patch of TRL's ``DPOTrainer._compute_loss`` (xla_cpu/patches.py): the original, under
    ``FixedShapeMaskedReductions`` when the trainer runs on XLA."""

    @functools.wraps(original)
    def compute_loss(trainer: Any, *args: Any, **kwargs: Any) -> Any:
        if trainer.accelerator.device.type != "xla":
            return original(trainer, *args, **kwargs)
        with FixedShapeMaskedReductions():
            return original(trainer, *args, **kwargs)

    return compute_loss
