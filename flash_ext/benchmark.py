"""`python -m flash_ext.benchmark`: the command line of the benchmark package flash_ext/bench/.

See benchmarks/README.md for the options and outputs.
"""
import sys

from flash_ext.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
