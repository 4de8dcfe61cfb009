"""Mixed precision: bf16 computation, fp32 master parameters and optimizer state.

With ``compute_dtype=torch.bfloat16`` the gathered full parameters, hence the matmuls, are bf16;
the shards the optimizer updates, their gradients and the AdamW state stay fp32; losses track the
fp32 reference within bf16's precision.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import pytest
import torch
import torch.nn as nn
from models import Case, build, compute_loss, global_batch, local_slice, make_optimizer, train_reference, wrap

from accel_xla_fsdp import _xla

STEPS = 3
# bf16 keeps 8 bits of mantissa (relative spacing 2**-8 = 0.004); a loss summed over a few hundred
# bf16 products drifts by about that much. A wrong reduction or a lost update moves it by far more.
LOSS_RTOL = 1e-2


def train_bf16(rank: int, world: int, fp32_reduce_scatter: bool) -> Tuple[List[torch.Tensor], Dict[str, str]]:
    kw = dict(flatten_parameters=True, compute_dtype=torch.bfloat16, fp32_reduce_scatter=fp32_reduce_scatter)
    model = wrap("llama", build("llama"), rank, world, kw)
    optimizer = make_optimizer("adamw", model.parameters())
    dtypes: Dict[str, str] = {}

    def record(module: nn.Module, args: tuple) -> None:
        dtypes["matmul weight"] = str(module.weight.dtype)
        dtypes["matmul input"] = str(args[0].dtype)

    model.module.model.layers[0].self_attn.q_proj.register_forward_pre_hook(record)
    losses = []
    for step in range(STEPS):
        x, y = (t.to(_xla.device()) for t in local_slice(global_batch("llama", step, 0, world), rank))
        loss = compute_loss("llama", model, x, y)
        loss.backward()
        dtypes["shard grads"] = ",".join(sorted({str(p.grad.dtype) for p in model.parameters()}))
        optimizer.step()
        optimizer.zero_grad()
        _xla.sync()
        losses.append(loss.detach().float())
    dtypes["shards"] = ",".join(sorted({str(p.dtype) for p in model.parameters()}))
    dtypes["optimizer state"] = ",".join(
        sorted({str(v.dtype) for s in optimizer.state.values() for k, v in s.items() if k != "step"})
    )
    return losses, dtypes


@pytest.mark.parametrize("fp32_reduce_scatter", [False, True], ids=["bf16-reduce", "fp32-reduce"])
def test_bf16_compute_fp32_master_tracks_fp32(pools, fp32_reduce_scatter: bool) -> None:
    world = 2
    results = pools[world].run(train_bf16, world, fp32_reduce_scatter)
    reference = train_reference(world, Case("llama", optimizer="adamw", steps=STEPS))
    losses = torch.stack([torch.stack(r[0]) for r in results]).mean(0)
    torch.testing.assert_close(losses, torch.stack(reference.losses), rtol=LOSS_RTOL, atol=0)
    assert not torch.allclose(losses, torch.stack(reference.losses), rtol=1e-6, atol=0), "bf16 must differ"
    for _, dtypes in results:
        assert dtypes == {
            "matmul weight": "torch.bfloat16",
            "matmul input": "torch.bfloat16",
            "shard grads": "torch.float32",
            "shards": "torch.float32",
            "optimizer state": "torch.float32",
        }
