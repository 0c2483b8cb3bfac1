"""``torchrun ... -m stepgraph.bench_ddp``: the DDP benchmark lives in :mod:`stepgraph.tools.bench_ddp`."""
from stepgraph.tools.bench_ddp import main

if __name__ == "__main__":
    raise SystemExit(main())
