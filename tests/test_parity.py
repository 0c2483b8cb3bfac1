"""Whole-step capture equals eager PyTorch, bitwise, on the CPU: model families x optimizers.

Each case captures on one batch, replays on fresh batches, and compares loss, parameters,
grads, buffers and optimizer state with an identical eager copy after every step.
"""
import pytest
import torch

from parity import FORMS, HAS_FUSED, OPTIMIZERS, run_parity

FAMILIES = ["mlp", "cnn_bn", "gpt", "embedding_model", "hooked_mlp", "tied"]
SMALL = {"mlp": {"width": 32, "depth": 3}, "gpt": {"layers": 1, "d": 32, "heads": 2, "vocab": 64, "seq": 16}}


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("form", list(FORMS))
def test_mlp_every_optimizer_form(opt_name, form):
    if form == "fused" and opt_name not in HAS_FUSED:
        pytest.skip(f"{opt_name} has no fused implementation")
    rep = run_parity("mlp", opt_name, form, config=SMALL["mlp"])
    assert rep.worst() == 0.0


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_family_x_optimizer(family, opt_name):
    rep = run_parity(family, opt_name, config=SMALL.get(family))
    assert rep.worst() == 0.0


@pytest.mark.parametrize("family", ["gpt", "cnn_bn"])
def test_family_foreach_adamw(family):
    assert run_parity(family, "adamw", "foreach", config=SMALL.get(family)).worst() == 0.0


def test_dropout_replays_draw_fresh_masks_like_eager():
    """With the same seed before each step, replays draw exactly eager's dropout masks."""
    import stepgraph
    from stepgraph.tools import models
    from parity import make_step
    cfg = dict(layers=1, d=32, heads=2, vocab=64, seq=16, dropout=0.3)
    case = models.build("gpt", **cfg)
    twin = case.fresh()
    opt = torch.optim.AdamW(case.model.parameters(), lr=1e-3)
    opt2 = torch.optim.AdamW(twin.model.parameters(), lr=1e-3)
    step, eager = stepgraph.compile(make_step(case, opt)), make_step(twin, opt2)
    losses = []
    for i in range(6):
        batch = case.make_batch(i)
        torch.manual_seed(100 + i)
        a = step(*batch)
        torch.manual_seed(100 + i)
        b = eager(*batch)
        assert torch.equal(a, b)
        losses.append(a)
    assert step.stats.replays == 4
    # Same batch, different seeds: replays must not reuse one mask.
    batch = case.make_batch(0)
    torch.manual_seed(1)
    l1 = step(*batch)
    l2 = step(*batch)
    assert not torch.equal(l1, l2)
