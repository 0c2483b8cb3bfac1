"""pytorch/examples word_language_model ``--model Transformer --use-optimizer --lr 0.001``: the
corpus client ``word_language_model_transformer_log_outside`` (the per-batch body compiled, its
``log_interval`` block after the call, the fix stepgraph names for the base client) with main.py's
``--use-optimizer`` path: ``optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)``,
``optimizer.zero_grad()`` and ``optimizer.step()`` in the body instead of ``model.zero_grad()`` and
the hand-written SGD update (the epoch loop's ``lr /= 4.0`` then only reaches the print, as in
main.py). ``--lr 0.001``: main.py's default lr 20 is for its SGD update.

Source: https://github.com/pytorch/examples/blob/77f55b912142e11fcfdf5b530231fb9c52f181e8/word_language_model/main.py
(BSD-3-Clause).
"""
from clients.harness import load

SOURCE = ("https://github.com/pytorch/examples/blob/77f55b912142e11fcfdf5b530231fb9c52f181e8/"
          "word_language_model/main.py")
LICENSE = "BSD-3-Clause"
TAGS = ("transformer", "lm", "nn-transformer", "src-mask-attr", "adamw", "clip", "item-in-step", "dropout",
        "ragged-last-batch", "eval-mode")


def main(sg, steps=8, device="cpu", amp=None):
    base = load("word_language_model_transformer_log_outside")   # a fresh copy, its own globals
    base.args.use_optimizer = True
    base.args.lr = 0.001
    base.lr = base.args.lr
    base.main(sg, steps=steps, device=device, amp=amp)
