"""The Runner contract: what every backend's ``compile`` returns and what callers may ask of it.

A runner is called as ``run(inputs) -> outputs`` (flat graph inputs in, flat graph outputs out).
Its optional abilities are declared here with defaults, so the runtime, ``explain()`` and the
tests ask a runner directly instead of probing it with ``getattr(run, ..., None)``:

    stale()          a reason when state the runner holds by address has moved (then recapture)
    wait(timeout)    block until a background compile is done and switch to it
    describe()       one line for explain() (background compile progress, a fallback taken)
    compile_seconds  in-process backend compile time, counted in ``stats.compile_seconds``
    source           the generated Python of the replay backend
    segments         the segments (CUDA graphs, or Inductor-fused code) of a step with host reads
    graph            the recorded ``torch.cuda.CUDAGraph``

A misspelt ability would silently fall back to its default (``stael`` would turn the
moved-storage check off), so a runner's public names are checked: abilities, the names in its
class's ``extras``, and nothing else.
"""
from __future__ import annotations

ABILITIES = frozenset({"stale", "wait", "describe", "compile_seconds", "source", "segments", "graph"})


class Runner:
    """Base class of every backend's per-call runner; subclasses define ``__call__``."""

    compile_seconds: float = 0.0
    source: str | None = None
    segments: list | None = None
    graph: object = None
    extras: tuple = ()            # a subclass's own public attributes (state, counters, ...)
    _allowed: frozenset = ABILITIES

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        own = {n for n in vars(cls) if not n.startswith("_")} - {"extras"}
        allowed = cls._allowed | set(cls.extras)
        bad = sorted(own - allowed)
        if bad:
            raise TypeError(f"Runner subclass {cls.__name__} defines {bad}, which are not runner abilities "
                            f"({', '.join(sorted(ABILITIES))}); a misspelt ability would be ignored. Name "
                            "other public attributes in the class's `extras`, or make them private")
        cls._allowed = frozenset(allowed)

    def __setattr__(self, name: str, value) -> None:
        if not name.startswith("_") and name not in self._allowed:
            raise AttributeError(f"{type(self).__name__} has no ability {name!r} (abilities: "
                                 f"{', '.join(sorted(ABILITIES))}; other public names go in `extras`)")
        object.__setattr__(self, name, value)

    def __call__(self, inputs: list) -> list:
        raise NotImplementedError

    def stale(self) -> str | None:
        return None

    def wait(self, timeout: float | None = None) -> bool:
        return True  # nothing pending

    def describe(self) -> str | None:
        return None
