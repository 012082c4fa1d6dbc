"""`python -m nanotron.plan`."""

import sys

from nanotron.plan.cli import main

sys.exit(main())
