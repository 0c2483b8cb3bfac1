"""Why did backend='inductor' with cuDNN attention (bf16) end 0.25 from eager (H100)? Per-parameter view."""
import sys, warnings
import torch
sys.path.insert(0, "tests")
import test_cuda_sdpa as T
from stepgraph.backends import inductor
from parity import rel_err

def variant(name, backend, opt_kw, unsafe=True):
    import stepgraph
    saved = dict(inductor._UNSAFE_OPS)
    if not unsafe:
        inductor._UNSAFE_OPS.clear()
    try:
        torch.manual_seed(0)
        case = T.models.build("gpt", sdpa=True, dropout=0.0, device="cuda")
        twin = case.fresh()
        opt = torch.optim.AdamW(case.model.parameters(), lr=1e-3, **opt_kw)
        opt2 = torch.optim.AdamW(twin.model.parameters(), lr=1e-3, **opt_kw)
        sg = stepgraph.compile(T._step(case, opt, "cudnn", "bf16"), backend=backend)
        eager = T._step(twin, opt2, "cudnn", "bf16")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i in range(6):
                b = case.make_batch(100 + i)
                sg(*b); eager(*b)
                if backend == "inductor" and i == 2:
                    sg.wait_compiled()
        names = [n for n, _ in case.model.named_parameters()]
        errs = sorted(((rel_err(p, q), n, q.norm().item())
                       for n, p, q in zip(names, case.model.parameters(), twin.model.parameters())), reverse=True)
        flat = lambda m: torch.cat([p.detach().double().flatten() for p in m.parameters()])
        print(f"{name} [{sg.captures[-1].backend}]: global rel {rel_err(flat(case.model), flat(twin.model)):.2e}; "
              f"worst params {[(n, f'{e:.1e}', f'|p|={nm:.1e}') for e, n, nm in errs[:3]]}", flush=True)
    except Exception as e:
        print(f"{name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    finally:
        inductor._UNSAFE_OPS.update(saved)

variant("cudagraph foreach", "cudagraph", dict(foreach=True))
variant("cudagraph fused", "cudagraph", dict(fused=True))
variant("inductor fused (unfused fallback)", "inductor", dict(fused=True))
variant("inductor fused by Inductor, eager fused", "inductor", dict(fused=True), unsafe=False)
variant("inductor fused by Inductor, eager capturable foreach", "inductor", dict(foreach=True, capturable=True), unsafe=False)
