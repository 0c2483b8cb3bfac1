"""tkipf/pygcn: a two-layer GCN on a sparse, normalized adjacency (``torch.spmm`` in every layer),
full-graph training with Adam (lr 0.01, weight decay 5e-4); one step is train.py's ``train(epoch)``:
forward on the whole graph, ``F.nll_loss`` on ``idx_train``, ``accuracy()``, backward, step, then a
validation forward in eval mode and a print of ``.item()`` of four tensors and the elapsed time.

Model: vendor/pygcn/layers.py, models.py (verbatim), helpers from vendor/pygcn/utils.py (verbatim:
``normalize``, ``accuracy``, ``sparse_mx_to_torch_sparse_tensor``). Loop: train.py ``train(epoch)``
(lines 62-85) and the epoch loop (99-101), decorated as it stands; the only addition is
``return loss_train`` so the harness can log it. Data: instead of Cora (2708 nodes, 1433 features),
a random symmetric graph of 120 nodes with 40 binary features, built as ``load_data`` builds Cora's
(symmetrize, ``normalize(adj + sp.eye)``, row-normalized features, torch sparse COO adjacency),
splits scaled from 140/300/1000 to 30/30/60.
"""
import time

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn.functional as F
import torch.optim as optim

from clients.vendor.pygcn.models import GCN
from clients.vendor.pygcn.utils import accuracy, normalize, sparse_mx_to_torch_sparse_tensor

SOURCE = "https://github.com/tkipf/pygcn/blob/1600b5b/pygcn/train.py"
LICENSE = "MIT"
TAGS = ("gnn", "gcn", "sparse", "spmm", "adam", "full-batch", "item-in-step", "print-in-step", "eval-in-step",
        "python-int-arg")


class args:  # argparse defaults of train.py
    fastmode = False; epochs = 200; lr = 0.01; weight_decay = 5e-4; hidden = 16; dropout = 0.5


n_nodes, n_feat, n_class, n_edges = 120, 40, 7, 300

model = optimizer = None
adj = features = labels = idx_train = idx_val = idx_test = None


def synthetic_data(g):
    """A random graph, processed the way utils.load_data processes Cora."""
    rng = np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=g)))
    features = sp.csr_matrix((rng.random((n_nodes, n_feat)) < 0.1).astype(np.float32))
    labels = torch.randint(0, n_class, (n_nodes,), generator=g)
    edges = rng.integers(0, n_nodes, (n_edges, 2))
    adj = sp.coo_matrix((np.ones(edges.shape[0]), (edges[:, 0], edges[:, 1])),
                        shape=(n_nodes, n_nodes), dtype=np.float32)
    # build symmetric adjacency matrix
    adj = adj + adj.T.multiply(adj.T > adj) - adj.multiply(adj.T > adj)
    features = normalize(features)
    adj = normalize(adj + sp.eye(adj.shape[0]))
    features = torch.FloatTensor(np.array(features.todense()))
    adj = sparse_mx_to_torch_sparse_tensor(adj)
    return adj, features, labels, torch.LongTensor(range(30)), torch.LongTensor(range(30, 60)), \
        torch.LongTensor(range(60, 120))


def main(sg, steps=8, device="cpu", amp=None):
    global model, optimizer, adj, features, labels, idx_train, idx_val, idx_test
    # Load data
    adj, features, labels, idx_train, idx_val, idx_test = synthetic_data(torch.Generator().manual_seed(1))

    # Model and optimizer
    model = GCN(nfeat=features.shape[1],
                nhid=args.hidden,
                nclass=labels.max().item() + 1,
                dropout=args.dropout)
    optimizer = optim.Adam(model.parameters(),
                           lr=args.lr, weight_decay=args.weight_decay)
    sg.track(model=model, opt=optimizer)

    if device == "cuda":
        model.cuda()
        features = features.cuda()
        adj = adj.cuda()
        labels = labels.cuda()
        idx_train = idx_train.cuda()
        idx_val = idx_val.cuda()
        idx_test = idx_test.cuda()

    @sg.compile
    def train(epoch):
        t = time.time()
        model.train()
        optimizer.zero_grad()
        output = model(features, adj)
        loss_train = F.nll_loss(output[idx_train], labels[idx_train])
        acc_train = accuracy(output[idx_train], labels[idx_train])
        loss_train.backward()
        optimizer.step()

        if not args.fastmode:
            # Evaluate validation set performance separately,
            # deactivates dropout during validation run.
            model.eval()
            output = model(features, adj)

        loss_val = F.nll_loss(output[idx_val], labels[idx_val])
        acc_val = accuracy(output[idx_val], labels[idx_val])
        print('Epoch: {:04d}'.format(epoch+1),
              'loss_train: {:.4f}'.format(loss_train.item()),
              'acc_train: {:.4f}'.format(acc_train.item()),
              'loss_val: {:.4f}'.format(loss_val.item()),
              'acc_val: {:.4f}'.format(acc_val.item()),
              'time: {:.4f}s'.format(time.time() - t))
        return loss_train  # (added: the value the harness logs)

    # Train model
    t_total = time.time()
    for epoch in range(min(steps, args.epochs)):
        sg.log(train(epoch))
    print("Optimization Finished!")
    print("Total time elapsed: {:.4f}s".format(time.time() - t_total))
