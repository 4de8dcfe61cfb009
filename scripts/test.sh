#!/usr/bin/env bash
# The test suite. Sets up .venv first when it is missing or stale. Arguments go to pytest.
# --quick: only the quick tier (tests/quick_tier.py), for while code changes; CI runs it all.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/ensure_venv.sh
status=0
# No path of ours here: pytest takes testpaths (tests/) when given none, and only the files given otherwise.
.venv/bin/python -m pytest -q -rA "$@" || status=$?
if [[ $status -eq 5 ]]; then
    echo "test.sh: pytest collected no tests: failing" >&2
fi
exit "$status"
