import sys

from backfill.server.serve import main

sys.exit(main())
