"""The forward graph as a picture: DOT (nodes filled by colour, clustered by module) and SVG.

Graphviz renders the DOT file when its ``dot`` program is installed. Without it graphamp draws
the SVG itself: nodes in layers by longest path from the inputs (networkx), edges as lines,
each node titled with its op, module, dtype and the reason for its precision.
"""

from __future__ import annotations

import html
import shutil
import subprocess
from collections import defaultdict

import networkx as nx
import torch.fx as fx

from ..records.validate import dtype_name
from ..torchkit.fxutil import dtype_after_amp, module_path, op_name

FILL = {  # allow / deny / infer-or-clear decided either way / cast / grad-scaler subgraph
    "allow": "#8fd18f",  # low precision
    "deny": "#f29b8f",  # fp32
    "cast": "#f7d46b",
    "fixed": "#c8c8c8",
    "input": "#ffffff",
    "output": "#ffffff",
    "grad_scaler": "#9cc3f0",
    None: "#e8e8e8",
}
LEGEND = [
    ("allow: low precision", FILL["allow"]),
    ("deny: fp32", FILL["deny"]),
    ("cast / parameter copy", FILL["cast"]),
    ("dtype fixed by the op", FILL["fixed"]),
    ("no floating-point data", FILL[None]),
]


def _kind(node: fx.Node) -> str | None:
    if node.op == "placeholder":
        return "cast" if node.meta.get("shadow_of") else "input"
    if node.op == "output":
        return "output"
    return node.meta.get("amp_colour")


def _label(node: fx.Node) -> str:
    dtype = dtype_after_amp(node)
    if isinstance(dtype, tuple):
        dtype = dtype[0]
    dtype = dtype_name(dtype) if dtype is not None else ""
    name = node.name if node.op != "call_function" else op_name(node).replace("aten.", "")
    return f"{name}\\n{dtype}" if dtype else name


def _tooltip(node: fx.Node) -> str:
    parts = [node.name, op_name(node) if node.op == "call_function" else node.op]
    if module_path(node):
        parts.append(f"module {module_path(node)}")
    if node.meta.get("amp_reason"):
        parts.append(str(node.meta["amp_reason"]))
    frame = node.meta.get("user_frame")
    if frame is not None:
        parts.append(frame.short())
    return " | ".join(parts)


def to_dot(gm: fx.GraphModule, title: str) -> str:
    lines = [
        f'digraph "{title}" {{',
        '  rankdir=TB; node [shape=box, style="rounded,filled", '
        'fontname="Helvetica", fontsize=10];',
    ]
    clusters: dict[str, list[fx.Node]] = defaultdict(list)
    for node in gm.graph.nodes:
        clusters[module_path(node) if node.op == "call_function" else ""].append(node)
    for i, (path, nodes) in enumerate(clusters.items()):
        indent = "  "
        if path:
            lines.append(
                f'  subgraph cluster_{i} {{ label="{path}"; style=dashed; color="#999999";'
            )
            indent = "    "
        for node in nodes:
            fill = FILL.get(_kind(node), FILL[None])
            label = _label(node).replace('"', "'")
            tip = _tooltip(node).replace('"', "'")
            lines.append(
                f'{indent}"{node.name}" [label="{label}", fillcolor="{fill}", tooltip="{tip}"];'
            )
        if path:
            lines.append("  }")
    for node in gm.graph.nodes:
        for src in node.all_input_nodes:
            lines.append(f'  "{src.name}" -> "{node.name}";')
    lines.append("}")
    return "\n".join(lines)


def dot_to_svg(dot: str) -> str | None:
    exe = shutil.which("dot")
    if exe is None:
        return None
    try:
        done = subprocess.run(
            [exe, "-Tsvg"], input=dot, capture_output=True, text=True, timeout=120, check=True
        )
    except (subprocess.SubprocessError, OSError):
        return None
    return done.stdout


def layered_svg(gm: fx.GraphModule, max_nodes: int = 4000) -> str:
    """graphamp's own drawing: a layered layout without Graphviz."""
    g = nx.DiGraph()
    nodes = list(gm.graph.nodes)[:max_nodes]
    keep = set(nodes)
    g.add_nodes_from(nodes)
    g.add_edges_from((s, n) for n in nodes for s in n.all_input_nodes if s in keep)
    layer: dict[fx.Node, int] = {}
    for node in nx.topological_sort(g):
        layer[node] = 1 + max((layer[p] for p in g.predecessors(node)), default=-1)
    rows: dict[int, list[fx.Node]] = defaultdict(list)
    for node, depth in layer.items():
        rows[depth].append(node)
    box_w, box_h, gap_x, gap_y = 150, 34, 16, 30
    width = max(len(r) for r in rows.values()) * (box_w + gap_x) + gap_x
    height = (max(rows) + 1) * (box_h + gap_y) + gap_y
    pos = {}
    for depth, row in rows.items():
        offset = (width - len(row) * (box_w + gap_x)) / 2
        for i, node in enumerate(row):
            pos[node] = (offset + i * (box_w + gap_x) + gap_x / 2, gap_y + depth * (box_h + gap_y))
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="Helvetica" font-size="10">'
    ]
    for src, dst in g.edges:
        (x1, y1), (x2, y2) = pos[src], pos[dst]
        out.append(
            f'<line x1="{x1 + box_w / 2:.0f}" y1="{y1 + box_h:.0f}" '
            f'x2="{x2 + box_w / 2:.0f}" y2="{y2:.0f}" stroke="#999" stroke-width="0.8"/>'
        )
    for node, (x, y) in pos.items():
        fill = FILL.get(_kind(node), FILL[None])
        first, _, second = _label(node).partition("\\n")
        out.append(
            f"<g><title>{html.escape(_tooltip(node))}</title>"
            f'<rect x="{x:.0f}" y="{y:.0f}" width="{box_w}" height="{box_h}" rx="6" '
            f'fill="{fill}" stroke="#555"/>'
            f'<text x="{x + box_w / 2:.0f}" y="{y + 14:.0f}" text-anchor="middle">'
            f"{html.escape(first[:24])}</text>"
            f'<text x="{x + box_w / 2:.0f}" y="{y + 27:.0f}" text-anchor="middle" '
            f'fill="#444">{html.escape(second)}</text></g>'
        )
    out.append("</svg>")
    return "\n".join(out)
