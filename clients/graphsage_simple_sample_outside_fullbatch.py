"""graphsage_simple_sample_outside trained full-batch: every call trains on all training nodes in
one fixed (sorted) order -- the full-batch form of GraphSAGE on a small graph, as GCN-style programs
(clients/pygcn.py) train -- while the neighbour sampling is still drawn anew in the loop before each
call and set as the encoders' ``adj_lists`` outside the step (stepgraph's two fixes for
clients/graphsage_simple.py, applied). Only the sampled neighbour sets change between calls.
Everything else is clients/graphsage_simple_sample_outside.py / clients/graphsage_simple.py.

Source: https://github.com/williamleif/graphsage-simple/blob/d3105e5223e9602ba3ef2dd27e343d044fe4bb5f/graphsage/model.py
(MIT). Variant of clients/graphsage_simple.py.
"""
from clients import graphsage_simple_sample_outside as base

SOURCE = "https://github.com/williamleif/graphsage-simple/blob/d3105e5223e9602ba3ef2dd27e343d044fe4bb5f/graphsage/model.py"
LICENSE = "MIT"
DEVICES = ("cpu",)
TAGS = base.TAGS + ("full-batch",)


def main(sg, steps=8, device="cpu", amp=None):
    base.main(sg, steps=steps, device=device, amp=amp, full_batch=True)
