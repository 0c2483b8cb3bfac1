"""stepgraph inside Lightning: one callback captures the whole training step.

    pip install 'stepgraph[lightning]'      # or: pip install lightning
    PYTHONPATH=. python examples/lightning_example.py

Trains a small classifier twice on the CPU -- plain Lightning, then with
``callbacks=[StepGraphCallback()]`` -- with bf16 autocast, gradient accumulation, gradient
clipping, a per-step LR schedule, validation and ``self.log``; prints both runs' metrics,
whether the parameters are bit-for-bit equal, and stepgraph's counters.
"""
import time

import torch
import torch.nn.functional as F
from torch import nn

import lightning.pytorch as L

from stepgraph.integrations.lightning import StepGraphCallback


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Dropout(0.1), nn.LayerNorm(128),
                                 nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True, on_step=True, on_epoch=True)
        self.log("lr", self.optimizers().param_groups[0]["lr"])
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=60)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, :10].argmax(1) + (x[:, 10] > 1)) % 10)


def fit(callbacks):
    torch.manual_seed(0)
    model = Classifier()
    trainer = L.Trainer(max_epochs=3, accelerator="cpu", precision="bf16-mixed", accumulate_grad_batches=2,
                        gradient_clip_val=1.0, callbacks=callbacks, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    t = time.perf_counter()
    trainer.fit(model, torch.utils.data.DataLoader(data(1280, 1), batch_size=32),
                torch.utils.data.DataLoader(data(256, 2), batch_size=64))
    return model, trainer, time.perf_counter() - t


if __name__ == "__main__":
    eager_model, eager_trainer, eager_s = fit([])
    sg = StepGraphCallback()  # <- the one line
    sg_model, sg_trainer, sg_s = fit([sg])
    same = all(torch.equal(p, q) for p, q in zip(sg_model.parameters(), eager_model.parameters()))
    print(f"eager:     {({k: round(float(v), 6) for k, v in eager_trainer.callback_metrics.items()})}  {eager_s:.2f}s")
    print(f"stepgraph: {({k: round(float(v), 6) for k, v in sg_trainer.callback_metrics.items()})}  {sg_s:.2f}s")
    print(f"parameters bit-for-bit equal: {same}; global_step {sg_trainer.global_step} (eager {eager_trainer.global_step})")
    print(f"stepgraph: {sg.stats}")
