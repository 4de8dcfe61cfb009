"""The main job: fine-tune a pretrained tiny Llama with XLA FSDP behind Hugging Face Accelerate.

    accelerate launch --config_file plugins/xla_fsdp_cpu.yaml scripts/finetune.py --pretrain   # stage 1, once
    accelerate launch --config_file plugins/xla_fsdp_cpu.yaml scripts/finetune.py [--lora] [options]
    bash scripts/finetune.sh [options]    # both: stage 1 if runs/finetune/pretrained/ holds no model yet

A stock Accelerate script on 4 XLA:CPU devices: its XLA lines are the ``Accelerator`` import and, for
LoRA, the ``seeded`` block that draws the adapters' initial values the same on every run.

Stage 1 (``--pretrain``) makes the pretrained checkpoint that no installed package ships: a
``LlamaForCausalLM`` (4 layers, hidden size 64, vocabulary 256: one UTF-8 byte is one token) from
``set_seed`` and ``from_config``, trained on scripts/data/corpus.txt (short English prose) and saved
with ``save_pretrained`` into ``--pretrained``.

Stage 2 (the default) fine-tunes it on scripts/data/logbook.txt (a lighthouse keeper's log):
``AutoModelForCausalLM.from_pretrained(--pretrained)`` (with ``fsdp_cpu_ram_efficient_loading`` each
replica reads only its shards from the files in ``prepare()``), then every weight (the default,
``--full``) or, with ``--lora``, LoRA adapters on every linear layer (PEFT's ``get_peft_model``, the
pretrained weights frozen). On this 181 k-parameter model full fine-tuning learns the log's form;
LoRA (33 k parameters) shows the PEFT path: its adapter saved, reloaded and merged.

- data: the text through ``datasets``, packed into blocks of ``--seq-len`` bytes and split into
  train and eval blocks; the global batch is split between the replicas;
- AdamW, cosine schedule with warmup, gradient accumulation, gradient clipping;
- a progress bar (main process) with the training loss and tokens/s every ``--log-every`` steps;
- evaluation (loss, perplexity) before training, every ``--eval-every`` steps and at the end;
- stage 2: sharded ``save_state`` checkpoints every ``--save-every`` steps and at the end, the
  newest ``--keep`` kept; after a stop, the same command with ``--resume`` continues from the newest;
- at the end the model is saved as transformers' examples save it, on every replica:
  ``unwrap_model(model).save_pretrained(dir, is_main_process=..., save_function=accelerator.save)``
  (stage 2: ``<output-dir>/model``, the LoRA adapter or the whole model). Then, on the main process:
  the loss curve (``<output-dir>/loss.png``), and that folder loaded back on the CPU with plain
  ``from_pretrained`` (with LoRA: the pretrained model, ``PeftModel.from_pretrained``, and
  ``merge_and_unload()`` saved into ``<output-dir>/merged``): its evaluation against the last one in
  training, and greedy samples of the pretrained and the fine-tuned model.
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
from typing import Any, Callable, Dict, Iterator, List, Tuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local: never ask the hub
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import datasets
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed
from datasets import Dataset, load_dataset
from peft import LoraConfig, PeftModel, get_peft_model
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

# The model class AutoModelForCausalLM picks is imported here, before the replica threads start:
# transformers' lazy imports are not thread-safe.
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,  # noqa: F401
    get_cosine_schedule_with_warmup,
)

from accel_xla_fsdp import Accelerator, seeded

DATA = Path(__file__).parent / "data"
PRETRAIN_TEXT, FINETUNE_TEXT = DATA / "corpus.txt", DATA / "logbook.txt"
VOCAB = 256  # byte-level: token = UTF-8 byte
LORA_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
LEARNING_RATES = {"pretrain": 3e-3, "full": 5e-3, "lora": 2e-2}
REPORT_WIDTH = 52  # label column of the final report
STAGE_NAMES = {"pretrain": "pretraining from scratch", "full": "full fine-tuning", "lora": "LoRA fine-tuning"}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    stage = p.add_mutually_exclusive_group()
    stage.add_argument(
        "--pretrain",
        dest="stage",
        action="store_const",
        const="pretrain",
        help="stage 1: train a model from scratch on corpus.txt and save it into --pretrained",
    )
    stage.add_argument(
        "--full",
        dest="stage",
        action="store_const",
        const="full",
        help="stage 2, fine-tuning every weight (the default)",
    )
    stage.add_argument(
        "--lora",
        dest="stage",
        action="store_const",
        const="lora",
        help="stage 2, training LoRA adapters only (--lora-r, --lora-targets), the pretrained weights frozen",
    )
    p.set_defaults(stage="full")
    p.add_argument(
        "--pretrained",
        type=Path,
        default=Path("runs/finetune/pretrained"),
        help="the pretrained model: written by --pretrain, fine-tuned otherwise",
    )
    p.add_argument(
        "--output-dir",
        type=Path,
        default=Path("runs/finetune"),
        help="stage 2: checkpoints/, model/ (saved), merged/ (LoRA merged) and loss.png go here",
    )
    p.add_argument("--steps", type=int, default=150, help="optimizer steps (keep it when resuming)")
    p.add_argument("--lr", type=float, help="peak learning rate; default: 3e-3 pretraining, 5e-3 full, 2e-2 LoRA")
    p.add_argument("--lora-r", type=int, default=8, help="LoRA rank")
    p.add_argument("--lora-alpha", type=float, default=16, help="LoRA scaling numerator (scale alpha / r)")
    p.add_argument("--lora-dropout", type=float, default=0.0, help="dropout on the LoRA inputs")
    p.add_argument("--lora-targets", default=LORA_TARGETS, help="comma-separated module names given adapters")
    p.add_argument("--batch-size", type=int, default=8, help="global batch in blocks, split between the replicas")
    p.add_argument("--accum", type=int, default=2, help="gradient accumulation: micro-batches per optimizer step")
    p.add_argument("--seq-len", type=int, default=64, help="tokens (bytes) per block")
    p.add_argument("--warmup", type=int, default=10, help="warmup steps of the cosine schedule")
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--eval-fraction", type=float, default=0.15, help="share of the blocks held out for evaluation")
    p.add_argument("--eval-batch-size", type=int, default=8, help="global evaluation batch, in blocks")
    p.add_argument("--log-every", type=int, default=5, help="steps between progress-bar updates of loss and tokens/s")
    p.add_argument("--eval-every", type=int, default=25, help="steps between evaluations")
    p.add_argument("--save-every", type=int, default=50, help="stage 2: steps between sharded checkpoints")
    p.add_argument("--keep", type=int, default=2, help="stage 2: checkpoints kept (total_limit)")
    p.add_argument(
        "--resume", action="store_true", help="stage 2: continue from the newest checkpoint in --output-dir"
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start again, removing an earlier run's pretrained model (stage 1) or its "
        "checkpoints/, model/ and merged/ (stage 2)",
    )
    p.add_argument("--prompt", default="31 December.", help="start of the greedy samples")
    p.add_argument(
        "--sample-tokens",
        type=int,
        default=52,
        help="bytes generated after the prompt (prompt and sample within --seq-len: the length trained on)",
    )
    args = p.parse_args()
    args.lr = args.lr or LEARNING_RATES[args.stage]
    for name in (
        "steps",
        "batch_size",
        "accum",
        "seq_len",
        "eval_batch_size",
        "log_every",
        "eval_every",
        "save_every",
        "keep",
        "lora_r",
    ):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.resume and (args.overwrite or args.stage == "pretrain"):
        p.error("--resume continues a fine-tuning run: not with --overwrite or --pretrain")
    return args


# -- data and model ----------------------------------------------------------------------------


def load_blocks(path: Path, seq_len: int) -> Dataset:
    """The text as byte tokens packed into rows of ``seq_len`` (``input_ids``), via ``datasets``."""
    datasets.disable_progress_bars()
    lines = load_dataset("text", data_files=str(path), split="train", keep_in_memory=True)
    tokens = lines.map(
        lambda row: {"input_ids": list((row["text"] + "\n").encode("utf-8"))},
        remove_columns=["text"],
        keep_in_memory=True,
    )

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
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=seq_len,
        attn_implementation="eager",
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,  # byte 0 never occurs in the texts
    )


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """Stage 1: a new model; stage 2: the pretrained one, with LoRA adapters unless ``--full``."""
    if args.stage == "pretrain":
        set_seed(0)  # every replica, on every run, builds the same model
        return AutoModelForCausalLM.from_config(model_config(args.seq_len))
    model = AutoModelForCausalLM.from_pretrained(args.pretrained)
    if args.stage == "full":
        return model
    lora = LoraConfig(
        task_type="CAUSAL_LM",
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=args.lora_targets.split(","),
    )
    # Replica threads share one random generator: the adapters' initial values are drawn under seeded().
    with seeded(0):
        return get_peft_model(model, lora)


def lm_loss(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss of the rows. The attention mask spares transformers a read-back of
    the position ids mid-forward (each replica thread would compile it at once)."""
    return model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), labels=input_ids).loss


def optimizer_for(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters, without weight decay on norms (1-d parameters)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in trainable if p.dim() > 1], "weight_decay": 0.1},
        {"params": [p for p in trainable if p.dim() <= 1], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=(0.9, 0.95))


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


def training_batches(
    accelerator: Accelerator, loader: Any, step: int, accum: int
) -> Iterator[Dict[str, torch.Tensor]]:
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
    accelerator: Accelerator,
    model: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    batches: Iterator[Dict[str, torch.Tensor]],
    max_grad_norm: float,
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


# -- after training (main process, on the CPU) -------------------------------------------------


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


def cpu_eval_loss(model: torch.nn.Module, eval_set: Dataset, batch_size: int) -> float:
    """The eval loss of a model on the CPU, batch by batch as in training."""
    model.eval()
    with torch.no_grad():
        losses = [lm_loss(model, batch["input_ids"]) for batch in eval_set.iter(batch_size=batch_size)]
    return torch.stack(losses).mean().item()


def greedy_sample(model: torch.nn.Module, prompt: str, new_tokens: int) -> str:
    ids = torch.tensor([list(prompt.encode("utf-8"))])
    with torch.no_grad():
        out = model.eval().generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False
        )
    return bytes(out[0].tolist()).decode("utf-8", errors="replace")


def report_reload(args: argparse.Namespace, history: History, eval_set: Dataset) -> None:
    """Load the saved model back with plain transformers (and peft) on the CPU and compare its
    evaluation with the last one in training; greedy samples before and after fine-tuning."""
    step, trained = history.evals[-1]
    print(
        f"{f'last evaluation (step {step}, XLA FSDP):':<{REPORT_WIDTH}}loss {trained:.6f}  "
        f"perplexity {math.exp(trained):.4f}"
    )

    def compare(how: str, model: torch.nn.Module) -> None:
        loss = cpu_eval_loss(model, eval_set, args.eval_batch_size)
        print(
            f"{how + ' (CPU):':<{REPORT_WIDTH}}loss {loss:.6f}  perplexity {math.exp(loss):.4f}  "
            f"(difference {abs(loss - trained):.1e})"
        )

    model_dir = args.output_dir / "model"
    if args.stage == "pretrain":
        compare("reloaded with from_pretrained", AutoModelForCausalLM.from_pretrained(args.pretrained))
        return
    base = AutoModelForCausalLM.from_pretrained(args.pretrained)
    print(f"pretrained model's sample: {greedy_sample(base, args.prompt, args.sample_tokens)!r}")
    if args.stage == "full":
        tuned = AutoModelForCausalLM.from_pretrained(model_dir)
        compare("reloaded with from_pretrained", tuned)
    else:
        adapted = PeftModel.from_pretrained(base, model_dir)
        compare("reloaded: base + PeftModel.from_pretrained", adapted)
        tuned = adapted.merge_and_unload()
        tuned.save_pretrained(args.output_dir / "merged")
        compare(f"merge_and_unload() -> {args.output_dir / 'merged'}", tuned)
    print(f"fine-tuned model's sample: {greedy_sample(tuned, args.prompt, args.sample_tokens)!r}")


# -- main --------------------------------------------------------------------------------------


def earlier_output(args: argparse.Namespace) -> List[Path]:
    """What an earlier run of this stage left, which ``--overwrite`` removes."""
    if args.stage == "pretrain":
        return [args.pretrained] if (args.pretrained / "config.json").exists() else []
    return [args.output_dir / name for name in ("checkpoints", "model", "merged") if (args.output_dir / name).exists()]


def prepare_output_dir(accelerator: Accelerator, args: argparse.Namespace) -> None:
    """Refuse to mix runs: an earlier run's output is resumed (--resume) or removed (--overwrite)."""
    if args.stage != "pretrain" and not (args.pretrained / "config.json").exists():
        raise SystemExit(
            f"no pretrained model in {args.pretrained}: make one first with the same command and "
            "--pretrain (bash scripts/finetune.sh does)"
        )
    if args.resume:
        if not any((args.output_dir / "checkpoints").glob("checkpoint_*")):
            raise SystemExit(f"--resume: no checkpoint_<n> under {args.output_dir / 'checkpoints'}")
        return
    earlier = earlier_output(args)
    if not earlier:
        return
    if not args.overwrite:
        raise SystemExit(
            f"{', '.join(map(str, earlier))}: an earlier run's output; pass --overwrite to replace it"
            + ("" if args.stage == "pretrain" else ", or --resume to continue that run")
        )
    accelerator.wait_for_everyone()  # every replica has looked before the main one removes them
    if accelerator.is_main_process:
        for folder in earlier:
            shutil.rmtree(folder)
    accelerator.wait_for_everyone()


def train(
    accelerator: Accelerator,
    args: argparse.Namespace,
    history: History,
    model: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    train_loader: Any,
    eval_loader: Any,
) -> None:
    """Train from ``history.step`` to ``--steps``: log, evaluate and (stage 2) save checkpoints as due."""
    main_process = accelerator.is_main_process
    checkpoints = args.stage != "pretrain"
    batches = training_batches(accelerator, train_loader, history.step, args.accum)
    bar = tqdm(total=args.steps, initial=history.step, desc="training", unit="step", disable=not main_process)

    def new_window() -> Tuple[torch.Tensor, int, float]:  # loss sum, micro-batches, start time
        return torch.zeros((), device=accelerator.device), 0, time.perf_counter()

    window_loss, window_micro, window_start = new_window()
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
            window_loss, window_micro, window_start = new_window()
        paused = time.perf_counter()
        if due(history.step, args.eval_every, args.steps):
            record_evaluation(accelerator, model, eval_loader, history, bar.write)
        if checkpoints and due(history.step, args.save_every, args.steps):
            folder = accelerator.save_state()
            if main_process:
                bar.write(f"step {history.step:4d}  saved {folder}")
        window_start += time.perf_counter() - paused  # tokens/s counts training time only
    bar.close()


def record_evaluation(
    accelerator: Accelerator,
    model: torch.nn.Module,
    eval_loader: Any,
    history: History,
    write: Callable[[str], None] = print,
) -> None:
    """Evaluate, remember the loss in ``history`` and write it (main process)."""
    loss = evaluate(accelerator, model, eval_loader)
    history.evals.append((history.step, loss))
    if accelerator.is_main_process:
        write(f"step {history.step:4d}  eval loss {loss:.4f}  perplexity {math.exp(loss):7.3f}")


def main() -> None:
    args = parse_args()
    accelerator = Accelerator(
        gradient_accumulation_steps=args.accum,
        project_config=ProjectConfiguration(
            str(args.output_dir), automatic_checkpoint_naming=True, total_limit=args.keep
        ),
        # Seedable sampler with its own seed: one shuffled order whatever the number of replicas,
        # in a resumed run too; split batches: --batch-size is the global batch and the scheduler
        # steps once per optimizer step.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=0, split_batches=True),
    )
    prepare_output_dir(accelerator, args)
    text = PRETRAIN_TEXT if args.stage == "pretrain" else FINETUNE_TEXT
    with accelerator.main_process_first():  # the main process fills the datasets cache
        train_set, eval_set = split_blocks(load_blocks(text, args.seq_len), args.eval_fraction, args.eval_batch_size)
    model = build_model(args)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    num_params = sum(p.numel() for p in model.parameters())
    optimizer = optimizer_for(model, args.lr)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True)
    eval_loader = DataLoader(eval_set, batch_size=args.eval_batch_size)
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup, args.steps)
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler
    )
    history = History()
    accelerator.register_for_checkpointing(history)
    if args.resume:
        accelerator.load_state()  # the newest checkpoint_<n>
    setup = (
        f"{STAGE_NAMES[args.stage]}, {trainable / 1e3:.1f} k of {num_params / 1e3:.1f} k parameters trained, "
        f"{accelerator.num_processes} replicas"
    )
    accelerator.print(
        f"{setup}; {text.name}: {len(train_set)} train / {len(eval_set)} eval blocks of {args.seq_len} bytes, "
        f"{len(train_loader)} batches of {args.batch_size} per epoch, accumulation {args.accum}, lr {args.lr:g}"
        + (f"; resumed at step {history.step}" if args.resume else "")
    )
    if not args.resume:
        record_evaluation(accelerator, model, eval_loader, history)
    train(accelerator, args, history, model, optimizer, scheduler, train_loader, eval_loader)
    saved = args.pretrained if args.stage == "pretrain" else args.output_dir / "model"
    accelerator.wait_for_everyone()
    accelerator.unwrap_model(model).save_pretrained(
        saved, is_main_process=accelerator.is_main_process, save_function=accelerator.save
    )
    if accelerator.is_main_process:
        print(f"saved {saved}: {', '.join(sorted(p.name for p in saved.iterdir()))}")
        if args.stage != "pretrain":
            title = f"tiny Llama, {STAGE_NAMES[args.stage]}, {accelerator.num_processes} replicas"
            plot_losses(history, title, args.output_dir / "loss.png")
            print(f"loss curve: {args.output_dir / 'loss.png'}")
        report_reload(args, history, eval_set)
        print(f"wall time {time.perf_counter() - STARTED:.1f} s")


if __name__ == "__main__":
    main()
