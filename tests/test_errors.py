"""Bad input gets an error that names what is at fault and what to do.

Each attempt runs inside the replicas and returns its message (a replica that raised would end the
device process, and these are cheap to collect in one run). Nothing here syncs, so replicas that
fail differently cannot fall out of step.
"""

from __future__ import annotations

from typing import Callable, Dict

import pytest
import torch
import torch.nn as nn

from accel_xla_fsdp import XlaFullyShardedDataParallel, _xla, predicate_policy

NO_SYNC = dict(execute_sharding_on_init=False)


def FSDP(module: nn.Module, **kw) -> XlaFullyShardedDataParallel:
    return XlaFullyShardedDataParallel(module, **NO_SYNC, **kw)


def attempt(fn: Callable[[], object]) -> str:
    try:
        fn()
    except (ValueError, RuntimeError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def optimizer_on_unwrapped_params() -> None:
    module = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    model = FSDP(module)
    model(torch.ones(2, 4, device=_xla.device())).sum().backward()
    optimizer.step()


def tied_across_units() -> None:
    embed, head = nn.Embedding(5, 4), nn.Linear(4, 5, bias=False)
    head.weight = embed.weight
    model = nn.Sequential(embed, head)
    model[1] = FSDP(model[1])
    FSDP(model)


def stepped_in_backward() -> XlaFullyShardedDataParallel:
    model = FSDP(nn.Linear(4, 4))
    model.apply_optimizer_in_backward(torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.ones(2, 4, device=_xla.device())).sum().backward()
    return model


def two_backwards_in_backward() -> None:
    """Accumulating without no_sync: the second backward would apply its gradients on top."""
    model = stepped_in_backward()
    model(torch.ones(2, 4, device=_xla.device())).sum().backward()


def bad_inputs(rank: int, world: int) -> Dict[str, str]:
    wrapped_once = nn.Linear(4, 4)
    wrapper = FSDP(wrapped_once)
    nested = nn.Sequential(FSDP(nn.Linear(4, 4)), nn.Linear(4, 4))
    two_devices = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).to(_xla.device()))
    all_replicas = list(range(world))
    cases = {
        "wrap_a_wrapper": lambda: FSDP(wrapper),
        "wrap_a_module_twice": lambda: FSDP(wrapped_once),
        "auto_wrap_over_wrapped": lambda: FSDP(nested, auto_wrap_policy=predicate_policy(lambda m: True)),
        "mixed_devices": lambda: FSDP(two_devices),
        "flatten_and_dim0": lambda: FSDP(nn.Linear(4, 4), flatten_parameters=True, shard_param_on_dim_0=True),
        "vocabulary_without_dim0": lambda: FSDP(nn.Linear(4, 4), keep_vocabulary_sharded=True),
        "loss_in_chunks_without_vocabulary": lambda: FSDP(
            nn.Linear(4, 4), shard_param_on_dim_0=True, lm_loss_in_chunks=True
        ),
        "integer_compute_dtype": lambda: FSDP(nn.Linear(4, 4), compute_dtype=torch.int32),
        "wrapper_without_policy": lambda: FSDP(nn.Linear(4, 4), auto_wrapper_callable=FSDP),
        "module_list": lambda: FSDP(nn.ModuleList([nn.Linear(2, 2)])),
        "groups_without_rank": lambda: FSDP(nn.Linear(4, 4), sharding_groups=[all_replicas]),
        "groups_miss_a_replica": lambda: FSDP(
            nn.Linear(4, 4), sharding_groups=[all_replicas[:-1]], sharding_rank=0, sharding_world_size=world - 1
        ),
        "groups_wrong_size": lambda: FSDP(
            nn.Linear(4, 4), sharding_groups=[[r] for r in all_replicas], sharding_rank=0, sharding_world_size=world
        ),
        "groups_wrong_rank": lambda: FSDP(
            nn.Linear(4, 4), sharding_groups=[all_replicas], sharding_rank=0, sharding_world_size=world
        ),
        "optimizer_on_unwrapped_params": optimizer_on_unwrapped_params,
        "tied_across_units": tied_across_units,
        "clip_in_backward": lambda: stepped_in_backward().clip_grad_norm_(1.0),
        "two_backwards_in_backward": two_backwards_in_backward,
        "in_backward_not_an_optimizer": lambda: FSDP(nn.Linear(4, 4)).apply_optimizer_in_backward(object()),
    }
    return {name: attempt(fn) for name, fn in cases.items()}


EXPECTED = {
    "wrap_a_wrapper": ("ValueError", "already an XlaFullyShardedDataParallel", "wrap each module once"),
    "wrap_a_module_twice": ("ValueError", "Linear is already wrapped", "use the wrapper"),
    "auto_wrap_over_wrapped": ("ValueError", "'0' is already wrapped", "pass the unwrapped model"),
    "mixed_devices": ("ValueError", "'0.weight' on cpu", "on xla:", "move the whole module to one device"),
    "flatten_and_dim0": ("ValueError", "flatten_parameters=True and shard_param_on_dim_0=True", "Choose one"),
    "vocabulary_without_dim0": ("ValueError", "keep_vocabulary_sharded=True needs shard_param_on_dim_0", "Set"),
    "loss_in_chunks_without_vocabulary": ("ValueError", "lm_loss_in_chunks=True needs keep_vocabulary_sharded", "Set"),
    "integer_compute_dtype": ("ValueError", "compute_dtype must be one of", "torch.int32"),
    "wrapper_without_policy": ("ValueError", "auto_wrapper_callable needs an auto_wrap_policy"),
    "module_list": ("ValueError", "ModuleList has no forward", "wrap its members"),
    "groups_without_rank": ("ValueError", "sharding_groups needs sharding_rank and sharding_world_size"),
    "groups_miss_a_replica": ("ValueError", "must cover each of the", "exactly once"),
    "groups_wrong_size": ("ValueError", "have sizes [1]", "sharding_world_size is"),
    "optimizer_on_unwrapped_params": (
        "ValueError",
        "holds 'weight' of the unwrapped model",
        "build the optimizer after wrapping",
    ),
    "tied_across_units": (
        "ValueError",
        "parameter '0.weight' is also used by",
        "wrap the modules that share it together",
    ),
    "clip_in_backward": ("RuntimeError", "clip_grad_norm_: the optimizer steps in backward", "max_grad_norm=0"),
    "two_backwards_in_backward": ("RuntimeError", "a second backward stepped the optimizer", "model.no_sync()"),
    "in_backward_not_an_optimizer": ("TypeError", "takes a torch.optim.Optimizer", "not object"),
}


@pytest.fixture(scope="module")
def messages(pools):
    return pools[2].run(bad_inputs, 2)


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_bad_input_is_named(messages, case: str) -> None:
    for rank_messages in messages:
        message = rank_messages[case]
        for fragment in EXPECTED[case]:
            assert fragment in message, f"{case}: {message!r} lacks {fragment!r}"


def test_sharding_rank_must_match_position_in_group(messages) -> None:
    assert messages[0]["groups_wrong_rank"] == "no error"
    assert (
        "replica 1 is at position 1 of its sharding group [0, 1], but sharding_rank is 0"
        in messages[1]["groups_wrong_rank"]
    )
