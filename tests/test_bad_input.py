"""Bad and unusual input: the same error as eager, or a result equal to eager — never a silently
wrong one — and the step keeps working afterwards.

Each test drives a stepgraph step next to an eager twin (deepcopy of the model, same optimizer);
the twin's arguments are built by the same function (same values, same strides and offsets,
and views of the twin's own parameters where the input is a parameter view). After every call:
same exception type and message, or bitwise-equal result, parameters, ``.grad``s, optimizer
state, input values (in-place writes) and input ``.grad``s.

Most tests run one sequence that puts the bad input at each stage of the state machine:
call 1 (warm-up), call 3 (a capture attempt) and call 6 (after a graph exists).
"""
import copy
import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings, strategies as st
from hypothesis.configuration import set_hypothesis_home_dir
from torch import nn

import stepgraph

# Hypothesis keeps a cache even with database=None: keep it under tests/ (it git-ignores itself).
set_hypothesis_home_dir(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".hypothesis"))


# ---- harness -----------------------------------------------------------------------------
pytestmark = pytest.mark.usefixtures("one_thread")  # (conftest.py)


def make_model(dtype=torch.float32, out=4):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, out)).to(dtype)


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


from parity import ce_step as train_step  # noqa: E402  (shared harness)


def gen(k):
    return torch.Generator().manual_seed(9000 + k)


def batch(k, n=8, dtype=torch.float32):
    g = gen(k)
    return torch.randn(n, 8, generator=g).to(dtype), torch.randint(0, 4, (n,), generator=g)


def same(a, b) -> bool:
    """Bitwise equal, NaNs in the same places counting as equal."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return a == b
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
    return torch.equal(a, b)


def _call(f, args, kwargs):
    try:
        return f(*args, **kwargs), None
    except Exception as e:
        return None, e


class Pair:
    def __init__(self, factory=train_step, model_fn=make_model, opt_fn=sgd, **compile_kw):
        self.model = model_fn()
        self.twin = copy.deepcopy(self.model)
        self.opt, self.topt = opt_fn(self.model.parameters()), opt_fn(self.twin.parameters())
        self.step = stepgraph.compile(factory(self.model, self.opt), **compile_kw)
        self.eager = factory(self.twin, self.topt)
        self.calls = 0

    def counts(self):
        s = self.step.stats
        return s.eager_calls, s.captures, s.replays

    def __call__(self, make, **kwargs):
        """``make(model) -> args``: called once per side (with that side's model)."""
        self.calls += 1
        a, b = make(self.model), make(self.twin)
        got, gexc = _call(self.step, a, kwargs)
        want, wexc = _call(self.eager, b, kwargs)
        where = f"call {self.calls} (counts {self.counts()}, recaptures {self.step.stats.recaptures})"
        if wexc is None:
            assert gexc is None, f"{where}: stepgraph raised {type(gexc).__name__}: {gexc}; eager returned"
            assert same(got, want), f"{where}: result {got} != eager {want}"
        else:
            assert gexc is not None, f"{where}: eager raised {type(wexc).__name__}: {wexc}; stepgraph returned {got}"
            assert type(gexc) is type(wexc) and str(gexc) == str(wexc), (
                f"{where}: stepgraph raised {type(gexc).__name__}: {gexc}\n eager raised {type(wexc).__name__}: {wexc}")
        for i, (u, v) in enumerate(zip(a, b)):
            if isinstance(u, torch.Tensor):
                assert same(u, v), f"{where}: input {i} after the call differs from eager's"
                if u.requires_grad and u.is_leaf:
                    assert (u.grad is None) == (v.grad is None), f"{where}: input {i} .grad presence differs"
                    if u.grad is not None:
                        assert same(u.grad, v.grad), f"{where}: input {i} .grad differs from eager"
        self.check_state(where)
        return gexc

    def check_state(self, where=""):
        for (n, p), q in zip(self.model.named_parameters(), self.twin.parameters()):
            assert same(p, q), f"{where}: parameter {n} differs from eager"
            assert (p.grad is None) == (q.grad is None), f"{where}: {n}.grad presence differs"
            if p.grad is not None:
                assert same(p.grad, q.grad), f"{where}: {n}.grad differs"
            sa, sb = self.opt.state.get(p, {}), self.topt.state.get(q, {})
            assert sa.keys() == sb.keys(), f"{where}: optimizer state keys of {n} differ"
            for k in sa:
                assert same(sa[k], sb[k]), f"{where}: optimizer state {n}[{k!r}] differs"


def good(k, **kw):
    return lambda m: batch(k, **kw)


BAD_AT = (1, 3, 6)  # warm-up, a capture attempt, after a graph exists


def run_sequence(p, bad, n_calls=9, check_error=None, failed_captures=2):
    """Calls 1..n_calls, the bad input at BAD_AT: each must raise exactly what eager raises;
    the good calls around them keep parity, and in the end the step replays.

    A bad input whose guard signature differs from the good calls' makes calls 3 and 6 capture
    attempts (``failed_captures=2``); one with the good signature fails inside a replay at call 6."""
    for c in range(1, n_calls + 1):
        if c in BAD_AT:
            exc = p(bad)
            assert exc is not None, f"call {c}: the bad input did not raise"
            if check_error:
                check_error(exc)
        else:
            assert p(good(c)) is None
    s = p.step.stats
    assert s.captures >= 1 and s.replays >= 2, s
    assert s.failed_captures == failed_captures, s
    return s


# ---- argument count and non-tensor arguments ---------------------------------------------
@pytest.mark.parametrize("args", ["missing_y", "extra_arg", "unknown_kwarg"])
def test_wrong_argument_count_same_type_error(args):
    p = Pair()

    def bad(m):
        x, y = batch(99)
        return {"missing_y": (x,), "extra_arg": (x, y, y), "unknown_kwarg": (x, y)}[args]
    if args == "unknown_kwarg":
        # kwargs are passed through Pair: wrap in a step call with an unexpected keyword
        def bad_call(m):
            return batch(99)
        for c in range(1, 10):
            if c in BAD_AT:
                exc = p(bad_call, z=1)
                assert isinstance(exc, TypeError) and "unexpected keyword argument 'z'" in str(exc), exc
            else:
                p(good(c))
        assert p.step.stats.replays >= 2, p.step.stats
        return
    run_sequence(p, bad, check_error=lambda e: (isinstance(e, TypeError) and "positional argument" in str(e))
                 or pytest.fail(f"not the arity TypeError: {e!r}"))


@pytest.mark.parametrize("kind", ["str", "None", "list", "numpy", "float"])
def test_non_tensor_input_same_type_error(kind):
    def bad(m):
        x, y = batch(98)
        return {"str": "abc", "None": None, "list": x.tolist(), "numpy": x.numpy(), "float": 1.5}[kind], y
    run_sequence(Pair(), bad, check_error=lambda e: isinstance(e, TypeError) or pytest.fail(repr(e)))


# ---- dtypes ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16, torch.int64])
def test_wrong_dtype_input_same_error_as_eager(dtype):
    """float32 model, input in another dtype: eager raises (matmul dtype mismatch); so must the
    step at every stage — never a replay of the float32 graph on reinterpreted data."""
    def bad(m):
        x, y = batch(97)
        return (x * 3).to(dtype), y
    run_sequence(Pair(), bad, check_error=lambda e: isinstance(e, RuntimeError) or pytest.fail(repr(e)))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.int32])
def test_wrong_dtype_input_to_casting_step_is_correct(dtype):
    """A step that casts its input (``model(x.float())``) gives eager's result for any dtype."""
    def factory(model, opt):
        def step(x, y):
            loss = F.cross_entropy(model(x.float()), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        return step
    p = Pair(factory)
    for c in range(1, 10):
        p(good(c) if c not in BAD_AT else (lambda m, c=c: ((batch(c)[0] * 3).to(dtype), batch(c)[1])))
    # call 1 (other dtype) is the warm-up; call 2 captures float32, call 3 the other dtype,
    # which call 6 replays
    assert p.step.stats.captures == 2 and p.step.stats.replays == 6, p.step.stats
    assert "float32 -> " in p.step.stats.recaptures[0], p.step.stats.recaptures


@pytest.mark.parametrize("labels", ["int32", "float", "out_of_range", "2d"])
def test_bad_labels_same_error_as_eager(labels):
    def bad(m):
        x, y = batch(96)
        if labels == "int32":
            return x, y.int()
        if labels == "float":
            return x, y.float()
        if labels == "out_of_range":
            return x, y + 4
        return x, y[:, None].expand(8, 2)
    # out-of-range labels have the good calls' signature: call 6 fails inside the replayed graph
    run_sequence(Pair(), bad, failed_captures=1 if labels == "out_of_range" else 2)


def test_integer_token_ids_int64_and_int32():
    """Embedding ids may be int64 or int32: both give eager's result (a dtype change recaptures)."""
    class Emb(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.head = nn.Linear(8, 4)

        def forward(self, ids):
            return self.head(self.emb(ids).mean(1))

    def make():
        torch.manual_seed(0)
        return Emb()
    p = Pair(model_fn=make)

    def ids(k, dtype):
        def make_args(m):
            g = gen(k)
            return (torch.randint(0, 10, (8, 5), generator=g).to(dtype),
                    torch.randint(0, 4, (8,), generator=g))
        return make_args
    for k in range(8):
        p(ids(k, torch.int32 if k in (3, 4, 6) else torch.int64))
    assert p.step.stats.captures == 2 and p.step.stats.replays == 5, p.step.stats
    assert "int64 -> int32" in p.step.stats.recaptures[0]
    # an id out of the embedding's range: the same IndexError as eager, at replay time
    exc = p(lambda m: (torch.full((8, 5), 10), batch(0)[1]))
    assert isinstance(exc, IndexError), exc
    p(ids(20, torch.int64))


# ---- layouts: non-contiguous, strided, offset, expanded -----------------------------------
LAYOUTS = {
    "contiguous": lambda g, n: torch.randn(n, 8, generator=g),
    "transposed": lambda g, n: torch.randn(8, n, generator=g).t(),
    "row_stride_2": lambda g, n: torch.randn(2 * n, 8, generator=g)[::2],
    "offset_3": lambda g, n: torch.randn(n + 3, 8, generator=g)[3:],
    "column_slice": lambda g, n: torch.randn(n, 16, generator=g)[:, 4:12],
    "expanded": lambda g, n: torch.randn(1, 8, generator=g).expand(n, 8),
}


def layout_batch(k, layout, n=8, dtype=torch.float32, label_layout="contiguous"):
    def make(m):
        g = gen(k)
        x = LAYOUTS[layout](g, n).to(dtype)
        y = torch.randint(0, 4, (2 * n,), generator=g)
        y = y[::2] if label_layout == "strided" else y[:n]
        return x, y
    return make


@pytest.mark.parametrize("layout", [k for k in LAYOUTS if k != "contiguous"])
def test_non_contiguous_inputs_match_eager(layout):
    p = Pair()
    for k in range(3):
        p(layout_batch(k, "contiguous"))
    for k in range(3, 6):  # the new layout: recapture (strides guard) or the same graph, but correct
        p(layout_batch(k, layout, label_layout="strided"))
    for k in range(6, 8):
        p(layout_batch(k, "contiguous"))
    assert p.step.stats.replays >= 4, p.step.stats


def test_storage_offset_change_replays_the_same_graph_correctly():
    """Same shape and strides, another storage offset: no guard sees it; the replay must still
    read the right elements."""
    p = Pair()

    def at(k, off):
        def make(m):
            g = gen(k)
            big = torch.randn(8 + 5, 8, generator=g)
            return big[off:off + 8], torch.randint(0, 4, (8,), generator=g)
        return make
    for k, off in enumerate([0, 0, 0, 5, 1, 3, 2]):
        p(at(k, off))
    assert p.counts() == (1, 1, 5), p.step.stats


# ---- aliasing ----------------------------------------------------------------------------
def pair_step(inplace):
    def factory(model, opt):
        def step(a, b):
            if inplace:
                a.mul_(0.5)  # an in-place write to one input, then the other is read
            loss = ((model(a) - b) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        return step
    return factory


def square_model():
    return make_model(out=8)


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("when", ["after_capture", "from_start"])
def test_same_tensor_passed_twice(inplace, when):
    p = Pair(pair_step(inplace), model_fn=square_model)

    def distinct(k):
        return lambda m: (torch.randn(8, 8, generator=gen(k)), torch.randn(8, 8, generator=gen(k + 50)))

    def aliased(k):
        def make(m):
            x = torch.randn(8, 8, generator=gen(k))
            return x, x
        return make
    first, second = (distinct, aliased) if when == "after_capture" else (aliased, distinct)
    for k in range(3):
        p(first(k))
    for k in range(3, 6):
        p(second(k))
    p(first(6))
    assert p.step.stats.captures == 2 and p.step.stats.replays == 4, p.step.stats
    assert "aliasing" in p.step.stats.recaptures[0], p.step.stats.recaptures


def test_partially_overlapping_inputs_with_identical_metadata():
    """Two views of ONE tensor that overlap (not the same object: the alias guard sees no alias;
    metadata equals the captured call's): the in-place write to ``a`` must be seen through ``b``."""
    p = Pair(pair_step(True), model_fn=square_model)

    def views(k, shared):
        def make(m):
            g = gen(k)
            base1 = torch.randn(8, 12, generator=g)
            base2 = base1 if shared else torch.randn(8, 12, generator=g)
            return base1[:, :8], base2[:, 4:12]
        return make
    for k in range(3):
        p(views(k, shared=False))
    for k in range(3, 6):
        p(views(k, shared=True))
    p(views(6, shared=False))
    assert p.counts()[2] >= 3, p.step.stats


# ---- inputs tied to parameters -----------------------------------------------------------
@pytest.mark.parametrize("kind", ["detached_view", "row_slice", "non_leaf_from_param"])
def test_input_is_a_view_of_a_parameter(kind):
    """The input shares memory with (or is computed from) a parameter the step updates in place;
    the step also reads the input after the update."""
    def factory(model, opt):
        def step(a, b):
            loss = ((model(a) - b) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss + a.sum()  # read after opt.step(): sees the updated weight for a view
        return step

    def make_inputs(k):
        def make(m):
            w = m[0].weight  # (16, 8)
            a = {"detached_view": lambda: w.detach()[:8],
                 "row_slice": lambda: w.detach()[4:12],
                 "non_leaf_from_param": lambda: w[:8] * 1.0}[kind]()
            return a, torch.randn(8, 8, generator=gen(k))
        return make
    p = Pair(factory, model_fn=square_model)
    for k in range(5):
        p(make_inputs(k))
    assert p.counts() == (1, 1, 3), p.step.stats


@pytest.mark.parametrize("which", ["x", "both"])
def test_inputs_that_require_grad_get_eager_grads(which):
    p = Pair(pair_step(False), model_fn=square_model)

    def make(k):
        def m_(m):
            a = torch.randn(8, 8, generator=gen(k)).requires_grad_()
            b = torch.randn(8, 8, generator=gen(k + 50)).requires_grad_(which == "both")
            return a, b
        return m_
    for k in range(5):
        p(make(k))  # Pair checks a.grad / b.grad against eager after every call
    assert p.counts() == (1, 1, 3), p.step.stats


def test_an_input_the_step_makes_require_grad_keeps_the_flag_after_replays():
    """FGSM adversarial training: ``x.requires_grad_()`` inside the step, then ``x.grad.sign()``.
    The replays wrote ``x.grad`` but left ``x.requires_grad`` False, unlike eager (helper-78)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @stepgraph.compile
    def step(x, y):
        x.requires_grad_()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return (x + 0.1 * x.grad.sign()).detach()
    for k in range(5):
        x = torch.randn(3, 4, generator=gen(k))
        step(x, torch.tensor([0, 1, 0]))
        assert x.requires_grad and x.grad is not None, k
    assert step.stats.replays == 3, step.stats


def test_reused_input_holding_grad_is_refused_leaving_eager_state():
    """Passing the same requires-grad leaf again (its .grad from the last call still set): replays
    could not accumulate into it, so the capture is refused with a CaptureError -- after the call
    ran eagerly, as every refused capture does (failures.py): parameters, optimizer state and the
    input's accumulated .grad are eager's. It works again once ``x.grad = None``."""
    p = Pair()
    x, y = batch(0)
    x.requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    p.step(x, y)  # warm-up, eager: x.grad is set
    p.eager(x2, y)
    assert x.grad is not None
    with pytest.raises(stepgraph.CaptureError, match="already holds a .grad"):
        p.step(x, y)
    p.eager(x2, y)
    p.check_state("refused call")
    assert torch.equal(x.grad, x2.grad), "the input's .grad accumulated as eager's"
    x.grad = x2.grad = None
    out = p.step(x, y)
    assert torch.equal(out, p.eager(x2, y)) and torch.equal(x.grad, x2.grad)
    p.check_state("after")


# ---- containers, scalars, empty batches --------------------------------------------------
def test_dict_batch_missing_key_and_reordered_keys():
    def factory(model, opt):
        def step(batch):
            loss = F.cross_entropy(model(batch["x"]), batch["y"])
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        return step
    p = Pair(factory)

    def d(k, keys=("x", "y")):
        return lambda m: ({key: v for key, v in zip(("x", "y"), batch(k)) if key in keys},)

    def reordered(k):
        return lambda m: (dict(reversed(list(zip(("x", "y"), batch(k))))),)
    for c in range(1, 10):
        if c in BAD_AT:
            exc = p(d(c, keys=("x",)))
            assert isinstance(exc, KeyError), exc
        else:
            p(reordered(c) if c in (7, 8) else d(c))
    assert p.step.stats.replays >= 2, p.step.stats


def test_nan_scalar_argument():
    """A NaN loss scale gives eager's (NaN) result; repeating it must not fill the graph cache
    (``nan != nan``: a guard comparing values would miss on every call)."""
    def factory(model, opt):
        def step(x, y, scale):
            loss = F.cross_entropy(model(x), y) * scale
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        return step
    p = Pair(factory)
    for k in range(3):
        p(lambda m, k=k: (*batch(k), 1.0))
    for k in range(3, 8):
        p(lambda m, k=k: (*batch(k), float("nan")))  # a new NaN object each call
    assert p.step.stats.captures <= 2, (
        f"{p.step.stats.captures} captures for one NaN argument: {p.step.stats.recaptures}")


def test_empty_batch():
    p = Pair()
    for k, n in enumerate([8, 8, 8, 0, 0, 8, 0]):
        p(good(k, n=n))
    assert p.step.stats.replays >= 3, p.step.stats


def test_bad_first_call_with_adam_then_good_calls():
    """The first batch is bad (int32 labels: eager raises), the user fixes it: with Adam the next
    calls must work like eager (the failed warm-up created no optimizer state)."""
    p = Pair(opt_fn=lambda ps: torch.optim.Adam(ps, lr=1e-2))
    assert p(lambda m: (batch(0)[0], batch(0)[1].int())) is not None
    for k in range(1, 5):
        assert p(good(k)) is None
    assert p.step.stats.replays >= 1, p.step.stats


# ---- property-based ----------------------------------------------------------------------
call_spec = st.tuples(st.integers(1, 12), st.sampled_from(sorted(LAYOUTS)), st.sampled_from(["contiguous", "strided"]))


@settings(max_examples=25, deadline=None, database=None,  # no .hypothesis/ outside tests/
          suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from([torch.float32, torch.float64]), calls=st.lists(call_spec, min_size=3, max_size=3))
def test_property_random_shapes_dtypes_strides_match_eager(dtype, calls):
    """A fresh step per example (model in ``dtype``, AdamW): 3 calls with drawn batch sizes and
    input/label layouts (warm-up, capture, then replay or recapture) all equal eager bitwise."""
    p = Pair(model_fn=lambda: make_model(dtype), opt_fn=lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    for k, (n, layout, labels) in enumerate(calls):
        assert p(layout_batch(k, layout, n=n, dtype=dtype, label_layout=labels)) is None
    s = p.step.stats
    assert s.eager_calls + s.captures + s.replays == 3 and s.eager_calls == 1, s


def test_a_sparse_csr_tensor_the_step_reads_runs_eagerly_warned_not_a_raw_error():
    """A PyG-style sparse CSR adjacency in the step's closure: its key read ``stride()``, a raw
    RuntimeError at the warm-up call (helper-80). Now keyed by layout; the capture cannot trace
    it and the step runs eagerly, warned, with eager's results."""
    idx = torch.tensor([[0, 1, 2, 3, 4], [1, 2, 3, 4, 0]])
    adj = torch.sparse_coo_tensor(idx, torch.ones(5), (5, 5)).coalesce().to_sparse_csr()
    torch.manual_seed(0)
    lin = nn.Linear(4, 2)
    twin = copy.deepcopy(lin)

    def make(m):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)

        def step(x):
            loss = torch.sparse.mm(adj, m(x)).pow(2).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()
        return step
    sg, eager = stepgraph.compile(make(lin)), make(twin)
    with pytest.warns(UserWarning):
        for k in range(3):
            x = torch.randn(5, 4, generator=gen(k))
            assert torch.equal(sg(x), eager(x)), k
    assert all(torch.equal(p, q) for p, q in zip(lin.parameters(), twin.parameters()))
