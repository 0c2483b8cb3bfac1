"""``nn.TransformerEncoder`` with a causal ``mask`` and a padding mask, against eager PyTorch.

PyTorch decides things about these masks on the host (``_detect_is_causal_mask`` compares the
mask with a causal one; in eval mode without grad the encoder takes its fast path, turning a
padded batch into a nested tensor). Training steps in train and eval mode capture and replay
bitwise; inference in eval mode runs the fast path's kernels as eager does; what cannot be
traced (nested tensors) is refused with a fix in the user's own code, never silently different.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stepgraph

D, S, B = 16, 6, 3


def _encoder(**kw):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(D, 2, 32, dropout=0.1, batch_first=True)
    return nn.ModuleDict(dict(enc=nn.TransformerEncoder(layer, 2, **kw), head=nn.Linear(D, 5)))


def _batch(k, left_pad=False):
    g = torch.Generator().manual_seed(k)
    x, y = torch.randn(B, S, D, generator=g), torch.randint(0, 5, (B, S), generator=g)
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[k % B, -1 - k % 3:] = True   # right padding, a different row and length each batch
    return x, pad, y


def _train_step(m, opt, causal_arg=False, is_causal=None):
    def step(x, pad, y, mask=None):
        if not causal_arg:
            mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        kw = {} if is_causal is None else dict(is_causal=is_causal)
        h = m["enc"](x, mask=mask, src_key_padding_mask=pad, **kw)
        loss = F.cross_entropy(m["head"](h).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return step


def _compare(m, m2, opt, opt2):
    for (n, a), b in zip(m.state_dict().items(), m2.state_dict().values()):
        assert torch.equal(a, b), n
    for p, q in zip(m.parameters(), m2.parameters()):
        for k, v in opt.state[p].items():
            assert torch.equal(v, opt2.state[q][k]), k


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("causal_arg", [False, True], ids=["mask_in_step", "mask_argument"])
def test_training_step_with_causal_and_padding_masks(mode, causal_arg):
    m = _encoder()
    m2 = copy.deepcopy(m)
    m.train(mode == "train"), m2.train(mode == "train")
    opt, opt2 = torch.optim.AdamW(m.parameters(), lr=1e-2), torch.optim.AdamW(m2.parameters(), lr=1e-2)
    step, eager = stepgraph.compile(_train_step(m, opt, causal_arg)), _train_step(m2, opt2, causal_arg)
    mask = nn.Transformer.generate_square_subsequent_mask(S)
    for k in range(6):
        kw = dict(mask=mask) if causal_arg else {}
        torch.manual_seed(k)
        got = step(*_batch(k), **kw)
        torch.manual_seed(k)
        want = eager(*_batch(k), **kw)
        assert torch.equal(got, want), k
        _compare(m, m2, opt, opt2)
    s = step.stats
    assert (s.eager_calls, s.captures, s.replays) == (1, 1, 4), step.explain()


def test_host_read_of_the_mask_refused_with_a_fix_in_user_code():
    """host_reads='error': the read is inside torch (the causal-mask check); the fix says what
    to change in the user's call."""
    m = _encoder()
    step = stepgraph.compile(_train_step(m, torch.optim.SGD(m.parameters(), lr=0.1)), host_reads="error")
    step(*_batch(0))
    with pytest.raises(stepgraph.CaptureError, match=r"(?s)transformer\.py.*fix: pass is_causal=True"):
        step(*_batch(1))


def test_is_causal_true_needs_no_host_read():
    m = _encoder()
    m2 = copy.deepcopy(m)
    opt, opt2 = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)
    step = stepgraph.compile(_train_step(m, opt, is_causal=True), host_reads="error")
    eager = _train_step(m2, opt2, is_causal=True)
    for k in range(5):
        torch.manual_seed(k)
        got = step(*_batch(k))
        torch.manual_seed(k)
        assert torch.equal(got, eager(*_batch(k)))
    _compare(m, m2, opt, opt2)
    assert step.stats.replays == 3


@pytest.mark.parametrize("nested", [False, True])
def test_eval_inference_takes_the_fast_path_as_eager(nested):
    """Eval mode without grad: PyTorch's fast path (``_transformer_encoder_layer_fwd``) is what
    eager runs, so the graph must run it too (the trace took the slow path: ~1e-7 apart)."""
    m = _encoder(enable_nested_tensor=nested).eval()
    mask = nn.Transformer.generate_square_subsequent_mask(S)

    def infer(x, pad):
        return m["head"](m["enc"](x, mask=mask, src_key_padding_mask=pad))
    step = stepgraph.compile(infer)
    with torch.no_grad():
        for k in range(5):
            x, pad, _ = _batch(k)
            assert torch.equal(step(x, pad), infer(x, pad)), k
    assert step.stats.replays == 3, step.explain()
    assert "_transformer_encoder_layer_fwd" in step.graph.code


def test_eval_inference_with_nested_tensors_refused_with_a_fix():
    """Padding mask alone in eval without grad: eager turns the batch into a nested tensor (padded
    positions come out as zeros), which the trace cannot follow. Refused, never silently different;
    the call itself returns eager's result with on_capture_error='eager'."""
    m = _encoder().eval()

    def infer(x, pad):
        return m["enc"](x, src_key_padding_mask=pad)
    step = stepgraph.compile(infer)
    with torch.no_grad():
        step(*_batch(0)[:2])
        with pytest.raises(stepgraph.CaptureError, match="enable_nested_tensor=False"):
            step(*_batch(1)[:2])
        soft = stepgraph.compile(infer, on_capture_error="eager")
        for k in range(4):
            x, pad, _ = _batch(k)
            with pytest.warns(UserWarning, match="nested") if k == 1 else _nothing():
                assert torch.equal(soft(x, pad), infer(x, pad)), k
    m2 = _encoder(enable_nested_tensor=False).eval()   # the fix: same weights, dense fast path
    fixed = stepgraph.compile(lambda x, pad: m2["enc"](x, src_key_padding_mask=pad))
    with torch.no_grad():
        for k in range(4):
            x, pad, _ = _batch(k)
            assert torch.equal(fixed(x, pad), m2["enc"](x, src_key_padding_mask=pad))
    assert fixed.stats.replays == 2


def _nothing():
    import contextlib
    return contextlib.nullcontext()


@pytest.mark.parametrize("module", ["mha_padding_mask", "mha_no_mask", "decoder_teacher"])
def test_an_eval_teacher_in_a_training_step_takes_eager_fast_path(module):
    """An eval attention module run under no_grad inside a training step (a distillation teacher,
    a validation pass): nn.MultiheadAttention.forward also declines its fast path while make_fx
    traces (``_is_make_fx_tracing``), so the graph ran the slow path, 6e-8 from eager's
    ``_native_multi_head_attention`` at the capture and every replay (found by a probe)."""
    torch.manual_seed(0)
    if module == "decoder_teacher":
        teacher = nn.TransformerDecoder(nn.TransformerDecoderLayer(D, 4, 32, batch_first=True), 2).eval()
    else:
        teacher = nn.MultiheadAttention(D, 4, batch_first=True).eval()
    head = nn.Linear(D, 1)
    head2 = copy.deepcopy(head)
    opt, opt2 = torch.optim.SGD(head.parameters(), lr=0.1), torch.optim.SGD(head2.parameters(), lr=0.1)

    def make(h, o):
        def step(x, pad):
            with torch.no_grad():
                if module == "decoder_teacher":
                    a = teacher(x, x)
                else:
                    a = teacher(x, x, x, key_padding_mask=pad if module == "mha_padding_mask" else None)[0]
            loss = h(a).pow(2).mean()
            loss.backward()
            o.step()
            o.zero_grad()
            return a
        return step
    step, eager = stepgraph.compile(make(head, opt)), make(head2, opt2)
    for k in range(5):
        x, pad, _ = _batch(k)
        pad = pad.clone()
        pad[:, 0] = False   # (no row all padding)
        assert torch.equal(step(x, pad), eager(x, pad)), k
        assert torch.equal(head.weight, head2.weight), k
    assert step.stats.replays == 3, step.explain()
