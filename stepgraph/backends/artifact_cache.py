"""A persistent cache of background-compiled whole-step graphs (``backend="inductor"``).

Inductor's own caches make a second compile of the same graph cheaper, but the child process
still lowers the whole step: GPT-2 124M's fused step was ready 20.4 s after the capture on a
warm Inductor cache against 81.8 s cold (H100, torch 2.11, ``python -m stepgraph.bench --cases
gpt2_124m --warm-cache``). The compiled artifact itself (``CompiledArtifact``, already what the
child hands over) is kept here under a key of everything that decides it, so a rerun of the same
script skips the child and loads it.

The key: the graph's code, every constant it holds (bytes), each input's shape, stride, dtype
and device, the Inductor patches and config, and the torch, CUDA and device versions. What is
not in the key does not change the compiled code (node metadata, names of the user's tensors).
A key that differs only needlessly costs a compile, never a wrong graph.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile

import torch

from .. import config


def folder() -> str | None:
    """The cache folder, or None when the cache is off (the knob, or Inductor's caches off:
    a user or benchmark measuring a cold compile gets one)."""
    where = str(config.get("artifact_cache") or "")
    if where.strip().lower() in ("0", "off", "false", "no"):
        return None
    import torch._inductor.config as ic
    if ic.force_disable_caches or torch.compiler.config.force_disable_caches:
        return None
    if not where:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        where = os.path.join(cache_dir(), "stepgraph")
    return where


def key(gm: torch.fx.GraphModule, specs: list, patches: dict) -> str:
    h = hashlib.sha256()

    def add(*parts):
        for p in parts:
            h.update(repr(p).encode())
            h.update(b"\0")
    add(gm.code, specs, sorted(patches.items(), key=lambda kv: kv[0]))
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            v = getattr(gm, n.target)
            if isinstance(v, torch.Tensor):
                v = v.detach().cpu().contiguous()
                add(n.target, tuple(v.shape), str(v.dtype))
                h.update(v.view(torch.uint8).numpy().tobytes() if v.numel() else b"")
            else:
                add(n.target, type(v).__name__)
    import torch._inductor.config as ic
    portable = getattr(ic, "save_config_portable", None)
    add(sorted(portable().items()) if portable else None)
    add(torch.__version__, torch.version.cuda, getattr(torch.version, "git_version", None))
    if torch.cuda.is_available() and any(str(s.device).startswith("cuda") for s in specs):
        add(torch.cuda.get_device_name(), torch.cuda.get_device_capability())
    return h.hexdigest()[:32]


def lookup(where: str, k: str) -> str | None:
    path = os.path.join(where, k + ".bin")
    return path if os.path.isfile(path) else None


def store(where: str, k: str, artifact: str) -> None:
    """Copy a complete artifact in (atomically: a reader never sees half a file)."""
    try:
        os.makedirs(where, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=where, suffix=".part")
        os.close(fd)
        shutil.copyfile(artifact, tmp)
        os.replace(tmp, os.path.join(where, k + ".bin"))
    except OSError:  # a read-only or full disk costs the next run a compile, nothing else
        pass
