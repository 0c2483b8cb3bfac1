"""Sweep Hugging Face transformers architectures (default settings, tiny configs, CPU) through
stepgraph, comparing bitwise with an eager twin after every call.

    OMP_NUM_THREADS=1 python scripts/sweep_hf.py [names...]        # markdown table
    python scripts/sweep_hf.py --list
    python scripts/sweep_hf.py --worker NAME OUT.json              # one architecture (internal)

Each architecture runs in its own subprocess (300 s timeout), one at a time. The training step is
the one a new user writes: ``model(**batch)``, ``loss.backward()``, ``clip_grad_norm_``, AdamW with
two param groups (no weight decay for biases / norms), ``get_scheduler("linear")`` with warm-up,
model in train mode (dropout on, default attn_implementation), padded batches with attention_mask
and -100 label padding. Eager run first, then a fresh twin under ``stepgraph.compile`` (same seed
before the build and before each call, fresh batches each call).

Per-architecture details (exception tracebacks, warnings, explain()) go to --out DIR
(default /tmp/sweep_hf/NAME.json / NAME.explain.txt).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's stepgraph

B, S, V = 4, 12, 96
CALLS = 6

# ----------------------------------------------------------------------------------- batches


def _gen(k, base=1000):
    import torch
    return torch.Generator().manual_seed(base + k)


def _lengths(g, k, n=S, lo=None, b=B):
    import torch
    lengths = torch.randint(lo or n // 2, n + 1, (b,), generator=g)
    lengths[k % b] = n
    return lengths


def mlm_batch(pad=1, mask_id=4, S=S):
    def make(k):
        import torch
        g = _gen(k)
        ids = torch.randint(5, V, (B, S), generator=g)
        mask = torch.arange(S)[None, :] < _lengths(g, k, n=S)[:, None]
        pick = (torch.rand(B, S, generator=g) < 0.25) & mask
        pick[:, 1] = True
        ids = torch.where(mask, ids, pad)
        return {"input_ids": torch.where(pick, mask_id, ids), "attention_mask": mask.long(),
                "labels": torch.where(pick, ids, -100)}
    return make


def electra_batch(pad=0):
    """ElectraForPreTraining: labels are 1 where the token was replaced, 0 otherwise."""
    def make(k):
        import torch
        g = _gen(k)
        ids = torch.randint(5, V, (B, S), generator=g)
        mask = torch.arange(S)[None, :] < _lengths(g, k)[:, None]
        repl = ((torch.rand(B, S, generator=g) < 0.15) & mask).long()
        return {"input_ids": torch.where(mask, ids, pad), "attention_mask": mask.long(), "labels": repl}
    return make


def clm_batch(pad=0, lo=5):
    def make(k):
        import torch
        g = _gen(k, 2000)
        ids = torch.randint(lo, V, (B, S), generator=g)
        mask = torch.arange(S)[None, :] < _lengths(g, k)[:, None]
        ids = torch.where(mask, ids, pad)
        return {"input_ids": ids, "attention_mask": mask.long(), "labels": torch.where(mask, ids, -100)}
    return make


def seq2seq_batch(pad=1, eos=2, lo=5, T=8):
    def make(k):
        import torch
        g = _gen(k, 3000)
        ids = torch.randint(lo, V, (B, S), generator=g)
        ln = _lengths(g, k)
        ids[torch.arange(B), ln - 1] = eos
        mask = torch.arange(S)[None, :] < ln[:, None]
        lab = torch.randint(lo, V, (B, T), generator=g)
        tl = _lengths(g, k + 1, n=T)
        lab[torch.arange(B), tl - 1] = eos
        lmask = torch.arange(T)[None, :] < tl[:, None]
        return {"input_ids": torch.where(mask, ids, pad), "attention_mask": mask.long(),
                "labels": torch.where(lmask, lab, -100)}
    return make


def tokcls_batch(pad=0, num_labels=5):
    def make(k):
        import torch
        g = _gen(k, 4500)
        ids = torch.randint(5, V, (B, S), generator=g)
        mask = torch.arange(S)[None, :] < _lengths(g, k)[:, None]
        lab = torch.randint(0, num_labels, (B, S), generator=g)
        return {"input_ids": torch.where(mask, ids, pad), "attention_mask": mask.long(),
                "labels": torch.where(mask, lab, -100)}
    return make


def seqcls_batch(pad=1, num_labels=3, lo=5):
    def make(k):
        import torch
        g = _gen(k, 4000)
        ids = torch.randint(lo, V, (B, S), generator=g)
        mask = torch.arange(S)[None, :] < _lengths(g, k)[:, None]
        return {"input_ids": torch.where(mask, ids, pad), "attention_mask": mask.long(),
                "labels": torch.randint(0, num_labels, (B,), generator=g)}
    return make


def image_batch(size=32, num_labels=3, ch=3):
    def make(k):
        import torch
        g = _gen(k, 5000)
        return {"pixel_values": torch.randn(B, ch, size, size, generator=g),
                "labels": torch.randint(0, num_labels, (B,), generator=g)}
    return make


def ctc_batch(L=800, vocab=32, T=6):
    def make(k):
        import torch
        g = _gen(k, 6000)
        ln = _lengths(g, k, n=L)
        mask = (torch.arange(L)[None, :] < ln[:, None]).long()
        labels = torch.randint(4, vocab, (B, T), generator=g)
        tl = _lengths(g, k + 1, n=T, lo=2)
        labels = torch.where(torch.arange(T)[None, :] < tl[:, None], labels, -100)
        return {"input_values": torch.randn(B, L, generator=g) * mask, "attention_mask": mask, "labels": labels}
    return make


def whisper_batch(mels=8, frames=32, T=8, eos=2, lo=5):
    def make(k):
        import torch
        g = _gen(k, 7000)
        lab = torch.randint(lo, V, (B, T), generator=g)
        tl = _lengths(g, k, n=T)
        lab[torch.arange(B), tl - 1] = eos
        return {"input_features": torch.randn(B, mels, frames, generator=g),
                "labels": torch.where(torch.arange(T)[None, :] < tl[:, None], lab, -100)}
    return make


def clip_batch(eos, pad=0):
    def make(k):
        import torch
        g = _gen(k, 8000)
        ids = torch.randint(5, V - 1, (B, S), generator=g)
        ln = _lengths(g, k)
        ids[torch.arange(B), ln - 1] = eos
        mask = torch.arange(S)[None, :] < ln[:, None]
        return {"input_ids": torch.where(mask, ids, pad), "attention_mask": mask.long(),
                "pixel_values": torch.randn(B, 3, 32, 32, generator=g), "return_loss": True}
    return make


# ------------------------------------------------------------------------------ architectures

ENC = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
DEC = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           intermediate_size=64, max_position_embeddings=64)
BARTLIKE = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)
VIT = dict(image_size=32, patch_size=8, num_channels=3, num_labels=3, **ENC)


def T():
    import transformers
    return transformers


def archs():
    """name -> (build(), batch(k)). Builders import transformers lazily (the parent does not)."""
    t = T
    return {
        # ---------------------------------------------------------------- encoders
        "roberta_mlm": (lambda: t().RobertaForMaskedLM(t().RobertaConfig(
            vocab_size=V, max_position_embeddings=S + 4, pad_token_id=1, **ENC)), mlm_batch(pad=1)),
        "xlm_roberta_mlm": (lambda: t().XLMRobertaForMaskedLM(t().XLMRobertaConfig(
            vocab_size=V, max_position_embeddings=S + 4, pad_token_id=1, **ENC)), mlm_batch(pad=1)),
        "deberta_v2_mlm": (lambda: t().DebertaV2ForMaskedLM(t().DebertaV2Config(
            vocab_size=V, max_position_embeddings=64, relative_attention=True, position_buckets=16,
            pos_att_type=["p2c", "c2p"], norm_rel_ebd="layer_norm", share_att_key=True, pad_token_id=0,
            **ENC)), mlm_batch(pad=0)),
        "albert_mlm": (lambda: t().AlbertForMaskedLM(t().AlbertConfig(
            vocab_size=V, embedding_size=16, max_position_embeddings=64, pad_token_id=0, **ENC)),
            mlm_batch(pad=0)),
        "electra_pretraining": (lambda: t().ElectraForPreTraining(t().ElectraConfig(
            vocab_size=V, embedding_size=16, max_position_embeddings=64, pad_token_id=0, **ENC)),
            electra_batch(pad=0)),
        "mpnet_mlm": (lambda: t().MPNetForMaskedLM(t().MPNetConfig(
            vocab_size=V, max_position_embeddings=S + 4, pad_token_id=1, **ENC)), mlm_batch(pad=1)),
        "funnel_mlm": (lambda: t().FunnelForMaskedLM(t().FunnelConfig(
            vocab_size=V, block_sizes=[1, 1], num_decoder_layers=1, d_model=32, n_head=2, d_head=16,
            d_inner=64, pad_token_id=0)), mlm_batch(pad=0)),
        "convbert_mlm": (lambda: t().ConvBertForMaskedLM(t().ConvBertConfig(
            vocab_size=V, embedding_size=32, max_position_embeddings=64, conv_kernel_size=5,
            pad_token_id=0, **ENC)), mlm_batch(pad=0)),
        "modernbert_mlm": (lambda: t().ModernBertForMaskedLM(t().ModernBertConfig(
            vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=64, local_attention=8, global_attn_every_n_layers=2,
            pad_token_id=1, bos_token_id=2, eos_token_id=3, cls_token_id=2, sep_token_id=3)),
            mlm_batch(pad=1)),
        # ---------------------------------------------------------------- decoders
        "gpt_neo": (lambda: t().GPTNeoForCausalLM(t().GPTNeoConfig(
            vocab_size=V, max_position_embeddings=64, hidden_size=32, num_layers=2, num_heads=2,
            attention_types=[[["global", "local"], 1]], window_size=4, intermediate_size=64,
            bos_token_id=0, eos_token_id=0)), clm_batch(pad=0)),
        "gptj": (lambda: t().GPTJForCausalLM(t().GPTJConfig(
            vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=2, rotary_dim=8,
            bos_token_id=0, eos_token_id=0)), clm_batch(pad=0)),
        "gpt_neox": (lambda: t().GPTNeoXForCausalLM(t().GPTNeoXConfig(
            vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=64, bos_token_id=0, eos_token_id=0)), clm_batch(pad=0)),
        "opt": (lambda: t().OPTForCausalLM(t().OPTConfig(
            vocab_size=V, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=2,
            max_position_embeddings=64, word_embed_proj_dim=32, pad_token_id=1, bos_token_id=2,
            eos_token_id=2)), clm_batch(pad=1)),
        "bloom": (lambda: t().BloomForCausalLM(t().BloomConfig(
            vocab_size=V, hidden_size=32, n_layer=2, n_head=2, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)), clm_batch(pad=0)),
        "falcon": (lambda: t().FalconForCausalLM(t().FalconConfig(
            vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=64, bos_token_id=1, eos_token_id=2)), clm_batch(pad=0)),
        "mistral": (lambda: t().MistralForCausalLM(t().MistralConfig(
            vocab_size=V, sliding_window=8, pad_token_id=0, bos_token_id=1, eos_token_id=2, **DEC)),
            clm_batch(pad=0)),
        "qwen2": (lambda: t().Qwen2ForCausalLM(t().Qwen2Config(
            vocab_size=V, pad_token_id=0, bos_token_id=1, eos_token_id=2, **DEC)), clm_batch(pad=0)),
        "qwen3": (lambda: t().Qwen3ForCausalLM(t().Qwen3Config(
            vocab_size=V, head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2, **DEC)),
            clm_batch(pad=0)),
        "phi": (lambda: t().PhiForCausalLM(t().PhiConfig(
            vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)), clm_batch(pad=0)),
        "phi3": (lambda: t().Phi3ForCausalLM(t().Phi3Config(
            vocab_size=V, pad_token_id=0, bos_token_id=1, eos_token_id=2, original_max_position_embeddings=64,
            **DEC)), clm_batch(pad=0)),
        "gemma": (lambda: t().GemmaForCausalLM(t().GemmaConfig(
            vocab_size=V, head_dim=8, pad_token_id=0, bos_token_id=2, eos_token_id=1, **DEC)),
            clm_batch(pad=0)),
        "gemma2": (lambda: t().Gemma2ForCausalLM(t().Gemma2Config(
            vocab_size=V, head_dim=8, query_pre_attn_scalar=8, sliding_window=8, pad_token_id=0,
            bos_token_id=2, eos_token_id=1, **DEC)), clm_batch(pad=0)),
        "stablelm": (lambda: t().StableLmForCausalLM(t().StableLmConfig(
            vocab_size=V, bos_token_id=1, eos_token_id=2, **DEC)), clm_batch(pad=0)),
        "mixtral": (lambda: t().MixtralForCausalLM(t().MixtralConfig(
            vocab_size=V, num_local_experts=4, num_experts_per_tok=2, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, **DEC)), clm_batch(pad=0)),
        "qwen2_moe": (lambda: t().Qwen2MoeForCausalLM(t().Qwen2MoeConfig(
            vocab_size=V, moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4,
            num_experts_per_tok=2, decoder_sparse_step=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            **DEC)), clm_batch(pad=0)),
        "olmoe": (lambda: t().OlmoeForCausalLM(t().OlmoeConfig(
            vocab_size=V, num_experts=4, num_experts_per_tok=2, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, **DEC)), clm_batch(pad=0)),
        "codegen": (lambda: t().CodeGenForCausalLM(t().CodeGenConfig(
            vocab_size=V, n_positions=64, n_ctx=64, n_embd=32, n_layer=2, n_head=2, rotary_dim=8,
            bos_token_id=0, eos_token_id=0)), clm_batch(pad=0)),
        # ---------------------------------------------------------------- seq2seq
        "bart": (lambda: t().BartForConditionalGeneration(t().BartConfig(
            vocab_size=V, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
            forced_eos_token_id=2, **BARTLIKE)), seq2seq_batch(pad=1, eos=2)),
        "mbart": (lambda: t().MBartForConditionalGeneration(t().MBartConfig(
            vocab_size=V, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
            forced_eos_token_id=2, **BARTLIKE)), seq2seq_batch(pad=1, eos=2)),
        "pegasus": (lambda: t().PegasusForConditionalGeneration(t().PegasusConfig(
            vocab_size=V, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
            forced_eos_token_id=1, **BARTLIKE)), seq2seq_batch(pad=0, eos=1)),
        "marian": (lambda: t().MarianMTModel(t().MarianConfig(
            vocab_size=V, pad_token_id=V - 1, eos_token_id=0, decoder_start_token_id=V - 1,
            forced_eos_token_id=0, **BARTLIKE)), seq2seq_batch(pad=V - 1, eos=0, lo=1)),
        "t5": (lambda: t().T5ForConditionalGeneration(t().T5Config(
            vocab_size=V, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
            relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)),
            seq2seq_batch(pad=0, eos=1)),
        "longt5_tglobal": (lambda: t().LongT5ForConditionalGeneration(t().LongT5Config(
            vocab_size=V, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2, local_radius=4,
            global_block_size=4, encoder_attention_type="transient-global",
            relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)),
            seq2seq_batch(pad=0, eos=1)),
        # ---------------------------------------------------------------- classification heads
        "roberta_seqcls": (lambda: t().RobertaForSequenceClassification(t().RobertaConfig(
            vocab_size=V, max_position_embeddings=S + 4, pad_token_id=1, num_labels=3, **ENC)),
            seqcls_batch(pad=1)),
        "gpt2_seqcls": (lambda: t().GPT2ForSequenceClassification(t().GPT2Config(
            vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=2, num_labels=3, pad_token_id=0,
            bos_token_id=1, eos_token_id=1)), seqcls_batch(pad=0)),
        # ---------------------------------------------------------------- vision
        "swin": (lambda: t().SwinForImageClassification(t().SwinConfig(
            image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4,
            num_labels=3)), image_batch()),
        "convnext": (lambda: t().ConvNextForImageClassification(t().ConvNextConfig(
            num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=3, image_size=32)), image_batch()),
        "resnet": (lambda: t().ResNetForImageClassification(t().ResNetConfig(
            embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic", num_labels=3)),
            image_batch()),
        "deit": (lambda: t().DeiTForImageClassification(t().DeiTConfig(**VIT)), image_batch()),
        "beit": (lambda: t().BeitForImageClassification(t().BeitConfig(**VIT)), image_batch()),
        "segformer": (lambda: t().SegformerForImageClassification(t().SegformerConfig(
            num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
            patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2],
            decoder_hidden_size=32, num_labels=3)), image_batch()),
        "mobilevit": (lambda: t().MobileViTForImageClassification(t().MobileViTConfig(
            image_size=32, patch_size=2, hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 48],
            num_attention_heads=2, num_labels=3)), image_batch()),
        "dinov2": (lambda: t().Dinov2ForImageClassification(t().Dinov2Config(
            image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            mlp_ratio=2, num_labels=3)), image_batch()),
        # ---------------------------------------------------------------- speech / multimodal
        "wav2vec2_ctc": (lambda: t().Wav2Vec2ForCTC(t().Wav2Vec2Config(
            vocab_size=32, conv_dim=(16, 16, 16), conv_stride=(5, 4, 2), conv_kernel=(10, 4, 2),
            num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, pad_token_id=0, **ENC)),
            ctc_batch()),
        "hubert_ctc": (lambda: t().HubertForCTC(t().HubertConfig(
            vocab_size=32, conv_dim=(16, 16, 16), conv_stride=(5, 4, 2), conv_kernel=(10, 4, 2),
            num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, pad_token_id=0, **ENC)),
            ctc_batch()),
        "whisper": (lambda: t().WhisperForConditionalGeneration(t().WhisperConfig(
            vocab_size=V, num_mel_bins=8, d_model=32, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
            max_source_positions=16, max_target_positions=32, pad_token_id=0, bos_token_id=3,
            eos_token_id=2, decoder_start_token_id=3, suppress_tokens=None, begin_suppress_tokens=None)),
            whisper_batch(eos=2)),
        "clip": (lambda: t().CLIPModel(t().CLIPConfig(
            text_config=dict(vocab_size=V, max_position_embeddings=S + 4, pad_token_id=0, bos_token_id=3,
                             eos_token_id=V - 1, **ENC),
            vision_config=dict(image_size=32, patch_size=8, **ENC), projection_dim=16)),
            clip_batch(eos=V - 1)),
        # ---------------------------------------------------------------- extras
        "electra_mlm": (lambda: t().ElectraForMaskedLM(t().ElectraConfig(
            vocab_size=V, embedding_size=16, max_position_embeddings=64, pad_token_id=0, **ENC)),
            mlm_batch(pad=0)),
        "bert_tokcls": (lambda: t().BertForTokenClassification(t().BertConfig(
            vocab_size=V, max_position_embeddings=64, num_labels=5, pad_token_id=0, **ENC)),
            tokcls_batch(pad=0)),
        "bigbird_mlm": (lambda: t().BigBirdForMaskedLM(t().BigBirdConfig(
            vocab_size=V, max_position_embeddings=64, block_size=2, num_random_blocks=1, pad_token_id=0,
            **ENC)), mlm_batch(pad=0, S=24)),
        "xlnet_lm": (lambda: t().XLNetLMHeadModel(t().XLNetConfig(
            vocab_size=V, d_model=32, n_layer=2, n_head=2, d_inner=64, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)), clm_batch(pad=0)),
        "mamba": (lambda: t().MambaForCausalLM(t().MambaConfig(
            vocab_size=V, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)), clm_batch(pad=0)),
        "gemma3_text": (lambda: t().Gemma3ForCausalLM(t().Gemma3TextConfig(
            vocab_size=V, head_dim=8, query_pre_attn_scalar=8, sliding_window=8, pad_token_id=0,
            bos_token_id=2, eos_token_id=1, **DEC)), clm_batch(pad=0)),
        "qwen3_moe": (lambda: t().Qwen3MoeForCausalLM(t().Qwen3MoeConfig(
            vocab_size=V, head_dim=8, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
            decoder_sparse_step=1, pad_token_id=0, bos_token_id=1, eos_token_id=2, **DEC)), clm_batch(pad=0)),
        "deepseek_v3": (lambda: t().DeepseekV3ForCausalLM(t().DeepseekV3Config(
            vocab_size=V, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=16,
            kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=64,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)), clm_batch(pad=0)),
        "switch_transformers": (lambda: t().SwitchTransformersForConditionalGeneration(t().SwitchTransformersConfig(
            vocab_size=V, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2,
            num_experts=4, expert_capacity=8, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1,
            relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)),
            seq2seq_batch(pad=0, eos=1)),
        "nllb_moe": (lambda: t().NllbMoeForConditionalGeneration(t().NllbMoeConfig(
            vocab_size=V, num_experts=4, expert_capacity=16, encoder_sparse_step=2, decoder_sparse_step=2,
            pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, **BARTLIKE)),
            seq2seq_batch(pad=1, eos=2)),
        # ------------------------------------------ the fix a refusal suggests, applied (not defaults)
        "wav2vec2_ctc+fix": (lambda: t().Wav2Vec2ForCTC(t().Wav2Vec2Config(
            vocab_size=32, conv_dim=(16, 16, 16), conv_stride=(5, 4, 2), conv_kernel=(10, 4, 2),
            num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, pad_token_id=0, mask_time_prob=0.0,
            **ENC)), ctc_batch()),
        "bigbird_mlm+fix": (lambda: t().BigBirdForMaskedLM(t().BigBirdConfig(
            vocab_size=V, max_position_embeddings=64, attention_type="original_full", pad_token_id=0,
            **ENC)), mlm_batch(pad=0, S=24)),
        "switch_transformers+fix": (lambda: t().SwitchTransformersForConditionalGeneration(
            t().SwitchTransformersConfig(
                vocab_size=V, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2,
                num_experts=4, expert_capacity=8, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1,
                router_jitter_noise=0.0, dropout_rate=0.0, relative_attention_num_buckets=8, pad_token_id=0,
                eos_token_id=1, decoder_start_token_id=0)), seq2seq_batch(pad=0, eos=1)),
    }


# ------------------------------------------------------------------------------- the worker

NO_DECAY = ("bias", "LayerNorm.weight", "layer_norm.weight", "layernorm.weight", "norm.weight")


def snapshot(model, opt, sched, loss) -> dict:
    snap = {"loss": None if loss is None else loss.detach().clone()}
    for n, p in model.named_parameters():
        snap[n] = p.detach().clone()
        snap[n + ".grad"] = None if p.grad is None else p.grad.clone()
    for n, b in model.named_buffers():
        snap["buffer:" + n] = b.detach().clone()
    for j, st in enumerate(opt.state.values()):
        for k, v in st.items():
            snap[f"opt{j}.{k}"] = v.clone() if hasattr(v, "clone") else v
    snap["lr"] = [g["lr"] for g in opt.param_groups]
    snap["sched_last_epoch"] = sched.last_epoch
    return snap


def rel_diff(a, b) -> float:
    import torch
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return float("nan")
    if a.shape != b.shape or a.dtype != b.dtype:
        return float("inf")
    a, b = a.double(), b.double()
    d = (a - b).abs()
    if torch.isnan(d).any():
        return float("nan")
    return float(d.max() / b.abs().max().clamp_min(1e-30))


def same(a, b) -> bool:
    import torch
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return a == b


def seed_all(n):
    import random
    import numpy as np
    import torch
    torch.manual_seed(n)
    np.random.seed(n)   # SpecAugment (Wav2Vec2/HuBERT), BigBird's random blocks draw with numpy
    random.seed(n)


def run_one(name, compiled, record):
    import torch
    import transformers
    import stepgraph
    build, batch = archs()[name]
    seed_all(0)
    model = build().train()
    decay = [p for n, p in model.named_parameters() if not any(s in n for s in NO_DECAY)]
    nodecay = [p for n, p in model.named_parameters() if any(s in n for s in NO_DECAY)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                             {"params": nodecay, "weight_decay": 0.0}], lr=1e-3)
    sched = transformers.get_scheduler("linear", optimizer=opt, num_warmup_steps=3, num_training_steps=20)

    def step(b):
        out = model(**b)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        return out.loss

    f = stepgraph.compile(step) if compiled else step
    snaps, times, warns = [], [], []
    import logging
    logs = []

    class Keep(logging.Handler):
        def emit(self, rec):
            logs.append(f"{rec.levelname} {rec.name}: {rec.getMessage()}")
    keep = Keep(level=logging.DEBUG)
    lg = logging.getLogger("stepgraph")
    lg.addHandler(keep)
    old_level = lg.level
    lg.setLevel(logging.INFO)
    err = None
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for k in range(CALLS):
            b = batch(k)
            seed_all(100 + k)
            t0 = time.perf_counter()
            try:
                loss = f(b)
            except BaseException as e:  # noqa: BLE001
                err = {"call": k + 1, "type": f"{type(e).__module__}.{type(e).__qualname__}",
                       "stepgraph": isinstance(e, stepgraph.StepGraphError),
                       "capture_error": isinstance(e, stepgraph.CaptureError),
                       "message": str(e), "traceback": traceback.format_exc()}
                break
            times.append(time.perf_counter() - t0)
            snaps.append(snapshot(model, opt, sched, loss))
        for x in w:
            warns.append({"category": x.category.__name__, "message": str(x.message),
                          "where": f"{x.filename}:{x.lineno}"})
    lg.removeHandler(keep)
    lg.setLevel(old_level)
    record["logs_" + ("sg" if compiled else "eager")] = logs
    record["warnings_" + ("sg" if compiled else "eager")] = warns
    record["times_" + ("sg" if compiled else "eager")] = times
    if compiled:
        s = f.stats
        record["stats"] = {"eager_calls": s.eager_calls, "captures": s.captures, "replays": s.replays,
                           "recaptures": [str(r) for r in s.recaptures],
                           "failed_captures": s.failed_captures, "guard_misses": {str(k): v for k, v in s.guard_misses.items()},
                           "capture_seconds": s.capture_seconds}
        try:
            record["explain"] = str(f.explain())
        except Exception as e:  # noqa: BLE001
            record["explain"] = f"explain() raised {type(e).__name__}: {e}\n{traceback.format_exc()}"
    return snaps, err


def worker(name, out_path):
    import torch
    torch.set_num_threads(1)
    os.environ.setdefault("STEPGRAPH_ARTIFACT_CACHE", "0")
    record = {"name": name}
    try:
        want, e_err = run_one(name, False, record)
    except BaseException as e:  # noqa: BLE001  (the build itself)
        want, e_err = [], {"call": 0, "type": type(e).__name__, "message": str(e), "traceback": traceback.format_exc()}
    record["eager_error"] = e_err
    if e_err is None:
        got, s_err = run_one(name, True, record)
        record["sg_error"] = s_err
        diffs = []
        for k, (a, b) in enumerate(zip(want, got)):
            bad = [(n, rel_diff(b.get(n), a[n])) for n in a if not same(a[n], b.get(n))]
            if bad:
                bad.sort(key=lambda x: -x[1] if x[1] == x[1] else 0)
                diffs.append({"call": k + 1, "n_bad": len(bad), "of": len(a),
                              "loss_rel": rel_diff(b["loss"], a["loss"]) if not same(a["loss"], b["loss"]) else 0.0,
                              "worst": bad[:8], "first_names": [n for n, _ in bad][:8]})
        record["diffs"] = diffs
    with open(out_path, "w") as fh:
        json.dump(record, fh, indent=1, default=str)


# ------------------------------------------------------------------------------- the parent

def classify(r) -> tuple[str, str]:
    if r.get("timeout"):
        return "CRASH", "timeout (300 s)"
    if r.get("worker_failed"):
        return "CRASH", "worker died: " + r["worker_failed"][-300:]
    if r.get("eager_error"):
        e = r["eager_error"]
        return "SKIP (eager fails)", f"{e['type']}: {e['message'][:150]}"
    st = r.get("stats", {})
    e = r.get("sg_error")
    sgw = [w for w in r.get("warnings_sg", []) if "stepgraph" in w["where"] or "stepgraph" in w["message"].lower()]
    note = f"calls {r.get('diffs') and r['diffs'][0]['call'] or '-'}"
    if r.get("diffs"):
        d = r["diffs"][0]
        return "WRONG", (f"first differs at call {d['call']}: {d['n_bad']}/{d['of']} entries, loss rel "
                         f"{d['loss_rel']:.2g}, worst {d['worst'][0][0]} ({d['worst'][0][1]:.2g})")
    if e:
        msg = e["message"].strip().splitlines()[0][:200] if e["message"].strip() else ""
        if e.get("capture_error") or e.get("stepgraph"):
            return "CLEAR-ERROR?", f"call {e['call']}: {e['type'].split('.')[-1]}: {msg}"
        return "CRASH", f"call {e['call']}: {e['type']}: {msg}"
    if st.get("captures", 0) > 2:
        return "RECAPTURES", f"{st['captures']} captures: {st.get('recaptures', [])[:2]}"
    if st.get("replays", 0) < 3:
        w = sgw[0]["message"][:200] if sgw else "no stepgraph warning"
        return "EAGER/FALLBACK", w
    del note
    return "OK", ""


def main(argv):
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="*")
    ap.add_argument("--worker", nargs=2, metavar=("NAME", "OUT"))
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--out", default="/tmp/sweep_hf")
    ap.add_argument("--timeout", type=int, default=300)
    a = ap.parse_args(argv)
    if a.worker:
        return worker(*a.worker)
    names = a.names or list(archs())
    if a.list:
        print("\n".join(names))
        return
    os.makedirs(a.out, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", STEPGRAPH_ARTIFACT_CACHE="0",
               TRANSFORMERS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    rows = []
    for name in names:
        out = os.path.join(a.out, name + ".json")
        if os.path.exists(out):
            os.remove(out)
        t0 = time.time()
        try:
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", name, out], env=env,
                               capture_output=True, text=True, timeout=a.timeout)
            if os.path.exists(out):
                r = json.load(open(out))
            else:
                r = {"name": name, "worker_failed": f"rc={p.returncode} {p.stderr[-2000:]}"}
        except subprocess.TimeoutExpired:
            r = {"name": name, "timeout": True}
        r["wall"] = time.time() - t0
        with open(out, "w") as fh:
            json.dump(r, fh, indent=1, default=str)
        if r.get("explain"):
            with open(os.path.join(a.out, name + ".explain.txt"), "w") as fh:
                fh.write(r["explain"])
        verdict, detail = classify(r)
        st = r.get("stats", {})
        te, ts = r.get("times_eager", [])[2:], r.get("times_sg", [])[2:]
        speed = ""
        if te and ts and len(te) == len(ts):
            ratio = sorted(ts)[len(ts) // 2] / sorted(te)[len(te) // 2]   # medians of calls 3..6
            speed = f"{ratio:.2f}x" + (" SLOW" if ratio > 1.5 else "")
        nw = len(r.get("warnings_sg", [])) - len(r.get("warnings_eager", []))
        rows.append((name, verdict, f"{st.get('eager_calls', '-')}/{st.get('captures', '-')}/{st.get('replays', '-')}",
                     speed, str(nw) if nw else "", detail.replace("|", "\\|").replace("\n", " ")))
        print(f"[{time.strftime('%H:%M:%S')}] {name}: {verdict} ({r['wall']:.0f}s) {detail[:160]}", file=sys.stderr,
              flush=True)
    print("| arch | verdict | eager/captures/replays | replay/eager time | extra warnings | detail |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
