"""`python -m hicached` runs the CLI."""

import sys

from .cli import main

sys.exit(main())
