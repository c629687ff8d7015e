"""Training plots from the history graphamp keeps on the device: loss, loss scale, skipped steps;
and, with overflow tracing, the headroom of each low-precision value against its dtype's range.

    g.history.fetch()                        -> the rows
    graphamp.inspect.plot.plot_history(g, "run.png") -> a PNG (needs the optional extra: pip install graphamp[plot])
    python -m graphamp plot state.pt --out run.png   (state.pt: torch.save(g.state_dict(), ...))
    graphamp.inspect.plot.plot_headroom(g, "headroom.png"), or
    python -m graphamp plot state.pt --headroom --out headroom.png
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import ConfigError
from ..forensics.reports import RangeReport, RangeRow
from ..records.history import TrainingHistory


def _rows(source: Any) -> dict[str, list[float]]:
    if hasattr(source, "history") and hasattr(source.history, "fetch"):
        return source.history.fetch()  # a Graph
    if hasattr(source, "fetch"):
        return source.fetch()  # a TrainingHistory
    if isinstance(source, dict) and "history" in source:  # a Graph state dict
        source = source["history"]
    if isinstance(source, dict) and "table" in source:
        history = TrainingHistory(max(1, int(torch.as_tensor(source["table"]).shape[0])))
        history.load_state_dict(source)
        history.materialize(torch.device("cpu"))
        return history.fetch()
    if isinstance(source, dict) and "step" in source and isinstance(source["step"], list):
        return source
    raise ConfigError("plot_history takes a Graph, its history, its state_dict() or fetched rows")


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("plotting needs matplotlib: pip install 'graphamp[plot]'") from e
    return plt


def plot_history(source: Any, path: str, title: str = "graphamp training") -> str:
    """Draw loss, loss scale (log axis) and skipped steps over training; save a PNG at ``path``."""
    plt = _pyplot()
    rows = _rows(source)
    if not rows["step"]:
        raise ConfigError("the history is empty: train the graph for a step first")
    steps = rows["step"]
    fig, (ax_loss, ax_scale) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax_loss.plot(steps, rows["loss"], lw=1.2, color="#1f77b4", label="loss")
    ax_loss.set_ylabel("loss")
    skipped = [s for s, k in zip(steps, rows["skipped"]) if k > 0]
    for s in skipped:
        ax_loss.axvline(s, color="#d62728", alpha=0.25, lw=1)
    if any(not math.isnan(v) for v in rows["grad_norm"]):
        ax_norm = ax_loss.twinx()
        ax_norm.plot(steps, rows["grad_norm"], lw=0.8, color="#7f7f7f", label="grad norm")
        ax_norm.set_ylabel("grad norm")
    ax_scale.step(steps, rows["scale"], where="post", color="#2ca02c", label="loss scale")
    ax_scale.set_yscale("log", base=2)
    ax_scale.set_ylabel("loss scale")
    ax_scale.set_xlabel("step")
    ax_scale.scatter(
        skipped,
        [rows["scale"][steps.index(s)] for s in skipped],
        color="#d62728",
        s=12,
        zorder=3,
        label=f"skipped ({len(skipped)})",
    )
    ax_scale.legend(loc="best")
    ax_loss.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _range_rows(source: Any) -> list[RangeRow]:
    if hasattr(source, "range_report"):
        source = source.range_report()  # a Graph
    if isinstance(source, RangeReport):
        return source.rows
    if isinstance(source, dict) and "ranges" in source:  # a Graph state dict
        return [RangeRow(**row) for row in source["ranges"]]
    raise ConfigError("plot_headroom takes a Graph, its range_report() or its state_dict()")


def plot_headroom(source: Any, path: str, title: str = "graphamp headroom", top: int = 40) -> str:
    """Bars of headroom (dtype max / largest magnitude so far, log axis) for the ``top``
    low-precision values with the least of it: values and gradients; 1 is an overflow."""
    plt = _pyplot()
    rows = sorted(_range_rows(source), key=lambda r: r.headroom)[:top]
    if not rows:
        raise ConfigError(
            "no ranges recorded: train a graph with "
            "config.enable_overflow_tracing() for a step first"
        )
    labels = [f"{r.node} ({r.op.replace('aten.', '')}) {r.module}"[:70] for r in rows]
    fig, ax = plt.subplots(figsize=(10, 0.28 * len(rows) + 1.5))
    y = range(len(rows))
    for offset, values, colour, name in (
        (-0.2, [r.activation_amax for r in rows], "#1f77b4", "value"),
        (0.2, [r.gradient_amax for r in rows], "#ff7f0e", "gradient (scaled)"),
    ):
        headroom = [r.dtype_max / v if v > 0 else math.nan for r, v in zip(rows, values)]
        ax.barh([i + offset for i in y], headroom, height=0.4, color=colour, label=name)
    ax.axvline(1.0, color="#d62728", lw=1.5, label="overflow")
    ax.set_xscale("log")
    ax.set_yticks(list(y), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("headroom: dtype max / largest magnitude so far")
    ax.set_title(title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_state_file(state_path: str, out: str, headroom: bool = False) -> str:
    """The CLI's plot command: a file saved with torch.save(g.state_dict()) (or a dict with it
    under 'graph'): the training history, or with ``headroom`` the ranges."""
    state = torch.load(state_path, weights_only=True)
    if "graph" in state and isinstance(state["graph"], dict):
        state = state["graph"]
    if headroom:
        return plot_headroom(state, out, title=f"graphamp headroom: {state_path}")
    return plot_history(state, out, title=f"graphamp training: {state_path}")
