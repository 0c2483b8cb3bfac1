"""A fusion bug on demand: Inductor's compiled step made to return NaN in its first output
(lora_finetune's fused step on the CPU gave NaN from its first call). Shared by
tests/test_inductor_verify.py and tests/fsdp2_worker.py (no pytest import: the worker runs under
torchrun)."""
import torch


def nan_first_output(compile_fn, when=lambda: True):
    """``compile_fn`` (an Inductor ``_compile``) whose result returns NaN first, where ``when()``."""
    def compile_(lifted, inputs, cuda):
        compiled = compile_fn(lifted, inputs, cuda)

        def bad(*a):
            out = list(compiled(*a))
            out[0] = torch.full_like(out[0], float("nan"))
            return out
        return bad if when() else compiled
    return compile_
