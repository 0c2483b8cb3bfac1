"""karpathy/minGPT: the character-level GPT of projects/chargpt trained by mingpt/trainer.py's
``Trainer.run``: AdamW from ``model.configure_optimizers`` (decay / no-decay groups chosen by
module type), a DataLoader with a replacement RandomSampler, the forward returning
``(logits, loss)``, ``model.zero_grad(set_to_none=True)`` *after* the forward, backward,
``clip_grad_norm_``, ``optimizer.step()``, and chargpt's ``on_batch_end`` callback reading
``trainer.loss.item()``.

Model: vendor/mingpt/model.py, utils.py, trainer.py (verbatim) and chargpt.py's CharDataset
(verbatim). Loop: mingpt/trainer.py ``Trainer.run`` (lines 61-109 at 37baab7), its body written
out in ``main`` with ``self`` as the Trainer object (the forward ... optimizer.step block is the
step), and chargpt.py's config and ``batch_end_callback`` logging (its every-500-iterations
sampling / checkpoint branch left out).

Scaled down: model_type None with n_layer=2, n_head=2, n_embd=32 (chargpt uses 'gpt-mini'),
block_size=16, batch_size=4, num_workers=0 (4 worker processes in the original), a synthetic
4000-character text over a 12-character alphabet instead of input.txt.
"""
import time

import torch
from torch.utils.data.dataloader import DataLoader

from clients.vendor.mingpt.chargpt import CharDataset
from clients.vendor.mingpt.model import GPT
from clients.vendor.mingpt.trainer import Trainer
from clients.vendor.mingpt.utils import CfgNode as CN

SOURCE = "https://github.com/karpathy/minGPT/blob/37baab7/mingpt/trainer.py"
LICENSE = "MIT"
TAGS = ("transformer", "gpt", "lm", "clip", "adamw", "weight-decay-groups", "dropout",
        "zero-grad-after-forward", "dataloader", "callback")


def get_config():

    C = CN()

    # system
    C.system = CN()
    C.system.seed = 3407
    C.system.work_dir = './out/chargpt'

    # data
    C.data = CharDataset.get_default_config()

    # model
    C.model = GPT.get_default_config()
    C.model.model_type = 'gpt-mini'

    # trainer
    C.trainer = Trainer.get_default_config()
    C.trainer.learning_rate = 5e-4 # the model we're using is so small that we can go a bit faster

    return C


def main(sg, steps=8, device="cpu", amp=None):
    # get default config and overrides (as from the command line)
    config = get_config()
    config.model.merge_from_dict(dict(model_type=None, n_layer=2, n_head=2, n_embd=32))
    config.data.block_size = 16
    config.trainer.merge_from_dict(dict(device=device, batch_size=4, num_workers=0, max_iters=steps))

    # construct the training dataset (synthetic text instead of input.txt)
    alphabet = "abcdefghij \n"
    g = torch.Generator().manual_seed(1)
    text = "".join(alphabet[i] for i in torch.randint(0, len(alphabet), (4000,), generator=g).tolist())
    train_dataset = CharDataset(config.data, text)

    # construct the model
    config.model.vocab_size = train_dataset.get_vocab_size()
    config.model.block_size = train_dataset.get_block_size()
    model = GPT(config.model)

    # construct the trainer object
    trainer = Trainer(config.trainer, model, train_dataset)

    # iteration callback
    def batch_end_callback(trainer):

        if trainer.iter_num % 10 == 0:
            print(f"iter_dt {trainer.iter_dt * 1000:.2f}ms; iter {trainer.iter_num}: train loss {trainer.loss.item():.5f}")
        sg.log(trainer.loss)

    trainer.set_callback('on_batch_end', batch_end_callback)

    # ---- trainer.run(), written out --------------------------------------------------------
    self = trainer
    model, config = self.model, self.config

    # setup the optimizer
    self.optimizer = model.configure_optimizers(config)
    sg.track(model=model, optimizer=self.optimizer)

    # setup the dataloader
    train_loader = DataLoader(
        self.train_dataset,
        sampler=torch.utils.data.RandomSampler(self.train_dataset, replacement=True, num_samples=int(1e10)),
        shuffle=False,
        pin_memory=True,
        batch_size=config.batch_size,
        num_workers=config.num_workers,
    )

    @sg.compile
    def train_step(x, y):
        # forward the model
        logits, loss = model(x, y)

        # backprop and update the parameters
        model.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_norm_clip)
        self.optimizer.step()
        return loss

    model.train()
    self.iter_num = 0
    self.iter_time = time.time()
    data_iter = iter(train_loader)
    while True:

        # fetch the next batch (x, y) and re-init iterator if needed
        try:
            batch = next(data_iter)
        except StopIteration:
            data_iter = iter(train_loader)
            batch = next(data_iter)
        batch = [t.to(self.device) for t in batch]
        x, y = batch

        self.loss = train_step(x, y)

        self.trigger_callbacks('on_batch_end')
        self.iter_num += 1
        tnow = time.time()
        self.iter_dt = tnow - self.iter_time
        self.iter_time = tnow

        # termination conditions
        if config.max_iters is not None and self.iter_num >= config.max_iters:
            break
