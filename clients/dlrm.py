"""facebookresearch/dlrm ``dlrm_s_pytorch.py``: the deep learning recommendation model. A bottom
MLP on the dense features; one ``nn.EmbeddingBag(n, m, mode="sum", sparse=True)`` per categorical
feature, looked up with that table's indices and offsets (``lS_i[k]``, ``lS_o[k]``), so its
weight gets a *sparse* gradient; the "dot" interaction (``torch.cat`` of the bottom output and the
pooled embeddings, ``torch.bmm`` with its transpose, the strictly lower triangle gathered with
index lists built in Python); a top MLP ending in a sigmoid; ``BCELoss``. One ``torch.optim.SGD``
over ``dlrm.parameters()`` (sparse embedding weights and dense MLP weights together) and the
program's ``LRPolicyScheduler`` (linear warm-up, then a quadratic decay), stepped after every
``optimizer.step()``. The step is the training loop's body as the program writes it: forward
(``dlrm_wrap``), loss (``loss_fn_wrap``), ``L = E.detach().cpu().numpy()``, ``zero_grad()``,
``E.backward()``, ``optimizer.step()``, ``lr_scheduler.step()``.

Source: https://github.com/facebookresearch/dlrm/blob/090956ee2319ddd349a42232958aefccfe3f7b0a/dlrm_s_pytorch.py
and dlrm_data_pytorch.py (``generate_uniform_input_batch``, ``generate_random_output_batch``), MIT
licence, Copyright (c) Facebook, Inc. and its affiliates. Restated after the source, not copied:
the lookup service this was written with does not allow committing its text. Only the
single-process CPU path with plain EmbeddingBags is kept (no QR/MD tricks, quantisation, DDP, or
profiling); ``record_function`` scopes dropped. Scaled down: ``--arch-sparse-feature-size=4
--arch-embedding-size=40-30-50 --arch-mlp-bot=5-8-4 --arch-mlp-top=10-8-1 --mini-batch-size=6
--loss-function=bce --learning-rate=0.1 --lr-num-warmup-steps=2 --lr-decay-start-step=3
--lr-num-decay-steps=4``; the random data generator with one index per lookup
(``--num-indices-per-lookup=1 --num-indices-per-lookup-fixed=True``, the layout of the Criteo
data sets, where each categorical feature is one index), so every batch has the same shapes.
"""
import sys

import numpy as np
from numpy import random as ra
import torch
import torch.nn as nn
from torch.optim.lr_scheduler import _LRScheduler

SOURCE = "https://github.com/facebookresearch/dlrm/blob/090956ee2319ddd349a42232958aefccfe3f7b0a/dlrm_s_pytorch.py"
LICENSE = "MIT"
TAGS = ("recsys", "embeddingbag", "sparse-grad", "offsets", "sgd", "lr-warmup-decay", "bce",
        "host-read-in-step")


class args:  # the argparse flags above
    loss_function = "bce"
    arch_interaction_op = "dot"
    arch_interaction_itself = False


class LRPolicyScheduler(_LRScheduler):
    def __init__(self, optimizer, num_warmup_steps, decay_start_step, num_decay_steps):
        self.num_warmup_steps = num_warmup_steps
        self.decay_start_step = decay_start_step
        self.decay_end_step = decay_start_step + num_decay_steps
        self.num_decay_steps = num_decay_steps
        if self.decay_start_step < self.num_warmup_steps:
            sys.exit("Learning rate warmup must finish before the decay starts")
        super(LRPolicyScheduler, self).__init__(optimizer)

    def get_lr(self):
        step_count = self._step_count
        if step_count < self.num_warmup_steps:  # warm-up
            scale = 1.0 - (self.num_warmup_steps - step_count) / self.num_warmup_steps
            lr = [base_lr * scale for base_lr in self.base_lrs]
            self.last_lr = lr
        elif self.decay_start_step <= step_count and step_count < self.decay_end_step:  # decay
            decayed_steps = step_count - self.decay_start_step
            scale = ((self.num_decay_steps - decayed_steps) / self.num_decay_steps) ** 2
            min_lr = 0.0000001
            lr = [max(min_lr, base_lr * scale) for base_lr in self.base_lrs]
            self.last_lr = lr
        else:
            # after the decay, or between warm-up and decay: hold the last value
            lr = self.last_lr if self.num_decay_steps > 0 else self.base_lrs
        return lr


class DLRM_Net(nn.Module):
    def create_mlp(self, ln, sigmoid_layer):
        layers = nn.ModuleList()
        for i in range(0, ln.size - 1):
            n, m = ln[i], ln[i + 1]
            LL = nn.Linear(int(n), int(m), bias=True)
            # Xavier-style normal fill for the weight, N(0, 1/m) for the bias, drawn with numpy
            W = np.random.normal(0.0, np.sqrt(2 / (m + n)), size=(m, n)).astype(np.float32)
            bt = np.random.normal(0.0, np.sqrt(1 / m), size=m).astype(np.float32)
            LL.weight.data = torch.tensor(W, requires_grad=True)
            LL.bias.data = torch.tensor(bt, requires_grad=True)
            layers.append(LL)
            layers.append(nn.Sigmoid() if i == sigmoid_layer else nn.ReLU())
        return torch.nn.Sequential(*layers)

    def create_emb(self, m, ln):
        emb_l = nn.ModuleList()
        v_W_l = []
        for i in range(0, ln.size):
            n = ln[i]
            EE = nn.EmbeddingBag(n, m, mode="sum", sparse=True)
            W = np.random.uniform(low=-np.sqrt(1 / n), high=np.sqrt(1 / n), size=(n, m)).astype(np.float32)
            EE.weight.data = torch.tensor(W, requires_grad=True)
            v_W_l.append(None)  # (no weighted pooling)
            emb_l.append(EE)
        return emb_l, v_W_l

    def __init__(self, m_spa, ln_emb, ln_bot, ln_top, arch_interaction_op, arch_interaction_itself=False,
                 sigmoid_bot=-1, sigmoid_top=-1, loss_threshold=0.0, ndevices=-1, loss_function="mse"):
        super(DLRM_Net, self).__init__()
        self.ndevices = ndevices
        self.arch_interaction_op = arch_interaction_op
        self.arch_interaction_itself = arch_interaction_itself
        self.loss_threshold = loss_threshold
        self.loss_function = loss_function
        self.emb_l, self.v_W_l = self.create_emb(m_spa, ln_emb)
        self.bot_l = self.create_mlp(ln_bot, sigmoid_bot)
        self.top_l = self.create_mlp(ln_top, sigmoid_top)
        if self.loss_function == "mse":
            self.loss_fn = torch.nn.MSELoss(reduction="mean")
        elif self.loss_function == "bce":
            self.loss_fn = torch.nn.BCELoss(reduction="mean")

    def apply_mlp(self, x, layers):
        return layers(x)

    def apply_emb(self, lS_o, lS_i, emb_l, v_W_l):
        ly = []
        for k, sparse_index_group_batch in enumerate(lS_i):
            sparse_offset_group_batch = lS_o[k]
            per_sample_weights = None if v_W_l[k] is None else v_W_l[k].gather(0, sparse_index_group_batch)
            E = emb_l[k]
            V = E(sparse_index_group_batch, sparse_offset_group_batch, per_sample_weights=per_sample_weights)
            ly.append(V)
        return ly

    def interact_features(self, x, ly):
        if self.arch_interaction_op == "dot":
            (batch_size, d) = x.shape
            T = torch.cat([x] + ly, dim=1).view((batch_size, -1, d))
            Z = torch.bmm(T, torch.transpose(T, 1, 2))
            _, ni, nj = Z.shape
            offset = 1 if self.arch_interaction_itself else 0
            li = torch.tensor([i for i in range(ni) for j in range(i + offset)])
            lj = torch.tensor([j for i in range(nj) for j in range(i + offset)])
            Zflat = Z[:, li, lj]
            R = torch.cat([x] + [Zflat], dim=1)
        else:  # "cat"
            R = torch.cat([x] + ly, dim=1)
        return R

    def forward(self, dense_x, lS_o, lS_i):
        return self.sequential_forward(dense_x, lS_o, lS_i)

    def sequential_forward(self, dense_x, lS_o, lS_i):
        x = self.apply_mlp(dense_x, self.bot_l)
        ly = self.apply_emb(lS_o, lS_i, self.emb_l, self.v_W_l)
        z = self.interact_features(x, ly)
        p = self.apply_mlp(z, self.top_l)
        if 0.0 < self.loss_threshold and self.loss_threshold < 1.0:
            z = torch.clamp(p, min=self.loss_threshold, max=(1.0 - self.loss_threshold))
        else:
            z = p
        return z


# ---- dlrm_data_pytorch's random data (restated) ---------------------------------------------
def generate_uniform_input_batch(m_den, ln_emb, n, num_indices_per_lookup, num_indices_per_lookup_fixed):
    Xt = torch.tensor(ra.rand(n, m_den).astype(np.float32))
    lS_emb_offsets, lS_emb_indices = [], []
    for size in ln_emb:
        lS_batch_offsets, lS_batch_indices = [], []
        offset = 0
        for _ in range(n):
            if num_indices_per_lookup_fixed:
                sparse_group_size = np.int64(num_indices_per_lookup)
            else:
                r = ra.random(1)
                sparse_group_size = np.int64(np.round(max([1.0], r * min(size, num_indices_per_lookup))))
            r = ra.random(sparse_group_size)
            sparse_group = np.unique(np.round(r * (size - 1)).astype(np.int64))
            sparse_group_size = np.int32(sparse_group.size)
            lS_batch_offsets += [offset]
            lS_batch_indices += sparse_group.tolist()
            offset += sparse_group_size
        lS_emb_offsets.append(torch.tensor(lS_batch_offsets))
        lS_emb_indices.append(torch.tensor(lS_batch_indices))
    return (Xt, lS_emb_offsets, lS_emb_indices)


def generate_random_output_batch(n, num_targets, round_targets=False):
    P = ra.rand(n, num_targets).astype(np.float32)
    if round_targets:
        P = np.round(P).astype(np.float32)
    return torch.tensor(P)


def main(sg, steps=8, device="cpu", amp=None, numpy_in_step=True):
    m_spa = 4
    ln_emb = np.array([40, 30, 50])
    ln_bot = np.array([5, 8, 4])
    num_fea = ln_emb.size + 1
    num_int = (num_fea * (num_fea - 1)) // 2 + ln_bot[-1]
    ln_top = np.array([num_int, 8, 1])
    mbs = 6
    dlrm = DLRM_Net(m_spa, ln_emb, ln_bot, ln_top, arch_interaction_op=args.arch_interaction_op,
                    arch_interaction_itself=args.arch_interaction_itself, sigmoid_bot=-1,
                    sigmoid_top=ln_top.size - 2, loss_threshold=0.0, ndevices=-1,
                    loss_function=args.loss_function)
    use_gpu = device != "cpu"
    if use_gpu:  # (dlrm_s_pytorch.py: "dlrm = dlrm.to(device)  # .cuda()")
        dlrm = dlrm.to(device)
    optimizer = torch.optim.SGD(dlrm.parameters(), lr=0.1)
    lr_scheduler = LRPolicyScheduler(optimizer, 2, 3, 4)
    sg.track(dlrm=dlrm, optimizer=optimizer, lr_scheduler=lr_scheduler)
    batches = []
    for _ in range(steps):
        X, lS_o, lS_i = generate_uniform_input_batch(ln_bot[0], ln_emb, mbs, 1, True)
        T = generate_random_output_batch(mbs, 1)
        batches.append((X, torch.stack(lS_o), lS_i, T))  # collate_wrapper_random_offset stacks lS_o

    def dlrm_wrap(X, lS_o, lS_i, use_gpu, device, ndevices=1):
        if use_gpu:  # the offsets and indices move with the batch, as in dlrm_s_pytorch.py
            lS_i = [S_i.to(device) for S_i in lS_i] if isinstance(lS_i, list) else lS_i.to(device)
            lS_o = [S_o.to(device) for S_o in lS_o] if isinstance(lS_o, list) else lS_o.to(device)
        return dlrm(X.to(device), lS_o, lS_i)

    def loss_fn_wrap(Z, T, use_gpu, device):
        return dlrm.loss_fn(Z, T.to(device))

    @sg.compile
    def train_step(X, lS_o, lS_i, T):  # the body of the training loop
        Z = dlrm_wrap(X, lS_o, lS_i, use_gpu, device, ndevices=-1)
        E = loss_fn_wrap(Z, T, use_gpu, device)
        if numpy_in_step:
            L = E.detach().cpu().numpy()  # numpy array
        optimizer.zero_grad()
        E.backward()
        optimizer.step()
        lr_scheduler.step()
        return L if numpy_in_step else E


    total_loss, total_samp = 0, 0
    for j, (X, lS_o, lS_i, T) in enumerate(batches):
        L = train_step(X, lS_o, lS_i, T)
        if not numpy_in_step:  # (dlrm_loss_outside: the fix the CaptureError names)
            L = L.detach().cpu().numpy()
        sg.log(torch.as_tensor(L))
        total_loss += L * T.shape[0]
        total_samp += T.shape[0]
    sg.log(float(total_loss / total_samp))
