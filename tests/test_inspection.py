"""print(g), debug levels, dumps, training plots, and the examples."""

from __future__ import annotations

import csv
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from helpers import make_graph
from models import SmallCNN, seed_mlp

import graphamp
from graphamp.inspect.picture import layered_svg, to_dot
from graphamp.inspect.plot import plot_history

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def mlp_graph():
    model = seed_mlp()
    g = make_graph(
        model,
        nn.CrossEntropyLoss(),
        torch.optim.SGD(model.parameters(), lr=1e-3),
        amp=torch.float16,
        scaler=graphamp.GradScaler(init_scale=3000),
    )
    return g


@pytest.fixture
def cnn_graph():
    model = SmallCNN()
    g = make_graph(
        model,
        nn.CrossEntropyLoss(),
        torch.optim.SGD(model.parameters(), lr=0.1),
        amp=torch.float16,
        scaler=graphamp.GradScaler(),
        clip=1.0,
    )
    g(torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,)))
    return g


def test_tree_before_and_after_the_first_call(mlp_graph):
    before = repr(mlp_graph)
    assert before.startswith("(GRAPH:TrainGraph:TrainGraph): (")
    assert "(MODULE:model:Sequential()): (" in before
    assert "(MODULE:model.0:Linear(in_features=256, out_features=128, bias=True)): (" in before
    assert (
        "(PARAMETER:model.0.weight:tensor(size=(128, 256), dtype=torch.float32, "
        "requires_grad=True))"
    ) in before
    assert "OPERATOR" not in before  # nothing captured yet
    mlp_graph(torch.randn(128, 256), torch.randint(0, 10, (128,)))
    after = repr(mlp_graph)
    assert "(INPUT:in_x:float32[128, 256])" in after
    lines = after.splitlines()
    addmm = next(ln for ln in lines if "OPERATOR: addmm(" in ln)
    assert addmm.endswith("-> (addmm:float16[128, 128]), allow)")
    # the operator sits under the module that produced it
    assert lines.index(addmm) > lines.index(next(ln for ln in lines if "(MODULE:model.0:" in ln))
    assert any("OPERATOR: _log_softmax(" in ln and ln.endswith("deny)") for ln in lines)
    assert any("OPERATOR: _to_copy(addmm_1:float16" in ln and ln.endswith("cast)") for ln in lines)
    block = after[after.index("(GRAD_SCALER:") :]
    assert "_amp_foreach_non_finite_check_and_unscale" in block
    assert "(OPTIMIZER:0:SGD(lr=0.001" in after and "(OUTPUT:" in after


def test_tree_of_a_cnn_shows_batchnorm_buffers_and_colours(cnn_graph):
    text = repr(cnn_graph)
    assert "(BUFFER:model.features.1.running_mean:tensor(size=(8,), dtype=torch.float32))" in text
    bn = next(ln for ln in text.splitlines() if "_native_batch_norm_legit_functional(" in ln)
    assert "p_model_features_1_weight:float32[8]" in bn and bn.endswith("allow)")
    assert "clip_grad_max_norm=1.0" in text


def test_debug_levels_log_what_they_promise(caplog):
    def run(level):
        caplog.clear()
        model = seed_mlp()
        g = make_graph(
            model,
            nn.CrossEntropyLoss(),
            torch.optim.SGD(model.parameters(), lr=0.1),
            amp=torch.bfloat16,
        )
        g.debug(level)
        with caplog.at_level(logging.DEBUG, logger="graphamp"):
            g(torch.randn(8, 256), torch.randint(0, 10, (8,)))
        return [
            r.getMessage()
            for r in caplog.records
            if r.name == "graphamp" and r.levelno >= logging.getLogger("graphamp").level
        ]

    quiet = run(0)
    assert quiet == []
    one = run(1)
    assert any("converted 5/7 ops to bfloat16 with 2 casts" in m for m in one)
    assert any("captured and compiled" in m and "compile" in m for m in one)
    assert not any("pass colour_by_lists" in m for m in one)
    two = run(2)
    assert any("pass colour_by_lists" in m and "ms" in m for m in two)
    assert any("pass insert_casts" in m for m in two)
    three = run(3)
    decision = next(m for m in three if m.strip().startswith("addmm ") or " aten.addmm " in m)
    assert "allow" in decision and "test_inspection.py" not in decision or "models.py" in decision


def test_debug_goes_through_logging_not_print(capsys, mlp_graph):
    mlp_graph.debug(3)
    mlp_graph(torch.randn(8, 256), torch.randint(0, 10, (8,)))
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("which", ["mlp", "cnn"])
def test_dump_writes_every_file(which, mlp_graph, cnn_graph, tmp_path):
    g = mlp_graph if which == "mlp" else cnn_graph
    if which == "mlp":
        g(torch.randn(128, 256), torch.randint(0, 10, (128,)))
    out = g.dump(str(tmp_path / "dump"))
    files = sorted(os.listdir(out))
    assert files[:9] == [
        "00_captured.py",
        "01_keep_fp32_where_faster.py",  # unchanged: the pass pins, colouring reads the pins
        "02_colour_by_lists.py",
        "03_hoist_parameter_casts.py",
        "04_insert_casts.py",
        "05_remove_hints.py",
        "06_fold_cast_chains.py",
        "07_use_fp8_matmuls.py",  # unchanged without enable_fp8
        "08_step.py",
    ]
    assert {"precision.csv", "graph.dot", "graph.svg", "report.html", "summary.json"} <= set(files)
    code = open(os.path.join(out, "06_fold_cast_chains.py")).read()
    assert "def forward(" in code and "torch.ops.aten._to_copy.default" in code
    step = open(os.path.join(out, "08_step.py")).read()
    assert "_amp_foreach_non_finite_check_and_unscale" in step
    rows = list(csv.DictReader(open(os.path.join(out, "precision.csv"))))
    assert rows and set(rows[0]) == {
        "node",
        "op",
        "module",
        "source",
        "list",
        "colour",
        "dtype",
        "why",
        "recomputed",
    }
    assert {"allow", "deny", "cast"} <= {r["colour"] for r in rows}
    dot = open(os.path.join(out, "graph.dot")).read()
    assert 'fillcolor="#8fd18f"' in dot and "subgraph cluster_" in dot
    svg = open(os.path.join(out, "graph.svg")).read()
    assert "<svg" in svg
    page = open(os.path.join(out, "report.html")).read()
    assert '<table id="ops">' in page and "<svg" in page and "sortBy(" in page
    assert page.count("<tr class=") == len(rows)
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["casts"] == 2 and summary["autocast"]["casts"] > 0


def test_own_svg_drawing_without_graphviz(cnn_graph):
    forward = cnn_graph.compiled_steps[-1].forward_graph
    svg = layered_svg(forward)
    assert svg.startswith("<svg") and svg.count("<rect") == len(list(forward.graph.nodes))
    assert "#8fd18f" in svg and "<title>" in svg
    edges = [
        ln for ln in to_dot(forward, "g").splitlines() if ln.startswith('  "') and '" -> "' in ln
    ]
    assert len(edges) == sum(len(n.all_input_nodes) for n in forward.graph.nodes)


def test_plot_history_and_the_cli(tmp_path):
    pytest.importorskip("matplotlib")
    model = seed_mlp()
    g = make_graph(
        model,
        nn.CrossEntropyLoss(),
        torch.optim.SGD(model.parameters(), lr=0.1),
        amp=torch.float16,
        scaler=graphamp.GradScaler(init_scale=256.0),
        clip=1.0,
    )
    for step in range(12):
        x = torch.randn(16, 256)
        if step in (3, 7):
            x[0, 0] = float("inf")
        g(x, torch.randint(0, 10, (16,)))
    png = plot_history(g, str(tmp_path / "run.png"))
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    state = tmp_path / "state.pt"
    torch.save({"graph": g.state_dict()}, state)
    out = subprocess.run(
        [sys.executable, "-m", "graphamp", "plot", str(state), "--out", str(tmp_path / "cli.png")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip().endswith("cli.png") and (tmp_path / "cli.png").stat().st_size > 1000


def test_plot_of_an_untrained_graph_says_why(mlp_graph, tmp_path):
    pytest.importorskip("matplotlib")
    with pytest.raises(graphamp.ConfigError, match="empty"):
        plot_history(mlp_graph, str(tmp_path / "x.png"))


def _needs(module: str):
    return pytest.mark.skipif(
        importlib.util.find_spec(module) is None, reason=f"{module} is not installed"
    )


EXAMPLES = [
    "oneflow_mlp",
    "training_step",
    pytest.param("hf_trainer", marks=[pytest.mark.slow, _needs("transformers")]),
    pytest.param("lightning_module", marks=[pytest.mark.slow, _needs("lightning")]),
    pytest.param("resnet_autocast_to_graph", marks=pytest.mark.slow),
    pytest.param("clip_after_unscale", marks=pytest.mark.slow),
    pytest.param("apex_opt_levels", marks=pytest.mark.slow),
    pytest.param("bf16_no_scaler", marks=pytest.mark.slow),
    pytest.param("overflow_forensics", marks=pytest.mark.slow),
    pytest.param("zero_data_parallel", marks=pytest.mark.slow),  # one process without torchrun
]
# run by tests/test_training_shapes.py (it checks the figures too)
_EXAMPLES_ELSEWHERE = {"accuracy"}


def test_every_example_is_run_by_a_test():
    """Every examples/*.py runs in its tiny mode after the README's install commands."""
    names = {p.values[0] if hasattr(p, "values") else p for p in EXAMPLES}
    found = {
        f[: -len(".py")]
        for f in os.listdir(os.path.join(ROOT, "examples"))
        if f.endswith(".py") and not f.startswith("_")
    }
    assert found == names | _EXAMPLES_ELSEWHERE


@pytest.mark.parametrize("name", EXAMPLES)
def test_examples_run_in_tiny_mode(name):
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", f"{name}.py"), "--tiny"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip()


@pytest.mark.skipif(shutil.which("chromium") is None, reason="Chromium is not installed")
def test_report_renders_in_headless_chromium(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "docs", "make_screenshot.py"),
            "--out",
            str(tmp_path / "report.png"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "report.png").stat().st_size > 10_000
