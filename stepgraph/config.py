"""The one registry of stepgraph's knobs: each has a default, an environment variable and a doc.

Read a knob with ``config.get("disable")``; the environment is read at the moment of the call,
so ``STEPGRAPH_DISABLE=1`` takes effect for every ``stepgraph.compile`` made after it is set.
"""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Knob:
    name: str
    env: str
    default: object
    doc: str

    def read(self):
        raw = os.environ.get(self.env)
        if raw is None:
            return self.default
        if isinstance(self.default, bool):
            return raw.strip().lower() not in ("", "0", "false", "no", "off")
        if isinstance(self.default, int):
            return int(raw)
        return raw


KNOBS = {k.name: k for k in [
    Knob("disable", "STEPGRAPH_DISABLE", False,
         "Run every call eagerly (no capture). Read when compile() is called; for bisecting."),
    Knob("backend", "STEPGRAPH_BACKEND", "", "Override the backend argument of every compile()."),
    Knob("max_captures", "STEPGRAPH_MAX_CAPTURES", 0,
         "Override max_captures (graphs kept per step function) when > 0."),
    Knob("check", "STEPGRAPH_CHECK", False,
         "Also run an eager shadow copy for the first replays and report divergence."),
    Knob("trace_stream", "STEPGRAPH_TRACE_STREAM", "current",
         "CUDA: run the capturing call on the caller's stream ('current', default: measured "
         "1.24x eager peak memory on MLP-512 vs 1.62x) or on the capture side stream ('side')."),
    Knob("inductor_patches", "STEPGRAPH_INDUCTOR_PATCHES", "",
         "JSON object of torch._inductor.config patches for backend='inductor', merged over "
         "stepgraph's own (e.g. '{\"combo_kernels\": true}')."),
    Knob("inductor_background", "STEPGRAPH_INDUCTOR_BACKGROUND", True,
         "backend='inductor': compile in a child process while the step runs its unfused graph, "
         "and switch when ready (0: block the capturing call until Inductor is done)."),
    Knob("inductor_parts", "STEPGRAPH_INDUCTOR_PARTS", 0,
         "backend='inductor', background compile: a large step graph (>= 600 ops a part) is cut into "
         "this many parts compiled side by side in child processes (0 = auto: one per 4 host cores, "
         "at most 4; 1 = never cut). GPT-2 124M on an H200 host: see docs/benchmarks.md, session 29."),
    Knob("inductor_verify", "STEPGRAPH_INDUCTOR_VERIFY", True,
         "backend='inductor': at the switch to the background-compiled graph, check its first step "
         "against the unfused graph on the same state (host copies of what the step writes, taken "
         "once); beyond tolerance the unfused graph stays, warned (0: switch unchecked)."),
    Knob("artifact_cache", "STEPGRAPH_ARTIFACT_CACHE", "",
         "backend='inductor': a folder of compiled whole-step graphs keyed by the graph, its inputs' "
         "metadata, Inductor's config and the torch/CUDA/device versions, so a rerun of the same "
         "script loads its fused step instead of compiling it ('' = Inductor's cache dir/stepgraph; "
         "'0' = off; also off where Inductor's caches are disabled)."),
    Knob("progress", "STEPGRAPH_PROGRESS", True,
         "backend='inductor': one line on stderr when the background compile starts, is ready and "
         "is switched to (through the 'stepgraph' logger at INFO where logging is configured; 0: quiet)."),
    Knob("host_reads", "STEPGRAPH_HOST_READS", "",
         "Override host_reads of every compile(): 'guard' (values read on the host are live or "
         "guarded between graph segments) or 'error' (any host read is a CaptureError)."),
    Knob("fsdp2_cuda", "STEPGRAPH_FSDP2_CUDA", True,
         "Capture FSDP2 (fully_shard) steps on CUDA: their unsharded parameters become graph "
         "temporaries (passes/unsharded.py), so backend='auto' records one CUDA graph (H100: 0.09x "
         "eager FSDP2's time, 1.05x its memory, bitwise); 0: such steps are refused with a "
         "CaptureError and run eagerly."),
    Knob("fsdp2_temporaries", "STEPGRAPH_FSDP2_TEMPORARIES", True,
         "FSDP2 steps: turn the unsharded-parameter storages FSDP2 frees and allocates into graph "
         "temporaries (passes/unsharded.py; no storage resizes left, so a CUDA graph can record "
         "the step); 0: keep the resizes as traced (the replay backend runs them)."),
    Knob("cudnn_rnn", "STEPGRAPH_CUDNN_RNN", "auto",
         "A step whose nn.LSTM/GRU/RNN runs cuDNN on CUDA: 'auto' (captured as matmuls and pointwise "
         "ops, capture/rnns.py, within 1e-5 relative of cuDNN on an H100, unless it trains with "
         "dropout between layers: cuDNN draws those masks from a state no graph can replay, so such "
         "a step is refused with the fixes), 'decompose' (always: such masks then come from "
         "PyTorch's generator, statistically alike, not cuDNN's) or 'refuse' (a CaptureError)."),
    Knob("dist_timeout", "STEPGRAPH_DIST_TIMEOUT", 300,
         "Seconds a rank waits for the others before a capture of a DDP step (rank agreement); "
         "past it, a CaptureError names the ranks that did not come."),
]}


def get(name: str):
    return KNOBS[name].read()


def describe() -> str:
    return "\n".join(f"{k.env:<26} default={k.default!r:<8} {k.doc}" for k in KNOBS.values())
