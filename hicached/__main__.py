"""`python -m hicached` runs the CLI."""

import sys

from hicached.cli import main

sys.exit(main())
