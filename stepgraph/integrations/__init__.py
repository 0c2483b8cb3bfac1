"""stepgraph inside the training frameworks people already use.

* :mod:`stepgraph.integrations.lightning` -- ``StepGraphCallback`` for ``lightning.pytorch.Trainer``
  (``pip install 'stepgraph[lightning]'``).
* :mod:`stepgraph.integrations.hf` -- ``StepGraphTrainer`` for ``transformers.Trainer`` and
  ``accelerate_step`` for Accelerate loops (``pip install 'stepgraph[hf]'``).

Each module imports its framework when imported; ``import stepgraph`` imports neither.
"""
