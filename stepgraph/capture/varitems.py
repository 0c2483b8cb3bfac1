"""Subscripts by a variable in a chain the step appends through: TRL's trainers log with
``self._metrics[mode][key].append(loss.item())`` (a dict of ``defaultdict(list)``).

The chain breaks at ``[mode]``, whose value is known only as the code runs, so ``self._metrics``
itself was the source, keyed by value: its lists grow at every call, so every call was a new
graph (7 captures, 0 replays in 8 calls; about 3 s each for a DPO step), then eager.

Here such a chain is expanded over the keys the container holds now: each
``self._metrics['train']['loss']`` is a source of its own, an appended list (a replay appends
what the capture appended, pyeffects.collect_appends), and the container is keyed by its keys
(a key added later, ``'eval'``, is a new graph, scanned anew). The key the code picks is computed
from values the graph is keyed by, so a replay picks the same one.

Only chains that end in an append or extend: another use (``cfg[name]`` read as a number) is
still the container, keyed by value."""
from __future__ import annotations

from .chains import _APPENDS, var_at
from .pyvalues import Source

_MAX_KEYS = 16


class KeysSource(Source):
    """A container keyed by its type and keys only (what it holds is keyed through the chains)."""

    def key_for(self, v):
        if isinstance(v, dict):
            return ("keys of", type(v), tuple(sorted(map(repr, v))))
        return super().key_for(v)


def expand_into(src: Source, args, out: dict, add) -> bool:
    """pyvalues' ``_add`` of such a chain: ``add`` each chain :func:`expand` gives, the container
    into ``out``; True when it was expanded (found again after the warm-up, which adds keys)."""
    more, keyed = expand(src, args)
    if keyed is not None:
        out.setdefault(key_of(keyed), keyed)
    for s in more:
        add(s)
    return keyed is not None


def key_of(s: Source) -> tuple:
    """Its key among pyvalues' sources (one per chain)."""
    return s.kind, id(s.root) if s.kind != "arg" else s.root, s.name, s.path


def expand(src: Source, args) -> tuple:
    """``(chains to add, the container keyed by its keys or None)`` for a chain with a subscript
    by a variable (``src.path`` holds ``("item", VAR)``)."""
    i = var_at(src.path)
    head = Source(src.kind, src.root, src.name, src.path[:i], src.where, from_step=src.from_step)
    container = head.read_or(args)
    if src.path[-1] not in _APPENDS or not isinstance(container, dict) \
            or len(container) > _MAX_KEYS or not all(isinstance(k, (str, int)) for k in container):
        return [head], None   # (as before: the container, keyed by value)
    out = [Source(src.kind, src.root, src.name, src.path[:i] + (("item", k),) + src.path[i + 1:], src.where,
                  from_step=src.from_step) for k in container]
    # (identity_only: another chain reading the container itself keys it by value instead)
    return out, KeysSource(src.kind, src.root, src.name, src.path[:i], src.where, from_step=src.from_step,
                           identity_only=True)
