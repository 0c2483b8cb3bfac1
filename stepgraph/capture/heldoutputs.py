"""Numbers a step returns inside a container it keeps (outputs.live_outputs): ``return info``
where ``info`` is a global or ``self.info`` the step updates. A replay hands back the flattened
output, so a number there was the capture's; here it is the number the replay writes into the
container (a NumberEffect's expression), or what the container holds after the replay."""
from __future__ import annotations

import torch.utils._pytree as pytree


def held_leaf(result, kp, sources, args, effects):
    """A number the step returns inside a container its code reads and keeps (``return info``,
    a global dict whose ``info['n'] += 1`` is written again after each replay): the number the
    replay writes there (its effect's expression), or what the container holds, as eager
    returns it (a replay returned the capture's count). None otherwise."""
    chain = [result]
    try:
        for k in kp[:-1]:
            chain.append(_child(chain[-1], k))
    except Exception:  # noqa: BLE001 - a path that does not resolve: no container to read
        return None
    parent = chain[-1]
    if not isinstance(parent, (dict, list)):
        return None
    kept = next(((i, s) for i in range(len(chain) - 1, -1, -1) if isinstance(chain[i], (dict, list))
                 for s in sources if s.read_or(args) is chain[i]), None)
    if kept is None:
        return None
    key = kp[-1].key if isinstance(kp[-1], pytree.MappingKey) else kp[-1].idx \
        if isinstance(kp[-1], pytree.SequenceKey) else None
    for e in effects:
        s = e.source
        if e.container is None and s is not None and s.path and s.path[-1][1] == key \
                and type(s)(s.kind, s.root, s.name, s.path[:-1]).read_or(args) is parent:
            return "number", e.expr
    i, src = kept

    def read():
        v = src.read(())
        for k in kp[i:]:
            v = _child(v, k)
        return v
    return "live", read


def _child(obj, k):
    if isinstance(k, pytree.MappingKey):
        return obj[k.key]
    if isinstance(k, pytree.SequenceKey):
        return obj[k.idx]
    return getattr(obj, k.name)
