#!/usr/bin/env bash
# The test suite. Sets up .venv first when it is missing or stale. Arguments go to pytest.
# --quick: only the quick tier (tests/quick_tier.py), for while code changes; CI runs it all.
# Two pytest workers (pytest-xdist) by default: most of the suite waits on one thread (imports,
# single-threaded XLA compiles, launched runs), so one worker keeps a 2-core machine about 1.2 cores
# busy. `--dist loadfile` runs each file in one worker, so a module fixture's launched run is made
# once. TEST_WORKERS=0 runs everything in this process (for pdb or -s); TEST_WORKERS=N, N workers.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/ensure_venv.sh
status=0
# No path of ours here: pytest takes testpaths (tests/) when given none, and only the files given otherwise.
workers="${TEST_WORKERS:-2}"
parallel=()
if [[ $workers != 0 ]]; then
    parallel=(-n "$workers" --dist loadfile)
fi
.venv/bin/python -m pytest -q -rA "${parallel[@]}" "$@" || status=$?
if [[ $status -eq 5 ]]; then
    echo "test.sh: pytest collected no tests: failing" >&2
fi
exit "$status"
