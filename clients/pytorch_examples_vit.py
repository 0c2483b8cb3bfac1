"""pytorch/examples ``vision_transformer/main.py``: a Vision Transformer on CIFAR-10 written from
scratch -- ``PatchExtractor`` (``unfold`` twice, ``permute``, ``contiguous().view``; a new
``PatchExtractor`` module is made inside ``InputEmbedding.forward`` at every call), ``InputEmbedding``
(``LinearProjection``, a ``class_token`` and a ``pos_embedding`` ``nn.Parameter`` of shape
``(batch_size, 1, latent_size)`` drawn with ``torch.randn``, ``torch.cat`` of the class token in
front, ``linear_projection += pos_embed`` in place), ``EncoderBlock`` (one ``nn.LayerNorm`` used
twice, ``nn.MultiheadAttention(latent, heads, dropout)`` on sequence-first inputs as the program
passes them, a GELU MLP with ``nn.Dropout``), ``ViT`` (the encoder stack in an ``nn.ModuleList``,
``MLPHead`` = LayerNorm, Linear, Linear on ``enc_output[:, 0]``), trained by ``TrainEval.train_fn``:
``optimizer.zero_grad()``, forward, ``nn.CrossEntropyLoss``, ``loss.backward()``,
``optimizer.step()`` with ``optim.Adam(model.parameters(), lr=args.lr,
weight_decay=args.weight_decay)`` (no lr scheduler in this program), ``total_loss +=
loss.item()`` and ``tk.set_postfix({"Loss": "%6f" % float(total_loss / (t + 1))})`` on the
``torch.hub.tqdm`` bar; ``eval_fn`` after each epoch in eval mode (no ``no_grad`` in the program).

What a user of stepgraph changes: the body of ``train_fn``'s ``for t, data in enumerate(tk)`` loop
(from ``images, labels = images.to(...)`` to ``tk.set_postfix``) is the method
``TrainEval.train_batch(t, images, labels, tk)``, wrapped with ``sg.compile`` in ``__init__`` (=
``@stepgraph.compile`` on the method); ``train_fn``'s local ``total_loss`` is the attribute
``self.total_loss`` so the method can accumulate it; ``if self.args.dry_run: break`` stays in the
loop.

Source: https://github.com/pytorch/examples/blob/5921fc191b83df2451c342b8bb30b5e3d8891ff8/vision_transformer/main.py
(the example's last version: pytorch/examples removed it in e8a38cc, May 2024). BSD-3-Clause.
Restated after the source, not copied: same classes, names, ops and order. (Helper brief K described
this example as "nn.TransformerEncoder, AdamW, CosineAnnealingLR"; the example itself has its own
``EncoderBlock`` around ``nn.MultiheadAttention``, ``optim.Adam`` with weight decay and no
scheduler, so that is what is restated.) Deviations: CIFAR-10 via torchvision (not installable here)
is replaced by synthetic images in a ``TensorDataset``, shuffled by a ``DataLoader``; no
``best-weights.pt`` file. Scaled down: image 224 -> 16, patch 16 -> 4 (16 patches + the class
token), latent 768 -> 32, heads 12 -> 4, encoders 12 -> 2, batch 4 (as the program), 16 training
and 8 validation images (4 and 2 batches), epochs 10 -> 2, dropout 0.1 (as the program), lr 1e-2
and weight decay 3e-2 (as the program).
"""
import numpy as np
import torch
import torch.nn as nn
from torch import optim
from torch.hub import tqdm
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "https://github.com/pytorch/examples/blob/5921fc191b83df2451c342b8bb30b5e3d8891ff8/vision_transformer/main.py"
LICENSE = "BSD-3-Clause"
TAGS = ("transformer", "vit", "multihead-attention", "dropout", "adam", "module-made-in-forward",
        "inplace-add-on-cat", "item-in-step", "tqdm-in-step", "method-step", "dataloader")


class Args:  # main()'s argparse defaults, scaled down (see the docstring)
    no_cuda = False; patch_size = 4; latent_size = 32; n_channels = 3; num_heads = 4; num_encoders = 2
    dropout = 0.1; img_size = 16; num_classes = 10; epochs = 2; lr = 1e-2; weight_decay = 3e-2
    batch_size = 4; dry_run = False


n_train, n_val = 16, 8


class PatchExtractor(nn.Module):
    def __init__(self, patch_size=16):
        super().__init__()
        self.patch_size = patch_size

    def forward(self, input_data):
        batch_size, channels, height, width = input_data.size()
        assert height % self.patch_size == 0 and width % self.patch_size == 0, \
            f"Input height ({height}) and width ({width}) must be divisible by patch size ({self.patch_size})"

        num_patches_h = height // self.patch_size
        num_patches_w = width // self.patch_size
        num_patches = num_patches_h * num_patches_w

        patches = input_data.unfold(2, self.patch_size, self.patch_size). \
            unfold(3, self.patch_size, self.patch_size). \
            permute(0, 2, 3, 1, 4, 5). \
            contiguous(). \
            view(batch_size, num_patches, -1)
        return patches


class InputEmbedding(nn.Module):

    def __init__(self, args):
        super().__init__()
        self.patch_size = args.patch_size
        self.n_channels = args.n_channels
        self.latent_size = args.latent_size
        use_cuda = not args.no_cuda and torch.cuda.is_available()
        self.device = torch.device("cuda" if use_cuda else "cpu")
        self.batch_size = args.batch_size
        self.input_size = self.patch_size * self.patch_size * self.n_channels

        # Linear projection
        self.LinearProjection = nn.Linear(self.input_size, self.latent_size)
        # Class token
        self.class_token = nn.Parameter(torch.randn(self.batch_size, 1, self.latent_size).to(self.device))
        # Positional embedding
        self.pos_embedding = nn.Parameter(torch.randn(self.batch_size, 1, self.latent_size).to(self.device))

    def forward(self, input_data):
        input_data = input_data.to(self.device)
        # Patchifying the Image
        patchify = PatchExtractor(patch_size=self.patch_size)
        patches = patchify(input_data)

        linear_projection = self.LinearProjection(patches).to(self.device)
        b, n, _ = linear_projection.shape
        linear_projection = torch.cat((self.class_token, linear_projection), dim=1)
        pos_embed = self.pos_embedding[:, :n + 1, :]
        linear_projection += pos_embed
        return linear_projection


class EncoderBlock(nn.Module):

    def __init__(self, args):
        super().__init__()
        self.latent_size = args.latent_size
        self.num_heads = args.num_heads
        self.dropout = args.dropout
        self.norm = nn.LayerNorm(self.latent_size)
        self.attention = nn.MultiheadAttention(self.latent_size, self.num_heads, dropout=self.dropout)
        self.enc_MLP = nn.Sequential(
            nn.Linear(self.latent_size, self.latent_size * 4),
            nn.GELU(),
            nn.Dropout(self.dropout),
            nn.Linear(self.latent_size * 4, self.latent_size),
            nn.Dropout(self.dropout)
        )

    def forward(self, emb_patches):
        first_norm = self.norm(emb_patches)
        attention_out = self.attention(first_norm, first_norm, first_norm)[0]
        first_added = attention_out + emb_patches
        second_norm = self.norm(first_added)
        mlp_out = self.enc_MLP(second_norm)
        output = mlp_out + first_added
        return output


class ViT(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.num_encoders = args.num_encoders
        self.latent_size = args.latent_size
        self.num_classes = args.num_classes
        self.dropout = args.dropout

        self.embedding = InputEmbedding(args)
        # Encoder Stack
        self.encoders = nn.ModuleList([EncoderBlock(args) for _ in range(self.num_encoders)])
        self.MLPHead = nn.Sequential(
            nn.LayerNorm(self.latent_size),
            nn.Linear(self.latent_size, self.latent_size),
            nn.Linear(self.latent_size, self.num_classes),
        )

    def forward(self, test_input):
        enc_output = self.embedding(test_input)
        for enc_layer in self.encoders:
            enc_output = enc_layer(enc_output)

        class_token_embed = enc_output[:, 0]
        return self.MLPHead(class_token_embed)


class TrainEval:

    def __init__(self, args, model, train_dataloader, val_dataloader, optimizer, criterion, device, sg, steps):
        self.model = model
        self.train_dataloader = train_dataloader
        self.val_dataloader = val_dataloader
        self.optimizer = optimizer
        self.criterion = criterion
        self.epoch = args.epochs
        self.device = device
        self.args = args
        self.total_loss = 0.0
        self.train_batch = sg.compile(self.train_batch)   # = @stepgraph.compile on the method
        self.sg, self.steps, self.done = sg, steps, 0      # (the harness's log and step budget)

    def train_batch(self, t, images, labels, tk):
        images, labels = images.to(self.device), labels.to(self.device)
        self.optimizer.zero_grad()
        logits = self.model(images)
        loss = self.criterion(logits, labels)
        loss.backward()
        self.optimizer.step()

        self.total_loss += loss.item()
        tk.set_postfix({"Loss": "%6f" % float(self.total_loss / (t + 1))})
        return loss

    def train_fn(self, current_epoch):
        self.model.train()
        self.total_loss = 0.0
        tk = tqdm(self.train_dataloader, desc="EPOCH" + "[TRAIN]" + str(current_epoch + 1) + "/" + str(self.epoch))

        for t, data in enumerate(tk):
            if self.done == self.steps:
                break
            images, labels = data
            loss = self.train_batch(t, images, labels, tk)
            self.done += 1
            self.sg.log((loss, self.total_loss, tk.postfix))
            if self.args.dry_run:
                break

        return self.total_loss / len(self.train_dataloader)

    def eval_fn(self, current_epoch):
        self.model.eval()
        total_loss = 0.0
        tk = tqdm(self.val_dataloader, desc="EPOCH" + "[VALID]" + str(current_epoch + 1) + "/" + str(self.epoch))

        for t, data in enumerate(tk):
            images, labels = data
            images, labels = images.to(self.device), labels.to(self.device)

            logits = self.model(images)
            loss = self.criterion(logits, labels)

            total_loss += loss.item()
            tk.set_postfix({"Loss": "%6f" % float(total_loss / (t + 1))})
            if self.args.dry_run:
                break

        return total_loss / len(self.val_dataloader)

    def train(self):
        best_valid_loss = np.inf
        best_train_loss = np.inf
        for i in range(self.epoch):
            if self.done == self.steps:
                break
            train_loss = self.train_fn(i)
            val_loss = self.eval_fn(i)
            self.sg.log((train_loss, val_loss))

            if val_loss < best_valid_loss:
                # (torch.save(self.model.state_dict(), "best-weights.pt") left out: no files)
                print("Saved Best Weights")
                best_valid_loss = val_loss
                best_train_loss = train_loss
        print(f"Training Loss : {best_train_loss}")
        print(f"Valid Loss : {best_valid_loss}")


def main(sg, steps=8, device="cpu", amp=None):
    args = Args()
    args.no_cuda = device == "cpu"
    use_cuda = not args.no_cuda and torch.cuda.is_available()
    device = torch.device("cuda" if use_cuda else "cpu")

    g = torch.Generator().manual_seed(1)
    train_data = TensorDataset(torch.rand(n_train, 3, args.img_size, args.img_size, generator=g),
                               torch.randint(0, args.num_classes, (n_train,), generator=g))
    valid_data = TensorDataset(torch.rand(n_val, 3, args.img_size, args.img_size, generator=g),
                               torch.randint(0, args.num_classes, (n_val,), generator=g))
    train_loader = DataLoader(train_data, batch_size=args.batch_size, shuffle=True)
    valid_loader = DataLoader(valid_data, batch_size=args.batch_size, shuffle=True)

    model = ViT(args).to(device)

    optimizer = optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    criterion = nn.CrossEntropyLoss()
    sg.track(model=model, opt=optimizer)

    TrainEval(args, model, train_loader, valid_loader, optimizer, criterion, device, sg, steps).train()
