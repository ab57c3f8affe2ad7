"""`python -m backfill.cli` is the `backfill` command."""

import sys

from backfill.cli import main

sys.exit(main())
