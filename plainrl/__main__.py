"""``python -m plainrl ...`` is the ``plainrl`` command; torchrun launches it this way:
``torchrun --nproc-per-node N -m plainrl train CONFIG.yaml``."""

import sys

from plainrl.cli import main

sys.exit(main())
