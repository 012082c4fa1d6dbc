"""`python -m nanotron COMMAND [args...]`: the `nanotron` console script, for where it is not on PATH (a job)."""

import sys

from nanotron.commands import main

sys.exit(main())
