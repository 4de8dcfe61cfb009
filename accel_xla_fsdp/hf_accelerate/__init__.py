"""Hugging Face Accelerate with XLA FSDP: ``Accelerator`` and ``XlaFsdpPlugin``.

Importing this package in the launcher process of ``accelerate launch`` passes the config file's
XLA FSDP settings on to the replicas (launch.py): a training script imports ``Accelerator`` from
``accel_xla_fsdp`` at module level. The import also installs the patch table's ``ACCELERATE``
entries (``xla_cpu/patches.py``): stock scripts behave on XLA:CPU replica threads as with a process
per replica (``from_pretrained``, ``set_seed``, logging, tqdm's ``thread_map`` in ``load_dataset``,
transformers' SDPA masks), and ``from_pretrained`` with ``fsdp_cpu_ram_efficient_loading`` loads
straight into shards (pretrained_loading.py).
"""

from ..xla_cpu import patches
from .accelerator import Accelerator
from .launch import export_launch_settings
from .plugin import XlaFsdpPlugin

export_launch_settings()
patches.install(patches.Stage.ACCELERATE)

__all__ = ["Accelerator", "XlaFsdpPlugin"]
