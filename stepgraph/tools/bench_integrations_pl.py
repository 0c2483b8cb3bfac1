"""The Lightning suite of :mod:`stepgraph.tools.bench_integrations`: ``lightning.pytorch.Trainer``
fitting a small GPT ``LightningModule`` (the GPT of :mod:`stepgraph.tools.models`: SDPA attention,
dropout 0.1, tied head), eager, ``trainer.fit(torch.compile(model[, mode="reduce-overhead"]))``
(Lightning's documented way: it compiles ``forward`` and ``training_step``), the network inside
compiled in place (``module.gpt.compile()``) and with ``callbacks=[StepGraphCallback()]``."""
from __future__ import annotations

import math
import os
import warnings

import torch
import torch.nn.functional as F

from .bench_integrations import Skip
from .bench_integrations_hf import walk_tokens
from .models import GPT


def _module_class():
    import lightning.pytorch as pl

    class GPTModule(pl.LightningModule):
        """Automatic optimization: next-token cross-entropy, AdamW with decay on matrices only,
        linear warm-up then cosine (stepped every batch); logs the loss."""

        def __init__(self, s, total):
            super().__init__()
            self.total = total
            self.gpt = GPT(s["layers"], s["d"], s["heads"], s["vocab"], s["seq"], 0.1, True)

        def forward(self, idx):
            return self.gpt(idx)

        def training_step(self, batch, batch_idx):
            x, y = batch
            logits = self(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            self.log("train_loss", loss, on_step=True, prog_bar=True)
            return loss

        def configure_optimizers(self):
            decay = [p for p in self.parameters() if p.dim() >= 2]
            rest = [p for p in self.parameters() if p.dim() < 2]
            opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                    lr=1e-3, betas=(0.9, 0.95))
            warm, total = max(1, min(10, self.total // 4)), self.total

            def lr_at(step):
                if step < warm:
                    return (step + 1) / warm
                return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
    return GPTModule


def describe_gpt(ctx) -> str:
    s = ctx.size
    n = sum(p.numel() for p in GPT(s["layers"], s["d"], s["heads"], s["vocab"], s["seq"], 0.1, True).parameters())
    return (f"lightning.pytorch.Trainer, GPT LightningModule (layers={s['layers']}, d={s['d']}, heads={s['heads']}, "
            f"vocab={s['vocab']}, seq={s['seq']}, SDPA, dropout 0.1), batch {s['batch']}, AdamW lr 1e-3 "
            f"warm-up + cosine per step, gradient_clip_val=1.0, {n / 1e6:.2f}M parameters")


def run_gpt(variant, ctx, timer):
    import lightning.pytorch as pl

    cuda = ctx.dev.type == "cuda"
    if variant.startswith("reduce-overhead") and not cuda:
        raise Skip("reduce-overhead records CUDA graphs: CUDA only")
    s = ctx.size
    every = ctx.log_every

    class Timing(pl.Callback):
        """Marks each batch; keeps the mean loss of every ``every`` batches (as Hugging Face logs it)
        with one device add per batch, read after the fit."""

        def __init__(self):
            self.acc, self.n, self.logged = None, 0, []

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            timer.begin()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            timer.end()
            loss = outputs["loss"].detach().float()
            self.acc = loss.clone() if self.acc is None else self.acc + loss
            self.n += 1
            if trainer.global_step % every == 0 or trainer.global_step == ctx.total:
                self.logged.append((trainer.global_step, self.acc / self.n))
                self.acc, self.n = None, 0

    ids = walk_tokens(ctx.total * s["batch"], s["seq"] + 1, s["vocab"], seed=3)
    data = torch.utils.data.TensorDataset(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
    loader = torch.utils.data.DataLoader(data, batch_size=s["batch"], shuffle=False, num_workers=0)
    torch.manual_seed(0)
    model = _module_class()(s, ctx.total)
    fit_model = model
    mode = "reduce-overhead" if variant.startswith("reduce-overhead") else None
    if variant in ("compile", "reduce-overhead"):  # Lightning's documented way
        fit_model = torch.compile(model, backend=ctx.compile_backend, mode=mode)
    elif variant in ("compile-net", "reduce-overhead-net"):  # the network inside, in place
        model.gpt.compile(backend=ctx.compile_backend, mode=mode)
    timing = Timing()
    callbacks = [timing]
    sg = None
    if variant == "stepgraph":
        from stepgraph.integrations.lightning import StepGraphCallback
        sg = StepGraphCallback()
        callbacks.insert(0, sg)
    trainer = pl.Trainer(max_steps=ctx.total, accelerator="gpu" if cuda else "cpu", devices=1,
                         precision="bf16-mixed" if ctx.bf16 else "32-true", gradient_clip_val=1.0,
                         callbacks=callbacks, logger=False, log_every_n_steps=every, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0, default_root_dir=os.path.join(ctx.workdir, "pl"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(fit_model, loader)
    notes = sorted({str(w.message).splitlines()[0][:200] for w in caught if "stepgraph" in str(w.message)})
    losses = [(step, float(v)) for step, v in timing.logged]
    if sg is not None:
        st = sg.stats
        notes.insert(0, f"eager_calls={st.eager_calls} captures={st.captures} replays={st.replays}"
                     if st is not None else f"not captured: {sg.eager_reason}")
        if st is not None and not st.replays:
            notes.insert(0, "NO REPLAYS (ran eagerly)")
    return losses, "; ".join(notes)
