"""williamleif/graphsage-simple: the reference PyTorch GraphSAGE, ``graphsage/model.py``'s
``run_cora``. ``MeanAggregator`` (aggregators.py) samples up to ``num_sample`` neighbours of each
node with ``random.sample`` (Python's RNG), builds a dense row-normalised ``mask`` over the union
of sampled nodes with Python index lists (``mask[row_indices, column_indices] = 1``), looks the
unique nodes up through ``self.features`` and returns ``mask.mm(embed_matrix)``; ``Encoder``
(encoders.py, gcn=True) is ``relu(weight.mm(neigh_feats.t()))`` over the aggregated neighbours;
two layers, the second's features a lambda over the first encoder (``enc1(nodes).t()``);
``SupervisedGraphSage`` (model.py) is ``weight.mm(embeds).t()`` and ``nn.CrossEntropyLoss``.
Features are an ``nn.Embedding`` whose weight is replaced by a frozen ``nn.Parameter`` of the
feature matrix; ``SGD(filter(requires_grad), lr=0.7)``; both weights xavier_uniform (the
source's ``init.xavier_uniform`` is the deprecated alias of ``xavier_uniform_``). The loop:
``batch_nodes = train[:256]``, ``random.shuffle(train)``, then ``zero_grad`` / ``loss`` /
``backward`` / ``step``, printing ``loss``. As in the source, ``enc1.num_samples = 5`` sets an
attribute nothing reads (the encoders sample ``num_sample=10``, the default).

What a user of stepgraph changes: the loop body's training part (``optimizer.zero_grad()`` through
``optimizer.step()``, the labels tensor built inside as the source builds it) is a function
decorated with ``sg.compile`` taking ``batch_nodes``; ``random.shuffle(train)`` and the slicing
stay in the loop; the print is ``sg.log(loss)``.

Scaled down / replaced: no cora files: a synthetic graph of 120 nodes with 24 binary features and 7
classes (a seeded numpy generator; a ring so no node is isolated, plus random edges, a few hub
nodes with more than 10 neighbours so ``random.sample`` actually samples), embed dim 16 (128),
batch ``train[:16]`` (256); the validation F1 is the micro-F1 computed by hand (no sklearn).
Python 3.11's ``random.sample`` no longer accepts a set (the source targets Python 2): the
population is ``tuple(to_neigh)``, which is what Python 3.9/3.10's ``random.sample`` did with a
set. ``Variable(...)`` is the tensor itself; ``print`` is ``sg.log``.

Source: https://github.com/williamleif/graphsage-simple/blob/d3105e5223e9602ba3ef2dd27e343d044fe4bb5f/graphsage/model.py
(and aggregators.py, encoders.py at the same commit). MIT License, Copyright (c) 2017 William L.
Hamilton. Restated after the source, not copied.
"""
import random
from collections import defaultdict

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn import init

SOURCE = "https://github.com/williamleif/graphsage-simple/blob/d3105e5223e9602ba3ef2dd27e343d044fe4bb5f/graphsage/model.py"
LICENSE = "MIT"
DEVICES = ("cpu",)   # run_cora runs on the CPU (the .cuda() calls are commented out / cuda=False)
TAGS = ("gnn", "graphsage", "python-random", "sample-in-step", "python-index-lists", "dynamic-shape",
        "frozen-embedding", "lambda-features", "sgd", "list-input", "numpy-in-step")

NUM_NODES, NUM_FEATS, NUM_CLASSES, EMBED = 120, 24, 7, 16
BATCH = 16


class MeanAggregator(nn.Module):
    """Aggregates a node's embeddings using mean of neighbors' embeddings."""

    def __init__(self, features, cuda=False, gcn=False):
        super(MeanAggregator, self).__init__()
        self.features = features
        self.cuda = cuda
        self.gcn = gcn

    def forward(self, nodes, to_neighs, num_sample=10):
        _set = set
        if num_sample is not None:
            _sample = random.sample
            samp_neighs = [_set(_sample(tuple(to_neigh), num_sample)) if len(to_neigh) >= num_sample else to_neigh
                           for to_neigh in to_neighs]
        else:
            samp_neighs = to_neighs

        if self.gcn:
            samp_neighs = [samp_neigh | set([nodes[i]]) for i, samp_neigh in enumerate(samp_neighs)]
        unique_nodes_list = list(set.union(*samp_neighs))
        unique_nodes = {n: i for i, n in enumerate(unique_nodes_list)}
        mask = torch.zeros(len(samp_neighs), len(unique_nodes))
        column_indices = [unique_nodes[n] for samp_neigh in samp_neighs for n in samp_neigh]
        row_indices = [i for i in range(len(samp_neighs)) for j in range(len(samp_neighs[i]))]
        mask[row_indices, column_indices] = 1
        if self.cuda:
            mask = mask.cuda()
        num_neigh = mask.sum(1, keepdim=True)
        mask = mask.div(num_neigh)
        if self.cuda:
            embed_matrix = self.features(torch.LongTensor(unique_nodes_list).cuda())
        else:
            embed_matrix = self.features(torch.LongTensor(unique_nodes_list))
        to_feats = mask.mm(embed_matrix)
        return to_feats


class Encoder(nn.Module):
    """Encodes a node's using 'convolutional' GraphSage approach."""

    def __init__(self, features, feature_dim, embed_dim, adj_lists, aggregator, num_sample=10,
                 base_model=None, gcn=False, cuda=False, feature_transform=False):
        super(Encoder, self).__init__()
        self.features = features
        self.feat_dim = feature_dim
        self.adj_lists = adj_lists
        self.aggregator = aggregator
        self.num_sample = num_sample
        if base_model is not None:
            self.base_model = base_model
        self.gcn = gcn
        self.embed_dim = embed_dim
        self.cuda = cuda
        self.aggregator.cuda = cuda
        self.weight = nn.Parameter(torch.FloatTensor(embed_dim, self.feat_dim if self.gcn else 2 * self.feat_dim))
        init.xavier_uniform_(self.weight)

    def forward(self, nodes):
        neigh_feats = self.aggregator.forward(nodes, [self.adj_lists[int(node)] for node in nodes], self.num_sample)
        if not self.gcn:
            if self.cuda:
                self_feats = self.features(torch.LongTensor(nodes).cuda())
            else:
                self_feats = self.features(torch.LongTensor(nodes))
            combined = torch.cat([self_feats, neigh_feats], dim=1)
        else:
            combined = neigh_feats
        combined = F.relu(self.weight.mm(combined.t()))
        return combined


class SupervisedGraphSage(nn.Module):

    def __init__(self, num_classes, enc):
        super(SupervisedGraphSage, self).__init__()
        self.enc = enc
        self.xent = nn.CrossEntropyLoss()
        self.weight = nn.Parameter(torch.FloatTensor(num_classes, enc.embed_dim))
        init.xavier_uniform_(self.weight)

    def forward(self, nodes):
        embeds = self.enc(nodes)
        scores = self.weight.mm(embeds)
        return scores.t()

    def loss(self, nodes, labels):
        scores = self.forward(nodes)
        return self.xent(scores, labels.squeeze())


def load_synthetic():
    """Stands in for ``load_cora``: (feat_data, labels (n, 1) int64, adj_lists defaultdict(set))."""
    rng = np.random.default_rng(7)
    labels = rng.integers(0, NUM_CLASSES, size=(NUM_NODES, 1)).astype(np.int64)
    centers = rng.random((NUM_CLASSES, NUM_FEATS))
    feat_data = (rng.random((NUM_NODES, NUM_FEATS)) < centers[labels[:, 0]] * 0.6).astype(np.float64)
    adj_lists = defaultdict(set)
    for i in range(NUM_NODES):   # a ring: no isolated node
        j = (i + 1) % NUM_NODES
        adj_lists[i].add(j)
        adj_lists[j].add(i)
    for _ in range(NUM_NODES):   # random edges
        a, b = rng.integers(0, NUM_NODES, size=2)
        if a != b:
            adj_lists[int(a)].add(int(b))
            adj_lists[int(b)].add(int(a))
    for hub in range(0, NUM_NODES, 15):   # hubs with more than num_sample neighbours
        for b in rng.choice(NUM_NODES, size=14, replace=False):
            if b != hub:
                adj_lists[hub].add(int(b))
                adj_lists[int(b)].add(hub)
    return feat_data, labels, adj_lists


def main(sg, steps=8, device="cpu", amp=None):
    np.random.seed(1)
    random.seed(1)
    num_nodes = NUM_NODES
    feat_data, labels, adj_lists = load_synthetic()
    features = nn.Embedding(NUM_NODES, NUM_FEATS)
    features.weight = nn.Parameter(torch.FloatTensor(feat_data), requires_grad=False)

    agg1 = MeanAggregator(features, cuda=True)
    enc1 = Encoder(features, NUM_FEATS, EMBED, adj_lists, agg1, gcn=True, cuda=False)
    agg2 = MeanAggregator(lambda nodes: enc1(nodes).t(), cuda=False)
    enc2 = Encoder(lambda nodes: enc1(nodes).t(), enc1.embed_dim, EMBED, adj_lists, agg2,
                   base_model=enc1, gcn=True, cuda=False)
    enc1.num_samples = 5
    enc2.num_samples = 5

    graphsage = SupervisedGraphSage(NUM_CLASSES, enc2)
    rand_indices = np.random.permutation(num_nodes)
    test = rand_indices[:30]
    val = rand_indices[30:50]
    train = list(rand_indices[50:])

    optimizer = torch.optim.SGD(filter(lambda p: p.requires_grad, graphsage.parameters()), lr=0.7)
    sg.track(graphsage=graphsage, optimizer=optimizer)

    @sg.compile
    def train_step(batch_nodes):
        optimizer.zero_grad()
        loss = graphsage.loss(batch_nodes, torch.LongTensor(labels[np.array(batch_nodes)]))
        loss.backward()
        optimizer.step()
        return loss

    for batch in range(steps):
        batch_nodes = train[:BATCH]
        random.shuffle(train)
        loss = train_step(batch_nodes)
        sg.log((batch, loss))

    val_output = graphsage.forward(val)
    pred = val_output.data.numpy().argmax(axis=1)
    sg.log(("Validation F1:", float((pred == labels[val][:, 0]).mean())))
