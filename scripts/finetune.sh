#!/usr/bin/env bash
# The main job: fine-tune a pretrained tiny Llama with XLA FSDP behind Accelerate (scripts/finetune.py),
# run by `accelerate launch` on 4 XLA:CPU devices (plugins/xla_fsdp_cpu.yaml; ACCELERATE_CONFIG=<file>
# picks another, such as plugins/xla_fsdp_tpu.yaml). Sets up .venv first when it is missing or stale.
# Stage 1, once: no installed package ships a small pretrained model, so while
# runs/finetune/pretrained/ holds none, `finetune.py --pretrain` makes it (a launch of its own, so that
# stage 2 loads it as any pretrained model: in a new process). Stage 2 fine-tunes it; the arguments
# go to that stage (--help lists them).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/ensure_venv.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
config="${ACCELERATE_CONFIG:-plugins/xla_fsdp_cpu.yaml}"
launch() { .venv/bin/accelerate launch --config_file "$config" scripts/finetune.py "$@"; }
if [[ ! -f runs/finetune/pretrained/config.json ]]; then
    launch --pretrain
fi
launch "$@"
