"""Value guards on numbers drawn from a random op: refused at the first capture.

A guard on a value computed after a random draw (``torch.randint`` batch indices read by Python
slicing, ``float()`` of a loss behind dropout) would miss at every call; ``random_guards`` finds
them in the traced graph (walking a guard's inputs back to a seeded op) and words each refusal
with the fix that fits it. Moved out of hostreads.py (which records the reads)."""
from __future__ import annotations

import math
import re

import operator

import torch
import torch.utils._pytree as pytree

from ..markers import host_guard
from .hostreads import tensor_shape
from .libraries import library_draw_fix
from .hints import INT_COUNT, ITEM_FIX

_SELECTS = (torch.ops.aten.index.Tensor, torch.ops.aten._unsafe_index.Tensor, torch.ops.aten.masked_select.default)


def _draws(n) -> bool:
    """``n`` draws random numbers: a seeded op, unless its dropout probability is 0 (PyTorch
    tags every SDPA kernel as seeded; with ``dropout_p=0.0`` it draws nothing)."""
    t = n.target
    if not (isinstance(t, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in t.tags):
        return False
    for i, arg in enumerate(t._schema.arguments):
        if arg.name in ("dropout_p", "p", "train"):
            v = n.kwargs.get(arg.name, n.args[i] if i < len(n.args) else arg.default_value)
            if (arg.name == "train" and v is False) or (arg.name != "train" and v == 0):
                return False
    return True


def _value_inputs(guard) -> list:
    """What a guarded value is computed from. A shape decided by tensor values (``nonzero``,
    ``x[mask]``, CTC's target lengths) is decided by the integer and boolean tensors among its
    op's inputs (indices, masks, lengths), not by float data flowing through it (a CTC loss's
    log-probs behind dropout); a selection's by its indices or mask alone (ELECTRA's discriminator
    loss ``labels[attention_mask == 1]`` with labels from the generator's sampling: the count is
    the mask's, not random -- it was refused as a random read)."""
    src = guard.args[0]
    if not (isinstance(src, torch.fx.Node) and src.target is tensor_shape):
        return list(guard.all_input_nodes)
    op = src.args[0]
    while op.target is operator.getitem:   # (an output of a multi-output op)
        op = op.args[0]
    if op.target in _SELECTS:   # (``labels[active]``: the count is the mask's, whatever the labels hold)
        chosen = [a for a in pytree.tree_leaves(op.args[1:]) if isinstance(a, torch.fx.Node)]
        return chosen or list(op.all_input_nodes)
    picked = [a for a in op.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)
              and not a.meta["val"].dtype.is_floating_point and not a.meta["val"].dtype.is_complex]
    return picked if picked else list(op.all_input_nodes)


def _integer(node) -> bool:
    return isinstance(v := node.meta.get("val"), torch.Tensor) and not (v.dtype.is_floating_point or v.dtype.is_complex)


def _integer_inputs(a, via_int: bool) -> list:
    """An integer value comes from its op's integer inputs when it has any (packed batch sizes
    from the lengths, not from the embeddings behind dropout); an argmax of floats from those."""
    if not (via_int or _integer(a)):
        return [(x, False) for x in a.all_input_nodes]
    if a.target is operator.getitem:   # (an integer output of a multi-output op)
        return [(x, True) for x in a.all_input_nodes]
    ints = [x for x in a.all_input_nodes if _integer(x)]
    return [(x, True) for x in ints] if ints else [(x, False) for x in a.all_input_nodes]


def _coin(n):
    """The random op a decision compares directly (``torch.rand([]) < p``: the draw a few ops up,
    with no data between), or None. A decision on data computed after dropout (a decoder's
    ``topi.item() == EOS``) is the data's, not a coin's."""
    todo, depth = list(n.all_input_nodes), 0
    while todo and depth < 4:
        nxt = []
        for a in todo:
            if _draws(a):
                return a.target
            nxt += a.all_input_nodes
        todo, depth = nxt, depth + 1
    return None


_ATEN = torch.ops.aten
_CMP = {_ATEN.gt.Scalar: "gt", _ATEN.ge.Scalar: "ge", _ATEN.lt.Scalar: "lt", _ATEN.le.Scalar: "le"}
_UNIT = (_ATEN.rand.default, _ATEN.rand_like.default, _ATEN.uniform_.default, _ATEN.uniform.default)


def _settled(guard) -> bool:
    """A coin whose side is decided by its threshold: ``torch.rand(1) > module_dropout`` with the
    default ``module_dropout=0.0`` (PEFT's LoHa/LoKr, once per adapted layer) is True unless the
    draw is exactly 0 (2**-24). Its guard stays (it holds at every call); it is no coin counted
    against max_captures (each model with them was refused as 2**n paths of LayerDrop)."""
    cmp = None
    for a in guard.all_input_nodes[:1]:
        while a.target in (bool, _ATEN._local_scalar_dense.default, _ATEN.squeeze.default, _ATEN.view.default) \
                and a.all_input_nodes:
            a = a.all_input_nodes[0]
        cmp = a if a.target in _CMP else None
    if cmp is None or len(cmp.args) != 2:
        return False
    draw, p = cmp.args
    if isinstance(p, torch.fx.Node):   # (a number read live: its value at this capture; its guard holds it)
        p = p.meta.get("host_value")
    if type(p) not in (int, float):
        return False
    if getattr(draw, "target", None) not in _UNIT or draw.target in (_ATEN.uniform_.default, _ATEN.uniform.default) \
            and tuple(draw.args[1:3]) not in ((), (0.0, 1.0), (0, 1)):
        return False
    op = _CMP[cmp.target]
    return op in ("gt", "ge") and p <= 0 or op in ("lt", "le") and p >= 1


def _one_integer(v) -> bool:
    """``int()`` of a uniform draw whose range holds one integer part: the same number at every
    call (torchvision's detection transform, ``torch_choice`` of a one-entry ``min_size``:
    ``int(torch.empty(1).uniform_(0.0, 1.0).item())``, refused as random, every detection model
    with it). Its guard stays; it holds at every call."""
    if getattr(v, "target", None) is not int or len(v.all_input_nodes) != 1:
        return False
    r = v.all_input_nodes[0]
    u = r.all_input_nodes[0] if r.target is torch.ops.aten._local_scalar_dense.default and r.all_input_nodes else None
    if u is None or u.target not in (torch.ops.aten.uniform_.default, torch.ops.aten.uniform.default):
        return False
    lo = u.args[1] if len(u.args) > 1 else u.kwargs.get("from", 0.0)
    hi = u.args[2] if len(u.args) > 2 else u.kwargs.get("to", 1.0)
    return type(lo) in (int, float) and type(hi) in (int, float) and 0 <= lo and hi <= math.floor(lo) + 1


def _library_of(guard) -> str:
    """``path:line`` in library code where the guarded value was read (hostreads), or ``""``."""
    todo, seen = [guard.args[0]], set()
    while todo:
        a = todo.pop()
        if not isinstance(a, torch.fx.Node) or a in seen:
            continue
        seen.add(a)
        if a.meta.get("stepgraph_library"):
            return a.meta["stepgraph_library"]
        if a.target is not torch.ops.aten._local_scalar_dense.default:
            todo.extend(a.all_input_nodes)
    return ""


def random_guards(gm, max_captures: int = 8) -> list:
    """Value guards on numbers drawn from a random op (``torch.randint`` batch indices read by
    Python slicing, ``float()`` of a loss behind dropout): such a value differs at every call,
    so each call would miss the guard and capture again until ``max_captures``, then run
    eagerly. Refused at the first capture instead. A *decision* (a bool: ``if torch.rand(()) <
    p``) takes few values and stays guarded -- unless more coins decide the path than
    ``max_captures`` graphs cover (as hostrandom.refuse_draw_checks for numpy's)."""
    from .effects import Problem
    out, coins = [], []
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not host_guard:
            continue
        if isinstance(n.args[1], bool):
            draw = _coin(n)
            if draw is not None and not _settled(n):
                coins.append((n, draw))
            continue
        if _one_integer(n.args[0]):
            continue
        seen, todo, draw = set(), [(a, False) for a in _value_inputs(n)], None
        while todo and draw is None:
            a, via_int = todo.pop()
            if a in seen:
                continue
            seen.add(a)
            if _draws(a):
                draw = a.target
            todo.extend(_integer_inputs(a, via_int))
        if draw is None:
            continue
        site, what = n.args[2], n.args[3]
        if str(what).startswith("float() of a") and "tensor" in str(what) and "float(" in str(site):
            # (``return float(loss)`` behind dropout, PyTorch Geometric's gcn.py: a plain copy)
            out.append(Problem(
                f"the step calls float() on a tensor computed after a random draw ({draw} feeds it): "
                "float() hands Python a plain copy of this call's value, which no replay can give back",
                site, "return the tensor (or t.item(), a value stepgraph reads again at every replay) "
                "and convert it outside the step", plain=True))
            continue
        if str(what).startswith("int() of a") and re.search(INT_COUNT, str(site)):
            out.append(Problem(
                f"the step calls int() on a tensor computed after a random draw ({draw} feeds it): "
                "int() hands Python a plain copy of this call's value, which no replay can give back",
                site, ITEM_FIX, plain=True))
            continue
        if any(f"{d} tensor" in str(what) for d in ("float16", "bfloat16", "float32", "float64")):
            # A float computed after a draw (``ReduceLROnPlateau.step(loss)`` behind dropout): no
            # batch to build outside; the fix is to compare it in the loop.
            out.append(Problem(
                f"the step compares a value computed after a random draw on the host ({what}; "
                f"{draw} feeds it): it differs at every call, so no graph captured for one value "
                "could be replayed", site,
                "return the value from the step and use it outside (e.g. scheduler.step(loss) or "
                "the comparison in the training loop)", plain=True))
            continue
        if "cannot stay live" in str(what):
            # (a float read back, ``.item()``, that an op takes as a number autograd keeps for
            # the backward: no batch to build outside; the fix is to keep it a tensor)
            out.append(Problem(
                f"the step reads back a value computed after a random draw ({what}; {draw} feeds "
                "it) and passes it as a number to an op whose backward keeps it: it differs at "
                "every call, so no graph captured for one value could be replayed", site,
                "keep it a tensor where it meets a tensor that needs grad (e.g. alpha = "
                "log_alpha.exp().detach() instead of log_alpha.exp().item()): the graph computes "
                "a tensor at every replay", plain=True))
            continue
        if str(what).startswith("float() of a value read"):
            # (``float(total_loss / (t + 1))`` for a progress bar, total_loss from loss.item()
            # behind dropout: already a Python float, kept live without float(); pytorch/examples' ViT)
            out.append(Problem(
                f"the step calls float() on a value read from a tensor after a random draw ({draw} "
                "feeds it): float() hands Python a plain copy the graph cannot follow, and it differs "
                "at every call", site,
                "drop the float(): a value from .item() is a Python float already, and stepgraph "
                "recomputes it at every replay where the step uses it (f-strings, set_postfix)",
                plain=True))
            continue
        if "depends on tensor values" in str(what):
            # (SwitchTransformers' router jitter, NLLB-MoE's dropout before its router: the
            # experts a batch reaches are sized by nonzero; no batch the user could build outside)
            out.append(Problem(
                f"the step reads a random value on the host ({what}, drawn by {draw}): a random draw "
                "decides a data-dependent shape (a mixture-of-experts router with jitter noise or "
                "dropout before it, a random mask selected with nonzero): it differs at every call, "
                "so no graph captured for one value could be replayed", site,
                "graph the parts that do not read it: stepgraph.graph_module(model) runs a forward "
                "that reads values eagerly and graphs its submodules, and the rest of the step stays "
                "eager. Where the model has an option that switches that randomness off (a "
                "mixture-of-experts router's router_jitter_noise=0.0; a random token mask is the "
                "method itself, keep it), its router then still sizes its experts by the data: a "
                "graph per routing",
                plain=True))
            continue
        lib = _library_of(n)
        out.append(Problem(
            f"the step reads a random value on the host ({what}, drawn by {draw}): it differs at "
            "every call, so no graph captured for one value could be replayed", site,
            library_draw_fix(lib) if lib else
            "build what the random draw selects outside the step and pass it as arguments (e.g. "
            "X, Y = get_batch('train') in the loop, then step(X, Y)), or select with tensor "
            "indexing (data[ix]) so no value is read on the host", plain=True))
    if 2 ** len(coins) > max_captures:
        # (LayerDrop, transformers' wav2vec2 / HuBERT / Whisper / BART with layerdrop > 0: a
        # ``torch.rand([]) < layerdrop`` coin per layer, 2**12 paths; each call captured a new
        # graph until max_captures, then ran eagerly with a fix for code the user does not own)
        lib = _library_of(coins[0][0])
        out.append(Problem(
            f"the step draws {len(coins)} random coins that decide which code runs ({coins[0][0].args[3]}, "
            f"drawn by {coins[0][1]}; LayerDrop draws one per layer): each of the 2**{len(coins)} "
            "outcomes would be a graph of its own", coins[0][0].args[2],
            f"turn the coins off{f' (drawn inside {lib})' if lib else ''} (a Hugging Face model: config.layerdrop = 0.0, or the model's layerdrop "
            "/ drop-layer probability set to 0), or compile the parts around them: model.encoder.layers[i] = "
            "stepgraph.graph_module(model.encoder.layers[i])", plain=True))
    return out
