"""insert_casts: make every op read its inputs in the precision colour_by_lists chose.

Rules (each checked by ``lint.check_amp_invariants``):

- at most one cast per value per dtype, placed right after the value (after the last
  placeholder for parameters and inputs): a parameter used by several ops is cast once per step;
- only floating-point values are cast, and only fp32 values are lowered: fp64 data and values
  the user cast explicitly keep their dtype;
- mixed-precision kernels (BatchNorm) keep their parameters and statistics fp32;
- an fp32 elementwise op that promotes mixed inputs itself (add, mul, where, ...) reads a
  low-precision input directly, as eager PyTorch does: no cast node;
- factories coloured low precision get their ``dtype`` rewritten instead of a cast;
- graph outputs (user results, losses, buffer updates) are returned in their captured dtype.

Writes ``meta["amp_dtype"]`` (the floating dtype a value has after the pass; a tuple for
tuple-producing ops) and marks inserted casts with ``meta["amp_cast"] = True``.
"""

from __future__ import annotations

import operator
from functools import reduce
from typing import Any

import torch
import torch.fx as fx

from .base import AmpContext, PassResult, float_dtype, packet_of
from .lists import ALL_OUTPUTS_FOLLOW, FACTORIES, LIKE_FACTORIES, MIXED_ARGS, PROMOTING

aten = torch.ops.aten


def dtype_after_amp(node: fx.Node) -> Any:
    """A value's floating dtype after the AMP passes (its captured dtype if they left it)."""
    if "amp_dtype" in node.meta:
        return node.meta["amp_dtype"]
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        return tuple(float_dtype(v) for v in val)
    return float_dtype(val)


def _short(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


class _CastInserter:
    def __init__(self, gm: fx.GraphModule, ctx: AmpContext):
        self.graph = gm.graph
        self.low = ctx.dtype
        self.casts: dict[tuple[fx.Node, torch.dtype], fx.Node] = {}
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        self.anchor = placeholders[-1] if placeholders else None

    def cast(self, value: fx.Node, dtype: torch.dtype, user: fx.Node) -> fx.Node:
        key = (value, dtype)
        node = self.casts.get(key)
        if node is None:
            where = self.anchor if value.op == "placeholder" else value
            with self.graph.inserting_after(where):
                node = self.graph.call_function(aten._to_copy.default, (value,), {"dtype": dtype})
            node.meta.update(
                amp_cast=True,
                amp_list="cast",
                amp_colour="cast",
                amp_dtype=dtype,
                amp_reason=f"{_short(dtype_after_amp(value))} -> {_short(dtype)} for {user.name}",
                nn_module_stack=user.meta.get("nn_module_stack"),
                user_frame=user.meta.get("user_frame"),
                cast_source=value,
            )
            self.casts[key] = node
        return node

    def rewrite(self, node: fx.Node) -> None:
        colour = node.meta.get("amp_colour")
        if colour not in ("allow", "deny"):
            return  # fixed-dtype and non-float ops read their inputs as they come
        packet = packet_of(node)
        low_here = colour == "allow"
        if low_here and packet in LIKE_FACTORIES:
            self._set_factory_dtype(node)
            return
        mixed = MIXED_ARGS.get(packet, ())
        wanted: dict[tuple[Any, int], torch.dtype] = {}

        def want(value: fx.Node, position: Any) -> torch.dtype | None:
            orig = float_dtype(value.meta.get("val"))
            if orig is None:
                return None
            if low_here and orig == torch.float32 and position not in mixed:
                return self.low
            return orig

        inputs = []  # (position, value, current dtype, wanted dtype)
        for pos, arg in [*enumerate(node.args), *node.kwargs.items()]:
            for value in _nodes_in(arg):
                target = want(value, pos)
                if target is not None:
                    inputs.append((pos, value, dtype_after_amp(value), target))
        if not low_here and packet in PROMOTING and self._promotes_correctly(node, inputs):
            pass  # the kernel widens low-precision inputs itself
        else:
            for pos, value, current, target in inputs:
                if current != target:
                    wanted[(value, pos)] = target
        if wanted:
            def replace(value: fx.Node, pos: Any) -> fx.Node:
                target = wanted.get((value, pos))
                return value if target is None else self.cast(value, target, node)

            node.args = tuple(_map_nodes(a, lambda v, p=i: replace(v, p))
                              for i, a in enumerate(node.args))
            node.kwargs = {k: _map_nodes(a, lambda v, p=k: replace(v, p))
                           for k, a in node.kwargs.items()}
        self._set_output_dtype(node, low_here, packet)

    def _promotes_correctly(self, node: fx.Node, inputs: list) -> bool:
        """Would type promotion on the current dtypes give the op's captured output dtype?"""
        out = float_dtype(node.meta.get("val"))
        dims, zero_dims = [], []
        for _, value, current, _ in inputs:
            val = value.meta.get("val")
            (dims if isinstance(val, torch.Tensor) and val.dim() > 0 else zero_dims).append(current)
        group = dims or zero_dims
        return bool(group) and out is not None and reduce(torch.promote_types, group) == out

    def _set_output_dtype(self, node: fx.Node, low_here: bool, packet: Any) -> None:
        val = node.meta.get("val")
        if not low_here:
            return
        if isinstance(val, (tuple, list)):
            dtypes = []
            for i, v in enumerate(val):
                orig = float_dtype(v)
                follows = i == 0 or packet in ALL_OUTPUTS_FOLLOW
                dtypes.append(self.low if follows and orig == torch.float32 else orig)
            node.meta["amp_dtype"] = tuple(dtypes)
            return
        if float_dtype(val) != torch.float32:
            return
        node.meta["amp_dtype"] = self.low
        if packet in FACTORIES:
            node.kwargs = {**node.kwargs, "dtype": self.low}

    def _set_factory_dtype(self, node: fx.Node) -> None:
        if float_dtype(node.meta.get("val")) == torch.float32:
            node.kwargs = {**node.kwargs, "dtype": self.low}
            node.meta["amp_dtype"] = self.low

    def fix_outputs(self, output: fx.Node) -> None:
        def restore(value: fx.Node) -> fx.Node:
            orig = float_dtype(value.meta.get("val"))
            current = dtype_after_amp(value)
            if orig is None or current == orig:
                return value
            return self.cast(value, orig, output)

        output.args = tuple(_map_nodes(a, restore) for a in output.args)


def _nodes_in(arg: Any) -> list[fx.Node]:
    if isinstance(arg, fx.Node):
        return [arg]
    if isinstance(arg, (list, tuple)):
        return [n for a in arg for n in _nodes_in(a)]
    return []


def _map_nodes(arg: Any, fn) -> Any:
    if isinstance(arg, fx.Node):
        return fn(arg)
    if isinstance(arg, (list, tuple)):
        return type(arg)(_map_nodes(a, fn) for a in arg)
    return arg


def insert_casts(gm: fx.GraphModule, ctx: AmpContext) -> PassResult:
    inserter = _CastInserter(gm, ctx)
    for node in list(gm.graph.nodes):
        if node.op == "output":
            inserter.fix_outputs(node)
        elif node.op == "call_function" and node.target is operator.getitem:
            src, index = node.args
            produced = dtype_after_amp(src)
            if isinstance(produced, tuple):
                node.meta["amp_dtype"] = produced[index]
        elif node.op == "call_function" and not node.meta.get("amp_cast"):
            inserter.rewrite(node)
    ctx.stats["casts_inserted"] = len(inserter.casts)
    gm.recompile()
    return PassResult(gm, bool(inserter.casts))
