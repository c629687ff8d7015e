"""The traced values of a step graph's metadata in the step cache's compact form, and the size
guards of a step traced with symbolic sizes.

The traced values (``meta["val"]``) of static sizes are stored as (shape, strides, dtype,
device) and made fake tensors again on load: GraphPickler's general form of them was 0.4 s of a
0.46 s load of a 6-layer GPT-2 step (2,000 nodes); ``meta["tensor_meta"]``, which nothing after
assembly reads, is left out. Symbolic sizes are stored as sympy expressions over the batch's
size symbols, with the guards the tracing ShapeEnv held; a build that loads them checks the
guards against its own sizes, makes the values over its own ShapeEnv and assumes the guards.
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._subclasses
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from ..torchkit.compat import backed_sizes
from ..torchkit.fxutil import graph_modules

_TAKEN_META = ("val", "tensor_meta")


_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _size(x: Any) -> bool:
    """An int, or a symbolic one over the batch's (backed) size symbols."""
    return type(x) is int or (isinstance(x, torch.SymInt) and _backed(x))


def _backed(x: Any) -> bool:
    """Every symbol of ``x`` has a value in its ShapeEnv (no data-dependent size: those are
    made afresh by each trace, so an entry could not name them)."""
    node = x.node
    return all(s in backed_sizes(node.shape_env) for s in node.expr.free_symbols)


def _encodable(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.layout is torch.strided and all(
            map(_size, (*value.shape, *value.stride(), value.storage_offset()))
        )
    if isinstance(value, (tuple, list)):
        return all(map(_encodable, value))
    if isinstance(value, _SYMBOLIC):
        return _backed(value)
    return value is None or type(value) in (int, float, bool)


def _symbolic(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return any(isinstance(x, torch.SymInt) for x in (*value.shape, *value.stride()))
    if isinstance(value, (tuple, list)):
        return any(map(_symbolic, value))
    return isinstance(value, _SYMBOLIC)


def _int_code(x: Any) -> Any:
    """An int as it is; a symbolic one as ("sym", its sympy expression)."""
    return ("sym", x.node.expr) if isinstance(x, torch.SymInt) else x


def encode(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (
            "tensor",
            tuple(map(_int_code, value.shape)),
            tuple(map(_int_code, value.stride())),
            _int_code(value.storage_offset()),
            value.dtype,
            str(value.device),
            value.requires_grad,
        )
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, [encode(v) for v in value])
    if isinstance(value, _SYMBOLIC):
        return ("symbol", type(value).__name__, value.node.expr)
    return ("value", value)


def decode(code: Any, mode: FakeTensorMode) -> Any:
    """A value ``encode`` made, as a fake of ``mode`` (symbols: of its ShapeEnv)."""
    kind = code[0]
    if kind == "tensor":
        _, shape, stride, offset, dtype, device, requires_grad = code
        shape, stride = [_int(x, mode) for x in shape], [_int(x, mode) for x in stride]
        offset = _int(offset, mode)
        fake: torch.Tensor
        if all(type(x) is int for x in (*shape, *stride)):
            meta = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
            if offset:
                meta = meta.as_strided(shape, stride, offset)
            fake = FakeTensor(mode, meta, torch.device(device))
        else:  # symbolic sizes: made by the fake mode itself, over its ShapeEnv's symbols
            with mode:
                fake = torch.empty_strided(shape, stride, dtype=dtype, device=device)
                if not (type(offset) is int and offset == 0):
                    fake = fake.as_strided(shape, stride, offset)
        return fake.requires_grad_(True) if requires_grad else fake
    if kind in ("tuple", "list"):
        items = [decode(c, mode) for c in code[1]]
        return tuple(items) if kind == "tuple" else items
    if kind == "symbol":
        return _symbol(code[1], code[2], mode)
    return code[1]


def _int(code: Any, mode: FakeTensorMode) -> Any:
    return _symbol("SymInt", code[1], mode) if isinstance(code, tuple) else code


def _symbol(kind: str, expr: Any, mode: FakeTensorMode) -> Any:
    """A SymInt (SymFloat, SymBool) of ``mode``'s ShapeEnv for ``expr``: the entry's symbols
    are this build's (the key holds the example inputs' sizes, symbols included, by name)."""
    env = _shape_env(mode)
    hint = expr.xreplace(backed_sizes(env))
    if kind == "SymInt":
        return env.create_symintnode(expr, hint=int(hint))
    if kind == "SymFloat":
        return env.create_symfloatnode(expr, hint=float(hint))
    return env.create_symboolnode(expr)


def shape_guards(gm: fx.GraphModule) -> list[Any]:
    """The guards of the ShapeEnv the step was traced in, when its sizes are symbolic."""
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            for x in (*value.shape, *value.stride()):
                if isinstance(x, torch.SymInt) and x.node.shape_env is not None:
                    return [guard.expr for guard in x.node.shape_env.guards]
    return []


def left_symbolic(gm: fx.GraphModule) -> bool:
    """Whether a symbolic value is left in the metadata (``take_values`` took the others)."""
    return any(_symbolic(n.meta.get("val")) for m in graph_modules(gm) for n in m.graph.nodes)


def guards_hold(guards: list[Any], mode: FakeTensorMode) -> bool:
    """Whether the entry's guards hold for this build's sizes (the hints of its symbols)."""
    if not guards:
        return True
    env = mode.shape_env
    if env is None:
        return False
    return all(bool(g.xreplace(backed_sizes(env))) for g in guards)


def assume(guards: list[Any], mode: FakeTensorMode) -> None:
    """Add the entry's guards to this build's ShapeEnv, as its assembly would have."""
    if not guards:
        return
    env = _shape_env(mode)
    for guard in guards:
        env.evaluate_expr(guard)


def _shape_env(mode: FakeTensorMode) -> Any:
    """The build's ShapeEnv, which an entry with symbolic sizes needs (``_restored`` turns the
    error into a warning and a rebuilt step)."""
    if mode.shape_env is None:
        raise ValueError("the entry has symbolic sizes, but this build's fake mode has no ShapeEnv")
    return mode.shape_env


_Taken = list[tuple[str, str, fx.Node, dict]]


def take_values(gm: fx.GraphModule) -> _Taken:
    """Take the encodable values (and tensor_meta) of the non-placeholder nodes out of their
    metadata, for ``put_back``: (graph module path, node name, node, what was taken)."""
    taken = []
    paths = {id(m): path for path, m in gm.named_modules()}
    for m in graph_modules(gm):
        for node in m.graph.nodes:
            value = node.meta.get("val")
            if node.op == "placeholder" and not _symbolic(value):
                continue  # GraphPickler's own form (static sizes need no ShapeEnv)
            if "val" in node.meta and _encodable(value):
                meta = {k: node.meta.pop(k) for k in _TAKEN_META if k in node.meta}
                taken.append((paths[id(m)], node.name, node, meta))
    return taken


def put_back(taken: _Taken) -> None:
    for _, _, node, meta in taken:
        node.meta.update(meta)


def put_values(gm: fx.GraphModule, values: list, mode: FakeTensorMode) -> None:
    modules = dict(gm.named_modules())
    nodes: dict[tuple[str, str], fx.Node] = {}
    for path, name, code in values:
        if (path, name) not in nodes:
            graph = modules[path].graph
            nodes.update({(path, n.name): n for n in graph.nodes})
        nodes[(path, name)].meta["val"] = decode(code, mode)
