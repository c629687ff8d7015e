"""The first call says what it is doing.

One INFO line per stage with its seconds and node counts; a progress line on a terminal while a
long compile runs (never on a non-terminal); ``config.set_progress(False)`` silences the line,
the logger's level the INFO lines.
"""

from __future__ import annotations

import io
import logging
import re
import sys
import threading
import time

import models
import pytest
import torch
import torch.nn as nn
from helpers import make_graph
from models import seed_mlp

from graphamp.backend import progress
from graphamp.backend.progress import CompileProgress

# the models here are tiny: outlined as a model whose blocks do enough work is by default
pytestmark = pytest.mark.usefixtures("outline_small_blocks")


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _graph(**kw):
    model = seed_mlp()
    return make_graph(
        model,
        nn.CrossEntropyLoss(),
        torch.optim.SGD(model.parameters(), lr=0.1),
        amp=torch.bfloat16,
        **kw,
    )


def _batch():
    return models.batches(1, 8, 256, 10, seed=0)[0]


def _stage_lines(caplog) -> dict[str, str]:
    lines = {}
    for record in caplog.records:
        m = re.fullmatch(r"TrainGraph: (\w+) (\d+\.\d\d) s(?: \((.*)\))?", record.getMessage())
        if m and record.levelno == logging.INFO:
            lines[m.group(1)] = m.group(3) or ""
    return lines


def test_each_stage_logs_one_info_line_with_its_node_counts(caplog):
    g = _graph()
    with caplog.at_level(logging.INFO, logger="graphamp"):
        g(*_batch())
    lines = _stage_lines(caplog)
    assert list(lines) == [
        "capture",
        "amp_passes",
        "plan",
        "examples",
        "step_cache",
        "assemble",
        "outline",
        "save_step",
        "compile",
    ]
    step = g.compiled_steps[-1]
    casts = sum(1 for n in step.forward_graph.graph.nodes if n.meta.get("amp_cast"))
    assert re.fullmatch(r"\d+ nodes", lines["capture"])
    assert lines["amp_passes"] == f"{step.forward_nodes} nodes, {casts} casts"
    assert lines["assemble"] == f"{step.step_nodes} nodes"
    # on by default; no two of this Sequential's children are equal: no blocks, the step is
    # unchanged
    assert lines["outline"] == (
        f"{step.step_nodes} nodes, 0 blocks, 0 distinct regions, 0 regions outlined"
    )
    assert lines["compile"] == f"{step.step_nodes} nodes, aot_eager"
    assert re.fullmatch(r"miss \([0-9a-f]{12}\)", lines["step_cache"])
    assert lines["save_step"] == "saved"
    # a steady call builds nothing and says nothing
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="graphamp"):
        g(*_batch())
    assert _stage_lines(caplog) == {}
    # the same step built again (as after a restart) is loaded: no assembly, no outlining
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="graphamp"):
        _graph()(*_batch())
    lines = _stage_lines(caplog)
    assert list(lines) == ["capture", "amp_passes", "plan", "examples", "step_cache", "compile"]
    assert re.fullmatch(rf"hit \([0-9a-f]{{12}}\): {step.step_nodes} nodes", lines["step_cache"])


def test_stage_lines_follow_the_logger_level(caplog):
    g = _graph()
    with caplog.at_level(logging.WARNING, logger="graphamp"):
        g(*_batch())
    assert _stage_lines(caplog) == {}


def _first_call_stderr(monkeypatch, stream, configure=None) -> str:
    monkeypatch.setattr(progress, "SHOW_AFTER_S", 0.0)  # every compile counts as long here
    monkeypatch.setattr(progress, "TICK_S", 0.01)
    monkeypatch.setattr(sys, "stderr", stream)
    g = _graph(configure=configure)
    g(*_batch())
    monkeypatch.undo()
    return stream.getvalue()


def test_progress_line_on_a_terminal(monkeypatch):
    text = _first_call_stderr(monkeypatch, FakeTerminal())
    assert "TrainGraph: compiling the step (" in text
    assert re.search(r"nodes, aot_eager\)  [|/\\-]  \d+ s", text)
    assert re.search(r"done in \d+\.\d s\n$", text)


def test_no_progress_line_on_a_non_terminal(monkeypatch):
    assert _first_call_stderr(monkeypatch, io.StringIO()) == ""


def test_set_progress_false_silences_the_line(monkeypatch):
    quiet = _first_call_stderr(
        monkeypatch, FakeTerminal(), configure=lambda g: g.config.set_progress(False)
    )
    assert quiet == ""


def test_set_progress_takes_a_bool():
    from graphamp.errors import ConfigError

    g = _graph()
    with pytest.raises(ConfigError, match="set_progress"):
        g.config.set_progress("no")


def test_a_short_compile_draws_nothing():
    stream = FakeTerminal()
    with CompileProgress("x: compiling", stream=stream, show_after=5.0, tick=0.01):
        time.sleep(0.05)
    assert stream.getvalue() == ""


def test_the_line_counts_seconds_and_ends_with_the_total():
    stream = FakeTerminal()
    with CompileProgress("x: compiling", stream=stream, show_after=0.0, tick=0.01):
        time.sleep(0.1)
    text = stream.getvalue()
    assert text.count("x: compiling  ") >= 3  # redrawn in place while the body ran
    assert "\r\x1b[K" in text
    assert re.search(r"x: compiling  done in 0\.\d s\n$", text)


def test_an_interrupted_compile_stops_the_line_and_raises():
    stream = FakeTerminal()
    with pytest.raises(KeyboardInterrupt):
        with CompileProgress("x: compiling", stream=stream, show_after=0.0, tick=0.01):
            time.sleep(0.05)
            raise KeyboardInterrupt
    assert stream.getvalue().endswith("x: compiling  stopped\n")
    assert not any(t.name == "graphamp-progress" for t in threading.enumerate())
