"""Optimizer adaptation, in one place: what stepgraph changes about the user's optimizers so that
a captured step reads and updates them as the eager step does. Every backend, the pipeline's
``adapt_optimizers`` stage and the tests' eager twins use this module.

- **Live hyper-parameters** (``LIVE_HYPERS``): the param-group entries a loop may assign between
  calls (nanoGPT's ``g["lr"] = get_lr(it)``). On the replay backend they are read from the group
  at each replay (capture/hostscalar.py traces them as ``HyperFloat``); which are live is decided
  by ``livefloats.LiveFloats``.
- **The capturable switch** (``make_capturable``): on CUDA, PyTorch's capturable form, step
  counters on the device and a float ``lr`` held as a 0-dim device tensor; the backends'
  ``prepare``.
- **Device-held hyper-parameters** (``reg.device_hypers``): that lr, or betas a schedule changes
  (``make_hyper_tensor``), filled in place from the floats a loop assigns (``absorb_floats``)
  before each call and as the step's own optimizer steps: no recapture, no host sync.
- **The trace-time patch** (``capturable_while_tracing``): Inductor traces the capturable path on
  the CPU too, with the user's flags put back after the trace.
- **Eager twins** (``same_form``): a test's or the corpus's eager reference takes the form
  stepgraph switched to, so the two run the same kernels.

Lifetime: the switch is made at the capturing call (not at a refused one) and stays for the
optimizer's life, as the user's own ``capturable=True`` would; ``reg.device_hypers`` (capture/
state.py) holds the device tensors while the registry knows the optimizer.
"""
from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field

import torch

# On the replay backend a float hyper-parameter (lr, betas) is read from its param_groups dict
# at replay time instead of being baked, from the first capture: a schedule never recaptures,
# and the arithmetic stays the eager Python-float arithmetic.
LIVE_HYPERS = ("lr", "betas", "momentum", "dampening", "weight_decay", "eps", "alpha", "rho", "lr_decay")

# capture/tracked.py's number proxies (TrackedInt, TrackedFloat), registered at its import: a
# number a traced step assigns to a group may be one of them.
NUMBER_PROXIES: set = set()


def _number(x) -> bool:
    # (a tracked number first: ``isinstance`` would ask it its class, a check the trace records)
    return type(x) in NUMBER_PROXIES or (isinstance(x, (float, int)) and not isinstance(x, bool))


def make_capturable(reg) -> list[str]:
    """Switch CUDA optimizers to their capturable form; return what changed (for explain).

    Step counters move to the device, ``capturable=True``, and a float ``lr`` becomes a
    0-dim device tensor that LR schedulers update in place (``fill_``), so a schedule never
    forces a recapture. The numerics are PyTorch's own capturable path with a float lr: Adam's
    and AdamW's foreach form divide by the lr as by a float (_divide_as_by_a_float).
    """
    changed = []
    for oname, opt in reg.optimizers:
        for gi, group in enumerate(opt.param_groups):
            params = [p for p in group["params"] if p.is_cuda]
            if not params:
                continue
            dev = params[0].device
            fused = bool(group.get("fused"))
            if "capturable" in group and not group["capturable"] and not fused:
                _remember(opt, gi, "capturable", group["capturable"])
                group["capturable"] = True
                changed.append(f"{oname}.param_groups[{gi}]['capturable'] = True")
            # Only these read a tensor lr on the device in every form; others would .item() it.
            # (torch's own classes: microsoft/LoRA's optimizer is also named AdamW, and its Python
            # step arithmetic takes the lr as a float)
            tensor_lr_ok = fused or type(opt) in (torch.optim.Adam, torch.optim.AdamW)
            if tensor_lr_ok and isinstance(group.get("lr"), float):
                _remember(opt, gi, "lr", None)
                # float64 for the foreach form, whose division by it is then written as PyTorch's
                # division by a float (_divide_as_by_a_float): bitwise with a float lr
                group["lr"] = torch.tensor(group["lr"], device=dev, dtype=torch.float32 if fused else torch.float64)
                # A loop that assigns a float lr every iteration (nanoGPT's get_lr idiom) then
                # fills this tensor in place (absorb_floats, below): no recapture.
                reg.device_hypers.append((group, "lr", group["lr"]))
                changed.append(f"{oname}.param_groups[{gi}]['lr'] -> 0-dim tensor on {dev}")
            if not (group.get("capturable") or fused):
                continue  # e.g. Adagrad: no capturable form; its counters stay host scalars
            if isinstance(group.get("lr"), torch.Tensor) and group["lr"].dtype == torch.float64 \
                    and not getattr(opt, "_stepgraph_lr_division", False):
                opt._stepgraph_lr_division = True
                opt.register_step_pre_hook(_divide_as_by_a_float)
                opt.register_step_post_hook(_divide_plainly)
            for p in params:
                st = opt.state.get(p) or {}
                for k, s in list(st.items()):
                    # step counters, and NAdam's mu_product: capturable forms want them on the device
                    if isinstance(s, torch.Tensor) and s.dim() == 0 and s.device != p.device:
                        st[k] = s.to(device=p.device, dtype=torch.float32 if k == "step" else s.dtype)
    return changed


def _remember(opt, gi: int, key: str, value) -> None:
    """The user's own value of a param-group entry stepgraph changes (``None`` for the lr and
    betas: saved as the floats their tensors hold), for ``state_dict``."""
    forms = opt.__dict__.setdefault("_stepgraph_user_form", {})
    forms.setdefault(gi, {}).setdefault(key, value)
    if not opt.__dict__.get("_stepgraph_saves_user_form"):
        opt._stepgraph_saves_user_form = True
        opt.register_state_dict_post_hook(saved_as_the_user_made_it)


def saved_as_the_user_made_it(opt, state_dict: dict) -> dict:
    """``opt.state_dict()`` (a checkpoint) as the user's own optimizer form saves it, not the
    graph-safe form stepgraph switched to: the lr and betas as floats, ``capturable`` and
    ``foreach`` as the user set them, and step counters where that form keeps them (the CPU).
    Without this a checkpoint written under stepgraph held CUDA tensors and ``capturable=True``:
    loaded (to the CPU, as Lightning loads) into the optimizer again, the lr was a CPU tensor a
    CUDA graph cannot read (Lightning's resumed fit fell back to the replay backend, H100), and a
    plain run resumed from it took the capturable path. Loaded back under stepgraph, the next
    call switches again (a recapture). The live optimizer is not changed."""
    def number(v):
        return float(v) if isinstance(v, torch.Tensor) else v
    forms = opt.__dict__.get("_stepgraph_user_form", {})
    for gi, saved in enumerate(state_dict["param_groups"]):
        for key, value in forms.get(gi, {}).items():
            if key in ("lr", "betas"):
                v = saved.get(key)
                saved[key] = tuple(number(x) for x in v) if isinstance(v, tuple) else number(v)
            else:
                saved[key] = value
        if forms.get(gi, {}).get("capturable") is False:
            for idx in saved["params"]:
                st = state_dict["state"].get(idx)
                if st:   # (a copy: the packed state holds the optimizer's own dicts)
                    state_dict["state"][idx] = {k: s.detach().to("cpu", torch.float32 if k == "step" else s.dtype)
                                                if isinstance(s, torch.Tensor) and s.dim() == 0 and s.device.type != "cpu"
                                                else s for k, s in st.items()}
    return state_dict


_FOREACH_DIV_ = torch._foreach_div_


def _divide_as_by_a_float(opt, args, kwargs) -> None:
    """While ``opt`` steps (eager or traced): its foreach division by a float64 lr it holds on
    the device is written as the multiply by the reciprocal that PyTorch's CUDA foreach division
    by a Python float does (``scalar_reciprocal``: ``1 / lr`` in double, then the kernel's
    float). Capturable Adam/AdamW's ``_foreach_div_(bias_correction1, lr)`` then rounds as with
    the float lr a loop assigns every iteration: bitwise on an H200, where a float32 lr tensor's
    true division moved 1e-9 a step from it (EDM's Adam: 1.6e-3 from eager after 8 steps)."""
    held = {id(g["lr"]) for g in opt.param_groups
            if isinstance(g["lr"], torch.Tensor) and g["lr"].dtype == torch.float64}
    if not held:
        return

    def div_(tensors, other):
        if isinstance(other, torch.Tensor) and id(other) in held and tensors:
            dt = torch.float64 if tensors[0].dtype == torch.float64 else torch.float32
            return torch._foreach_mul_(tensors, torch.reciprocal(other).to(dt))
        return _FOREACH_DIV_(tensors, other)
    torch._foreach_div_ = div_


def _divide_plainly(opt, args, kwargs) -> None:
    torch._foreach_div_ = _FOREACH_DIV_


def make_hyper_tensor(reg, oi: int, gi: int, key: str) -> str | None:
    """After a float ``betas[0]`` changed between calls (OneCycleLR cycles beta1): hold it as a
    0-dim device tensor that later float assignments fill in place (``absorb_floats``), so the
    schedule recaptures once, not every step. Only PyTorch's capturable Adam/AdamW read such a
    tensor inside a graph, and only in their single-tensor form (the foreach form reads tensor
    betas on the host, torch 2.11), which this switches to. (Their ``lr`` is a device tensor
    already: ``make_capturable``.) Returns what changed, or None (each new value recaptures)."""
    name, opt = reg.optimizers[oi]
    group = opt.param_groups[gi]
    if type(opt) not in (torch.optim.Adam, torch.optim.AdamW) or group.get("fused") or not group.get("capturable"):
        return None
    dev = next((p.device for p in group["params"] if p.is_cuda), None)
    if dev is None or key != "betas" or any(k == key and g is group for g, k, _ in reg.device_hypers):
        return None  # (already held: this change is something else, beta2)
    v = group[key]
    _remember(opt, gi, key, None)
    _remember(opt, gi, "foreach", group.get("foreach"))
    group[key] = (torch.tensor(float(v[0]), device=dev), *v[1:])
    group["foreach"] = False
    reg.device_hypers.append((group, key, group[key]))
    return (f"{name}.param_groups[{gi}]['{key}'] is now held on the device and filled in place "
            "(with foreach=False: PyTorch's foreach Adam reads tensor betas on the host)")


@contextlib.contextmanager
def capturable_while_tracing(reg):
    """While tracing for Inductor, run optimizers' capturable (non-fused) path.

    The default CPU path reads step counters with ``.item()`` (host scalars Inductor cannot
    compile) and the fused CPU kernels have no functional form; the capturable path keeps
    the counters as tensors. PyTorch only allows capturable on accelerators, so its device
    check is widened for the duration of the trace; the user's flags are restored after.
    """
    saved_groups, saved_fns = [], {}
    widen = False
    for _, opt in reg.optimizers:
        for group in opt.param_groups:
            on_cpu = all(p.device.type == "cpu" for p in group["params"])
            # Fused kernels have no functional/fake form for Inductor (CPU: "mutating a
            # non-functional tensor"; CUDA with a tensor lr: no fake impl): trace the
            # capturable foreach path instead.
            if "capturable" in group and (on_cpu or group.get("fused")):
                saved_groups.append((group, group["capturable"], group.get("fused")))
                group["capturable"] = True
                if group.get("fused"):
                    group["fused"] = False
                widen |= on_cpu
    if widen:
        # Every loaded module that imported PyTorch's device check (torch.optim.adadelta, rprop,
        # ... and third-party optimizers) holds its own reference: patch them all, not a list of
        # known optimizers (a missing name was Adadelta's AssertionError mid-trace).
        from torch.optim import optimizer as _opt_mod
        orig = _opt_mod._get_capturable_supported_devices

        def widened(*a, **k):
            return [*orig(*a, **k), "cpu"]
        for mod in list(sys.modules.values()):
            # (through __dict__: a lazy module's __getattr__ could import things)
            if getattr(mod, "__dict__", {}).get("_get_capturable_supported_devices") is orig:
                saved_fns[mod] = orig
                mod._get_capturable_supported_devices = widened
    try:
        yield
    finally:
        for group, cap, fused in saved_groups:
            group["capturable"] = cap
            if fused is not None:
                group["fused"] = fused
        for mod, f in saved_fns.items():
            setattr(mod, "_get_capturable_supported_devices", f)


def counter_branch_fix(reg) -> str:
    """The fix for an optimizer whose Python branches on its step counter (``if n_sma >= 5``):
    its capturable form where it has one; else (pytorch_optimizer's AdaBelief / Ranger have no
    such flag: the fix named one) stepping it outside the compiled function."""
    plain = [n for n, opt in reg.optimizers if "capturable" not in getattr(opt, "defaults", {})]
    if not plain:
        return "use a capturable optimizer (capturable=True)"
    return (f"{', '.join(plain)} has no capturable form: step it outside the compiled function (return the "
            "loss from it, then call optimizer.step() and optimizer.zero_grad() in the loop), or use a "
            "torch.optim optimizer")


def absorb_floats(reg, groups=None) -> None:
    """Numbers assigned in place of hyper-parameters held on the device (a scheduler's float
    betas, or ``g['lr'] = get_lr(it)``): fill the tensors the graphs read and put them back in
    the group (no host sync: a fill kernel). Before each call for the loop's assignments
    (runtime.py), and as an optimizer of ``groups`` steps for the step's own (in a trace, a fill
    the graph records: ``capture/effects.discover_stepping_optimizers``)."""
    for group, key, held in reg.device_hypers:
        v = group.get(key)
        if v is held or (groups is not None and all(g is not group for g in groups)):
            continue
        if isinstance(held, torch.Tensor):
            if _number(v):
                with torch.no_grad():
                    held.fill_(v)
                group[key] = held
            continue
        if not (isinstance(v, tuple) and len(v) == len(held)):
            continue
        if all(x is h or (isinstance(h, torch.Tensor) and _number(x))
               or (not isinstance(h, torch.Tensor) and x == h) for x, h in zip(v, held)):
            with torch.no_grad():
                for x, h in zip(v, held):
                    if isinstance(h, torch.Tensor) and x is not h:
                        h.fill_(x)
            group[key] = held


@dataclass
class Optimizers:
    """What ``make_capturable`` reads of a registry: named optimizers and the device-held values."""
    optimizers: list
    device_hypers: list = field(default_factory=list)


def same_form(*optimizers) -> list[str]:
    """Give eager twins the optimizer form stepgraph switches to at its capture on the GPU (the
    capturable path, the lr a device tensor), so the comparison is kernel for kernel."""
    return make_capturable(Optimizers([(f"opt{i}", o) for i, o in enumerate(optimizers)]))
