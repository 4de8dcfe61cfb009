#!/usr/bin/env bash
# The main job: FSDP training of a tiny Llama on 4 XLA:CPU devices (scripts/train.py).
# Sets up .venv first when it is missing or stale. Arguments go to train.py (--help lists them).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/ensure_venv.sh
exec .venv/bin/python scripts/train.py "$@"
