"""pytorch/examples mnist_forward_forward: Hinton's Forward-Forward algorithm, each layer trained on
its own with a local loss, no backpropagation between layers. ``overlay_y_on_x`` writes the label
one-hot into the first 10 pixels of each flattened image (``x_[:, :classes] *= 0.0``, then
``x_[range(n), y] = x.max()``); ``get_y_neg`` draws a wrong label per sample (a Python loop with
``.item()`` and ``torch.randint``). ``Net`` keeps its layers in a plain Python list (not a
ModuleList); ``Layer`` subclasses ``nn.Linear``, owns an ``Adam(self.parameters(), lr=args.lr)``,
normalises its input (``x / (x.norm(2, 1, keepdim=True) + 1e-4)``) before ``torch.mm(x_direction,
self.weight.T) + self.bias.unsqueeze(0)`` and a ReLU, and overrides ``nn.Module.train`` with its
training loop: ``for i in range(self.num_epochs)``: goodness ``g_pos = self.forward(x_pos).pow(2)
.mean(1)`` and ``g_neg`` likewise, ``loss = torch.log1p(torch.exp(torch.cat([-g_pos + threshold,
g_neg - threshold]))).mean()``, ``self.opt.zero_grad()``, ``loss.backward()``, ``self.opt.step()``,
``print("Loss: ", loss.item())`` every ``log_interval`` iterations; it then returns both
datasets passed through the trained layer, detached, as the next layer's inputs. ``Net.train``
trains the layers in turn; ``predict`` scores each of the 10 labels overlaid by the summed
goodness of every layer and takes the argmax (train and test error printed).

What is compiled: one iteration of ``Layer.train``'s loop (the body of ``for i in
range(self.num_epochs)``, the logging ``if`` included), moved verbatim into a method
``Layer.train_iteration(self, x_pos, x_neg, i)`` on which the user puts ``@stepgraph.compile``
(done here in ``main`` with ``sg.compile``, the harness's decorator); ``Layer.train`` calls it once
per iteration. One compiled method serves both layers: the layer (``self``) is its first argument,
so the second layer is new state to it (and its input has another width). It returns the loss so
that the harness can log it. Everything else (``overlay_y_on_x``, ``get_y_neg``, the detached
outputs handed to the next layer, ``predict``) runs as the program writes it.

Source: https://github.com/pytorch/examples/blob/77f55b912142e11fcfdf5b530231fb9c52f181e8/mnist_forward_forward/main.py
BSD-3-Clause (pytorch/examples; the file credits Mohammad Pezeshki's MIT-licensed
pytorch_forward_forward). Restated after the source, not copied: same modules, names, ops and
order. At this commit the loss uses ``torch.log1p(torch.exp(...))`` (changed from ``torch.log(1 +
torch.exp(...))`` in cdef4d4). Deviations: MNIST (torchvision download, ``Normalize((0.1307,),
(0.3081,))``, flattened) replaced by synthetic normalised 784-pixel images and labels in one batch as
the program's ``train_size`` loader gives it; argparse replaced by an ``args`` class; no model
file. Scaled down: train_size 50000 -> 64, test_size 10000 -> 32, dims [784, 500, 500] -> [784,
64, 64], epochs 1000 -> steps / 2 (4 per layer, so the harness's 8 steps are both layers),
log_interval 10 -> 2.
"""
import torch
import torch.nn as nn
from torch.optim import Adam

SOURCE = ("https://github.com/pytorch/examples/blob/77f55b912142e11fcfdf5b530231fb9c52f181e8/"
          "mnist_forward_forward/main.py")
LICENSE = "BSD-3-Clause"
TAGS = ("forward-forward", "local-loss", "per-layer-optimizer", "adam", "module-as-argument", "method-step",
        "train-overridden", "item-in-step", "print-in-step", "log-interval-branch")


class args:  # main.py's argparse defaults, scaled down
    epochs = 4; lr = 0.03; no_accel = True; seed = 1; save_model = False; train_size = 64; threshold = 2.0
    test_size = 32; log_interval = 2


device = torch.device("cpu")


def get_y_neg(y):
    y_neg = y.clone()
    for idx, y_samp in enumerate(y):
        allowed_indices = list(range(10))
        allowed_indices.remove(y_samp.item())
        y_neg[idx] = torch.tensor(allowed_indices)[torch.randint(len(allowed_indices), size=(1,))].item()
    return y_neg.to(device)


def overlay_y_on_x(x, y, classes=10):
    x_ = x.clone()
    x_[:, :classes] *= 0.0
    x_[range(x.shape[0]), y] = x.max()
    return x_


class Net(torch.nn.Module):
    def __init__(self, dims):
        super().__init__()
        self.layers = []
        for d in range(len(dims) - 1):
            self.layers = self.layers + [Layer(dims[d], dims[d + 1]).to(device)]

    def predict(self, x):
        goodness_per_label = []
        for label in range(10):
            h = overlay_y_on_x(x, label)
            goodness = []
            for layer in self.layers:
                h = layer(h)
                goodness = goodness + [h.pow(2).mean(1)]
            goodness_per_label += [sum(goodness).unsqueeze(1)]
        goodness_per_label = torch.cat(goodness_per_label, 1)
        return goodness_per_label.argmax(1)

    def train(self, x_pos, x_neg):
        h_pos, h_neg = x_pos, x_neg
        for i, layer in enumerate(self.layers):
            print("training layer: ", i)
            h_pos, h_neg = layer.train(h_pos, h_neg)


class Layer(nn.Linear):
    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device, dtype)
        self.relu = torch.nn.ReLU()
        self.opt = Adam(self.parameters(), lr=args.lr)
        self.threshold = args.threshold
        self.num_epochs = args.epochs

    def forward(self, x):
        x_direction = x / (x.norm(2, 1, keepdim=True) + 1e-4)
        return self.relu(torch.mm(x_direction, self.weight.T) + self.bias.unsqueeze(0))

    def train_iteration(self, x_pos, x_neg, i):   # (the loop body of train, compiled in main)
        g_pos = self.forward(x_pos).pow(2).mean(1)
        g_neg = self.forward(x_neg).pow(2).mean(1)
        loss = torch.log1p(torch.exp(torch.cat([-g_pos + self.threshold, g_neg - self.threshold]))).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        if i % args.log_interval == 0:
            print("Loss: ", loss.item())
        return loss

    def train(self, x_pos, x_neg):
        for i in range(self.num_epochs):
            loss = self.train_iteration(x_pos, x_neg, i)
            _log(loss)
        return self.forward(x_pos).detach(), self.forward(x_neg).detach()


_log = None


def main(sg, steps=8, device="cpu", amp=None):
    global _log
    globals()["device"] = torch.device(device)
    torch.manual_seed(args.seed)
    n_layers = 2
    args.epochs = max(1, steps // n_layers)
    Layer.train_iteration = sg.compile(Layer.train_iteration)   # @stepgraph.compile on the method
    _log = sg.log

    g = torch.Generator().manual_seed(1)
    # (MNIST through ToTensor, Normalize((0.1307,), (0.3081,)) and flatten: one batch of train_size)
    x = ((torch.rand(args.train_size, 784, generator=g) - 0.1307) / 0.3081).to(globals()["device"])
    y = torch.randint(0, 10, (args.train_size,), generator=g).to(globals()["device"])
    x_te = ((torch.rand(args.test_size, 784, generator=g) - 0.1307) / 0.3081).to(globals()["device"])
    y_te = torch.randint(0, 10, (args.test_size,), generator=g).to(globals()["device"])

    net = Net([784, 64, 64])
    sg.track(**{f"layer{i}": layer for i, layer in enumerate(net.layers)},
             **{f"opt{i}": layer.opt for i, layer in enumerate(net.layers)})
    x_pos = overlay_y_on_x(x, y)
    y_neg = get_y_neg(y)
    x_neg = overlay_y_on_x(x, y_neg)
    net.train(x_pos, x_neg)
    train_error = 1.0 - net.predict(x).eq(y).float().mean().item()
    print("train error:", train_error)
    test_error = 1.0 - net.predict(x_te).eq(y_te).float().mean().item()
    print("test error:", test_error)
    sg.log((train_error, test_error))
