"""senya-ashukha/real-nvp-pytorch (real-nvp-pytorch.ipynb): a RealNVP normalizing flow fitted to
the two-moons toy data by maximum likelihood. Six affine coupling layers with alternating binary
masks ([0, 1], [1, 0], x3) held as ``nn.Parameter(mask, requires_grad=False)``, a scale net
(Linear-LeakyReLU-Linear-LeakyReLU-Linear-Tanh) and a translation net (the same without the Tanh)
per layer; ``f`` runs the couplings in reverse from data to latent and accumulates
``log_det_J -= s.sum(dim=1)`` from ``x.new_zeros(batch)``; ``log_prob`` is the base
``torch.distributions.MultivariateNormal(zeros(2), eye(2))`` (a plain attribute of the module,
not a submodule: its tensors are constants the step closes over; argument validation at its
default, on) ``prior.log_prob(z) + log_det``. The loop: Adam (lr 1e-4) over the parameters with
``requires_grad``, a fresh ``make_moons(n_samples=100, noise=.05)`` batch every iteration,
``loss = -flow.log_prob(x).mean()``, ``optimizer.zero_grad()``, ``loss.backward(retain_graph=True)``
(as the notebook writes it), ``optimizer.step()``, and ``print('iter %s:' % t, 'loss = %.3f' %
loss)`` every ``print_every`` iterations.

The step is the notebook's loop body after the data line (loss, zero_grad, backward, step, the
conditional print); the batch is drawn outside it, as a DataLoader would. ``flow.sample`` /
``flow.g`` (the plotting cells) run once after training, outside the step.

Restated after the source, not copied: ``RealNVP`` (g, f, log_prob, sample), the ``nets`` /
``nett`` / ``masks`` / ``prior`` definitions and the training cell. The notebook's class reads the
global ``masks`` for its layer count; kept. sklearn is not installed here: ``make_moons`` is
restated (two half circles, shuffled, Gaussian noise, from NumPy's global RandomState as sklearn
uses it with ``random_state=None``). Scaled down: hidden width 64 (256), print_every 4 (500),
``steps`` iterations (5001).
"""
import numpy as np
import torch
from torch import distributions, nn

SOURCE = ("https://github.com/senya-ashukha/real-nvp-pytorch/blob/90c7562dc87f99073c4f4958780c5c69993e3012/"
          "real-nvp-pytorch.ipynb")
LICENSE = "none stated (public notebook)"
TAGS = ("flow", "realnvp", "density-estimation", "torch-distributions", "mask-parameter", "retain-graph",
        "adam", "item-in-step", "numpy-data", "conditional-print")

hidden = 64
print_every = 4


def make_moons(n_samples=100, noise=None):
    """sklearn.datasets.make_moons (shuffle=True, random_state=None: NumPy's global RandomState)."""
    rng = np.random.mtrand._rand
    n_out = n_samples // 2
    n_in = n_samples - n_out
    outer_x, outer_y = np.cos(np.linspace(0, np.pi, n_out)), np.sin(np.linspace(0, np.pi, n_out))
    inner_x, inner_y = 1 - np.cos(np.linspace(0, np.pi, n_in)), 1 - np.sin(np.linspace(0, np.pi, n_in)) - 0.5
    X = np.vstack([np.append(outer_x, inner_x), np.append(outer_y, inner_y)]).T
    y = np.hstack([np.zeros(n_out, dtype=np.intp), np.ones(n_in, dtype=np.intp)])
    order = np.arange(n_samples)
    rng.shuffle(order)
    X, y = X[order], y[order]
    if noise is not None:
        X += rng.normal(scale=noise, size=X.shape)
    return X, y


class RealNVP(nn.Module):
    def __init__(self, nets, nett, mask, prior):
        super().__init__()
        self.prior = prior
        self.mask = nn.Parameter(mask, requires_grad=False)
        self.t = torch.nn.ModuleList([nett() for _ in range(len(masks))])
        self.s = torch.nn.ModuleList([nets() for _ in range(len(masks))])

    def g(self, z):
        """latent -> data"""
        x = z
        for i in range(len(self.t)):
            x_ = x * self.mask[i]
            s = self.s[i](x_) * (1 - self.mask[i])
            t = self.t[i](x_) * (1 - self.mask[i])
            x = x_ + (1 - self.mask[i]) * (x * torch.exp(s) + t)
        return x

    def f(self, x):
        """data -> latent, with the log-determinant of the Jacobian"""
        log_det_J, z = x.new_zeros(x.shape[0]), x
        for i in reversed(range(len(self.t))):
            z_ = self.mask[i] * z
            s = self.s[i](z_) * (1 - self.mask[i])
            t = self.t[i](z_) * (1 - self.mask[i])
            z = (1 - self.mask[i]) * (z - t) * torch.exp(-s) + z_
            log_det_J -= s.sum(dim=1)
        return z, log_det_J

    def log_prob(self, x):
        z, logp = self.f(x)
        return self.prior.log_prob(z) + logp

    def sample(self, batchSize):
        z = self.prior.sample((batchSize, 1))
        logp = self.prior.log_prob(z)
        x = self.g(z)
        return x


masks = None


def main(sg, steps=8, device="cpu", amp=None):
    global masks
    nets = lambda: nn.Sequential(nn.Linear(2, hidden), nn.LeakyReLU(), nn.Linear(hidden, hidden), nn.LeakyReLU(),  # noqa: E731
                                 nn.Linear(hidden, 2), nn.Tanh())
    nett = lambda: nn.Sequential(nn.Linear(2, hidden), nn.LeakyReLU(), nn.Linear(hidden, hidden), nn.LeakyReLU(),  # noqa: E731
                                 nn.Linear(hidden, 2))
    masks = torch.from_numpy(np.array([[0, 1], [1, 0]] * 3).astype(np.float32))
    prior = distributions.MultivariateNormal(torch.zeros(2, device=device), torch.eye(2, device=device))
    flow = RealNVP(nets, nett, masks.to(device), prior).to(device)

    optimizer = torch.optim.Adam([p for p in flow.parameters() if p.requires_grad == True], lr=1e-4)  # noqa: E712
    sg.track(flow=flow, optimizer=optimizer)

    @sg.compile
    def train_step(x, t):
        loss = -flow.log_prob(x).mean()

        optimizer.zero_grad()
        loss.backward(retain_graph=True)
        optimizer.step()

        if t % print_every == 0:
            print('iter %s:' % t, 'loss = %.3f' % loss)
        return loss

    for t in range(steps):
        noisy_moons = make_moons(n_samples=100, noise=.05)[0].astype(np.float32)
        loss = train_step(torch.from_numpy(noisy_moons).to(device), t)
        sg.log(loss)

    # the plotting cells: map data to latent, sample from the flow
    with torch.no_grad():
        x = torch.from_numpy(make_moons(n_samples=200, noise=.05)[0].astype(np.float32)).to(device)
        z = flow.f(x)[0]
        samples = flow.sample(200)
    sg.log({"z": z, "samples": samples})
