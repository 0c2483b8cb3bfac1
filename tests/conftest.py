import os
import sys

import pytest
import torch

# Tests import the checkout's stepgraph (installed or not) and the shared harness beside them.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
# Each test compiles afresh: stepgraph's artifact cache would let a test load what an earlier
# test compiled (tests/test_inductor.py turns it on where it tests it).
os.environ.setdefault("STEPGRAPH_ARTIFACT_CACHE", "0")



@pytest.fixture
def one_thread():
    """Tiny ops: one intra-op thread (2 OpenMP threads on a loaded 2-core box are ~5x slower).
    Modules use it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def world_of_one(tmp_path):
    """A one-process gloo group for the tests of DDP and FSDP2 steps that need no second rank."""
    import torch.distributed as dist
    if not dist.is_available():
        pytest.skip("torch.distributed unavailable")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def nccl_world_of_one(tmp_path):
    """A one-process NCCL group on GPU 0 (the CUDA tests of FSDP2 and of the step's own collectives)."""
    import torch.distributed as dist
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(autouse=True)
def tensor_class_untouched():
    """No test leaves an attribute on torch.Tensor that was not there: a Python ``__getitem__``
    left on the class once made every tensor a sequence, and a corpus client 20 minutes later
    failed in its eager run ("len() of a 0-d tensor", the CI failure of stop 31)."""
    before = {c: set(vars(c)) for c in (torch.Tensor, torch._C.TensorBase)}
    yield
    for c, names in before.items():
        added = set(vars(c)) - names - {"__slotnames__"}   # (copyreg's cache, made by pickling)
        assert not added, f"{c.__name__} gained {sorted(added)}"


@pytest.fixture
def as_library(tmp_path, monkeypatch):
    """``as_library(name, source)``: the module imported from a folder stepgraph takes for an
    installed package's (site-packages), for code the user does not own."""
    import importlib.util
    import os
    from stepgraph import errors
    for attr in ("_SKIP_PREFIXES", "_LIB_DIRS"):
        monkeypatch.setattr(errors, attr, getattr(errors, attr) + (str(tmp_path) + os.sep,))

    def load(name, source):
        (tmp_path / f"{name}.py").write_text(source)
        spec = importlib.util.spec_from_file_location(name, tmp_path / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return load
