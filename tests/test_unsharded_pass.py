"""passes/unsharded.py: storages a graph allocates and frees (FSDP2's unsharded parameters)
become graph temporaries, so nothing is left that a CUDA graph refuses (issue 19).

Hand-built graphs pin the rules (what is rewritten, what is left as traced); the FSDP2 cases
check on a world of one (gloo) that the captured step's graph has no resize left, that
cudagraph.refuse_uncapturable (the CUDA backend's decision, run here without a GPU) accepts it
where it refused the traced graph, and that the temporaries' peak is at most the traced graph's.
"""
import pytest
import torch
from torch import fx

from stepgraph.backends.refusals import refuse_uncapturable
from stepgraph.errors import NeedsReplay
from stepgraph.passes.analysis import RESIZE_STORAGE
from stepgraph.passes.unsharded import peak_unsharded_bytes, storages_to_temporaries

aten = torch.ops.aten
pytestmark = pytest.mark.usefixtures("one_thread")


def _module():
    root = torch.nn.Module()
    root.buf = torch.zeros(8)                       # FSDP2's all-gather output: freed between steps
    root.param = torch.as_strided(root.buf, (2, 4), (4, 1))   # the unsharded parameter, a view of it
    torch.ops.inductor.resize_storage_bytes_(root.buf, 0)
    root.src, root.src2 = torch.arange(8.0), torch.arange(8.0) * 3   # the shards copied in
    return root


def _two_intervals(read_before=False, return_view=False):
    """resize(full) -> copy_ -> view made and read -> resize(0), twice; the view made in the first
    interval is read again in the second (a tensor autograd saved in forward, read in backward)."""
    root, g = _module(), fx.Graph()
    ga = lambda name: g.get_attr(name)  # noqa: E731 - make_fx emits one get_attr per use, as here
    early = g.call_function(aten.sum.default, (ga("param"),)) if read_before else None
    g.call_function(RESIZE_STORAGE, (ga("buf"), 32))
    c = g.call_function(aten.copy_.default, (ga("buf"), ga("src")))
    v = g.call_function(aten.t.default, (ga("param"),))
    s1 = g.call_function(aten.sum.default, (v,))
    g.call_function(RESIZE_STORAGE, (c, 0))
    g.call_function(RESIZE_STORAGE, (c, 32))
    c2 = g.call_function(aten.copy_.default, (c, ga("src2")))
    m = g.call_function(aten.mul.Tensor, (v, 1))
    g.call_function(RESIZE_STORAGE, (c2, 0))
    outs = (s1, m) + ((early,) if early is not None else ()) + ((v,) if return_view else ())
    g.output(outs)
    return fx.GraphModule(root, g)


def _resizes(gm):
    return sum(1 for n in gm.graph.nodes if n.target is RESIZE_STORAGE)


def test_intervals_become_temporaries_and_a_view_read_later_is_made_again_from_the_later_one():
    gm = _two_intervals()
    want = [o.clone() for o in gm()]   # as traced: real resizes (the storage ends empty again)
    assert torch.equal(want[1], (torch.arange(8.0) * 3).view(2, 4).t())  # eager reads the refill
    peak_before = peak_unsharded_bytes(gm)
    rep = storages_to_temporaries(gm)
    assert (rep.storages, rep.temporaries, rep.resizes_removed, rep.left) == (1, 2, 4, {})
    assert _resizes(gm) == 0 and "as_strided" in gm.code
    got = gm()
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert gm.buf.untyped_storage().nbytes() == 0   # the constant is never touched again
    # the first temporary dies after its last read (the view is made again from the second)
    assert peak_before == 32 and peak_unsharded_bytes(gm) == 32
    refuse_uncapturable(gm)   # nothing left that the CUDA backend refuses


@pytest.mark.parametrize("case,why", [
    ("read_before", "touches it while it is freed"),
    ("return_view", "returns a tensor aliasing it"),
    ("not_empty", "not empty at the graph's end"),
])
def test_storages_the_pass_cannot_prove_safe_are_left_as_traced(case, why):
    gm = _two_intervals(read_before=case == "read_before", return_view=case == "return_view")
    if case == "not_empty":
        torch.ops.inductor.resize_storage_bytes_(gm.buf, 32)
    code = gm.code
    rep = storages_to_temporaries(gm)
    assert rep.storages == 0 and why in rep.left[0], rep
    assert gm.code == code and _resizes(gm) == 4
    with pytest.raises(NeedsReplay, match="frees and allocates storages"):
        refuse_uncapturable(gm)



@pytest.mark.parametrize("raf,bf16", [(True, False), (False, False), (True, True)])
def test_fsdp2_graph_has_no_resize_and_the_cuda_backend_would_take_it(world_of_one, monkeypatch, raf, bf16):
    """The same step captured with the pass off (resizes as traced) and on: the CUDA backend's
    check refuses the first (NeedsReplay) and accepts the second; both replay bitwise as eager;
    the temporaries hold at most the traced graph's peak of unsharded bytes. (SGD with momentum:
    a CPU AdamW reads its step counter on the host, which the CUDA backend's capturable AdamW
    does not, and which the check would refuse for that reason alone.)"""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import stepgraph
    from fsdp2_worker import max_diff, sharded_gpt, gpt_step
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    graphs = {}
    for on in ("0", "1"):
        monkeypatch.setenv("STEPGRAPH_FSDP2_TEMPORARIES", on)
        a, b = sharded_gpt(raf, mp), sharded_gpt(raf, mp)
        oa, ob = (torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9) for m in (a, b))
        sg, eager = stepgraph.compile(gpt_step(a, oa)), gpt_step(b, ob)
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            x = torch.randint(0, 64, (2, 16), generator=g)
            assert torch.equal(sg(x, torch.roll(x, -1, 1)), eager(x, torch.roll(x, -1, 1)))
            assert max_diff(a, oa, b, ob) == 0.0
        assert sg.stats.captures == 1 and sg.stats.replays == 2
        graphs[on] = sg.graph
    traced, temps = graphs["0"], graphs["1"]
    with pytest.raises(NeedsReplay, match="frees and allocates storages"):
        refuse_uncapturable(traced)
    assert _resizes(temps) == 0 and "resize_storage_bytes_" not in temps.code
    refuse_uncapturable(temps)
    rep = temps.meta["unsharded"]
    assert rep.left == {} and rep.temporaries == (2 if raf else 1) * rep.storages > 0, rep
    # live unsharded bytes, from the resizes as traced vs the temporaries' lifetimes
    assert 0 < peak_unsharded_bytes(temps) <= peak_unsharded_bytes(traced)
