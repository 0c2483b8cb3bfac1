"""zalandoresearch/pytorch-vq-vae: a VQ-VAE (van den Oord et al. 2017) on CIFAR-10 with the
exponential-moving-average codebook (``decay = 0.99`` selects ``VectorQuantizerEMA``). The model
(``Model``): ``Encoder`` (two stride-2 4x4 convs and a 3x3 conv, then a ``ResidualStack`` of
``Residual`` blocks: ReLU, 3x3 conv, ReLU, 1x1 conv, bias-free, added to the input; a final ReLU),
a 1x1 ``_pre_vq_conv`` to ``embedding_dim``, the quantizer, and a ``Decoder`` (3x3 conv,
ResidualStack, two ConvTranspose2d 4x4 stride 2). ``VectorQuantizerEMA.forward``: BCHW -> BHWC,
flattened; squared distances to the codebook (``sum(x**2) + sum(w**2) - 2 x w^T``);
``torch.argmin`` -> one-hot ``encodings`` by ``torch.zeros(...).scatter_(1, idx, 1)``; ``quantized =
encodings @ weight``; in training mode the EMA update, written as rebinding: the
``_ema_cluster_size`` buffer rebound to ``size * decay + (1 - decay) * sum(encodings, 0)``, then
Laplace smoothing (``n = torch.sum(self._ema_cluster_size.data)``, ``(size + eps) / (n + K * eps) *
n``), ``dw = encodings.t() @ flat_input``, ``self._ema_w = nn.Parameter(self._ema_w * decay + (1 -
decay) * dw)`` and ``self._embedding.weight = nn.Parameter(self._ema_w /
self._ema_cluster_size.unsqueeze(1))`` -- two new Parameters every step, not the ones the
optimizer was given; the loss is the commitment term only (``commitment_cost * mse(quantized.detach(),
inputs)``), the straight-through estimator ``inputs + (quantized - inputs).detach()``, and the
perplexity ``exp(-sum(p * log(p + 1e-10)))`` of the mean code usage. Adam (lr 1e-3,
``amsgrad=False``) on ``model.parameters()``.

Loop: the notebook's training cell: ``model.train()``, then per update ``(data, _) =
next(iter(training_loader))`` and ``data.to(device)`` (in the loop), and the body from
``optimizer.zero_grad()`` to ``optimizer.step()`` -- the model, ``recon_error =
F.mse_loss(data_recon, data) / data_variance`` (a numpy float64 global: ``np.var`` of the uint8
training images / 255), ``loss = recon_error + vq_loss``, backward, step -- as the step function,
returning ``recon_error`` and ``perplexity``; the ``.item()`` appends to
``train_res_recon_error`` / ``train_res_perplexity`` and the print every 100 updates (of
``np.mean`` of the last 100) stay in the loop.

Source: https://github.com/zalandoresearch/pytorch-vq-vae/blob/b98fde9a8f8f65486dbfaf12958049e8d33184a1/vq-vae.ipynb
(cells 7, 11, 13-15, 17-23), MIT. Restated after the source, not copied: same modules, names, ops,
init (``_embedding.weight.data.normal_()``, ``_ema_w.data.normal_()``) and order. Data: instead of
torchvision's CIFAR10 (ToTensor, Normalize((0.5, 0.5, 0.5), (1.0, 1.0, 1.0))), a synthetic uint8
array of 64 32x32x3 images through the same transform; ``pin_memory`` off (CPU). Scaled down:
batch_size 256 -> 8, num_hiddens 128 -> 16, num_residual_hiddens 32 -> 8, num_residual_layers 2,
embedding_dim 64 -> 8, num_embeddings 512 -> 16, num_training_updates 15000 -> steps, the print
every 100 -> 4 updates.
"""
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.utils.data import DataLoader, Dataset

SOURCE = ("https://github.com/zalandoresearch/pytorch-vq-vae/blob/b98fde9a8f8f65486dbfaf12958049e8d33184a1/"
          "vq-vae.ipynb")
LICENSE = "MIT"
TAGS = ("vq-vae", "ema-codebook", "argmin", "scatter-one-hot", "buffer-rebind", "parameter-rebind-in-step",
        "straight-through", "perplexity", "conv", "conv-transpose", "adam", "numpy-global", "dataloader")

xrange = range


# ---- vq-vae.ipynb (restated) ----

class VectorQuantizerEMA(nn.Module):
    def __init__(self, num_embeddings, embedding_dim, commitment_cost, decay, epsilon=1e-5):
        super(VectorQuantizerEMA, self).__init__()

        self._embedding_dim = embedding_dim
        self._num_embeddings = num_embeddings

        self._embedding = nn.Embedding(self._num_embeddings, self._embedding_dim)
        self._embedding.weight.data.normal_()
        self._commitment_cost = commitment_cost

        self.register_buffer('_ema_cluster_size', torch.zeros(num_embeddings))
        self._ema_w = nn.Parameter(torch.Tensor(num_embeddings, self._embedding_dim))
        self._ema_w.data.normal_()

        self._decay = decay
        self._epsilon = epsilon

    def forward(self, inputs):
        # BCHW -> BHWC
        inputs = inputs.permute(0, 2, 3, 1).contiguous()
        input_shape = inputs.shape

        # one row per latent vector
        flat_input = inputs.view(-1, self._embedding_dim)

        # squared distances to every codebook vector
        distances = (torch.sum(flat_input**2, dim=1, keepdim=True)
                     + torch.sum(self._embedding.weight**2, dim=1)
                     - 2 * torch.matmul(flat_input, self._embedding.weight.t()))

        # nearest code, as a one-hot row
        encoding_indices = torch.argmin(distances, dim=1).unsqueeze(1)
        encodings = torch.zeros(encoding_indices.shape[0], self._num_embeddings, device=inputs.device)
        encodings.scatter_(1, encoding_indices, 1)

        # quantize, back to the input's shape
        quantized = torch.matmul(encodings, self._embedding.weight).view(input_shape)

        # the codebook follows an exponential moving average of its assigned vectors
        if self.training:
            self._ema_cluster_size = self._ema_cluster_size * self._decay + \
                                     (1 - self._decay) * torch.sum(encodings, 0)

            # Laplace smoothing of the cluster sizes
            n = torch.sum(self._ema_cluster_size.data)
            self._ema_cluster_size = (
                (self._ema_cluster_size + self._epsilon)
                / (n + self._num_embeddings * self._epsilon) * n)

            dw = torch.matmul(encodings.t(), flat_input)
            self._ema_w = nn.Parameter(self._ema_w * self._decay + (1 - self._decay) * dw)

            self._embedding.weight = nn.Parameter(self._ema_w / self._ema_cluster_size.unsqueeze(1))

        # commitment loss only (the codebook is not trained by gradient)
        e_latent_loss = F.mse_loss(quantized.detach(), inputs)
        loss = self._commitment_cost * e_latent_loss

        # straight-through estimator
        quantized = inputs + (quantized - inputs).detach()
        avg_probs = torch.mean(encodings, dim=0)
        perplexity = torch.exp(-torch.sum(avg_probs * torch.log(avg_probs + 1e-10)))

        # BHWC -> BCHW
        return loss, quantized.permute(0, 3, 1, 2).contiguous(), perplexity, encodings


class Residual(nn.Module):
    def __init__(self, in_channels, num_hiddens, num_residual_hiddens):
        super(Residual, self).__init__()
        self._block = nn.Sequential(
            nn.ReLU(True),
            nn.Conv2d(in_channels=in_channels,
                      out_channels=num_residual_hiddens,
                      kernel_size=3, stride=1, padding=1, bias=False),
            nn.ReLU(True),
            nn.Conv2d(in_channels=num_residual_hiddens,
                      out_channels=num_hiddens,
                      kernel_size=1, stride=1, bias=False)
        )

    def forward(self, x):
        return x + self._block(x)


class ResidualStack(nn.Module):
    def __init__(self, in_channels, num_hiddens, num_residual_layers, num_residual_hiddens):
        super(ResidualStack, self).__init__()
        self._num_residual_layers = num_residual_layers
        self._layers = nn.ModuleList([Residual(in_channels, num_hiddens, num_residual_hiddens)
                                      for _ in range(self._num_residual_layers)])

    def forward(self, x):
        for i in range(self._num_residual_layers):
            x = self._layers[i](x)
        return F.relu(x)


class Encoder(nn.Module):
    def __init__(self, in_channels, num_hiddens, num_residual_layers, num_residual_hiddens):
        super(Encoder, self).__init__()
        self._conv_1 = nn.Conv2d(in_channels=in_channels, out_channels=num_hiddens // 2,
                                 kernel_size=4, stride=2, padding=1)
        self._conv_2 = nn.Conv2d(in_channels=num_hiddens // 2, out_channels=num_hiddens,
                                 kernel_size=4, stride=2, padding=1)
        self._conv_3 = nn.Conv2d(in_channels=num_hiddens, out_channels=num_hiddens,
                                 kernel_size=3, stride=1, padding=1)
        self._residual_stack = ResidualStack(in_channels=num_hiddens,
                                             num_hiddens=num_hiddens,
                                             num_residual_layers=num_residual_layers,
                                             num_residual_hiddens=num_residual_hiddens)

    def forward(self, inputs):
        x = self._conv_1(inputs)
        x = F.relu(x)

        x = self._conv_2(x)
        x = F.relu(x)

        x = self._conv_3(x)
        return self._residual_stack(x)


class Decoder(nn.Module):
    def __init__(self, in_channels, num_hiddens, num_residual_layers, num_residual_hiddens):
        super(Decoder, self).__init__()
        self._conv_1 = nn.Conv2d(in_channels=in_channels, out_channels=num_hiddens,
                                 kernel_size=3, stride=1, padding=1)
        self._residual_stack = ResidualStack(in_channels=num_hiddens,
                                             num_hiddens=num_hiddens,
                                             num_residual_layers=num_residual_layers,
                                             num_residual_hiddens=num_residual_hiddens)
        self._conv_trans_1 = nn.ConvTranspose2d(in_channels=num_hiddens, out_channels=num_hiddens // 2,
                                                kernel_size=4, stride=2, padding=1)
        self._conv_trans_2 = nn.ConvTranspose2d(in_channels=num_hiddens // 2, out_channels=3,
                                                kernel_size=4, stride=2, padding=1)

    def forward(self, inputs):
        x = self._conv_1(inputs)

        x = self._residual_stack(x)

        x = self._conv_trans_1(x)
        x = F.relu(x)

        return self._conv_trans_2(x)


class Model(nn.Module):
    def __init__(self, num_hiddens, num_residual_layers, num_residual_hiddens,
                 num_embeddings, embedding_dim, commitment_cost, decay=0):
        super(Model, self).__init__()

        self._encoder = Encoder(3, num_hiddens, num_residual_layers, num_residual_hiddens)
        self._pre_vq_conv = nn.Conv2d(in_channels=num_hiddens, out_channels=embedding_dim,
                                      kernel_size=1, stride=1)
        if decay > 0.0:
            self._vq_vae = VectorQuantizerEMA(num_embeddings, embedding_dim, commitment_cost, decay)
        else:   # (the notebook's VectorQuantizer, cell 9: not used with decay > 0)
            raise NotImplementedError("this client restates the EMA quantizer only")
        self._decoder = Decoder(embedding_dim, num_hiddens, num_residual_layers, num_residual_hiddens)

    def forward(self, x):
        z = self._encoder(x)
        z = self._pre_vq_conv(z)
        loss, quantized, perplexity, _ = self._vq_vae(z)
        x_recon = self._decoder(quantized)

        return loss, x_recon, perplexity


# ---- data: a synthetic CIFAR-10 stand-in through the notebook's transform ----

class SyntheticCIFAR10(Dataset):
    def __init__(self, n, seed):
        rng = np.random.RandomState(seed)
        self.data = rng.randint(0, 256, size=(n, 32, 32, 3), dtype=np.uint8)   # as CIFAR10.data
        self.targets = rng.randint(0, 10, size=n).tolist()

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        # transforms.ToTensor() then transforms.Normalize((0.5,0.5,0.5), (1.0,1.0,1.0))
        img = torch.from_numpy(self.data[i]).permute(2, 0, 1).float().div(255)
        return img - 0.5, self.targets[i]


# the notebook's hyper-parameters (cell 17), scaled down
batch_size = 8
num_training_updates = 15000

num_hiddens = 16
num_residual_hiddens = 8
num_residual_layers = 2

embedding_dim = 8
num_embeddings = 16

commitment_cost = 0.25

decay = 0.99

learning_rate = 1e-3

print_every = 4   # (100 in the notebook)


def main(sg, steps=8, device="cpu", amp=None):
    global data_variance
    training_data = SyntheticCIFAR10(64, seed=3)
    data_variance = np.var(training_data.data / 255.0)

    training_loader = DataLoader(training_data,
                                 batch_size=batch_size,
                                 shuffle=True)

    model = Model(num_hiddens, num_residual_layers, num_residual_hiddens,
                  num_embeddings, embedding_dim,
                  commitment_cost, decay).to(device)

    optimizer = optim.Adam(model.parameters(), lr=learning_rate, amsgrad=False)
    sg.track(model=model, optimizer=optimizer)

    @sg.compile
    def train_step(data):
        optimizer.zero_grad()

        vq_loss, data_recon, perplexity = model(data)
        recon_error = F.mse_loss(data_recon, data) / data_variance
        loss = recon_error + vq_loss
        loss.backward()

        optimizer.step()
        return recon_error, perplexity

    model.train()
    train_res_recon_error = []
    train_res_perplexity = []

    for i in xrange(min(steps, num_training_updates)):
        (data, _) = next(iter(training_loader))
        data = data.to(device)

        recon_error, perplexity = train_step(data)
        sg.log((recon_error, perplexity))

        train_res_recon_error.append(recon_error.item())
        train_res_perplexity.append(perplexity.item())

        if (i + 1) % print_every == 0:
            print('%d iterations' % (i + 1))
            print('recon_error: %.3f' % np.mean(train_res_recon_error[-print_every:]))
            print('perplexity: %.3f' % np.mean(train_res_perplexity[-print_every:]))
            print()
    sg.log(train_res_recon_error)
