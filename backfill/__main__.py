"""`python -m backfill` is the `backfill` command (for environments without the console script)."""

import sys

from backfill.cli import main

sys.exit(main())
