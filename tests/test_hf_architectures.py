"""transformers architectures beyond the corpus's (GPT-2, Llama, BERT, DistilBERT, T5, ViT), with
their default settings (default attention implementation, dropout on), trained as a new user
would: ``model(**batch)`` on padded batches with -100 labels, AdamW, ``clip_grad_norm_``.
Tiny configs (no downloads), compared bitwise with an eager twin after every call: loss,
parameters, grads and optimizer state; and the step must replay.

transformers is a test-only dependency: these tests skip when it is not importable.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import stepgraph  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

B, S, V = 4, 12, 128


def mlm_batch(k, pad=1, mask_id=4):
    g = torch.Generator().manual_seed(1000 + k)
    ids = torch.randint(5, V, (B, S), generator=g)
    lengths = torch.randint(S // 2, S + 1, (B,), generator=g)
    lengths[k % B] = S
    mask = torch.arange(S)[None, :] < lengths[:, None]
    pick = (torch.rand(B, S, generator=g) < 0.25) & mask
    pick[:, 1] = True
    ids = torch.where(mask, ids, pad)
    return {"input_ids": torch.where(pick, mask_id, ids), "attention_mask": mask.long(),
            "labels": torch.where(pick, ids, -100)}


def snapshot(model, opt, loss) -> dict:
    snap = {"loss": loss.detach().clone()}
    for n, p in model.named_parameters():
        snap[n] = p.detach().clone()
        snap[n + ".grad"] = None if p.grad is None else p.grad.clone()
    for j, st in enumerate(opt.state.values()):
        snap.update({f"opt{j}.{k}": v.clone() for k, v in st.items()})
    return snap


def compare_with_eager(build, batch, calls=6):
    """Run ``build()``'s model eagerly, then a fresh twin under stepgraph, on the same batches and
    seeds; assert bitwise equality after every call. Returns the compiled step."""
    runs = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = build().train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)

        def step(b):
            out = model(**b)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            return out.loss
        f = stepgraph.compile(step) if compiled else step
        snaps = []
        for k in range(calls):
            torch.manual_seed(100 + k)
            snaps.append(snapshot(model, opt, f(batch(k))))
        runs.append(snaps)
    for k, (want, got) in enumerate(zip(*runs)):
        bad = [n for n in want if not (got[n] is None and want[n] is None or
                                       got[n] is not None and want[n] is not None and torch.equal(got[n], want[n]))]
        assert not bad, f"call {k + 1}: {bad[:5]} differ from eager"
    return f


def test_longformer_global_attention_captures_and_replays():
    """LongformerForMaskedLM with a global token per row. Its attention reads on the host the
    number of global tokens (``torch.arange(num_global.max())``, ``new_zeros(b, max, ...)``:
    C reads of an integer tensor, now guarded by value) and sizes its chunks with
    ``torch.div(seq_len, 2 * w, rounding_mode="trunc")`` (Python ints wrapped into tensors: now
    folded). Both were refused as host syncs with a fix the user could not apply."""
    def build():
        return transformers.LongformerForMaskedLM(transformers.LongformerConfig(
            vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=80, attention_window=[8, 8], pad_token_id=1))

    def batch(k):
        b = mlm_batch(k)
        b["global_attention_mask"] = torch.zeros_like(b["input_ids"])
        b["global_attention_mask"][:, 0] = 1
        return b
    f = compare_with_eager(build, batch)
    assert (f.stats.captures, f.stats.replays) == (1, 4), f.stats


def test_an_unpadded_batch_with_its_all_ones_mask_is_bitwise_on_the_cpu():
    """peft's and run_clm's grouped texts: ``attention_mask`` all ones. Eager transformers skips the
    mask (``padding_mask.all()``) and runs SDPA with ``is_causal=True``; the trace was told it was
    tracing and built the explicit mask: another kernel, grads ~1e-8 apart at every replay, said
    nowhere (helper-77). On the CPU that read is now a guarded host read: a graph for unpadded
    batches, one for padded, each bitwise."""
    def build():
        torch.manual_seed(0)
        m = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2))
        opt = torch.optim.SGD(m.parameters(), lr=0.1)

        def step(ids, mask):
            loss = m(input_ids=ids, attention_mask=mask, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()
        return m, step
    (me, eager), (ms, sg) = build(), build()
    sg = stepgraph.compile(sg)
    g = torch.Generator().manual_seed(1)
    for k in range(7):
        ids = torch.randint(0, V, (2, 16), generator=g)
        mask = torch.ones_like(ids)
        if k % 3 == 2:
            mask[0, 12:] = 0   # (a padded batch now and then)
        assert torch.equal(eager(ids, mask), sg(ids, mask)), k
        assert all(torch.equal(a, b) for a, b in zip(me.parameters(), ms.parameters())), k
    assert sg.stats.captures <= 2 and sg.stats.replays >= 4, sg.stats
