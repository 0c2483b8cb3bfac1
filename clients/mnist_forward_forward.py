"""pytorch/examples mnist_forward_forward: Hinton's Forward-Forward algorithm. No backward pass across
layers: each ``Layer`` (an ``nn.Linear`` subclass that overrides ``nn.Module.train`` with its own
training loop) owns an Adam optimizer (``self.opt``, lr 0.03) and trains alone on a local "goodness"
loss, ``log1p(exp(cat([-g_pos + threshold, g_neg - threshold]))).mean()``; the next layer trains on
the previous one's detached outputs. The ``Net`` keeps its layers in a plain Python list (not a
``ModuleList``), so the net itself has no parameters.

Model: vendor/pytorch_examples/mnist_forward_forward_main.py (get_y_neg, overlay_y_on_x, Net, Layer,
verbatim). Loop: ``Net.train`` (lines 52-56) and ``Layer.train`` (70-84), reproduced here as
``net_train`` / ``layer_train`` so the loop body can be the step function: one step function, called
with the layer as ``self`` (as a user decorating the method body would), so every layer gets its own
graph; the ``loss.item()`` print every ``log_interval`` iterations is taken on the returned loss. The
__main__ block's data prep (``overlay_y_on_x``, ``get_y_neg`` with its host ``randint``) and the final
``net.predict`` train/test errors are kept. Scaled down: dims [784, 64, 64] instead of [784, 500, 500],
64 training / 32 test images (synthetic, seeded) instead of 50000 / 10000, ``--epochs`` = steps / 2
per layer instead of 1000.
"""
import torch

import clients.vendor.pytorch_examples.mnist_forward_forward_main as ff
from clients.vendor.pytorch_examples.mnist_forward_forward_main import Net, get_y_neg, overlay_y_on_x

SOURCE = "https://github.com/pytorch/examples/blob/77f55b9/mnist_forward_forward/main.py"
LICENSE = "BSD-3-Clause AND MIT"
TAGS = ("forward-forward", "local-loss", "optimizer-per-layer", "module-owns-optimizer", "method-step",
        "plain-list-of-layers", "detach-between-layers", "adam")
EXPECTED_RECAPTURES = 1  # one graph per layer: the step is called with each layer (its own weights) as self


class args:  # argparse defaults of main.py, scaled down
    epochs = 4; lr = 0.03; threshold = 2; log_interval = 10; train_size = 64; test_size = 32


def main(sg, steps=8, device="cpu", amp=None):
    device = torch.device(device)
    args.epochs = steps // 2
    ff.args, ff.device = args, device  # module globals the vendored classes read, set by main.py's __main__

    g = torch.Generator().manual_seed(1)
    # (MNIST through ToTensor, Normalize((0.1307,), (0.3081,)), flatten)
    x = ((torch.rand(args.train_size, 784, generator=g) - 0.1307) / 0.3081).to(device)
    y = torch.randint(0, 10, (args.train_size,), generator=g).to(device)
    x_te = ((torch.rand(args.test_size, 784, generator=g) - 0.1307) / 0.3081).to(device)
    y_te = torch.randint(0, 10, (args.test_size,), generator=g).to(device)

    net = Net([784, 64, 64])
    for i, layer in enumerate(net.layers):
        sg.track(**{f"layer{i}": layer, f"layer{i}_opt": layer.opt})

    @sg.compile
    def train_step(self, x_pos, x_neg):
        g_pos = self.forward(x_pos).pow(2).mean(1)
        g_neg = self.forward(x_neg).pow(2).mean(1)
        loss = torch.log1p(
            torch.exp(
                torch.cat([-g_pos + self.threshold, g_neg - self.threshold])
            )
        ).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return loss

    def layer_train(self, x_pos, x_neg):
        for i in range(self.num_epochs):
            loss = train_step(self, x_pos, x_neg)
            sg.log(loss)
            if i % args.log_interval == 0:
                loss.item()  # print("Loss: ", loss.item())
        return self.forward(x_pos).detach(), self.forward(x_neg).detach()

    def net_train(self, x_pos, x_neg):
        h_pos, h_neg = x_pos, x_neg
        for i, layer in enumerate(self.layers):
            h_pos, h_neg = layer_train(layer, h_pos, h_neg)  # (print("training layer: ", i))

    x_pos = overlay_y_on_x(x, y)
    y_neg = get_y_neg(y)
    x_neg = overlay_y_on_x(x, y_neg)
    net_train(net, x_pos, x_neg)
    sg.log(1.0 - net.predict(x).eq(y).float().mean().item())        # "train error:"
    sg.log(1.0 - net.predict(x_te).eq(y_te).float().mean().item())  # "test error:"
