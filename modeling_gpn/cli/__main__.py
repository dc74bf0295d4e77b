"""`python -m modeling_gpn.cli`: the `gpn` console script."""

import sys

from . import main

sys.exit(main())
