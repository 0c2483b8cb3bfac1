# Vendored verbatim from https://github.com/tkipf/pygcn/blob/1600b5b/pygcn/models.py
# Copyright (c) 2017 Thomas Kipf. MIT License (see LICENSE beside this file).
# Import replaced: `from pygcn.layers import GraphConvolution` -> `from clients.vendor.pygcn.layers import GraphConvolution`.
import torch.nn as nn
import torch.nn.functional as F
from clients.vendor.pygcn.layers import GraphConvolution


class GCN(nn.Module):
    def __init__(self, nfeat, nhid, nclass, dropout):
        super(GCN, self).__init__()

        self.gc1 = GraphConvolution(nfeat, nhid)
        self.gc2 = GraphConvolution(nhid, nclass)
        self.dropout = dropout

    def forward(self, x, adj):
        x = F.relu(self.gc1(x, adj))
        x = F.dropout(x, self.dropout, training=self.training)
        x = self.gc2(x, adj)
        return F.log_softmax(x, dim=1)
