#!/usr/bin/env bash
# The main job: fine-tune a tiny Llama with XLA FSDP behind Accelerate (scripts/finetune.py), run by
# `accelerate launch` on 4 XLA:CPU devices (plugins/xla_fsdp_cpu.yaml; ACCELERATE_CONFIG=<file>
# picks another, such as plugins/xla_fsdp_tpu.yaml). Sets up .venv first when it is missing or
# stale. Arguments go to finetune.py (--help lists them).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/ensure_venv.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
exec .venv/bin/accelerate launch --config_file "${ACCELERATE_CONFIG:-plugins/xla_fsdp_cpu.yaml}" scripts/finetune.py "$@"
