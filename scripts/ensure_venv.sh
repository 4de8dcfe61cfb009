#!/usr/bin/env bash
# Make sure .venv in this checkout is installed for the current pyproject.toml.
#
# Missing .venv: `python3 -m venv .venv`, then `pip install -e '.[test]'`.
# Present and installed for this pyproject.toml (.venv/.pyproject.sha256 holds its hash): nothing
# to do, no pip call. A changed pyproject.toml installs again into the existing .venv.
# Works from any directory: `bash scripts/ensure_venv.sh`.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
stamp=.venv/.pyproject.sha256

up_to_date() {
    [[ -x .venv/bin/python && -f $stamp && "$(cat "$stamp")" == "$(sha256sum pyproject.toml | cut -d' ' -f1)" ]]
}

up_to_date && exit 0

# One installer at a time (say train.sh and test.sh started together on a fresh clone).
exec 9<pyproject.toml
flock 9
up_to_date && exit 0

if [[ ! -x .venv/bin/python ]]; then
    echo "ensure_venv: creating $root/.venv" >&2
    python3 -m venv .venv
fi
echo "ensure_venv: pip install -e '.[test]' into .venv (first time for this pyproject.toml)" >&2
start=$SECONDS
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
.venv/bin/python -m pip install --disable-pip-version-check -q -e '.[test]'
# Through a new file: a worktree's .venv may hard-link the stamp of the .venv it was cloned from.
echo "$want" > "$stamp.new" && mv "$stamp.new" "$stamp"
echo "ensure_venv: installed in $((SECONDS - start)) s" >&2
