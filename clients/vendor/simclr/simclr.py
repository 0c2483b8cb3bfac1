# Restates what clients/simclr.py uses of sthalles/SimCLR's simclr.py: the import-time
# ``torch.manual_seed(0)``, ``SimCLR.__init__`` and ``SimCLR.info_nce_loss`` (``SimCLR.train`` is
# the client's loop):
#   https://github.com/sthalles/SimCLR/blob/1848fc934ad844ae630e6c452300433fe99acfd9/simclr.py
# Copyright (c) 2020 Thalles Silva. MIT License (see LICENSE beside this file).
# Restated after the source, not copied: the lookup service this was written with does not allow
# committing its text. ``info_nce_loss`` keeps the source's tensor ops in their order (the
# ``torch.eye`` boolean mask and the boolean-mask indexing ``sim[~mask]``, ``sim[pos]``,
# ``sim[~pos]``, each followed by ``.view``): the idiom the corpus exercises. The TensorBoard
# writer is the stand-in in shims.py.
import logging
import os

import torch
import torch.nn.functional as F

from clients.vendor.simclr.shims import SummaryWriter

torch.manual_seed(0)   # (the source seeds at import)


class SimCLR(object):
    """Holds the model, optimizer and scheduler of a run; the loss is ``info_nce_loss`` followed
    by cross-entropy against "the positive is column 0"."""

    def __init__(self, *args, **kwargs):
        self.args = kwargs["args"]
        device = self.args.device
        self.model = kwargs["model"].to(device)
        self.optimizer = kwargs["optimizer"]
        self.scheduler = kwargs["scheduler"]
        self.writer = SummaryWriter()
        # (the source logs the run into its TensorBoard directory, root logger at DEBUG)
        logging.basicConfig(filename=os.path.join(self.writer.log_dir, "training.log"), level=logging.DEBUG)
        self.criterion = torch.nn.CrossEntropyLoss().to(device)

    def info_nce_loss(self, features):
        """NT-Xent logits for ``n_views`` stacked views of ``batch_size`` images: for each row,
        its positive(s) first, then all negatives, divided by the temperature; the target is 0."""
        a = self.args
        ids = torch.cat([torch.arange(a.batch_size) for _ in range(a.n_views)], dim=0)
        same = (ids.unsqueeze(0) == ids.unsqueeze(1)).float().to(a.device)   # n x n, 1 = same image

        z = F.normalize(features, dim=1)
        sim = torch.matmul(z, z.T)                                           # cosine similarities

        # drop each row's self-similarity (the diagonal) from both matrices
        diag = torch.eye(same.shape[0], dtype=torch.bool).to(a.device)
        same = same[~diag].view(same.shape[0], -1)
        sim = sim[~diag].view(sim.shape[0], -1)

        positives = sim[same.bool()].view(same.shape[0], -1)
        negatives = sim[~same.bool()].view(sim.shape[0], -1)

        logits = torch.cat([positives, negatives], dim=1)
        target = torch.zeros(logits.shape[0], dtype=torch.long).to(a.device)
        return logits / a.temperature, target
