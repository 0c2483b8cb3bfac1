"""Graph nodes that capture/ records and passes/ and backends/ recognise: one small module all
three import, so passes/ and backends/ need nothing from capture/ (which runs only while
tracing). Each is a plain Python function that a graph calls as a ``call_function`` node."""
from __future__ import annotations

from .errors import GuardMiss

# Host-side RNG state calls (activation checkpointing's preserve_rng_state, fork_rng): not aten
# ops, so a plain trace drops them and a recompute would draw a different dropout mask.
# They are recorded as Python call nodes and replayed in order (replay backend only).
# Filled while tracing (capture/effects.py wraps torch's functions): wrapper -> original.
RNG_STATE_FUNCS: dict = {}


def zero_grad_marker():
    """Graph marker: the step's ``optimizer.zero_grad()`` ran here (capture/effects.py
    ``record_grad_bindings``); the replay backend binds fresh grads only before it."""


RNG_STATE_FUNCS[zero_grad_marker] = zero_grad_marker  # kept by the cleanup pass like RNG calls


def host_guard(actual, expected, site: str, what: str, restore=(), rng=None):
    """Graph node: continue when the host read equals the traced value, else undo and raise
    (recorded by capture/hostreads.py, placed by passes/guards.py, cut at by backends/segments.py)."""
    if actual == expected or (actual != actual and expected != expected):  # nan == nan here
        return None
    for dst, saved in restore:
        dst.copy_(saved)
    for gen, state in rng or ():
        gen.set_state(state)
    raise GuardMiss(site, what, expected, actual)


host_guard.stepgraph_impure = True  # kept by dead-code elimination although nothing uses it
