import sys

from nanotron.coord_check.cli import main

sys.exit(main())
