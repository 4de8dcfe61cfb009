"""Accelerate's own files in a ``save_state`` folder, written and read straight through a ``Location``.

Accelerate's ``save_accelerator_state`` / ``load_accelerator_state`` and ``save_custom_state``
take a local folder (``Path(output_dir) / name``: a URL would become a local ``./s3:/...``
folder), so with them a save into a bucket has to be staged on local disk and uploaded. Here the
same files, under the names and with the contents Accelerate's loader reads, are serialized in
memory (they are small: step counters, random states, sampler seeds) and written with one
``Location.put`` each, to a local folder or a bucket alike:

- ``scheduler.bin`` (``scheduler_<i>.bin``): each prepared scheduler's ``state_dict()``;
- ``sampler.bin`` (``sampler_<i>.bin``): the seedable sampler of a dataloader over an
  ``IterableDatasetShard``, which is when Accelerate saves (and loads) it;
  ``dl_state_dict.bin`` (``_<i>``) with ``use_stateful_dataloader``;
- ``random_states_<r>.pkl``: each rank's random states and the step;
- ``custom_checkpoint_<i>.pkl``: each object registered with ``register_for_checkpointing``.

Each rank writes its own random states; the main process writes the rest. Accelerate's
``save_on_each_node`` (every host's local main process writing the shared files) is not
followed: the save's record is written by the main process only ([Note: save_state folders]),
so a host-local copy of the shared files would not make that host's folder loadable; a pod
without a shared filesystem saves to a bucket (docs/checkpoints.md).
"""

from __future__ import annotations

import io
import logging
import random
import threading
from typing import Any, Dict, Optional

import numpy as np
import torch
from accelerate.data_loader import IterableDatasetShard, SeedableRandomSampler
from accelerate.utils import RNG_STATE_NAME, SAMPLER_NAME, SCHEDULER_NAME
from accelerate.utils import load as accelerate_load

from .. import _xla
from ..checkpoint import CheckpointError
from ..checkpoint.store import Location

logger = logging.getLogger(__name__)

# Accelerate's ``load`` adds torch's safe globals for ``torch.load`` and clears them afterwards:
# a process-wide list. XLA:CPU replica threads loading at once clear each other's, a replica's
# random states then fail to unpickle, and (in Accelerate's loader) the step silently stays at 0
# on that replica, which then runs steps the others do not. One replica at a time reads them.
_reading = threading.Lock()


def _numbered(stem: str, index: int, suffix: str = "bin") -> str:
    return f"{stem}.{suffix}" if index == 0 else f"{stem}_{index}.{suffix}"


def rng_file(rank: int) -> str:
    return f"{RNG_STATE_NAME}_{rank}.pkl"


def _seedable_sampler(dataloader: Any) -> Optional[SeedableRandomSampler]:
    if not isinstance(dataloader.dataset, IterableDatasetShard):
        return None
    sampler = dataloader.get_sampler()
    return sampler if isinstance(sampler, SeedableRandomSampler) else None


def write(accelerator: Any, state: Location) -> None:
    """Write this rank's files of Accelerate's state into ``state`` (on every replica)."""
    if accelerator.is_main_process:
        for i, scheduler in enumerate(accelerator._schedulers):
            _put(state / _numbered(SCHEDULER_NAME, i), scheduler.state_dict())
        for i, dataloader in enumerate(accelerator._dataloaders):
            sampler = _seedable_sampler(dataloader)
            if sampler is not None:
                _put(state / _numbered(SAMPLER_NAME, i), sampler)
            if getattr(dataloader, "use_stateful_dataloader", False):
                _put(state / _numbered("dl_state_dict", i), dataloader.state_dict())
        for i, obj in enumerate(accelerator._custom_objects):
            _put(state / f"custom_checkpoint_{i}.pkl", obj.state_dict())
    states: Dict[str, Any] = {
        "step": accelerator.step,
        "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(),
        "torch_manual_seed": torch.get_rng_state(),
        "xm_seed": _xla.rng_state(_xla.device()),
    }
    _put(state / rng_file(accelerator.process_index), states)


def _put(location: Location, obj: Any) -> None:
    buffer = io.BytesIO()
    torch.save(_on_cpu(obj), buffer)
    data = buffer.getvalue()
    location.put(data)
    if location.size() != len(data):
        raise CheckpointError(f"{location}: the store holds another size than was written")


def _on_cpu(obj: Any) -> Any:
    """Tensors of a state dict on the CPU (an XLA tensor would pickle as its device's handle)."""
    return torch.utils._pytree.tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, obj)


def read(accelerator: Any, state: Location, load_kwargs: Optional[dict]) -> int:
    """Restore Accelerate's state from ``state`` (on every replica); returns the step saved.

    A replica with no random states of its own (resumed on more replicas than saved) keeps its
    random states and takes the step from rank 0's, so that every replica resumes at one step."""
    load_kwargs = load_kwargs or {}
    present = set(state.names())
    for i, scheduler in enumerate(accelerator._schedulers):
        scheduler.load_state_dict(_load(state / _numbered(SCHEDULER_NAME, i), **load_kwargs))
    for i, dataloader in enumerate(accelerator._dataloaders):
        if _seedable_sampler(dataloader) is not None:
            dataloader.set_sampler(_load(state / _numbered(SAMPLER_NAME, i)))
        stateful = _numbered("dl_state_dict", i)
        if getattr(dataloader, "use_stateful_dataloader", False) and stateful in present:
            dataloader.load_state_dict(_load(state / stateful, **load_kwargs))
    for i, obj in enumerate(accelerator._custom_objects):
        obj.load_state_dict(_load(state / f"custom_checkpoint_{i}.pkl", map_location="cpu", weights_only=False))
    mine = rng_file(accelerator.process_index)
    if mine not in present:
        if rng_file(0) not in present:
            raise CheckpointError(
                f"{state} has no {rng_file(0)}: not a complete save_state folder (it holds the step to resume at)"
            )
        return int(_load(state / rng_file(0))["step"])
    states = _load(state / mine)
    random.setstate(states["random_state"])
    np.random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    if "xm_seed" in states:
        _xla.set_rng_state(states["xm_seed"], _xla.device())
    return int(states["step"])


def _load(location: Location, **kwargs: Any) -> Any:
    data = location.read_bytes()  # outside the lock: a bucket's read takes the time
    with _reading:
        try:
            return accelerate_load(io.BytesIO(data), **kwargs)
        except Exception as e:  # noqa: BLE001 - an unpickling error of any kind: name the file
            raise CheckpointError(f"{location}: cannot be read as Accelerate's state ({e})") from e
