"""``python -m stepgraph.bench``: the one-process benchmark lives in :mod:`stepgraph.tools.bench`."""
import sys

from stepgraph.tools.bench import main

if __name__ == "__main__":
    sys.exit(main())
