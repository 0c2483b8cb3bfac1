"""``cudagraph``: placeholder until the CUDA-graph backend lands."""
from . import Backend


def compile_cudagraph(gm, example_inputs, **_):
    raise NotImplementedError("cudagraph backend")


BACKEND = Backend("cudagraph", compile_cudagraph, "one CUDA graph launch per step", ("cuda",))
