"""jayroxis/PINNs, Burgers: a physics-informed neural network (the PyTorch port of Raissi,
Perdikaris and Karniadakis's PINNs) for the viscous Burgers equation u_t + l1 u u_x - l2 u_xx = 0,
the data-driven discovery notebook ("Burgers Identification (PyTorch)"), whose training is an Adam
phase (``train(nIter)``) followed by an L-BFGS phase (``self.optimizer.step(self.loss_func)``).

``DNN``: an ``nn.Sequential`` of ``OrderedDict`` ``layer_i`` Linear / ``activation_i`` Tanh
(default init). ``PhysicsInformedNN`` holds the training points as
``torch.tensor(X[:, 0:1], requires_grad=True).float()`` -- a float64 leaf that requires grad,
cast to float32, so ``self.x`` / ``self.t`` are *non-leaf* tensors with a ``ToCopyBackward0``
grad_fn made once, before training -- the unknown PDE coefficients ``lambda_1 = 0`` and
``lambda_2 = -6`` as ``nn.Parameter``s registered on the DNN (``dnn.register_parameter``), and
``torch.optim.Adam(self.dnn.parameters())`` with its defaults. ``net_f`` is the residual:
``u = dnn(cat([x, t], 1))``, then ``torch.autograd.grad(u, t, grad_outputs=torch.ones_like(u),
retain_graph=True, create_graph=True)`` for u_t, the same in x for u_x, and again on u_x for
u_xx, ``f = u_t + lambda_1 * u * u_x - exp(lambda_2) * u_xx``. The Adam loop body (``train``):
``loss = mean((u - u_pred) ** 2) + mean(f_pred ** 2)``, ``optimizer_Adam.zero_grad()``,
``loss.backward()`` (a double backward through the autograd.grad graphs, and on through the
inputs' ToCopyBackward0 into their hidden float64 leaves), ``optimizer_Adam.step()``; every 100
epochs it prints ``loss.item()``, ``lambda_1.item()`` and ``torch.exp(lambda_2).item()``.

The step function is that loop body (the ``epoch`` loop and its print stay outside, the print
read from the returned loss and the parameters). The L-BFGS phase is left out: the corpus's
time_sequence_prediction client covers ``LBFGS.step(closure)`` (its ``loss_func`` is the same
loss with ``self.iter`` counting and the print inside the closure).

Source: https://github.com/jayroxis/PINNs/blob/fcc37d2fb2c920eebddd29ea141bf9b3caba4d92/Burgers%20Equation/Burgers%20Identification%20(PyTorch).ipynb
The repository states no licence (its README credits Raissi et al.'s PINNs,
https://github.com/maziarraissi/PINNs, MIT); restated after the source, not copied: same
modules, names, ops and init. Scaled down: layers [2, 20 x 8, 1] -> [2, 10, 10, 10, 1],
N_u 2000 -> 64 points drawn (``np.random.choice`` as there) from a synthetic 32 x 16 (x, t)
grid standing in for burgers_shock.mat (u = -sin(pi x) exp(-t)), the print interval 100 -> 4.
``warnings.filterwarnings('ignore')`` and the plots are left out.
"""
from collections import OrderedDict

import numpy as np
import torch

SOURCE = ("https://github.com/jayroxis/PINNs/blob/fcc37d2fb2c920eebddd29ea141bf9b3caba4d92/"
          "Burgers%20Equation/Burgers%20Identification%20(PyTorch).ipynb")
LICENSE = "none stated (restated; PINNs by Raissi et al.: MIT)"
TAGS = ("pinn", "pde", "autograd.grad", "create_graph", "double-backward", "second-derivative",
        "non-leaf-input-requires-grad", "registered-parameter", "adam", "mlp", "tanh")


class DNN(torch.nn.Module):
    def __init__(self, layers):
        super(DNN, self).__init__()
        self.depth = len(layers) - 1
        self.activation = torch.nn.Tanh

        layer_list = list()
        for i in range(self.depth - 1):
            layer_list.append(('layer_%d' % i, torch.nn.Linear(layers[i], layers[i + 1])))
            layer_list.append(('activation_%d' % i, self.activation()))
        layer_list.append(('layer_%d' % (self.depth - 1), torch.nn.Linear(layers[-2], layers[-1])))
        layerDict = OrderedDict(layer_list)

        self.layers = torch.nn.Sequential(layerDict)

    def forward(self, x):
        out = self.layers(x)
        return out


class PhysicsInformedNN():
    def __init__(self, X, u, layers, lb, ub, device):
        # domain bounds (kept, unused, as there)
        self.lb = torch.tensor(lb).float().to(device)
        self.ub = torch.tensor(ub).float().to(device)

        # data: float64 leaves that require grad, cast to float32 (non-leaf tensors)
        self.x = torch.tensor(X[:, 0:1], requires_grad=True).float().to(device)
        self.t = torch.tensor(X[:, 1:2], requires_grad=True).float().to(device)
        self.u = torch.tensor(u).float().to(device)

        # the unknown coefficients
        self.lambda_1 = torch.tensor([0.0], requires_grad=True).to(device)
        self.lambda_2 = torch.tensor([-6.0], requires_grad=True).to(device)
        self.lambda_1 = torch.nn.Parameter(self.lambda_1)
        self.lambda_2 = torch.nn.Parameter(self.lambda_2)

        self.dnn = DNN(layers).to(device)
        self.dnn.register_parameter('lambda_1', self.lambda_1)
        self.dnn.register_parameter('lambda_2', self.lambda_2)

        # (the L-BFGS optimizer of the second phase is built here too; that phase is left out)
        self.optimizer_Adam = torch.optim.Adam(self.dnn.parameters())
        self.iter = 0

    def net_u(self, x, t):
        u = self.dnn(torch.cat([x, t], dim=1))
        return u

    def net_f(self, x, t):
        """The residual of the PDE, by autograd."""
        lambda_1 = self.lambda_1
        lambda_2 = torch.exp(self.lambda_2)
        u = self.net_u(x, t)

        u_t = torch.autograd.grad(u, t, grad_outputs=torch.ones_like(u),
                                  retain_graph=True, create_graph=True)[0]
        u_x = torch.autograd.grad(u, x, grad_outputs=torch.ones_like(u),
                                  retain_graph=True, create_graph=True)[0]
        u_xx = torch.autograd.grad(u_x, x, grad_outputs=torch.ones_like(u_x),
                                   retain_graph=True, create_graph=True)[0]

        f = u_t + lambda_1 * u * u_x - lambda_2 * u_xx
        return f


def main(sg, steps=8, device="cpu", amp=None):
    nu = 0.01 / np.pi   # (the true lambda_2, for the error print)
    N_u = 64
    layers = [2, 10, 10, 10, 1]

    # synthetic stand-in for burgers_shock.mat: x in [-1, 1] (32), t in [0, 1) (16)
    x = np.linspace(-1, 1, 32)[:, None]
    t = np.linspace(0, 0.99, 16)[:, None]
    X, T = np.meshgrid(x, t)
    Exact = -np.sin(np.pi * X) * np.exp(-T)
    X_star = np.hstack((X.flatten()[:, None], T.flatten()[:, None]))
    u_star = Exact.flatten()[:, None]
    lb = X_star.min(0)
    ub = X_star.max(0)

    idx = np.random.choice(X_star.shape[0], N_u, replace=False)
    X_u_train = X_star[idx, :]
    u_train = u_star[idx, :]

    model = PhysicsInformedNN(X_u_train, u_train, layers, lb, ub, device)
    sg.track(dnn=model.dnn, optimizer_Adam=model.optimizer_Adam)

    @sg.compile
    def adam_step():
        u_pred = model.net_u(model.x, model.t)
        f_pred = model.net_f(model.x, model.t)
        loss = torch.mean((model.u - u_pred) ** 2) + torch.mean(f_pred ** 2)

        # Backward and optimize
        model.optimizer_Adam.zero_grad()
        loss.backward()
        model.optimizer_Adam.step()
        return loss

    # model.train(nIter): the Adam phase
    model.dnn.train()
    for epoch in range(steps):
        loss = adam_step()
        sg.log(loss)
        if epoch % 4 == 0:
            sg.log((loss.item(), model.lambda_1.item(), torch.exp(model.lambda_2).item()))   # the print
    # (not the program's: the grads its backwards accumulated in the inputs' hidden float64 leaves)
    sg.log([_leaf_of(model.x).grad, _leaf_of(model.t).grad])


def _leaf_of(x):
    fn = x.grad_fn
    while not hasattr(fn, "variable"):
        fn = fn.next_functions[0][0]
    return fn.variable
