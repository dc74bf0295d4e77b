"""`python -m gpn_cli`: the `gpn` console script."""

import sys

from . import main

sys.exit(main())
