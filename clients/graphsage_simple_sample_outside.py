"""graphsage_simple with stepgraph's fix applied: the neighbour sampling (``random.sample``) is
drawn in the loop outside the step -- one draw per node of up to ``num_sample`` neighbours, the
same rule ``MeanAggregator`` applies -- and passed to the step, whose aggregators then run with
``num_sample=None`` (the source's no-sampling path) over the pre-drawn neighbour sets, set as the encoders' ``adj_lists`` in the loop (the second
fix stepgraph names when the step itself assigns ``enc1.adj_lists``). Everything
else is clients/graphsage_simple.py (the program's code, restated there).

Source: https://github.com/williamleif/graphsage-simple/blob/d3105e5223e9602ba3ef2dd27e343d044fe4bb5f/graphsage/model.py
(MIT). Variant of clients/graphsage_simple.py.
"""
import random

import numpy as np
import torch
import torch.nn as nn

from clients.graphsage_simple import (BATCH, EMBED, NUM_CLASSES, NUM_FEATS, NUM_NODES, Encoder, MeanAggregator,
                                      SupervisedGraphSage, load_synthetic)

SOURCE = "https://github.com/williamleif/graphsage-simple/blob/d3105e5223e9602ba3ef2dd27e343d044fe4bb5f/graphsage/model.py"
LICENSE = "MIT"
DEVICES = ("cpu",)
TAGS = ("gnn", "graphsage", "python-random", "python-index-lists", "dynamic-shape", "frozen-embedding",
        "lambda-features", "sgd", "list-input", "numpy-in-step", "fix-applied", "dict-input")

FULL_BATCH = False   # clients/graphsage_simple_sample_outside_fullbatch.py: True


def main(sg, steps=8, device="cpu", amp=None, full_batch=None):
    full_batch = FULL_BATCH if full_batch is None else full_batch
    np.random.seed(1)
    random.seed(1)
    feat_data, labels, adj_lists = load_synthetic()
    features = nn.Embedding(NUM_NODES, NUM_FEATS)
    features.weight = nn.Parameter(torch.FloatTensor(feat_data), requires_grad=False)

    agg1 = MeanAggregator(features, cuda=True)
    enc1 = Encoder(features, NUM_FEATS, EMBED, adj_lists, agg1, gcn=True, cuda=False, num_sample=None)
    agg2 = MeanAggregator(lambda nodes: enc1(nodes).t(), cuda=False)
    enc2 = Encoder(lambda nodes: enc1(nodes).t(), enc1.embed_dim, EMBED, adj_lists, agg2,
                   base_model=enc1, gcn=True, cuda=False, num_sample=None)
    graphsage = SupervisedGraphSage(NUM_CLASSES, enc2)
    rand_indices = np.random.permutation(NUM_NODES)
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

    num_sample = 10
    train_sorted = sorted(train)
    for batch in range(steps):
        if full_batch:
            batch_nodes = train_sorted
        else:
            batch_nodes = train[:BATCH]
            random.shuffle(train)
        sampled = {n: set(random.sample(tuple(adj), num_sample)) if len(adj) >= num_sample else adj
                   for n, adj in adj_lists.items()}
        enc1.adj_lists = enc2.adj_lists = sampled
        loss = train_step(batch_nodes)
        sg.log((batch, loss))

    enc1.adj_lists = enc2.adj_lists = adj_lists
    val_output = graphsage.forward(val)
    pred = val_output.data.numpy().argmax(axis=1)
    sg.log(("Validation F1:", float((pred == labels[val][:, 0]).mean())))
