"""``accelerator.unwrap_model(model).save_pretrained(dir, is_main_process=...)`` keeps the full
model on the writing replica only.

Every replica calls it (the stock scripts do, and the gathers need them all); the unwrapped
model's ``state_dict()`` then streams the whole model ([Note: streamed full state dicts]). Only
a replica told ``is_main_process=True`` writes, so only there is it kept: the others take part
in the gathers and get an empty state dict, which ``transformers``' and PEFT's
``save_pretrained`` read nothing from on a replica that does not write. Freed memory goes back
to the system once the files are written (host_memory.py).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from .. import host_memory
from ..fsdp import XlaFullyShardedDataParallel
from ..state_dict import kept_on_this_replica


def route_save_pretrained(wrapper: XlaFullyShardedDataParallel) -> None:
    """Give the root ``wrapper``'s module (if its class has ``save_pretrained``) one that keeps
    the state dict where it is written."""
    inner = wrapper.module
    own = getattr(type(inner), "save_pretrained", None)
    if own is None:
        return
    signature = inspect.signature(own)

    @functools.wraps(own)
    def save_pretrained(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(inner, *args, **kwargs)
        writes = bool(bound.arguments.get("is_main_process", True))
        try:
            with kept_on_this_replica(writes):
                return own(inner, *args, **kwargs)
        finally:
            host_memory.give_back()

    inner.save_pretrained = save_pretrained  # type: ignore[assignment]  # per instance, over the class's method
