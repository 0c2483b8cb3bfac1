"""The real-client corpus harness: run a vendored training program eager and under stepgraph on
the same batches, and classify what stepgraph did.

A client is a module in ``clients/`` that reproduces a public training program: its model code
vendored verbatim (licence header and source kept), its loop body as the program writes it, on
synthetic data. It defines::

    SOURCE = "https://github.com/owner/repo/blob/<commit>/path"   # where the code comes from
    LICENSE = "BSD-3-Clause"
    TAGS = ("rnn", "lm")                                          # what kind of program it is

    def main(sg, steps=8, device="cpu", amp=None):
        ...build the model, optimizer, data exactly as the program does (seeded by the harness)...
        sg.track(model=model, opt=opt)           # the objects whose state the harness compares
        @sg.compile                              # where the user would put @stepgraph.compile
        def train_step(x, y): ...
        for it in range(steps):
            ...the program's loop: lr schedules, logging, evaluation, as it writes them...
            loss = train_step(x, y)
            sg.log(loss)                          # the per-step value the program reports

``amp`` is None (fp32) or "bf16": clients whose program has an autocast path use it there.

Each client module is loaded fresh (its own globals) for every run, so a program's module-level
state (a global ``lr``, a list of rewards) starts identical in the eager and the stepgraph run.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import random
import re
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree

from stepgraph.captured import reason_kind

HERE = os.path.dirname(os.path.abspath(__file__))

OK, WRONG, CLEAR, UNCLEAR, EAGER, RECAPTURES = "OK", "WRONG", "CLEAR-ERROR", "UNCLEAR-ERROR", "EAGER", "RECAPTURES"


class _Stop(Exception):
    """Raised by the eager run's wrapper after the call at which the stepgraph run failed."""


def names() -> list[str]:
    return sorted(f[:-3] for f in os.listdir(HERE)
                  if f.endswith(".py") and not f.startswith("_") and f not in ("harness.py", "__main__.py"))


def load(name: str):
    """A fresh copy of client ``name`` (its own module globals); ``zoo:...``: clients/_zoo.py."""
    if name.startswith("zoo:"):
        from clients import _zoo as zoo
        return zoo.load(name, load)
    path = os.path.join(HERE, name + ".py")
    spec = importlib.util.spec_from_file_location(f"clients.{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("clients", importlib.import_module("clients"))
    spec.loader.exec_module(mod)
    return mod


def seed_all(seed: int) -> None:
    # Deterministic cuDNN kernels: eager and stepgraph runs must be comparable bit for bit.
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
        np.random.seed(seed)
    except ImportError:
        pass


class SG:
    """What a client's ``main`` receives: ``compile`` (stepgraph or identity), ``track``, ``log``."""

    def __init__(self, use_stepgraph: bool, device: str, stop_after: int | None = None, **compile_kw):
        self.use_stepgraph = use_stepgraph
        self.device = device
        self.compile_kw = compile_kw
        self.stop_after = stop_after
        self.tracked: dict = {}
        self.logs: list = []
        self.calls = 0
        self.times: list[tuple[str, float]] = []   # (what the call did, seconds)
        self.steps: list = []                      # the StepFunctions made

    def track(self, **objs) -> None:
        self.tracked.update(objs)

    def log(self, value) -> None:
        self.logs.append(_detach(value))

    def compile(self, fn=None, **kw):
        def wrap(f):
            inner = f
            if self.use_stepgraph:
                import stepgraph
                inner = stepgraph.compile(f, **{**self.compile_kw, **kw})
                self.steps.append(inner)

            n_calls = [0]

            def call(*a, **k):
                self.calls += 1
                n_calls[0] += 1
                if not self.use_stepgraph and self.device == "cuda" and n_calls[0] == 2:
                    _same_optimizer_form(f, a, k)
                before = _counts(inner)
                _sync(self.device)
                t = time.perf_counter()
                out = inner(*a, **k)
                _sync(self.device)
                dt = time.perf_counter() - t
                after = _counts(inner)
                kind = "eager" if after is None else ("replay" if after[2] > before[2] else
                                                       "capture" if after[1] > before[1] else "eager")
                self.times.append((kind, dt))
                if self.stop_after is not None and self.calls >= self.stop_after:
                    raise _Stop()
                return out
            call.__wrapped__ = f
            call.step = inner
            return call
        return wrap(fn) if fn is not None else wrap


def _same_optimizer_form(f, a, k) -> None:
    """The eager reference switches its CUDA optimizers to the capturable form where stepgraph
    does (at its capturing call, the second): PyTorch has no graph-safe form bitwise equal to
    the default foreach Adam, so the corpus compares like with like; the drift between the two
    forms is measured by scripts/optimizer_drift.py and tabled in docs/optimizer_drift.md."""
    from stepgraph.capture.guards import arg_names
    from stepgraph.capture.state import discover
    from stepgraph.optimizers import make_capturable
    make_capturable(discover(f, (), a, k, arg_names(f)))


def _counts(step):
    s = getattr(step, "stats", None)
    return None if s is None else (s.eager_calls, s.captures, s.replays)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _detach(v):
    return pytree.tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, v)


def state_tensors(tracked: dict) -> dict[str, object]:
    """Every tensor the tracked objects hold, by name: modules' parameters, grads and buffers,
    optimizers' state_dict, GradScaler's scale, and plain tensors."""
    out: dict = {}
    for name, obj in tracked.items():
        if isinstance(obj, torch.nn.Module):
            for n, p in obj.named_parameters():
                out[f"{name}.{n}"] = p.detach().clone()
                out[f"{name}.{n}.grad"] = None if p.grad is None else p.grad.detach().clone()
            for n, b in obj.named_buffers():
                out[f"{name}.{n}"] = b.detach().clone()
        elif isinstance(obj, torch.optim.Optimizer):
            sd = obj.state_dict()
            for k, leaf in pytree.tree_flatten_with_path(sd)[0]:
                out[f"{name}{pytree.keystr(k)}"] = leaf.detach().clone() if isinstance(leaf, torch.Tensor) else leaf
        elif isinstance(obj, torch.Tensor):
            out[name] = obj.detach().clone()
        elif hasattr(obj, "state_dict"):
            for k, leaf in pytree.tree_flatten_with_path(obj.state_dict())[0]:
                out[f"{name}{pytree.keystr(k)}"] = leaf.detach().clone() if isinstance(leaf, torch.Tensor) else leaf
        else:
            out[name] = obj
    return out


def rel_err(a, b, at_least: float = 0.0) -> float:
    # A hyper-parameter held as a 0-dim device tensor (stepgraph's capturable switch on the
    # GPU) is compared by value with the user's float.
    if isinstance(a, torch.Tensor) and a.numel() == 1 and isinstance(b, (int, float)) and not isinstance(b, bool):
        a = a.item()
    if isinstance(b, torch.Tensor) and b.numel() == 1 and isinstance(a, (int, float)) and not isinstance(a, bool):
        b = b.item()
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return math.inf
        if a.shape != b.shape or a.dtype != b.dtype:
            return math.inf
        # (On the GPU stepgraph keeps optimizer step counters on the device: compare values.)
        a, b = a.detach().cpu(), b.detach().cpu()
        if a.is_sparse:
            a, b = a.to_dense(), b.to_dense()
        if torch.equal(a, b):
            return 0.0
        if not a.is_floating_point() and not a.is_complex() and not at_least:
            return math.inf   # (CPU: integers are exact)
        # GPU: an integer tensor computed from floats (a confusion matrix of argmax predictions)
        # moves by a count where a float within the tolerance flips an argmax: compared as floats.
        a, b = a.double(), b.double()
        if not torch.equal(a.isnan(), b.isnan()):
            return math.inf
        a, b = a.nan_to_num(0.0), b.nan_to_num(0.0)
        return ((a - b).norm() / b.norm().clamp_min(max(at_least, 1e-30))).item()
    if isinstance(a, float) and isinstance(b, float):
        if a == b or (a != a and b != b):
            return 0.0
        return abs(a - b) / max(abs(b), 1e-30)
    return 0.0 if a == b else math.inf


def errors(got: dict, want: dict, floor: float | None = None) -> dict:
    """Relative error per entry. ``floor`` (GPU): a tensor's error is relative to at least
    ``floor`` times the largest norm of its family (grads, a parameter kind, an optimizer-state
    kind), not to its own norm alone."""
    out = {}
    scale = _family_scale(want) if floor else {}
    for k in dict.fromkeys(list(want) + list(got)):
        if k.endswith(("['capturable']", "['foreach']")):
            continue  # the optimizer form stepgraph picks on the GPU (README); values are compared
        at_least = floor * scale.get(_family(k), 0.0) if floor else 0.0
        out[k] = rel_err(got.get(k, "<missing>"), want.get(k, "<missing>"), at_least)
    return out


def compare(got: dict, want: dict, floor: float | None = None, spread: dict | None = None) -> tuple[float, str]:
    """Worst relative error over all entries, and the name of the worst one. ``spread`` (GPU):
    eager's own run-to-run error per entry (nondeterministic kernels: atomics in ReflectionPad
    and upsample backwards); an entry is judged by its error over 4 times that spread, or its
    family's (the loss at every step, every grad) where larger: one second run is one sample of
    a chaotic spread (torchvision's segmentation: the loss of step 5 one run apart by 1e-4, by
    1e-3 at the next run, while its grads differ by up to 1.0)."""
    worst, where = 0.0, ""
    family: dict = {}
    for k, e in (spread or {}).items():
        for g in (_family(k), _record(k)):
            family[g] = max(family.get(g, 0.0), e)
    for k, e in errors(got, want, floor).items():
        s = max(spread.get(k, 0.0), family.get(_family(k), 0.0), family.get(_record(k), 0.0)) if spread else 0.0
        if s > 0.0:
            e = e / max(1.0, 4 * s / (floor or 1e-3))
        if e > worst:
            worst, where = e, k
    return worst, where


def _family(k: str) -> str:
    """``a.b.weight.grad`` -> ``grad``; ``a.b.bias`` -> ``bias``; ``optim['state'][3]['exp_avg']``
    -> ``optim['state'][]['exp_avg']``."""
    k = re.sub(r"\[\d+\]", "[]", k)
    return "grad" if k.endswith(".grad") else k.rsplit(".", 1)[-1]


def _record(k: str) -> str:
    """``log[9]['acc_global']`` -> ``log[9]``: the values the program logged together, from one
    evaluation. When eager cannot repeat one of them, the others come from that same unrepeatable
    evaluation (torchvision's segmentation: its confusion matrix moved by a pixel between eager
    runs while the two runs' ``acc_global``, the matrix's trace over its sum, happened to agree;
    the stepgraph run's was one pixel off: 1.2e-3, H200, session 30)."""
    m = re.match(r"log\[\d+\]", k)
    return m.group() + "[*]" if m else ""


def _family_scale(want: dict) -> dict:
    out: dict = {}
    for k, v in want.items():
        if isinstance(v, torch.Tensor) and v.dtype != torch.bool and not v.is_complex() and not v.is_sparse:
            out[_family(k)] = max(out.get(_family(k), 0.0), v.detach().double().norm().item())
    return out


def _near_zero(want: dict, floor: float):
    """Tensors whose norm is below ``floor`` times their family's scale (compared at that scale)."""
    scale = _family_scale(want)
    for k, v in want.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point() and not v.is_sparse \
                and v.detach().double().norm().item() < floor * scale.get(_family(k), 0.0):
            yield k


def _log_dict(logs: list) -> dict:
    out = {}
    for i, v in enumerate(logs):
        for path, leaf in pytree.tree_flatten_with_path(v)[0]:
            out[f"log[{i}]{pytree.keystr(path)}"] = leaf
    return out


@dataclass
class Result:
    name: str
    status: str
    detail: str = ""
    max_rel: float = 0.0
    speedup: float | None = None      # eager median step / stepgraph median replay
    stats: list = field(default_factory=list)
    warnings: list = field(default_factory=list)
    noisy: int = 0   # tensors near zero in exact arithmetic, compared at their family's scale (GPU)
    unrepeatable: int = 0   # tensors two eager runs disagree on (GPU), judged against that spread

    def row(self) -> str:
        sp = f"{self.speedup:.2f}x" if self.speedup else "-"
        return f"{self.name:<28} {self.status:<14} {sp:>7}  {self.max_rel:9.2e}  {self.detail}"


def _run(name, use_stepgraph, steps, device, amp, seed, stop_after=None, **compile_kw):
    mod = load(name)
    sg = SG(use_stepgraph, device, stop_after, **compile_kw)
    seed_all(seed)
    err = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            mod.main(sg, steps=steps, device=device, amp=amp)
        except _Stop:
            pass
        except Exception as e:  # noqa: BLE001 - classified by the caller
            err = e
            err.__tb_text__ = traceback.format_exc()
    stepgraph_warnings = [str(w.message) for w in caught if "stepgraph" in str(w.message)]
    return mod, sg, err, stepgraph_warnings


def _spread(name, steps, device, amp, seed, stop_after, want: dict, rtol: float, logs: bool = True) -> dict:
    """Eager's own run-to-run error per entry over two more eager runs (the largest of each)."""
    spread: dict = {}
    for _ in range(2):
        _, again, _, _ = _run(name, False, steps, device, amp, seed, stop_after=stop_after)
        got = {**state_tensors(again.tracked), **(_log_dict(again.logs) if logs else {})}
        for k, e in errors(got, want, floor=rtol).items():
            if e > 0.0:
                spread[k] = max(e, spread.get(k, 0.0))
    return spread


def run_client(name: str, *, steps: int = 8, device: str = "cpu", amp=None, seed: int = 0,
               rtol: float | None = None, **compile_kw) -> Result:
    """Eager run, then the stepgraph run on the same seed and batches; classify the difference."""
    rtol = (1e-5 if device == "cpu" else 1e-3 if amp is None else 2e-2) if rtol is None else rtol
    try:
        devices = getattr(load(name), "DEVICES", ("cpu", "cuda"))
    except ImportError as e:
        return Result(name, "SKIP", f"needs {e.name}")
    if device not in devices:
        return Result(name, "SKIP", f"the program runs on {', '.join(devices)} only")
    mod, eager, e_err, _ = _run(name, False, steps, device, amp, seed)
    if isinstance(e_err, ImportError):
        return Result(name, "SKIP", f"needs {e_err.name}")
    if e_err is not None:
        return Result(name, "BROKEN", f"the eager program fails: {type(e_err).__name__}: {e_err}")
    _, sgr, err, warns = _run(name, True, steps, device, amp, seed, **compile_kw)
    # (a step the program defines but this run never calls, a variant's other path: not listed)
    stats = [s.stats for s in sgr.steps if s.stats.eager_calls or s.stats.captures or s.stats.failed_captures]
    res = Result(name, OK, stats=stats, warnings=warns)
    if err is not None:
        from stepgraph import CaptureError
        fname = os.path.basename(mod.__file__)
        where = getattr(err, "where", "") or ""
        first = str(err).splitlines()[0][:160]
        # The user's line is the client's, or the program's own code vendored beside it (a step
        # that is the program's method, sfujim/TD3's policy.train), or, for errors raised at the
        # call, the harness's wrapper that makes it.
        # (A variant client runs its program's code from the program's client file: that file
        # is the user's code too.)
        if isinstance(err, CaptureError) and (fname in where or HERE in where) \
                and getattr(err, "fix", ""):
            # Refused before anything changed: state equals eager's after the same calls.
            _, twin, _, _ = _run(name, False, steps, device, amp, seed, stop_after=sgr.calls)
            got_s, want_s = state_tensors(sgr.tracked), state_tensors(twin.tracked)
            worst, at = compare(got_s, want_s)
            if worst > rtol and device != "cpu":   # (the GPU's floor and eager's own spread, as below)
                # (two more eager runs: cyclegan's ReflectionPad backward atomics spread its
                # Adam state by up to 1.7 between eager runs, and one run's spread was judged
                # 1.1e-3 short of the stepgraph run's on an H200)
                spread = _spread(name, steps, device, amp, seed, sgr.calls, want_s, rtol, logs=False)
                worst, at = compare(got_s, want_s, floor=rtol, spread=spread)
            if worst <= rtol:
                res.status, res.detail = CLEAR, f"{first} [{where.split(' (')[0]}]"
            else:
                res.status, res.detail = WRONG, f"error left state unlike eager ({at}: {worst:.2e}): {first}"
            res.max_rel = worst
            return res
        res.status, res.detail = UNCLEAR, f"{type(err).__name__}: {first}"
        return res
    worst, at = compare({**state_tensors(sgr.tracked), **_log_dict(sgr.logs)},
                        {**state_tensors(eager.tracked), **_log_dict(eager.logs)})
    res.max_rel = worst
    eager_t = [t for k, t in eager.times[2:]]
    replay_t = [t for k, t in sgr.times if k == "replay"]
    if eager_t and replay_t:
        res.speedup = statistics.median(eager_t) / statistics.median(replay_t)
    if worst > rtol and device != "cpu":
        # A tensor whose exact value is zero (the grad of a conv bias followed by BatchNorm, and
        # its Adam moments) is rounding noise in eager and here: measured at its family's scale.
        want = state_tensors(eager.tracked)
        got_all, want_all = {**state_tensors(sgr.tracked), **_log_dict(sgr.logs)}, {**want, **_log_dict(eager.logs)}
        worst, at = compare(got_all, want_all, floor=rtol)
        res.max_rel, res.noisy = worst, sum(1 for _ in _near_zero(want, rtol))
        if worst > rtol:
            # Eager itself may not repeat (atomics in a backward, and Adam's normalised step
            # turning a zero grad's noise into a full step): two more eager runs measure that
            # (one judged fast_neural_style's upsample/ReflectionPad atomics 4e-3 short on an
            # H200, as it did cyclegan's refused call).
            spread = _spread(name, steps, device, amp, seed, None, want_all, rtol)
            if spread:
                worst, at = compare(got_all, want_all, floor=rtol, spread=spread)
                res.max_rel, res.unrepeatable = worst, len(spread)
    if worst > rtol:
        res.status, res.detail = WRONG, f"{at}: rel err {worst:.2e}"
        return res
    # (a model passed as an argument that is new to the step warms up eagerly, as the first did)
    extra_eager = sum(max(0, s.eager_calls - s_warm - s.new_state_warmups) for s, s_warm in
                      ((st.stats, st.warmup) for st in sgr.steps))
    # A new input shape needs its own graph (as torch.compile without dynamic shapes): counted
    # apart. Of the other recaptures, a *variant* is the first time the loop takes another path
    # through the step (a branch the other way, a gradient None then a tensor, a number reset
    # where a tensor was): its graph is kept and replayed whenever that path comes back. A
    # *recapture* is a guard site missing again (a value that keeps changing): the user pays a
    # capture per change, which is what RECAPTURES flags. The same reason again (a logging
    # branch taken for a second model, forward-forward's layers) is that variant needed once
    # more under other state, not a new value: a site counts once per distinct reason.
    recaptures = [r for s in stats for r in s.recaptures if " shape " not in r.split(" (now")[0]]
    shapes = sum(1 for s in stats for r in s.recaptures) - len(recaptures)
    sites: dict = {}
    # (a flag's two ways, ``... True -> False`` and ``... False -> True``, are one pair of
    # variants: a boolean takes no third value)
    # (and a reason is its site and values: what the recapture then made live is no new value)
    for r in dict.fromkeys(re.sub(r"\b(True|False)\b", "<bool>", r.split(" (now ")[0]) for r in recaptures):
        sites.setdefault(reason_kind(r), []).append(r)
    repeated = [rs for rs in sites.values() if len(rs) > 1]
    if not sgr.steps:
        res.status, res.detail = "BROKEN", "the client never called sg.compile"
    elif extra_eager:
        res.status = EAGER
        res.detail = ("warned: " + warns[0][:140]) if warns else "SILENT"
    elif repeated:
        res.status, res.detail = RECAPTURES, f"{len(repeated[0])} at one site: {' | '.join(repeated[0])[:160]}"
    elif not any(s.replays for s in stats):
        res.status, res.detail = EAGER, "never replayed"
    else:
        res.detail = "; ".join(f"{s.captures} capture(s), {s.replays} replays" for s in stats)
        if shapes:
            res.detail += f" ({shapes} for new input shapes)"
        if recaptures:
            res.detail += f" ({len(recaptures)} variant(s): {'; '.join(recaptures)[:160]})"
        if res.noisy:
            res.detail += f" ({res.noisy} near-zero tensor(s) compared at their family's scale)"
        if res.unrepeatable:
            res.detail += f" ({res.unrepeatable} tensor(s) differ between two eager runs: judged against that spread)"
    return res


def _isolated(chosen: list, a) -> list:
    """Each client in ``python -m clients NAME --result-json F``, ``a.jobs`` at a time."""
    import subprocess
    import sys
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    def one(n):
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "r.json")
            cmd = [sys.executable, "-m", "clients", n, "--device", a.device, "--steps", str(a.steps),
                   "--backend", a.backend, "--result-json", out] + (["--amp", a.amp] if a.amp else [])
            proc = subprocess.run(cmd, cwd=os.path.dirname(HERE), capture_output=True, text=True)
            if os.path.exists(out):
                with open(out) as f:
                    r = Result(**json.load(f))
            else:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
                r = Result(n, UNCLEAR, f"the process died (exit {proc.returncode}): {tail[0][:200]}")
        print(r.row(), flush=True)
        return r
    with ThreadPoolExecutor(a.jobs) as pool:
        return list(pool.map(one, chosen))


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="python -m clients", description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", help="clients to run (default: all)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--amp", default=None, choices=[None, "bf16"])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--backend", default="auto")
    p.add_argument("--out", default=None, help="write the table as markdown here")
    p.add_argument("--jobs", type=int, default=0,
                   help="run each client in a process of its own, this many at once (a crash is one "
                        "row, not the run; speed ratios are then measured on a shared machine)")
    p.add_argument("--result-json", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    chosen = a.names or names()
    if "zoo" in chosen:   # (library models trained by the corpus's programs: clients/_zoo.py)
        from clients import _zoo as zoo
        chosen = [m for n in chosen for m in (zoo.names() if n == "zoo" else [n])]
    unknown = [n for n in chosen if n not in names() and not n.startswith("zoo:")]
    if unknown:
        p.error(f"unknown client(s) {unknown}; known: {names()}")
    print(f"{'client':<28} {'status':<14} {'speed':>7}  {'max rel':>9}  detail", flush=True)
    if a.result_json:       # (one client, in a process of its own: --jobs)
        r = run_client(chosen[0], steps=a.steps, device=a.device, amp=a.amp, backend=a.backend)
        with open(a.result_json, "w") as f:
            json.dump(dataclasses.asdict(r), f, default=str)
        return 0
    rows = _isolated(chosen, a) if a.jobs else []
    for n in [] if a.jobs else chosen:
        r = run_client(n, steps=a.steps, device=a.device, amp=a.amp, backend=a.backend)
        rows.append(r)
        print(r.row(), flush=True)
    counts = {}
    for r in rows:
        counts[r.status] = counts.get(r.status, 0) + 1
    print("totals:", ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    if a.out:
        with open(a.out, "w") as f:
            f.write(f"| client | status | speed-up | max rel | detail |\n|---|---|---|---|---|\n")
            for r in rows:
                sp = f"{r.speedup:.2f}x" if r.speedup else "-"
                f.write(f"| {r.name} | {r.status} | {sp} | {r.max_rel:.1e} | {r.detail.replace('|', '/')} |\n")
    return 0 if all(r.status in (OK, CLEAR, "SKIP") for r in rows) else 1
