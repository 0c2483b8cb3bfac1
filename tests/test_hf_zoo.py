"""Hugging Face transformers models, built from tiny configs (no downloads), trained with AdamW
through stepgraph and compared with an eager twin, bitwise.

transformers is a test-only dependency: these tests skip when it is not importable.

The stepgraph run and the eager twin run one after the other (the same seed before each call,
since the default configs keep dropout on), not interleaved: the eager twin of BERT builds an
``nn.CrossEntropyLoss`` in every forward, which stepgraph's global module-registration guard
sees (see test_real_loops.py::test_unrelated_module_construction_between_steps_does_not_recapture).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.utils._pytree as pytree

transformers = pytest.importorskip("transformers")

import stepgraph  # noqa: E402
from parity import rel_err  # noqa: E402

V, T, B = 96, 12, 4
CALLS = 7  # 1 eager warm-up, 1 capture, 5 replays
MAX_REL: dict[str, float] = {}


def build(name: str, attn: str = "eager", **extra):
    """A tiny randomly initialised model; the same weights for the same arguments."""
    torch.manual_seed(0)
    if name == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=V, n_positions=T, n_embd=32, n_layer=2, n_head=2,
                                      bos_token_id=0, eos_token_id=0, attn_implementation=attn, **extra)
        model = transformers.GPT2LMHeadModel(cfg)
    elif name == "bert":
        cfg = transformers.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=64, max_position_embeddings=T,
                                      attn_implementation=attn, **extra)
        model = transformers.BertForMaskedLM(cfg)
    elif name == "llama":
        cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=T,
                                       attn_implementation=attn, **extra)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        raise KeyError(name)
    model.train()
    return model


def make_batch(name: str, k: int, padded: bool = True) -> dict:
    g = torch.Generator().manual_seed(5000 + k)
    ids = torch.randint(1, V, (B, T), generator=g)
    if name == "bert":
        # Masked LM: predict ~30% of the tokens. No attention_mask: BERT's bidirectional mask
        # checks padding_mask.all() on the host (see test_hf_padding_mask_host_check_...).
        pick = torch.rand(B, T, generator=g) < 0.3
        pick[:, 0] = True
        return {"input_ids": torch.where(pick, 1, ids), "labels": torch.where(pick, ids, -100)}
    batch = {"input_ids": ids, "labels": ids.clone()}
    if padded:
        lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
        lengths[0] = T
        mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
        batch["attention_mask"] = mask
        batch["labels"] = torch.where(mask.bool(), ids, -100)
    return batch


def step_fn(model, opt, returns: str):
    def step(batch):
        out = model(**batch)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        return out.loss if returns == "loss" else out
    return step


def run(fn, name, padded=True):
    outs = []
    for k in range(CALLS):
        torch.manual_seed(100 + k)  # dropout: the same masks in both runs
        outs.append(fn(make_batch(name, k, padded)))
    return outs


def check(feature, got, want):
    if isinstance(got, torch.Tensor):
        e = 0.0 if torch.equal(got, want) else rel_err(got, want)
        MAX_REL[feature] = max(MAX_REL.get(feature, 0.0), e)
        assert e == 0.0, f"{feature}: differs from eager (max rel err {e:.3g})"
    else:
        assert got == want, f"{feature}: {got!r} != {want!r}"


def check_state(feature, m1, m2, o1, o2):
    for (n, p), q in zip(m1.named_parameters(), m2.parameters()):
        check(f"{feature} param {n}", p, q)
    for (n, b), c in zip(m1.named_buffers(), m2.buffers()):
        check(f"{feature} buffer {n}", b, c)
    for s1, s2 in zip(o1.state.values(), o2.state.values()):
        for k in s1:
            check(f"{feature} opt state {k}", s1[k], s2[k])


def twins(name, attn="eager", **extra):
    m1 = build(name, attn, **extra)
    m2 = copy.deepcopy(m1)
    o1 = torch.optim.AdamW(m1.parameters(), lr=1e-3, weight_decay=0.01)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-3, weight_decay=0.01)
    return m1, m2, o1, o2


def cache_tensors(cache) -> list:
    """The key/value tensors of a transformers Cache (empty list for None)."""
    if cache is None:
        return []
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama"])
def test_hf_train_returning_loss(name):
    feat = f"{name} loss"
    m1, m2, o1, o2 = twins(name)
    step = stepgraph.compile(step_fn(m1, o1, "loss"))
    got = run(step, name)
    want = run(step_fn(m2, o2, "loss"), name)
    for k, (a, b) in enumerate(zip(got, want)):
        check(f"{feat} (call {k + 1})", a, b)
    check_state(feat, m1, m2, o1, o2)
    s = step.stats
    assert (s.eager_calls, s.captures, s.replays) == (1, 1, CALLS - 2), s
    assert len({float(x.detach()) for x in got}) == CALLS  # a live loss each replay


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama"])
def test_hf_train_returning_whole_model_output(name):
    """The step returns the ModelOutput itself, as built by the model's default config (GPT-2 and
    Llama include past_key_values, a DynamicCache). Every field of every call must be that
    call's values (equal to eager), or the capture must raise a CaptureError: a replay may not
    hand back the capture call's cache object with the capture call's tensors in it."""
    feat = f"{name} ModelOutput"
    m1, m2, o1, o2 = twins(name)
    step = stepgraph.compile(step_fn(m1, o1, "output"))
    try:
        got = run(step, name)
    except stepgraph.CaptureError as e:  # acceptable, if it says what to return instead
        assert "past_key_values" in str(e) or "Cache" in str(e) or "use_cache" in str(e), str(e)
        return
    want = run(step_fn(m2, o2, "output"), name)
    for k, (a, b) in enumerate(zip(got, want)):
        assert type(a) is type(b)
        assert list(a.keys()) == list(b.keys())
        check(f"{feat} loss (call {k + 1})", a.loss, b.loss)
        check(f"{feat} logits (call {k + 1})", a.logits, b.logits)
        ca, cb = cache_tensors(a.get("past_key_values")), cache_tensors(b.get("past_key_values"))
        assert len(ca) == len(cb)
        for t1, t2 in zip(ca, cb):
            check(f"{feat} past_key_values (call {k + 1})", t1, t2)
    check_state(feat, m1, m2, o1, o2)
    s = step.stats
    assert (s.eager_calls, s.captures, s.replays) == (1, 1, CALLS - 2), s


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hf_train_returning_model_output_without_cache(name):
    """With use_cache=False the ModelOutput holds only tensors (loss, logits): equal to eager."""
    feat = f"{name} ModelOutput use_cache=False"
    m1, m2, o1, o2 = twins(name, use_cache=False)
    step = stepgraph.compile(step_fn(m1, o1, "output"))
    got = run(step, name)
    want = run(step_fn(m2, o2, "output"), name)
    for k, (a, b) in enumerate(zip(got, want)):
        assert type(a) is type(b) and list(a.keys()) == list(b.keys()) == ["loss", "logits"]
        for x, y in zip(pytree.tree_leaves(a), pytree.tree_leaves(b)):
            check(f"{feat} (call {k + 1})", x, y)
    check_state(feat, m1, m2, o1, o2)
    s = step.stats
    assert (s.eager_calls, s.captures, s.replays) == (1, 1, CALLS - 2), s


def test_gpt2_sdpa_without_attention_mask():
    """The default attention (sdpa) with no attention_mask has no host check: it captures."""
    feat = "gpt2 sdpa (no mask)"
    m1, m2, o1, o2 = twins("gpt2", "sdpa")
    step = stepgraph.compile(step_fn(m1, o1, "loss"))
    got = run(step, "gpt2", padded=False)
    want = run(step_fn(m2, o2, "loss"), "gpt2", padded=False)
    for k, (a, b) in enumerate(zip(got, want)):
        check(f"{feat} (call {k + 1})", a, b)
    check_state(feat, m1, m2, o1, o2)
    s = step.stats
    assert (s.eager_calls, s.captures, s.replays) == (1, 1, CALLS - 2), s


@pytest.mark.parametrize("name,attn", [("gpt2", "sdpa"), ("bert", "eager")])
def test_hf_padded_batches_with_default_attention_capture(name, attn):
    """transformers' mask code asks padding_mask.all() on the host to skip building a mask (sdpa;
    and BERT's bidirectional mask even with eager attention) unless ``is_tracing(mask)``: while
    stepgraph traces it answers True for the step's tensors, so the mask is built and the
    step captures and replays equal to eager on padded batches (was a CaptureError)."""
    m1, m2, o1, o2 = twins(name, attn)
    step, eager = stepgraph.compile(step_fn(m1, o1, "loss")), step_fn(m2, o2, "loss")
    batch0 = make_batch("gpt2", 0)  # input_ids, padded attention_mask, labels
    if name == "bert":
        batch0 = dict(make_batch("bert", 0), attention_mask=batch0["attention_mask"])
    for k in range(5):
        b = {key: v.roll(k, 0) for key, v in batch0.items()}
        torch.manual_seed(k)
        got = step(b)
        torch.manual_seed(k)
        want = eager(b)
        assert torch.equal(got, want), k
        check_state(f"{name} {attn} padded batch", m1, m2, o1, o2)
    assert step.stats.replays == 3 and step.stats.captures == 1
