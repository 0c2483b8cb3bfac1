"""The live side of the guard key: which optimizer hyper-parameters and Python values the graphs
read live (not keyed by value), the comparisons they branched on (guarded as predicates), and
re-keying a capture once the trace has shown what it used. A mixin of ``guards.Guards``."""
from __future__ import annotations

from .sigkey import Signature, SignatureKey


def _is_marker(v) -> bool:
    """A live value's part of a key (``Guards._marker``), not a value keyed as it is."""
    return v == "<live>" or isinstance(v, tuple) and v[:1] == ("<live>",)


class LiveKeys:
    """``Guards``' methods for live values (``self.live``, ``self.preds`` are set by ``Guards``)."""

    def changed_hypers(self, old: tuple, new: tuple) -> list:
        """(optimizer index, group index, key) of float hyper-parameters that differ."""
        out = []
        for oi, (ga, gb) in enumerate(zip(old.hypers, new.hypers)):
            for gi, (x, y) in enumerate(zip(ga, gb)):
                dx, dy = dict(x), dict(y)
                for k in dx:
                    a, b = dx[k], dy.get(k)
                    floaty = all(isinstance(v, float) for v in (a if isinstance(a, tuple) else (a,))) and \
                        all(isinstance(v, float) for v in (b if isinstance(b, tuple) else (b,)))
                    if a != b and floaty:
                        out.append((oi, gi, k))
        return out

    def live_candidates(self, args, keys=None) -> list:
        """What a replay graph can read live from its first capture: the float entries ``keys``
        of every group (None: all, not only LIVE_HYPERS -- schedulefree's ``weight_sum`` and
        ``lr_max``, sums its step writes back, were keyed by value: a capture per call), and the
        float globals/cells/attributes the step's own code reads (not arguments: those come with
        each call). Reading them live costs a dict or attribute read per replay; baking them
        cost one recapture at the first schedule change (every corpus client with a scheduler
        recaptured once)."""
        out = []
        for oi, (_, opt) in enumerate(self.reg.optimizers):
            for gi, g in enumerate(opt.param_groups):
                for k in (keys if keys is not None else [k for k in g if k != "params"]):
                    v = g.get(k)
                    vs = v if isinstance(v, tuple) else (v,)
                    if vs and all(isinstance(x, float) for x in vs):
                        out.append((oi, gi, k))
        for s in self.py.sources:
            if s.from_step and (s.kind != "arg" or s.path) and isinstance(s.read_or(args), float):
                out.append(s)
        return out

    def frozen_key(self, args, kwargs) -> SignatureKey:
        """The signature key with nothing read live (every value as it is now): taken before a
        capture, so that values the capture ends up baking are guarded as they were *before*
        the call (the call itself changes grads, counters, ...)."""
        # (every source keyed by value: a source the capture bakes is keyed so from then on)
        saved, self.live = self.live, set()
        saved_keyed, self.keyed = self.keyed, self.keyed | set(self.py.sources)
        try:
            return self.signature(args, kwargs).key
        finally:
            self.live, self.keyed = saved, saved_keyed

    def rebake(self, sig: "Signature", frozen: SignatureKey, baked) -> "Signature":
        """``sig`` with the live markers of ``baked`` replaced by their values in ``frozen``, and
        those of values with predicates answered for their ``frozen`` (pre-call) values."""
        def entry(h, v, fv):
            if h in baked:
                return fv
            return self._marker(h, fv) if h in self.live and _is_marker(v) else v
        key = sig.key
        hypers = tuple(tuple(tuple((k, entry((oi, gi, k), v, fv)) for (k, v), (_, fv) in zip(g, fg))
                             for gi, (g, fg) in enumerate(zip(go, fo)))
                       for oi, (go, fo) in enumerate(zip(key.hypers, frozen.hypers)))
        py_values = tuple(entry(s, v, fv) for s, v, fv in zip(self.py.sources, key.py_values, frozen.py_values))
        return Signature(key._replace(hypers=hypers, py_values=py_values), sig.leaves, sig.tensor_pos)

    def overwritten_after(self, sig: "Signature", args, indices, before) -> "Signature":
        """``sig`` with the tensors the step replaces before reading them (pybefore.overwritten)
        keyed as from now on, where the one held before the call keys as the one held now."""
        if not indices:
            return sig
        now, py_values = self._py_key(args), list(sig.key.py_values)
        for i in indices:
            s = self.py.sources[i]
            if s.key_for(before.tensors[i]) == s.key_for(s.read_or(args)):
                py_values[i] = now[i]
        return Signature(sig.key._replace(py_values=tuple(py_values)), sig.leaves, sig.tensor_pos)

    def add_predicates(self, preds) -> dict:
        """Record ``(hyper, path, op, constant)`` comparisons a trace made on live values;
        returns {hyper: how many were new} (keys taken before hold fewer answers: rekey them)."""
        added: dict = {}
        for h, path, op, other in preds:
            cur = self.preds.get(h, ())
            if (path, op, other) not in cur and h in self.live:
                self.preds[h] = (*cur, (path, op, other))
                added[h] = added.get(h, 0) + 1
        return added

    def rekey(self, key: SignatureKey, added: dict) -> list:
        """The keys an older graph (which did not branch on the comparisons just ``added``) now
        answers to: its key with every combination of answers to those comparisons."""
        import itertools
        slots = []  # (section, position path) of each marker to extend
        for oi, go in enumerate(key.hypers):
            for gi, g in enumerate(go):
                for j, (k, v) in enumerate(g):
                    if (oi, gi, k) in added and (v == "<live>" or isinstance(v, tuple) and v[:1] == ("<live>",)):
                        slots.append(("hypers", (oi, gi, j, k), added[(oi, gi, k)]))
        for i, (src, v) in enumerate(zip(self.py.sources, key.py_values)):
            # (only a graph that read it live answers to the new comparisons: one that keyed it by
            # value -- YOLOv5's ``accumulate``, the int 1 before it became a float -- keeps its
            # key; extending that key raised IndexError and the step ran eagerly)
            if src in added and (v == "<live>" or isinstance(v, tuple) and v[:1] == ("<live>",)):
                slots.append(("py_values", i, added[src]))
        if not slots:
            return [key]
        out = []
        for combo in itertools.product(*[list(itertools.product((True, False), repeat=n)) for *_, n in slots]):
            k6 = [[list(g) for g in go] for go in key.hypers]
            k11 = list(key.py_values)
            for (comp, where, _), answers in zip(slots, combo):
                if comp == "hypers":
                    oi, gi, j, name = where
                    old = k6[oi][gi][j][1]
                    k6[oi][gi][j] = (name, ("<live>", (old[1] if isinstance(old, tuple) else ()) + answers))
                else:
                    old = k11[where]
                    k11[where] = ("<live>", (old[1] if isinstance(old, tuple) else ()) + answers)
            out.append(key._replace(hypers=tuple(tuple(tuple(g) for g in go) for go in k6),
                                    py_values=tuple(k11)))
        return out

    def live_label(self, h) -> str:
        """How explain() and the graph's readers name a live value."""
        if isinstance(h, tuple):
            oi, gi, k = h
            return f"{self.reg.optimizers[oi][0]}.param_groups[{gi}]['{k}']"
        return h.describe()

    def forward_floats(self, args) -> dict:
        """Float attributes a module's ``forward`` reads on ``self`` (forward_attrs.py), with their
        values now. Candidates only once they change (LiveFloats): Wav2Vec2's gumbel
        ``quantizer.temperature``, which the training loop lowers at every step, was keyed by value
        and recaptured at every call, never replaying; ``LayerNorm.eps`` stays baked."""
        return {s: v for s in self.py.sources if not s.from_step and s.kind == "object"
                for v in [s.read_or(args)] if type(v) is float}

    def candidate_values(self, args, keys=None) -> dict:
        """``live_candidates`` and ``forward_floats`` with their values now (a float, or a tuple
        of floats)."""
        out = dict(self.forward_floats(args))
        for h in self.live_candidates(args, keys):
            if isinstance(h, tuple):
                oi, gi, k = h
                out[h] = self.reg.optimizers[oi][1].param_groups[gi].get(k)
            else:
                out[h] = h.read_or(args)
        return out

    # ---- explaining a miss -------------------------------------------------------------
