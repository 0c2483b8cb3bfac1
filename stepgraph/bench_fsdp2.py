"""``torchrun ... -m stepgraph.bench_fsdp2``: the FSDP2 benchmark lives in :mod:`stepgraph.tools.bench_fsdp2`."""
from stepgraph.tools.bench_fsdp2 import main

if __name__ == "__main__":
    raise SystemExit(main())
