"""karpathy/makemore: a character-level language model over names; ``--type gru`` (the RNN class with
karpathy's own GRUCell: ``torch.cat`` of input and hidden state, sigmoid gates, a Python loop over the
16 time steps, the learned start state ``expand``-ed over the batch), ``F.cross_entropy(...,
ignore_index=-1)`` over padded targets; AdamW (lr 5e-4, weight_decay 0.01, betas (0.9, 0.99), eps
1e-8); ``model.zero_grad(set_to_none=True)`` on the model, not the optimizer, between the forward
and ``loss.backward()``.

Model: vendor/makemore/makemore.py (every model class, verbatim). Loop: makemore.py's training loop
(lines 675-695): the step function is the body from ``logits, loss = model(X, Y)`` to
``optimizer.step()``; the batch comes from ``batch_loader.next()`` before it, the ``loss.item()``
print every 10 steps after it. ``CharDataset.__getitem__`` (lines 535-543) encodes the words, kept as
written. Scaled down: 64 synthetic lowercase names (seeded) instead of names.txt, max word length 15
(block_size 16), batch 8 instead of 32, n_embd = n_embd2 = 16; no tensorboard, evaluation or sampling
(they start at step 200/500).
"""
import torch

from clients.vendor.makemore.makemore import RNN, ModelConfig

SOURCE = "https://github.com/karpathy/makemore/blob/988aa59/makemore.py"
LICENSE = "MIT"
TAGS = ("rnn", "gru-cell", "python-time-loop", "lm", "ignore-index", "adamw", "model-zero-grad-set-to-none")


class args:  # argparse defaults of makemore.py (--type gru), scaled down
    type = 'gru'; n_layer = 4; n_head = 4; n_embd = 16; n_embd2 = 16; batch_size = 8
    learning_rate = 5e-4; weight_decay = 0.01; max_steps = 8


class CharDataset:  # makemore.py lines 506-543 (the torch Dataset base dropped; encode/__getitem__ as written)

    def __init__(self, words, chars, max_word_length):
        self.words = words
        self.chars = chars
        self.max_word_length = max_word_length
        self.stoi = {ch:i+1 for i,ch in enumerate(chars)}
        self.itos = {i:s for s,i in self.stoi.items()} # inverse mapping

    def __len__(self):
        return len(self.words)

    def get_vocab_size(self):
        return len(self.chars) + 1 # all the possible characters and special 0 token

    def get_output_length(self):
        return self.max_word_length + 1 # <START> token followed by words

    def encode(self, word):
        ix = torch.tensor([self.stoi[w] for w in word], dtype=torch.long)
        return ix

    def __getitem__(self, idx):
        word = self.words[idx]
        ix = self.encode(word)
        x = torch.zeros(self.max_word_length + 1, dtype=torch.long)
        y = torch.zeros(self.max_word_length + 1, dtype=torch.long)
        x[1:1+len(ix)] = ix
        y[:len(ix)] = ix
        y[len(ix)+1:] = -1 # index -1 will mask the loss at the inactive locations
        return x, y


def main(sg, steps=8, device="cpu", amp=None):
    args.max_steps = steps
    g = torch.Generator().manual_seed(1)
    chars = [chr(ord('a') + i) for i in range(26)]
    lengths = torch.randint(3, 16, (64,), generator=g).tolist()
    words = [''.join(chars[i] for i in torch.randint(0, 26, (n,), generator=g).tolist()) for n in lengths]
    train_dataset = CharDataset(words, chars, max(len(w) for w in words))
    vocab_size = train_dataset.get_vocab_size()
    block_size = train_dataset.get_output_length()

    config = ModelConfig(vocab_size=vocab_size, block_size=block_size,
                       n_layer=args.n_layer, n_head=args.n_head,
                       n_embd=args.n_embd, n_embd2=args.n_embd2)
    model = RNN(config, cell_type='gru')
    model.to(device)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay, betas=(0.9, 0.99), eps=1e-8)
    sg.track(model=model, optimizer=optimizer)

    # (InfiniteDataLoader: a RandomSampler with replacement, from a seeded generator here)
    order = torch.randint(0, len(train_dataset), (steps * args.batch_size,), generator=g).tolist()

    def next_batch(step):
        items = [train_dataset[i] for i in order[step * args.batch_size:(step + 1) * args.batch_size]]
        return [torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])]

    @sg.compile
    def train_step(X, Y):
        # feed into the model
        logits, loss = model(X, Y)

        # calculate the gradient, update the weights
        model.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss

    step = 0
    while True:
        # get the next batch, ship to device, and unpack it to input and target
        batch = next_batch(step)
        batch = [t.to(device) for t in batch]
        X, Y = batch

        loss = train_step(X, Y)
        sg.log(loss)

        # logging
        if step % 10 == 0:
            loss.item()  # print(f"step {step} | loss {loss.item():.4f} | step time ...")

        step += 1
        # termination conditions
        if args.max_steps >= 0 and step >= args.max_steps:
            break
