"""Smoke tests for stepgraph.models: every family builds, trains one step, and is reproducible."""
import pytest
import torch

from stepgraph.tools import models

# Small configs keep the whole file well under a few seconds on a 2-core CPU.
VARIANTS = [
    ("mlp", {}),
    ("cnn_bn", {}),
    ("gpt", {}),
    ("gpt", {"sdpa": True}),
    ("gpt", {"dropout": 0.1}),
    ("embedding_model", {}),
    ("embedding_model", {"bag": False}),
    ("hooked_mlp", {}),
    ("tied", {}),
    ("nanogpt", {"layers": 1, "d": 32, "heads": 2, "vocab": 64, "seq": 16, "batch": 2}),
]
IDS = [f"{f}-{'-'.join(f'{k}={v}' for k, v in kw.items()) or 'default'}" for f, kw in VARIANTS]


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _bitwise_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a)


def test_families_registry_complete():
    assert set(models.FAMILIES) == {"mlp", "cnn_bn", "gpt", "embedding_model", "hooked_mlp", "tied",
                                    "hf_gpt2", "hf_llama", "nanogpt"}


@pytest.mark.parametrize("family,kw", VARIANTS, ids=IDS)
def test_forward_backward(family, kw):
    case = models.build(family, **kw)
    batch = case.make_batch(0)
    assert isinstance(batch, tuple)
    loss = case.loss_fn(case.model, *batch)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    params = [p for p in case.model.parameters() if p.requires_grad]
    assert params and all(p.grad is not None and torch.isfinite(p.grad).all() for p in params)


@pytest.mark.parametrize("family,kw", VARIANTS, ids=IDS)
def test_same_seed_bitwise_identical(family, kw):
    a, b = models.build(family, seed=7, **kw), models.build(family, seed=7, **kw)
    assert _bitwise_equal(_state(a.model), _state(b.model))
    assert _bitwise_equal(_state(a.model), _state(a.fresh().model))
    for x, y in zip(a.make_batch(3), b.make_batch(3)):
        assert torch.equal(x, y)
    # A generator argument works too and gives the same stream as the equivalent seed.
    for x, y in zip(a.make_batch(torch.Generator().manual_seed(3)), a.make_batch(3)):
        assert torch.equal(x, y)
    # Different batch seeds give different data; different model seeds give different weights.
    assert not all(torch.equal(x, y) for x, y in zip(a.make_batch(3), a.make_batch(4)))
    c = models.build(family, seed=8, **kw)
    assert not _bitwise_equal(_state(a.model), _state(c.model))


@pytest.mark.parametrize("family,kw", [v for v in VARIANTS if v[1].get("dropout", 0) == 0],
                         ids=[i for i, v in zip(IDS, VARIANTS) if v[1].get("dropout", 0) == 0])
def test_copies_train_identically(family, kw):
    """Two copies stepped with the same batches stay bitwise equal (what equivalence tests need)."""
    a, b = models.build(family, **kw), models.build(family, **kw)
    opts = [torch.optim.AdamW(c.model.parameters()) for c in (a, b)]
    for i in range(2):
        for case, opt in zip((a, b), opts):
            case.loss_fn(case.model, *case.make_batch(i)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert _bitwise_equal(_state(a.model), _state(b.model))


def test_build_does_not_touch_global_rng():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    models.gpt(seed=5)
    assert torch.equal(torch.rand(3), expected)


def test_gpt_head_is_tied_and_mask_is_buffer():
    m = models.gpt().model
    assert m.head.weight is m.tok.weight
    assert "mask" in dict(m.blocks[0].attn.named_buffers())
    # The tied weight is one Parameter, so the optimizer sees it once.
    assert len(list(m.parameters())) == len({id(p) for p in m.parameters()})


def test_sdpa_matches_manual_attention():
    manual, fused = models.gpt(seed=1), models.gpt(seed=1, sdpa=True)
    batch = manual.make_batch(0)
    torch.testing.assert_close(manual.loss_fn(manual.model, *batch),
                               fused.loss_fn(fused.model, *batch), rtol=1e-4, atol=1e-5)


def test_hooks_change_gradients():
    case = models.hooked_mlp()
    x, y = case.make_batch(0)
    case.loss_fn(case.model, x, y).backward()
    hooked = case.model.fc1.weight.grad.clone()
    # Recompute the same gradient by hand without the hooks: 0.5 (tensor hook) x 2.0 (param hook).
    m = case.fresh().model
    w = m.fc1.weight.detach().clone().requires_grad_(True)
    h = torch.nn.functional.gelu(torch.nn.functional.linear(x, w, m.fc1.bias))
    torch.nn.functional.cross_entropy(m.fc2(h), y).backward()
    torch.testing.assert_close(hooked, w.grad * 0.5 * 2.0)


def test_tied_shares_one_parameter():
    m = models.tied().model
    assert m.a.weight is m.b.weight


def test_dtype_argument():
    case = models.mlp(dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in case.model.parameters())
    x, y = case.make_batch(0)
    assert x.dtype == torch.bfloat16 and y.dtype == torch.int64
    case.loss_fn(case.model, x, y).backward()
