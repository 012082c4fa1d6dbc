import sys

from nanotron.launch.cluster import main

sys.exit(main())
