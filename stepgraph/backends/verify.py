"""A fused graph that proves itself: the first background-compiled Inductor step is checked
against the unfused graph on the same state, once, at the switch.

At the switching call (``FusedWhenReady``), with the tensors the step writes (``graph_writes``:
parameters, gradients, optimizer state, inputs written in place):

1. host copies of them are taken (before);
2. the unfused runner steps the user's tensors; its results are copied to the host (expected);
3. the user's tensors are restored from ``before`` and the fused runner steps them;
4. every written tensor and every output is compared with ``expected``.

Within tolerance the fused results stay (the step ran once, fused); beyond it, or if the fused
call raised, ``expected`` is copied back, the unfused outputs are returned and the unfused graph
stays: the user's state is then exactly the unfused graph's, i.e. eager's kernels. The copies
live in host memory, so the device's peak is the larger of the two runners' own, and they are
dropped before the call returns.

Steps that draw random numbers are checked for non-finite values only: Inductor generates them
with its own generator, so dropout masks differ from eager's by design, but a NaN or inf the
unfused graph does not produce is no mask (lora_finetune's fused step on the CPU: NaN loss and
parameters from its first call). With Inductor's ``fallback_random`` (``STEPGRAPH_INDUCTOR_PATCHES``)
it draws eager's: then they are checked in full, both runs starting from the same generator
state, and the generators end as after the runner whose results are kept.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import fx

from ..passes.analysis import graph_writes

# Relative difference (per tensor, ||fused - unfused|| / ||unfused||) accepted after one step,
# by the least precise float dtype the step computes in. Fusion reorders float sums and keeps
# intermediates in fp32 where eager rounds each op's output. Measured on the CPU after one step
# (GPT 1L d32, AdamW; scripts/switch_stall.py's models): MLP 1.8e-7 in fp32; GPT 5.3e-5 in fp32 and
# 2.8e-2 with bf16 autocast, both worst at the attention qkv bias, whose key part has a zero
# true gradient: rounding noise that Adam turns into lr-sized steps of either sign. The limits
# sit ~5-20x above that; the fusion bug seen so far (a dropped alpha in an SGD update,
# passes/alpha.py) was ~1 after one step. fp16 has 3 more mantissa bits than bf16; fp64 is
# fp32's case scaled by 2^-29.
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-9, torch.float16: 5e-2, torch.bfloat16: 0.15}


@dataclass
class ParityResult:
    """What the switch's check found (``stats.fused_parity``; shown by ``explain()``)."""
    max_rel: float = 0.0
    worst: str = ""                # the tensor with the largest difference
    diverged: str | None = None    # the first tensor beyond tolerance (None: the fused graph stays)
    tolerance: float = 0.0
    dtype: str = "float32"         # the lowest precision the step computes in
    compared: int = 0              # tensors compared
    seconds: float = 0.0           # the check's own cost on the switching call
    skipped: str | None = None     # why it was not checked
    error: str | None = None       # the fused call raised
    finite_only: str | None = None  # why only non-finite values were compared (random draws)
    other_rank: bool = False       # this rank passed, another's check failed (DDP, FSDP2): kept too

    def describe(self) -> str:
        if self.skipped:
            return f"not parity-checked: {self.skipped}"
        if self.finite_only:
            head = (f"checked against the unfused graph at the switch for non-finite values only "
                    f"({self.finite_only}) over {self.compared} tensors, check took {self.seconds:.2f}s")
        else:
            head = (f"parity-checked against the unfused graph at the switch: max relative difference "
                    f"{self.max_rel:.1e} ({self.worst}) over {self.compared} tensors, tolerance "
                    f"{self.tolerance:.0e} ({self.dtype}), check took {self.seconds:.2f}s")
        if self.error:
            return head + f"; the fused call failed ({self.error}): kept the unfused graph"
        if self.other_rank:
            return head + "; another rank's check failed: every rank kept the unfused graph"
        if self.diverged:
            return head + f"; DIVERGED first at {self.diverged}: kept the unfused graph"
        return head


@dataclass
class FusedCheck:
    """What to copy and compare at the switch: written tensors by position, with their names."""
    input_idx: list[int]                 # runner inputs the step writes
    state: list[torch.Tensor]            # state tensors the step writes (the user's own)
    names: list[str]                     # input names, then state names
    tolerance: float
    dtype: str
    out_names: list[str] = field(default_factory=list)
    rng_devices: list = field(default_factory=list)  # generators to rewind (fallback_random steps)
    finite_only: str | None = None       # random draws: compare only where values are non-finite
    collectives: bool = False            # the step communicates: every rank takes the same verdict

    @classmethod
    def plan(cls, gm: fx.GraphModule, example_inputs, random_ops: int, name_of=None,
             input_names=None, n_user_outputs=None, eager_random=False) -> "FusedCheck":
        writes = graph_writes(gm)
        state = list({id(t): t for t in (getattr(gm, a) for a in writes.attrs)}.values())
        names_in = list(input_names or [])
        names = [names_in[i] if i < len(names_in) else f"input #{i}" for i in writes.placeholders]
        names += [(name_of(t) if name_of else None) or f"<state #{k} {tuple(t.shape)}>"
                  for k, t in enumerate(state)]
        low = _lowest_precision(gm, list(example_inputs) + state)
        finite = (f"the step draws random numbers ({random_ops} random ops, e.g. dropout), which "
                  "Inductor generates with its own generator" if random_ops and not eager_random else None)
        outs = [f"output #{i}" if n_user_outputs is None or i < n_user_outputs
                else f"output #{i} (rebound state)" for i in range(_n_outputs(gm))]
        devices = {t.device for t in list(example_inputs) + state if isinstance(t, torch.Tensor)}
        rng = [torch.device("cpu")] + sorted((d for d in devices if d.type == "cuda"), key=str) if random_ops else []
        collectives = any(n.op == "call_function" and "c10d" in str(n.target) for n in gm.graph.nodes)
        return cls(list(writes.placeholders), state, names, TOLERANCE[low], str(low).removeprefix("torch."),
                   outs, rng, finite, collectives)

    def run(self, inputs, unfused, fused) -> tuple[list, ParityResult]:
        """This call's outputs (fused, or unfused if they differ) and what the check found."""
        t0 = time.perf_counter()
        live = [inputs[i] for i in self.input_idx] + self.state
        before = [_host(t) for t in live]
        rng_before = _rng_state(self.rng_devices)
        out_u = unfused(inputs)
        rng_after = _rng_state(self.rng_devices)
        _set_rng_state(rng_before)
        expected = [_host(t) for t in live]
        expected_out = [_host(o) if isinstance(o, torch.Tensor) else o for o in out_u]
        _restore(live, before)
        del before
        res = ParityResult(tolerance=self.tolerance, dtype=self.dtype, finite_only=self.finite_only)
        judge = _nonfinite if self.finite_only else _rel
        try:
            out_f = fused(inputs)
        except Exception as e:  # noqa: BLE001 - a fused call that fails leaves the unfused graph
            res.error = f"{type(e).__name__}: {str(e).strip()[:300]}"
            out_f = None
        if out_f is not None:
            pairs = list(zip(self.names, live, expected))
            pairs += [(n, f, u) for n, f, u in zip(self.out_names, out_f, expected_out)
                      if isinstance(u, torch.Tensor)]
            for name, got, want in pairs:
                rel = judge(got, want)
                res.compared += 1
                if rel > res.max_rel or not res.worst:
                    res.max_rel, res.worst = rel, name
                if rel > self.tolerance and res.diverged is None:
                    res.diverged = name
            if len(out_f) != len(expected_out):
                res.diverged = res.diverged or "the number of outputs"
        passed = not (res.error or res.diverged)
        if self.collectives and not _all_ranks_passed(passed, live) and passed:
            res.diverged, res.other_rank = "another rank's fused step", True
        if res.error or res.diverged:
            _restore(live, expected)
            _set_rng_state(rng_after)
            out = out_u
        else:
            out = out_f
        res.seconds = time.perf_counter() - t0
        return out, res


def _all_ranks_passed(passed: bool, live) -> bool:
    """Whether every rank's fused step passed its check (a DDP or FSDP2 step; each rank checks at
    the same call, and every rank calls this). Ranks that ran different graphs would still pair
    their collectives (both graphs issue the same ones, in order), but their updates would round
    differently: one verdict for all keeps the ranks' replicas equal."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return passed
    device = next((t.device for t in live if t.device.type == "cuda"), torch.device("cpu"))
    flag = torch.full((), float(passed), device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def random_draws(gm: fx.GraphModule) -> int:
    """Ops that draw random numbers whose values matter: seeded ops, less those with a dropout
    probability of 0 (attention kernels carry the tag for their dropout_p even when it is 0)."""
    n_draws = 0
    for n in gm.graph.nodes:
        if not (isinstance(n.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in n.target.tags):
            continue
        probs = [n.args[i] if i < len(n.args) else n.kwargs.get(a.name, a.default_value)
                 for i, a in enumerate(n.target._schema.arguments) if a.name in ("p", "dropout_p")]
        n_draws += not (probs and all(isinstance(v, (int, float)) and v == 0 for v in probs))
    return n_draws


def _rng_state(devices) -> list:
    return [(d, torch.get_rng_state() if d.type == "cpu" else torch.cuda.get_rng_state(d)) for d in devices]


def _set_rng_state(states) -> None:
    for d, st in states:
        if d.type == "cpu":
            torch.set_rng_state(st)
        else:
            torch.cuda.set_rng_state(st, d)


def _host(t: torch.Tensor) -> torch.Tensor:
    # Host memory, not the device's: the check must not raise the device's peak.
    return t.detach().to("cpu", copy=True)


def _restore(live, copies) -> None:
    with torch.no_grad():
        for t, c in zip(live, copies):
            t.copy_(c)


def _nonfinite(got: torch.Tensor, want: torch.Tensor) -> float:
    """inf where ``got`` holds a NaN or inf that ``want`` does not, else 0: a step's random
    draws differ between the runs, its finiteness does not."""
    a = got.detach()
    if a.shape != want.shape or not (a.is_floating_point() or a.is_complex()):
        return 0.0
    return float("inf") if bool((~torch.isfinite(a) & torch.isfinite(want.to(a.device))).any()) else 0.0


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / max(||got||, ||want||), per tensor: the norm the parity tests use
    (tests/parity.py). Not per element: an element whose true value is ~0 (the zero gradient of
    an attention key bias is rounding noise, which Adam turns into lr-sized steps of either
    sign) would count as 100% off in any implementation."""
    a = got.detach()
    want = want.to(a.device)  # one tensor at a time on the device: no D2H of the fused results
    if a.shape != want.shape:
        return float("inf")
    if not (a.is_floating_point() or a.is_complex()):
        return 0.0 if torch.equal(a, want) else float("inf")
    a, b = a.double(), want.double()
    nan_a, nan_b = a.isnan(), b.isnan()
    if not torch.equal(nan_a, nan_b):
        return float("inf")
    a, b = a.masked_fill(nan_a, 0), b.masked_fill(nan_b, 0)
    if torch.equal(a, b):
        return 0.0
    scale = max(a.norm().item(), b.norm().item())
    return (a - b).norm().item() / scale if scale > 0 else 0.0


_PRECISION = [torch.bfloat16, torch.float16, torch.float32, torch.float64]


def _lowest_precision(gm: fx.GraphModule, tensors) -> torch.dtype:
    """The least precise float dtype the step computes in: autocast's casts are dtype arguments
    of the graph's ops; a model held in bf16 shows in its tensors."""
    seen = {t.dtype for t in tensors if isinstance(t, torch.Tensor)}
    for n in gm.graph.nodes:
        for a in list(n.args) + list(n.kwargs.values()):
            if isinstance(a, torch.dtype):
                seen.add(a)
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            seen.add(val.dtype)
    for dt in _PRECISION:
        if dt in seen:
            return dt
    return torch.float32


def _n_outputs(gm: fx.GraphModule) -> int:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    args = out.args[0]
    return len(args) if isinstance(args, (list, tuple)) else 1
