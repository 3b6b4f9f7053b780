"""``python -m nsa.train [--preset tiny] [--resume] [key=value ...]``: same as ``nsa train``."""

import sys

from nsa.cli import main

main(["train", *sys.argv[1:]])
