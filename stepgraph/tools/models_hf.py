"""Hugging Face ``transformers`` models for the zoo, built from small configs (no downloads).

``transformers`` is only needed when one of these families is built (tests, benchmark).
"""
from __future__ import annotations

import torch

from .models import Case, _built, _generator


def _lm_case(name: str, family: str, make_model, vocab: int, batch: int, seq: int, seed: int, device,
             dtype, cfg: dict) -> Case:
    model = _built(make_model, seed, device, dtype)

    def make_batch(seed_or_gen):
        g = _generator(seed_or_gen)
        ids = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
        return ids, torch.ones_like(ids)

    def loss_fn(m, ids, mask):
        # An explicit mask, as real batches carry: without one, transformers' packed-sequence
        # detection branches on a tensor value (a host sync a captured step refuses).
        return m(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False).loss
    return Case(name, model, make_batch, loss_fn, family, cfg)


def hf_gpt2(layers: int = 2, d: int = 128, heads: int = 4, vocab: int = 1024, batch: int = 4, seq: int = 64,
            *, seed: int = 0, device="cpu", dtype=torch.float32, attn: str = "eager") -> Case:
    import transformers
    cfg = dict(layers=layers, d=d, heads=heads, vocab=vocab, batch=batch, seq=seq, seed=seed,
               device=device, dtype=dtype, attn=attn)
    conf = transformers.GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=d, n_layer=layers, n_head=heads,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation=attn)
    return _lm_case(f"hf_gpt2_{layers}l", "hf_gpt2", lambda: transformers.GPT2LMHeadModel(conf), vocab,
                    batch, seq, seed, device, dtype, cfg)


def hf_llama(layers: int = 2, d: int = 128, heads: int = 4, vocab: int = 1024, batch: int = 4, seq: int = 64,
             *, seed: int = 0, device="cpu", dtype=torch.float32, attn: str = "eager") -> Case:
    import transformers
    cfg = dict(layers=layers, d=d, heads=heads, vocab=vocab, batch=batch, seq=seq, seed=seed,
               device=device, dtype=dtype, attn=attn)
    conf = transformers.LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=4 * d,
                                    num_hidden_layers=layers, num_attention_heads=heads,
                                    num_key_value_heads=heads, max_position_embeddings=seq,
                                    attn_implementation=attn)
    return _lm_case(f"hf_llama_{layers}l", "hf_llama", lambda: transformers.LlamaForCausalLM(conf), vocab,
                    batch, seq, seed, device, dtype, cfg)
