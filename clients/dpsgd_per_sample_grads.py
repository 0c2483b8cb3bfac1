"""DP-SGD by hand on the PyTorch tutorial "Per-sample-gradients" (``torch.func``): the tutorial's
``SimpleCNN`` (conv1, conv2, max_pool2d, fc1, fc2, ``log_softmax``) and ``loss_fn`` (``nll_loss``),
``compute_loss(params, buffers, sample, target)`` (``sample.unsqueeze(0)``,
``functional_call(model, (params, buffers), (batch,))``), ``ft_compute_grad =
grad(compute_loss)`` and ``ft_compute_sample_grad = vmap(ft_compute_grad, in_dims=(None, None, 0,
0))`` on ``params = {k: v.detach() for k, v in model.named_parameters()}`` and the buffers; then
the DP-SGD update the tutorial names as the use (Abadi et al.'s algorithm, as Opacus does it):
each sample's gradient is clipped to ``max_grad_norm`` (its norm over all parameters; factor
``(max_grad_norm / (norm + 1e-6)).clamp(max=1.0)``), the clipped grads are summed, Gaussian noise
``torch.normal(0, noise_multiplier * max_grad_norm, size=p.shape)`` is added, the sum is divided
by the batch size and written into ``p.grad``, and ``optimizer.step()`` (SGD) runs. The whole
update (params snapshot, per-sample grads, clipping, noise, ``p.grad``, step) is one function.

What a user of stepgraph changes: that function, ``dp_sgd_step(data, targets)``, is decorated with
``sg.compile``. Variants (``main``'s keywords, used by the clients ``dpsgd_per_sample_grads_adam``
and ``dpsgd_per_sample_grads_gen``): ``optim="adam"`` (``torch.optim.Adam``), and
``noise_gen=True``: the noise drawn from a ``torch.Generator`` the program seeds and owns
(``torch.normal(..., generator=noise_generator)``, as DP code that keeps a separate secure/seeded
noise stream does).

Scaled down: 28x28 MNIST-like images -> 12x12 synthetic ones (so fc1 is 8*4*4 -> 32), conv widths
32/64 -> 4/8, fc1 128 -> 32, batch 64 -> 8; noise_multiplier 1.1, max_grad_norm 1.0, lr 0.05.

Source: https://github.com/pytorch/tutorials/blob/0bb46a4a7c3e4a4d185372221fecb5754f68fcca/intermediate_source/per_sample_grads.py
(BSD-3-Clause). Restated after the source, not copied; the DP-SGD part is written here after the
algorithm (clip per sample, sum, add noise, average).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

SOURCE = "https://github.com/pytorch/tutorials/blob/0bb46a4a7c3e4a4d185372221fecb5754f68fcca/intermediate_source/per_sample_grads.py"
LICENSE = "BSD-3-Clause"
DEVICES = ("cpu", "cuda")
TAGS = ("cnn", "torch-func", "vmap", "functional-call", "per-sample-grads", "dp-sgd", "grad-assigned",
        "noise-in-step", "torch-normal", "sgd")

batch_size = 8
noise_multiplier = 1.1
max_grad_norm = 1.0


class SimpleCNN(nn.Module):
    def __init__(self):
        super(SimpleCNN, self).__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, 1)
        self.conv2 = nn.Conv2d(4, 8, 3, 1)
        self.fc1 = nn.Linear(128, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def loss_fn(predictions, targets):
    return F.nll_loss(predictions, targets)


def main(sg, steps=8, device="cpu", amp=None, optim="sgd", noise_gen=False):
    model = SimpleCNN().to(device=device)
    if optim == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    noise_generator = torch.Generator(device=device).manual_seed(1234) if noise_gen else None
    sg.track(model=model, optimizer=optimizer)

    def compute_loss(params, buffers, sample, target):
        batch = sample.unsqueeze(0)
        targets = target.unsqueeze(0)
        predictions = functional_call(model, (params, buffers), (batch,))
        loss = loss_fn(predictions, targets)
        return loss

    ft_compute_grad = grad(compute_loss)
    ft_compute_sample_grad = vmap(ft_compute_grad, in_dims=(None, None, 0, 0))

    @sg.compile
    def dp_sgd_step(data, targets):
        params = {k: v.detach() for k, v in model.named_parameters()}
        buffers = {k: v.detach() for k, v in model.named_buffers()}
        per_sample_grads = ft_compute_sample_grad(params, buffers, data, targets)

        # clip each sample's gradient (its norm over all parameters) to max_grad_norm
        per_param_norms = [g.reshape(len(g), -1).norm(2, dim=-1) for g in per_sample_grads.values()]
        per_sample_norms = torch.stack(per_param_norms, dim=1).norm(2, dim=1)
        clip_factor = (max_grad_norm / (per_sample_norms + 1e-6)).clamp(max=1.0)

        for name, p in model.named_parameters():
            summed = torch.einsum("i,i...", clip_factor, per_sample_grads[name])
            noise = torch.normal(0, noise_multiplier * max_grad_norm, size=p.shape, device=p.device,
                                 generator=noise_generator)
            p.grad = (summed + noise) / len(data)
        optimizer.step()

        with torch.no_grad():
            loss = loss_fn(model(data), targets)
        return loss

    g = torch.Generator().manual_seed(1)
    for it in range(steps):
        data = torch.randn(batch_size, 1, 12, 12, generator=g).to(device)
        targets = torch.randint(10, (batch_size,), generator=g).to(device)
        loss = dp_sgd_step(data, targets)
        sg.log(loss)
    # (for the comparison: the noise stream's state after training, as a next draw sees it)
    sg.log(torch.randn(4, device=device, generator=noise_generator))
