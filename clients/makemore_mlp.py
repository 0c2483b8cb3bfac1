"""Karpathy's nn-zero-to-hero, makemore part 2 (lectures/makemore/makemore_part2_mlp.ipynb): the
Bengio et al. character MLP written with bare tensors (``C``, ``W1``, ``b1``, ``W2``, ``b2``, a
``parameters`` list with ``requires_grad = True``), trained by the lecture's hand-written loop:
the minibatch drawn *inside* the iteration (``ix = torch.randint(0, Xtr.shape[0], (32,))``, then
``C[Xtr[ix]]``), ``F.cross_entropy``, ``for p in parameters: p.grad = None``, ``loss.backward()``,
the step decay ``lr = 0.1 if i < 100000 else 0.01`` and ``for p in parameters: p.data += -lr *
p.grad``; then ``stepi.append(i)`` and ``lossi.append(loss.log10().item())``.

The step is the loop body from "minibatch construct" to "update", as a function of ``i`` (what
a user pulling the notebook's loop into a decorated function writes). The data are globals of the
notebook (``Xtr``, ``Ytr``) and so is the model. Written after the notebook (not copied: the
lookup service used does not allow committing its text). Scaled down: 300 synthetic names over
a-z instead of names.txt (``build_dataset`` with block_size 3, the 80/10/10 split), hidden 64
(200), the decay at step ``steps // 2`` (100000 of 200000).
"""
import random

import torch
import torch.nn.functional as F

SOURCE = "https://github.com/karpathy/nn-zero-to-hero/blob/73c3fcc/lectures/makemore/makemore_part2_mlp.ipynb"
LICENSE = "MIT"
TAGS = ("mlp", "bare-tensors", "manual-sgd", "randint-in-step", "global-data", "lr-from-step-index",
        "grad-none")

block_size = 3


def synthetic_words(n, seed=42):
    rng = random.Random(seed)
    return ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randrange(3, 8)))
            for _ in range(n)]


def build_dataset(words, stoi):
    X, Y = [], []
    for w in words:
        context = [0] * block_size
        for ch in w + '.':
            ix = stoi[ch]
            X.append(context)
            Y.append(ix)
            context = context[1:] + [ix]  # crop and append
    return torch.tensor(X), torch.tensor(Y)


def data():
    words = synthetic_words(300)
    chars = sorted(list(set(''.join(words))))
    stoi = {s: i + 1 for i, s in enumerate(chars)}
    stoi['.'] = 0
    random.seed(42)
    random.shuffle(words)
    n1 = int(0.8 * len(words))
    n2 = int(0.9 * len(words))
    return build_dataset(words[:n1], stoi), build_dataset(words[n1:n2], stoi), len(stoi)


def main(sg, steps=8, device="cpu", amp=None):
    (Xtr, Ytr), (Xdev, Ydev), vocab_size = data()
    Xtr, Ytr, Xdev, Ydev = Xtr.to(device), Ytr.to(device), Xdev.to(device), Ydev.to(device)

    g = torch.Generator().manual_seed(2147483647)  # for reproducibility
    C = torch.randn((vocab_size, 10), generator=g).to(device)
    W1 = torch.randn((30, 64), generator=g).to(device)
    b1 = torch.randn(64, generator=g).to(device)
    W2 = torch.randn((64, vocab_size), generator=g).to(device)
    b2 = torch.randn(vocab_size, generator=g).to(device)
    parameters = [C, W1, b1, W2, b2]
    for p in parameters:
        p.requires_grad = True
    sg.track(C=C, W1=W1, b1=b1, W2=W2, b2=b2)
    decay_at = steps // 2

    @sg.compile
    def train_step(i):
        # minibatch construct
        ix = torch.randint(0, Xtr.shape[0], (32,))

        # forward pass
        emb = C[Xtr[ix]]  # (32, 3, 10)
        h = torch.tanh(emb.view(-1, 30) @ W1 + b1)  # (32, 64)
        logits = h @ W2 + b2  # (32, 27)
        loss = F.cross_entropy(logits, Ytr[ix])

        # backward pass
        for p in parameters:
            p.grad = None
        loss.backward()

        # update
        lr = 0.1 if i < decay_at else 0.01
        for p in parameters:
            p.data += -lr * p.grad
        return loss

    stepi, lossi = [], []
    for i in range(steps):
        loss = train_step(i)
        sg.log((loss, [p.grad for p in parameters]))
        # track stats
        stepi.append(i)
        lossi.append(loss.log10().item())
    sg.log(lossi)

    # the notebook's evaluation cell
    emb = C[Xdev]
    h = torch.tanh(emb.view(-1, 30) @ W1 + b1)
    logits = h @ W2 + b2
    loss = F.cross_entropy(logits, Ydev)
    sg.log(loss)
