"""Wrap policies and ``recursive_wrap`` (no devices), and one auto-wrapped Llama on 2 devices.

transformers' model classes are imported here at module level: its lazy imports are not
thread-safe, and replica threads must not be the first to touch them.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List

import pytest
import torch
import torch.nn as nn
import torch_xla.distributed.fsdp.wrap as xla_wrap
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaMLP

import accel_xla_fsdp
from accel_xla_fsdp import (
    TransformerBlockPolicy,
    XlaFullyShardedDataParallel,
    _xla,
    lambda_auto_wrap_policy,
    predicate_policy,
    size_based_auto_wrap_policy,
    size_policy,
    transformer_auto_wrap_policy,
    transformer_block_policy,
)
from accel_xla_fsdp.wrap import recursive_wrap, resolve_policy

# ---------------------------------------------------------------------------------------------
# Models and a wrapper that only records


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(4, 4)  # 20 parameters
        self.mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))  # 40 + 36 = 76

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.attn(x))


class SubBlock(Block):
    pass


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)  # 40
        self.layers = nn.ModuleList([Block(), SubBlock()])  # 96 each
        self.head = nn.Linear(4, 10)  # 50

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class Containers(nn.Module):
    """Small leaves in containers: only the containers are big enough for a size policy."""

    def __init__(self) -> None:
        super().__init__()
        self.stack = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])  # 3 x 20
        self.named = nn.ModuleDict({k: nn.Linear(4, 4) for k in "abc"})  # 3 x 20


class Recorder(nn.Module):
    """A stand-in for the FSDP class: remembers what it wrapped, in which order, with which kwargs."""

    def __init__(self, module: nn.Module, log: List[nn.Module], **kwargs: Any) -> None:
        super().__init__()
        self.module = module
        self.kwargs = kwargs
        log.append(module)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def _wrap(root: nn.Module, policy, **kwargs: Any) -> List[nn.Module]:
    log: List[nn.Module] = []
    recursive_wrap(root, policy, Recorder, {"log": log, **kwargs})
    return log


def _recorders(root: nn.Module) -> Dict[str, Recorder]:
    return {name: m for name, m in root.named_modules() if isinstance(m, Recorder)}


def tiny_llama_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    )


def tiny_llama() -> LlamaForCausalLM:
    with accel_xla_fsdp.seeded(0):
        return LlamaForCausalLM(tiny_llama_config())


# ---------------------------------------------------------------------------------------------
# Policies called as recursive_wrap calls them (keyword arguments)


def test_transformer_auto_wrap_policy_decides_by_class() -> None:
    decide = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    for module in (Block(), SubBlock(), nn.Linear(2, 2), nn.ModuleList()):
        assert decide(module=module, recurse=True, unwrapped_params=0) is True  # always looks inside
    assert decide(module=Block(), recurse=False, unwrapped_params=0) is True
    assert decide(module=SubBlock(), recurse=False, unwrapped_params=10**9) is True  # subclasses too
    assert decide(module=nn.Linear(2, 2), recurse=False, unwrapped_params=10**9) is False
    assert decide(module=Net(), recurse=False, unwrapped_params=10**9) is False


def test_size_based_auto_wrap_policy_decides_by_unwrapped_count() -> None:
    lin = nn.Linear(2, 2)
    decide = functools.partial(size_based_auto_wrap_policy, min_num_params=100)
    assert decide(module=lin, recurse=True, unwrapped_params=100) is True
    assert decide(module=lin, recurse=True, unwrapped_params=99) is False
    assert decide(module=lin, recurse=False, unwrapped_params=100) is True
    assert decide(module=lin, recurse=False, unwrapped_params=99) is False
    # The count that matters is the one passed in, not the module's own size.
    assert decide(module=nn.Linear(100, 100), recurse=False, unwrapped_params=5) is False
    # Default threshold: 1e8.
    assert size_based_auto_wrap_policy(module=lin, recurse=False, unwrapped_params=10**8 - 1) is False
    assert size_based_auto_wrap_policy(module=lin, recurse=False, unwrapped_params=10**8) is True
    # size_policy is the same partial.
    assert size_policy(100)(module=lin, recurse=False, unwrapped_params=100) is True
    assert size_policy(100)(module=lin, recurse=False, unwrapped_params=99) is False


@pytest.mark.parametrize("container", [nn.ModuleList([nn.Linear(2, 2)]), nn.ModuleDict({"a": nn.Linear(2, 2)})])
def test_size_based_auto_wrap_policy_never_wraps_containers(container: nn.Module) -> None:
    decide = functools.partial(size_based_auto_wrap_policy, min_num_params=1)
    assert decide(module=container, recurse=True, unwrapped_params=10**9) is True  # but looks inside
    assert decide(module=container, recurse=False, unwrapped_params=10**9) is False


def test_lambda_auto_wrap_policy_follows_the_function() -> None:
    decide = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.Linear))
    assert decide(module=nn.ReLU(), recurse=True, unwrapped_params=0) is True  # always looks inside
    assert decide(module=nn.Linear(2, 2), recurse=False, unwrapped_params=0) is True
    assert decide(module=nn.ReLU(), recurse=False, unwrapped_params=10**9) is False
    truthy = predicate_policy(lambda m: 1 if isinstance(m, nn.ReLU) else 0)
    assert truthy(module=nn.ReLU(), recurse=False, unwrapped_params=0) is True  # a bool, not 1
    assert truthy(module=nn.Linear(2, 2), recurse=False, unwrapped_params=0) is False


def _decision_grid(ours, theirs, modules) -> None:
    for module in modules:
        for recurse in (True, False):
            for unwrapped in (0, 19, 20, 21, 10**8):
                kw = dict(module=module, recurse=recurse, unwrapped_params=unwrapped)
                assert bool(ours(**kw)) == bool(theirs(**kw)), (type(module).__name__, kw)


def test_policies_decide_like_torch_xla() -> None:
    modules = list(Net().modules()) + list(Containers().modules())
    _decision_grid(
        functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
        functools.partial(xla_wrap.transformer_auto_wrap_policy, transformer_layer_cls={Block}),
        modules,
    )
    _decision_grid(
        size_policy(20), functools.partial(xla_wrap.size_based_auto_wrap_policy, min_num_params=20), modules
    )
    is_linear = lambda m: isinstance(m, nn.Linear)  # noqa: E731
    _decision_grid(
        predicate_policy(is_linear), functools.partial(xla_wrap.lambda_auto_wrap_policy, lambda_fn=is_linear), modules
    )


def test_size_based_policy_keeps_multihead_attention_whole() -> None:
    mha = nn.MultiheadAttention(32, 2)
    big = 10**6
    theirs = xla_wrap.size_based_auto_wrap_policy(module=mha, recurse=True, unwrapped_params=big, min_num_params=1000)
    assert theirs is False
    assert size_based_auto_wrap_policy(module=mha, recurse=True, unwrapped_params=big, min_num_params=1000) is False
    # As in torch_xla, a leaf is neither looked into nor wrapped alone: it stays whole inside the
    # unit around it (here the inner Sequential), never split from its out_proj.
    root = nn.Sequential(nn.Sequential(nn.MultiheadAttention(32, 2), nn.Linear(32, 4)), nn.Linear(4, 4))
    log = _wrap(root, size_policy(1000))
    assert [type(m).__name__ for m in log] == ["Sequential"]
    assert isinstance(log[0][0], nn.MultiheadAttention)


# ---------------------------------------------------------------------------------------------
# recursive_wrap


def test_recursive_wrap_wraps_the_chosen_blocks_keeping_names_and_kwargs() -> None:
    net = Net()
    block0, block1, embed, head = net.layers[0], net.layers[1], net.embed, net.head
    names_before = [name for name, _ in net.named_children()]
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    log = _wrap(net, policy, tag="unit", reshard_after_forward=False)

    assert [id(m) for m in log] == [id(block0), id(block1)]  # in module order, SubBlock included
    assert not isinstance(net, Recorder)  # in place; the root is never wrapped
    assert [name for name, _ in net.named_children()] == names_before
    assert isinstance(net.layers, nn.ModuleList) and len(net.layers) == 2
    assert isinstance(net.layers[0], Recorder) and net.layers[0].module is block0
    assert isinstance(net.layers[1], Recorder) and net.layers[1].module is block1
    assert net.embed is embed and net.head is head
    assert set(_recorders(net)) == {"layers.0", "layers.1"}
    for rec in _recorders(net).values():
        assert rec.kwargs == {"tag": "unit", "reshard_after_forward": False}
    # The wrapped model still computes what it did.
    ids = torch.tensor([[1, 2, 3]])
    assert net(ids).shape == (1, 3, 10)


def test_recursive_wrap_goes_innermost_first() -> None:
    net = Net()
    block0, block1 = net.layers[0], net.layers[1]
    mlp0, mlp1 = block0.mlp, block1.mlp
    policy = predicate_policy(lambda m: isinstance(m, (Block, nn.Sequential)))
    log = _wrap(net, policy)
    assert [id(m) for m in log] == [id(mlp0), id(block0), id(mlp1), id(block1)]
    assert set(_recorders(net)) == {"layers.0", "layers.0.module.mlp", "layers.1", "layers.1.module.mlp"}
    assert isinstance(block0.mlp, Recorder) and block0.mlp.module is mlp0  # inner wrapped in place


def test_recursive_wrap_never_wraps_the_root() -> None:
    net = Net()
    every_module = [m for m in net.modules() if m is not net]
    log = _wrap(net, predicate_policy(lambda m: True))
    assert all(m is not net for m in log)
    assert {id(m) for m in log} == {id(m) for m in every_module}
    assert len(log) == len(every_module)
    # A root that the policy would wrap stays itself, even alone.
    lone = nn.Linear(3, 3)
    assert _wrap(lone, predicate_policy(lambda m: True)) == []


def test_recursive_wrap_passes_unwrapped_counts_and_respects_recurse_false() -> None:
    net = Net()
    calls: List[tuple] = []

    def policy(module: nn.Module, recurse: bool, unwrapped_params: int) -> bool:
        calls.append((type(module).__name__, recurse, unwrapped_params))
        if recurse:
            return not isinstance(module, SubBlock)  # do not look inside the second block
        return isinstance(module, (nn.Sequential, SubBlock))

    log = _wrap(net, policy)
    assert ("Block", True, 96) in calls
    assert ("Block", False, 20) in calls  # 96 minus its wrapped mlp (76)
    assert ("SubBlock", True, 96) in calls
    # The policy declined to look inside SubBlock: neither it nor its children were wrapped or asked.
    assert ("SubBlock", False, 96) not in calls
    assert [type(m).__name__ for m in log] == ["Sequential"]
    assert not any(name == "Net" and not recurse for name, recurse, _ in calls)  # root: never asked to wrap


def test_size_policy_with_recursive_wrap() -> None:
    net = Net()
    mlp0, mlp1, head = net.layers[0].mlp, net.layers[1].mlp, net.head
    log = _wrap(net, size_policy(50))
    # mlp (76) is wrapped; its block's remainder (20) is not; embed (40) is too small; head (50) is.
    assert [id(m) for m in log] == [id(mlp0), id(mlp1), id(head)]

    containers = Containers()
    # Each leaf (20) is below 50; each container's remainder (60) is above, but containers are never units.
    assert _wrap(containers, size_policy(50)) == []
    log = _wrap(containers, size_policy(20))
    assert len(log) == 6 and all(isinstance(m, nn.Linear) for m in log)


def test_torch_xla_policies_work_with_our_recursive_wrap() -> None:
    net = Net()
    log = _wrap(net, functools.partial(xla_wrap.transformer_auto_wrap_policy, transformer_layer_cls={Block}))
    assert set(_recorders(net)) == {"layers.0", "layers.1"} and len(log) == 2

    net = Net()
    log = _wrap(net, functools.partial(xla_wrap.size_based_auto_wrap_policy, min_num_params=50))
    assert set(_recorders(net)) == {"layers.0.mlp", "layers.1.mlp", "head"}

    net = Net()
    _wrap(net, functools.partial(xla_wrap.lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.Embedding)))
    assert set(_recorders(net)) == {"embed"}

    net = Net()
    _wrap(net, xla_wrap.always_wrap_policy)
    assert len(_recorders(net)) == len([m for m in Net().modules()]) - 1

    llama = tiny_llama()
    log = _wrap(
        llama, functools.partial(xla_wrap.transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    )
    assert set(_recorders(llama)) == {"model.layers.0", "model.layers.1"}


# ---------------------------------------------------------------------------------------------
# transformer_block_policy


def test_transformer_block_policy_defaults_to_no_split_modules() -> None:
    model = tiny_llama()
    assert list(model._no_split_modules) == ["LlamaDecoderLayer"]
    layers = list(model.model.layers)
    policy = transformer_block_policy()
    assert isinstance(policy, TransformerBlockPolicy)
    bound = resolve_policy(policy, model)
    assert bound(module=layers[0], recurse=False, unwrapped_params=0) is True
    assert bound(module=model.model.norm, recurse=False, unwrapped_params=10**9) is False
    log = _wrap(model, bound)
    assert [id(m) for m in log] == [id(layer) for layer in layers]
    assert set(_recorders(model)) == {"model.layers.0", "model.layers.1"}


@pytest.mark.parametrize(
    "classes, expected",
    [
        ([LlamaMLP], {f"model.layers.{i}.mlp" for i in range(2)}),
        (["LlamaMLP"], {f"model.layers.{i}.mlp" for i in range(2)}),
        (
            ["LlamaRMSNorm"],
            {f"model.layers.{i}.{n}" for i in range(2) for n in ("input_layernorm", "post_attention_layernorm")}
            | {"model.norm"},
        ),
        (
            [LlamaDecoderLayer, "LlamaRMSNorm"],  # norms inside the blocks are wrapped first, then the blocks
            {"model.layers.0", "model.layers.1", "model.norm"}
            | {
                f"model.layers.{i}.module.{n}"
                for i in range(2)
                for n in ("input_layernorm", "post_attention_layernorm")
            },
        ),
    ],
    ids=["type", "name", "name-several-instances", "type-and-name"],
)
def test_transformer_block_policy_with_explicit_classes(classes, expected) -> None:
    model = tiny_llama()
    _wrap(model, resolve_policy(transformer_block_policy(classes), model))
    assert set(_recorders(model)) == expected


def test_transformer_block_policy_without_no_split_modules_asks_for_classes() -> None:
    model = nn.Sequential(nn.Linear(4, 4), Block())
    with pytest.raises(ValueError, match=r"no _no_split_modules") as info:
        resolve_policy(transformer_block_policy(), model)
    assert "transformer_block_policy(" in str(info.value)  # tells the user how to name the blocks
    # Naming them works on the same model.
    _wrap(model, resolve_policy(transformer_block_policy([Block]), model))
    assert set(_recorders(model)) == {"1"}


@pytest.mark.parametrize("missing", ["GPT2Block", nn.Conv2d], ids=["name", "type"])
def test_transformer_block_policy_rejects_classes_not_in_the_model(missing) -> None:
    model = tiny_llama()
    name = missing if isinstance(missing, str) else missing.__name__
    with pytest.raises(ValueError, match=name):
        transformer_block_policy([LlamaDecoderLayer, missing]).for_model(model)


def test_transformer_block_policy_must_be_bound_to_a_model() -> None:
    with pytest.raises(TypeError, match="bound to its model"):
        transformer_block_policy()(module=nn.Linear(2, 2), recurse=False, unwrapped_params=0)


# ---------------------------------------------------------------------------------------------
# On devices: the FSDP wrapper with the block policy


def wrap_tiny_llama_and_step(rank: int) -> dict:
    model = tiny_llama()
    fsdp = XlaFullyShardedDataParallel(model, auto_wrap_policy=transformer_block_policy())
    layers = fsdp.module.model.layers
    units = [name for name, m in fsdp.named_modules() if isinstance(m, XlaFullyShardedDataParallel)]
    dev = _xla.device()
    ids = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29]]).to(dev)
    out = fsdp(input_ids=ids, labels=ids)
    out.loss.backward()
    _xla.sync()
    shards = list(fsdp.parameters())
    return {
        "layer_types": [type(layer).__name__ for layer in layers],
        "inner_types": [type(layer.module).__name__ for layer in layers],
        "units": units,
        "loss": out.loss.detach(),
        "grads_present": [p.grad is not None for p in shards if p.requires_grad],
        "grads_finite": all(bool(torch.isfinite(p.grad).all()) for p in shards if p.grad is not None),
        "grad_abs_sum": sum(float(p.grad.abs().sum()) for p in shards if p.grad is not None),
    }


def test_block_policy_makes_each_decoder_layer_a_unit_and_trains(pools) -> None:
    results = pools[2].run(wrap_tiny_llama_and_step)
    reference = tiny_llama()
    ids = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29]])
    expected_loss = reference(input_ids=ids, labels=ids).loss.detach()
    assert len(results) == 2
    for res in results:
        assert res["layer_types"] == ["XlaFullyShardedDataParallel"] * 2
        assert res["inner_types"] == ["LlamaDecoderLayer"] * 2
        assert len(res["units"]) == 3  # the root and one per decoder layer
        assert res["units"][0] == ""
        assert all("layers.0" in u or "layers.1" in u for u in res["units"][1:])
        assert res["grads_present"] and all(res["grads_present"])
        assert res["grads_finite"] and res["grad_abs_sum"] > 0
        torch.testing.assert_close(res["loss"], expected_loss, rtol=1e-4, atol=1e-4)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)


class _DecoderOnly(nn.Module):
    # Like transformers' encoder-decoder families, it names a block class it does not contain.
    _no_split_modules = ["_EncoderBlock", "_Block"]

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_transformer_block_policy_skips_no_split_classes_the_model_lacks() -> None:
    model = _DecoderOnly()
    log = _wrap(model, transformer_block_policy().for_model(model))
    assert [type(m).__name__ for m in log] == ["_Block", "_Block"]
    with pytest.raises(ValueError, match=r"_EncoderBlock"):
        transformer_block_policy(["_EncoderBlock", "_Block"]).for_model(model)
