"""`python -m cluster.bench_serving ...`: the same as `pdcluster bench serving ...`."""

import sys

from cluster.bench_serving.cli import main

sys.exit(main())
