"""print(graph): a tree in the spirit of OneFlow's nn.Graph repr.

    (GRAPH:TrainGraph:TrainGraph): (
      (CONFIG:GraphConfig(amp=torch.float16 O1, backend='inductor', ...))
      (INPUT:in_x:tensor(size=(128, 256), dtype=torch.float32))
      (MODULE:model:Sequential()): (
        (MODULE:model.0:Linear(in_features=256, out_features=128, bias=True)): (
          (PARAMETER:model.0.weight:tensor(size=(128, 256), dtype=torch.float32, requires_grad=True))
          (OPERATOR: addmm(p_model_0_bias_float16:float16[128], ...) -> (addmm:float16[128, 128]), allow)
        )
      )
      (OPTIMIZER:0:SGD(lr=0.001, ...))
      (GRAD_SCALER:GradScaler(...)): (
        (OPERATOR: ...)
      )
      (OUTPUT: ...)
    )

Operators appear after the first call, under the module that produced them, with the dtype and
shape of every input and output after AMP and their colour.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from ..records.spec import GraphSpec, Program
from ..records.subgraphs import Subgraph, subgraph_of
from ..records.update_paths import path_of
from ..records.validate import dtype_name
from ..torchkit.fxutil import dtype_after_amp, is_compute_node, op_name

INDENT = "  "


def _short(dtype: Any) -> str:
    return dtype_name(dtype) if dtype is not None else "?"


def value_text(node: fx.Node) -> str:
    """``name:dtype[shape]`` for a value, with the dtype it has after the AMP passes."""
    val = node.meta.get("val")  # casts and shadows carry their source's value: shape and strides
    dtype = dtype_after_amp(node)
    if isinstance(val, torch.Tensor):
        if isinstance(dtype, tuple):
            dtype = dtype[0]
        return f"{node.name}:{_short(dtype if dtype is not None else val.dtype)}{list(val.shape)}"
    if isinstance(val, (tuple, list)):
        return f"{node.name}:tuple[{len(val)}]"
    return node.name


def operator_line(node: fx.Node) -> str:
    ins = ", ".join(value_text(a) for a in node.all_input_nodes)
    colour = node.meta.get("amp_colour") or "fp32"
    return (
        f"(OPERATOR: {op_name(node).replace('aten.', '')}({ins}) -> ({value_text(node)}), {colour})"
    )


def _tensor_text(t: torch.Tensor) -> str:
    grad = ", requires_grad=True" if t.requires_grad else ""
    device = f"device='{t.device}', " if t.device.type != "cpu" else ""
    return f"tensor({device}size={tuple(t.shape)}, dtype={t.dtype}{grad})"


def graph_repr(spec: GraphSpec, config_repr: str, program: Program | None) -> str:
    """The tree for a Graph: registration from ``spec``, operators from the last ``program``."""
    name = spec.name
    lines = [f"(GRAPH:{name}:{name}): (", f"{INDENT}(CONFIG:{config_repr})"]
    by_module: dict[str, list[fx.Node]] = {}
    loose: list[fx.Node] = []
    if program is not None:
        lines += _group_operators(program.forward, by_module, loose)
    for attr, module in spec.modules:
        lines += _module_lines(attr, module, by_module, 1)
    lines += [f"{INDENT}{operator_line(node)}" for node in loose]
    lines += _optimizer_lines(spec)
    lines += _scaler_lines(spec, program)
    if program is not None:
        out = next(n for n in program.forward.graph.nodes if n.op == "output")
        outs = [value_text(n) for n in out.all_input_nodes][: program.captured.num_user_outputs]
        lines.append(f"{INDENT}(OUTPUT:{', '.join(outs)})")
    lines.append(")")
    return "\n".join(lines)


def _group_operators(
    forward: fx.GraphModule, by_module: dict[str, list[fx.Node]], loose: list[fx.Node]
) -> list[str]:
    """INPUT lines; compute nodes sorted into ``by_module`` (innermost module) or ``loose``."""
    inputs = []
    for node in forward.graph.nodes:
        if node.op == "placeholder" and node.name.startswith("in_"):
            inputs.append(f"{INDENT}(INPUT:{value_text(node)})")
        if not is_compute_node(node):
            continue
        stack = node.meta.get("nn_module_stack") or {}
        path = list(stack)[-1] if stack else ""
        (by_module.setdefault(path, []) if path else loose).append(node)
    return inputs


def _optimizer_lines(spec: GraphSpec) -> list[str]:
    lines = []
    for i, slot in enumerate(spec.optimizers):
        opt = slot.optimizer
        group = opt.param_groups[0]
        hyper = ", ".join(
            f"{k}={group[k]}" for k in ("lr", "momentum", "betas", "weight_decay") if k in group
        )
        clip = f", clip_grad_max_norm={slot.clip_max_norm}" if slot.clip_max_norm else ""
        path = path_of(opt, slot.eager).describe(opt, slot.eager)
        lines.append(
            f"{INDENT}(OPTIMIZER:{i}:{type(opt).__name__}({hyper}, "
            f"param_groups={len(opt.param_groups)}{clip}): {path})"
        )
    return lines


def _scaler_lines(spec: GraphSpec, program: Program | None) -> list[str]:
    scaler = spec.scaler
    if scaler is None:
        return []
    nodes = []
    if program is not None:
        nodes = [
            n
            for n in program.step_gm.graph.nodes
            if n.op == "call_function" and subgraph_of(n) == Subgraph.GRAD_SCALER
        ]
    if not nodes:
        return [f"{INDENT}(GRAD_SCALER:{scaler!r})"]
    return (
        [f"{INDENT}(GRAD_SCALER:{scaler!r}): ("]
        + [f"{INDENT * 2}{operator_line(n)}" for n in nodes]
        + [f"{INDENT})"]
    )


def _module_lines(
    path: str, module: torch.nn.Module, ops: dict[str, list[fx.Node]], depth: int
) -> list[str]:
    pad = INDENT * depth
    extra = module.extra_repr()
    head = f"{pad}(MODULE:{path}:{type(module).__name__}({extra}))"
    body = []
    for pname, p in module.named_parameters(recurse=False):
        body.append(f"{pad}{INDENT}(PARAMETER:{path}.{pname}:{_tensor_text(p)})")
    for bname, b in module.named_buffers(recurse=False):
        if b is not None:
            body.append(f"{pad}{INDENT}(BUFFER:{path}.{bname}:{_tensor_text(b)})")
    for cname, child in module.named_children():
        body += _module_lines(f"{path}.{cname}", child, ops, depth + 1)
    body += [f"{pad}{INDENT}{operator_line(n)}" for n in ops.get(path, [])]
    if not body:
        return [head]
    return [head + ": ("] + body + [f"{pad})"]
