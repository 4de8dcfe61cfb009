"""What ``accelerate launch`` does not pass to the replicas it starts on XLA, passed on.

For ``distributed_type: XLA`` Accelerate's launcher imports the training script in its own
process, then starts the replicas with ``xmp.spawn``. It hands them nothing of the config file:
not the ``fsdp_config`` section, not ``mixed_precision`` (it only sets torch_xla's
``XLA_USE_BF16``, which torch_xla 2.9 no longer reads), and on XLA:CPU not the number of
devices. The script's import of ``accel_xla_fsdp.Accelerator`` runs ``export_launch_settings``
in that launcher process, before the spawn, and it passes them on as environment variables,
which the replica processes inherit: the ``fsdp_config`` keys, parsed there once, as the
settings' own variables (``FSDP_*``, ``XLA_FSDP_*``), as Accelerate's launcher does for its FSDP.

An import inside the script's ``main()`` runs only in the replicas, after the spawn: each
``Accelerator`` then reads the launcher's command line (its parent process's) and takes the
config from there, but on XLA:CPU the device count was fixed at the spawn, so a run whose
device count differs from the config's ``num_processes`` stops with what to do
(``check_device_count``), whatever the cause.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Dict, List, Optional

from .. import _xla
from ..tpu_compiler import libtpu_init_args
from .plugin import (
    CONFIG_EXPORTED_ENV,
    CONFIG_FILE_ENV,
    SETTINGS,
    check_config_section,
    parse_percent,
    settings_environment,
)

# The replicas the launcher was asked for (``--num_processes`` or the config's ``num_processes``).
NUM_PROCESSES_ENV = "ACCEL_XLA_FSDP_NUM_PROCESSES"
# The TPU compiler's scheduler memory target ([Note: the scheduler's memory target]).
SCHEDULER_MEMORY_ENV = next(s.env for s in SETTINGS if s.name == "tpu_scheduler_memory_percent")
# Set when a replica, not the launcher, read the launch settings.
READ_LATE_ENV = "ACCEL_XLA_FSDP_SETTINGS_READ_IN_REPLICA"


def launch_arguments(argv: List[str]) -> Optional[List[str]]:
    """The arguments of ``accelerate launch`` if ``argv`` is its command line, else None."""
    if argv and Path(argv[0]).name.startswith("python") and len(argv) > 1:
        argv = argv[1:]  # the interpreter, as /proc/<pid>/cmdline shows a script with a shebang
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
        if name in ("XLA_FLAGS", "LIBTPU_INIT_ARGS"):  # ours, then the user's (and torch_xla's import's) own
            os.environ[name] = value
        else:
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
    section = check_config_section(config.fsdp_config or {}, source=path)  # fail in the launcher, once
    resolved = str(Path(path).resolve())
    # The settings travel as environment variables, parsed here once; the replicas read those.
    env = {CONFIG_FILE_ENV: resolved, CONFIG_EXPORTED_ENV: resolved, **settings_environment(section)}
    env[NUM_PROCESSES_ENV] = str(args.num_processes or config.num_processes or 1)
    mixed_precision = args.mixed_precision or config.mixed_precision
    if mixed_precision:
        env["ACCELERATE_MIXED_PRECISION"] = str(mixed_precision)
    if _xla.on_cpu():
        env.update(_xla.cpu_device_env(args.num_processes or config.num_processes or 1))
    # libtpu reads its flags as a replica starts: only the launcher can pass them. The user's own
    # variable wins, as for every setting.
    percent = os.environ.get(SCHEDULER_MEMORY_ENV, env.get(SCHEDULER_MEMORY_ENV))
    if percent is not None:
        given = os.environ.get("LIBTPU_INIT_ARGS", "")
        env["LIBTPU_INIT_ARGS"] = libtpu_init_args(parse_percent(SCHEDULER_MEMORY_ENV, percent), given)
    return env


def read_settings_in_replica() -> None:
    """In a replica whose launcher exported nothing (the script imported ``accel_xla_fsdp``
    inside ``main()``): the launch settings, read from the launcher's command line."""
    if CONFIG_FILE_ENV in os.environ:
        return
    arguments = _launcher_arguments()
    if arguments is None:
        return
    env = launch_environment(arguments)
    if env:
        passed = (CONFIG_FILE_ENV, CONFIG_EXPORTED_ENV, NUM_PROCESSES_ENV, "ACCELERATE_MIXED_PRECISION")
        for name in passed + tuple(s.env for s in SETTINGS):
            if name in env:
                os.environ.setdefault(name, env[name])
        os.environ[READ_LATE_ENV] = "1"
        if "LIBTPU_INIT_ARGS" in env and env["LIBTPU_INIT_ARGS"] != os.environ.get("LIBTPU_INIT_ARGS", ""):
            warnings.warn(
                f"{SCHEDULER_MEMORY_ENV} is set, but this replica's TPU runtime started without it: libtpu "
                "reads LIBTPU_INIT_ARGS as a replica starts. Put `from accel_xla_fsdp import Accelerator` at "
                f"module level in the script (not inside main()), or export LIBTPU_INIT_ARGS={env['LIBTPU_INIT_ARGS']}"
            )


def check_device_count(running: int) -> None:
    """Stop when the devices running are not the replicas ``accelerate launch`` was asked for."""
    asked = os.environ.get(NUM_PROCESSES_ENV)
    if asked is None or int(asked) == running:
        return
    config = os.environ.get(CONFIG_FILE_ENV, "the config file")
    if os.environ.get(READ_LATE_ENV) and _xla.on_cpu():
        raise RuntimeError(
            f"accelerate launch was asked for {asked} processes ({config}), but {running} XLA device(s) run: "
            "on XLA:CPU the device count is set in the launcher process, before the replicas start, by "
            "importing accel_xla_fsdp there. Put `from accel_xla_fsdp import Accelerator` at module level in "
            "the script (not inside main())"
        )
    overridden = _xla.on_cpu() and "CPU_NUM_DEVICES" in os.environ
    raise RuntimeError(
        f"accelerate launch was asked for {asked} processes ({config}, or --num_processes), but {running} XLA "
        "device(s) run: set num_processes to the number of devices (a TPU host's chip count)"
        + (", or unset CPU_NUM_DEVICES, which takes precedence" if overridden else "")
    )


def _launcher_arguments() -> Optional[List[str]]:
    """The ``accelerate launch`` arguments of this process's launcher (its parent on XLA:CPU, where
    torch_xla's worker process runs the replica threads), if an ancestor is one."""
    pid = os.getppid()
    for _ in range(3):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
            arguments = launch_arguments(argv)
            if arguments is not None:
                return arguments
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return None
    return None
