"""`python -m modeling_gpn.train` and `accelerate launch -m modeling_gpn.train`: the training program."""

import sys

from . import main

sys.exit(main())
