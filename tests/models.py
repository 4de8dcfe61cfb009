"""The models the parity tests train two ways: FSDP on N replicas, and plain on the CPU.

Every model is built inside ``seeded(0)`` so that each replica and the reference start from the
same parameters. A training step takes the same *global* batch both ways: replica r gets rows
[r * b, (r + 1) * b) of it, the reference all of it, and the loss is a mean over the batch, so the
reference loss equals the mean of the replicas' losses and its gradient the mean of theirs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from tiny_llama import TINY_LLAMA
from transformers import LlamaConfig, LlamaForCausalLM  # at import time: not thread-safe later

from accel_xla_fsdp import XlaFullyShardedDataParallel as FSDP
from accel_xla_fsdp import _xla, checkpoint_module, seeded, transformer_block_policy

LOCAL_BATCH = 2
# The tiny Llama of the launched scripts and the launch tests.
LAUNCH_LLAMA = dict(TINY_LLAMA, vocab_size=64, max_position_embeddings=32, attn_implementation="eager")


@dataclass(frozen=True)
class Case:
    """One parity run: a model, how to wrap it, how to train it."""

    model: str
    fsdp: Tuple[Tuple[str, Any], ...] = ()
    optimizer: str = "sgd"
    steps: int = 3
    accumulation: int = 1
    clip: Optional[float] = None
    checkpoint: bool = False  # activation checkpointing inside every auto-wrapped unit
    in_backward: bool = False  # the optimizer steps each unit in backward (apply_optimizer_in_backward)

    @property
    def fsdp_kwargs(self) -> Dict[str, Any]:
        return dict(self.fsdp)

    @property
    def id(self) -> str:
        opts = "-".join(f"{k}={v}" for k, v in self.fsdp) or "default"
        extra = f"-accum{self.accumulation}" if self.accumulation > 1 else ""
        extra += f"-clip{self.clip}" if self.clip else ""
        extra += "-checkpointed" if self.checkpoint else ""
        extra += "-in-backward" if self.in_backward else ""
        return f"{self.model}-{opts}-{self.optimizer}{extra}"


# ---------------------------------------------------------------------------------------------
# Models


class ResidualBlock(nn.Module):
    """``x + fc2(tanh(fc1(x)))``: the block the compiled-program and memory tests wrap."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class NestedLinear(nn.Module):
    """A stack of Linear layers, some wrapped and some not, nested two deep (the seed's
    NestedWrappedModule)."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Sequential(
            nn.Linear(8, 4),
            nn.Sequential(nn.Linear(4, 16), nn.Linear(16, 16)),
            nn.Linear(16, 4),
            nn.Linear(4, 8),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)

    def wrap(self, **kw: Any) -> FSDP:
        self.module[1][0] = FSDP(self.module[1][0], **kw)
        self.module[1] = FSDP(self.module[1], **kw)
        self.module[2] = FSDP(self.module[2], **kw)
        return FSDP(self, **kw)


class TiedTransformer(nn.Module):
    """A small transformer whose output projection is tied to its embedding, with a float and
    an integer buffer (the seed's TransformerWithSharedParams)."""

    vocab = 23

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(self.vocab, 16)
        # bias=False: a key bias has an exactly-zero gradient (softmax ignores it), and Adam would
        # amplify the round-off noise that stands in for zero into lr-sized updates.
        layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=8, dropout=0.0, batch_first=True, bias=False)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.output_proj = nn.Linear(16, self.vocab)
        self.output_proj.weight = self.embed_tokens.weight
        self.register_buffer("vocab_bias", torch.linspace(-0.5, 0.5, 16))
        self.register_buffer("long_buffer", torch.arange(16, dtype=torch.long) % 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(ids) + self.vocab_bias + 0.01 * self.long_buffer.type_as(self.vocab_bias)
        return self.output_proj(self.encoder(h))

    def wrap(self, **kw: Any) -> FSDP:
        for i, layer in enumerate(self.encoder.layers):
            self.encoder.layers[i] = FSDP(layer, **kw)
        return FSDP(self, **kw)


class ScaledEmbedding(nn.Embedding):
    """An embedding that scales its rows in a forward of its own, as Gemma-2's does: not a stock
    ``nn.Embedding``, so FSDP leaves it unpatched."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * 2.0


class ScaledTiedTransformer(TiedTransformer):
    """TiedTransformer with a ScaledEmbedding tied to its (patched) output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = ScaledEmbedding(self.vocab, 16)
        self.output_proj.weight = self.embed_tokens.weight


class FrozenOdd(nn.Module):
    """Frozen parameters, and sizes that divide by neither 2 nor 4 (7x13, 13, 13x5, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5), nn.Tanh(), nn.Linear(5, 3))
        self.module[0].requires_grad_(False)
        self.module[4].bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)

    def wrap(self, **kw: Any) -> FSDP:
        self.module[2] = FSDP(self.module[2], **kw)
        return FSDP(self, **kw)


class MixtureOfExperts(nn.Module):
    """Shared layers sharded across all replicas, and an expert that differs per replica and is
    sharded in a group of one (the seed's MixtureOfExperts)."""

    def __init__(self, expert: nn.Linear) -> None:
        super().__init__()
        self.module = nn.Sequential(nn.Linear(8, 12), nn.Linear(12, 23), expert, nn.Linear(12, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)

    def wrap(self, world: int, **kw: Any) -> FSDP:
        self.module[1] = FSDP(self.module[1], **kw)
        alone = dict(kw, sharding_groups=[[r] for r in range(world)], sharding_rank=0, sharding_world_size=1)
        self.module[2] = FSDP(self.module[2], **alone)
        return FSDP(self, **kw)


class WideHead(nn.Module):
    """A head whose weight's gradient, 128 wide, takes several reduce-scatter chunks on 2 and 4
    replicas (more than 128 tiles of 16 rows per replica's part: reduce_scatter_in_linear_backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Sequential(nn.Linear(8, 128), nn.Tanh(), nn.Linear(128, 8200))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)

    def wrap(self, **kw: Any) -> FSDP:
        return FSDP(self, **kw)


def make_expert(rank: int) -> nn.Linear:
    with seeded(42 + rank):
        return nn.Linear(23, 12)


LLAMA_CONFIG = dict(
    TINY_LLAMA,
    vocab_size=97,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    use_cache=False,  # training: and a recomputed (checkpointed) forward must not extend a cache
)


def make_llama() -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(**LLAMA_CONFIG, attn_implementation="eager"))


def build(name: str) -> nn.Module:
    """The unwrapped model, identical on every replica and in the reference."""
    makers: Dict[str, Callable[[], nn.Module]] = {
        "nested_linear": NestedLinear,
        "tied_transformer": TiedTransformer,
        "scaled_tied": ScaledTiedTransformer,
        "frozen_odd": FrozenOdd,
        "llama": make_llama,
        "moe": lambda: MixtureOfExperts(nn.Linear(23, 12)),
        "wide_head": WideHead,
    }
    with seeded(0):
        return makers[name]()


def checkpointed_unit(module: nn.Module, *args: Any, **kwargs: Any) -> FSDP:
    return FSDP(checkpoint_module(module), *args, **kwargs)


def wrap(name: str, model: nn.Module, rank: int, world: int, kw: Dict[str, Any], checkpoint: bool = False) -> FSDP:
    if name == "llama":
        wrapper = checkpointed_unit if checkpoint else None
        return FSDP(model, auto_wrap_policy=transformer_block_policy(), auto_wrapper_callable=wrapper, **kw)
    if name == "moe":
        model.module[2] = make_expert(rank)
        return model.wrap(world, **kw)
    return model.wrap(**kw)


# ---------------------------------------------------------------------------------------------
# Data and loss


def global_batch(name: str, step: int, micro: int, world: int) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    rows = LOCAL_BATCH * world
    if name in ("tied_transformer", "scaled_tied", "llama"):
        vocab = LLAMA_CONFIG["vocab_size"] if name == "llama" else TiedTransformer.vocab
        ids = torch.randint(0, vocab, (rows, 12), generator=g)
        return ids, torch.roll(ids, -1, dims=1)
    width = {"nested_linear": (8, 8), "frozen_odd": (7, 3), "moe": (8, 8), "wide_head": (8, 8200)}[name]
    return torch.rand(rows, width[0], generator=g), torch.rand(rows, width[1], generator=g)


def local_slice(batch: Tuple[torch.Tensor, ...], rank: int) -> Tuple[torch.Tensor, ...]:
    return tuple(t[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH] for t in batch)


def compute_loss(name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if name == "llama":
        # With a mask, transformers 5 does not read position ids back to the host to look for
        # packed sequences: a read each replica thread compiles at once, which torch_xla 2.9 has
        # crashed on (SIGSEGV, seen once in a full run).
        return model(input_ids=x, attention_mask=torch.ones_like(x), labels=x).loss
    out = model(x)
    if name in ("tied_transformer", "scaled_tied"):
        return F.cross_entropy(out.reshape(-1, out.size(-1)).float(), y.reshape(-1))
    return F.mse_loss(out.float(), y)


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


# ---------------------------------------------------------------------------------------------
# The two ways to train


@dataclass
class Trace:
    losses: List[torch.Tensor] = field(default_factory=list)
    grad_norms: List[torch.Tensor] = field(default_factory=list)
    state: Dict[str, torch.Tensor] = field(default_factory=dict)


def train_fsdp(rank: int, world: int, case: Case) -> Trace:
    """Replica ``rank`` of ``world``: FSDP training on its slice of every global batch."""
    model = wrap(case.model, build(case.model), rank, world, case.fsdp_kwargs, case.checkpoint)
    optimizer = make_optimizer(case.optimizer, model.parameters())
    if case.in_backward:
        model.apply_optimizer_in_backward(optimizer)
    dev, trace = _xla.device(), Trace()
    for step in range(case.steps):
        step_loss = torch.zeros((), device=dev)
        for micro in range(case.accumulation):
            x, y = (t.to(dev) for t in local_slice(global_batch(case.model, step, micro, world), rank))
            # in backward, the optimizer steps at the backward that syncs: the others under no_sync
            last = micro == case.accumulation - 1
            with model.no_sync() if case.in_backward and not last else contextlib.nullcontext():
                loss = compute_loss(case.model, model, x, y) / case.accumulation
                loss.backward()
            step_loss = step_loss + loss.detach()
        if case.clip:
            trace.grad_norms.append(model.clip_grad_norm_(case.clip))
        optimizer.step()
        optimizer.zero_grad()
        _xla.sync()
        trace.losses.append(step_loss)
    trace.state = model.full_state_dict()
    return trace


def train_reference(world: int, case: Case) -> Trace:
    """The same training on the CPU, one plain model, whole global batches."""
    model = build(case.model)
    params = list(model.parameters())
    optimizer = make_optimizer(case.optimizer, params)
    trace = Trace()
    for step in range(case.steps):
        step_loss = torch.zeros(())
        for micro in range(case.accumulation):
            x, y = global_batch(case.model, step, micro, world)
            loss = compute_loss(case.model, model, x, y) / case.accumulation
            loss.backward()
            step_loss += loss.detach()
        if case.clip:
            trace.grad_norms.append(torch.nn.utils.clip_grad_norm_(params, case.clip))
        optimizer.step()
        optimizer.zero_grad()
        trace.losses.append(step_loss)
    trace.state = _plain_state(model)
    return trace


def train_moe_reference(world: int, case: Case) -> Tuple[Trace, List[Dict[str, torch.Tensor]]]:
    """MoE on the CPU: replica r's batch goes through expert r. Shared gradients are the mean over
    replicas (as FSDP's reduction gives); each expert's is its own replica's, unscaled."""
    shared = build("moe")
    experts = [make_expert(r) for r in range(world)]
    params = list(shared.parameters()) + [p for e in experts for p in e.parameters()]
    optimizer = make_optimizer(case.optimizer, params)
    trace = Trace()
    for step in range(case.steps):
        x, y = global_batch("moe", step, 0, world)
        losses = []
        for r, expert in enumerate(experts):
            shared.module[2] = expert
            xr, yr = local_slice((x, y), r)
            losses.append(compute_loss("moe", shared, xr, yr))
        loss = torch.stack(losses).mean()
        loss.backward()
        for p in (p for e in experts for p in e.parameters()):
            p.grad.mul_(world)
        optimizer.step()
        optimizer.zero_grad()
        trace.losses.append(loss.detach())
    shared.module[2] = nn.Identity()
    trace.state = _plain_state(shared)
    return trace, [{f"module.2.{k}": v for k, v in _plain_state(e).items()} for e in experts]


def _plain_state(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Parameters (each once, under its first name, as ``named_parameters`` gives) and buffers."""
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    state.update({n: b.detach().clone() for n, b in model.named_buffers()})
    return state
