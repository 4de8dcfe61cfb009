"""The main job: fine-tune a tiny Llama with XLA FSDP behind Hugging Face Accelerate.

    accelerate launch --config_file plugins/xla_fsdp_cpu.yaml scripts/finetune.py [options]
    bash scripts/finetune.sh [options]          # the same, setting up .venv first

A stock Accelerate loop (its one change is the ``Accelerator`` import) on 4 XLA:CPU devices:

- model: a ``LlamaForCausalLM`` built from a ``LlamaConfig`` (4 layers, hidden size 64,
  vocabulary 256: one UTF-8 byte is one token), the same on every replica (``seeded``);
- data: scripts/data/corpus.txt through ``datasets``, packed into blocks of ``--seq-len`` bytes
  and split into train and eval blocks; the global batch is split between the replicas;
- AdamW, cosine schedule with warmup, gradient accumulation, gradient clipping;
- a progress bar (main process) with the training loss and tokens/s every ``--log-every`` steps;
- evaluation (loss, perplexity) every ``--eval-every`` steps and at the end;
- sharded checkpoints every ``--save-every`` steps and at the end, the newest ``--keep`` kept;
  after a stop, the same command with ``--resume`` continues from the newest;
- at the end, on the main process: the last checkpoint consolidated into a Hugging Face folder
  (``<output-dir>/model``), the loss curve (``<output-dir>/loss.png``), and that folder loaded
  back with ``from_pretrained`` on the CPU: its evaluation loss and a greedy sample.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # wall time includes the imports

import argparse
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local: never ask the hub
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import datasets
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration
from datasets import Dataset, load_dataset
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

# Model classes are imported here, before the replica threads start: transformers' lazy imports
# are not thread-safe.
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, get_cosine_schedule_with_warmup

import accel_xla_fsdp
from accel_xla_fsdp import Accelerator, seeded
from accel_xla_fsdp.integration.checkpoints import numbered_checkpoints

CORPUS = Path(__file__).parent / "data" / "corpus.txt"
VOCAB = 256  # byte-level: token = UTF-8 byte


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", type=Path, default=Path("runs/finetune"),
                   help="checkpoints/, model/ (consolidated) and loss.png go here")
    p.add_argument("--steps", type=int, default=150, help="optimizer steps (keep it when resuming)")
    p.add_argument("--batch-size", type=int, default=8, help="global batch in blocks, split between the replicas")
    p.add_argument("--accum", type=int, default=2, help="gradient accumulation: micro-batches per optimizer step")
    p.add_argument("--seq-len", type=int, default=64, help="tokens (bytes) per block")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=10, help="warmup steps of the cosine schedule")
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--eval-fraction", type=float, default=0.15, help="share of the blocks held out for evaluation")
    p.add_argument("--eval-batch-size", type=int, default=8, help="global evaluation batch, in blocks")
    p.add_argument("--log-every", type=int, default=5, help="steps between progress-bar updates of loss and tokens/s")
    p.add_argument("--eval-every", type=int, default=25, help="steps between evaluations")
    p.add_argument("--save-every", type=int, default=50, help="steps between sharded checkpoints")
    p.add_argument("--keep", type=int, default=2, help="checkpoints kept (total_limit)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --output-dir")
    p.add_argument("--overwrite", action="store_true", help="start again, removing the checkpoints of an earlier run")
    p.add_argument("--prompt", default="The lighthouse", help="start of the generated sample")
    p.add_argument("--sample-tokens", type=int, default=50,
                   help="bytes generated after the prompt (prompt and sample within --seq-len: the length trained on)")
    args = p.parse_args()
    for name in ("steps", "batch_size", "accum", "seq_len", "eval_batch_size", "log_every", "eval_every", "save_every", "keep"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.resume and args.overwrite:
        p.error("--resume and --overwrite exclude each other")
    return args


# -- data and model ----------------------------------------------------------------------------


def load_blocks(path: Path, seq_len: int) -> Dataset:
    """The corpus as byte tokens packed into rows of ``seq_len`` (``input_ids``), via ``datasets``."""
    datasets.disable_progress_bars()
    lines = load_dataset("text", data_files=str(path), split="train", keep_in_memory=True)
    tokens = lines.map(lambda row: {"input_ids": list((row["text"] + "\n").encode("utf-8"))},
                       remove_columns=["text"], keep_in_memory=True)

    def pack(batch: Dict[str, List[List[int]]]) -> Dict[str, List[List[int]]]:
        flat = [t for ids in batch["input_ids"] for t in ids]
        usable = len(flat) - len(flat) % seq_len
        return {"input_ids": [flat[i : i + seq_len] for i in range(0, usable, seq_len)]}

    return tokens.map(pack, batched=True, batch_size=len(tokens), keep_in_memory=True)


def split_blocks(blocks: Dataset, eval_fraction: float, eval_batch: int) -> Tuple[Dataset, Dataset]:
    """Train and eval blocks (seeded); the eval set is cut to whole global batches, so that every
    replica evaluates as many rows, each row once."""
    split = blocks.train_test_split(test_size=eval_fraction, seed=0)
    held_out = len(split["test"]) - len(split["test"]) % eval_batch
    if held_out == 0:
        raise ValueError(f"{len(split['test'])} eval blocks, fewer than one eval batch of {eval_batch}")
    train, evals = split["train"], split["test"].select(range(held_out))
    return train.with_format("torch"), evals.with_format("torch")


def model_config(seq_len: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=seq_len, attn_implementation="eager",
        bos_token_id=None, eos_token_id=None, pad_token_id=0,  # byte 0 never occurs in the corpus
    )


def lm_loss(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss of the rows. The attention mask spares transformers a read-back of
    the position ids mid-forward (each replica thread would compile it at once)."""
    return model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), labels=input_ids).loss


def optimizer_for(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW, without weight decay on norms (1-d parameters)."""
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


# -- training state ----------------------------------------------------------------------------


@dataclass
class History:
    """Optimizer steps done and the losses logged so far; saved with every checkpoint
    (``register_for_checkpointing``), so a resumed run plots and reports the whole run."""

    step: int = 0
    train: List[Tuple[int, float]] = field(default_factory=list)  # (step, mean training loss since the last log)
    evals: List[Tuple[int, float]] = field(default_factory=list)  # (step, eval loss)

    def state_dict(self) -> Dict[str, Any]:
        return {"step": self.step, "train": self.train, "evals": self.evals}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.step = state["step"]
        self.train = [tuple(t) for t in state["train"]]
        self.evals = [tuple(e) for e in state["evals"]]


def checkpoints_of(output_dir: Path) -> List[Path]:
    """The ``checkpoint_<n>`` folders ``save_state`` wrote under ``output_dir``, oldest first."""
    return numbered_checkpoints(output_dir / "checkpoints")


def training_batches(accelerator: Accelerator, loader: Any, step: int, accum: int) -> Iterator[Dict[str, torch.Tensor]]:
    """Training batches, epoch after epoch, from optimizer step ``step`` on. An epoch's last
    micro-batch always ends an optimizer step (Accelerate syncs at the end of the dataloader),
    so an epoch is ceil(batches / accum) steps; the seedable sampler's order depends on the epoch."""
    steps_per_epoch = math.ceil(len(loader) / accum)
    epoch, done = divmod(step, steps_per_epoch)
    skip = done * accum
    while True:
        loader.set_epoch(epoch)
        yield from accelerator.skip_first_batches(loader, skip)
        epoch, skip = epoch + 1, 0


def train_step(
    accelerator: Accelerator, model: torch.nn.Module, optimizer: Any, scheduler: Any,
    batches: Iterator[Dict[str, torch.Tensor]], max_grad_norm: float,
) -> Tuple[torch.Tensor, int]:
    """One optimizer step: micro-batches until Accelerate syncs the gradients. Returns the sum of
    their losses (on the device: nothing is read back) and their number."""
    total, count = torch.zeros((), device=accelerator.device), 0
    while True:
        batch = next(batches)  # before accumulate(), which asks whether it is the epoch's last batch
        with accelerator.accumulate(model):
            loss = lm_loss(model, batch["input_ids"])
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        total, count = total + loss.detach(), count + 1
        if accelerator.sync_gradients:
            return total, count


def evaluate(accelerator: Accelerator, model: torch.nn.Module, loader: Any) -> float:
    """Mean loss over the eval blocks (every replica's batches are the same size)."""
    model.eval()
    total = torch.zeros((), device=accelerator.device)
    with torch.no_grad():
        for batch in loader:
            total = total + lm_loss(model, batch["input_ids"])
    model.train()
    return (accelerator.reduce(total, "mean") / len(loader)).item()


def due(step: int, every: int, last: int) -> bool:
    return step % every == 0 or step == last


# -- after training (main process) ------------------------------------------------------------


def plot_losses(history: History, title: str, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*zip(*history.train), label="train (mean since last log)")
    ax.plot(*zip(*history.evals), "o-", label="eval")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats per byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def reload_and_check(folder: Path, eval_set: Dataset, batch_size: int, prompt: str, new_tokens: int) -> Tuple[float, str]:
    """Load ``folder`` with plain ``transformers`` on the CPU: its eval loss and a greedy sample."""
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        losses = [lm_loss(model, batch["input_ids"]) for batch in eval_set.iter(batch_size=batch_size)]
        ids = torch.tensor([list(prompt.encode("utf-8"))])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
    return torch.stack(losses).mean().item(), bytes(out[0].tolist()).decode("utf-8", errors="replace")


def finish(args: argparse.Namespace, history: History, config: LlamaConfig, eval_set: Dataset, title: str) -> None:
    """Consolidate the newest checkpoint, plot, reload and report."""
    checkpoint = checkpoints_of(args.output_dir)[-1]
    model_dir = accel_xla_fsdp.consolidate(checkpoint / "xla_fsdp_0", args.output_dir / "model",
                                           config=config, overwrite=True, progress=False)
    print(f"consolidated {checkpoint} -> {model_dir}: {', '.join(sorted(p.name for p in model_dir.iterdir()))}")
    plot_losses(history, title, args.output_dir / "loss.png")
    print(f"loss curve: {args.output_dir / 'loss.png'}")
    step, loss = history.evals[-1]
    reloaded, sample = reload_and_check(model_dir, eval_set, args.eval_batch_size, args.prompt, args.sample_tokens)
    print(f"last evaluation (step {step}, XLA FSDP): loss {loss:.6f}  perplexity {math.exp(loss):.4f}")
    print(f"reloaded with from_pretrained (CPU):   loss {reloaded:.6f}  perplexity {math.exp(reloaded):.4f}  "
          f"(difference {abs(reloaded - loss):.1e})")
    print(f"greedy sample: {sample!r}")


# -- main --------------------------------------------------------------------------------------


def prepare_output_dir(accelerator: Accelerator, args: argparse.Namespace) -> None:
    """Refuse to mix runs: an earlier run's checkpoints are resumed (--resume) or removed (--overwrite)."""
    checkpoints = args.output_dir / "checkpoints"
    earlier = checkpoints_of(args.output_dir)
    if args.resume and not earlier:
        raise SystemExit(f"--resume: no checkpoint_<n> under {checkpoints}")
    if earlier and not args.resume:
        if not args.overwrite:
            raise SystemExit(f"{checkpoints} holds an earlier run's checkpoints: pass --resume to continue it, "
                             "or --overwrite to start again")
        accelerator.wait_for_everyone()  # every replica has looked before the main one removes them
        if accelerator.is_main_process:
            shutil.rmtree(checkpoints)
        accelerator.wait_for_everyone()


def train(
    accelerator: Accelerator, args: argparse.Namespace, history: History, model: torch.nn.Module,
    optimizer: Any, scheduler: Any, train_loader: Any, eval_loader: Any,
) -> None:
    """Train from ``history.step`` to ``--steps``: log, evaluate and save as due."""
    main_process = accelerator.is_main_process
    batches = training_batches(accelerator, train_loader, history.step, args.accum)
    bar = tqdm(total=args.steps, initial=history.step, desc="training", unit="step", disable=not main_process)
    window_loss, window_micro, window_start = torch.zeros((), device=accelerator.device), 0, time.perf_counter()
    while history.step < args.steps:
        loss_sum, micro = train_step(accelerator, model, optimizer, scheduler, batches, args.max_grad_norm)
        window_loss, window_micro = window_loss + loss_sum, window_micro + micro
        history.step += 1
        bar.update(1)
        if due(history.step, args.log_every, args.steps):
            loss = (accelerator.reduce(window_loss, "mean") / window_micro).item()  # one sync per log
            speed = window_micro * args.batch_size * args.seq_len / (time.perf_counter() - window_start)
            history.train.append((history.step, loss))
            bar.set_postfix({"loss": f"{loss:.3f}", "tok/s": f"{speed:.0f}"})
            window_loss, window_micro, window_start = torch.zeros((), device=accelerator.device), 0, time.perf_counter()
        paused = time.perf_counter()
        if due(history.step, args.eval_every, args.steps):
            loss = evaluate(accelerator, model, eval_loader)
            history.evals.append((history.step, loss))
            if main_process:
                bar.write(f"step {history.step:4d}  eval loss {loss:.4f}  perplexity {math.exp(loss):7.3f}")
        if due(history.step, args.save_every, args.steps):
            folder = accelerator.save_state()
            if main_process:
                bar.write(f"step {history.step:4d}  saved {folder}")
        window_start += time.perf_counter() - paused  # tokens/s counts training time only
    bar.close()


def main() -> None:
    args = parse_args()
    # No set_seed: on XLA:CPU the replicas are threads sharing one CPU generator, and a replica
    # reseeding it while another builds its model under seeded() changes that model.
    accelerator = Accelerator(
        gradient_accumulation_steps=args.accum,
        project_config=ProjectConfiguration(str(args.output_dir), automatic_checkpoint_naming=True, total_limit=args.keep),
        # Seedable sampler with its own seed: one shuffled order whatever the number of replicas,
        # in a resumed run too; split batches: --batch-size is the global batch and the scheduler
        # steps once per optimizer step.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=0, split_batches=True),
    )
    prepare_output_dir(accelerator, args)
    with accelerator.main_process_first():  # the main process fills the datasets cache
        train_set, eval_set = split_blocks(load_blocks(CORPUS, args.seq_len), args.eval_fraction, args.eval_batch_size)
    config = model_config(args.seq_len)
    with seeded(0):  # replica threads share one random generator: build the same model on each
        model = LlamaForCausalLM(config)
    num_params = sum(p.numel() for p in model.parameters())
    optimizer = optimizer_for(model, args.lr)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True)
    eval_loader = DataLoader(eval_set, batch_size=args.eval_batch_size)
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup, args.steps)
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler)
    history = History()
    accelerator.register_for_checkpointing(history)
    if args.resume:
        accelerator.load_state()  # the newest checkpoint_<n>
    setup = f"{num_params / 1e3:.0f} k parameters, {accelerator.num_processes} replicas"
    accelerator.print(
        f"{setup}, {len(train_set)} train / {len(eval_set)} eval blocks of {args.seq_len} bytes, "
        f"{len(train_loader)} batches of {args.batch_size} per epoch, accumulation {args.accum}"
        + (f"; resumed at step {history.step}" if args.resume else ""))
    train(accelerator, args, history, model, optimizer, scheduler, train_loader, eval_loader)
    if accelerator.is_main_process:
        finish(args, history, config, eval_set, f"tiny Llama ({setup}), XLA FSDP")
        print(f"wall time {time.perf_counter() - STARTED:.1f} s")


if __name__ == "__main__":
    main()
