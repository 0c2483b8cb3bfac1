import os
import sys

# Tests import the checkout's stepgraph (installed or not) and the shared harness beside them.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _deterministic_cudnn():
    # cuDNN's conv weight-gradient kernels may use atomics: eager vs eager would differ run to
    # run, so GPU parity tests pin deterministic algorithms (a no-op on the CPU).
    prev = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    yield
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = prev
