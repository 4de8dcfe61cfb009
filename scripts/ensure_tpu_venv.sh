#!/usr/bin/env bash
# Make sure .tpu-venv in this checkout holds the TPU compiler (libtpu, driven by JAX) at the pinned
# version: `python3 -m venv .tpu-venv`, then `pip install 'jax[tpu]==0.10.2'` (1.3 GB, libtpu
# 0.0.42.*). Present and installed for this pin: nothing to do.
#
# Why a second venv: torch_xla and jaxlib each carry their own XLA; loaded into one process they
# clash. accel_xla_fsdp/tpu_compile.py (imports no torch) runs in this venv as a process of its own,
# and programs pass between the two as HLO files (docs/tpu.md). Works from any directory.
set -euo pipefail

PIN="jax[tpu]==0.10.2"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv=.tpu-venv
stamp=$venv/.pin

up_to_date() {
    [[ -x $venv/bin/python && -f $stamp && "$(cat "$stamp")" == "$PIN" ]]
}

up_to_date && exit 0

exec 9<"${BASH_SOURCE[0]}"
flock 9  # one installer at a time
up_to_date && exit 0

if [[ ! -x $venv/bin/python ]]; then
    echo "ensure_tpu_venv: creating $root/$venv" >&2
    python3 -m venv "$venv"
fi
echo "ensure_tpu_venv: pip install '$PIN' into $venv (about 1.3 GB)" >&2
start=$SECONDS
$venv/bin/python -m pip install --disable-pip-version-check -q "$PIN"
echo "$PIN" > "$stamp"
echo "ensure_tpu_venv: installed in $((SECONDS - start)) s" >&2
