"""`python -m nanotron.tokenize ...`: see `nanotron.tokenize.cli`."""

import sys

from nanotron.tokenize.cli import main

sys.exit(main())
