"""Issue 11: the one-way pipeline. Imports go graph -> pipeline -> stages -> records, the step's
input order has one owner, a failing pass names itself, compiled steps have a public view."""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest
import torch
import torch.nn as nn
from helpers import make_graph
from models import seed_mlp

import graphamp
import graphamp.passes.amp_pipeline as amp_pipeline
from graphamp.passes import AmpPassError
from graphamp.records.layouts import STEP_INPUT_GROUPS, StepLayout

ROOT = pathlib.Path(__file__).resolve().parent.parent
STAGES = ("graphamp.capture", "graphamp.passes", "graphamp.step", "graphamp.runtime")
ABOVE_STAGES = ("graphamp.graph", "graphamp.pipeline", "graphamp.inspect")


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports() -> dict[str, list[tuple[str, bool]]]:
    """module -> [(imported graphamp module, inside a function?)], TYPE_CHECKING blocks left out."""
    out: dict[str, list[tuple[str, bool]]] = {}
    for path in ROOT.glob("graphamp/**/*.py"):
        mod = _module_name(path)
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        found: list[tuple[str, bool]] = []

        def visit(node, in_function):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                    continue
                inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
                if isinstance(child, ast.ImportFrom):
                    base = package
                    for _ in range(child.level - 1):
                        base = base.rpartition(".")[0]
                    target = (
                        (f"{base}.{child.module}" if child.module else base)
                        if child.level
                        else (child.module or "")
                    )
                    for alias in child.names:
                        found.append((f"{target}.{alias.name}", inner))
                elif isinstance(child, ast.Import):
                    found.extend((a.name, inner) for a in child.names)
                visit(child, inner)

        visit(ast.parse(path.read_text()), False)
        out[mod] = [(t, f) for t, f in found if t.startswith("graphamp")]
    return out


def _under(name: str, prefixes) -> str | None:
    return next((p for p in prefixes if name == p or name.startswith(p + ".")), None)


def test_imports_go_one_way():
    problems = []
    for mod, targets in _imports().items():
        stage = _under(mod, STAGES)
        for target, in_function in targets:
            if in_function:
                problems.append(f"{mod} imports {target} inside a function")
            if stage and _under(target, ABOVE_STAGES):
                problems.append(f"stage {mod} imports {target}")
            other = _under(target, STAGES)
            if stage and other and other != stage:
                problems.append(f"stage {mod} imports another stage: {target}")
            if _under(mod, ("graphamp.inspect",)) and other:
                problems.append(f"inspection {mod} imports stage {target}")
            if (
                mod.startswith("graphamp.")
                and target.startswith("graphamp.pipeline")
                and mod not in ("graphamp.graph",)
            ):
                problems.append(f"only graph.py calls the pipeline, not {mod}")
    assert not problems, "\n".join(problems)


def test_step_layout_owns_the_order_of_the_step_inputs():
    names = {g: [f"{g}{i}" for i in range(k)] for k, g in enumerate(STEP_INPUT_GROUPS)}
    layout = StepLayout(names)
    values = {g: [object() for _ in names[g]] for g in STEP_INPUT_GROUPS}
    flat = layout.flatten(values)
    assert layout.names == [n for g in STEP_INPUT_GROUPS for n in names[g]]
    assert vars(layout.split(flat)) == values
    assert layout.n_state == len(flat) - len(names["inputs"])  # the batch comes last
    with pytest.raises(ValueError, match="'hyper' has 1 values, the layout 3"):
        layout.flatten({**values, "hyper": [object()]})
    with pytest.raises(ValueError, match="unknown step input groups"):
        StepLayout({"gradients": ["g"]})


def test_a_failing_amp_pass_names_itself_and_the_passes_before_it(monkeypatch):
    def broken_pass(gm, ctx):
        raise KeyError("no such node")

    passes = amp_pipeline.AMP_PIPELINE
    monkeypatch.setattr(amp_pipeline, "AMP_PIPELINE", (*passes[:2], broken_pass, *passes[2:]))
    model = seed_mlp()
    g = make_graph(
        model,
        nn.CrossEntropyLoss(),
        torch.optim.SGD(model.parameters(), lr=0.1),
        amp=torch.bfloat16,
    )
    with pytest.raises(AmpPassError) as err:
        g(torch.randn(4, 256), torch.randint(0, 10, (4,)))
    assert isinstance(err.value, graphamp.GraphampError)
    assert "AMP pass broken_pass failed" in str(err.value)
    assert f"before it: {passes[0].__name__}, {passes[1].__name__})" in str(err.value)
    assert isinstance(err.value.__cause__, KeyError)


def test_compiled_steps_are_a_read_only_public_view():
    model = seed_mlp()
    g = make_graph(
        model,
        nn.CrossEntropyLoss(),
        torch.optim.SGD(model.parameters(), lr=0.1),
        amp=torch.bfloat16,
    )
    assert g.compiled_steps == ()
    for batch in (8, 8, 4):
        g(torch.randn(batch, 256), torch.randint(0, 10, (batch,)))
    first, last = g.compiled_steps
    assert first.signature.startswith("8x256 float32") and last.signature.startswith("4x256")
    assert (first.calls, last.calls) == (2, 1)
    assert last.training and last.amp_dtype == torch.bfloat16 and last.backend == "aot_eager"
    assert not last.cuda_graph
    assert {"capture", "amp_passes", "assemble", "compile"} <= set(last.timings)
    assert last.forward_nodes == len(last.forward_graph.graph.nodes) > 0
    assert last.step_nodes == len(last.step_graph.graph.nodes) > last.forward_nodes
    with pytest.raises(dataclasses.FrozenInstanceError):
        last.calls = 0
