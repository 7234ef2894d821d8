"""`python -m dflash_export`: see dflash_export.cli."""

import sys

from dflash_export.cli import main

sys.exit(main())
