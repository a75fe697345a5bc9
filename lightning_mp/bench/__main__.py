"""``python -m lightning_mp.bench``: run the benchmark the command line asks for (see :mod:`lightning_mp.bench.cli`)."""

import sys

from lightning_mp.bench.cli import main

sys.exit(main())
