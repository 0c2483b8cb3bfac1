"""What to change when recaptures of one kind keep coming: the hint a recapture or the
max_captures warning gives for a reason (reasons.py explains the reason itself)."""
from __future__ import annotations

import re

_ARG = r"(?:arg \d+ \((?P<arg>\w+)\)|kwarg '(?P<kw>\w+)')(?P<path>\S*)"


# (ELECTRA pretraining's ``logits[attention_mask == 1]``, the CTC loss's masked_select: a size per
# batch, in code the user may not own; said at the first recapture too, not only after max_captures)
# (a count taken with int(): ``correct += int((pred == y).sum())``, HF MLM's masked-token count:
# a plain copy, a graph per count; .item() of it is read again at every replay)
INT_COUNT = r"\+=? *int\("
ITEM_FIX = ("use t.item() (total += t.item() is recomputed at every replay), or return the tensor and "
            "convert it outside the step")
DATA_SIZED = ("a tensor sized by the data (a boolean-mask selection, nonzero, masked_select) is a graph per "
              "size: keep the shape with a mask (torch.where(mask, x, 0).sum() / mask.sum() for x[mask].mean()), "
              "or, in a model you do not own, graph its parts without it: stepgraph.graph_module(model)")


# (Lightning's ``self.global_step`` in training_step or optimizer_step: a counter its loop
# advances, read through properties, so keyed by value: a graph per step, then eager)
LOOP_COUNTER = re.compile(r"\b(global_step|current_epoch) \d+ -> \d+")
COUNTER_HINT = ("a number the loop advances at every step is a graph per value: compute what you need "
                "from it outside the step (Lightning: in on_train_batch_start, self.beta = min(1.0, "
                "self.trainer.global_step / 100); a warm-up lr set there on the param groups) and read that "
                "float in the step: floats are read live")


def recapture_hint(reason: str) -> str:
    """What to change when recaptures of this kind keep coming (one clause, '' if nothing
    specific): an argument keyed by identity, an argument whose None elements move, a variable
    the step calls methods on that is a new object each time, an argument whose shape changes."""
    if "depends on tensor values" in reason:
        return DATA_SIZED
    if LOOP_COUNTER.search(reason):
        return COUNTER_HINT
    m = re.match(_ARG + r" (?P<t>\w+) object at 0x[0-9a-f]+ -> (?P=t) object at", reason)
    if m:
        name = m["arg"] or m["kw"]
        if m["t"] in ("Module", "Linear", "Sequential", "Layer") or m["t"].endswith(("Net", "Model", "Layer")):
            # (forward-forward's layers passed one by one to one compiled method)
            return (f"a new model {name} is new state, a graph of its own each: compile one step per "
                    "model (stepgraph.compile(layer.train_step) for each), or raise max_captures")
        return (f"a {m['t']} argument is keyed by identity (a graph cannot guard its contents), so "
                f"each new one is a new graph: pass a tensor instead (e.g. torch.as_tensor({name}))")
    m = re.match(_ARG + r" numpy array .*(?:\(values read in the step\)|object at 0x[0-9a-f]+)$", reason)
    if m:
        return (f"the step reads the values of {m['arg'] or m['kw']} in Python (numpy), so each new content "
                "is a new graph: index or compute with torch on it in the step (torch.as_tensor(...))")
    m = re.match(_ARG + r" (?:None -> tensor |tensor .* -> None$)", reason)
    if m and m["path"]:
        name = m["arg"] or m["kw"]
        return (f"which elements of {name} are None changes between calls, and each pattern is a graph "
                "of its own: build the tensors the step needs outside it (stack the elements, make the "
                "mask there) and pass those")
    m = re.match(_ARG + r" shape \((?P<old>[\d, ]*)\) -> \((?P<new>[\d, ]*)\)", reason)
    if m and _padded_length_changed(m["old"], m["new"]):
        name = m["arg"] or m["kw"]
        return (f"{name}{m['path']} is padded to the longest sequence of each batch, and each length is "
                "a graph of its own: pad to a fixed length (tokenizer padding='max_length', or a "
                "multiple that leaves a few lengths: DataCollatorWithPadding(pad_to_multiple_of=64)), "
                "or raise max_captures to the number of lengths")
    if m and _batch_size_changed(m["old"], m["new"]):
        name = m["arg"] or m["kw"]
        return (f"{name}{m['path']}'s batch size changed, and each size is a graph of its own: "
                "DataLoader(drop_last=True) when only the last batch of an epoch is smaller, else "
                "one batch size, or raise max_captures to the number of sizes")
    m = re.match(_ARG + r" shape \(", reason)
    if m:
        name = m["arg"] or m["kw"]
        return (f"{name}{m['path']} has another shape at each call (a flat batch of variable-length "
                "sequences, as nn.EmbeddingBag's input with offsets), and each shape is a graph of its "
                f"own: pad {name} to one of a few fixed lengths before the call (padding the model "
                "ignores: padding_idx, an extra bag whose output is dropped, ignore_index), or "
                "DataLoader(drop_last=True) when only the last batch is smaller; when it takes only a "
                "few shapes (a char-RNN's name lengths), raise max_captures to their number")
    conv = converted_number(reason)
    if conv:
        return conv
    if re.search(r"\.step\([^)].*\): float\(\) of a (\w+ tensor|value read from a tensor) was .* at capture, now ",
                 reason):
        # (``scheduler.step(val_loss)`` in the step: ReduceLROnPlateau's own float(metrics), which
        # .item() does not avoid -- the hint below sent the user there first)
        return ("a scheduler stepped with this call's value (ReduceLROnPlateau.step(loss)) compares it "
                "on the host, so each value is a graph of its own: return the loss from the step and "
                "call scheduler.step(loss) outside it")
    if re.search(r": float\(\) of a \w+ tensor was .* at capture, now ", reason):
        # (PyTorch Geometric's examples: ``return float(loss)``; a plain float, which the graph
        # cannot hand back live, so a value guard that misses at every call)
        return ("float(t) hands Python a plain copy of this call's value, which no replay can give back: "
                "return the tensor (or t.item(), a value stepgraph reads again at every replay) and "
                "convert it outside the step")
    if re.search(INT_COUNT + r".*\): int\(\) of a \w+ tensor was .* at capture, now ", reason):
        return "int(t) hands Python a plain copy of this call's value, so each value is a graph of its own: " + ITEM_FIX
    m = re.match(r"(?:global )?(?P<name>\S+) <object at 0x[0-9a-f]+>(?: of length \d+)? -> <object at", reason)
    if m:
        return (f"{m['name']} is a new object, keyed by identity because the step calls its methods: "
                "create it once outside the loop, or use it outside the step")
    return ""


def _dims(shape: str) -> tuple:
    return tuple(int(d) for d in shape.split(",") if d.strip())


def _padded_length_changed(old: str, new: str) -> bool:
    """A batch of sequences (2+ dims) whose batch size stayed and whose length moved: a collator
    padding each batch to its longest (transformers' default ``DataCollatorWithPadding``)."""
    a, b = _dims(old), _dims(new)
    return len(a) == len(b) >= 2 and a[0] == b[0] and a[1] != b[1] and a[2:] == b[2:]


def _batch_size_changed(old: str, new: str) -> bool:
    """A batch (2+ dims) of which only the first dimension moved."""
    a, b = _dims(old), _dims(new)
    return len(a) == len(b) >= 2 and a[0] != b[0] and a[1:] == b[1:]


def converted_number(reason: str) -> str:
    """A number of the step's own arithmetic (a counter, ``i + epoch * n``) that ``float()`` or
    ``int()`` on its line handed Python as a plain copy (DANN's ``p = float(i + epoch * n) /
    total``, a KD meter's ``total / float(steps)``): baked, a graph per value. Without the call
    the number stays live (tracked arithmetic); '' when the reason is no such miss."""
    m = re.search(r"\d+(?:\.\d+)? -> \d+(?:\.\d+)? \(at (?P<file>[^()]+):(?P<line>\d+)\)$", reason)
    if not m:
        return ""
    import linecache
    line = linecache.getline(m["file"], int(m["line"]))
    call = re.search(r"\b(float|int)\((?!\))", line)
    if call is None:
        return ""
    return (f"{call[1]}() on {m['file'].rsplit('/', 1)[-1]}:{m['line']} hands Python a plain copy of a number "
            f"that changes at every call, so each value is a graph of its own: drop the {call[1]}() "
            "(Python's / already gives a float; without it stepgraph keeps the number live)")
