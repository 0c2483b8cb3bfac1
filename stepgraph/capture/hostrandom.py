"""Random numbers the step draws on the host with Python's ``random`` or ``numpy.random``.

Such a draw is no aten op: the trace sees only what it produced (a replay-buffer batch built
from ``np.random.randint`` indices, ``random.sample(memory, n)`` transitions, an ``if
random.random() < eps`` branch) and a replay runs no Python, so it would reuse this call's draw
at every step: silently wrong (sfujim/TD3's ``policy.train`` samples its batch this way). The
draw is recorded as a problem and the capture refused, naming the user's line; the call itself
ran for real, so state is what eager leaves.
"""
from __future__ import annotations

import contextlib
import random
import traceback

from ..errors import library_frame, user_frame
from .effects import Problem

_PY = ("random", "randint", "randrange", "choice", "choices", "sample", "shuffle", "uniform", "gauss",
       "normalvariate", "lognormvariate", "expovariate", "betavariate", "gammavariate", "triangular",
       "vonmisesvariate", "paretovariate", "weibullvariate", "getrandbits", "randbytes")
_NP = ("rand", "randn", "randint", "random", "random_sample", "ranf", "sample", "choice", "permutation",
       "shuffle", "normal", "uniform", "standard_normal", "binomial", "poisson", "beta", "gamma",
       "exponential", "multinomial", "dirichlet", "laplace", "logistic", "lognormal", "geometric",
       "integers", "random_integers", "bytes")


def _modules():
    out = [("random", random, _PY)]
    try:
        import numpy.random as npr
        out.append(("numpy.random", npr, _NP))
    except ImportError:
        pass
    return out


@contextlib.contextmanager
def host_random_watch(problems: list):
    """While the step is traced: each module-level draw of ``random`` / ``numpy.random`` adds a
    problem (once per call site). Draws made from inside another draw are not counted twice."""
    saved, inside = [], [False]

    def wrap(label, name, orig):
        def draw(*a, **k):
            if inside[0]:
                return orig(*a, **k)
            inside[0] = True
            try:
                stack = traceback.extract_stack()
                where = user_frame(stack)
                if all(p.where != where or "host random" not in p.op for p in problems):
                    problems.append(Problem(
                        f"the step draws host random numbers with {label}.{name}(): a replay runs no "
                        "Python code, so it would reuse this call's draw at every step (the same batch, "
                        "the same branch)", where,
                        "draw them in the loop outside the step and pass the result (the batch, the "
                        "indices, the decision) as arguments; or draw with torch inside the step "
                        "(torch.randint / torch.rand / torch.randperm), which the graph replays",
                        library_frame(stack), plain=True))
                return orig(*a, **k)
            finally:
                inside[0] = False
        draw.__wrapped__ = orig
        return draw
    for label, mod, names in _modules():
        for name in names:
            orig = getattr(mod, name, None)
            if orig is None or not callable(orig):
                continue
            saved.append((mod, name, orig))
            setattr(mod, name, wrap(label, name, orig))
    try:
        yield
    finally:
        for mod, name, orig in reversed(saved):
            setattr(mod, name, orig)
