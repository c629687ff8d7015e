"""insert_casts: make every op read its inputs in the precision colour_by_lists chose.

Rules (each checked by ``lint.check_amp_invariants``):

- at most one cast per value per dtype, placed right after the value (after the last
  placeholder for graph inputs);
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

from ..validate import dtype_name
from .base import AmpContext, PassResult, captured_dtype, dtype_after_amp, packet_of
from .lists import ALL_OUTPUTS_FOLLOW, FACTORIES, LIKE_FACTORIES, MIXED_ARGS, PROMOTING

__all__ = ["dtype_after_amp", "insert_casts", "wanted_dtype"]

aten = torch.ops.aten


def wanted_dtype(consumer: fx.Node, position: Any, value: fx.Node, low: torch.dtype) -> Any:
    """The dtype ``consumer`` wants to read ``value`` in at argument ``position``."""
    orig = captured_dtype(value)
    if (orig == torch.float32 and consumer.meta.get("amp_colour") == "allow"
            and position not in MIXED_ARGS.get(packet_of(consumer), ())):
        return low
    return orig


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
                node = self.graph.create_node(
                    "call_function", aten._to_copy.default, (value,), {"dtype": dtype},
                    name=f"{value.name}_{dtype_name(dtype)}")
            node.meta.update(
                amp_cast=True,
                amp_list="cast",
                amp_colour="cast",
                amp_dtype=dtype,
                captured_dtype=captured_dtype(value),
                amp_reason=f"{dtype_name(dtype_after_amp(value))} -> {dtype_name(dtype)} for {user.name}",
                nn_module_stack=user.meta.get("nn_module_stack"),
                user_frame=user.meta.get("user_frame"),
                val=value.meta.get("val"),  # shape and strides; the dtype is amp_dtype
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
        mixed = MIXED_ARGS.get(packet)
        if mixed is None:
            # the dtype a value is wanted in does not depend on its argument position:
            # low for fp32 values of an allow op, the captured dtype otherwise (wanted_dtype)
            changes = {}
            for value in node.all_input_nodes:
                current = dtype_after_amp(value)
                if current is None or current.__class__ is tuple:
                    continue
                target = captured_dtype(value)
                if low_here and target == torch.float32:
                    target = self.low
                if current != target:
                    changes[value] = target
            if changes and not (not low_here and packet in PROMOTING
                                and self._promotes_correctly(node)):
                for value, target in changes.items():
                    node.replace_input_with(value, self.cast(value, target, node))
        else:
            self._rewrite_positional(node, mixed)
        self._set_output_dtype(node, low_here, packet)

    def _rewrite_positional(self, node: fx.Node, mixed: tuple[int, ...]) -> None:
        def fix(value: fx.Node, position: Any) -> fx.Node:
            current = dtype_after_amp(value)
            if current is None or isinstance(current, tuple):
                return value
            target = wanted_dtype(node, position, value, self.low)
            return value if current == target else self.cast(value, target, node)

        node.args = tuple(_map_nodes(a, lambda v, p=i: fix(v, p)) for i, a in enumerate(node.args))
        node.kwargs = {k: _map_nodes(a, lambda v, p=k: fix(v, p)) for k, a in node.kwargs.items()}

    def _promotes_correctly(self, node: fx.Node) -> bool:
        """Would type promotion on the current dtypes give the op's captured output dtype?"""
        out = captured_dtype(node)
        dims, zero_dims = [], []
        for value in node.all_input_nodes:
            current = dtype_after_amp(value)
            if current is None or isinstance(current, tuple):
                continue
            val = value.meta.get("val")
            (dims if isinstance(val, torch.Tensor) and val.dim() > 0 else zero_dims).append(current)
        group = dims or zero_dims
        return bool(group) and out is not None and reduce(torch.promote_types, group) == out

    def _set_output_dtype(self, node: fx.Node, low_here: bool, packet: Any) -> None:
        if not low_here:
            return
        orig = captured_dtype(node)
        if isinstance(orig, tuple):
            node.meta["amp_dtype"] = tuple(
                self.low if d == torch.float32 and (i == 0 or packet in ALL_OUTPUTS_FOLLOW) else d
                for i, d in enumerate(orig))
            return
        if orig != torch.float32:
            return
        node.meta["amp_dtype"] = self.low
        if packet in FACTORIES:
            node.kwargs = {**node.kwargs, "dtype": self.low}

    def _set_factory_dtype(self, node: fx.Node) -> None:
        if captured_dtype(node) == torch.float32:
            node.kwargs = {**node.kwargs, "dtype": self.low}
            node.meta["amp_dtype"] = self.low

    def fix_outputs(self, output: fx.Node) -> None:
        def restore(value: fx.Node) -> fx.Node:
            orig = captured_dtype(value)
            current = dtype_after_amp(value)
            if orig is None or current == orig or isinstance(orig, tuple):
                return value
            return self.cast(value, orig, output)

        output.args = tuple(_map_nodes(a, restore) for a in output.args)


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
        elif node.op != "call_function" or node.meta.get("amp_cast"):
            continue
        elif node.target is operator.getitem:
            src, index = node.args
            produced = dtype_after_amp(src)
            if isinstance(produced, tuple):
                node.meta["amp_dtype"] = produced[index]
        else:
            inserter.rewrite(node)
    ctx.stats["casts_inserted"] = len(inserter.casts)
    return PassResult(gm, bool(inserter.casts))
