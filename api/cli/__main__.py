"""`python -m stepline.api.cli`: the `stepline` command (how `mlx.launch` starts each rank)."""

import sys

from stepline.api.cli import main

sys.exit(main())
