"""``StepFunction.explain()``: what was captured, as text (ops, state by source, guards)."""
from __future__ import annotations

from .capture import fetches
from .capture.numchecks import describe, roots_of
from .capture.sigkey import TensorMeta
from .passes.analysis import collective_nodes


def _names(xs, limit=12) -> str:
    xs = list(xs)
    if not xs:
        return "-"
    head = ", ".join(xs[:limit])
    return head + (f", ... (+{len(xs) - limit})" if len(xs) > limit else "")


def stats_line(stats, compiles: bool = True) -> str:
    """The ``stats:`` line of an explain() (a whole step's, or a graphed module's: no compiles)."""
    return (f"  stats: eager_calls={stats.eager_calls} captures={stats.captures} replays={stats.replays} "
            f"failed_captures={stats.failed_captures} capture_seconds={stats.capture_seconds:.3f}"
            + (f" compile_seconds={stats.compile_seconds:.3f}" if compiles else "")
            + (f" guard_misses={sum(stats.guard_misses.values())}" if stats.guard_misses else ""))


def _tensor(m: TensorMeta) -> str:
    return f"{str(m.dtype).replace('torch.', '')}{list(m.shape)}"


def explain(self) -> str:
    """What was captured: ops, state by source name, inputs, written state, guards."""
    lines = [f"stepgraph step {self.__name__!r}: backend={self.backend}, "
             f"{len(self.captures)} graph(s), max_captures={self.max_captures}, warmup={self.warmup}"
             + (" [DISABLED by STEPGRAPH_DISABLE: every call runs eagerly]" if self.disabled else ""),
             stats_line(self.stats)]
    for note in self.prepared_notes:
        lines.append(f"  prepared: {note}")
    for note in self.capture_notes:
        lines.append(f"  runs only at capture: {note}")
    reg = self.registry
    if reg is not None:
        lines.append("  state found: modules " + (", ".join(n for n, _ in reg.modules) or "-")
                     + "; optimizers " + (", ".join(n for n, _ in reg.optimizers) or "-"))
    lines += [f"  {line}" for line in fetches.describe(self.fetches)]
    for r in self.stats.recaptures:
        lines.append(f"  recapture: {r}")
    for site, n in self.stats.guard_misses.items():
        lines.append(f"  guard misses at {site}: {n}")
    for i, e in enumerate(self.captures):
        s = e.summary
        tr = e.trace
        compile_s = e.run.compile_seconds
        background = e.run.describe()   # (a background compile says its own times)
        lines.append(f"  graph {i} (captured at call {e.captured_at_call} in {e.seconds:.3f}s"
                     + (f", of which Inductor compile {compile_s:.2f}s" if compile_s and background is None
                        else "")
                     + f", backend {e.backend}): {s.ops} aten ops, {s.inplace_ops} in-place, "
                     f"{s.random_ops} random")
        if background is not None:
            lines.append(f"    {background}")
        ins = [x for x in e.key.inputs if isinstance(x, TensorMeta)]
        lines.append("    inputs (" + ("copied into static buffers" if e.backend == "cudagraph"
                                      else "used in place, never copied") + "): "
                     + ", ".join(f"{_tensor(m)}@{m.device}" for m in ins))
        if e.to_device:
            lines.append("    moved to the device at each call before the graph (x.to(device) in the step): "
                         + ", ".join(f"argument tensor #{m.index} -> {m.device}" for m in e.to_device))
        if e.prologue is not None:
            ops = list(dict.fromkeys(str(n.target) for n in e.prologue.module.graph.nodes if n.op == "call_function"))
            lines.append("    CPU work run before the graph at each call, as eager runs it (its results are "
                         "graph inputs): " + _names(ops, 6))
        if tr.grad_inputs:
            lines.append(f"    persistent grads read as inputs: {_names([s for _, s in tr.grad_inputs])}")
        lines.append(f"    state read ({len(s.state_read)}): {_names(s.state_read)}")
        lines.append(f"    state written in place ({len(s.state_written)}): {_names(s.state_written)}")
        if s.inputs_written:
            lines.append(f"    inputs written in place: {s.inputs_written}")
        if tr.escapes or tr.clear_slots:
            lines.append(f"    rebound after each replay: "
                         f"{_names([x.source for x in tr.escapes] + [x.source for x, _ in tr.clear_slots])}")
        colls = collective_nodes(e.graph)
        if colls:
            kinds = sorted({str(n.target).split(".")[1] for n in colls})
            lines.append(f"    collectives in the graph: {len(colls)} ({', '.join(kinds)}; DDP gradient "
                         "buckets and buffer broadcasts, FSDP2 parameter all-gathers and gradient "
                         "reduce-scatters, the step's own dist.all_reduce & co.); ranks agree in the "
                         "store before each capture")
        resizes = sum(1 for n in e.graph.graph.nodes if n.op == "call_function"
                      and str(n.target) == "inductor.resize_storage_bytes_.default")
        if resizes:
            lines.append(f"    storages freed or allocated in the graph: {resizes} (FSDP2's unsharded parameters, "
                         "as in eager)")
        unsh = e.graph.meta.get("unsharded")
        if unsh is not None and unsh.storages:
            lines.append(f"    FSDP2 unsharded parameters as graph temporaries: {unsh.storages} storages, "
                         f"{unsh.temporaries} all-gather intervals, {unsh.resizes_removed} resizes removed")
        if unsh is not None and unsh.left:
            lines.append(f"    FSDP2 storages left resized as traced: {len(unsh.left)} "
                         f"({next(iter(unsh.left.values()))})")
        live = list(dict.fromkeys(n.target.live_label for n in e.graph.graph.nodes
                                  if n.op == "call_function" and hasattr(n.target, "live_label")))
        if live:
            lines.append(f"    read live at each replay (no recapture when they change): {_names(live)}")
        if e.device_scalars is not None:
            lines.append("    read live at each call into one device tensor (no recapture when they change): "
                         f"{_names(list(dict.fromkeys(e.device_scalars.labels)))}")
        plan = e.guard_plan
        if plan is not None:
            lines.append(f"    host reads: {len(plan.guards)} value guard(s); a replay runs {plan.prefix_ops} of "
                         f"{plan.total_ops} ops before the last one"
                         + (" (moved ahead of the rest)" if plan.reordered else "")
                         + (f"; saved at each call to undo a miss: {_names(plan.saved, 6)} "
                            f"({plan.saved_bytes / 2**20:.2f} MiB)" if plan.saved else "; nothing to undo on a miss"))
            for site, what, value in plan.guards[:6]:
                lines.append(f"      guard {what} == {value!r} at {site}")
        segs = e.run.segments
        if segs:
            lines.append(f"    {e.run.segment_kind.format(n=len(segs))}; between "
                         "them the host reads a value (one sync each, as eager) and checks its guards")
            lines += _segment_lines(segs, e.run.syncs)
        if tr.source_inputs:
            lines.append("    tensors of loop variables read as inputs at each call: "
                         + _names([src.describe() for src in tr.source_inputs], 6))
        written = [f"{src.describe()} (a {k})" for src, k in
                   [(x.source, x.kind if x.kind == "tensor" else f"tuple of {x.n} tensors" if x.kind == "tensors"
                     else "number") for x in tr.source_effects]]
        written += [x.root.label for x in tr.number_effects]
        if written:
            lines.append("    Python values written back after each replay: " + _names(written, 6))
        grown = list(dict.fromkeys(e.source.describe() for e in tr.append_effects))
        if grown:
            lines.append("    lists appended to after each replay (as the step does): " + _names(grown, 6))
        called = list(dict.fromkeys(f"{c.source.describe()}.{c.method}()" for c in tr.call_effects))
        if called:
            lines.append("    library calls redone after each replay, with its values: " + _names(called, 6))
        if e.checks:
            lines.append("    Python numbers checked before each replay: " + _names(
                [f"{describe(c.expr)} == {c.expected!r}" for c in e.checks], 6))
        if tr.track is not None:
            used = {id(r) for c in e.checks for r in roots_of(c.expr)}
            free = [r.label for r in tr.track.roots() if id(r) not in used]
            if free:
                lines.append(f"    Python numbers read but not used by the graph (no guard): {_names(free, 6)}")
        reads = [x for x in (tr.reads.reads if tr.reads is not None else [])]
        if reads:
            lines.append(f"    values read live at each replay: {_names(list(dict.fromkeys(r.site for r in reads)), 4)}")
        if s.host_scalar_reads:
            lines.append(f"    host scalars: {s.host_scalar_reads} optimizer step-counter reads "
                         "recomputed on the host each replay (eager-identical numerics)")
        lines.append("    guards: input shapes/dtypes/devices/strides/requires_grad and non-tensor "
                     "values; grad mode; autocast; train/eval of "
                     f"{len(reg.all_modules) if reg else 0} modules; optimizer "
                     "hyper-parameters; optimizer state identity; module parameter registration; "
                     ".grad presence and layout")
    return "\n".join(lines)


def _segment_lines(segs, syncs) -> list[str]:
    """Each CUDA-graph segment, and after it each host sync with its site and measured wait."""
    lines = []
    for k in range(-1, len(segs)):
        if k >= 0:
            seg = segs[k]
            ops = sum(1 for n in seg.module.graph.nodes if n.op == "call_function")
            lines.append(f"      segment {k}: {ops} ops" + (f", reads {len(seg.materialise)} host op output(s) "
                                                           "from static buffers" if seg.materialise else ""))
        for p in syncs:
            if p.after_segment == k:
                cost = f"{p.average_us():.1f} µs host wait per call ({p.count} calls)" if p.count else "not run yet"
                lines.append(f"      sync: {p.what} at {p.site}: {cost}")
    return lines


def explain_partial(gm) -> str:
    """``GraphedModule.explain()``: graphs, ops, saved activations, inputs, recapture reasons, guards."""
    from .passes import summarize
    lines = [f"stepgraph.graph_module({gm.name}): backend={gm.backend}, {len(gm.order)} graph(s), "
             f"max_captures={gm.max_captures}" + (" [DISABLED]" if gm.disabled else ""),
             stats_line(gm.stats, compiles=False)]
    lines += [f"  recapture: {r}" for r in gm.stats.recaptures]
    for i, e in enumerate(gm.order):
        fw = summarize(e.fw_gm, lambda t: None)
        bw = (f"backward {summarize(e.bw_gm, lambda t: None).ops} aten ops, {e.n_saved} saved activations, "
              f"grads for {len(e.grad_slots)} tensors") if e.bw_gm is not None else "no backward (forward only)"
        ins = [f"{n}: {_tensor(m)}{' requires_grad' if m.requires_grad else ''}"
               for n, m in zip(e.names, e.key.inputs) if isinstance(m, TensorMeta)]
        lines += [f"  graph {i} (captured at call {e.at_call} in {e.seconds:.3f}s, backend {e.backend}): "
                  f"forward {fw.ops} aten ops ({fw.random_ops} random), {bw}",
                  f"    inputs: {', '.join(ins) or '-'}; grad mode {e.key.grad_mode}; "
                  f"{'train' if e.key.training[0] else 'eval'}"]
        if e.hook_calls:
            lines.append("    hooks called after each replayed forward, with its tensors: "
                         + ", ".join(dict.fromkeys(c.where for c in e.hook_calls)))
    lines += [f"  eager (not graphed) for a signature: {why}" for why in gm.eager_keys.values()]
    lines += [f"    {name}: {len(c.order)} graph(s), {c.stats.replays} replays, {c.stats.eager_calls} eager calls"
              for name, c in gm.children_graphed.items()]
    lines.append("  guards: input shapes/dtypes/devices/strides/requires_grad, non-tensor argument values, "
                 "grad mode, autocast, train/eval of every submodule, parameter/buffer identity, hooks inside")
    return "\n".join(lines)


def median_us(f, repeat: int) -> float:
    """Median µs of ``f()`` over ``repeat`` calls (``StepFunction.overhead_us``)."""
    import statistics
    import time
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6
