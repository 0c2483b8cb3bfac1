"""The optimizer sections of a call's signature (guards.py): each param group's entries, and the
identities of ``opt.state``'s per-parameter dicts."""
from __future__ import annotations

import torch

from .groupwrites import user_tensor
from .state import group_counter


def hyper_value(v):
    if isinstance(v, torch.Tensor):
        # A tensor hyper-parameter (lr=torch.tensor(...)) is read by the graph at replay time:
        # only its identity and metadata are baked.
        return ("tensor", id(v), v.dtype, v.device, tuple(v.shape))
    if isinstance(v, list):
        return tuple(hyper_value(x) for x in v)
    if isinstance(v, dict):   # (SCION's ``norm_kwargs={}`` in each group)
        return ("dict", tuple((k, hyper_value(x)) for k, x in v.items()))
    if group_counter(v):
        return ("number",)   # (a counter: tracked, checked where a graph used it, state.number_slots)
    return v


def state_ids(opt, numeric=frozenset()) -> tuple:
    """The per-parameter dicts' identities (and a global entry's: MADGRAD's ``state['k']``; a
    number there, SPAM's ``state['total_step']``, by its type: a counter, state.number_slots).
    ``numeric``: ids of the optimizers holding such a number (StateRegistry.numeric_state, read
    at each capture); the others take the fast path (9.6 against 21.6 us for 150 entries)."""
    if id(opt) not in numeric:
        return tuple(map(id, opt.state.values()))
    return tuple(type(v) if type(v) is int or type(v) is float else id(v) for v in opt.state.values())


def groups_quick(self) -> tuple:
    """The quick key's part (guards.Guards.quick_key): the group values themselves, compared by ``==``."""
    # (a param-group int is a counter, as in the full signature: its type only)
    if not self.live:
        return tuple(tuple(int if group_counter(v) else v for v in g.values())
                     for _, opt in self.reg.optimizers for g in opt.param_groups)
    return tuple(tuple(live_key(self, (oi, gi, k), v) if (oi, gi, k) in self.live else int if group_counter(v) else v
                       for k, v in g.items())
                 for oi, (_, opt) in enumerate(self.reg.optimizers) for gi, g in enumerate(opt.param_groups))


def live_key(self, h, v):
    """A live hyper-parameter's part of a signature: what the graphs decided from it -- unless a
    tensor of the user's own is there now (a float lr replaced by ``torch.tensor(lr)`` between
    calls: replayed as the float it was, the graph raised half-way through the update)."""
    if user_tensor(self.reg, v):
        return hyper_value(v)
    return self._marker(h, v)
