"""``python -m placement``: the placement planner's command line."""

import sys

from placement.cli import main

sys.exit(main(prog="python -m placement"))
