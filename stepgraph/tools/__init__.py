"""Tools beside the library: benchmarks, the demo and the model zoo the tests and benchmarks train.

Nothing in the library imports from here; ``python -m stepgraph.bench`` and ``python -m stepgraph``
are thin entry points into these modules.
"""
