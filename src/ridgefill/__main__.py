"""`python -m ridgefill` runs the command line."""

import sys

from ridgefill.cli import main

sys.exit(main())
