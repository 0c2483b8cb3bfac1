"""A skip-gram with negative sampling trainer: DGL's metapath2vec example
(examples/pytorch/metapath2vec), whose ``SkipGramModel`` is the common word2vec SGNS module:
``u_embeddings`` / ``v_embeddings`` = ``nn.Embedding(emb_size, emb_dimension, sparse=True)``
(u drawn from U(-1/dim, 1/dim), v zeros); the loss is ``-logsigmoid`` of the clamped
center·context score plus the summed ``-logsigmoid(-score)`` of the negatives (``torch.bmm``),
averaged. Optimizer ``optim.SparseAdam(list(model.parameters()), lr=initial_lr)`` with
``CosineAnnealingLR(optimizer, len(dataloader))``. The negatives are drawn outside the step, by
the data set (``DataReader.getNegatives``: a sliding window over a shuffled unigram^0.75 table,
in numpy), and collated into ``neg_v``; the loop body is ``scheduler.step()`` (before the
optimizer step, as the program writes it), ``optimizer.zero_grad()``, forward, ``backward()``,
``optimizer.step()``, and ``running_loss = running_loss * 0.9 + loss.item() * 0.1``.

The user compiles the part from ``zero_grad`` to ``optimizer.step()``; ``scheduler.step()``
stays before the call, in the loop.

Source: https://github.com/dmlc/dgl/blob/c96fdcde7c2a5dfbd5c93d25c93b93cf643473a4/examples/pytorch/metapath2vec/metapath2vec.py
(and model.py, reading_data.py there), Apache-2.0. Restated after the source, not copied: the
lookup service this was written with does not allow committing its text. Scaled down: a
synthetic corpus of 60 "walks" of 12 tokens over 40 words (min_count 1), dim 8 (128), window 2
(7), 5 negatives per pair as there; sub-sampling (``discards``) off so that every walk gives the
same number of pairs, and ``batch_size`` counted in walks (2) as the DataLoader does there.
"""
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.nn import init
from torch.utils.data import DataLoader, Dataset

SOURCE = ("https://github.com/dmlc/dgl/blob/c96fdcde7c2a5dfbd5c93d25c93b93cf643473a4/"
          "examples/pytorch/metapath2vec/metapath2vec.py")
LICENSE = "Apache-2.0"
TAGS = ("word2vec", "sgns", "embedding", "sparse-grad", "sparseadam", "cosine-lr", "dataloader")


class SkipGramModel(nn.Module):
    def __init__(self, emb_size, emb_dimension):
        super(SkipGramModel, self).__init__()
        self.emb_size = emb_size
        self.emb_dimension = emb_dimension
        self.u_embeddings = nn.Embedding(emb_size, emb_dimension, sparse=True)
        self.v_embeddings = nn.Embedding(emb_size, emb_dimension, sparse=True)
        initrange = 1.0 / self.emb_dimension
        init.uniform_(self.u_embeddings.weight.data, -initrange, initrange)
        init.constant_(self.v_embeddings.weight.data, 0)

    def forward(self, pos_u, pos_v, neg_v):
        emb_u = self.u_embeddings(pos_u)
        emb_v = self.v_embeddings(pos_v)
        emb_neg_v = self.v_embeddings(neg_v)
        score = torch.clamp(torch.sum(torch.mul(emb_u, emb_v), dim=1), max=10, min=-10)
        score = -F.logsigmoid(score)
        neg_score = torch.clamp(torch.bmm(emb_neg_v, emb_u.unsqueeze(2)).squeeze(), max=10, min=-10)
        neg_score = -torch.sum(F.logsigmoid(-neg_score), dim=1)
        return torch.mean(score + neg_score)


class DataReader:
    """The word counts, and the negative-sampling table (each word repeated in proportion to its
    count^0.75, shuffled) read through a sliding window."""
    NEGATIVE_TABLE_SIZE = 1e4

    def __init__(self, walks):
        self.negpos = 0
        self.word2id, self.id2word, self.word_frequency = {}, {}, {}
        counts = {}
        for line in walks:
            for w in line:
                counts[w] = counts.get(w, 0) + 1
        for wid, (w, c) in enumerate(counts.items()):
            self.word2id[w], self.id2word[wid], self.word_frequency[wid] = wid, w, c
        pow_frequency = np.array(list(self.word_frequency.values())) ** 0.75
        ratio = pow_frequency / sum(pow_frequency)
        count = np.round(ratio * DataReader.NEGATIVE_TABLE_SIZE)
        negatives = []
        for wid, c in enumerate(count):
            negatives += [wid] * int(c)
        self.negatives = np.array(negatives)
        np.random.shuffle(self.negatives)

    def getNegatives(self, target, size):
        response = self.negatives[self.negpos:self.negpos + size]
        self.negpos = (self.negpos + size) % len(self.negatives)
        if len(response) != size:
            return np.concatenate((response, self.negatives[0:self.negpos]))
        return response


class Metapath2vecDataset(Dataset):
    def __init__(self, data, walks, window_size):
        self.data, self.walks, self.window_size = data, walks, window_size

    def __len__(self):
        return len(self.walks)

    def __getitem__(self, idx):
        word_ids = [self.data.word2id[w] for w in self.walks[idx]]
        pair_catch = []
        for i, u in enumerate(word_ids):
            for j, v in enumerate(word_ids[max(i - self.window_size, 0):i + self.window_size]):
                if i == j:
                    continue
                pair_catch.append((u, v, self.data.getNegatives(v, 5)))
        return pair_catch

    @staticmethod
    def collate(batches):
        all_u = [u for batch in batches for u, _, _ in batch if len(batch) > 0]
        all_v = [v for batch in batches for _, v, _ in batch if len(batch) > 0]
        all_neg_v = [neg_v for batch in batches for _, _, neg_v in batch if len(batch) > 0]
        return torch.LongTensor(all_u), torch.LongTensor(all_v), torch.LongTensor(np.array(all_neg_v))


def main(sg, steps=8, device="cpu", amp=None, sparse_adam_in_step=True):
    rng = np.random.RandomState(5)
    walks = [[f"w{rng.randint(40)}" for _ in range(12)] for _ in range(60)]
    data = DataReader(walks)
    dataset = Metapath2vecDataset(data, walks, 2)
    dataloader = DataLoader(dataset, batch_size=2, shuffle=True, num_workers=0, collate_fn=dataset.collate)
    skip_gram_model = SkipGramModel(len(data.word2id), 8).to(device)
    optimizer = optim.SparseAdam(list(skip_gram_model.parameters()), lr=0.025)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, len(dataloader))
    sg.track(model=skip_gram_model, optimizer=optimizer, scheduler=scheduler)

    @sg.compile
    def train_step(pos_u, pos_v, neg_v):
        optimizer.zero_grad()
        loss = skip_gram_model.forward(pos_u, pos_v, neg_v)
        loss.backward()
        if sparse_adam_in_step:
            optimizer.step()
        return loss

    done = 0
    while done < steps:  # for iteration in range(self.iterations):
        running_loss = 0.0
        for i, sample_batched in enumerate(dataloader):
            if done == steps:
                break
            if len(sample_batched[0]) > 1:
                pos_u = sample_batched[0].to(device)
                pos_v = sample_batched[1].to(device)
                neg_v = sample_batched[2].to(device)
                scheduler.step()
                loss = train_step(pos_u, pos_v, neg_v)
                if not sparse_adam_in_step:   # (word2vec_sgns_step_outside: the refusal's fix)
                    optimizer.step()
                sg.log(loss)
                running_loss = running_loss * 0.9 + loss.item() * 0.1
                done += 1
        sg.log(running_loss)
