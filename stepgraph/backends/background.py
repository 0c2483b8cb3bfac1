"""Background compile for ``backend="inductor"``: train on the unfused graph while Inductor works.

Inductor needs seconds to minutes for a whole step (GPT-6L on an H200: ~22 s, against ~9 s
for ``torch.compile`` of the model alone, which leaves the optimizer eager). Blocking the
first step on that is what users of compilers complain about most. Instead, the capturing
call hands the lifted graph to a child process (``compile_worker``: Inductor's
``standalone_compile`` on fake inputs, saved as a ``CompiledArtifact``) and returns at once;
until the artifact is ready, calls run the *same* graph unfused (one CUDA graph on the GPU,
the replay backend on the CPU), so steps start within a second. The first call that finds
the child done loads the artifact, records it and switches; both graphs update the same
parameter and optimizer tensors, so the switch is seamless.

A separate process, not a thread: Inductor's compile is Python holding the GIL, and a
thread would stall the training loop's every call by up to the interpreter's switch interval.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import weakref

import torch

from .compile_worker import ARTIFACT, InputSpec, Job
from .runner import Runner

log = logging.getLogger("stepgraph")


def can_background(gm: torch.fx.GraphModule, inputs: list) -> str | None:
    """Why this graph must compile in-process (None: it can go to a child process)."""
    if any(n.op == "call_function" and "c10d" in str(n.target) for n in gm.graph.nodes):
        # Each rank would switch at a different call; collectives must pair up step by step.
        return "the step runs collectives (DDP)"
    seen = set()
    for t in inputs:
        if t._is_view() or t.storage_offset() != 0:
            return "an input or state tensor is a view (rebuilt as fake tensors they would not alias)"
        key = t.untyped_storage().data_ptr()
        if key in seen and t.numel():
            return "two inputs share storage"
        seen.add(key)
    return None


def _stop(proc: subprocess.Popen, directory: str) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    shutil.rmtree(directory, ignore_errors=True)


def _spawn(spare: bool) -> tuple[subprocess.Popen, str]:
    directory = tempfile.mkdtemp(prefix="stepgraph-inductor-")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    with open(os.path.join(directory, "log.txt"), "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "stepgraph.backends.compile_worker", directory]
                                + (["--spare"] if spare else []), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.PIPE if spare else subprocess.DEVNULL, env=env)
    return proc, directory


def _import_loader() -> None:
    import torch._inductor.standalone_compile  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401


_spare: list = []  # at most one (proc, dir) started ahead of a capture


def prestart() -> None:
    """Start a compile process ahead of the capture (called at the warm-up call): its start-up
    (Python, torch, Inductor's compile workers: seconds) then overlaps warm-up and tracing."""
    if not _spare:
        _spare.append(_spawn(spare=True))


@atexit.register
def _drop_spare() -> None:
    while _spare:
        _stop(*_spare.pop())


class BackgroundCompile:
    """One whole-step graph compiling in a child process."""

    def __init__(self, gm: torch.fx.GraphModule, inputs: list, patches: dict):
        from torch.fx._graph_pickler import GraphPickler, Options
        # GraphPickler keeps the graph node for node; plain pickling of a GraphModule re-traces
        # its code, which turns e.g. an arange into a tensor constant (an extra input).
        graph = GraphPickler.dumps(gm, Options(ops_filter=None))
        spare = _spare.pop() if _spare else None
        if spare is not None and spare[0].poll() is not None:  # it died: start a fresh one below
            _stop(*spare)
            spare = None
        self.proc, self.dir = spare or _spawn(spare=False)
        with open(os.path.join(self.dir, "job.pkl"), "wb") as f:
            pickle.dump(Job(graph, [InputSpec.of(t) for t in inputs], patches), f)
        if spare is not None:
            try:
                self.proc.stdin.write(b"go\n")
                self.proc.stdin.close()
            except OSError:  # it died: start a fresh one
                self.proc, self.dir = _spawn(spare=False)
        self.started = time.perf_counter()
        self.phases: dict = {}
        # Loading the artifact imports much of Inductor (~1.3 s the first time in a process):
        # do that now, off the call that will switch.
        threading.Thread(target=_import_loader, daemon=True).start()
        self._finalizer = weakref.finalize(self, _stop, self.proc, self.dir)

    def done(self) -> bool:
        return self.proc.poll() is not None

    def wait(self, timeout: float | None = None) -> bool:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def load(self):
        """The compiled callable; raises with the child's last output lines if it failed."""
        rc = self.proc.wait()
        try:
            if rc != 0 or not os.path.exists(os.path.join(self.dir, ARTIFACT)):
                with open(os.path.join(self.dir, "log.txt"), errors="replace") as f:
                    lines = [ln for ln in f.read().strip().splitlines() if ln.strip()]
                raise RuntimeError(f"the Inductor compile process exited with status {rc}: "
                                   + " | ".join(lines[-3:]))
            try:
                with open(os.path.join(self.dir, "done.json")) as f:
                    self.phases = json.load(f)  # the child's own times: start-up, compile, save
            except (OSError, ValueError):
                pass
            from torch._inductor import CompiledArtifact
            import torch._inductor.config as ic
            # Loading unpacks the artifact's cache entries and looks them up, so it needs the
            # caches on even where the user turned them off for their own compiles.
            with ic.patch(force_disable_caches=False), torch.compiler.config.patch(force_disable_caches=False):
                return CompiledArtifact.load(path=os.path.join(self.dir, ARTIFACT), format="binary")
        finally:
            self._finalizer()


class FusedWhenReady(Runner):
    """The per-call runner of a background-compiled step: unfused until the fused one is ready.

    ``finish(job) -> runner`` loads the fused runner and is called on the first call after the
    child exits (or from :meth:`wait`); on CUDA that runner's first call runs the fused step
    directly and records it. A failed compile is logged and warned once; the step then stays
    on the unfused graph, same results.
    """
    extras = ("job", "state", "error", "switch_seconds", "calls", "phases", "fused_at_call")

    def __init__(self, unfused, job: BackgroundCompile, finish, on_fused=None):
        self._run, self.job, self._finish, self._on_fused = unfused, job, finish, on_fused
        self.state = "compiling"
        self.error: str | None = None
        self.compile_seconds = 0.0   # wall time from the capture to the artifact being ready
        self.switch_seconds = 0.0    # loading + the first fused call (it records the CUDA graph)
        self.calls = 0
        self.phases: dict = {}  # the child's own times: waiting for the job, compile, save
        self.fused_at_call: int | None = None  # counted in replays of this graph
        self._first_fused = False

    def __call__(self, inputs):
        if self.job is not None and self.job.done():
            self._switch()
        self.calls += 1
        if not self._first_fused:
            return self._run(inputs)
        t0 = time.perf_counter()
        out = self._run(inputs)
        self._first_fused = False
        self.switch_seconds += time.perf_counter() - t0
        log.info("stepgraph: Inductor graph ready after %.1fs in the background; switched at replay %d "
                 "(load + first call + record %.2fs)", self.compile_seconds, self.fused_at_call,
                 self.switch_seconds)
        return out

    def _switch(self) -> None:
        job, self.job = self.job, None
        self.compile_seconds = time.perf_counter() - job.started
        t0 = time.perf_counter()
        try:
            fused = self._finish(job)
        except Exception as e:  # noqa: BLE001 - any failure leaves the (correct) unfused graph
            self.state, self.error = "failed", f"{type(e).__name__}: {str(e).strip()[:500]}"
            msg = (f"stepgraph: the background Inductor compile failed; the step keeps running its "
                   f"unfused graph (same results, no fusion): {self.error}")
            warnings.warn(msg, stacklevel=3)
            log.warning(msg)
            return
        self._run, self.state = fused, "fused"
        self.switch_seconds = time.perf_counter() - t0
        self.phases = job.phases
        self.fused_at_call = self.calls + 1
        self._first_fused = True
        if self._on_fused is not None:
            self._on_fused(self.compile_seconds)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the compile is done and switch now; True once fused."""
        if self.job is not None and self.job.wait(timeout):
            self._switch()
        return self.state == "fused"

    def stale(self) -> str | None:
        return self._run.stale()

    def describe(self) -> str:
        if self.state == "compiling":
            return (f"Inductor compiling in a background process (pid {self.job.proc.pid}, "
                    f"{time.perf_counter() - self.job.started:.1f}s so far); running the unfused graph meanwhile")
        if self.state == "fused":
            ph = ", ".join(f"{k[:-2]} {v:.1f}s" for k, v in self.phases.items())
            return (f"Inductor graph live from this graph's replay {self.fused_at_call} (compiled in the background "
                    f"in {self.compile_seconds:.1f}s; switching took {self.switch_seconds:.2f}s; {ph})")
        return f"background Inductor compile failed, running the unfused graph: {self.error}"
