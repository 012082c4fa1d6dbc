"""`python -m nanotron.launch`: the Slurm launcher (`nanotron launch`) under the original nanotron's spelling."""

import sys

from nanotron.commands.launch import main

sys.exit(main())
