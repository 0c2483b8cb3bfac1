"""PyTorch's "Text classification with the torchtext library" tutorial
(beginner_source/text_sentiment_ngrams_tutorial.py): a ``TextClassificationModel`` of one
``nn.EmbeddingBag(vocab_size, embed_dim, sparse=False)`` (mode "mean") fed a flat ``text`` tensor
and the ``offsets`` where each sentence starts, and one ``fc`` layer; ``init_weights`` draws both
weights from U(-0.5, 0.5). ``collate_batch`` concatenates the sentences of a batch and builds
``offsets`` with ``torch.tensor(lengths[:-1]).cumsum(dim=0)``, so ``text`` has the batch's total
token count as its length: a different shape at nearly every batch. ``train()``'s loop body is
the step: ``optimizer.zero_grad()``, forward, ``CrossEntropyLoss``, ``backward()``,
``clip_grad_norm_(model.parameters(), 0.1)``, ``optimizer.step()`` (SGD, lr=5); the accuracy
count (``.item()``) stays in the loop. After each epoch ``evaluate`` runs on the validation
split and ``StepLR(optimizer, 1.0, gamma=0.1)`` steps only when validation accuracy fell.

Source: https://github.com/pytorch/tutorials/blob/5130967035247c8343376ee69f49d6e10d61eaca/beginner_source/text_sentiment_ngrams_tutorial.py
(BSD-3-Clause). Restated after the source, not copied: the lookup service this was written with
does not allow committing its text. Scaled down: AG_NEWS replaced by 48 synthetic (label, token
ids) sentences of 3..11 tokens over a 120-word vocabulary, 4 classes, emsize 16 (64),
BATCH_SIZE 8 (64).
"""
import random

import torch
from torch import nn
from torch.utils.data import DataLoader

SOURCE = ("https://github.com/pytorch/tutorials/blob/5130967035247c8343376ee69f49d6e10d61eaca/"
          "beginner_source/text_sentiment_ngrams_tutorial.py")
LICENSE = "BSD-3-Clause"
TAGS = ("embeddingbag", "offsets", "text-classification", "clip", "sgd", "steplr",
        "varying-shapes", "dataloader")

device = None


class TextClassificationModel(nn.Module):
    def __init__(self, vocab_size, embed_dim, num_class):
        super(TextClassificationModel, self).__init__()
        self.embedding = nn.EmbeddingBag(vocab_size, embed_dim, sparse=False)
        self.fc = nn.Linear(embed_dim, num_class)
        self.init_weights()

    def init_weights(self):
        initrange = 0.5
        self.embedding.weight.data.uniform_(-initrange, initrange)
        self.fc.weight.data.uniform_(-initrange, initrange)
        self.fc.bias.data.zero_()

    def forward(self, text, offsets):
        embedded = self.embedding(text, offsets)
        return self.fc(embedded)


def synthetic_split(n, vocab_size, num_class, seed):
    rng = random.Random(seed)
    return [(rng.randrange(1, num_class + 1), [rng.randrange(1, vocab_size) for _ in range(rng.randrange(3, 12))])
            for _ in range(n)]


label_pipeline = lambda x: int(x) - 1  # noqa: E731 (the tutorial's lambdas)
text_pipeline = lambda x: x  # noqa: E731 (the synthetic text is token ids already)


def collate_batch(batch):
    label_list, text_list, offsets = [], [], [0]
    for _label, _text in batch:
        label_list.append(label_pipeline(_label))
        processed_text = torch.tensor(text_pipeline(_text), dtype=torch.int64)
        text_list.append(processed_text)
        offsets.append(processed_text.size(0))
    label_list = torch.tensor(label_list, dtype=torch.int64)
    offsets = torch.tensor(offsets[:-1]).cumsum(dim=0)
    text_list = torch.cat(text_list)
    return label_list.to(device), text_list.to(device), offsets.to(device)


def main(sg, steps=8, device="cpu", amp=None):
    globals()["device"] = torch.device(device)
    vocab_size, emsize, num_class, BATCH_SIZE, LR = 120, 16, 4, 8, 5
    model = TextClassificationModel(vocab_size, emsize, num_class).to(device)
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1.0, gamma=0.1)
    sg.track(model=model, optimizer=optimizer, scheduler=scheduler)
    train_dataloader = DataLoader(synthetic_split(40, vocab_size, num_class, 1), batch_size=BATCH_SIZE,
                                  shuffle=True, collate_fn=collate_batch)
    valid_dataloader = DataLoader(synthetic_split(8, vocab_size, num_class, 2), batch_size=BATCH_SIZE,
                                  shuffle=True, collate_fn=collate_batch)

    @sg.compile
    def train_step(label, text, offsets):  # train()'s loop body
        optimizer.zero_grad()
        predicted_label = model(text, offsets)
        loss = criterion(predicted_label, label)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        optimizer.step()
        return predicted_label, loss

    def evaluate(dataloader):
        model.eval()
        total_acc, total_count = 0, 0
        with torch.no_grad():
            for idx, (label, text, offsets) in enumerate(dataloader):
                predicted_label = model(text, offsets)
                criterion(predicted_label, label)
                total_acc += (predicted_label.argmax(1) == label).sum().item()
                total_count += label.size(0)
        return total_acc / total_count

    total_accu = None
    done = 0
    while done < steps:  # for epoch in range(1, EPOCHS + 1): train(train_dataloader) ...
        model.train()
        total_acc, total_count = 0, 0
        for idx, (label, text, offsets) in enumerate(train_dataloader):
            if done == steps:
                break
            predicted_label, loss = train_step(label, text, offsets)
            sg.log(loss)
            total_acc += (predicted_label.argmax(1) == label).sum().item()
            total_count += label.size(0)
            done += 1
        accu_val = evaluate(valid_dataloader)
        if total_accu is not None and total_accu > accu_val:
            scheduler.step()
        else:
            total_accu = accu_val
        sg.log([accu_val, total_acc / max(total_count, 1)])
