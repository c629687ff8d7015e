"""Inspection: what a built step looks like and why, read from the records only.

``report`` (the precision report and the debug log), ``printing`` (``print(g)``), ``dump``
(per-pass graphs, CSV, pictures, report.html), ``picture`` (DOT and SVG), ``compare`` (graphamp
against the autocast oracle, op by op), ``plot`` (training history as a PNG).
"""
