"""Sweep third-party and torch optimizers through stepgraph on the CPU, comparing bitwise with an eager
twin after every call (loss, params, grads, buffers, optimizer state, param_groups, optimizer attributes).

    OMP_NUM_THREADS=1 PYTHONPATH=/work/pydeps/tv python scripts/sweep_optim.py [--jobs 2] [--out DIR] [names or prefixes...]
    python scripts/sweep_optim.py --list
    python scripts/sweep_optim.py --worker NAME OUT.json           # one optimizer (internal)

Libraries: torch.optim ("torch:"), timm.optim.create_optimizer_v2 ("timm:", needs torchvision importable:
PYTHONPATH=/work/pydeps/tv), pytorch_optimizer.load_optimizer ("po:"), schedulefree ("sf:"),
torch_optimizer ("to:"), lion_pytorch ("lion:").

Each optimizer runs in its own subprocess (timeout --timeout, default 150 s) on two configs:
``mlp`` (Linear(8,16)-GELU-Linear(16,4)) and ``conv`` (Conv-BN-ReLU-Conv-pool-Linear, 4-D weights and BN
buffers); weight-decay groups (0.05 on >=2-D weights, 0 on biases/norms) where the constructor takes
``weight_decay``; 8 calls on fresh batches (the same ones for both twins, RNG seeded before each call).

Verdicts: OK (bitwise, <=3 captures, >=5 replays; >=4 when 2-3 bounded variants were captured), WRONG (first differing entry recorded), RECAPTURES
(>=4 captures, or too few replays because of recaptures), CLEAR-ERROR (CaptureError), CRASH (other
exception / timeout), EAGER (no replays, no error), SKIP (the eager run itself fails: CUDA-only, ...).
Details per optimizer go to OUT/NAME.json; the table to OUT/table.md.
"""
from __future__ import annotations

import inspect
import json
import math
import os
import subprocess
import sys
import time
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's stepgraph

CALLS = 8
WD = 0.05
TIMEOUT = 150

# ------------------------------------------------------------------------------------- registry


def torch_entries():
    import torch.optim as O
    E = {}

    def add(name, cls, closure=False, **kw):
        E["torch:" + name] = {"lib": "torch.optim", "make": lambda params, model, cls=cls, kw=kw: getattr(O, cls)(params, **kw),
                              "wd": "weight_decay" in inspect.signature(getattr(O, cls).__init__).parameters,
                              "mode": "closure" if closure else "plain"}
    for cls in ("Adam", "AdamW"):
        for ams in (False, True):
            for fe in (False, True):
                add(f"{cls}{'-amsgrad' if ams else ''}{'-foreach' if fe else '-forloop'}", cls, amsgrad=ams, foreach=fe, lr=1e-3)
    add("Adam-capturable", "Adam", capturable=True, lr=1e-3)
    add("Adam-tensorlr", "Adam", lr=__import__("torch").tensor(1e-3), foreach=False)
    add("AdamW-maximize", "AdamW", maximize=True, lr=1e-3)
    add("SGD", "SGD", lr=0.01)
    add("SGD-momentum", "SGD", lr=0.01, momentum=0.9)
    add("SGD-nesterov", "SGD", lr=0.01, momentum=0.9, nesterov=True)
    add("SGD-nesterov-foreach", "SGD", lr=0.01, momentum=0.9, nesterov=True, foreach=True)
    add("RAdam", "RAdam", lr=1e-3)
    add("RAdam-decoupled", "RAdam", lr=1e-3, decoupled_weight_decay=True)
    add("RAdam-decoupled-foreach", "RAdam", lr=1e-3, decoupled_weight_decay=True, foreach=True)
    add("NAdam", "NAdam", lr=1e-3)
    add("NAdam-decoupled", "NAdam", lr=1e-3, decoupled_weight_decay=True)
    add("NAdam-foreach", "NAdam", lr=1e-3, foreach=True)
    add("Adamax", "Adamax", lr=1e-3)
    add("Adamax-foreach", "Adamax", lr=1e-3, foreach=True)
    add("Adagrad", "Adagrad", lr=1e-2)
    add("Adagrad-foreach", "Adagrad", lr=1e-2, foreach=True)
    add("Adadelta", "Adadelta")
    add("Adadelta-foreach", "Adadelta", foreach=True)
    add("RMSprop", "RMSprop", lr=1e-3)
    add("RMSprop-centered", "RMSprop", lr=1e-3, centered=True, momentum=0.9)
    add("RMSprop-centered-foreach", "RMSprop", lr=1e-3, centered=True, momentum=0.9, foreach=True)
    add("Rprop", "Rprop", lr=1e-3)
    add("Rprop-foreach", "Rprop", lr=1e-3, foreach=True)
    add("ASGD", "ASGD", lr=1e-2, t0=2)
    add("ASGD-foreach", "ASGD", lr=1e-2, t0=2, foreach=True)
    add("LBFGS", "LBFGS", closure=True, lr=0.1, max_iter=3)
    add("LBFGS-strongwolfe", "LBFGS", closure=True, lr=0.1, max_iter=3, line_search_fn="strong_wolfe")
    add("SparseAdam-dense", "SparseAdam", lr=1e-3)   # dense grads: eager refuses -> SKIP
    if hasattr(O, "Muon"):
        add("Muon", "Muon", lr=1e-3)
        E["torch:Muon"]["only2d"] = True
    add("Adafactor", "Adafactor", lr=1e-2) if hasattr(O, "Adafactor") else None
    return E


TIMM_NAMES = None


def timm_entries():
    try:
        import timm.optim
        names = timm.optim.list_optimizers()
    except Exception as e:  # noqa: BLE001
        print(f"timm not importable ({e}); set PYTHONPATH=/work/pydeps/tv", file=sys.stderr)
        return {}
    E = {}
    for n in names:
        def make(params, model, n=n):
            import timm.optim
            return timm.optim.create_optimizer_v2(model, n, lr=1e-3, weight_decay=WD)
        E["timm:" + n] = {"lib": "timm", "make": make, "wd": "own", "mode": "auto"}
    return E


PO_SPECIAL = {
    "adalomo": "lomo", "lomo": "lomo",
    "alig": "closure_float", "bsam": "closure", "lbfgs": "closure",
    "adahessian": "create_graph", "sophiah": "create_graph",
}


def po_entries():
    try:
        from pytorch_optimizer import get_supported_optimizers, load_optimizer
    except Exception as e:  # noqa: BLE001
        print(f"pytorch_optimizer not importable ({e})", file=sys.stderr)
        return {}
    E = {}
    for n in get_supported_optimizers():
        try:
            cls = load_optimizer(n)
        except Exception:  # noqa: BLE001
            continue
        sig = inspect.signature(cls.__init__).parameters
        try:
            msrc = inspect.getsource(inspect.getmodule(cls))
        except Exception:  # noqa: BLE001
            msrc = ""
        first = list(sig)[1]

        def make(params, model, n=n, first=first, msrc=msrc):
            from pytorch_optimizer import load_optimizer
            import torch
            cls = load_optimizer(n)
            kw = {}
            if n == "bsam":
                kw["num_data"] = 100
            if n == "ranger21":
                kw["num_iterations"] = 100
            if first == "model":
                return cls(model, **kw)
            if first == "optimizer":       # magma: wraps a base optimizer
                return cls(torch.optim.AdamW(params, lr=1e-3))
            if "use_muon" in msrc:
                hidden = [p for p in model.parameters() if p.ndim >= 2 and p is not last_weight(model)]
                rest = [p for p in model.parameters() if not any(p is q for q in hidden)]
                params = [{"params": hidden, "use_muon": True}, {"params": rest, "use_muon": False}]
            if n == "galore":
                mats = [p for p in model.parameters() if p.ndim == 2]
                rest = [p for p in model.parameters() if not any(p is q for q in mats)]
                params = [{"params": rest}, {"params": mats, "rank": 2, "update_proj_gap": 3, "scale": 0.25,
                                             "projection_type": "std"}]
            return cls(params, **kw)
        E["po:" + n] = {"lib": "pytorch_optimizer", "make": make,
                        "wd": "weight_decay" in sig and first == "params" and "use_muon" not in msrc and n != "galore",
                        "mode": PO_SPECIAL.get(n, "auto"), "only2d": n == "spectralsphere"}
    return E


def sf_entries():
    E = {}
    for cls in ("AdamWScheduleFree", "SGDScheduleFree", "RAdamScheduleFree", "AdamWScheduleFreeClosure",
                "SGDScheduleFreeClosure", "RAdamScheduleFreeClosure", "AdamWScheduleFreeReference",
                "SGDScheduleFreeReference", "ScheduleFreeWrapper"):
        def make(params, model, cls=cls):
            import schedulefree
            import torch
            if cls == "ScheduleFreeWrapper":
                return schedulefree.ScheduleFreeWrapper(torch.optim.SGD(params, lr=1e-3, momentum=0), momentum=0.9)
            kw = {"lr": 1e-2 if "SGD" in cls else 1e-3}
            return getattr(schedulefree, cls)(params, **kw)
        E["sf:" + cls] = {"lib": "schedulefree", "make": make, "wd": cls != "ScheduleFreeWrapper",
                          "mode": "closure" if cls.endswith("Closure") else "plain", "train": True}
    return E


def to_entries():
    E = {}
    try:
        import torch_optimizer as to
    except Exception as e:  # noqa: BLE001
        print(f"torch_optimizer not importable ({e})", file=sys.stderr)
        return {}
    for n in [n for n in dir(to) if n[0].isupper() and n not in ("Dict", "List", "Type", "Optimizer")]:
        cls = getattr(to, n)
        if not isinstance(cls, type):
            continue
        sig = inspect.signature(cls.__init__).parameters

        def make(params, model, n=n):
            import torch
            import torch_optimizer as to
            if n == "Lookahead":
                return to.Lookahead(to.Yogi(params, lr=1e-3), k=3, alpha=0.5)
            return getattr(to, n)(params)
        E["to:" + n] = {"lib": "torch_optimizer", "make": make, "wd": "weight_decay" in sig or n == "Lookahead",
                        "mode": "create_graph" if n == "Adahessian" else "plain"}
    return E


def lion_entries():
    E = {}
    for tag, kw in (("Lion", {}), ("Lion-foreach", {"use_triton": False, "decoupled_weight_decay": True})):
        def make(params, model, kw=kw):
            import lion_pytorch
            return lion_pytorch.Lion(params, lr=1e-4, **kw)
        E["lion:" + tag] = {"lib": "lion_pytorch", "make": make, "wd": True, "mode": "plain"}
    return E


def registry() -> dict:
    E = {}
    for f in (torch_entries, timm_entries, po_entries, sf_entries, to_entries, lion_entries):
        try:
            E.update(f())
        except Exception as e:  # noqa: BLE001
            print(f"{f.__name__}: {e}", file=sys.stderr)
    return E


# ------------------------------------------------------------------------------------- models


def last_weight(model):
    return [p for p in model.parameters() if p.ndim >= 2][-1]


def build_model(config):
    import torch.nn as nn
    if config == "mlp":
        return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def make_batch(config, k):
    import torch
    g = torch.Generator().manual_seed(1000 + k)
    if config == "mlp":
        return torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
    return torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 4, (4,), generator=g)


def wd_groups(model):
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": WD}, {"params": no, "weight_decay": 0.0}]


def seed_all(n):
    import random
    import torch
    torch.manual_seed(n)
    random.seed(n)
    try:
        import numpy as np
        np.random.seed(n)
    except Exception:  # noqa: BLE001
        pass


def make_step(model, opt, mode):
    import torch.nn.functional as F
    if mode == "plain":
        def step(x, y):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            return loss.detach()
    elif mode == "create_graph":       # second-order (Hutchinson) optimizers: timm train.py's create_graph
        def step(x, y):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward(create_graph=True)
            opt.step()
            return loss.detach()
    elif mode == "closure":
        def step(x, y):
            def closure():
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                return loss
            loss = opt.step(closure)
            return loss.detach()
    elif mode == "closure_float":      # AliG's README: optimizer.step(lambda: float(loss))
        def step(x, y):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step(lambda: float(loss))
            return loss.detach()
    elif mode == "lomo":               # LOMO's trainer: (grad_norm if clipping) then fused_backward
        def step(x, y):
            loss = F.cross_entropy(model(x), y)
            if getattr(opt, "clip_grad_norm", None):
                opt.grad_norm(loss)
            opt.fused_backward(loss, lr=1e-3)
            return loss.detach()
    else:
        raise ValueError(mode)
    return step


def build(spec, config, mode):
    import torch
    seed_all(0)
    model = build_model(config).train()
    params = wd_groups(model) if spec["wd"] is True else list(model.parameters())
    if spec.get("only2d"):      # optimizers that take matrices only (torch Muon, SpectralSphere)
        params = [p for p in model.parameters() if p.ndim == 2]
    opt = spec["make"](params, model)
    if (spec.get("train") or "schedulefree" in type(opt).__name__.lower()) and callable(getattr(opt, "train", None)):
        opt.train()          # schedulefree's README: optimizer.train() before training steps
    return model, opt, make_step(model, opt, mode)


# ------------------------------------------------------------------------------------- snapshots


PNAME = {}   # id(param) -> name of the twin being snapshotted (dict keys that are ids: magma's _state)


def knorm(k):
    import torch
    if isinstance(k, torch.Tensor):
        return PNAME.get(id(k), "<tensor>")
    if isinstance(k, int) and k in PNAME:
        return "id:" + PNAME[k]
    if isinstance(k, str) and k.isdigit() and int(k) in PNAME:
        return "id:" + PNAME[int(k)]
    return str(k)


def flatten(prefix, v, out, depth=0):
    import torch
    if isinstance(v, torch.Tensor):
        out.append((prefix, v.detach().clone()))
    elif isinstance(v, (bool, int, float, complex, str, type(None))):
        out.append((prefix, v))
    elif isinstance(v, (list, tuple)) and depth < 4:
        out.append((prefix + ".<len>", (type(v).__name__, len(v))))
        for i, x in enumerate(v):
            flatten(f"{prefix}[{i}]", x, out, depth + 1)
    elif isinstance(v, dict) and depth < 4:
        out.append((prefix + ".<keys>", tuple(sorted(map(knorm, v.keys())))))
        for k, x in v.items():
            flatten(f"{prefix}.{knorm(k)}", x, out, depth + 1)
    else:
        out.append((prefix + ".<type>", type(v).__name__))


SKIP_ATTRS = {"state", "param_groups", "defaults", "_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
              "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
              "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks",
              "_zero_grad_profile_name", "model", "_opt_called"}


def snap_optimizer(tag, opt, pname, out, depth=0):
    import torch
    state_items = list(opt.state.items())
    order = {id(p): i for i, g in enumerate(opt.param_groups) for p in g["params"]}
    out.append((f"{tag}.state.<len>", len(state_items)))
    for j, (k, st) in enumerate(state_items):
        key = pname.get(id(k), f"#{j}") if isinstance(k, torch.Tensor) else repr(k)
        flatten(f"{tag}.state[{key}]", st, out)
    for i, g in enumerate(opt.param_groups):
        out.append((f"{tag}.param_groups[{i}].params", tuple(pname.get(id(p), "?") for p in g["params"])))
        for k, v in g.items():
            if k != "params":
                flatten(f"{tag}.param_groups[{i}].{k}", v, out)
    for k, v in sorted(vars(opt).items()):
        if k in SKIP_ATTRS or k.startswith("__"):
            continue
        if isinstance(v, torch.optim.Optimizer):
            if depth < 2 and v is not opt:
                snap_optimizer(f"{tag}.{k}", v, pname, out, depth + 1)
            continue
        if isinstance(v, (torch.Tensor, bool, int, float, str, type(None))) or (
                isinstance(v, (list, tuple, dict)) and len(v) < 64):
            if isinstance(v, (list, tuple)) and any(isinstance(x, dict) and "params" in x for x in v):
                continue          # param-group lists shared with an inner optimizer
            flatten(f"{tag}.{k}", v, out)


def snapshot(model, opt, loss):
    out = [("loss", loss.detach().clone() if hasattr(loss, "detach") else loss)]
    pname = {id(p): n for n, p in model.named_parameters()}
    PNAME.clear()
    PNAME.update(pname)
    for n, p in model.named_parameters():
        out.append((n, p.detach().clone()))
        out.append((n + ".grad", None if p.grad is None else p.grad.detach().clone()))
    for n, b in model.named_buffers():
        out.append(("buffer:" + n, b.detach().clone()))
    snap_optimizer("opt", opt, pname, out)
    return out


def same(a, b):
    import torch
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype or a.layout != b.layout:
            return False
        if a.layout != torch.strided:
            a, b = a.to_dense(), b.to_dense()
        if torch.equal(a, b):
            return True
        if a.is_floating_point() or a.is_complex():
            na, nb = torch.isnan(a), torch.isnan(b)
            return bool(torch.equal(na, nb)) and torch.equal(a[~na], b[~nb])
        return False
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def describe(a, b):
    import torch
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"eager {tuple(a.shape)} {a.dtype} vs stepgraph {tuple(b.shape)} {b.dtype}"
        d = (a.double() - b.double()).abs()
        return (f"max|diff|={d.max().item():.3e} ({int((d > 0).sum())}/{d.numel()} elems), "
                f"max|eager|={a.double().abs().max().item():.3e}")
    r = lambda v: f"{type(v).__name__} {v!r}"[:120]  # noqa: E731
    if isinstance(a, torch.Tensor):
        return f"eager tensor {a.dtype}{tuple(a.shape)} vs stepgraph {r(b)}"
    if isinstance(b, torch.Tensor):
        return f"eager {r(a)} vs stepgraph tensor {b.dtype}{tuple(b.shape)}"
    return f"eager {r(a)} vs stepgraph {r(b)}"


def compare(want, got):
    gd = dict(got)
    bad = []
    for n, a in want:
        if n not in gd:
            bad.append((n, "missing in stepgraph run"))
        elif not same(a, gd[n]):
            bad.append((n, describe(a, gd[n])))
    wn = {n for n, _ in want}
    bad += [(n, "only in stepgraph run") for n, _ in got if n not in wn]
    return bad


# ------------------------------------------------------------------------------------- the worker


def run_config(spec, config, rec):
    import logging
    import torch
    import stepgraph
    res = {"config": config}
    rec["configs"].append(res)
    # pick the step form: the spec's, or "auto": plain, else a closure when the eager step asks for one,
    # else create_graph for second-order optimizers (timm's is_second_order)
    modes = [spec["mode"]] if spec["mode"] != "auto" else ["plain", "create_graph", "closure"]
    mode, eager_err = None, None
    for m in modes:
        try:
            model, opt, step = build(spec, config, m)
            if m == "plain" and getattr(opt, "is_second_order", False):
                continue
            seed_all(100)
            x, y = make_batch(config, 0)
            step(x, y)
            mode = m
            break
        except Exception as e:  # noqa: BLE001
            if eager_err is None:
                eager_err = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
                res["eager_traceback"] = traceback.format_exc()[-3000:]
    if mode is None:
        res["verdict"] = "SKIP"
        res["detail"] = f"eager fails: {eager_err}"
        return res
    res["mode"] = mode
    m_e, o_e, s_e = build(spec, config, mode)
    m_c, o_c, s_c = build(spec, config, mode)
    f = stepgraph.compile(s_c)
    logs = []

    class Keep(logging.Handler):
        def emit(self, r):
            logs.append(f"{r.levelname} {r.name}: {r.getMessage()}"[:600])
    keep = Keep(level=logging.DEBUG)
    lg = logging.getLogger("stepgraph")
    lg.addHandler(keep)
    lg.setLevel(logging.INFO)
    err, first_diff, ndiff_calls = None, None, []
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for k in range(CALLS):
            x, y = make_batch(config, k)
            try:
                seed_all(100 + k)
                le = s_e(x, y)
            except Exception as e:  # noqa: BLE001
                res["verdict"] = "SKIP"
                res["detail"] = f"eager fails at call {k + 1}: {type(e).__name__}: {str(e).strip()[:200]}"
                return res
            try:
                seed_all(100 + k)
                lc = f(x, y)
            except BaseException as e:  # noqa: BLE001
                err = {"call": k + 1, "type": type(e).__name__, "capture_error": isinstance(e, stepgraph.CaptureError),
                       "stepgraph": isinstance(e, stepgraph.StepGraphError),
                       "message": str(e), "traceback": traceback.format_exc()[-6000:]}
                break
            bad = compare(snapshot(m_e, o_e, le), snapshot(m_c, o_c, lc))
            if bad:
                ndiff_calls.append({"call": k + 1, "branch": str(f.stats.last_branch), "n_bad": len(bad),
                                    "first": bad[:12]})
                if first_diff is None:
                    first_diff = ndiff_calls[-1]
    res["seconds"] = round(time.perf_counter() - t0, 2)
    lg.removeHandler(keep)
    res["warnings"] = [f"{x.category.__name__}: {str(x.message)[:400]} ({os.path.basename(x.filename)}:{x.lineno})"
                       for x in w][:20]
    res["logs"] = logs[:30]
    s = f.stats
    res["stats"] = {"eager_calls": s.eager_calls, "captures": s.captures, "replays": s.replays,
                    "failed_captures": s.failed_captures, "recaptures": [str(r) for r in s.recaptures],
                    "guard_misses": {str(k): v for k, v in s.guard_misses.items()},
                    "branches": [str(b) for b in s.branches.items()]}
    try:
        res["explain"] = str(f.explain())[:20000]
    except Exception as e:  # noqa: BLE001
        res["explain"] = f"explain() raised {type(e).__name__}: {e}"
    res["error"] = err
    res["diffs"] = ndiff_calls
    cr = f"{s.captures}/{s.replays}"
    res["cr"] = cr
    if first_diff is not None:
        n, d = first_diff["first"][0]
        res["verdict"] = "WRONG"
        res["detail"] = (f"call {first_diff['call']} ({first_diff['branch'].split('.')[-1]}): {n}: {d}"
                         f" [{first_diff['n_bad']} entries differ]")
        if err:
            res["detail"] += f"; then {err['type']}: {err['message'].strip().splitlines()[0][:200] if err['message'].strip() else ''}"
    elif err is not None:
        msg = err["message"].strip().splitlines()[0][:300] if err["message"].strip() else ""
        res["verdict"] = "CLEAR-ERROR" if err["capture_error"] else "CRASH"
        res["detail"] = f"call {err['call']}: {err['type']}: {msg}"
    elif s.captures >= 4 or (s.captures > 1 and s.replays < 4):
        res["verdict"] = "RECAPTURES"
        res["detail"] = " | ".join(str(r)[:250] for r in s.recaptures[:3])
    elif s.replays == 0:
        res["verdict"] = "EAGER"
        wl = [x for x in res["warnings"] + res["logs"] if "stepgraph" in x.lower() or "eager" in x.lower()]
        res["detail"] = (wl[0] if wl else f"failed_captures={s.failed_captures}")[:300]
    elif s.replays >= 5 or (s.captures > 1 and s.replays >= 4):
        res["verdict"] = "OK"
        res["detail"] = ("recaptures: " + " | ".join(str(r)[:200] for r in s.recaptures[:3])) if s.recaptures else ""
    else:
        res["verdict"] = "EAGER"
        res["detail"] = f"only {s.replays} replays"
    return res


RANK = ["CRASH", "WRONG", "CLEAR-ERROR", "RECAPTURES", "EAGER", "OK", "SKIP"]


def worker(name, out_path):
    import torch
    torch.set_num_threads(1)
    os.environ.setdefault("STEPGRAPH_ARTIFACT_CACHE", "0")
    rec = {"name": name, "configs": []}

    def dump():
        with open(out_path, "w") as fh:
            json.dump(rec, fh, indent=1, default=str)
    try:
        spec = registry_one(name)
        rec["lib"] = spec["lib"]
        for config in ("mlp", "conv"):
            try:
                run_config(spec, config, rec)
            except BaseException as e:  # noqa: BLE001
                rec["configs"][-1].update(verdict="CRASH", detail=f"harness: {type(e).__name__}: {e}"[:300],
                                          traceback=traceback.format_exc())
            dump()
    except BaseException as e:  # noqa: BLE001
        rec["error"] = f"{type(e).__name__}: {e}"
        rec["traceback"] = traceback.format_exc()
    dump()


def registry_one(name):
    lib = name.split(":")[0]
    f = {"torch": torch_entries, "timm": timm_entries, "po": po_entries, "sf": sf_entries, "to": to_entries,
         "lion": lion_entries}[lib]
    return f()[name]


# ------------------------------------------------------------------------------------- the parent


def summarize(rec):
    """One row per optimizer: the worst verdict over the configs, with the config it came from."""
    cfgs = [c for c in rec.get("configs", []) if "verdict" in c]
    if not cfgs:
        return "CRASH", "", rec.get("error", "no result")
    worst = min(cfgs, key=lambda c: RANK.index(c["verdict"]))
    cr = " ".join(f"{c['config']}:{c.get('cr', '-')}" for c in cfgs)
    others = [f"{c['config']}={c['verdict']}" for c in cfgs if c is not worst]
    detail = f"[{worst['config']}{', mode=' + worst['mode'] if worst.get('mode') not in (None, 'plain') else ''}] {worst.get('detail', '')}"
    if others:
        detail += f" ({', '.join(others)})"
    return worst["verdict"], cr, detail


def main():
    import argparse
    import concurrent.futures as cf
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="*")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--worker", nargs=2)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=TIMEOUT)
    ap.add_argument("--out", default="/work/sweep_optim/results")
    ap.add_argument("--rerun", action="store_true", help="rerun names that already have a result")
    a = ap.parse_args()
    if a.worker:
        worker(*a.worker)
        return
    names = list(registry())
    if a.names:
        names = [n for n in names if any(n == p or n.startswith(p) for p in a.names)]
    if a.list:
        print("\n".join(names))
        return
    os.makedirs(a.out, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")

    def one(name):
        path = os.path.join(a.out, name.replace(":", "__").replace("/", "_") + ".json")
        if os.path.exists(path) and not a.rerun:
            return name, path, 0.0
        t0 = time.time()
        try:
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", name, path], env=env,
                               timeout=a.timeout, capture_output=True, text=True)
            if p.returncode != 0 or not os.path.exists(path):
                rec = json.load(open(path)) if os.path.exists(path) else {"name": name, "configs": []}
                rec["error"] = f"worker exit {p.returncode}: {p.stderr[-1500:]}"
                if rec["configs"] and "verdict" not in rec["configs"][-1]:
                    rec["configs"][-1].update(verdict="CRASH", detail=f"process died (rc {p.returncode}): {p.stderr.strip()[-300:]}")
                json.dump(rec, open(path, "w"), indent=1, default=str)
        except subprocess.TimeoutExpired:
            rec = json.load(open(path)) if os.path.exists(path) else {"name": name, "configs": []}
            done = [c["config"] for c in rec["configs"] if "verdict" in c]
            nxt = [c for c in ("mlp", "conv") if c not in done][:1]
            rec["configs"] = [c for c in rec["configs"] if "verdict" in c]
            rec["configs"].append({"config": nxt[0] if nxt else "?", "verdict": "CRASH",
                                   "detail": f"timeout after {a.timeout}s"})
            json.dump(rec, open(path, "w"), indent=1, default=str)
        return name, path, time.time() - t0

    rows = []
    with cf.ThreadPoolExecutor(a.jobs) as ex:
        for name, path, dt in ex.map(one, names):
            rec = json.load(open(path))
            v, cr, d = summarize(rec)
            rows.append((name, rec.get("lib", name.split(":")[0]), v, cr, d))
            print(f"{name:40s} {v:12s} {cr:24s} {dt:6.1f}s {d[:150]}", flush=True)
    with open(os.path.join(a.out, "table.md"), "w") as fh:
        fh.write("| optimizer | library | verdict | captures/replays | detail |\n|---|---|---|---|---|\n")
        for r in rows:
            fh.write("| " + " | ".join(str(x).replace("|", "\\|").replace("\n", " ") for x in r) + " |\n")
    counts = {}
    for r in rows:
        counts[r[2]] = counts.get(r[2], 0) + 1
    print(counts)


if __name__ == "__main__":
    main()
