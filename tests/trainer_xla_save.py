"""The Trainer's own XLA FSDP checkpoint, written by transformers' own code, for the conversion test.

transformers 5.24's Trainer cannot train with ``fsdp_config={"xla": True}`` (with the optimizer's
creation delayed for FSDP, ``_prepare_for_training`` prepares ``None`` and ``create_scheduler``
fails before the first step), so this script calls the two functions that path is made of,
``wrap_model_xla_fsdp`` (torch_xla's ``XlaFullyShardedDataParallel``) and ``save_tpu_checkpoint``
(the pickled ``rank<r>-of-<N>-pytorch_model.bin`` files), on each XLA:CPU replica. Importing
accel_xla_fsdp makes the ``xm.rendezvous`` of that save work between replica threads.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=2 python trainer_xla_save.py MODEL_DIR OUT_DIR
"""

from __future__ import annotations

import sys

import accelerate
import torch_xla.core.xla_model as xm
import torch_xla.distributed.xla_multiprocessing as xmp
from transformers import AutoModelForCausalLM, TrainingArguments
from transformers.integrations.tpu import save_tpu_checkpoint, wrap_model_xla_fsdp

import accel_xla_fsdp  # noqa: F401  (xm.rendezvous between replica threads)


def main(index: int, model_dir: str, out: str) -> None:
    args = TrainingArguments(
        output_dir=out,
        report_to="none",
        fsdp=True,
        fsdp_config={"xla": True, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir).to(xm.xla_device())
    save_tpu_checkpoint(wrap_model_xla_fsdp(model, args, False), args, accelerate.Accelerator(), None, True, out)


if __name__ == "__main__":
    xmp.spawn(main, args=(sys.argv[1], sys.argv[2]))
