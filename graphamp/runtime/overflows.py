"""The host's side of overflow tracing around the steps: read each step's overflow record into
the graph's history, and hand what it finds to autofix."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ..forensics.reports import OverflowReport, RangeReport
from ..records.probes import OverflowEvent
from ..records.spec import Program

if TYPE_CHECKING:  # calls.py imports this module
    from .calls import GraphRuntime

log = logging.getLogger("graphamp")


def watch_overflows(run: GraphRuntime, program: Program) -> None:
    """Autofix and debug logging act on each overflow soon after it happens: poll the device's
    overflow count without waiting, and read the record (one sync) only when it moved. Without
    either, nothing is read until the user asks."""
    forensics = program.runner.forensics
    if forensics is None or (run.config.autofix is None and run.debug_level < 1):
        return
    # CUDA: the count as of the step before, if its copy has landed. Data parallel waits for
    # it: every rank must read (and pin) at the same call, or one rank would rebuild while the
    # others wait in the step's collectives
    count = forensics.poll(wait=program.plan.process_group is not None)
    forensics.start_poll()  # queue this step's count behind it (CUDA; no wait)
    if count is None or count <= forensics.analysed:
        return
    events = read_overflows(run, program)
    if program.spec.config.amp_pins == run.config.amp_pins:  # not a step built before a pin
        run.autofix.consider(run.name, events, run.config)


def read_overflows(run: GraphRuntime, program: Program) -> list[OverflowEvent]:
    """Analyse what ``program`` recorded since the last read (one sync) into the history."""
    if program.runner.forensics is None:  # traced without overflow tracing
        return []
    events, lost = program.runner.forensics.read_new()
    run.state.history.add_overflows(events, lost)
    for event in events:
        log.info("%s: overflow at %s", run.name, event.describe())
    return events


def range_report(run: GraphRuntime, forensics: Any) -> RangeReport:
    """The last step's ranges, every overflow read first (its values are marked)."""
    for program in run.programs.values():
        read_overflows(run, program)
    return RangeReport(run.name, forensics.range_rows(run.state.history.overflows))


def overflow_report(run: GraphRuntime) -> OverflowReport:
    """Every compiled step's record read, then the history's overflows as a report."""
    for program in run.programs.values():
        read_overflows(run, program)
    history = run.state.history
    return OverflowReport(
        run.name,
        len(history.overflows) + history.overflows_lost,
        list(history.overflows),
        history.overflows_lost,
    )
