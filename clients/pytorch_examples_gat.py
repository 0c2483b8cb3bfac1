"""pytorch/examples gat: a two-layer Graph Attention Network (dense adjacency, masked softmax
attention, 8 heads averaged) trained full-graph with Adam (lr 0.005, weight decay 5e-4) and
NLLLoss; one step is main.py's ``train_iter``: train-mode forward/backward/step, then two ``test``
calls (eval mode, ``torch.no_grad``, ``loss.item(), acc.item()``) and a print every
``val_every`` epochs.

Model: vendor/pytorch_examples/gat_model.py (main.py lines 14-203, verbatim). Loop: main.py
``train_iter`` (lines 256-274) and ``test`` (277-285), decorated as they stand but for an added
``return loss`` so the harness can log it; the epoch loop of ``__main__`` (lines 366-369) and the
final test (370-371). Data: instead of Cora (``load_cora``), a random graph of 96 nodes with 64
binary features row-normalized as load_cora does (sum-scaling by a sparse diagonal), dense
adjacency ``eye(V) + sparse edges``, a random permutation split as in ``__main__`` (1200/400/rest ->
24/24/48). Scaled down: hidden dim 64 -> 16, val_every 20 -> 4.
"""
import time

import torch
from torch import nn
from torch.optim import Adam

from clients.vendor.pytorch_examples.gat_model import GAT

SOURCE = "https://github.com/pytorch/examples/blob/77f55b9/gat/main.py"
LICENSE = "BSD-3-Clause"
TAGS = ("gnn", "gat", "attention", "dropout", "adam", "full-batch", "item-in-step", "eval-in-step",
        "print-in-step", "python-int-arg")


class args:  # argparse defaults of gat/main.py, scaled down
    epochs = 300; lr = 0.005; l2 = 5e-4; dropout_p = 0.6; hidden_dim = 16; num_heads = 8
    concat_heads = False; val_every = 4


V, n_feat, n_class, n_edges = 96, 64, 7, 400


def train_iter(epoch, model, optimizer, criterion, input, target, mask_train, mask_val, print_every=10):
    start_t = time.time()
    model.train()
    optimizer.zero_grad()

    # Forward pass
    output = model(*input)
    loss = criterion(output[mask_train], target[mask_train]) # Compute the loss using the training mask

    loss.backward()
    optimizer.step()

    # Evaluate the model performance on training and validation sets
    loss_train, acc_train = test(model, criterion, input, target, mask_train)
    loss_val, acc_val = test(model, criterion, input, target, mask_val)

    if epoch % print_every == 0:
        # Print the training progress at specified intervals
        print(f'Epoch: {epoch:04d} ({(time.time() - start_t):.4f}s) loss_train: {loss_train:.4f} acc_train: {acc_train:.4f} loss_val: {loss_val:.4f} acc_val: {acc_val:.4f}')
    return loss  # (added: the value the harness logs)


def test(model, criterion, input, target, mask):
    model.eval()
    with torch.no_grad():
        output = model(*input)
        output, target = output[mask], target[mask]

        loss = criterion(output, target)
        acc = (output.argmax(dim=1) == target).float().sum() / len(target)
    return loss.item(), acc.item()


def synthetic_cora(g, device):
    """A random graph with load_cora's processing of features and adjacency."""
    features = (torch.rand(V, n_feat, generator=g) < 0.1).float()
    scale_vector = torch.sum(features, dim=1) # Compute sum of features for each node
    scale_vector = 1 / scale_vector # Compute reciprocal of the sums
    scale_vector[scale_vector == float('inf')] = 0 # Handle division by zero cases
    scale_vector = torch.diag(scale_vector).to_sparse() # Convert the scale vector to a sparse diagonal matrix
    features = scale_vector @ features # Scale the features using the scale vector
    labels = torch.randint(0, n_class, (V,), generator=g)
    edges = torch.randint(0, V, (n_edges, 2), generator=g)
    E = edges.shape[0]
    adj_mat = torch.sparse_coo_tensor(edges.T, torch.ones(E), (V, V), dtype=torch.int64)
    adj_mat = torch.eye(V) + adj_mat # Add self-loops to the adjacency matrix
    return features.to(device), labels.to(device), adj_mat.to(device)


def main(sg, steps=8, device="cpu", amp=None):
    g = torch.Generator().manual_seed(1)
    features, labels, adj_mat = synthetic_cora(g, device)
    # Split the dataset into training, validation, and test sets
    idx = torch.randperm(len(labels), generator=g).to(device)
    idx_test, idx_val, idx_train = idx[:24], idx[24:48], idx[48:]

    gat_net = GAT(
        in_features=features.shape[1],          # Number of input features per node
        n_hidden=args.hidden_dim,               # Output size of the first Graph Attention Layer
        n_heads=args.num_heads,                 # Number of attention heads in the first Graph Attention Layer
        num_classes=labels.max().item() + 1,    # Number of classes to predict for each node
        concat=args.concat_heads,               # Wether to concatinate attention heads
        dropout=args.dropout_p,                 # Dropout rate
        leaky_relu_slope=0.2                    # Alpha (slope) of the leaky relu activation
    ).to(device)

    # configure the optimizer and loss function
    optimizer = Adam(gat_net.parameters(), lr=args.lr, weight_decay=args.l2)
    criterion = nn.NLLLoss()
    sg.track(model=gat_net, opt=optimizer)

    step = sg.compile(train_iter)

    # Train and evaluate the model
    for epoch in range(min(steps, args.epochs)):
        sg.log(step(epoch + 1, gat_net, optimizer, criterion, (features, adj_mat), labels, idx_train, idx_val,
                    args.val_every))
    loss_test, acc_test = test(gat_net, criterion, (features, adj_mat), labels, idx_test)
    print(f'Test set results: loss {loss_test:.4f} accuracy {acc_test:.4f}')
