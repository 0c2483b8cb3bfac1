"""A checkpoint written under stepgraph is the one the user's own optimizer form writes.

On CUDA stepgraph switches optimizers to PyTorch's capturable form (``optimizers.make_capturable``:
``capturable=True``, the lr a 0-dim device tensor, step counters on the device). ``state_dict()``
used to save that form: Lightning's resumed fit loaded the lr as a CPU tensor, which a CUDA graph
cannot read (the step fell back to the replay backend, H100), and a plain run resumed from such a
checkpoint took the capturable path. ``optimizers.saved_as_the_user_made_it`` saves the user's
form; the live optimizer keeps stepgraph's.
"""
import pytest
import torch

import stepgraph
from stepgraph.optimizers import _remember


def test_state_dict_saves_the_users_lr_and_flags_and_leaves_the_live_optimizer_alone():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.25, betas=(0.9, 0.99))
    p.grad = torch.ones(3)
    opt.step()
    g = opt.param_groups[0]
    # what make_capturable / make_hyper_tensor do (on CUDA tensors; the CPU stands in here)
    for key, value in (("capturable", False), ("lr", None), ("betas", None), ("foreach", None)):
        _remember(opt, 0, key, value)
    g["capturable"], g["lr"], g["foreach"] = True, torch.tensor(0.125, dtype=torch.float64), False
    g["betas"] = (torch.tensor(0.5), 0.99)
    sd = opt.state_dict()
    saved = sd["param_groups"][0]
    assert saved["lr"] == 0.125 and type(saved["lr"]) is float
    assert saved["betas"] == (0.5, 0.99) and all(type(b) is float for b in saved["betas"])
    assert saved["capturable"] is False and saved["foreach"] is None
    # the live optimizer keeps stepgraph's form
    assert g["capturable"] is True and isinstance(g["lr"], torch.Tensor) and g["foreach"] is False
    # a plain optimizer loads it as a checkpoint written without stepgraph
    q = torch.nn.Parameter(torch.ones(3))
    plain = torch.optim.AdamW([q], lr=1.0)
    plain.load_state_dict(sd)
    assert plain.param_groups[0]["lr"] == 0.125 and plain.param_groups[0]["capturable"] is False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_checkpoint_of_a_captured_cuda_step_is_the_eager_form_and_resumes_as_one_graph():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)

    @stepgraph.compile
    def step(x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    batches = [(torch.randn(16, 8, device="cuda"), torch.randn(16, 4, device="cuda")) for _ in range(8)]
    for x, y in batches[:4]:
        step(x, y)
        sched.step()
    assert step.stats.captures == 1 and opt.param_groups[0]["capturable"] is True
    sd = opt.state_dict()
    saved = sd["param_groups"][0]
    assert type(saved["lr"]) is float and saved["lr"] == sched.get_last_lr()[0]
    assert saved["capturable"] is False
    assert all(s["step"].device.type == "cpu" for s in sd["state"].values())
    # resumed as Lightning does: the checkpoint loaded to the CPU, then into the optimizer
    import io
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    opt.load_state_dict(torch.load(buf, map_location="cpu"))
    with _no_fallback():
        for x, y in batches[4:]:
            step(x, y)
            sched.step()
    assert step.captures[-1].backend == "cudagraph", step.explain()
    assert step.stats.replays >= 3, step.stats


class _no_fallback:
    def __enter__(self):
        import warnings
        self._ctx = warnings.catch_warnings(record=True)
        self.caught = self._ctx.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        bad = [str(w.message) for w in self.caught if "chose 'replay'" in str(w.message)]
        assert not bad, bad
