"""Which Python floats a capture reads live instead of baking, per backend.

Lifecycle, per :class:`~stepgraph.runtime.StepFunction`:

* warm-up call: :meth:`LiveFloats.seen_at_warmup` notes every candidate's value (float
  hyper-parameters of each param group, float globals/cells/attributes the step's code reads);
* each capture: :meth:`LiveFloats.choose` picks what is live for it --
  on ``replay`` every candidate from the first capture (a live read is a dict or attribute read
  per replay, with eager's own Python arithmetic: bitwise); on a device graph (``cudagraph``,
  ``inductor``) only what changed since the last call or what an LR scheduler drives: those are
  fed in as one device tensor (:meth:`to_device`, passes/device_scalars.py), the others stay
  baked, bitwise eager, until they change (then one recapture makes them live);
* after the trace: :meth:`after_trace` -- a value the step branched on is guarded again (or only
  the comparison it made, ``if momentum != 0``), and graphs captured before are re-keyed.
"""
from __future__ import annotations

import logging

from .optimizers import LIVE_HYPERS, make_hyper_tensor
from .passes.bake_floats import bake_host_floats
from .passes.device_scalars import Unsupported, is_number_reader, to_device_scalars

log = logging.getLogger("stepgraph")

# What a recapture's reason says of a float made live for it; if the trace then baked it (an op
# with no tensor form of it: LeakyReLU's negative_slope, Dropout's p), reason_after_trace
# says that instead: the promise was not kept
_LIVE_NOTES = (" (now read live at each replay: no further recaptures for it)",
               " (now read live at each call: no further recaptures for it)")
_BAKED_NOTE = " (an op bakes it: keyed by its value, each change captures again)"


def reason_after_trace(reason, tr):
    """The recapture's reason, its live note replaced when the trace baked a live float."""
    if tr.baked_hypers and reason is not None:
        for note in _LIVE_NOTES:
            reason = reason.replace(note, _BAKED_NOTE)
    return reason


class LiveFloats:
    def __init__(self, guards, reg, name: str):
        self.guards, self.reg, self.name = guards, reg, name
        self.baked: set = set()   # live candidates a capture had to bake: guarded by value for good
        self.seen: dict = {}      # candidates' values at the last warm-up or device capture
        self.notes: list = []     # for explain(): what could not be fed to a device graph
        self.unbaked: set = set()  # baked after graphs that read them live were captured

    def seen_at_warmup(self, args) -> None:
        self.seen = self.guards.candidate_values(args)

    def _scheduled(self, h) -> bool:
        """An lr an LR scheduler drives (it marks the optimizer's step): it will change."""
        return isinstance(h, tuple) and h[2] == "lr" and \
            hasattr(self.reg.optimizers[h[0]][1].step, "_wrapped_by_lr_sched")

    def with_aliases(self, new, args) -> set:
        """``new`` with every other name of the same value: the step reading
        ``optimizer.param_groups[0]["lr"]`` itself (a metric logger's ``lr=``) names the lr a
        scheduler drives a second time. Live under one name and keyed by value under the other,
        every schedule change recaptured (torchvision's reference recipe: 2 recaptures on the
        GPU), and the tracked read turned the optimizer's ``-lr`` into a value check."""
        from .capture.trackplan import slot_of
        hypers = {(id(grp), k): (oi, gi, k) for oi, (_, opt) in enumerate(self.reg.optimizers)
                  for gi, grp in enumerate(opt.param_groups) for k in grp}
        out = set(new)
        for s in self.guards.py.sources:
            h = hypers.get(slot_of(s, args)) if s.path and s.path[-1][0] == "item" else None
            if h is not None and (h in out or s in out):
                out |= {h, s}
        return out - self.baked

    def before_prepare(self, backend_name: str, device: str, args, reason, last_key, key):
        """Live choices made before the backend's ``prepare``; returns (reason, re-sign?)."""
        g = self.guards
        if backend_name == "replay":
            # (one the first trace found is noted then: wav2vec2's temperature moved at every call unseen)
            moved = [s for s, v in g.forward_floats(args).items() if self.seen.setdefault(s, v) != v]
            new = [h for h in g.live_candidates(args) + moved if h not in g.live and h not in self.baked]
            if new:
                g.live.update(self.with_aliases(new, args))
                if reason is not None:
                    reason += _LIVE_NOTES[0]
            return reason, bool(new)
        if last_key is not None and device == "cuda":
            notes = [n for h in g.changed_hypers(last_key, key) if h[2] in LIVE_HYPERS
                     for n in [make_hyper_tensor(self.reg, *h)] if n]
            if notes:
                reason += f" ({'; '.join(notes)}: no further recaptures for it)"
                return reason, True
        return reason, False

    def after_prepare(self, backend_name: str, args, reason):
        """A graph bakes scalars: floats that changed since the last call (or an lr a scheduler
        drives) become live for device graphs. After ``prepare``: an lr it made a device tensor
        is no float any more. Returns (reason, re-sign?)."""
        if backend_name == "replay":
            return reason, False
        g = self.guards
        # (LIVE_HYPERS only: a group float the step itself sums, schedulefree's ``weight_sum``,
        # read live into a CUDA graph replayed wrong on the H200 -- keyed by value there, a
        # capture per call, until that is understood)
        now = g.candidate_values(args, keys=LIVE_HYPERS)
        new = [h for h, v in now.items() if h not in g.live and h not in self.baked
               and (h in self.seen and self.seen[h] != v or self._scheduled(h))]
        self.seen = now
        if new:
            g.live.update(self.with_aliases(new, args))
            if reason is not None:
                reason += _LIVE_NOTES[1]
        return reason, bool(new)

    def after_trace(self, tr, sig, frozen, entries: dict):
        """What the trace decided from live values; returns the signature to key the graph by."""
        preds = getattr(tr.baked_hypers, "predicates", ())
        if not (tr.baked_hypers or preds):
            return sig
        g = self.guards
        self.baked |= tr.baked_hypers
        if entries:
            self.unbaked |= tr.baked_hypers & g.live
        g.live -= tr.baked_hypers
        g.keyed |= {h for h in tr.baked_hypers if not isinstance(h, tuple)}  # untracked from now on
        added = g.add_predicates(preds)
        if added:
            # Graphs captured before answer to keys with more comparisons now: any answer.
            for key, e in list(entries.items()):
                del entries[key]
                for k in g.rekey(key, added):
                    entries.setdefault(k, e)
        return g.rebake(sig, frozen, tr.baked_hypers)

    def read_live_key(self, key):
        """The key a graph captured while the values baked since (``unbaked``) were still read
        live answers to: ``key`` with their values put back as live markers; None when none
        were. (A variant that bakes a float -- CleanRL's logging branch, ``int(global_step /
        (time.time() - start_time))`` -- keys it by value from then on; the graphs before it
        read it live at each replay and stay valid for any value, but their keys hold the
        marker: without this every earlier path recaptured once.)"""
        if not self.unbaked:
            return None
        g, unbaked = self.guards, self.unbaked

        def entry(h, v):
            return g._marker(h, v) if h in unbaked else v
        hypers = tuple(tuple(tuple((k, entry((oi, gi, k), v)) for k, v in grp) for gi, grp in enumerate(go))
                       for oi, go in enumerate(key.hypers))
        py_values = tuple(entry(s, v) for s, v in zip(g.py.sources, key.py_values))
        return key._replace(hypers=hypers, py_values=py_values)

    def to_device(self, gm, device, sig, frozen, numbers=None, segmented=False):
        """Feed the graph's live floats in as one device tensor; where an op has no tensor form,
        bake them and guard their values again (a change then recaptures, with its reason) --
        unless the graph is ``segmented`` anyway (it reads values on the host): then they stay
        Python the segments run on the host, with the ops they feed, as its numbers do
        (microsoft/LoRA's AdamW: ``lr * sqrt(1 - beta2 ** step)`` meets the optimizer's step
        count, which a segmented graph does not feed; baked, every scheduled lr recaptured).
        ``numbers``: the tracked numbers read at each replay too, but the readers in this set
        (device_scalars.numbers_to_feed; they cannot be baked: where one finds no tensor form,
        the ops it feeds run between graph segments). Returns (DeviceScalars or None, signature)."""
        g = self.guards
        numbers = False if numbers is None else numbers
        while True:
            try:
                return to_device_scalars(gm, device, numbers), sig
            except Unsupported as e:
                bad = frozenset(r for r in e.roots if is_number_reader(r))
                if bad and numbers is not False:
                    numbers |= bad
                    continue
                if segmented:
                    note = (f"the live floats reach an op with no tensor form ({e}): they and the ops "
                            "they feed run on the host between graph segments")
                    log.info("stepgraph: %s: %s", self.name, note)
                    self.notes.append(note)
                    return None, sig
                labels = {h.target.live_label for h in e.roots}
                gone = {h for h in g.live if g.live_label(h) in labels}
                if not gone:  # not known which: bake them all
                    gone, e.roots = set(g.live), None
                baked = bake_host_floats(gm, e.roots)
                sig = g.rebake(sig, frozen, gone)
                self.baked |= gone
                g.live -= gone
                note = (f"{', '.join(baked) or 'a live float'} cannot be fed to the graph as a tensor "
                        f"({e}): baked and guarded, a new value recaptures")
                log.warning("stepgraph: %s: %s", self.name, note)
                self.notes.append(note)
                if not g.live and numbers is False:
                    return None, sig
