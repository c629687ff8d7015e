"""Overflow forensics on the host: the analysis of the device's overflow record, the reports
users read, and autofix (``config.enable_amp_autofix``), which pins what keeps overflowing.

The records these read (probes, ``OverflowEvent``) are in ``records/probes.py``; the subgraph
that measures the probes inside the step is ``step/components/overflow_probes.py``.
"""

from .analysis import analyse
from .autofix import Autofix
from .device_record import ForensicsState
from .reports import OverflowReport, RangeReport, RangeRow, range_rows

__all__ = [
    "Autofix",
    "ForensicsState",
    "OverflowReport",
    "RangeReport",
    "RangeRow",
    "analyse",
    "range_rows",
]
