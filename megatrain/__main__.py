"""`python -m megatrain ...` is the `megatrain` command (for torchrun and environments without the entry point)."""

import sys

from .cli import main

sys.exit(main())
