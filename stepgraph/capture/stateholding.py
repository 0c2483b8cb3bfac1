"""How a ``StateRegistry`` holds what it found, and which hooks it watches (mixins of it).

``WeakHolding``: models and optimizers found through a call's arguments or the step's code are
held weakly (``weak_ids``); when the user drops one (or rebinds the global that held it), ``on_death``
lets the step free the graphs that hold its tensors. What ``state=`` names is held strongly,
behind the same call interface (``_Strong``).

``HookWatching``: hooks run inside the trace, so the registry keys which hooks exist on the
step's modules and parameters (``hook_key``), counting handles where it can (watch.py) and
reading the hook dicts only of what was hooked before stepgraph first saw it.
"""
from __future__ import annotations

import types

import weakref

from .fsdp import key as fsdp_key
from .sigkey import Strong as _Strong
from .watch import _HOOK_EPOCH, GLOBAL_HOOK_ATTRS, MODULE_HOOK_ATTRS, watch


def _held(pairs) -> list:
    return [(n, o) for n, h in pairs for o in (h(),) if o is not None]


class WeakHolding:
    """The registry's found objects, each behind a weak or strong holder."""

    def _hold(self, obj):
        if id(obj) in self.weak_ids:
            return weakref.ref(obj, self._died)
        return _Strong(obj)

    def _died(self, _ref) -> None:
        if self.on_death is not None:
            self.on_death()

    @property
    def modules(self) -> list:          # (name, Module)
        return _held(self._mods)

    @modules.setter
    def modules(self, value) -> None:
        self._mods = [(n, self._hold(m)) for n, m in value]

    @property
    def optimizers(self) -> list:       # (name, Optimizer)
        return _held(self._opts)

    @optimizers.setter
    def optimizers(self, value) -> None:
        self._opts = [(n, self._hold(o)) for n, o in value]

    @property
    def all_modules(self) -> list:      # every submodule, for train/eval guards
        return self._all_plain if self._all_plain is not None else [m for _, m in _held(self._all)]

    @property
    def ddp(self) -> list:              # DistributedDataParallel modules (source, module)
        return _held(self._ddp)

    @property
    def fsdp(self) -> list:             # fully_shard (FSDP2) modules (source, module)
        return _held(self._fsdp)

    def alive(self) -> bool:
        """False once a weakly held model or optimizer was dropped by its user."""
        return all(h() is not None for _, h in self._mods + self._opts)


class HookWatching:
    """Which hooks the registry's modules and parameters have (part of the signature)."""

    def user_hooks(self) -> list:
        from .chains import _user_code   # (torchmetrics' own update/compute wrappers: its state)
        """The hook functions on the step's modules and parameters (a DANN-style gradient hook
        scaling by an annealed global): scanned as the step's code is, for the values they read
        (Guards.find_python_values)."""
        out = []
        for m in self.all_modules:
            for name in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
                d = getattr(m, name, None)
                out += list(d.values()) if d else []
            # (and functions a module holds that its code calls: AveragedModel's ``avg_fn``, a user
            # lambda reading a global decay the loop ramps; baked, silently -- helper-93)
            out += [v for v in vars(m).values() if isinstance(v, types.FunctionType) and _user_code(v.__code__)]
        for _, p in self.params:
            for name in ("_backward_hooks", "_post_accumulate_grad_hooks"):
                d = getattr(p, name, None)
                out += list(d.values()) if d else []
        return out

    def _watch_hooks(self, subs) -> None:
        from torch.nn.modules import module as _m
        # Hooks registered on watched modules are counted by their handles (``_counting``); only
        # modules that already had hooks when first seen, and the global hook dicts, are read.
        for m in subs:
            if id(m) not in self._seen:
                self._seen.add(id(m))
                dicts = [getattr(m, a) for a in MODULE_HOOK_ATTRS if isinstance(getattr(m, a, None), dict)]
                if any(dicts):
                    self.pre_hooked_dicts += dicts
        self.module_hook_dicts = list(self.pre_hooked_dicts)
        self.module_hook_dicts += [getattr(_m, a) for a in GLOBAL_HOOK_ATTRS
                                   if isinstance(getattr(_m, a, None), dict)]
        watch(subs, [p for _, p in self.params])
        # Hooks registered before stepgraph watched these params have uncounted handles: read
        # those params' hook dicts directly (usually none, so this costs nothing).
        # Decided once per parameter (when first seen), so the key keeps its shape afterwards.
        for _, p in self.params:
            if id(p) not in self._seen and (p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None)):
                self.pre_hooked.append(p)
            self._seen.add(id(p))

    def hook_key(self) -> tuple:
        """Which hooks exist on the step's modules and parameters: hooks run inside the trace,
        so adding or removing one after capture must recapture, never be silently ignored."""
        return (tuple(map(len, self.module_hook_dicts)), _HOOK_EPOCH[0],
                tuple((m.require_backward_grad_sync, m.require_forward_param_sync) for _, m in self.ddp),
                fsdp_key(self.fsdp) if self._fsdp else (),
                tuple(len(p._backward_hooks or ()) + len(getattr(p, "_post_accumulate_grad_hooks", None) or ())
                      for p in self.pre_hooked))
