"""``accelerator.unwrap_model(model).generate(...)`` gathers the whole model once, as the wrapper's.

transformers' sequence-to-sequence examples evaluate with ``accelerator.unwrap_model(model).generate(...)``
(Accelerate's FSDP2 leaves the hooks on the model itself, so that works on GPUs). Here the unwrapped
model's own forward gathers its unit (unit_state.py), but the ``generate`` of an encoder-decoder calls the
encoder and the decoder directly: submodules whose parameters, in the root unit (T5's shared embedding),
stay sharded. run_translation_no_trainer.py on a tiny T5 failed in ``F.embedding`` with a flat weight.
So the unwrapped model's ``generate`` is the wrapper's: every unit gathered once for the whole
generation, none per token (fsdp.py says why). Call it on every replica, as the wrapper's.
"""

from __future__ import annotations

import functools
from typing import Any

from ..fsdp import XlaFullyShardedDataParallel


def route_generate(wrapper: XlaFullyShardedDataParallel) -> None:
    """Give the root ``wrapper``'s module a ``generate`` (if its class has one) that runs the wrapper's."""
    inner = wrapper.module
    own = getattr(type(inner), "generate", None)
    if own is None:
        return

    @functools.wraps(own)
    def generate(*args: Any, **kwargs: Any) -> Any:
        units = [unit for _, unit in wrapper.unit_state.named_units()]
        if all(unit.params_gathered for unit in units):  # inside the wrapper's generate (or summon_full_params)
            return own(inner, *args, **kwargs)
        return wrapper.generate(*args, **kwargs)

    inner.generate = generate  # type: ignore[assignment]  # per instance, over the class's method
