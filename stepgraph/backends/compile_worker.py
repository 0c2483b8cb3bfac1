"""The subprocess side of ``backend="inductor"``'s background compile.

    python -m stepgraph.backends.compile_worker JOB_DIR [--spare]

Reads ``JOB_DIR/job.pkl`` (a :class:`Job`: the lifted whole-step graph, its input metadata and
Inductor patches), compiles it with ``torch._inductor.standalone_compile`` on fake inputs of
the same metadata, and saves the artifact to ``JOB_DIR/artifact.bin`` for the training process
to load (``CompiledArtifact.load``). Exit status 0 means the artifact is complete. With
``--spare`` it imports and warms Inductor first, then waits for "go" on stdin.
"""
from __future__ import annotations

import inspect
import json
import os
import pickle
import sys
import time
from dataclasses import dataclass

ARTIFACT = "artifact.bin"
START = time.perf_counter()


@dataclass(frozen=True)
class InputSpec:
    """What the compiler needs to know of one graph input (no data: the inputs are fake)."""

    shape: tuple
    stride: tuple
    dtype: str      # torch dtype name, e.g. "float32"
    device: str     # e.g. "cuda:0"

    @classmethod
    def of(cls, t) -> "InputSpec":
        return cls(tuple(t.shape), tuple(t.stride()), str(t.dtype).removeprefix("torch."), str(t.device))


@dataclass
class Job:
    graph_module: bytes       # torch.fx.GraphModule (GraphPickler), state lifted to placeholders
    inputs: list              # [InputSpec]
    patches: dict             # torch._inductor.config patches


def compile_job(job_dir: str) -> dict:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with open(os.path.join(job_dir, "job.pkl"), "rb") as f:
        job: Job = pickle.load(f)
    # The artifact is a bundle of Inductor's cache entries, so the caches must be on here
    # (a user's TORCHINDUCTOR_FORCE_DISABLE_CACHES would otherwise leave it empty).
    torch._inductor.config.force_disable_caches = False
    torch.compiler.config.force_disable_caches = False
    from torch.fx._graph_pickler import GraphPickler
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    gm = GraphPickler.loads(job.graph_module, fake_mode)
    with fake_mode:
        inputs = [torch.empty_strided(s.shape, s.stride, dtype=getattr(torch, s.dtype), device=s.device)
                  for s in job.inputs]
    kwargs = dict(dynamic_shapes="from_example_inputs", options={"config_patches": job.patches})
    params = inspect.signature(torch._inductor.standalone_compile).parameters
    if "fake_mode" in params:
        kwargs["fake_mode"] = fake_mode
    if "aot" in params:
        # The bundled form: the cache-entry form (aot=False) loaded a runtime wrapper whose
        # input indices were off by one for a GPT step on torch 2.13 (IndexError at the call).
        kwargs["aot"] = True
    t0 = time.perf_counter()
    with torch.no_grad():
        art = torch._inductor.standalone_compile(gm, inputs, **kwargs)
    t1 = time.perf_counter()
    art.save(path=os.path.join(job_dir, ARTIFACT), format="binary")
    return {"compile_s": t1 - t0, "save_s": time.perf_counter() - t1}


def prewarm() -> None:
    """What every compile needs before it has a job: torch, Inductor, its compile workers."""
    import torch  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401
    from torch._inductor.async_compile import AsyncCompile
    AsyncCompile.warm_pool()


def main(argv: list[str]) -> int:
    job_dir = argv[0]
    if len(argv) > 1 and argv[1] == "--spare":
        # Started ahead of the capture (at the warm-up call): get ready, then wait for the job.
        prewarm()
        if sys.stdin.readline().strip() != "go":
            return 0
    times = {"waited_for_job_s": time.perf_counter() - START}
    times.update(compile_job(job_dir))
    with open(os.path.join(job_dir, "done.json"), "w") as f:
        json.dump(times, f)
    return 0


if __name__ == "__main__":
    rc = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown (joining Inductor's compile workers took ~3 s): the parent
    # switches when this process has exited.
    os._exit(rc)
