"""What ``accelerate launch`` does not pass to the replicas it starts on XLA, passed on.

For ``distributed_type: XLA`` Accelerate's launcher imports the training script in its own
process, then starts the replicas with ``xmp.spawn``. It hands them nothing of the config file:
not the ``fsdp_config`` section, not ``mixed_precision`` (it only sets torch_xla's
``XLA_USE_BF16``, which torch_xla 2.9 no longer reads), and on XLA:CPU not the number of
devices. The script's import of ``accel_xla_fsdp.Accelerator`` runs ``export_launch_settings``
in that launcher process, before the spawn, and it passes them on as environment variables,
which the replica processes inherit.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Dict, List, Optional

from .. import _xla
from .plugin import CONFIG_FILE_ENV, check_config_section


def launch_arguments(argv: List[str]) -> Optional[List[str]]:
    """The arguments of ``accelerate launch`` if this process is its launcher, else None."""
    program = Path(argv[0]).name if argv else ""
    if program == "accelerate" and argv[1:2] == ["launch"]:
        return argv[2:]
    if program == "accelerate-launch":
        return argv[1:]
    return None


def export_launch_settings() -> None:
    """In the launcher of an XLA ``accelerate launch``: the settings the replicas need, exported."""
    arguments = launch_arguments(sys.argv)
    if arguments is None:
        return
    for name, value in launch_environment(arguments).items():
        os.environ.setdefault(name, value)  # the user's own environment wins


def launch_environment(arguments: List[str]) -> Dict[str, str]:
    from accelerate.commands.config.config_args import default_config_file, load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    args = launch_command_parser().parse_args(arguments)
    path = args.config_file or (default_config_file if os.path.isfile(default_config_file) else None)
    if path is None:
        return {}
    config = load_config_from_file(path)
    if str(config.distributed_type) not in ("XLA", "DistributedType.XLA"):
        return {}
    check_config_section(config.fsdp_config or {}, source=path)  # fail in the launcher, once
    env = {CONFIG_FILE_ENV: str(Path(path).resolve())}
    mixed_precision = args.mixed_precision or config.mixed_precision
    if mixed_precision:
        env["ACCELERATE_MIXED_PRECISION"] = str(mixed_precision)
    if _xla.on_cpu():
        env.update(_xla.cpu_device_env(args.num_processes or config.num_processes or 1))
    return env
