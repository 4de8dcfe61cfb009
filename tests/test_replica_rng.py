"""torch's CPU generator in replica threads (xla_cpu/seeds.py): after ``set_seed(s)``
each replica thread draws what a process of its own with ``set_seed(s)`` draws, here the masks of
``DataCollatorForLanguageModeling`` through a shuffling dataloader (transformers' mlm example)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import List

import torch

import accel_xla_fsdp.hf_accelerate  # noqa: F401  (installs the per-thread generators in the device process)
from accel_xla_fsdp import _xla

HERE = Path(__file__).resolve().parent


def seed_of(rank: int) -> int:
    return 40 + rank % 2  # two replicas share each seed


def replica_masks(rank: int) -> List[torch.Tensor]:
    import masking

    drawn = masking.masked_batches(seed_of(rank))
    on_device = torch.rand(4, device=_xla.device())  # XLA tensors still draw on the device
    assert on_device.device.type == "xla"
    return drawn


def reference(seed: int, tmp_path: Path) -> List[torch.Tensor]:
    """The same calls in a fresh Python process without accel_xla_fsdp."""
    out = tmp_path / f"seed{seed}.pt"
    subprocess.run([sys.executable, str(HERE / "masking.py"), str(seed), str(out)], check=True, timeout=300)
    return torch.load(out)


def test_each_replica_thread_masks_as_a_process_of_its_own(pools, tmp_path: Path) -> None:
    by_rank = pools[4].run(replica_masks)
    expected = {seed: reference(seed, tmp_path) for seed in {seed_of(r) for r in range(4)}}
    assert not torch.equal(expected[40][1], expected[41][1])  # the seeds give other masks
    for rank, drawn in enumerate(by_rank):
        want = expected[seed_of(rank)]
        assert len(drawn) == len(want)
        for i, (got, ref) in enumerate(zip(drawn, want)):
            assert torch.equal(got, ref), f"replica {rank}, draw {i}"
    assert torch.equal(by_rank[0][-4], by_rank[0][-3]), "set_rng_state restored the thread's state"
