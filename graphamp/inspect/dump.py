"""g.dump(path): everything a person needs to see which op runs in which precision, and why.

00_captured.py ... 05_fold_cast_chains.py   the forward graph after capture and each pass
06_step.py                                    the assembled training step (what is compiled)
precision.csv                                 the precision report, one row per compute op
graph.dot / graph.svg                         the forward graph, coloured, clustered by module
report.html                                   one self-contained page: summary, table, picture
                                              (and, with overflow tracing, the overflows and
                                              the tightest headroom)
summary.json                                  the counts and timings
overflows.txt, ranges.csv                     with overflow tracing: g.overflow_report() and
                                              g.range_report()
"""

from __future__ import annotations

import csv
import html
import io
import json
import os

from ..forensics.reports import OverflowReport, RangeReport, RangeRow
from ..records.spec import Program
from .picture import LEGEND, dot_to_svg, layered_svg, to_dot
from .report import COLUMNS, PrecisionReport

RANGE_COLUMNS = ("node", "op", "module", "dtype", "activation_amax", "gradient_amax", "headroom")


def dump_program(
    program: Program,
    report: PrecisionReport,
    path: str,
    overflows: OverflowReport | None = None,
    ranges: RangeReport | None = None,
) -> str:
    """Write the files listed above for ``program`` under ``path``; returns its absolute path."""
    os.makedirs(path, exist_ok=True)
    name = program.spec.name
    records = program.pass_records
    for i, record in enumerate(records):
        header = (
            f"# {name}: forward graph after {record.name} "
            f"({record.seconds * 1e3:.1f} ms{'' if record.modified else ', no change'})\n"
        )
        _write(path, f"{i:02d}_{record.name}.py", header + record.code)
    _write(
        path,
        f"{len(records):02d}_step.py",
        f"# {name}: the whole training step as compiled\n" + program.step_gm.code,
    )
    _write(path, "precision.csv", report.to_csv())
    dot = to_dot(program.forward, name)
    _write(path, "graph.dot", dot)
    svg = dot_to_svg(dot)
    drawn_by = "Graphviz"
    if svg is None:
        svg, drawn_by = layered_svg(program.forward), "graphamp (Graphviz not installed)"
    _write(path, "graph.svg", svg)
    summary = {
        "graph": name,
        "summary": report.summary(),
        "casts": report.casts,
        "parameter_copies": report.parameter_copies,
        "ops_low": report.ops_low,
        "ops_total": report.ops_total,
        "unknown_ops": report.unknown_ops,
        "autocast": report.autocast,
        "timings_s": program.timings,
        "passes": [
            {"name": r.name, "ms": r.seconds * 1e3, "modified": r.modified} for r in records
        ],
    }
    _write(path, "summary.json", json.dumps(summary, indent=2, default=str))
    forensics = ""
    if overflows is not None and ranges is not None:
        _write(path, "overflows.txt", str(overflows) + "\n")
        _write(path, "ranges.csv", _ranges_csv(ranges.rows))
        forensics = _forensics_html(overflows, ranges)
    _write(path, "report.html", _html(name, report, svg, drawn_by, summary, forensics))
    return os.path.abspath(path)


def _ranges_csv(rows: list[RangeRow]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(RANGE_COLUMNS)
    for r in rows:
        writer.writerow(
            [
                r.node,
                r.op,
                r.module,
                r.dtype,
                f"{r.activation_amax:.6g}",
                f"{r.gradient_amax:.6g}",
                f"{r.headroom:.6g}",
            ]
        )
    return buf.getvalue()


def _forensics_html(overflows: OverflowReport, ranges: RangeReport) -> str:
    """The overflow section: the last overflows as the report words them, and the values with
    the least headroom against their dtype."""
    events = (
        "".join(
            f'<pre class="overflow">{html.escape(e.describe())}</pre>'
            for e in overflows.events[-10:]
        )
        or "<p>No overflowing step recorded.</p>"
    )
    head = "".join(f"<th>{c}</th>" for c in RANGE_COLUMNS)
    body = "\n".join(
        "<tr>"
        + "".join(
            f"<td>{html.escape(v)}</td>"
            for v in (
                r.node,
                r.op,
                r.module,
                r.dtype,
                f"{r.activation_amax:.4g}",
                f"{r.gradient_amax:.4g}",
                f"{r.headroom:.3g}",
            )
        )
        + "</tr>"
        for r in ranges.tightest(30)
    )
    return f"""<h2>Overflow forensics</h2>
<div class="summary"><b>{html.escape(str(overflows).splitlines()[0])}</b></div>
{events}
<h2>Headroom (tightest {min(30, len(ranges.rows))} of {len(ranges.rows)} low-precision values)</h2>
<table><thead><tr>{head}</tr></thead><tbody>
{body}
</tbody></table>
"""


def _write(path: str, filename: str, text: str) -> None:
    with open(os.path.join(path, filename), "w", encoding="utf-8") as f:
        f.write(text)


def _html(name: str, report, svg: str, drawn_by: str, summary: dict, forensics: str) -> str:
    head = "".join(f'<th onclick="sortBy({i})">{c}</th>' for i, c in enumerate(COLUMNS))
    body = "\n".join(
        f'<tr class="{html.escape(r["colour"])}">'
        + "".join(f"<td>{html.escape(str(r[c]))}</td>" for c in COLUMNS)
        + "</tr>"
        for r in report.rows
    )
    legend = "".join(
        f'<span class="key" style="background:{c}">{html.escape(t)}</span>' for t, c in LEGEND
    )
    passes = ", ".join(f"{p['name']} {p['ms']:.1f} ms" for p in summary["passes"])
    timings = ", ".join(f"{k} {v:.2f} s" for k, v in summary["timings_s"].items())
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>graphamp report: {html.escape(name)}</title>
<style>
body {{ font-family: Helvetica, Arial, sans-serif; margin: 24px; color: #222; }}
h1 {{ font-size: 20px; }} h2 {{ font-size: 16px; margin-top: 28px; }}
.summary {{ background: #f5f7fa; padding: 12px 16px; border-radius: 6px; }}
table {{ border-collapse: collapse; font-size: 12px; width: 100%; }}
th, td {{ border-bottom: 1px solid #ddd; padding: 3px 6px; text-align: left; }}
th {{ cursor: pointer; background: #eef; position: sticky; top: 0; }}
tr.allow td:nth-child(6) {{ background: #8fd18f; }} tr.deny td:nth-child(6) {{ background: #f29b8f; }}
tr.cast td:nth-child(6) {{ background: #f7d46b; }}
.key {{ display: inline-block; padding: 2px 8px; margin-right: 8px; border-radius: 4px;
        border: 1px solid #999; font-size: 12px; }}
.picture {{ overflow: auto; max-height: 900px; border: 1px solid #ccc; }}
input {{ margin: 8px 0; padding: 4px; width: 320px; }}
pre.overflow {{ background: #fdecea; padding: 8px 12px; border-radius: 6px; white-space: pre-wrap; }}
</style></head><body>
<h1>graphamp precision report: {html.escape(name)}</h1>
<div class="summary"><b>{html.escape(report.summary())}</b><br>
Passes: {html.escape(passes)}<br>First call: {html.escape(timings)}</div>
{forensics}
<h2>Operators ({len(report.rows)})</h2>
<input id="filter" placeholder="filter: op, module, colour, reason ..." oninput="filterRows()">
<table id="ops"><thead><tr>{head}</tr></thead><tbody>
{body}
</tbody></table>
<h2>Forward graph after the AMP passes</h2>
<div>{legend} <small>drawn by {html.escape(drawn_by)}; hover a node for its reason</small></div>
<div class="picture">{svg}</div>
<script>
function filterRows() {{
  const q = document.getElementById('filter').value.toLowerCase();
  for (const tr of document.querySelectorAll('#ops tbody tr'))
    tr.style.display = tr.textContent.toLowerCase().includes(q) ? '' : 'none';
}}
let order = 1;
function sortBy(col) {{
  const tbody = document.querySelector('#ops tbody');
  const rows = Array.from(tbody.rows);
  order = -order;
  rows.sort((a, b) => a.cells[col].textContent.localeCompare(b.cells[col].textContent,
                                                            undefined, {{numeric: true}}) * order);
  rows.forEach(r => tbody.appendChild(r));
}}
</script></body></html>
"""
