"""``python -m stepgraph.bench_integrations``: the integrations benchmark lives in
:mod:`stepgraph.tools.bench_integrations`."""
import sys

from stepgraph.tools.bench_integrations import main

if __name__ == "__main__":
    sys.exit(main())
