"""XLA:CPU replicas as threads of one process, made to behave as a process per replica.

torch_xla runs N XLA:CPU devices in one process, one Python thread each (the platform note,
docs/xla-cpu.md). What a TPU gives for free, a process per chip, is emulated here:

* replica_run.py: how replica threads meet, and how a failing one ends the run (pure Python);
* graph_boundaries.py: callbacks before every graph cut, replicas taking turns at the cut, and
  torch_xla's launcher made to fail fast;
* rendezvous.py: host values handed between replica threads (``xm.rendezvous``, ``agree``,
  ``broadcast_from_rank0_``);
* host_collectives.py: Accelerate's ``gather``/``reduce``/``pad_across_processes`` on threads;
* seeds.py, script_logging.py, tqdm_lock.py, sdpa_mask.py: what stock scripts call, behaving per
  thread as it does per process;
* patches.py: the one table of every name of another library the package replaces, with why,
  where and when, and ``install``/``uninstall`` (``python -m accel_xla_fsdp.xla_cpu --patches``).
"""
