"""Live floats a device graph cannot take as a tensor (passes/device_scalars.py raised
``Unsupported``): baked to the values the trace saw, guarded again by the caller."""
from __future__ import annotations

from torch import fx

from .device_scalars import host_nodes, is_reader


def bake_host_floats(gm: fx.GraphModule, roots=None) -> list[str]:
    """Replace the live floats read by ``roots`` (all when None), and what is computed from
    them alone, by the values the trace saw (the caller guards those values again); returns
    the readers' labels."""
    host = host_nodes(gm)
    values: dict = {}
    for h in host:
        if not (h in roots if roots is not None and is_reader(h) else
                all(a in values for a in h.all_input_nodes) if not is_reader(h) else True):
            continue
        # (a reader of a tuple has no value of its own: only its items reach ops)
        values[h] = h.meta.get("host_value")
    host = [h for h in host if h in values]
    for h in host:
        for u in list(h.users):
            if u not in values:
                u.args = fx.node.map_arg(u.args, lambda x: values[x] if x in values else x)
                u.kwargs = fx.node.map_arg(u.kwargs, lambda x: values[x] if x in values else x)
    for h in reversed(host):
        if not h.users:
            gm.graph.erase_node(h)
    gm.graph.lint()
    gm.recompile()
    return [h.target.live_label for h in host if is_reader(h)]
