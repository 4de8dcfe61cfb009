"""transformers' SDPA mask check without a host read-back on XLA:CPU replica threads.

Before building an SDPA attention mask, transformers asks whether it may skip it
(``masking_utils._ignore_causal_mask_sdpa``): with an attention mask that means
``fast_all(padding_mask)``, a read-back to the host in the middle of the forward. It skips that
question only while tracing (``is_tracing``), which does not recognize XLA's lazy tensors. On
XLA:CPU replica threads the read-back runs outside the replicas' turns, every replica at once:
both replicas of a launched Trainer run died of a segmentation fault inside torch_xla there
(tests/test_trainer.py, once). Here XLA tensors get the tracing answer: build the mask (the
same attention, without the read-back).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from .rendezvous import replicas_are_threads


def without_read_back(original: Callable[..., bool]) -> Callable[..., bool]:
    """The patch of ``transformers.masking_utils._ignore_causal_mask_sdpa`` (patches.py)."""

    @functools.wraps(original)
    def ignore_causal_mask_sdpa(padding_mask: Any, *args: Any, **kwargs: Any) -> bool:
        if padding_mask is not None and padding_mask.device.type == "xla" and replicas_are_threads():
            return False  # what transformers answers while tracing
        return original(padding_mask, *args, **kwargs)

    return ignore_causal_mask_sdpa
