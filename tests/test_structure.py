"""The package's structure (issue 16): where shared exceptions live, the Runner contract every
backend returns, and the keyword-built stage objects. Behaviour is covered by the parity suites."""
import pytest

pytestmark = pytest.mark.usefixtures("one_thread")


def test_exceptions_every_backend_may_raise_live_in_errors():
    """``NeedsReplay`` lived in backends/cudagraph.py although every backend may raise it."""
    from stepgraph import errors
    from stepgraph.backends import cudagraph, refusals, segments
    from stepgraph.capture import hostreads
    assert errors.NeedsReplay.__module__ == "stepgraph.errors"
    assert issubclass(errors.NeedsHostScalars, errors.NeedsReplay)
    assert issubclass(errors.NeedsReplay, errors.CaptureError)
    assert errors.GuardMiss.__module__ == "stepgraph.errors"
    # the backends and the graph's host guard raise these very classes (imported, not redefined)
    assert cudagraph.NeedsReplay is errors.NeedsReplay and segments.NeedsReplay is errors.NeedsReplay
    assert refusals.NeedsHostScalars is errors.NeedsHostScalars
    assert hostreads.host_guard.__module__ == "stepgraph.markers"
    with pytest.raises(errors.GuardMiss):
        hostreads.host_guard(1, 2, "site", "x")


# ---- the Runner contract ------------------------------------------------------------------
def _tiny_graph():
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx
    return make_fx(lambda x: (x * 2 + 1,))(torch.ones(3))


def test_runner_abilities_have_defaults():
    """Callers ask a runner directly (no getattr probes): every ability has a default."""
    from stepgraph.backends import Runner

    class Plain(Runner):
        def __call__(self, inputs):
            return inputs
    r = Plain()
    assert r.stale() is None and r.wait() is True and r.wait(0.1) is True and r.describe() is None
    assert (r.compile_seconds, r.source, r.segments, r.graph) == (0.0, None, None, None)
    assert r([1]) == [1]


def test_every_backend_returns_a_runner():
    import torch
    import stepgraph
    from stepgraph.backends import Runner, background, cudagraph, inductor, replay, segments
    run = replay.compile_replay(_tiny_graph())
    assert isinstance(run, Runner) and "def step_graph" in run.source
    assert torch.equal(run([torch.ones(3)])[0], torch.full((3,), 3.0))
    assert isinstance(replay.without_grad(lambda x: [x]), Runner)
    assert isinstance(cudagraph.record_after_first_call(lambda x: [x]), Runner)
    for cls in (cudagraph.CudaGraphRunner, segments.SegmentedRunner, inductor._Unfused,
                background.FusedWhenReady):
        assert issubclass(cls, Runner), cls
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        loss = model(x).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    sg = stepgraph.compile(step)
    for _ in range(3):
        sg(torch.ones(2, 4))
    assert isinstance(sg.captures[0].run, Runner)


def test_a_misspelt_runner_ability_fails_loudly():
    """A misspelt ``stale`` used to switch the moved-storage check off silently (the caller read
    ``getattr(run, "stale", None)``): now defining, setting or reading one raises."""
    from stepgraph.backends import Runner, replay
    with pytest.raises(TypeError, match="stael"):
        class Bad(Runner):
            def __call__(self, inputs):
                return inputs

            def stael(self):
                return "moved"
    run = replay.compile_replay(_tiny_graph())
    with pytest.raises(AttributeError, match="stael"):
        run.stael = lambda: "moved"
    with pytest.raises(AttributeError):
        run.stael()
    with pytest.raises(AttributeError, match="compile_secs"):
        run.compile_secs = 1.0
    run.compile_seconds = 1.0   # an ability: settable
    run._private = 1            # private names are the runner's own business


def test_callers_do_not_probe_runners():
    import inspect
    import re
    from stepgraph import check, explain, partial, partial_graphs, runtime
    for mod in (runtime, explain, check, partial, partial_graphs):
        src = inspect.getsource(mod)
        assert not re.search(r"getattr\((e\.|entry\.|last\.|self\._)?run\b", src), mod.__name__


# ---- stage objects ----------------------------------------------------------------------
def test_backends_get_a_frozen_compile_request_and_no_loose_options():
    import dataclasses
    import inspect
    from stepgraph.backends import CompileRequest, cudagraph, inductor, replay, segments
    req = CompileRequest(n_user_outputs=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        req.pool = object()
    for f in (replay.compile_replay, cudagraph.compile_cudagraph, cudagraph.record, cudagraph._segmented,
              segments.compile_segmented, inductor.compile_inductor, cudagraph.record_after_first_call):
        kinds = {p.kind for p in inspect.signature(f).parameters.values()}
        assert inspect.Parameter.VAR_KEYWORD not in kinds, f.__name__


def test_signature_key_is_named_and_captured_step_keyword_built():
    import torch
    import stepgraph
    from stepgraph.captured import CapturedStep
    from stepgraph.capture.sigkey import SignatureKey, TensorMeta
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        loss = model(x).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    sg = stepgraph.compile(step)
    for n in (2, 2, 3, 3):
        sg(torch.ones(n, 4))
    k0, k1 = (c.key for c in sg.captures)
    assert isinstance(k0, SignatureKey) and isinstance(k0.inputs[0], TensorMeta)
    assert (k0.inputs[0].shape, k1.inputs[0].shape) == ((2, 4), (3, 4))
    assert k0.hypers == k1.hypers and k0 == tuple(k0) and hash(k0) == hash(tuple(k0))
    assert sg.stats.recaptures == ["arg 0 (x) shape (2, 4) -> (3, 4)"]
    with pytest.raises(TypeError):
        CapturedStep(k0, sg.captures[0].graph)   # positional: 13 fields in a row were misread


def test_call_policy_branches_are_named_in_stats():
    import torch
    import stepgraph
    from stepgraph.captured import Branch
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        loss = model(x).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    sg = stepgraph.compile(step, max_captures=1)
    seen = []
    for n in (2, 2, 2, 3):
        sg(torch.ones(n, 4))
        seen.append(sg.stats.last_branch)
    assert seen == [Branch.WARMUP, Branch.CAPTURE, Branch.REPLAY, Branch.EAGER]
    assert sg.stats.branches == {Branch.WARMUP: 1, Branch.CAPTURE: 1, Branch.REPLAY: 1, Branch.EAGER: 1}
    assert (sg.stats.eager_calls, sg.stats.captures, sg.stats.replays) == (2, 1, 1)   # the old fields stay


def test_capture_is_a_pipeline_of_named_stages():
    import inspect
    from stepgraph import pipeline, runtime
    assert not hasattr(runtime.StepFunction, "_capture")
    src = inspect.getsource(pipeline.capture)
    order = [src.index(f"{name}(") for name in ("plan_capture", "adapt_optimizers", "trace", "clean", "lower", "keep")]
    assert order == sorted(order)
    assert len(inspect.getsource(runtime).splitlines()) < 400


def _imports(path):
    import ast
    tree = ast.parse(open(path).read())
    for node in ast.walk(tree):   # (function-level imports too)
        if isinstance(node, ast.ImportFrom):
            yield "." * node.level + (node.module or "")
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)


def test_passes_and_backends_import_nothing_from_capture():
    """Shared graph markers live in stepgraph/markers.py: passes/ imports neither capture/ nor
    backends/, and backends/ does not import capture/ (which runs only while tracing)."""
    import glob
    import os
    import stepgraph
    root = os.path.dirname(stepgraph.__file__)
    for layer, banned in (("passes", ("capture", "backends")), ("backends", ("capture",))):
        for path in glob.glob(os.path.join(root, layer, "*.py")):
            for mod in _imports(path):
                parts = mod.lstrip(".").split(".")
                up = mod.startswith("..") or mod.startswith("stepgraph.")
                assert not (up and any(p in banned for p in parts)), (path, mod)


def test_explain_and_check_read_public_fields_only():
    import inspect
    import re
    from stepgraph import check, explain
    for mod in (explain, check):
        src = inspect.getsource(mod)
        assert not re.search(r"\b(self|step|stepfn)\._[a-z]", src), mod.__name__


def test_graph_module_uses_the_whole_step_pieces():
    """partial.py was a second runtime: its own key tuple, CUDA recording, stats and explain. Now
    its key is sigkey.PartialKey (tensors as TensorMeta), its runners are the backends' Runners,
    and each call's Branch is counted in the same Stats."""
    import torch
    import stepgraph
    from stepgraph.backends import Runner
    from stepgraph.captured import Branch
    from stepgraph.capture.sigkey import PartialKey, TensorMeta, ValueMeta
    gm = stepgraph.graph_module(torch.nn.Linear(4, 2))
    for _ in range(3):
        gm(torch.ones(2, 4)).sum().backward()
    e = gm.order[0]
    assert isinstance(e.key, PartialKey) and isinstance(e.key.inputs[0], TensorMeta)
    assert isinstance(e.fw, Runner) and isinstance(e.bw, Runner) and e.stale() is None
    assert gm.stats.branches == {Branch.WARMUP: 1, Branch.CAPTURE: 1, Branch.REPLAY: 1}
    assert gm.stats.last_branch is Branch.REPLAY
    assert ValueMeta("float", "2.0") != ValueMeta("float", "3.0")
    assert "stats: eager_calls=1 captures=1 replays=1" in gm.explain()


# ---- sizes and layers (issue 16) ------------------------------------------------------------
MAX_FILE_LINES, MAX_CLASS_LINES = 400, 150
# Known exceptions, each with its reason; remove an entry when the file or class is split.
SIZE_EXCEPTIONS: dict = {}


def _sources():
    import glob
    import os
    import stepgraph
    root = os.path.dirname(stepgraph.__file__)
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        yield os.path.relpath(path, root).replace(os.sep, "/"), path


def test_no_file_over_400_lines_and_no_class_over_150():
    import ast
    too_big = []
    for rel, path in _sources():
        text = open(path).read()
        n = len(text.splitlines())
        if n > MAX_FILE_LINES and rel not in SIZE_EXCEPTIONS:
            too_big.append(f"{rel}: {n} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                size = node.end_lineno - node.lineno + 1
                if size > MAX_CLASS_LINES and f"{rel}:{node.name}" not in SIZE_EXCEPTIONS:
                    too_big.append(f"{rel}: class {node.name} {size} lines")
    assert not too_big, "split by concern (or list in SIZE_EXCEPTIONS with a reason): " + "; ".join(too_big)


# What each layer may import from stepgraph. Shared by every layer: errors, markers, config, and
# optimizers (the optimizer adaptation, one module: test_optimizer_adaptation_has_one_home).
# capture/ and backends/ are siblings (capture runs while tracing, backends after it); both may
# use passes/; none of the three imports the runtime above them (runtime, pipeline, captured,
# partial*, explain, ...), integrations/ or tools/.
_SHARED = {"errors", "markers", "config", "optimizers"}
_LAYER_MAY_IMPORT = {"passes": _SHARED, "capture": _SHARED | {"passes"}, "backends": _SHARED | {"passes"}}
_ENTRY_POINTS = {"bench.py", "bench_ddp.py", "bench_fsdp2.py", "bench_integrations.py", "__main__.py"}   # three-line shims to tools/


def _stepgraph_imports(rel, path):
    """Top-level stepgraph names (``capture``, ``runtime``, ...) that ``rel`` imports."""
    import ast
    pkg = rel.split("/")[:-1]
    for node in ast.walk(ast.parse(open(path).read())):
        targets = []
        if isinstance(node, ast.ImportFrom) and node.level:
            base = pkg[:len(pkg) - (node.level - 1)]
            targets = [base + node.module.split(".")] if node.module else [base + [a.name] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("stepgraph."):
            targets = [node.module.split(".")[1:]]
        elif isinstance(node, ast.Import):
            targets = [a.name.split(".")[1:] for a in node.names if a.name.startswith("stepgraph.")]
        for t in targets:
            if t:
                yield t[0]


def test_import_graph_points_down_only():
    bad = []
    for rel, path in _sources():
        top = rel.split("/")[0] if "/" in rel else rel[:-3]
        for target in _stepgraph_imports(rel, path):
            if target == top:
                continue
            if top in _LAYER_MAY_IMPORT and target not in _LAYER_MAY_IMPORT[top]:
                bad.append(f"{rel} imports {target} (a {top}/ module may import {sorted(_LAYER_MAY_IMPORT[top])})")
            if target == "integrations" and top != "tools":  # (tools/ sit above: the integrations bench)
                bad.append(f"{rel} imports integrations/ (adapters import the library, not the reverse)")
            if target == "tools" and rel not in _ENTRY_POINTS:
                bad.append(f"{rel} imports tools/ (tooling, not library)")
    assert not bad, "; ".join(bad)


def test_optimizer_adaptation_has_one_home():
    """Live hyper-parameters, the capturable switch, device-held hyper-parameters, the trace-time
    patch and the eager twins' switch are defined in stepgraph/optimizers.py alone, which imports
    no stepgraph layer; tests and tools take them from there, not from a backend."""
    import ast
    import glob
    import os
    import stepgraph
    names = {"LIVE_HYPERS", "make_capturable", "make_hyper_tensor", "absorb_floats",
             "capturable_while_tracing", "same_form"}
    root = os.path.dirname(stepgraph.__file__)
    for rel, path in _sources():
        tree = ast.parse(open(path).read())
        defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        defined |= {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets
                    if isinstance(t, ast.Name)}
        if rel != "optimizers.py":
            assert not (defined & names), (rel, defined & names)
    assert set(_stepgraph_imports("optimizers.py", os.path.join(root, "optimizers.py"))) <= {"errors", "config"}
    repo = os.path.dirname(root)
    for path in glob.glob(os.path.join(repo, "tests", "*.py")) + glob.glob(os.path.join(repo, "clients", "*.py")):
        for mod in _imports(path):
            assert not (mod.startswith("stepgraph.backends") and "cudagraph" in mod and
                        "make_capturable" in open(path).read()), path
