"""Hugging Face Wav2Vec2ForCTC trained through stepgraph, bitwise against eager (CPU).

Its CTC loss has a data-dependent output shape decided by the label lengths, behind dropout and
layerdrop: that shape is guarded by the lengths, not refused as a random value (hostreads.
random_guards). SpecAugment's masks are drawn with numpy inside transformers: with them on
(its default) the step is refused with a fix the user can apply (mask_time_prob=0.0)."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import stepgraph  # noqa: E402

V, B, L = 32, 3, 800


def model(**extra):
    torch.manual_seed(0)
    cfg = transformers.Wav2Vec2Config(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        conv_dim=(16, 16, 16), conv_stride=(5, 4, 2), conv_kernel=(10, 4, 2), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2, pad_token_id=0, mask_time_length=4, **extra)
    return transformers.Wav2Vec2ForCTC(cfg).train()


def batch(k):
    g = torch.Generator().manual_seed(700 + k)
    lengths = torch.randint(L // 2, L + 1, (B,), generator=g)
    lengths[0] = L
    mask = (torch.arange(L)[None, :] < lengths[:, None]).long()
    labels = torch.randint(4, V, (B, 6), generator=g)
    labels[1:, 4:] = -100   # shorter transcripts: the CTC target lengths differ per row
    return {"input_values": torch.randn(B, L, generator=g) * mask, "attention_mask": mask, "labels": labels}


def make(m, opt):
    def step(b):
        loss = m(**b).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss
    return step


def test_wav2vec2_ctc_trains_bitwise_with_layerdrop_and_dropout():
    m = model(mask_time_prob=0.0)
    twin = copy.deepcopy(m)
    o, ot = (torch.optim.AdamW(x.parameters(), lr=1e-3) for x in (m, twin))
    sg, eager = stepgraph.compile(make(m, o)), make(twin, ot)
    for k in range(6):
        torch.manual_seed(k)
        got = sg(batch(k))
        torch.manual_seed(k)
        assert torch.equal(got, eager(batch(k))), k
        assert all(torch.equal(p, q) for p, q in zip(m.parameters(), twin.parameters())), k
    assert sg.stats.replays >= 2, sg.stats   # (layerdrop's draws decide a branch: a graph each)


def test_wav2vec2_specaugment_is_refused_with_the_option_to_switch_it_off():
    m = model()
    sg = stepgraph.compile(make(m, torch.optim.AdamW(m.parameters(), lr=1e-3)))
    np.random.seed(0)
    sg(batch(0))
    with pytest.raises(stepgraph.CaptureError, match="mask_time_prob=0.0"):
        sg(batch(1))
