"""`python -m llmlower.cli`: the `llmlower` command."""

import sys

from . import main

sys.exit(main())
