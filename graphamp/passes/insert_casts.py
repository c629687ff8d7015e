"""insert_casts: make every op read its inputs in the precision colour_by_lists chose.

What each op computes in:

- allow: the AMP dtype. Its floating inputs (fp32, and fp16/bf16 in the other low precision)
  are cast to it, as autocast's ``lower_precision_fp`` policy does;
- deny with ``amp_widen`` (deny-list ops and the ops downstream of them): fp32. Low-precision
  inputs are cast up whatever made them low (an explicit ``.half()``, an fp16 graph input or
  parameter, a low-precision op upstream): autocast's fp32 rule;
- promote (autocast's promote list): the widest floating dtype among its inputs as they arrive;
- every other op: the dtype it was captured with (low-precision results graphamp made are cast
  back for it).

Rules (each checked by ``lint.check_amp_invariants``):

- at most one cast per value per dtype, placed right after the value (after the last
  placeholder for graph inputs);
- only floating-point values are cast; fp64 values never are;
- mixed-precision kernels (BatchNorm) keep their parameters and statistics fp32;
- an op whose kernel needs equal input dtypes (``EQUAL_DTYPES``: index_put...) gets them cast
  to the widest when the rules above would leave them mixed;
- an elementwise op that promotes mixed inputs itself (add, mul, where, ...) reads a
  low-precision input directly when promotion gives the dtype it should compute in, as eager
  PyTorch does: no cast node;
- factories get their ``dtype`` rewritten instead of a cast;
- graph outputs (user results, losses, buffer updates) are returned in their captured dtype, so
  a lowered value is cast back once for the output, and so is a widened one, except among
  build()'s results: those stay fp32, as autocast returns its fp32 ops' results.

Writes ``meta["amp_dtype"]`` (the floating dtype a value has after the pass; a tuple for
tuple-producing ops) and marks inserted casts with ``meta["amp_cast"] = True``.
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch.ops.aten._to_copy
import operator
from functools import reduce
from typing import Any

import torch
import torch.fx as fx

from ..records.validate import LOW_PRECISION_DTYPES, dtype_name
from .base import (
    AmpContext,
    PassResult,
    captured_dtype,
    dtype_after_amp,
    output_values,
    packet_of,
)
from .op_dtypes import (
    ALL_OUTPUTS_FOLLOW,
    EQUAL_DTYPES,
    FACTORIES,
    LIKE_FACTORIES,
    MIXED_ARGS,
    PROMOTING,
)

__all__ = ["dtype_after_amp", "insert_casts", "wanted_dtype"]

aten = torch.ops.aten
# floating dtypes AMP may change (autocast's "eligible" tensors): fp64 is never touched
AMP_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def compute_dtype(node: fx.Node, low: torch.dtype) -> torch.dtype | None:
    """The floating dtype ``node`` computes in, or None: each input in its captured dtype."""
    colour = node.meta.get("amp_colour")
    if colour == "allow":
        return low
    if colour == "deny" and node.meta.get("amp_widen"):
        return torch.float32
    if colour == "promote":
        arriving = [
            d for d in {dtype_after_amp(v) for v in node.all_input_nodes} if d in AMP_DTYPES
        ]
        return reduce(torch.promote_types, arriving) if arriving else None
    return None


def wanted_dtype(consumer: fx.Node, position: Any, value: fx.Node, low: torch.dtype) -> Any:
    """The dtype ``consumer`` wants to read ``value`` in at argument ``position`` (before the
    equal-dtype rule)."""
    orig = captured_dtype(value)
    current = dtype_after_amp(value)
    if current not in AMP_DTYPES or position in MIXED_ARGS.get(packet_of(consumer), ()):
        return orig
    compute = compute_dtype(consumer, low)
    return compute if compute is not None else orig


class _CastInserter:
    def __init__(self, gm: fx.GraphModule, ctx: AmpContext):
        self.graph = gm.graph
        self.low = ctx.dtype
        self.user_outputs = ctx.user_outputs
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
                    "call_function",
                    aten._to_copy.default,
                    (value,),
                    {"dtype": dtype},
                    name=f"{value.name}_{dtype_name(dtype)}",
                )
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
        if colour == "fixed" and node.meta.get("part_of") is not None:
            _widen_inner_cast(node)
        if colour not in ("allow", "deny", "promote"):
            return  # fixed-dtype and non-float ops read their inputs as they come
        packet = packet_of(node)
        compute = compute_dtype(node, self.low)
        if packet in FACTORIES or packet in LIKE_FACTORIES:
            self._set_factory_dtype(node, compute)
            return
        wanted = self._wanted(node, packet)
        changes = {(v, p): d for (v, p), d in wanted.items() if dtype_after_amp(v) != d}
        if changes and not (packet in PROMOTING and self._promotes_to(node, compute)):
            swap = {key: self.cast(key[0], d, node) for key, d in changes.items()}
            node.args = tuple(_map_positions(a, i, swap) for i, a in enumerate(node.args))
            node.kwargs = {k: _map_positions(a, k, swap) for k, a in node.kwargs.items()}
        self._set_output_dtype(node, compute, packet, wanted)

    def _wanted(self, node: fx.Node, packet: Any) -> dict[tuple[fx.Node, Any], torch.dtype]:
        """{(value, argument position): dtype it should be read in} for the floating inputs."""
        wanted = {}
        for position, value in _positions(node):
            current = dtype_after_amp(value)
            if current is None or isinstance(current, tuple):
                continue
            wanted[(value, position)] = wanted_dtype(node, position, value, self.low)
        if packet in EQUAL_DTYPES and len(set(wanted.values())) > 1:
            widest = reduce(torch.promote_types, set(wanted.values()))
            wanted = {key: widest for key in wanted}
        return wanted

    def _promotes_to(self, node: fx.Node, compute: torch.dtype | None) -> bool:
        """Would type promotion on the current dtypes give the dtype ``node`` should compute in
        (its captured output dtype when it has no compute dtype)?"""
        out = captured_dtype(node)
        if compute is not None and out in AMP_DTYPES:
            out = compute
        dims: list[torch.dtype] = []
        zero_dims: list[torch.dtype] = []
        for value in node.all_input_nodes:
            current = dtype_after_amp(value)
            if current is None or isinstance(current, tuple):
                continue
            val = value.meta.get("val")
            (dims if isinstance(val, torch.Tensor) and val.dim() > 0 else zero_dims).append(current)
        group = dims or zero_dims
        return bool(group) and out is not None and reduce(torch.promote_types, group) == out

    def _set_output_dtype(
        self, node: fx.Node, compute: torch.dtype | None, packet: Any, wanted: dict
    ) -> None:
        orig = captured_dtype(node)
        if compute is None and packet in EQUAL_DTYPES and wanted:
            compute = next(iter(wanted.values()))  # the one dtype its inputs now share
        if compute is None:
            return
        # low-precision ops change only their data outputs (output 0, or all for splits and
        # recurrent states); widened ops compute every output in fp32
        widen = node.meta.get("amp_widen") and compute == torch.float32
        if isinstance(orig, tuple):
            after = tuple(
                compute
                if d in AMP_DTYPES and (widen or i == 0 or packet in ALL_OUTPUTS_FOLLOW)
                else d
                for i, d in enumerate(orig)
            )
            if after != orig:
                node.meta["amp_dtype"] = after
        elif orig in AMP_DTYPES and orig != compute:
            node.meta["amp_dtype"] = compute

    def _set_factory_dtype(self, node: fx.Node, compute: torch.dtype | None) -> None:
        """Factories read no data: their ``dtype`` argument is set instead of casting. A
        ``*_like`` factory whose source changed dtype gets it set too, to keep its own."""
        orig = captured_dtype(node)
        if orig not in AMP_DTYPES:
            return
        target = compute if compute is not None else orig
        source = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        follows_source = source is not None and node.kwargs.get("dtype") is None
        if target != orig or (
            follows_source and source is not None and dtype_after_amp(source) != target
        ):
            node.kwargs = {**node.kwargs, "dtype": target}
        if target != orig:
            node.meta["amp_dtype"] = target

    def fix_outputs(self, output: fx.Node) -> None:
        """Each output in its captured dtype (losses, buffer updates, and build()'s results
        computed in low precision: cast back up), except build()'s results an op computed
        wider than captured: those stay fp32, as autocast's fp32 ops return them, so a sum of
        many fp16 values does not overflow on the way out."""
        position = iter(range(len(output_values(output))))

        def restore(value: fx.Node) -> fx.Node:
            is_result = next(position) < self.user_outputs
            orig = captured_dtype(value)
            current = dtype_after_amp(value)
            if orig is None or current == orig or isinstance(orig, tuple):
                return value
            if is_result and orig in LOW_PRECISION_DTYPES and current == torch.float32:
                return value
            return self.cast(value, orig, output)

        output.args = tuple(_map_nodes(a, restore) for a in output.args)


def _widen_inner_cast(node: fx.Node) -> None:
    """A composite op's own cast back to its input's precision (rms_norm's CPU kernel computes
    in fp32 and casts back) follows the input the whole op sees: when the op's pieces were
    widened to fp32, so is the cast, and it becomes a plain dtype cast that fold_cast_chains
    removes."""
    src = node.args[0] if node.args else None
    if node.target is not aten._to_copy.default or not isinstance(src, fx.Node):
        return
    if not (
        node.kwargs.get("dtype") in (torch.float16, torch.bfloat16)
        and src.meta.get("amp_widen")
        and src.meta.get("part_of") == node.meta["part_of"]
        and dtype_after_amp(src) == torch.float32
    ):
        return
    val = src.meta.get("val")
    same_place = {"layout": torch.strided, "device": getattr(val, "device", None)}
    node.kwargs = {k: v for k, v in node.kwargs.items() if same_place.get(k, object()) != v}
    node.kwargs = {**node.kwargs, "dtype": torch.float32}
    node.meta["amp_dtype"] = torch.float32


def _positions(node: fx.Node):
    """(argument position, value) for every node among the arguments (lists flattened)."""
    for i, a in enumerate(node.args):
        for value in _nodes_in(a):
            yield i, value
    for k, a in node.kwargs.items():
        for value in _nodes_in(a):
            yield k, value


def _nodes_in(arg: Any):
    if isinstance(arg, fx.Node):
        yield arg
    elif isinstance(arg, (list, tuple)):
        for a in arg:
            yield from _nodes_in(a)


def _map_positions(arg: Any, position: Any, swap: dict) -> Any:
    return _map_nodes(arg, lambda v: swap.get((v, position), v))


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
