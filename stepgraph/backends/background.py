"""Background compile for ``backend="inductor"``: train on the unfused graph while Inductor works.

Inductor needs seconds to minutes for a whole step (GPT-6L on an H200: ~22 s, against ~9 s
for ``torch.compile`` of the model alone, which leaves the optimizer eager). Blocking the
first step on that is what users of compilers complain about most. Instead, the capturing
call hands the lifted graph to a child process (``compile_worker``: Inductor's
``standalone_compile`` on fake inputs, saved as a ``CompiledArtifact``) and returns at once;
until the artifact is ready, calls run the *same* graph unfused (one CUDA graph on the GPU,
the replay backend on the CPU), so steps start within a second. A watcher thread waits for
the child and loads the artifact (the load was the switching call's whole stall: 0.3 s to
11 s on the CPU); the first call after that switches, checking the fused step against the
unfused one (verify.py); both graphs update the same parameter and optimizer tensors, so the
switch is seamless. Progress lines (progress.py) say when it starts, is ready and switches.

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

from . import artifact_cache
from .compile_worker import ARTIFACT, InputSpec, Job
from .progress import progress
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


def _spawn(spare: bool, share: int = 1) -> tuple[subprocess.Popen, str]:
    """A compile process; ``share``: how many run side by side (partition.py), which split the
    host's cores between their pools of Inductor compile workers (each warms one worker per core
    otherwise: 4 children on a 128-core host would start 128 workers)."""
    directory = tempfile.mkdtemp(prefix="stepgraph-inductor-")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    if share > 1 and "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
        env["TORCHINDUCTOR_COMPILE_THREADS"] = str(max(1, min(32, os.cpu_count() or 1) // share))
    with open(os.path.join(directory, "log.txt"), "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "stepgraph.backends.compile_worker", directory]
                                + (["--spare"] if spare else []), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.PIPE if spare else subprocess.DEVNULL, env=env)
    return proc, directory


def _import_loader() -> None:
    import torch._inductor.standalone_compile  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401


_spare: list = []  # (proc, dir) started ahead of a capture: one, or one per part (partition.py)


def prestart(n: int = 1) -> None:
    """Start ``n`` compile processes ahead of the capture (called at the warm-up call): their
    start-up (Python, torch, Inductor's compile workers: 7-8 s on an H200 host) then overlaps
    warm-up and tracing. ``n > 1`` for a step whose graph will compile in parts (partition.py)."""
    while len(_spare) < n:
        _spare.append(_spawn(spare=True, share=n))


@atexit.register
def _drop_spare() -> None:
    while _spare:
        _stop(*_spare.pop())


class BackgroundCompile:
    """One whole-step graph compiling in a child process."""

    def __init__(self, gm: torch.fx.GraphModule, inputs: list, patches: dict, part: tuple | None = None):
        from torch.fx._graph_pickler import GraphPickler, Options
        # (part i of k: partition.PartsCompile says what they do; each part says when it is done)
        self.part = part
        quiet = part is not None
        # GraphPickler keeps the graph node for node; plain pickling of a GraphModule re-traces
        # its code, which turns e.g. an arange into a tensor constant (an extra input).
        specs = [InputSpec.of(t) for t in inputs]
        self.cache = artifact_cache.folder()
        self.key = artifact_cache.key(gm, specs, patches) if self.cache else None
        self.cached = artifact_cache.lookup(self.cache, self.key) if self.cache else None
        if self.cached:
            self._start(_Done(), tempfile.mkdtemp(prefix="stepgraph-inductor-"))
            quiet or progress("stepgraph: the fused step is in stepgraph's artifact cache (%s); loading "
                              "it in the background, training continues on the unfused graph", self.cached)
            return
        graph = GraphPickler.dumps(gm, Options(ops_filter=None))
        spare = _spare.pop() if _spare else None
        if spare is not None and spare[0].poll() is not None:  # it died: start a fresh one below
            _stop(*spare)
            spare = None
        share = part[1] if part is not None else 1
        self.proc, self.dir = spare or _spawn(spare=False, share=share)
        with open(os.path.join(self.dir, "job.pkl"), "wb") as f:
            pickle.dump(Job(graph, specs, patches), f)
        if spare is not None:
            try:
                self.proc.stdin.write(b"go\n")
                self.proc.stdin.close()
            except OSError:  # it died: start a fresh one
                self.proc, self.dir = _spawn(spare=False, share=share)
        self._start(self.proc, self.dir)
        quiet or progress("stepgraph: compiling the fused step with Inductor in the background (pid %d); "
                          "training continues on the unfused graph", self.proc.pid)

    def _start(self, proc, directory: str) -> None:
        self.proc, self.dir = proc, directory
        self.started = time.perf_counter()
        self.phases: dict = {}
        self.exited_s = self.ready_s = 0.0  # seconds from the start: child exited, artifact loaded
        self.ready = threading.Event()      # set once loaded (or failed): the next call switches
        self._loaded = self._error = None
        self._deferred = False  # the load was left to the switching call (load())
        self._finalizer = weakref.finalize(self, _stop, self.proc, self.dir)
        # The thread holds the job weakly: a dropped job still kills its child (the finalizer).
        threading.Thread(target=_watch, args=(weakref.ref(self), self.proc), daemon=True,
                         name="stepgraph-inductor-load").start()

    def done(self) -> bool:
        return self.ready.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self.ready.wait(timeout)

    def load(self):
        """The compiled callable (loaded by the watcher thread); raises its error if it failed."""
        self.ready.wait()
        if self._deferred:
            # The watcher met a warnings filter set to "error" (pytest -W error, a test's
            # simplefilter): Inductor's imports warn (torch.jit.script_method's deprecation,
            # torch 2.11), which then raised. Silencing warnings is only safe on this thread
            # (catch_warnings swaps process-wide filters), so the load happens here.
            self._deferred = False
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    _import_loader()
                    self._loaded = self._load()
            except Exception as e:  # noqa: BLE001 - the switching call reports it
                self._error = e
        if self._error is not None:
            raise self._error
        return self._loaded

    def _load(self):
        """The compiled callable; raises with the child's last output lines if it failed."""
        rc = self.proc.wait()
        artifact = self.cached or os.path.join(self.dir, ARTIFACT)
        try:
            if rc != 0 or not os.path.exists(artifact):
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
                loaded = CompiledArtifact.load(path=artifact, format="binary")
            if self.key and not self.cached:  # (kept only once it loaded)
                artifact_cache.store(self.cache, self.key, artifact)
        except Warning:
            raise  # (load() retries on the user's thread: the files must stay)
        except BaseException:
            self._finalizer()
            raise
        self._finalizer()
        return loaded


class _Done:
    """The child of a job found in the artifact cache: there is none, it has 'exited' fine."""

    pid = 0

    def wait(self):
        return 0

    def poll(self):
        return 0


def _watch(ref, proc: subprocess.Popen) -> None:
    """Wait for the child, then load its artifact here, off the user's calls: loading imports
    much of Inductor and unpacks its cache entries (the switching call's whole stall when it
    ran there). It holds the GIL at times, so calls meanwhile may run a little slower."""
    proc.wait()
    job = ref()
    if job is None:
        return
    job.exited_s = time.perf_counter() - job.started
    try:
        _import_loader()
        job._loaded = job._load()
    except Warning:  # a warning raised as an error by the user's filters: see load()
        job._deferred = True
    except BaseException as e:  # noqa: BLE001 - handed to the call that switches
        job._error = e
    job.ready_s = time.perf_counter() - job.started
    if job._error is None and not job._deferred and job.part is not None:
        progress("stepgraph: part %d of %d of the fused step compiled (%.1fs)", job.part[0] + 1, job.part[1],
                 job.ready_s)
    elif job._error is None and not job._deferred:
        progress("stepgraph: fused step ready after %.1fs (compiled %.1fs, loaded %.2fs); "
                 "it takes over at the next call", job.ready_s, job.exited_s, job.ready_s - job.exited_s)
    job.ready.set()


class FusedWhenReady(Runner):
    """The per-call runner of a background-compiled step: unfused until the fused one is ready.

    ``finish(job) -> runner`` loads the fused runner and is called on the first call after the
    child exits (or from :meth:`wait`); on CUDA that runner's first call runs the fused step
    directly and records it. A failed compile is logged and warned once; the step then stays
    on the unfused graph, same results.
    """
    extras = ("job", "state", "error", "switch_seconds", "calls", "phases", "fused_at_call", "parity", "where",
              "started", "switched_s")

    def __init__(self, unfused, job: BackgroundCompile, finish, on_fused=None, check=None, where="in the background"):
        self._run, self.job, self._finish, self._on_fused = unfused, job, finish, on_fused
        self.where = where   # how it was compiled (inductor._checked_at_first_call: "in-process")
        self._unfused, self._check = unfused, check  # verify.FusedCheck: run at the first fused call
        self.parity = None  # verify.ParityResult once checked
        self.state = "compiling"
        self.error: str | None = None
        self.compile_seconds = 0.0   # wall time from the capture to the artifact loaded (ready)
        self.switch_seconds = 0.0    # the switching call: first fused call (CUDA: + record) + check
        self.calls = 0
        self.phases: dict = {}  # the child's own times: waiting for the job, compile, save
        self.fused_at_call: int | None = None  # counted in replays of this graph
        self._first_fused = False
        self.started = job.started
        self.switched_s = 0.0  # seconds from the capture to the end of the switching call

    def __call__(self, inputs):
        if self.job is not None and self.job.done():
            self._switch()
        self.calls += 1
        if not self._first_fused:
            return self._run(inputs)
        t0 = time.perf_counter()
        unfused, check = self._unfused, self._check
        self._unfused = self._check = None  # the check's plan holds state tensors: not kept
        if check is not None:
            out, self.parity = check.run(inputs, unfused, self._run)
        else:
            out = self._run(inputs)
        self._first_fused = False
        self.switch_seconds += time.perf_counter() - t0
        self.switched_s = time.perf_counter() - self.started
        if self.parity is not None and (self.parity.diverged or self.parity.error):
            self._keep_unfused(unfused)
            return out
        if self.parity is not None and self._on_fused is not None:
            self._on_fused(0.0, self.parity)
        checked = "" if self.parity is None else (
            "; checked for non-finite values only: it draws random numbers" if self.parity.finite_only else
            f"; checked against the unfused graph: max relative difference {self.parity.max_rel:.1e}")
        progress("stepgraph: switched to the fused step at replay %d (switching call %.2fs%s)",
                 self.fused_at_call, self.switch_seconds, checked)
        return out

    def _keep_unfused(self, unfused) -> None:
        p = self.parity
        self._run, self.state = unfused, "diverged"
        if self._on_fused is not None:
            self._on_fused(0.0, p)
        what = (f"its first call failed ({p.error})" if p.error else
                "another rank's check failed, and every rank keeps its unfused graph (one verdict keeps "
                "the replicas equal)" if p.other_rank else
                f"{p.diverged} holds NaN or inf where the unfused graph's does not" if p.finite_only else
                f"{p.diverged} differs from the unfused graph's by {p.max_rel:.1e} relative after one step "
                f"(tolerance {p.tolerance:.0e} for {p.dtype})")
        msg = (f"stepgraph: the fused Inductor step did not match the unfused graph: {what}; the step "
               "keeps running its unfused graph (eager's kernels), and this call's results are the "
               "unfused graph's. STEPGRAPH_INDUCTOR_VERIFY=0 switches without the check")
        warnings.warn(msg, stacklevel=4)
        log.warning(msg)

    def _switch(self) -> None:
        job, self.job = self.job, None
        self.started = job.started
        self.compile_seconds = job.ready_s or time.perf_counter() - job.started
        t0 = time.perf_counter()
        try:
            fused = self._finish(job)
        except Exception as e:  # noqa: BLE001 - any failure leaves the (correct) unfused graph
            self.state, self.error = "failed", f"{type(e).__name__}: {str(e).strip()[:500]}"
            msg = (f"stepgraph: the background Inductor compile failed; the step keeps running its "
                   f"unfused graph (same results, no fusion): {self.error}")
            warnings.warn(msg, stacklevel=3)
            log.warning(msg)
            self._unfused = self._check = None
            return
        self._run, self.state = fused, "fused"
        if self._check is None:
            self._unfused = None
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
        checked = f"\n    {self.parity.describe()}" if self.parity is not None else ""
        if self.state == "fused":
            ph = ", ".join(f"{k[:-2]} {v:.1f}s" for k, v in self.phases.items())
            fallback = self._run.describe()   # (a fused step that could not be recorded: cudagraph.py)
            return (f"Inductor graph live from this graph's replay {self.fused_at_call} (compiled {self.where} "
                    f"in {self.compile_seconds:.1f}s; switching took {self.switch_seconds:.2f}s; {ph})"
                    + (f"; but {fallback}" if fallback else "") + checked)
        if self.state == "diverged":
            return "the fused Inductor graph did not match the unfused graph: running the unfused graph" + checked
        return f"background Inductor compile failed, running the unfused graph: {self.error}"
