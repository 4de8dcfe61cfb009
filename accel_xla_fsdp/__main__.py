"""``python -m accel_xla_fsdp ...``: the ``accel-xla-fsdp`` command."""

import sys

from .cli import main

sys.exit(main())
