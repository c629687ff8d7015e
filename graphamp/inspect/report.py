"""The precision report and the debug log: which op runs in which precision, and why."""

from __future__ import annotations

import csv
import io
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from ..records.amp import FINER_COLOURS
from ..records.spec import AutocastTrace, Program
from ..records.subgraphs import Subgraph, subgraph_of
from ..records.validate import dtype_name
from ..torchkit.fxutil import dtype_after_amp, is_compute_node, module_path, op_name
from .compare import compare

log = logging.getLogger("graphamp")
COLUMNS = ("node", "op", "module", "source", "list", "colour", "dtype", "why", "recomputed")
_LEVELS = {0: logging.WARNING, 1: logging.INFO, 2: logging.INFO, 3: logging.DEBUG}


def configure_logging(v_level: int) -> None:
    """Route graphamp's log to stderr at the level g.debug(v_level) asks for."""
    log.setLevel(_LEVELS[v_level])
    if v_level > 0 and not any(getattr(h, "_graphamp", False) for h in log.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[graphamp] %(message)s"))
        handler._graphamp = True  # type: ignore[attr-defined]
        log.addHandler(handler)


def _short_dtype(dtype: Any) -> str:
    if isinstance(dtype, tuple):
        dtype = next((d for d in dtype if d is not None), None)
    return "" if dtype is None else dtype_name(dtype)


def _source(node: fx.Node) -> str:
    frame = node.meta.get("user_frame")
    return frame.short() if frame is not None else ""


@dataclass
class PrecisionReport:
    """One row per compute op of the forward graph, plus the counts that summarise it."""

    rows: list[dict[str, str]]
    dtype: str
    casts: int
    parameter_copies: int  # parameters cast once at the start of the step (hoisted casts)
    ops_low: int
    ops_total: int
    unknown_ops: dict[str, int]
    autocast: dict[str, int] | None = None
    timings: dict[str, float] = field(default_factory=dict)
    recomputed_regions: tuple[str, ...] = ()  # activation checkpointing's regions
    # ops finer than the AMP dtype, by colour (records.amp.FINER_COLOURS; counted in ops_low)
    ops_finer: dict[str, int] = field(default_factory=dict)
    # node -> (low-precision ms, fp32 ms): ops kept fp32 where fp32 measured faster
    # (passes/fp32_where_faster.py)
    kept_fp32_where_faster: dict[str, tuple[float, float]] = field(default_factory=dict)
    # node -> (low-precision kernel ms, fp32 kernel ms, matmuls ms): attention written as
    # low-precision matmuls around an fp32 softmax where that measured fastest
    matmul_attention: dict[str, tuple[float, float, float]] = field(default_factory=dict)

    def summary(self) -> str:
        text = (
            f"converted {self.ops_low}/{self.ops_total} ops to {self.dtype} with {self.casts} casts"
        )
        for colour, n in self.ops_finer.items():
            text += f", {n} of them {FINER_COLOURS[colour]}"
        if self.parameter_copies:
            text += (
                f" (+{self.parameter_copies} low-precision parameter copies made at the "
                "start of the step)"
            )
        if self.kept_fp32_where_faster:
            low = sum(t[0] for t in self.kept_fp32_where_faster.values())
            fp32 = sum(t[1] for t in self.kept_fp32_where_faster.values())
            text += (
                f"; {self._kept_fp32_kinds()} kept fp32, faster there on this "
                f"machine ({fp32:.2f} ms against {low:.2f} ms in {self.dtype}, timed)"
            )
        if self.matmul_attention:
            text += "; " + _matmul_attention_words(self.matmul_attention, self.dtype)
        if self.unknown_ops:
            names = ", ".join(sorted(self.unknown_ops))
            n = sum(self.unknown_ops.values())
            text += f"; {n} unknown op{'s' if n != 1 else ''} kept fp32: {names}"
        recomputed = sum(r["recomputed"] == "yes" for r in self.rows)
        if recomputed:
            text += (
                f"; {recomputed} ops recomputed in the backward "
                f"(activation checkpointing: {', '.join(self.recomputed_regions)})"
            )
        if self.autocast is not None:
            text += (
                f" (torch.autocast on the same forward: {self.autocast['ops_low']} ops "
                f"low precision, {self.autocast['casts']} casts)"
            )
        return text

    def _kept_fp32_kinds(self) -> str:
        """'2 attention ops and 36 matrix products': the ops fp32_where_faster kept, by kind."""
        ops = {r["node"]: r["op"] for r in self.rows}
        kinds = Counter(_timed_kind(ops.get(name, "")) for name in self.kept_fp32_where_faster)
        words = [
            f"{n} {kind}{'s' if n != 1 else ''}"
            for kind, n in sorted(kinds.items(), key=lambda kv: -kv[1])
        ]
        return " and ".join([", ".join(words[:-1]), words[-1]] if len(words) > 1 else words)

    def to_csv(self) -> str:
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(self.rows)
        return buf.getvalue()

    def __str__(self) -> str:
        widths = {
            c: min(max(len(c), *(len(r[c]) for r in self.rows)) if self.rows else len(c), 48)
            for c in COLUMNS
        }

        def line(r: dict) -> str:
            return "  ".join(str(r[c])[: widths[c]].ljust(widths[c]) for c in COLUMNS).rstrip()

        out = [line({c: c for c in COLUMNS})]
        out += [line(r) for r in self.rows]
        out.append(self.summary())
        return "\n".join(out)

    def __repr__(self) -> str:
        return f"PrecisionReport({self.summary()})"


def _timed_kind(op: str) -> str:
    """What fp32_where_faster timed, in words, by the op's name."""
    if "convolution" in op:
        return "convolution"
    if "attention" in op:
        return "attention op"
    return "matrix product"


def _matmul_attention_words(timings: dict[str, tuple[float, float, float]], dtype: Any) -> str:
    """The summary's clause on attention written as matmuls, with the summed timings."""
    n = len(timings)
    low, fp32, matmuls = (sum(t[i] for t in timings.values()) for i in range(3))
    return (
        f"{n} attention op{'s' if n != 1 else ''} written as {_short_dtype(dtype)} matmuls "
        f"around an fp32 softmax, faster there on this machine ({matmuls:.2f} ms against "
        f"{low:.2f} ms for the {_short_dtype(dtype)} kernel and {fp32:.2f} ms for the fp32 "
        "one, timed)"
    )


def report_rows(
    gm: fx.GraphModule, recomputed: frozenset[str] = frozenset()
) -> list[dict[str, str]]:
    """One row per compute op; ``recomputed`` names the forward nodes the step recomputes."""
    rows = []
    for node in gm.graph.nodes:
        if not is_compute_node(node):
            continue
        colour = node.meta.get("amp_colour")
        if colour is None and "amp_list" not in node.meta:
            colour = "fp32"  # AMP off: everything as captured
        rows.append(
            {
                "node": node.name,
                "op": op_name(node),
                "module": module_path(node),
                "source": _source(node),
                "list": str(node.meta.get("amp_list", "")),
                "colour": str(colour or "n/a"),
                "dtype": _short_dtype(dtype_after_amp(node)),
                "why": str(node.meta.get("amp_reason", "AMP off")),
                "recomputed": "yes" if node.name in recomputed else "",
            }
        )
    return rows


def autocast_counts(program: Program, trace: AutocastTrace) -> dict[str, int]:
    """Autocast's op and cast counts on the program's forward, and how often it agrees."""
    cmp = compare(program.forward, trace)
    return {
        "ops_low": trace.ops_low,
        "ops": len(trace.ops),
        "casts": trace.casts,
        "agree": sum(p.agrees for p in cmp.pairs),
        "compared": len(cmp.pairs),
    }


def precision_report(program: Program, trace: AutocastTrace | None = None) -> PrecisionReport:
    """The report for ``program``'s forward; with ``trace`` (the autocast oracle's run on the
    same forward), autocast's counts beside graphamp's."""
    amp = program.amp
    copies = []  # a step without checkpointing need not be read (a restart's may not be loaded)
    if program.plan.recomputes:
        copies = [n for n in program.step_gm.graph.nodes if subgraph_of(n) == Subgraph.RECOMPUTE]
    rows = report_rows(program.forward, frozenset(n.meta.get("fwd_node") for n in copies))
    regions = {n.meta.get("recompute_region", "") for n in copies}
    return PrecisionReport(
        rows=rows,
        dtype=_short_dtype(amp.dtype) if amp is not None else "fp32",
        casts=amp.stats.get("casts", 0) if amp else 0,
        parameter_copies=len(amp.hoisted) if amp else 0,
        ops_low=sum(r["colour"] in ("allow", *FINER_COLOURS) for r in rows),
        ops_total=sum(r["colour"] in ("allow", "deny", "fp32", *FINER_COLOURS) for r in rows),
        ops_finer=_finer_counts(rows),
        kept_fp32_where_faster=dict(amp.kept_fp32_timings) if amp else {},
        matmul_attention=dict(amp.matmul_attention_timings) if amp else {},
        unknown_ops=dict(amp.unknown_ops) if amp else {},
        autocast=autocast_counts(program, trace) if trace is not None else None,
        timings=dict(program.timings),
        recomputed_regions=tuple(sorted(r for r in regions if r)),
    )


def _finer_counts(rows: list[dict[str, str]]) -> dict[str, int]:
    counts = {c: sum(r["colour"] == c for r in rows) for c in FINER_COLOURS}
    return {c: n for c, n in counts.items() if n}


def log_program_summary(program: Program) -> None:
    spec = program.spec
    timing = ", ".join(f"{k} {v:.2f}s" for k, v in program.timings.items())
    if program.amp is not None:
        log.info("%s: %s", spec.name, precision_report(program).summary())
        if spec.debug_level >= 3:
            _log_decisions(program.forward)
    log.info(
        "%s: captured and compiled (%s) with backend %s%s",
        spec.name,
        timing,
        spec.config.backend,
        ", replayed as a CUDA graph" if program.runner.uses_cuda_graph else "",
    )


def _log_decisions(forward: fx.GraphModule) -> None:
    for node in forward.graph.nodes:
        if is_compute_node(node) and "amp_colour" in node.meta:
            frame = node.meta.get("user_frame")
            log.debug(
                "  %-28s %-28s %-6s %-6s %s  [%s]",
                node.name,
                op_name(node),
                node.meta.get("amp_colour"),
                _short_dtype(dtype_after_amp(node)),
                node.meta.get("amp_reason", ""),
                f"{os.path.basename(frame.filename)}:{frame.lineno}: {frame.code}" if frame else "",
            )
