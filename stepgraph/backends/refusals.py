"""What a CUDA graph would silently get wrong, refused before recording (the replay backend
runs it instead): host scalars, RNG state saved on the host, resized storages (FSDP2),
data-dependent shapes, sparse tensors, several GPUs in one step."""
from __future__ import annotations

import torch
from torch import fx

from ..errors import CaptureError, NeedsHostScalars, NeedsReplay, RunsEagerly
from ..passes.analysis import collective_nodes, host_staged


def check_graph(gm: fx.GraphModule, problems_out: list, inputs=()) -> None:
    """Refuse what a CUDA graph would silently get wrong: host scalars and several GPUs.
    (CPU tensor work: capture/cpuwork.py:_cpu_work.) ``inputs``: a sparse one shows in no node value
    (pygcn's adjacency matrix reached the static-buffer copy: "copy_() between dense and sparse")."""
    devices = set()
    if any(isinstance(x, torch.Tensor) and x.layout != torch.strided for x in inputs):
        problems_out.append("sparse")
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is torch.ops.aten._local_scalar_dense.default:
            problems_out.append("host-scalar")
        if n.op == "call_function" and getattr(n.target, "__name__", "") == "tensor_shape" \
                and "dynamic-shape" not in problems_out:
            problems_out.append("dynamic-shape")   # (capture/trace.py: a data-dependent shape, guarded)
        val = n.meta.get("val")
        for v in val if isinstance(val, (list, tuple)) else [val]:
            if isinstance(v, torch.Tensor) and v.device.type == "cuda":
                devices.add(v.device.index)
                if v.layout != torch.strided and "sparse" not in problems_out:
                    problems_out.append("sparse")
    if len(devices) > 1:
        problems_out.append(f"tensors on several GPUs ({sorted(devices)}) in one step")
    host_backend = _host_collective(gm)
    if host_backend is not None:
        problems_out.append(host_backend)


def _host_collective(gm: fx.GraphModule) -> str | None:
    """A collective on CUDA tensors over a process group whose backend stages through the host
    (gloo: it copies to CPU and waits): recorded into a CUDA graph it crashed the process (MoCo
    v2's all_gather on a gloo group, H200: SIGSEGV). Returns the problem, or None."""
    import torch.distributed as dist
    for n in collective_nodes(gm):
        val = n.meta.get("val")
        if not (isinstance(val, torch.Tensor) and val.device.type == "cuda"):
            continue
        name = next((a for a in reversed(n.args) if isinstance(a, str)), None)
        try:
            backend = host_staged(dist.distributed_c10d._resolve_process_group(name))
        except Exception:   # (an unknown group: not ours to judge)
            continue
        if backend is not None:
            return f"host-collective:{backend}:{n.target}"
    return None


def drop_idle_rng_state_calls(gm: fx.GraphModule) -> bool:
    """Checkpointing saves/restores the RNG state even when the region draws no random numbers;
    with no random op in the graph those calls change nothing and can go. True if dropped."""
    from ..markers import RNG_STATE_FUNCS
    nodes = list(gm.graph.nodes)
    if any(isinstance(n.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in n.target.tags
           for n in nodes if n.op == "call_function"):
        return False
    for n in reversed(nodes):
        if n.op == "call_function" and n.target in RNG_STATE_FUNCS and not n.users:
            gm.graph.erase_node(n)
    gm.recompile()
    return not any(n.op == "call_function" and n.target in RNG_STATE_FUNCS for n in gm.graph.nodes)


def refuse_uncapturable(gm: fx.GraphModule, host_scalar_ops=(), rng_state_calls=0, inputs=()) -> None:
    if rng_state_calls and not drop_idle_rng_state_calls(gm):
        raise NeedsReplay(
            "the step saves and restores the RNG state on the host (activation checkpointing with "
            "preserve_rng_state=True, or fork_rng): a CUDA graph cannot replay that",
            op="torch.get_rng_state/set_rng_state", where="torch.utils.checkpoint / torch.random.fork_rng",
            fix="use backend='replay' (backend='auto' does so), or checkpoint regions without dropout "
                "with preserve_rng_state=False")
    from ..passes.analysis import RESIZE_STORAGE
    if any(n.target is RESIZE_STORAGE for n in gm.graph.nodes):
        raise NeedsReplay(
            "the step frees and allocates storages (FSDP2's unsharded parameters): a CUDA graph "
            "cannot record that", op="inductor.resize_storage_bytes_", where="FSDP2's hooks",
            fix="use backend='replay' (backend='auto' does so)")
    problems: list = []
    check_graph(gm, problems, inputs)
    if "dynamic-shape" in problems:
        raise NeedsReplay(
            "the step has an op whose output shape depends on tensor values (nonzero, a boolean "
            "mask, unique): it syncs with the host to allocate, which a CUDA graph cannot record",
            op="data-dependent shape", where="the step",
            fix="use backend='replay' (backend='auto' does so), or keep shapes static (torch.where, "
                "multiplying by a mask)")
    if "sparse" in problems:
        raise NeedsReplay(
            "the step computes with sparse CUDA tensors: cuSPARSE's kernels synchronise with the host "
            "and cannot be recorded into a CUDA graph", op="sparse tensor op", where="the step",
            fix="use backend='replay' (backend='auto' does so), or a dense adjacency matrix")
    if host_scalar_ops and "torch/optim/" not in host_scalar_ops[0][1]:
        # (not an optimizer: name the op and the line, the fallback warning shows them -- issue 15
        # found a plain AdamW step blamed for an op elsewhere)
        op, site = host_scalar_ops[0]
        more = f" and {len(host_scalar_ops) - 1} more" if len(host_scalar_ops) > 1 else ""
        raise NeedsHostScalars(
            f"the step cannot be recorded as a CUDA graph: it computes on 0-dim CPU tensors ({op} at {site}{more})",
            op=op, where=site,
            fix="make that value on the GPU (device=...), or use backend='replay' (backend='auto' does so)")
    if "host-scalar" in problems or host_scalar_ops:
        raise NeedsHostScalars(
            "the step cannot be recorded as a CUDA graph: an optimizer reads its step counter on "
            "the host every step (PyTorch has no capturable form of it, e.g. Adagrad)",
            op="aten._local_scalar_dense", where="the optimizer's step()",
            fix="use backend='replay' (or backend='auto', which does so), or an optimizer with "
                "capturable=True such as Adam/AdamW/RMSprop/SGD")
    host = next((p for p in problems if p.startswith("host-collective:")), None)
    if host is not None:
        _, backend, op = host.split(":", 2)
        raise NeedsReplay(
            f"the step runs {op} on CUDA tensors over a {backend} process group, which copies them "
            "to the host and waits there: a CUDA graph cannot record that", op=op,
            where=f"the {backend} process group",
            fix="init_process_group('nccl') for CUDA tensors (as torchrun scripts do), or use "
                "backend='replay' (backend='auto' does so)")
    if problems:
        raise CaptureError(f"the step cannot be recorded as a CUDA graph: {problems[0]}",
                           op=problems[0], where="the step function",
                           fix="keep every tensor of the step on one GPU (move CPU tensors to the "
                               "device before the step, return values instead of reading them), "
                               "or use backend='replay'")


def refuse_collectives_with_reads(reg, device: str, tr) -> None:
    """A CUDA step calling collectives itself and reading tensor values on the host: MoCo v2
    (all_gather, broadcast, ``int(self.queue_ptr)``) left eager's gradients by 0.29 on the H200
    with every backend, replay included, while its CPU run (gloo) is bitwise and DINO's
    (all_reduce, a one-time host read) passes. Until the cause is found such steps run eagerly,
    warned -- inside the trace, so that this call is undone and runs eagerly from its start."""
    # (value guards only -- a branch, a position: a read only returned or logged, a DDP script's
    # all-reduced loss for its meter, has no guard and keeps its graph)
    sites = list(dict.fromkeys(g[0] for g in tr.reads.guards)) if tr.reads is not None else []
    if device == "cuda" and reg.collective_groups and sites:
        raise RunsEagerly(
            f"it calls torch.distributed collectives itself and reads tensor values on the host "
            f"({sites[0]}): on the GPU such a step (MoCo v2) left eager's results, so it is not "
            "captured; keep the host read out of the step (a tensor pointer and index_copy_ for a "
            "ring buffer) to capture it")
