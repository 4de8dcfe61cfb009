"""Habits of stock fine-tuning scripts, for ``test_launch_habits.py`` (run by ``accelerate launch``).

Written as ``transformers``' ``*_no_trainer.py`` examples are, but for the import: its own
``logging.basicConfig``, ``transformers`` verbosity by process, ``set_seed`` then ``from_config``,
``from_pretrained`` inside ``main()`` (a tied-embedding model), ``prepare``, ``accelerator.print``
and a progress bar. With ``STOCK_SCRIPT_LATE_IMPORT=1`` it imports ``Accelerator`` inside
``main()`` instead of at module level. The main process writes ``--out`` (safetensors: the
models' weights; metadata: what the replicas saw).
"""

from __future__ import annotations

import argparse
import json
import logging
import os

import torch
import transformers
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from safetensors.torch import save_file
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM

LATE_IMPORT = os.environ.get("STOCK_SCRIPT_LATE_IMPORT") == "1"
if not LATE_IMPORT:
    from accel_xla_fsdp import Accelerator

logger = get_logger(__name__)


def accelerator_class() -> type:
    if LATE_IMPORT:
        from accel_xla_fsdp import Accelerator as imported_in_main

        return imported_in_main
    return Accelerator


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pretrained", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    accelerator = accelerator_class()()
    logging.basicConfig(format="%(levelname)s - %(name)s - %(message)s", level=logging.INFO)
    logger.info(f"script log line: {accelerator.num_processes} processes", main_process_only=True)
    if accelerator.is_local_main_process:
        transformers.utils.logging.set_verbosity_info()
    else:
        transformers.utils.logging.set_verbosity_error()
    accelerator.wait_for_everyone()  # every replica has set its verbosity

    set_seed(42)
    config = AutoConfig.from_pretrained(args.pretrained)
    from_config = AutoModelForCausalLM.from_config(config)
    pretrained = AutoModelForCausalLM.from_pretrained(args.pretrained)  # logs at INFO on the main process
    optimizer = torch.optim.AdamW(pretrained.parameters(), lr=1e-3)
    pretrained, optimizer = accelerator.prepare(pretrained, optimizer)
    accelerator.print("accelerator.print reached the output")
    for _ in tqdm(range(3), desc="progress bar", disable=not accelerator.is_local_main_process):
        pass

    state = accelerator.get_state_dict(pretrained)
    seeded = {k: v.clone() for k, v in from_config.state_dict().items()}  # clones: tied ones share storage
    everyone = accelerator.gather(torch.stack([v.float().sum() for v in seeded.values()]).to(accelerator.device))
    if accelerator.is_main_process:
        tensors = {f"pretrained/{k}": v.clone() for k, v in state.items()}
        tensors.update({f"from_config/{k}": v for k, v in seeded.items()})
        meta = {"from_config sums by replica": everyone.reshape(accelerator.num_processes, -1).tolist()}
        save_file(tensors, args.out, metadata={"record": json.dumps(meta)})
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
