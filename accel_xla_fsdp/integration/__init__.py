"""Hugging Face Accelerate with XLA FSDP: ``Accelerator`` and ``XlaFsdpPlugin``.

Importing this package in the launcher process of ``accelerate launch`` passes the config file's
XLA FSDP settings on to the replicas (launch.py): a training script imports ``Accelerator`` from
``accel_xla_fsdp`` at module level. The import also makes stock scripts behave on XLA:CPU replica
threads as with a process per replica: ``from_pretrained`` and ``set_seed`` (pretrained_loading.py,
replica_seeds.py), logging (script_logging.py), tqdm's ``thread_map`` in ``load_dataset``
(tqdm_lock.py), transformers' SDPA masks (sdpa_mask.py); and ``from_pretrained`` with
``fsdp_cpu_ram_efficient_loading`` loads straight into shards (pretrained_loading.py).
"""

from . import pretrained_loading, replica_seeds, script_logging, sdpa_mask, tqdm_lock
from .accelerator import Accelerator
from .launch import export_launch_settings
from .plugin import XlaFsdpPlugin

export_launch_settings()
pretrained_loading.install()
replica_seeds.install()
tqdm_lock.install()
sdpa_mask.install()
script_logging.drop_torch_xla_basic_config()
script_logging.per_thread_verbosity()

__all__ = ["Accelerator", "XlaFsdpPlugin"]
