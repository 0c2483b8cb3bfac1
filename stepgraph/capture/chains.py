"""The load chains of a function's bytecode: what pyvalues.find_sources reads.

Each ``LOAD_GLOBAL`` / ``LOAD_DEREF`` / argument load followed by attribute loads and constant
subscripts is one chain (``args.clip``, ``cfg['lr']``); a chain that ends in a method load says
whether the call's result is dropped (``("call", m)``: ``pbar.update(1)`` as a statement,
pycalls.py) or used (``("method", m)``). And the number literals the code stores
(:func:`constant_stores`), which a replay writes again.
"""
from __future__ import annotations

import collections
import dis
import inspect
import types

import torch

from ..errors import core_file, library_file

_SUBSCR = ("BINARY_SUBSCR",)


class _VarKey:
    """The key of a subscript by a variable (``self._metrics[mode]``), in a chain's path: what
    it holds is known only as the code runs (varitems.py expands it over the container's keys)."""

    def __repr__(self):
        return "<key>"


VAR = _VarKey()


def autograd_parts(v) -> tuple:
    """A user ``torch.autograd.Function``'s forward, setup_context and backward: ``Fn.apply(x)``
    runs them through torch's code, so a global or class attribute they read (DANN's gradient
    reversal scale) is found only by reading them."""
    if not (isinstance(v, type) and issubclass(v, torch.autograd.Function)):
        return ()
    return tuple(f for f in (getattr(v, n, None) for n in ("forward", "setup_context", "backward"))
                 if isinstance(f, types.FunctionType) and _user_code(f.__code__))


def var_at(path) -> int | None:
    """Where the first subscript by a variable is in ``path`` (None: there is none)."""
    return next((n for n, (_, k) in enumerate(path) if k is VAR), None)


def has_var(path) -> bool:
    return var_at(path) is not None


_VARS = ("LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_DEREF")
_APPENDS = (("call", "append"), ("call", "extend"))


def _chains(top: types.CodeType):
    """(root opcode, root name, path, line) for each load chain in ``top`` and nested code."""
    for code in _all_code(top):
        yield from _code_chains(code)


def _walk(ins, j):
    """``(index, instruction, stack depth)`` after each instruction following ``ins[j]``, the
    depth counted from just after it; stops at a jump (where the stack goes is not known)."""
    depth = 0
    for k in range(j + 1, len(ins)):
        y = ins[k]
        if y.opname == "CACHE":
            continue
        if y.opname.startswith(("JUMP", "POP_JUMP", "FOR_ITER", "RETURN", "SEND", "YIELD")):
            return
        try:
            depth += dis.stack_effect(y.opcode, y.arg if y.opcode >= dis.HAVE_ARGUMENT else None, jump=False)
        except ValueError:
            return
        yield k, y, depth


def _popped(ins, k) -> bool:
    nxt = next((z for z in ins[k + 1:] if z.opname != "CACHE"), None)
    return nxt is not None and nxt.opname == "POP_TOP"


def _discarded(ins, j) -> bool:
    """Is the method loaded at ``ins[j]`` called as a statement (its result popped)? Follows the
    stack depth to the call that consumes the method; a jump on the way: not known, no."""
    for k, y, depth in _walk(ins, j):
        if y.opname.startswith("CALL") and depth < 0:
            return _popped(ins, k)
    return False


def _ex_statement(ins, j) -> bool:
    """Is the attribute loaded at ``ins[j]`` the callable of a ``CALL_FUNCTION_EX`` whose result
    is popped (``metric_logger.update(loss=l, **loss_dict)``: no LOAD_METHOD there)? The call
    leaves its result where the NULL below the callable was: one below the attribute's depth
    (an argument of such a call would leave it two below)."""
    for k, y, depth in _walk(ins, j):
        if depth < 0:
            return y.opname == "CALL_FUNCTION_EX" and depth == -1 and _popped(ins, k)
    return False


def _last_attr(ins, j) -> bool:
    nxt = next((z for z in ins[j + 1:] if z.opname != "CACHE"), None)
    return nxt is None or nxt.opname != "LOAD_ATTR"


def _extended(ins, i) -> int | None:
    """``lst += [x]`` for the variable loaded at ``ins[i]`` (CleanRL's ``clipfracs += [...]``):
    the index of the store that rebinds it to itself, or None. (An in-place add on a list is
    ``lst.extend(...)``: read as that call, pycalls/pyeffects replay the items.)"""
    depth = 0
    for k in range(i + 1, len(ins)):
        y = ins[k]
        if y.opname == "CACHE":
            continue
        if y.opname.startswith(("JUMP", "POP_JUMP", "FOR_ITER", "RETURN", "SEND", "YIELD")):
            return None
        if y.opname == "BINARY_OP" and y.argrepr == "+=" and depth == 1:
            nxt = next(((m, z) for m, z in enumerate(ins[k + 1:], k + 1) if z.opname != "CACHE"), None)
            ok = nxt is not None and nxt[1].opname.replace("FAST", "X").replace("DEREF", "X") \
                .replace("GLOBAL", "X") == "STORE_X" and nxt[1].argval == ins[i].argval
            return nxt[0] if ok else None
        try:
            depth += dis.stack_effect(y.opcode, y.arg if y.opcode >= dis.HAVE_ARGUMENT else None, jump=False)
        except ValueError:
            return None
        if depth < 1:
            return None
    return None


def _code_chains(code: types.CodeType):
    line = code.co_firstlineno
    ins = list(dis.get_instructions(code))
    skip = set()   # stores of ``lst += [...]`` (read as ``lst.extend``)
    # (``m = self._metrics[mode]`` then ``m["loss"].append(x)``: a local stored once from a chain
    # is that chain where the code appends through it)
    stores = collections.Counter(y.argval for y in ins if y.opname in ("STORE_FAST", "DELETE_FAST"))
    aliases: dict = {}   # local -> (position in out, the chain it was stored from)
    out, kept = [], set()
    i = 0
    while i < len(ins):
        x = ins[i]
        if x.positions is not None and x.positions.lineno:
            line = x.positions.lineno
        if x.opname in ("LOAD_GLOBAL", "LOAD_DEREF", "LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_CLASSDEREF"):
            path = []
            j = i + 1
            while j < len(ins):
                y = ins[j]
                if y.opname == "LOAD_METHOD" or (y.opname == "LOAD_ATTR" and str(y.argrepr).startswith("NULL|self")):
                    # ("call", m): a statement whose result the code drops (``pbar.update(1)``)
                    path.append(("call" if _discarded(ins, j) else "method", y.argval))
                    break
                if y.opname == "LOAD_ATTR" and _ex_statement(ins, j):
                    path.append(("call", y.argval))
                    break
                if y.opname == "LOAD_ATTR" and str(x.argrepr).startswith("NULL + ") and _last_attr(ins, j):
                    # (3.11: ``torch.save(...)`` after a ``global`` store is LOAD_GLOBAL NULL + torch;
                    # LOAD_ATTR save -- the same stack as LOAD_METHOD, so the same test)
                    path.append(("call" if _discarded(ins, j) else "method", y.argval))
                    break
                if y.opname == "LOAD_ATTR":
                    path.append(("attr", y.argval))
                elif y.opname in ("COPY", "STORE_ATTR") and (y.opname == "STORE_ATTR" or (
                        y.argval == 1 and j + 1 < len(ins) and ins[j + 1].opname == "LOAD_ATTR")):
                    # ``self.global_step += 1`` (COPY; LOAD_ATTR) or ``self.n = 0``: a slot the step writes
                    path.append(("attr", (y if y.opname == "STORE_ATTR" else ins[j + 1]).argval))
                    break
                elif y.opname == "LOAD_CONST" and j + 1 < len(ins) and ins[j + 1].opname in _SUBSCR \
                        and isinstance(y.argval, (str, int)):
                    path.append(("item", y.argval))
                    j += 1
                elif y.opname in _VARS and j + 1 < len(ins) and ins[j + 1].opname in _SUBSCR:
                    path.append(("item", VAR))   # (``self._metrics[mode]``: varitems.py)
                    j += 1
                elif y.opname == "LOAD_CONST" and isinstance(y.argval, (str, int)) and (
                        [z.opname for z in ins[j + 1:j + 2]] == ["STORE_SUBSCR"]   # info['loss'] = t
                        or [z.opname for z in ins[j + 1:j + 4]] == ["COPY", "COPY", *_SUBSCR]):  # it[0] += 1
                    path.append(("item", y.argval))   # a slot the step writes
                    break
                else:
                    break
                j += 1
            full = tuple(path)
            if has_var(path) and path[-1] not in _APPENDS:   # (only an append is expanded: varitems.py)
                path = path[:var_at(path)]
            store = None if path else _extended(ins, i)
            if store is not None:
                skip.add(store)
                path = [("call", "extend")]
            if full and full[-1][0] in ("attr", "item") and j < len(ins) and ins[j].opname == "STORE_FAST" \
                    and stores[ins[j].argval] == 1 and x.argval != ins[j].argval:
                aliases[ins[j].argval] = (len(out), x.opname, x.argval, full)
            elif x.argval in aliases and x.opname.startswith("LOAD_FAST"):
                at, op, name, head = aliases[x.argval]
                if path and path[-1] in _APPENDS:
                    out.append((op, name, head + tuple(path), line))
                else:   # (another use of the alias: the chain it was stored from stays a read)
                    kept.add(at)
            out.append((x.opname, x.argval, tuple(path), line))
        elif x.opname in ("STORE_GLOBAL", "STORE_DEREF") and i not in skip:
            # A variable the step only assigns is Python state it changes: keyed like a read one,
            # so the change is replayed (pyeffects.py) or refused, never dropped by a replay.
            out.append(("LOAD_GLOBAL" if x.opname == "STORE_GLOBAL" else "LOAD_DEREF", x.argval, (), line))
        i += 1
    dropped = {at for at, *_ in aliases.values()} - kept   # (stored only to append through)
    yield from (c for k, c in enumerate(out) if k not in dropped)


def _user_code(code: types.CodeType) -> bool:
    # Code typed into a notebook or exec'd ("<string>", "<ipython-input-...>") is user code.
    return not library_file(code.co_filename) and not code.co_filename.startswith(("<frozen", "<stepgraph"))


def _prefixes(path):
    for n in range(len(path), -1, -1):
        yield path[:n]


def unwrapped_function(f, bound=None):
    """The user's function under ``functools.wraps`` decorators (``@torch.no_grad()``,
    ``@torch.autocast(...)``, a timing decorator): the wrapper's code reads nothing of the user's,
    so a scan of it baked what the body reads (a decorated EMA helper's global decay). Not an
    optimizer's method under torch's profiling wrapper (``opt.step``): its counters are the
    registry's (None)."""
    if isinstance(bound, torch.optim.Optimizer) and isinstance(f, types.FunctionType) \
            and core_file(f.__code__.co_filename):
        return None
    try:
        g = inspect.unwrap(f)
    except ValueError:   # (a cycle of __wrapped__)
        return f
    return g if isinstance(g, types.FunctionType) else f


def _all_code(code):
    yield code
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _all_code(c)


def statement_calls(code: types.CodeType, name: str) -> bool:
    """Does ``code`` (or code nested in it) call the global ``name`` as a statement (``print(...)``
    with its result dropped)? 3.11/3.12 load it as ``LOAD_GLOBAL NULL + name``: the stack of a
    method load, so ``_discarded`` answers."""
    for c in _all_code(code):
        ins = list(dis.get_instructions(c))
        for i, x in enumerate(ins):
            if x.opname == "LOAD_GLOBAL" and x.argval == name and str(x.argrepr).startswith("NULL + ") \
                    and _last_attr(ins, i) and _discarded(ins, i):
                return True
    return False


def constant_stores(code) -> set:
    """``(name, number)`` for each number literal the code stores as it is into an attribute, a
    constant subscript or a global/closure variable (build-nanogpt's DataLoaderLite resets
    ``self.current_position = 0`` when it runs out): a replay can write that number again. Also
    in a tuple assignment (spinningup's ``self.ptr, self.path_start_idx = 0, 0``)."""
    out = set()
    for c in _all_code(code):
        ins = [x for x in dis.get_instructions(c) if x.opname not in ("CACHE", "NOP", "EXTENDED_ARG")]
        for i, x in enumerate(ins):
            if x.opname != "LOAD_CONST":
                continue
            if _number(x.argval) or x.argval is None:   # (torchmetrics' ``self._computed = None``)
                got = _store_target(ins, i + 1)
                if got is not None and got[0] is not None:
                    out.add((got[0], x.argval))
            values, j = _unpacked(ins, i)
            for v in values:
                got = _store_target(ins, j)
                if got is None:
                    break
                if _number(v) and got[0] is not None:
                    out.add((got[0], v))
                j = got[1]
    return out


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _store_target(ins, j):
    """``(name, next index)`` of the store starting at ``ins[j]``, or None."""
    nxt = ins[j:j + 3]
    if nxt and nxt[0].opname in ("STORE_FAST", "STORE_NAME"):
        return None, j + 1   # (a local: no value a replay must write)
    if nxt and nxt[0].opname in ("STORE_GLOBAL", "STORE_DEREF"):
        return nxt[0].argval, j + 1
    if len(nxt) >= 2 and nxt[0].opname.startswith("LOAD_") and nxt[1].opname == "STORE_ATTR":
        return nxt[1].argval, j + 2
    if len(nxt) == 3 and nxt[0].opname.startswith("LOAD_") and nxt[1].opname == "LOAD_CONST" \
            and nxt[2].opname == "STORE_SUBSCR":
        return nxt[1].argval, j + 3
    return None


def _unpacked(ins, i):
    """The values a tuple assignment starting at ``ins[i]`` stores, in target order (None where
    not a constant), and the index of its first store: ``LOAD_CONST (0, 0); UNPACK_SEQUENCE``,
    or n loads then ``SWAP n`` (CPython 3.11+ for ``a, b, c = 0, 0, size``)."""
    x = ins[i]
    if isinstance(x.argval, tuple) and i + 1 < len(ins) and ins[i + 1].opname == "UNPACK_SEQUENCE" \
            and ins[i + 1].argval == len(x.argval):
        return list(x.argval), i + 2
    if i > 0 and ins[i - 1].opname.startswith("LOAD_"):
        return [], i   # (only from the first load of a run)
    run = []
    j = i
    while j < len(ins) and ins[j].opname.startswith("LOAD_") and ins[j].opname != "LOAD_ATTR":
        run.append(ins[j].argval if ins[j].opname == "LOAD_CONST" else None)
        j += 1
    if len(run) >= 2 and j < len(ins) and ins[j].opname == "SWAP" and ins[j].argval == len(run):
        return run, j + 1
    return [], i
