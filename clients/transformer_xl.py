"""kimiyoung/transformer-xl (pytorch/): Transformer-XL language-model training with segment-level
recurrence. ``MemTransformerLM`` (mem_transformer.py) with the default ``attn_type=0``:
``AdaptiveEmbedding`` (``div_val=1``: one ``nn.Embedding``, ``embed.mul_(emb_scale)``),
``PositionalEmbedding`` (``torch.ger(pos_seq, inv_freq)``, sin/cos), ``RelPartialLearnableDecoderLayer``s
(``RelPartialLearnableMultiHeadAttn``: ``torch.cat([mems, w], 0)``, one ``qkv_net``, ``r_net``,
``einsum`` AC and BD terms with ``r_w_bias`` / ``r_r_bias``, ``_rel_shift`` by zero-pad-and-view,
``attn_score.mul_(scale)``, ``if attn_mask is not None and attn_mask.any().item()`` then
``masked_fill(-inf)``, softmax over ``dim=1``, ``o_net``, post-LayerNorm residual;
``PositionwiseFF`` with ``ReLU(inplace=True)``), the causal ``dec_attn_mask`` by ``torch.triu(...,
diagonal=1+mlen)`` (``.bool()``, see below), ``_update_mems`` under ``torch.no_grad()`` keeping the last ``mem_len``
hidden states of every layer ``.detach()``-ed (called with ``mlen, qlen`` in swapped order, as the
source does), and ``ProjectedAdaptiveLogSoftmax`` with no cutoffs (``-F.log_softmax(logit).gather``)
whose output layer is tied to the embedding. ``forward(data, target, *mems)`` starts from
``init_mems()`` (``torch.empty(0)`` per layer) when ``mems`` is empty and returns ``[loss] +
new_mems``. Init as train.py's ``weights_init`` (``normal(0, init_std)`` on Linear and Embedding
weights and on ``r_w_bias`` / ``r_r_bias``, LayerNorm weights ``normal(1, init_std)``, biases 0),
applied to the model and again to ``word_emb``.

Loop: train.py's ``train()``; its per-batch body is the step function: ``model.zero_grad()``,
``ret = para_model(data, target, *mems)``, ``loss, mems = ret[0], ret[1:]``,
``loss = loss.float().mean().type_as(loss)``, ``loss.backward()``, ``train_loss +=
loss.float().item()``, ``torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)``,
``optimizer.step()`` (Adam), ``train_step += 1`` and the step-wise lr annealing: during warmup
``optimizer.param_groups[0]['lr'] = curr_lr`` by hand, then ``scheduler.step(train_step)`` on
``CosineAnnealingLR(optimizer, max_step, eta_min)``; every ``log_interval`` steps the log line
(``time.time()``, ``math.exp(cur_loss)``) and ``train_loss = 0``; every ``eval_interval`` steps
``evaluate(va_iter)`` (``model.eval()``, ``reset_length``, a no-grad loop over the validation
iterator with its own ``mems`` and ``loss.float().item()``, ``model.train()``), its log lines and
the best-loss bookkeeping (``--debug``: no checkpoint files).

What a user of stepgraph changes: the body of ``for batch, (data, target, seq_len) in
enumerate(train_iter)`` is the function ``train_batch(batch, data, target, seq_len)`` decorated with
``sg.compile`` (= ``@stepgraph.compile``), defined once; ``mems`` is the enclosing function's
variable the body rebinds (``nonlocal``; ``train()`` resets it to ``tuple()`` each epoch as the
program does), the counters stay module globals (``global``), and ``if train_step ==
args.max_step: break`` is checked after the call (a ``break`` cannot leave a function). Deviations:
no argparse (an ``args`` class), no ``create_exp_dir`` (``logging`` collects the lines in a list),
no DataParallel / fp16 / apex, no CUDA-version constants in the adaptive softmax; the masks are
``.bool()`` where the source has ``.byte()`` (``masked_fill`` refuses uint8 masks since torch 2.x). Data: a
synthetic token stream through ``LMOrderedIterator`` (restated from data_utils.py) instead of
WikiText-103. Scaled down from run_wt103_base.sh (--adaptive off: a 40-token vocabulary): 16 layers
-> 2, d_model 410 -> 16, 10 heads of 41 -> 2 of 8, d_inner 2100 -> 32, dropout 0.1, tgt_len = mem_len
150 -> 5, batch 60 -> 3, max_step 200000 -> 8 with ``warmup_step`` 0 -> 3 (so both lr paths run),
log_interval 200 -> 2, eval_interval 4000 -> 4 (one validation pass inside the step at step 4),
4 batches an epoch (so ``mems`` restarts from ``tuple()`` at batch 5).

Source: https://github.com/kimiyoung/transformer-xl/blob/44781ed21dbaec88b280f74d9ae2877f52b492a5/pytorch/train.py
(and pytorch/mem_transformer.py, pytorch/data_utils.py, pytorch/utils/proj_adaptive_softmax.py at
that commit), Apache-2.0. Restated after the source, not copied: same modules, names, ops, init and
order.
"""
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

SOURCE = "https://github.com/kimiyoung/transformer-xl/blob/44781ed21dbaec88b280f74d9ae2877f52b492a5/pytorch/train.py"
LICENSE = "Apache-2.0"
TAGS = ("transformer", "lm", "recurrence-memory", "state-returned-and-fed-back", "nonlocal-rebound-tensors",
        "item-in-step", "any-item-branch", "clip-grad-norm", "adam", "lr-set-by-hand", "cosine-scheduler-in-step",
        "scheduler-step-with-epoch", "eval-in-step", "time-in-step", "tied-weights", "dropout", "einsum")


class args:  # train.py's argparse, scaled down from run_wt103_base.sh
    n_layer = 2; n_head = 2; d_head = 8; d_model = 16; d_embed = -1; d_inner = 32; dropout = 0.1; dropatt = 0.0
    init = 'normal'; emb_init = 'normal'; init_range = 0.1; emb_init_range = 0.01; init_std = 0.02
    proj_init_std = 0.01; optim = 'adam'; lr = 0.00025; mom = 0.0; scheduler = 'cosine'; warmup_step = 3
    decay_rate = 0.5; lr_min = 0.0; clip = 0.25; clip_nonemb = False; max_step = 8; batch_size = 3
    batch_chunk = 1; tgt_len = 5; eval_tgt_len = 5; ext_len = 0; mem_len = 5; not_tied = False; seed = 1111
    adaptive = False; div_val = 1; pre_lnorm = False; varlen = False; log_interval = 2; eval_interval = 4
    debug = True; same_length = False; attn_type = 0; clamp_len = -1; eta_min = 0.0; max_eval_steps = -1
    sample_softmax = -1; fp16 = False


args.tied = not args.not_tied
if args.d_embed < 0:
    args.d_embed = args.d_model


# ---------------------------------------------------------------- data_utils.py (restated)

class LMOrderedIterator(object):
    def __init__(self, data, bsz, bptt, device='cpu', ext_len=None):
        self.bsz = bsz
        self.bptt = bptt
        self.ext_len = ext_len if ext_len is not None else 0
        self.device = device
        self.n_step = data.size(0) // bsz
        data = data.narrow(0, 0, self.n_step * bsz)
        self.data = data.view(bsz, -1).t().contiguous().to(device)
        self.n_batch = (self.n_step + self.bptt - 1) // self.bptt

    def get_batch(self, i, bptt=None):
        if bptt is None:
            bptt = self.bptt
        seq_len = min(bptt, self.data.size(0) - 1 - i)
        end_idx = i + seq_len
        beg_idx = max(0, i - self.ext_len)
        data = self.data[beg_idx:end_idx]
        target = self.data[i + 1:i + 1 + seq_len]
        return data, target, seq_len

    def get_fixlen_iter(self, start=0):
        for i in range(start, self.data.size(0) - 1, self.bptt):
            yield self.get_batch(i)

    def __iter__(self):
        return self.get_fixlen_iter()


# ---------------------------------------------------------------- utils/proj_adaptive_softmax.py (restated)

class ProjectedAdaptiveLogSoftmax(nn.Module):
    """Only the ``n_clusters == 0`` path (no cutoffs) is restated: the program's config here."""

    def __init__(self, n_token, d_embed, d_proj, cutoffs, div_val=1, keep_order=False):
        super(ProjectedAdaptiveLogSoftmax, self).__init__()
        self.n_token = n_token
        self.d_embed = d_embed
        self.d_proj = d_proj
        self.cutoffs = cutoffs + [n_token]
        self.cutoff_ends = [0] + self.cutoffs
        self.div_val = div_val
        self.shortlist_size = self.cutoffs[0]
        self.n_clusters = len(self.cutoffs) - 1
        self.head_size = self.shortlist_size + self.n_clusters
        assert self.n_clusters == 0 and div_val == 1
        self.out_layers = nn.ModuleList()
        self.out_projs = nn.ParameterList()
        for i in range(len(self.cutoffs)):
            if d_proj != d_embed:
                self.out_projs.append(nn.Parameter(torch.Tensor(d_proj, d_embed)))
            else:
                self.out_projs.append(None)
        self.out_layers.append(nn.Linear(d_embed, n_token))
        self.keep_order = keep_order

    def _compute_logit(self, hidden, weight, bias, proj):
        if proj is None:
            logit = F.linear(hidden, weight, bias=bias)
        else:
            proj_hid = F.linear(hidden, proj.t().contiguous())
            logit = F.linear(proj_hid, weight, bias=bias)
        return logit

    def forward(self, hidden, target, keep_order=False):
        if hidden.size(0) != target.size(0):
            raise RuntimeError('Input and target should have the same size in the batch dimension.')
        logit = self._compute_logit(hidden, self.out_layers[0].weight, self.out_layers[0].bias, self.out_projs[0])
        nll = -F.log_softmax(logit, dim=-1).gather(1, target.unsqueeze(1)).squeeze(1)
        return nll


# ---------------------------------------------------------------- mem_transformer.py (restated)

class PositionalEmbedding(nn.Module):
    def __init__(self, demb):
        super(PositionalEmbedding, self).__init__()
        self.demb = demb
        inv_freq = 1 / (10000 ** (torch.arange(0.0, demb, 2.0) / demb))
        self.register_buffer('inv_freq', inv_freq)

    def forward(self, pos_seq, bsz=None):
        sinusoid_inp = torch.ger(pos_seq, self.inv_freq)
        pos_emb = torch.cat([sinusoid_inp.sin(), sinusoid_inp.cos()], dim=-1)
        if bsz is not None:
            return pos_emb[:, None, :].expand(-1, bsz, -1)
        return pos_emb[:, None, :]


class PositionwiseFF(nn.Module):
    def __init__(self, d_model, d_inner, dropout, pre_lnorm=False):
        super(PositionwiseFF, self).__init__()
        self.d_model = d_model
        self.d_inner = d_inner
        self.dropout = dropout
        self.CoreNet = nn.Sequential(
            nn.Linear(d_model, d_inner), nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(d_inner, d_model),
            nn.Dropout(dropout),
        )
        self.layer_norm = nn.LayerNorm(d_model)
        self.pre_lnorm = pre_lnorm

    def forward(self, inp):
        if self.pre_lnorm:
            core_out = self.CoreNet(self.layer_norm(inp))
            output = core_out + inp
        else:
            core_out = self.CoreNet(inp)
            output = self.layer_norm(inp + core_out)
        return output


class RelMultiHeadAttn(nn.Module):
    def __init__(self, n_head, d_model, d_head, dropout, dropatt=0,
                 tgt_len=None, ext_len=None, mem_len=None, pre_lnorm=False):
        super(RelMultiHeadAttn, self).__init__()
        self.n_head = n_head
        self.d_model = d_model
        self.d_head = d_head
        self.dropout = dropout
        self.qkv_net = nn.Linear(d_model, 3 * n_head * d_head, bias=False)
        self.drop = nn.Dropout(dropout)
        self.dropatt = nn.Dropout(dropatt)
        self.o_net = nn.Linear(n_head * d_head, d_model, bias=False)
        self.layer_norm = nn.LayerNorm(d_model)
        self.scale = 1 / (d_head ** 0.5)
        self.pre_lnorm = pre_lnorm

    def _rel_shift(self, x, zero_triu=False):
        zero_pad = torch.zeros((x.size(0), 1, *x.size()[2:]), device=x.device, dtype=x.dtype)
        x_padded = torch.cat([zero_pad, x], dim=1)
        x_padded = x_padded.view(x.size(1) + 1, x.size(0), *x.size()[2:])
        x = x_padded[1:].view_as(x)
        if zero_triu:
            ones = torch.ones((x.size(0), x.size(1)))
            x = x * torch.tril(ones, x.size(1) - x.size(0))[:, :, None, None]
        return x

    def forward(self, w, r, attn_mask=None, mems=None):
        raise NotImplementedError


class RelPartialLearnableMultiHeadAttn(RelMultiHeadAttn):
    def __init__(self, *args, **kwargs):
        super(RelPartialLearnableMultiHeadAttn, self).__init__(*args, **kwargs)
        self.r_net = nn.Linear(self.d_model, self.n_head * self.d_head, bias=False)

    def forward(self, w, r, r_w_bias, r_r_bias, attn_mask=None, mems=None):
        qlen, rlen, bsz = w.size(0), r.size(0), w.size(1)
        if mems is not None:
            cat = torch.cat([mems, w], 0)
            if self.pre_lnorm:
                w_heads = self.qkv_net(self.layer_norm(cat))
            else:
                w_heads = self.qkv_net(cat)
            r_head_k = self.r_net(r)
            w_head_q, w_head_k, w_head_v = torch.chunk(w_heads, 3, dim=-1)
            w_head_q = w_head_q[-qlen:]
        else:
            if self.pre_lnorm:
                w_heads = self.qkv_net(self.layer_norm(w))
            else:
                w_heads = self.qkv_net(w)
            r_head_k = self.r_net(r)
            w_head_q, w_head_k, w_head_v = torch.chunk(w_heads, 3, dim=-1)

        klen = w_head_k.size(0)
        w_head_q = w_head_q.view(qlen, bsz, self.n_head, self.d_head)
        w_head_k = w_head_k.view(klen, bsz, self.n_head, self.d_head)
        w_head_v = w_head_v.view(klen, bsz, self.n_head, self.d_head)
        r_head_k = r_head_k.view(rlen, self.n_head, self.d_head)

        # attention score
        rw_head_q = w_head_q + r_w_bias
        AC = torch.einsum('ibnd,jbnd->ijbn', (rw_head_q, w_head_k))
        rr_head_q = w_head_q + r_r_bias
        BD = torch.einsum('ibnd,jnd->ijbn', (rr_head_q, r_head_k))
        BD = self._rel_shift(BD)
        attn_score = AC + BD
        attn_score.mul_(self.scale)

        # attention probability
        if attn_mask is not None and attn_mask.any().item():
            if attn_mask.dim() == 2:
                attn_score = attn_score.float().masked_fill(
                    attn_mask[None, :, :, None], -float('inf')).type_as(attn_score)
            elif attn_mask.dim() == 3:
                attn_score = attn_score.float().masked_fill(
                    attn_mask[:, :, :, None], -float('inf')).type_as(attn_score)
        attn_prob = F.softmax(attn_score, dim=1)
        attn_prob = self.dropatt(attn_prob)

        # attention vector
        attn_vec = torch.einsum('ijbn,jbnd->ibnd', (attn_prob, w_head_v))
        attn_vec = attn_vec.contiguous().view(attn_vec.size(0), attn_vec.size(1), self.n_head * self.d_head)
        attn_out = self.o_net(attn_vec)
        attn_out = self.drop(attn_out)
        if self.pre_lnorm:
            output = w + attn_out
        else:
            output = self.layer_norm(w + attn_out)
        return output


class RelPartialLearnableDecoderLayer(nn.Module):
    def __init__(self, n_head, d_model, d_head, d_inner, dropout, **kwargs):
        super(RelPartialLearnableDecoderLayer, self).__init__()
        self.dec_attn = RelPartialLearnableMultiHeadAttn(n_head, d_model, d_head, dropout, **kwargs)
        self.pos_ff = PositionwiseFF(d_model, d_inner, dropout, pre_lnorm=kwargs.get('pre_lnorm'))

    def forward(self, dec_inp, r, r_w_bias, r_r_bias, dec_attn_mask=None, mems=None):
        output = self.dec_attn(dec_inp, r, r_w_bias, r_r_bias, attn_mask=dec_attn_mask, mems=mems)
        output = self.pos_ff(output)
        return output


class AdaptiveEmbedding(nn.Module):
    """The ``div_val == 1`` path."""

    def __init__(self, n_token, d_embed, d_proj, cutoffs, div_val=1, sample_softmax=False):
        super(AdaptiveEmbedding, self).__init__()
        self.n_token = n_token
        self.d_embed = d_embed
        self.cutoffs = cutoffs + [n_token]
        self.div_val = div_val
        self.d_proj = d_proj
        self.emb_scale = d_proj ** 0.5
        self.cutoff_ends = [0] + self.cutoffs
        self.emb_layers = nn.ModuleList()
        self.emb_projs = nn.ParameterList()
        assert div_val == 1
        self.emb_layers.append(nn.Embedding(n_token, d_embed, sparse=sample_softmax > 0))
        if d_proj != d_embed:
            self.emb_projs.append(nn.Parameter(torch.Tensor(d_proj, d_embed)))

    def forward(self, inp):
        embed = self.emb_layers[0](inp)
        if self.d_proj != self.d_embed:
            embed = F.linear(embed, self.emb_projs[0])
        embed.mul_(self.emb_scale)
        return embed


class MemTransformerLM(nn.Module):
    def __init__(self, n_token, n_layer, n_head, d_model, d_head, d_inner, dropout, dropatt, tie_weight=True,
                 d_embed=None, div_val=1, tie_projs=[False], pre_lnorm=False, tgt_len=None, ext_len=None,
                 mem_len=None, cutoffs=[], adapt_inp=False, same_length=False, attn_type=0, clamp_len=-1,
                 sample_softmax=-1):
        super(MemTransformerLM, self).__init__()
        self.n_token = n_token
        d_embed = d_model if d_embed is None else d_embed
        self.d_embed = d_embed
        self.d_model = d_model
        self.n_head = n_head
        self.d_head = d_head
        self.word_emb = AdaptiveEmbedding(n_token, d_embed, d_model, cutoffs, div_val=div_val)
        self.drop = nn.Dropout(dropout)
        self.n_layer = n_layer
        self.tgt_len = tgt_len
        self.mem_len = mem_len
        self.ext_len = ext_len
        self.max_klen = tgt_len + ext_len + mem_len
        self.attn_type = attn_type
        assert attn_type == 0
        self.layers = nn.ModuleList()
        for i in range(n_layer):
            self.layers.append(RelPartialLearnableDecoderLayer(
                n_head, d_model, d_head, d_inner, dropout, tgt_len=tgt_len, ext_len=ext_len, mem_len=mem_len,
                dropatt=dropatt, pre_lnorm=pre_lnorm))
        self.sample_softmax = sample_softmax
        assert sample_softmax <= 0
        self.crit = ProjectedAdaptiveLogSoftmax(n_token, d_embed, d_model, cutoffs, div_val=div_val)
        if tie_weight:
            for i in range(len(self.crit.out_layers)):
                self.crit.out_layers[i].weight = self.word_emb.emb_layers[i].weight
        if tie_projs:
            for i, tie_proj in enumerate(tie_projs):
                if tie_proj and div_val == 1 and d_model != d_embed:
                    self.crit.out_projs[i] = self.word_emb.emb_projs[0]
                elif tie_proj and div_val != 1:
                    self.crit.out_projs[i] = self.word_emb.emb_projs[i]
        self.same_length = same_length
        self.clamp_len = clamp_len
        self._create_params()

    def _create_params(self):
        self.pos_emb = PositionalEmbedding(self.d_model)
        self.r_w_bias = nn.Parameter(torch.Tensor(self.n_head, self.d_head))
        self.r_r_bias = nn.Parameter(torch.Tensor(self.n_head, self.d_head))

    def reset_length(self, tgt_len, ext_len, mem_len):
        self.tgt_len = tgt_len
        self.mem_len = mem_len
        self.ext_len = ext_len

    def init_mems(self):
        if self.mem_len > 0:
            mems = []
            param = next(self.parameters())
            for i in range(self.n_layer + 1):
                empty = torch.empty(0, dtype=param.dtype, device=param.device)
                mems.append(empty)
            return mems
        return None

    def _update_mems(self, hids, mems, qlen, mlen):
        if mems is None:
            return None
        assert len(hids) == len(mems), 'len(hids) != len(mems)'
        with torch.no_grad():
            new_mems = []
            end_idx = mlen + max(0, qlen - 0 - self.ext_len)
            beg_idx = max(0, end_idx - self.mem_len)
            for i in range(len(hids)):
                cat = torch.cat([mems[i], hids[i]], dim=0)
                new_mems.append(cat[beg_idx:end_idx].detach())
        return new_mems

    def _forward(self, dec_inp, mems=None):
        qlen, bsz = dec_inp.size()
        word_emb = self.word_emb(dec_inp)
        mlen = mems[0].size(0) if mems is not None else 0
        klen = mlen + qlen
        if self.same_length:
            all_ones = word_emb.new_ones(qlen, klen)
            mask_len = klen - self.mem_len
            mask_shift_len = qlen - mask_len if mask_len > 0 else qlen
            dec_attn_mask = (torch.triu(all_ones, 1 + mlen) + torch.tril(all_ones, -mask_shift_len)).bool()[:, :, None]
        else:
            dec_attn_mask = torch.triu(word_emb.new_ones(qlen, klen), diagonal=1 + mlen).bool()[:, :, None]

        hids = []
        pos_seq = torch.arange(klen - 1, -1, -1.0, device=word_emb.device, dtype=word_emb.dtype)
        if self.clamp_len > 0:
            pos_seq.clamp_(max=self.clamp_len)
        pos_emb = self.pos_emb(pos_seq)
        core_out = self.drop(word_emb)
        pos_emb = self.drop(pos_emb)
        hids.append(core_out)
        for i, layer in enumerate(self.layers):
            mems_i = None if mems is None else mems[i]
            core_out = layer(core_out, pos_emb, self.r_w_bias, self.r_r_bias, dec_attn_mask=dec_attn_mask,
                             mems=mems_i)
            hids.append(core_out)
        core_out = self.drop(core_out)
        new_mems = self._update_mems(hids, mems, mlen, qlen)   # (sic: the source's argument order)
        return core_out, new_mems

    def forward(self, data, target, *mems):
        if not mems:
            mems = self.init_mems()
        tgt_len = target.size(0)
        hidden, new_mems = self._forward(data, mems=mems)
        pred_hid = hidden[-tgt_len:]
        loss = self.crit(pred_hid.view(-1, pred_hid.size(-1)), target.view(-1))
        loss = loss.view(tgt_len, -1)
        if new_mems is None:
            return [loss]
        return [loss] + new_mems


# ---------------------------------------------------------------- train.py (restated)

def init_weight(weight):
    if args.init == 'uniform':
        nn.init.uniform_(weight, -args.init_range, args.init_range)
    elif args.init == 'normal':
        nn.init.normal_(weight, 0.0, args.init_std)


def init_bias(bias):
    nn.init.constant_(bias, 0.0)


def weights_init(m):
    classname = m.__class__.__name__
    if classname.find('Linear') != -1:
        if hasattr(m, 'weight') and m.weight is not None:
            init_weight(m.weight)
        if hasattr(m, 'bias') and m.bias is not None:
            init_bias(m.bias)
    elif classname.find('AdaptiveEmbedding') != -1:
        if hasattr(m, 'emb_projs'):
            for i in range(len(m.emb_projs)):
                if m.emb_projs[i] is not None:
                    nn.init.normal_(m.emb_projs[i], 0.0, args.proj_init_std)
    elif classname.find('Embedding') != -1:
        if hasattr(m, 'weight'):
            init_weight(m.weight)
    elif classname.find('ProjectedAdaptiveLogSoftmax') != -1:
        if hasattr(m, 'out_projs'):
            for i in range(len(m.out_projs)):
                if m.out_projs[i] is not None:
                    nn.init.normal_(m.out_projs[i], 0.0, args.proj_init_std)
    elif classname.find('LayerNorm') != -1:
        if hasattr(m, 'weight'):
            nn.init.normal_(m.weight, 1.0, args.init_std)
        if hasattr(m, 'bias') and m.bias is not None:
            init_bias(m.bias)
    elif classname.find('TransformerLM') != -1:
        if hasattr(m, 'r_w_bias'):
            init_weight(m.r_w_bias)
        if hasattr(m, 'r_r_bias'):
            init_weight(m.r_r_bias)


log_lines = []


def logging(s):   # (create_exp_dir's logger: print and append to log.txt)
    log_lines.append(s)


# train.py's module-level training state
train_step = 0
train_loss = 0
best_val_loss = None
log_start_time = 0.0
eval_start_time = 0.0
epoch = 0

TOKENS = 40


def main(sg, steps=8, device="cpu", amp=None):
    global train_step, train_loss, best_val_loss, log_start_time, eval_start_time, epoch
    device = torch.device(device)
    args.max_step = steps

    # synthetic corpus: 4 training batches an epoch, 2 validation batches
    g = torch.Generator().manual_seed(1)
    train_data = torch.randint(0, TOKENS, (args.batch_size * (4 * args.tgt_len + 1),), generator=g)
    valid_data = torch.randint(0, TOKENS, (10 * (2 * args.eval_tgt_len + 1),), generator=g)
    ntokens = TOKENS
    eval_batch_size = 10
    tr_iter = LMOrderedIterator(train_data, args.batch_size, args.tgt_len, device=device, ext_len=args.ext_len)
    va_iter = LMOrderedIterator(valid_data, eval_batch_size, args.eval_tgt_len, device=device, ext_len=args.ext_len)
    cutoffs, tie_projs = [], [False]

    model = MemTransformerLM(ntokens, args.n_layer, args.n_head, args.d_model, args.d_head, args.d_inner,
                             args.dropout, args.dropatt, tie_weight=args.tied, d_embed=args.d_embed,
                             div_val=args.div_val, tie_projs=tie_projs, pre_lnorm=args.pre_lnorm,
                             tgt_len=args.tgt_len, ext_len=args.ext_len, mem_len=args.mem_len, cutoffs=cutoffs,
                             same_length=args.same_length, attn_type=args.attn_type, clamp_len=args.clamp_len,
                             sample_softmax=args.sample_softmax)
    model.apply(weights_init)
    model.word_emb.apply(weights_init)
    para_model = model.to(device)

    optimizer = optim.Adam(model.parameters(), lr=args.lr)
    scheduler = optim.lr_scheduler.CosineAnnealingLR(optimizer, args.max_step, eta_min=args.eta_min)
    sg.track(model=model, optimizer=optimizer, scheduler=scheduler)

    def evaluate(eval_iter):
        model.eval()
        if args.mem_len == 0:
            model.reset_length(args.eval_tgt_len, args.ext_len + args.tgt_len - args.eval_tgt_len, args.mem_len)
        else:
            model.reset_length(args.eval_tgt_len, args.ext_len, args.mem_len + args.tgt_len - args.eval_tgt_len)
        total_len, total_loss = 0, 0.
        with torch.no_grad():
            mems = tuple()
            for i, (data, target, seq_len) in enumerate(eval_iter):
                if args.max_eval_steps > 0 and i >= args.max_eval_steps:
                    break
                ret = model(data, target, *mems)
                loss, mems = ret[0], ret[1:]
                loss = loss.mean()
                total_loss += seq_len * loss.float().item()
                total_len += seq_len
        model.reset_length(args.tgt_len, args.ext_len, args.mem_len)
        model.train()
        return total_loss / total_len

    mems = tuple()

    @sg.compile
    def train_batch(batch, data, target, seq_len):   # the body of train()'s loop
        global train_step, train_loss, best_val_loss, eval_start_time, log_start_time
        nonlocal mems
        model.zero_grad()
        ret = para_model(data, target, *mems)
        loss, mems = ret[0], ret[1:]
        loss = loss.float().mean().type_as(loss)
        loss.backward()
        train_loss += loss.float().item()

        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()

        # step-wise learning rate annealing
        train_step += 1
        if args.scheduler in ['cosine', 'constant', 'dev_perf']:
            if train_step < args.warmup_step:   # linear warmup stage
                curr_lr = args.lr * train_step / args.warmup_step
                optimizer.param_groups[0]['lr'] = curr_lr
            else:
                if args.scheduler == 'cosine':
                    scheduler.step(train_step)

        if train_step % args.log_interval == 0:
            cur_loss = train_loss / args.log_interval
            elapsed = time.time() - log_start_time
            log_str = '| epoch {:3d} step {:>8d} | {:>6d} batches | lr {:.3g} ' \
                      '| ms/batch {:5.2f} | loss {:5.2f}'.format(
                          epoch, train_step, batch + 1, optimizer.param_groups[0]['lr'],
                          elapsed * 1000 / args.log_interval, cur_loss)
            log_str += ' | ppl {:9.3f}'.format(math.exp(cur_loss))
            logging(log_str)
            train_loss = 0
            log_start_time = time.time()

        if train_step % args.eval_interval == 0:
            val_loss = evaluate(va_iter)
            logging('-' * 100)
            log_str = '| Eval {:3d} at step {:>8d} | time: {:5.2f}s ' \
                      '| valid loss {:5.2f}'.format(train_step // args.eval_interval, train_step,
                                                   (time.time() - eval_start_time), val_loss)
            log_str += ' | valid ppl {:9.3f}'.format(math.exp(val_loss))
            logging(log_str)
            logging('-' * 100)
            if not best_val_loss or val_loss < best_val_loss:
                # (--debug: no model.pt / optimizer.pt)
                best_val_loss = val_loss
            eval_start_time = time.time()

    def train():
        nonlocal mems
        model.train()
        mems = tuple()
        train_iter = tr_iter
        for batch, (data, target, seq_len) in enumerate(train_iter):
            train_batch(batch, data, target, seq_len)
            sg.log((train_step, train_loss, optimizer.param_groups[0]['lr'], best_val_loss, list(mems)))
            if train_step == args.max_step:
                break

    train_step = 0
    train_loss = 0
    best_val_loss = None
    log_start_time = time.time()
    eval_start_time = time.time()
    epoch = 0
    while True:
        epoch += 1
        train()
        if train_step == args.max_step:
            logging('-' * 100)
            logging('End of training')
            break
