"""clients/lora_finetune.py with the fix its CLEAR-ERROR names applied: the LoRA repo's own AdamW
(a Python int ``state['step']``) replaced by ``torch.optim.AdamW`` on the trainable (LoRA)
parameters, same lr/betas/eps/weight decay; everything else as there: loralib ``Linear`` q/v
layers (r=8, alpha 16, dropout 0.1, merge_weights=True), the linear warmup LambdaLR stepped in
the step, ``loss.item()`` in the step, and ``evaluate`` every 3 steps: ``model.eval()`` merges
``B @ A * scaling`` into the frozen weights in place, ``model.train()`` subtracts it again."""
from clients.lora_finetune import LICENSE, SOURCE, TAGS  # noqa: F401
from clients.lora_finetune import main as _main


def main(sg, steps=8, device="cpu", amp=None):
    _main(sg, steps=steps, device=device, amp=amp, torch_adamw=True)
