"""Karpathy's nn-zero-to-hero, makemore part 3 (lectures/makemore/makemore_part3_bn.ipynb), the
"deeper network" section: layers as plain Python classes "with the same API as nn.Module" --
``Linear`` (``self.out = x @ self.weight``, ``self.out += self.bias``), ``BatchNorm1d`` (batch
statistics in training, and its buffers *rebound* under ``torch.no_grad()``:
``self.running_mean = (1 - self.momentum) * self.running_mean + self.momentum * xmean``) and
``Tanh`` -- each storing its output on ``self.out``; a ``parameters`` list of bare tensors; the
lecture's loop: ``ix = torch.randint(0, Xtr.shape[0], (batch_size,), generator=g)``, the forward
through ``layers``, ``layer.out.retain_grad()`` for every layer (to plot activation gradients),
``p.grad = None``, backward, ``lr = 0.1 if i < 150000 else 0.01``, ``p.data += -lr * p.grad``;
after the step ``lossi.append(loss.log10().item())`` and the update-to-data ratios
``ud.append([((lr*p.grad).std() / p.data.std()).log10().item() for p in parameters])``. After
training: the activation and gradient statistics read from each ``Tanh``'s ``layer.out`` and
``layer.out.grad``, then ``layer.training = False`` and ``split_loss`` with the running statistics.

The step is the loop body from "minibatch construct" to "update" as a function of ``i`` that
returns ``loss, lr`` (the ratio line uses ``lr``). Written after the notebook, not copied (the
lookup service used does not allow committing its text). Scaled down: 300 synthetic names (not
names.txt), n_hidden 32 (100), decay at ``steps // 2``.
"""
import torch
import torch.nn.functional as F

from clients.makemore_mlp import data

SOURCE = "https://github.com/karpathy/nn-zero-to-hero/blob/73c3fcc/lectures/makemore/makemore_part3_bn.ipynb"
LICENSE = "MIT"
TAGS = ("mlp", "batchnorm", "plain-python-layers", "bare-tensors", "manual-sgd", "randint-generator-in-step",
        "retain-grad", "rebound-buffers", "intermediates-on-objects", "lr-from-step-index")

DEVICES = ("cpu",)  # the notebook builds everything on the default device

g = None


class Linear:

    def __init__(self, fan_in, fan_out, bias=True):
        self.weight = torch.randn((fan_in, fan_out), generator=g) / fan_in**0.5
        self.bias = torch.zeros(fan_out) if bias else None

    def __call__(self, x):
        self.out = x @ self.weight
        if self.bias is not None:
            self.out += self.bias
        return self.out

    def parameters(self):
        return [self.weight] + ([] if self.bias is None else [self.bias])


class BatchNorm1d:

    def __init__(self, dim, eps=1e-5, momentum=0.1):
        self.eps = eps
        self.momentum = momentum
        self.training = True
        # parameters (trained with backprop)
        self.gamma = torch.ones(dim)
        self.beta = torch.zeros(dim)
        # buffers (trained with a running 'momentum update')
        self.running_mean = torch.zeros(dim)
        self.running_var = torch.ones(dim)

    def __call__(self, x):
        if self.training:
            xmean = x.mean(0, keepdim=True)  # batch mean
            xvar = x.var(0, keepdim=True)  # batch variance
        else:
            xmean = self.running_mean
            xvar = self.running_var
        xhat = (x - xmean) / torch.sqrt(xvar + self.eps)  # normalize to unit variance
        self.out = self.gamma * xhat + self.beta
        # update the buffers
        if self.training:
            with torch.no_grad():
                self.running_mean = (1 - self.momentum) * self.running_mean + self.momentum * xmean
                self.running_var = (1 - self.momentum) * self.running_var + self.momentum * xvar
        return self.out

    def parameters(self):
        return [self.gamma, self.beta]


class Tanh:
    def __call__(self, x):
        self.out = torch.tanh(x)
        return self.out

    def parameters(self):
        return []


def main(sg, steps=8, device="cpu", amp=None):
    global g
    (Xtr, Ytr), (Xdev, Ydev), vocab_size = data()
    block_size = 3

    n_embd = 10  # the dimensionality of the character embedding vectors
    n_hidden = 32  # the number of neurons in the hidden layer of the MLP
    g = torch.Generator().manual_seed(2147483647)  # for reproducibility

    C = torch.randn((vocab_size, n_embd), generator=g)
    layers = [
        Linear(n_embd * block_size, n_hidden, bias=False), BatchNorm1d(n_hidden), Tanh(),
        Linear(n_hidden, n_hidden, bias=False), BatchNorm1d(n_hidden), Tanh(),
        Linear(n_hidden, n_hidden, bias=False), BatchNorm1d(n_hidden), Tanh(),
        Linear(n_hidden, n_hidden, bias=False), BatchNorm1d(n_hidden), Tanh(),
        Linear(n_hidden, n_hidden, bias=False), BatchNorm1d(n_hidden), Tanh(),
        Linear(n_hidden, vocab_size, bias=False), BatchNorm1d(vocab_size),
    ]
    with torch.no_grad():
        # last layer: make less confident
        layers[-1].gamma *= 0.1
        # all other layers: apply gain
        for layer in layers[:-1]:
            if isinstance(layer, Linear):
                layer.weight *= 1.0  # 5/3

    parameters = [C] + [p for layer in layers for p in layer.parameters()]
    for p in parameters:
        p.requires_grad = True
    sg.track(**{f"p{i}": p for i, p in enumerate(parameters)})

    max_steps = steps
    batch_size = 32
    decay_at = steps // 2

    @sg.compile
    def train_step(i):
        # minibatch construct
        ix = torch.randint(0, Xtr.shape[0], (batch_size,), generator=g)
        Xb, Yb = Xtr[ix], Ytr[ix]  # batch X,Y

        # forward pass
        emb = C[Xb]  # embed the characters into vectors
        x = emb.view(emb.shape[0], -1)  # concatenate the vectors
        for layer in layers:
            x = layer(x)
        loss = F.cross_entropy(x, Yb)  # loss function

        # backward pass
        for layer in layers:
            layer.out.retain_grad()  # AFTER_DEBUG: would take out retain_graph
        for p in parameters:
            p.grad = None
        loss.backward()

        # update
        lr = 0.1 if i < decay_at else 0.01  # step learning rate decay
        for p in parameters:
            p.data += -lr * p.grad
        return loss, lr

    lossi = []
    ud = []
    for i in range(max_steps):
        loss, lr = train_step(i)
        sg.log((loss, [p.grad for p in parameters]))
        # track stats
        lossi.append(loss.log10().item())
        with torch.no_grad():
            ud.append([((lr * p.grad).std() / p.data.std()).log10().item() for p in parameters])
    sg.log((lossi, ud))

    # visualize histograms: forward activations and their gradients, from each Tanh
    for i, layer in enumerate(layers[:-1]):
        if isinstance(layer, Tanh):
            t = layer.out
            sg.log((t.mean(), t.std(), (t.abs() > 0.97).float().mean() * 100))
            t = layer.out.grad
            sg.log((t.mean(), t.std()))
    sg.log([(l.running_mean, l.running_var) for l in layers if isinstance(l, BatchNorm1d)])

    @torch.no_grad()  # this decorator disables gradient tracking
    def split_loss(split):
        x, y = {'train': (Xtr, Ytr), 'val': (Xdev, Ydev)}[split]
        emb = C[x]  # (N, block_size, n_embd)
        x = emb.view(emb.shape[0], -1)  # concat into (N, block_size * n_embd)
        for layer in layers:
            x = layer(x)
        loss = F.cross_entropy(x, y)
        sg.log((split, loss.item()))

    # put layers into eval mode
    for layer in layers:
        layer.training = False
    split_loss('train')
    split_loss('val')
