#!/usr/bin/env bash
# The code checks CI runs before the tests (.ci/run): ruff's lint and format over the whole tree,
# mypy over the library (its settings in pyproject.toml). Sets up .venv first, as test.sh does.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/ensure_venv.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
