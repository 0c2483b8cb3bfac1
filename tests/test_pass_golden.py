"""Golden-text tests of the graph passes (stepgraph/passes/): one small graph in, the printed
graph out, compared with the text written here.

Each input is a ``make_fx`` trace of a tiny function on real CPU tensors; the nodes only
stepgraph's tracer records (host-read guards, live-float readers, FSDP2's storage resizes) are
added by hand as capture/ adds them. The printed code is normalised: make_fx's ``; x = None``
frees (which names it frees is torch-version noise) and memory addresses are dropped. A golden
diff shows what a pass now does differently; each test also checks a result of the rewrite.
"""
import operator
import re
import textwrap

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from stepgraph.capture.hostscalar import group_reader
from stepgraph.errors import GuardMiss
from stepgraph.markers import host_guard
from stepgraph.passes import cleanup, summarize
from stepgraph.passes.alpha import fold_alpha
from stepgraph.passes.analysis import RESIZE_STORAGE, graph_writes
from stepgraph.passes.bake_floats import bake_host_floats
from stepgraph.passes.device_scalars import to_device_scalars
from stepgraph.passes.guards import place_guards
from stepgraph.passes.unsharded import storages_to_temporaries

aten = torch.ops.aten
pytestmark = pytest.mark.usefixtures("one_thread")


def printed(gm) -> str:
    text = re.sub(r";\s+(\w+ = )+None", "", gm.code)
    text = re.sub(r"0x[0-9a-fA-F]+", "0x?", text)
    return "\n".join(line.rstrip() for line in text.strip().splitlines() if line.strip())


def check(gm, golden: str) -> None:
    assert printed(gm) == textwrap.dedent(golden).strip()


# ---- cleanup.py -------------------------------------------------------------------------------
def test_cleanup_drops_aliases_noop_views_profiler_ranges_and_dead_ops_but_keeps_writes_and_rng():
    w = torch.ones(3)

    def f(x, p, g):
        y = x.detach()
        v = x.view(2, 3).t().t().view(2, 3)   # a no-op view, a transpose of a transpose
        x * 3                                  # dead
        torch.rand(2)                          # dead, but the random stream must advance
        with torch.autograd.profiler.record_function("opt"):
            p.add_(g, alpha=-0.1)
        return y + v + w
    x, p, g = torch.arange(6.0).view(2, 3), torch.zeros(3), torch.ones(3)
    gm = make_fx(f)(x, p.clone(), g)
    want = f(x, p.clone(), g)
    cleanup(gm)
    check(gm, """
        def forward(self, x_1, p_1, g_1):
            rand = torch.ops.aten.rand.default([2], device = device(type='cpu'), pin_memory = False)
            add_ = torch.ops.aten.add_.Tensor(p_1, g_1, alpha = -0.1)
            add = torch.ops.aten.add.Tensor(x_1, x_1)
            _tensor_constant0 = self._tensor_constant0
            add_1 = torch.ops.aten.add.Tensor(add, _tensor_constant0)
            return add_1
    """)
    assert {k.name: v.name for k, v in gm.meta["replaced"].items()} == \
        {"detach": "x_1", "view": "x_1", "t_1": "x_1", "view_1": "x_1"}
    q = p.clone()
    assert torch.equal(gm(x, q, g), want) and torch.equal(q, torch.full((3,), -0.1))


# ---- alpha.py ---------------------------------------------------------------------------------
def test_fold_alpha_writes_each_alpha_as_its_own_mul():
    def f(p, g):
        p.add_(g, alpha=-0.1)
        q = p.sub(g, alpha=2)
        torch._foreach_add_([p], [g], alpha=0.5)
        return p + q                                # no alpha: left alone
    p, g = torch.arange(3.0), torch.ones(3)
    gm = make_fx(f)(p.clone(), g)
    assert fold_alpha(gm) == 3
    check(gm, """
        def forward(self, p_1, g_1):
            mul_tensor = torch.ops.aten.mul.Tensor(g_1, -0.1)
            add_ = torch.ops.aten.add_.Tensor(p_1, mul_tensor)
            mul_tensor_1 = torch.ops.aten.mul.Tensor(g_1, 2)
            sub = torch.ops.aten.sub.Tensor(add_, mul_tensor_1)
            _foreach_mul_scalar = torch.ops.aten._foreach_mul.Scalar([g_1], 0.5)
            _foreach_add_ = torch.ops.aten._foreach_add_.List([add_], _foreach_mul_scalar)
            add = torch.ops.aten.add.Tensor(add_, sub)
            return add
    """)
    assert fold_alpha(gm) == 0   # nothing left to fold
    # (the same arithmetic, not bitwise: add's a + alpha * b is one fused multiply-add on the CPU)
    torch.testing.assert_close(gm(p.clone(), g), f(p.clone(), g))


# ---- analysis.py ------------------------------------------------------------------------------
def test_summarize_names_what_the_graph_reads_and_writes():
    bn, w = torch.nn.BatchNorm1d(3), torch.ones(3)
    names = {id(t): n for n, t in [*bn.named_parameters(), *bn.named_buffers()]}

    def f(x, y):
        y.mul_(2)                                        # an input written
        torch.nn.functional.dropout(x, 0.5)              # one random op
        return bn(x) * w                                 # running stats written, w unnamed
    gm = make_fx(f)(torch.randn(4, 3), torch.ones(2))
    s = summarize(gm, lambda t: names.get(id(t)))
    assert str(s) == (
        "GraphSummary(ops=9, inplace_ops=5, host_scalar_reads=0, state_read=['num_batches_tracked', "
        "'weight', 'bias', 'running_mean', 'running_var', '<constant #0 (3,)>'], state_written="
        "['num_batches_tracked', 'running_mean', 'running_var'], inputs_written=[1], constants="
        "{'_tensor_constant0': 'num_batches_tracked', '_param_constant0': 'weight', '_param_constant1': "
        "'bias', '_tensor_constant1': 'running_mean', '_tensor_constant2': 'running_var', "
        "'_tensor_constant3': '<constant #0 (3,)>'}, random_ops=1)")
    assert str(graph_writes(gm)) == ("GraphWrites(attrs=['_tensor_constant0', '_tensor_constant1', "
                                     "'_tensor_constant2'], placeholders=[1])")


# ---- guards.py --------------------------------------------------------------------------------
def _guard_at_end(gm, value):
    """``loss.item()`` read after the rest of the step, as capture/hostreads.py records it."""
    g = gm.graph
    out = next(n for n in g.nodes if n.op == "output")
    with g.inserting_before(out):
        item = g.call_function(aten._local_scalar_dense.default, (out.args[0][0],))
        g.call_function(host_guard, (item, value, "step.py:5", "loss.item()"))
    gm.recompile()
    return gm


def test_place_guards_moves_a_guard_ahead_of_writes_it_does_not_depend_on():
    def f(x, p):
        loss = (x * 2).sum()
        p.add_(x)
        return (loss,)
    gm = _guard_at_end(make_fx(f)(torch.ones(3), torch.zeros(3)), 6.0)
    plan = place_guards(gm, "cpu")
    check(gm, """
        def forward(self, x_1, p_1):
            mul = torch.ops.aten.mul.Tensor(x_1, 2)
            sum_1 = torch.ops.aten.sum.default(mul)
            _local_scalar_dense_default = torch.ops.aten._local_scalar_dense.default(sum_1)
            host_guard = stepgraph_markers_host_guard(_local_scalar_dense_default, 6.0, 'step.py:5', 'loss.item()', (), None)
            add_ = torch.ops.aten.add_.Tensor(p_1, x_1)
            return (sum_1,)
    """)
    assert (plan.reordered, plan.prefix_ops, plan.total_ops, plan.saved) == (True, 3, 5, [])
    p = torch.zeros(3)
    with pytest.raises(GuardMiss):
        gm(torch.full((3,), 2.0), p)
    assert torch.equal(p, torch.zeros(3))   # the write after the guard never ran


def test_place_guards_keeps_order_when_unsafe_and_makes_the_prefix_undoable():
    def f(x, p):
        x.view(-1).mul_(2)                    # writes x through a view, before the read of x
        return ((x * torch.rand(3)).sum() + p.sum(),)
    gm = _guard_at_end(make_fx(f)(torch.ones(3), torch.ones(3)), 1.0)
    plan = place_guards(gm, "cpu")
    check(gm, """
        def forward(self, x_1, p_1):
            clone_default = torch.ops.aten.clone.default(x_1)
            generator_state = stepgraph_passes_guards_generator_state()
            view = torch.ops.aten.view.default(x_1, [-1])
            mul_ = torch.ops.aten.mul_.Tensor(view, 2)
            rand = torch.ops.aten.rand.default([3], device = device(type='cpu'), pin_memory = False)
            mul = torch.ops.aten.mul.Tensor(x_1, rand)
            sum_1 = torch.ops.aten.sum.default(mul)
            sum_2 = torch.ops.aten.sum.default(p_1)
            add = torch.ops.aten.add.Tensor(sum_1, sum_2)
            _local_scalar_dense_default = torch.ops.aten._local_scalar_dense.default(add)
            host_guard = stepgraph_markers_host_guard(_local_scalar_dense_default, 1.0, 'step.py:5', 'loss.item()', ((x_1, clone_default),), generator_state)
            return (add,)
    """)
    assert (plan.reordered, plan.prefix_ops, plan.saved, plan.saved_bytes) == (False, 8, ["x_1"], 12)
    torch.manual_seed(0)
    x = torch.ones(3)
    with pytest.raises(GuardMiss):
        gm(x, torch.ones(3))
    assert torch.equal(x, torch.ones(3))                 # the write undone
    drawn = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(drawn, torch.rand(3))             # the random stream rewound


# ---- device_scalars.py ------------------------------------------------------------------------
def _sgd_with_live_floats(group):
    """SGD with momentum whose lr and momentum are live floats: reader nodes where the trace
    passed the HyperFloats (capture/hostscalar.py ``live_hyper``)."""
    def f(p, g, buf):
        buf.mul_(0.9).add_(g)
        p.add_(buf, alpha=-0.1)
        return (g * 0.1,)
    gm = make_fx(f)(torch.ones(3), torch.ones(3), torch.ones(3))
    g = gm.graph
    with g.inserting_before(next(n for n in g.nodes if n.op != "placeholder")):
        lr = g.call_function(group_reader(group, "lr"), ())
        mom = g.call_function(group_reader(group, "momentum"), ())
        neg = g.call_function(operator.neg, (lr,))
    lr.meta["host_value"], mom.meta["host_value"], neg.meta["host_value"] = 0.1, 0.9, -0.1
    for n in g.nodes:
        if n.target is aten.add_.Tensor and "alpha" in n.kwargs:
            n.update_kwarg("alpha", neg)
        elif n.target is aten.mul.Tensor:
            n.update_arg(1, lr)
        elif n.target is aten.mul_.Tensor:
            n.update_arg(1, mom)
    gm.recompile()
    return gm


def test_to_device_scalars_feeds_live_floats_as_one_tensor():
    group = {"lr": 0.1, "momentum": 0.9}
    gm = _sgd_with_live_floats(group)
    ds = to_device_scalars(gm, "cpu")
    check(gm, """
        def forward(self, p_1, g_1, buf_1, live_scalars):
            select_int_1 = torch.ops.aten.select.int(live_scalars, 0, 1)
            _to_copy_default_1 = torch.ops.aten._to_copy.default(select_int_1, dtype = torch.float32)
            mul_ = torch.ops.aten.mul_.Tensor(buf_1, _to_copy_default_1)
            add_ = torch.ops.aten.add_.Tensor(mul_, g_1)
            select_int_2 = torch.ops.aten.select.int(live_scalars, 0, 2)
            _to_copy_default_2 = torch.ops.aten._to_copy.default(select_int_2, dtype = torch.float32)
            addcmul__default = torch.ops.aten.addcmul_.default(p_1, add_, _to_copy_default_2)
            select_int = torch.ops.aten.select.int(live_scalars, 0, 0)
            _to_copy_default = torch.ops.aten._to_copy.default(select_int, dtype = torch.float32)
            mul = torch.ops.aten.mul.Tensor(g_1, _to_copy_default)
            return (mul,)
    """)
    check(ds.program, """
        def forward(self):
            param_group_lr = stepgraph_capture_hostscalar_param_group_lr()
            param_group_momentum = stepgraph_capture_hostscalar_param_group_momentum()
            neg = -param_group_lr
            return [param_group_lr, param_group_momentum, neg]
    """)
    group["lr"] = 0.5
    assert torch.equal(ds.pack(), torch.tensor([0.5, 0.9, -0.5], dtype=torch.float64))
    p, buf = torch.ones(3), torch.ones(3)
    (out,) = gm(p, torch.ones(3), buf, ds.pack())
    assert torch.equal(out, torch.full((3,), 0.5))     # g * lr, with the lr of this call
    torch.testing.assert_close(p, torch.full((3,), 1 - 0.5 * 1.9))


def test_to_device_scalars_sgd_on_a_sparse_grad_multiplies_then_adds():
    """``p.add_(grad, alpha=-lr)`` with a sparse grad (nn.EmbeddingBag(sparse=True): DLRM): no
    sparse addcmul_, so ``add_(p, mul(grad, alpha_t))`` (on CUDA: "Could not run
    'aten::addcmul_' with arguments from the 'SparseCUDA' backend")."""
    group = {"lr": 0.1}

    def f(p, g):
        p.add_(g, alpha=-0.1)
        return (p,)
    sparse = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (3,))
    gm = make_fx(f)(torch.ones(3), sparse)
    g = gm.graph
    with g.inserting_before(next(n for n in g.nodes if n.op != "placeholder")):
        lr = g.call_function(group_reader(group, "lr"), ())
        neg = g.call_function(operator.neg, (lr,))
    lr.meta["host_value"], neg.meta["host_value"] = 0.1, -0.1
    for n in g.nodes:
        if n.target is aten.add_.Tensor:
            n.update_kwarg("alpha", neg)
    gm.recompile()
    ds = to_device_scalars(gm, "cpu")
    assert "addcmul" not in gm.code, gm.code
    group["lr"] = 0.5
    p = torch.ones(3)
    gm(p, sparse, ds.pack())
    assert torch.equal(p, torch.ones(3).add_(sparse, alpha=-0.5))


def _with_reader(f, args, reader, value, target):
    """``f`` traced, the scalar operand of its ``target`` ops replaced by ``reader``'s node."""
    gm = make_fx(f)(*args)
    g = gm.graph
    with g.inserting_before(next(n for n in g.nodes if n.op != "placeholder")):
        r = g.call_function(reader, ())
    r.meta["host_value"] = value
    for n in g.nodes:
        if target in str(n.target):
            n.update_arg(1, r)
    gm.recompile()
    return gm


def test_a_division_by_a_live_float_on_cuda_multiplies_by_its_reciprocal_as_cuda_does():
    """CUDA divides by a Python float as ``a * (1 / b)`` (div_true_kernel_cuda, the reciprocal in
    the op's float; the foreach form's in double); a 0-dim tensor divisor is a true division, a
    rounding apart: torchvision's meter ``sum / count`` was unequal to eager on an H200. (On the
    CPU a Python float divides truly: left a division there.)"""
    group = {"lr": 3.0}
    a, b = torch.tensor([0.7, 1.3, 2.9]), torch.tensor([5.1, 0.11, 7.7])
    gm = _with_reader(lambda x: (x / 3.0,), (a,), group_reader(group, "lr"), 3.0, "div.Tensor")
    assert to_device_scalars(gm, "cuda") is not None and "reciprocal" in gm.code and "aten.div" not in gm.code, gm.code
    group["lr"] = 2.7
    (out,) = gm(a, torch.tensor([2.7], dtype=torch.float64))
    assert torch.equal(out, a * torch.reciprocal(torch.tensor(2.7, dtype=torch.float32))), out
    gm = _with_reader(lambda x, y: tuple(torch._foreach_div([x, y], 3.0)), (a, b), group_reader(group, "lr"), 3.0,
                      "_foreach_div")
    to_device_scalars(gm, "cuda")
    assert "aten._foreach_mul" in gm.code and "aten._foreach_div" not in gm.code, gm.code
    out = gm(a, b, torch.tensor([2.7], dtype=torch.float64))
    assert all(torch.equal(o, t * torch.tensor(1 / 2.7, dtype=torch.float32)) for o, t in zip(out, (a, b)))
    gm = _with_reader(lambda x: (x / 3.0,), (a,), group_reader(group, "lr"), 3.0, "div.Tensor")
    to_device_scalars(gm, "cpu")
    assert "aten.div" in gm.code and "reciprocal" not in gm.code, gm.code


def test_a_number_read_at_each_replay_is_fed_in_unless_it_meets_an_integer_tensor():
    """A tracked number (uselog._reader: an optimizer's Python step count) reaches device ops as
    one of the live scalars; an int one meeting an integer tensor keeps the op integral on the
    host (``numbers_to_feed`` leaves it out: segments run it)."""
    from stepgraph.passes.device_scalars import numbers_to_feed
    count = [3]

    def read_number():
        return count[0]
    read_number.number_label = "opt.state[p]['step']"
    gm = _with_reader(lambda x: (x * 2,), (torch.ones(3),), read_number, 3, "mul.Tensor")
    assert numbers_to_feed(gm, "cpu") == frozenset() and to_device_scalars(gm, "cpu") is None   # (floats only)
    ds = to_device_scalars(gm, "cpu", numbers=True)
    assert ds.labels == ["opt.state[p]['step']"] and "mul.Tensor" in gm.code, gm.code
    count[0] = 5
    assert torch.equal(gm(torch.ones(3), ds.pack())[0], torch.full((3,), 5.0))
    hits = _with_reader(lambda x: (x * 2,), (torch.ones(3, dtype=torch.int64),), read_number, 3, "mul.Tensor")
    assert numbers_to_feed(hits, "cpu") is None


def test_to_device_scalars_foreach_add_with_a_live_alpha_stays_a_foreach_op():
    """``torch._foreach_add_(params, grads, alpha=-lr)`` (SGD's and RMSprop's foreach form on
    CUDA): the operands are lists of nodes, which the sparse check above once took for sparse
    tensors -- an ``aten.mul`` of a list, which failed every live-lr replay (H200)."""
    group = {"lr": 0.1}

    def f(p1, p2, g1, g2):
        torch._foreach_add_([p1, p2], [g1, g2], alpha=-0.1)
        return (p1, p2)
    gm = make_fx(f)(*(torch.ones(3) for _ in range(4)))
    g = gm.graph
    with g.inserting_before(next(n for n in g.nodes if n.op != "placeholder")):
        lr = g.call_function(group_reader(group, "lr"), ())
        neg = g.call_function(operator.neg, (lr,))
    lr.meta["host_value"], neg.meta["host_value"] = 0.1, -0.1
    for n in g.nodes:
        if "_foreach_add" in str(n.target):
            n.update_kwarg("alpha", neg)
    gm.recompile()
    ds = to_device_scalars(gm, "cpu")
    assert "aten.mul.Tensor" not in gm.code and "addcmul" in gm.code, gm.code
    group["lr"] = 0.5
    p1, p2, g1, g2 = torch.ones(3), torch.ones(3), torch.full((3,), 2.0), torch.full((3,), 4.0)
    gm(p1, p2, g1, g2, ds.pack())
    assert torch.equal(p1, torch.zeros(3)) and torch.equal(p2, torch.full((3,), -1.0))


def test_to_device_scalars_a_rewritten_foreach_result_feeds_the_next_rewrite():
    """SGD's nesterov step after its weight decay, both live: ``g = _foreach_add(grads, params,
    alpha=wd)`` becomes one addcmul per element, then ``_foreach_add_(g, bufs, alpha=momentum)``
    reads those new nodes, which must carry their values (H200: an ``aten.mul`` of a list)."""
    group = {"weight_decay": 0.01, "momentum": 0.9}

    def f(p1, p2, g1, g2, b1, b2):
        d = torch._foreach_add([g1, g2], [p1, p2], alpha=0.01)
        torch._foreach_add_(d, [b1, b2], alpha=0.9)
        return tuple(d)
    gm = make_fx(f)(*(torch.ones(3) for _ in range(6)))
    g = gm.graph
    with g.inserting_before(next(n for n in g.nodes if n.op != "placeholder")):
        wd = g.call_function(group_reader(group, "weight_decay"), ())
        mom = g.call_function(group_reader(group, "momentum"), ())
    wd.meta["host_value"], mom.meta["host_value"] = 0.01, 0.9
    adds = [n for n in g.nodes if "_foreach_add" in str(n.target)]
    adds[0].update_kwarg("alpha", wd)
    adds[1].update_kwarg("alpha", mom)
    gm.recompile()
    ds = to_device_scalars(gm, "cpu")
    assert "aten.mul.Tensor" not in gm.code, gm.code
    group["weight_decay"], group["momentum"] = 0.5, 0.25
    ones = [torch.ones(3) for _ in range(6)]
    out = gm(*ones, ds.pack())
    assert all(torch.equal(o, torch.full((3,), 1.5 + 0.25)) for o in out), out


def test_bake_host_floats_replaces_a_reader_and_what_is_computed_from_it_by_traced_values():
    gm = _sgd_with_live_floats({"lr": 0.1, "momentum": 0.9})
    lr = next(n for n in gm.graph.nodes if n.name == "param_group_lr")
    assert bake_host_floats(gm, {lr}) == ["param_groups[..]['lr']"]
    check(gm, """
        def forward(self, p_1, g_1, buf_1):
            param_group_momentum = stepgraph_capture_hostscalar_param_group_momentum()
            mul_ = torch.ops.aten.mul_.Tensor(buf_1, param_group_momentum)
            add_ = torch.ops.aten.add_.Tensor(mul_, g_1)
            add__1 = torch.ops.aten.add_.Tensor(p_1, add_, alpha = -0.1)
            mul = torch.ops.aten.mul.Tensor(g_1, 0.1)
            return (mul,)
    """)


# ---- unsharded.py -----------------------------------------------------------------------------
def test_storages_to_temporaries_turns_a_resized_storage_into_an_empty_temporary():
    """One FSDP2 interval: resize(full) -> copy the shard in -> read the parameter -> resize(0)."""
    root = torch.nn.Module()
    root.buf = torch.zeros(8)                                   # the all-gather output
    root.param = torch.as_strided(root.buf, (2, 4), (4, 1))     # the unsharded parameter on it
    torch.ops.inductor.resize_storage_bytes_(root.buf, 0)      # freed between steps
    root.shard = torch.arange(8.0)
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.call_function(RESIZE_STORAGE, (g.get_attr("buf"), 32))
    c = g.call_function(aten.copy_.default, (g.get_attr("buf"), g.get_attr("shard")))
    y = g.call_function(aten.mm.default, (x, g.call_function(aten.t.default, (g.get_attr("param"),))))
    g.call_function(RESIZE_STORAGE, (c, 0))
    g.output((y,))
    gm = torch.fx.GraphModule(root, g)
    want = gm(torch.ones(3, 4))[0]
    rep = storages_to_temporaries(gm)
    check(gm, """
        def forward(self, x):
            empty_memory_format = torch.ops.aten.empty.memory_format([8], dtype = torch.float32, device = device(type='cpu'), pin_memory = False)
            shard = self.shard
            copy__default = torch.ops.aten.copy_.default(empty_memory_format, shard)
            as_strided_default = torch.ops.aten.as_strided.default(empty_memory_format, [2, 4], [4, 1], 0)
            t_default = torch.ops.aten.t.default(as_strided_default)
            mm_default = torch.ops.aten.mm.default(x, t_default)
            return (mm_default,)
    """)
    assert (rep.storages, rep.temporaries, rep.resizes_removed, rep.left) == (1, 1, 2, {})
    assert torch.equal(gm(torch.ones(3, 4))[0], want) and gm.buf.untyped_storage().nbytes() == 0


# ---- cleanup.py: resolve_bindings -------------------------------------------------------------
def test_resolve_bindings_follows_cleanup_replacements_or_drops_the_markers():
    """The replay backend binds fresh grads at the recorded nodes, mapped through what cleanup
    replaced; CUDA graphs and Inductor cannot stop mid-graph, so the zero_grad markers go."""
    from stepgraph.markers import zero_grad_marker
    from stepgraph.passes.cleanup import resolve_bindings

    def f(x):
        y = x.detach()
        return y * 2
    gm = make_fx(f)(torch.ones(2))
    marker = gm.graph.call_function(zero_grad_marker, (), {})
    next(n for n in gm.graph.nodes if n.op == "output").prepend(marker)
    gm.recompile()
    detach = next(n for n in gm.graph.nodes if n.target is aten.detach.default)
    cleanup(gm)   # detach -> x_1 (gm.meta["replaced"])
    bindings = [("bind", "p.grad", detach), ("zero", None, marker)]
    got = resolve_bindings(gm, bindings, keep_markers=True)
    assert [(k, s, n.name) for k, s, n in got] == [("bind", "p.grad", "x_1"), ("zero", None, marker.name)]
    assert resolve_bindings(gm, bindings, keep_markers=False) == []
    check(gm, """
        def forward(self, x_1):
            mul = torch.ops.aten.mul.Tensor(x_1, 2)
            return mul
    """)


# ---- host_prologue.py / moved_arguments.py ----------------------------------------------------
# (the "meta" device stands for the GPU: these passes ask only whether a tensor is on the CPU)
def test_split_prologue_moves_host_ops_and_their_copy_out_of_the_graph():
    """A CUDA step's CPU work on its CPU inputs (a DDPM's timesteps) runs before the graph at
    each call; the graph reads its result as a new input."""
    from stepgraph.passes.host_prologue import split_prologue

    def f(t, h):
        ts = (t + 1).to("meta")
        return h * ts
    gm = make_fx(f)(torch.arange(3), torch.ones(3, device="meta"))
    for n in gm.graph.nodes:
        if n.target in (aten.add.Tensor, aten._to_copy.default):
            n.meta["stepgraph_host"] = True   # (capture/modes.py marks them while tracing)
    example = []
    pro = split_prologue(gm, example)
    assert pro.reads == (0,) and pro.n_outputs == 1 and not pro.draws
    check(pro.module, """
        def forward(self, t_1):
            add = torch.ops.aten.add.Tensor(t_1, 1)
            _to_copy = torch.ops.aten._to_copy.default(add, dtype = torch.int64, layout = torch.strided, device = device(type='meta'))
            return (_to_copy,)
    """)
    check(gm, """
        def forward(self, t_1, h_1, host_0):
            mul = torch.ops.aten.mul.Tensor(h_1, host_0)
            return mul
    """)
    assert len(example) == 1 and example[0].device.type == "meta" and example[0].shape == (3,)
    assert pro([torch.arange(3), None])[0].device.type == "meta"


def test_moved_arguments_finds_a_cpu_argument_only_copied_to_the_device():
    from stepgraph.errors import NeedsReplay
    from stepgraph.passes.moved_arguments import MovedArgument, moved_arguments
    x, w = torch.ones(3), torch.ones(3, device="meta")
    gm = make_fx(lambda x, w: w * x.to("meta"))(x, w)
    assert moved_arguments(gm, 2, [x, w]) == [MovedArgument(0, torch.device("meta"))]
    gm = make_fx(lambda x, w: (w * x.to("meta"), x.sum()))(x, w)   # also used on the CPU
    with pytest.raises(NeedsReplay, match="also used otherwise"):
        moved_arguments(gm, 2, [x, w])
