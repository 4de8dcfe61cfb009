"""``python -m accel_xla_fsdp.xla_cpu --patches``: print the patch table (patches.py)."""

import argparse
import sys

from .patches import PATCHES, table

parser = argparse.ArgumentParser(prog="python -m accel_xla_fsdp.xla_cpu", description=__doc__)
parser.add_argument("--patches", action="store_true", help="print every name of another library replaced at run time")
args = parser.parse_args()
if not args.patches:
    parser.print_help()
    sys.exit(2)
print(table())
print(f"{len(PATCHES)} patched names")
