"""The layout shows the pipeline. Imports go one way through the layers of docs/architecture.md;
records import only torch; each input order has one owner; a failing pass names itself;
compiled steps have a public view; the architecture document names only files and functions
that exist."""

from __future__ import annotations

import ast
import collections
import dataclasses
import pathlib
import re
import sys

import pytest
import torch
import torch.nn as nn
from helpers import make_graph
from models import seed_mlp

import graphamp
import graphamp.passes.amp_pipeline as amp_pipeline
from graphamp.passes import AmpPassError
from graphamp.records.layouts import (
    CALL_GROUPS,
    STATE_GROUPS,
    STEP_INPUT_GROUPS,
    ForwardLayout,
    StepLayout,
)
from graphamp.records.placement import Placement
from graphamp.sharding.row_placement import RowPlacement

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "graphamp"

# What each part of graphamp may import besides itself: read from docs/architecture.md's
# "Layers" table, so the page and this check cannot say different things. A part is a
# subpackage or a module at the top of graphamp/. Imports under TYPE_CHECKING are types only and
# are left out.
ARCHITECTURE_PAGE = ROOT / "docs" / "architecture.md"


def _documented_layers() -> dict[str, set[str]]:
    """The page's ``| part | may import |`` rows as {part: parts it may import}; what a row
    says in parentheses is why, not a part."""
    rows = ARCHITECTURE_PAGE.read_text().split("| part | may import |", 1)[1].split("\n\n", 1)[0]
    allowed: dict[str, set[str]] = {}
    for row in rows.splitlines()[2:]:
        cells = row.strip().strip("|").split("|")
        parts = [_documented_part(n) for n in re.findall(r"`([^`]+)`", cells[0])]
        imports = {
            _documented_part(n)
            for n in re.findall(r"`([^`]+)`", re.sub(r"\([^)]*\)", "", cells[1]))
        }
        for part in parts:
            allowed[part] = imports
    return allowed


def _documented_part(name: str) -> str:
    return "graphamp." + name.rstrip("/").removesuffix(".py")


ALLOWED = _documented_layers()
# The entry points import whatever they present.
ENTRY_POINTS = ("graphamp", "graphamp.__main__", "graphamp.cli")
TOP_MODULES = {
    "__init__.py",
    "__main__.py",
    "graph.py",
    "config.py",
    "scaler.py",
    "errors.py",
}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports() -> dict[str, list[tuple[str, bool]]]:
    """module -> [(imported module or name, inside a function?)], TYPE_CHECKING blocks left
    out; every import, graphamp's and others'."""
    out: dict[str, list[tuple[str, bool]]] = {}
    for path in PACKAGE.glob("**/*.py"):
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
        out[mod] = found
    return out


def _part(name: str) -> str:
    """The part of graphamp a module or imported name belongs to (``graphamp.records``...)."""
    parts = name.split(".")
    if len(parts) == 1:
        return name
    if (PACKAGE / parts[1]).is_dir() or (PACKAGE / f"{parts[1]}.py").is_file():
        return ".".join(parts[:2])
    return "graphamp"  # a name imported from the package itself


def test_the_architecture_page_has_a_row_for_every_part():
    parts = {f"graphamp.{p.name}" for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    parts |= {f"graphamp.{p.stem}" for p in PACKAGE.glob("*.py")}
    entry = {*ENTRY_POINTS, "graphamp.__init__"}
    assert parts - entry - set(ALLOWED) == set(), "parts the page's Layers table leaves out"
    assert set(ALLOWED) - parts == set(), "rows of the page's Layers table that name no part"


def test_imports_go_one_way_through_the_layers():
    problems = []
    for mod, targets in _imports().items():
        part = _part(mod)
        for target, in_function in targets:
            if not target.startswith("graphamp"):
                continue
            if in_function:
                problems.append(f"{mod} imports {target} inside a function")
            other = _part(target)
            if part in ENTRY_POINTS or other == part:
                continue
            if part not in ALLOWED:
                problems.append(f"{mod}: {part} is not a part of the documented layers")
            elif other not in ALLOWED[part]:
                problems.append(f"{mod} ({part}) imports {target} ({other})")
    assert not problems, "\n".join(problems)


# The trainers graphamp plugs into are imported by their own integration module only (which
# the user imports), so graphamp imports without them.
TRAINER_LIBRARIES = {"transformers", "accelerate", "lightning", "pytorch_lightning"}
TRAINER_MODULES = {"graphamp.integrations.transformers", "graphamp.integrations.lightning"}


def test_only_the_integrations_import_the_trainers():
    problems = []
    for mod, targets in _imports().items():
        for target, _ in targets:
            if target.split(".")[0] in TRAINER_LIBRARIES and mod not in TRAINER_MODULES:
                problems.append(f"{mod} imports {target}")
            if any(target == m or target.startswith(m + ".") for m in TRAINER_MODULES):
                problems.append(f"{mod} imports {target}: only the user imports it")
    assert not problems, "\n".join(problems)


def test_records_import_only_torch():
    allowed_third_party = {"torch"}
    problems = []
    for mod, targets in _imports().items():
        if _part(mod) != "graphamp.records":
            continue
        for target, _ in targets:
            top = target.split(".")[0]
            if top in sys.stdlib_module_names or top == "__future__" or top in allowed_third_party:
                continue
            if _part(target) in ("graphamp.records", "graphamp.errors"):
                continue
            problems.append(f"{mod} imports {target}")
    assert not problems, "\n".join(problems)


def test_the_top_of_the_package_is_the_public_face_and_the_orchestrator():
    assert {p.name for p in PACKAGE.glob("*.py")} == TOP_MODULES
    assert not (ROOT / "passes").exists()  # the AMP passes are graphamp/passes/
    names = collections.Counter(
        p.name for p in PACKAGE.rglob("*.py") if p.name not in ("__init__.py", "__main__.py")
    )
    assert [n for n, c in names.items() if c > 1] == []


def test_no_library_function_is_longer_than_a_screen():
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 60:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} {lines}")
    assert not long, long


def test_step_layout_owns_the_order_of_the_step_inputs():
    """The core's state groups, then the components' groups in the order given, then the
    per-call groups: the batch comes last."""
    given = [*STEP_INPUT_GROUPS, "scaler", "history"]  # two components' groups, core's first
    names = {g: [f"{g}{i}" for i in range(k)] for k, g in enumerate(given)}
    layout = StepLayout(names)
    values = {g: [object() for _ in names[g]] for g in given}
    flat = layout.flatten(values)
    order = [*STATE_GROUPS, "scaler", "history", *CALL_GROUPS]
    assert layout.names == [n for g in order for n in names[g]]
    split = layout.split(flat)
    assert {g: getattr(split, g) for g in STEP_INPUT_GROUPS} == {
        g: values[g] for g in STEP_INPUT_GROUPS
    }
    assert split.owned == {"scaler": values["scaler"], "history": values["history"]}
    assert layout.n_state == len(flat) - len(names["inputs"])  # the batch comes last
    with pytest.raises(ValueError, match="'hyper' has 1 values, the layout 3"):
        layout.flatten({**values, "hyper": [object()]})
    with pytest.raises(ValueError, match="not in the layout"):
        layout.flatten({**values, "gradients": [object()]})


def test_forward_layout_owns_the_order_of_the_forward_inputs():
    layout = ForwardLayout(params=2, buffers=1, inputs=2, constants=1).with_param_copies(1)
    flat = layout.flatten(
        params=["p0", "p1"],
        buffers=["b0"],
        inputs=["x", "y"],
        loss_scale="scale",
        constants=["c0"],
        param_copies=["p0_low"],
    )
    assert flat == ["p0", "p1", "b0", "x", "y", "scale", "c0", "p0_low"] and len(layout) == 8
    groups = layout.split(flat)
    assert (groups.params, groups.loss_scale, groups.param_copies) == (
        ["p0", "p1"],
        "scale",
        ["p0_low"],
    )
    with pytest.raises(ValueError, match="'buffers' has 0 values, the layout 1"):
        layout.flatten(params=["p0", "p1"], buffers=[], inputs=["x", "y"], loss_scale="s")


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
    # the batch size changed: the second step serves every batch size ("?")
    assert first.signature.startswith("8x256 float32") and last.signature.startswith("?x256")
    assert first.dynamic == () and last.dynamic == ((0, 0), (1, 0))
    assert (first.calls, last.calls) == (2, 1)
    assert last.training and last.amp_dtype == torch.bfloat16 and last.backend == "aot_eager"
    assert not last.cuda_graph
    assert {"capture", "amp_passes", "assemble", "compile"} <= set(last.timings)
    assert last.forward_nodes == len(last.forward_graph.graph.nodes) > 0
    assert last.step_nodes == len(last.step_graph.graph.nodes) > last.forward_nodes
    with pytest.raises(dataclasses.FrozenInstanceError):
        last.calls = 0


# -- docs/architecture.md names what exists ------------------------------------------------------


def _definitions() -> tuple[dict[str, set[str]], set[str]]:
    """(module stem or package name -> the names it defines: functions, classes, methods,
    module constants, attributes set on ``self``; every function, method and class name in
    graphamp)."""
    by_module: dict[str, set[str]] = collections.defaultdict(set)
    everything: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        stem = path.parent.name if path.name == "__init__.py" else path.stem
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                by_module[stem].add(node.name)
                everything.add(node.name)
            elif isinstance(node, ast.ImportFrom) and path.name == "__init__.py":
                by_module[stem].update(a.asname or a.name for a in node.names)  # re-exported
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:  # module constants, and attributes set on self
                    if isinstance(target, ast.Name) and node in tree.body:
                        by_module[stem].add(target.id)
                    elif isinstance(target, ast.Attribute) and ast.unparse(target.value) == "self":
                        by_module[stem].add(target.attr)
    return by_module, everything


def _exists(name: str) -> bool:
    """A path from the repository root or from graphamp/, or a bare file name (module names
    are unique in graphamp/, so it names one file)."""
    if any((base / name).exists() for base in (ROOT, PACKAGE)):
        return True
    return "/" not in name and len(list(PACKAGE.rglob(name))) == 1


def _resolves(parts: list[str], by_module: dict, classes: set, everything: set) -> bool:
    """Does a dotted name starting at a graphamp module, package or class name something that
    exists? (Names starting elsewhere, ``torch.`` or ``g.``, are not graphamp's to check.)"""
    head, rest = parts[0], parts[1:]
    if head in classes and head not in by_module:
        return all(p in everything for p in rest)  # Class.method
    if head not in by_module:
        return True
    names = by_module[head]
    for i, part in enumerate(rest):
        if part in by_module and part not in names:  # a module of a package: go on in it
            names = by_module[part]
            continue
        return part in names and all(p in everything for p in rest[i + 1 :])
    return True


def _named_in_the_document() -> list[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    return re.findall(r"`([^`\n]+)`", text)


def test_the_architecture_document_names_only_files_and_functions_that_exist():
    by_module, everything = _definitions()
    classes = {n for n in everything if n[:1].isupper()}
    missing = []
    for token in _named_in_the_document():
        name = token.strip().removesuffix("()")
        if re.fullmatch(r"[\w./-]+\.(py|md)|[\w./-]+/", name):  # a file or a folder
            if not _exists(name):
                missing.append(token)
        elif re.fullmatch(r"\w+(\.\w+)+", name):  # module.function, Class.method, pkg.module
            if not _resolves(name.split("."), by_module, classes, everything):
                missing.append(token)
        elif token.endswith("()") and re.fullmatch(r"\w+", name):  # a function by name
            if name not in everything:
                missing.append(token)
    assert not missing, f"docs/architecture.md names what does not exist: {missing}"


# -- one way through a first call ------------------------------------------------------------------


def test_a_first_call_goes_down_graph_runtime_pipeline_and_never_back_up():
    """graph.py -> runtime/ -> pipeline/ -> the stages, and back by returning: no frame of
    graph.py runs while runtime/ or pipeline/ is on the stack (no callback into the Graph)."""
    model = seed_mlp()
    g = make_graph(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1))
    package = str(PACKAGE) + "/"
    looped_back, order = [], []

    def part(frame):
        name = frame.f_code.co_filename
        if not name.startswith(package):
            return None
        return name[len(package) :].split("/")[0].removesuffix(".py")

    def profile(frame, event, arg):
        if event != "call":
            return
        here = part(frame)
        if here in ("graph", "runtime", "pipeline") and (not order or order[-1] != here):
            order.append(here)
        if here != "graph":
            return
        outer = frame.f_back
        while outer is not None:
            if part(outer) in ("runtime", "pipeline"):
                looped_back.append(f"{frame.f_code.co_name} under {outer.f_code.co_name}")
                break
            outer = outer.f_back

    sys.setprofile(profile)
    try:
        g(torch.randn(4, 256), torch.randint(0, 10, (4,)))
    finally:
        sys.setprofile(None)
    assert not looped_back, looped_back
    assert order[:3] == ["graph", "runtime", "pipeline"], order


def test_each_stage_is_a_function_of_records_to_a_frozen_record():
    """The stages hand off through their signatures: every stage build.py runs has annotated
    parameters and returns a frozen record (no mutable build object a stage fills in)."""
    import graphamp.pipeline.build as build
    import graphamp.pipeline.stages as stages

    tree = ast.parse(pathlib.Path(build.__file__).read_text())
    run = [
        node.args[1].attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and ast.unparse(node.func) in ("run", "_Stages(spec).run")
        and len(node.args) > 1
        and isinstance(node.args[1], ast.Attribute)
        and ast.unparse(node.args[1].value) == "stages"
    ]
    assert {"capture", "amp_passes", "plan", "assemble", "compile"} <= set(run), run
    for name in run:
        fn = getattr(stages, name)
        annotations = fn.__annotations__
        assert "return" in annotations, name
        params = fn.__code__.co_varnames[: fn.__code__.co_argcount]
        assert all(p in annotations for p in params), f"{name}: unannotated parameters"
    for record in (stages.BuildContext, stages.Captured, stages.Passed, stages.Choices):
        assert record.__dataclass_params__.frozen, record
    assert stages.StepGraph.__dataclass_params__.frozen
    assert stages.CacheLookup.__dataclass_params__.frozen


def test_the_runtime_holds_no_callback_into_the_graph():
    from graphamp.runtime.calls import GraphRuntime

    callables = [f.name for f in dataclasses.fields(GraphRuntime) if "Callable" in str(f.type)]
    assert callables == ["build"]  # build() is the user's code, read for its signature
    model = seed_mlp()
    g = make_graph(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1))
    bound = [
        f.name
        for f in dataclasses.fields(g._run)
        if getattr(getattr(g._run, f.name), "__self__", None) is g and f.name != "build"
    ]
    assert bound == []
    assert not hasattr(graphamp.Graph, "_compile")


def test_records_check_the_invariants_they_state():
    from graphamp.records.spec import GradientCode

    with pytest.raises(ValueError, match="ascend"):
        GradientCode(grad_params=(2, 1))
    model = seed_mlp()
    g = make_graph(
        model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1), amp=None
    )
    g(torch.randn(4, 256), torch.randint(0, 10, (4,)))
    plan = g._programs.last().plan
    assert all(type(k) is str for k in g._programs.last().timings)  # torch.load reads them
    for change, words in (
        (dict(trainable=[0, 0]), "twice"),
        (dict(acc_steps=0), "at least 1"),
        (dict(placement=_Sharded(), process_group=None), "process group"),
        (dict(training=False), "eval StepPlan"),
    ):
        with pytest.raises(ValueError, match=words):
            dataclasses.replace(plan, **change)
    captured = plan.captured
    with pytest.raises(ValueError, match="num_written"):
        dataclasses.replace(captured, num_written=captured.num_user_outputs + 1)
    with pytest.raises(ValueError, match="1 to 3"):
        RowPlacement(4, group=object())
    with pytest.raises(ValueError, match="process group"):
        RowPlacement(1, group=None)


class _Sharded(Placement):
    sharded = True


def test_every_package_is_in_the_distribution():
    """pyproject.toml lists the packages a wheel holds: a room added to graphamp/ and not
    listed there would be missing from every non-editable install."""
    import tomllib

    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    on_disk = {
        _module_name(path)
        for path in PACKAGE.rglob("__init__.py")
        if "__pycache__" not in path.parts
    }
    assert on_disk == listed


def test_process_wide_patches_of_torch_go_through_shared_patch():
    """torch's attributes are process-wide: graphamp replaces one only through a
    ``torchkit.process_state.SharedPatch`` (reference-counted across threads, put back on every
    path), never by assigning it in place."""
    problems = []
    for path in PACKAGE.glob("**/*.py"):
        if path == PROCESS_STATE_MODULE:
            continue
        tree = ast.parse(path.read_text())
        torch_names = {"torch", "nn"} | _names_bound_to_torch(tree)
        for node in ast.walk(tree):
            targets: list = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("setattr", "delattr"):
                targets = node.args[:1]
            for target in targets:
                text = ast.unparse(target)
                if text.split(".")[0] in torch_names and (
                    isinstance(target, ast.Attribute) or isinstance(node, ast.Call)
                ):
                    problems.append(f"{path.relative_to(ROOT)}:{node.lineno}: {text}")
    # the side compile's child process takes its parent's settings as its own (a process that
    # only compiles one kernel and exits)
    own_process = "graphamp/pipeline/side_compile.py:"
    assert not [p for p in problems if not p.startswith(own_process)], "\n".join(problems)


def _names_bound_to_torch(tree: ast.AST) -> set[str]:
    """Names a module binds to torch's modules and objects (``from torch.x import y``,
    ``import torch.x as y``), in functions too."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            names |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.asname for a in node.names if a.asname and a.name.startswith("torch")}
    return names


def test_no_code_tests_an_optimizers_update_path_by_name():
    """Each way a step updates is an ``UpdatePath`` (records/update_paths.py) that code asks
    (``plan.path.traced``): a test of its name (``kind == "sgd"``) would be missed by the next
    path."""
    by_name = re.compile(r"""kind\s*(==|!=|in)\s*\(?\s*["'](sgd|adam|traced|eager)["']""")
    problems = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in PACKAGE.glob("**/*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if by_name.search(line)
    ]
    assert not problems, "\n".join(problems)


# -- step components ---------------------------------------------------------------------------

# the step's input groups that are the forward's and the optimizers' (step/plan.py names them);
# every other group belongs to exactly one step component
_CORE_INPUT_GROUPS = {
    "params",
    "buffers",
    "opt_state",
    "hyper",
    "counters",
    "momentum_fresh",
    "pass_state",
    "constants",
    "inputs",
}


def _documented_components() -> list[tuple[str, str, list[str], str]]:
    """docs/architecture.md's step components table: (name, module, phases, input group)."""
    page = ARCHITECTURE_PAGE.read_text()
    rows = page.split("| component | module | phases | input group |", 1)[1].split("\n\n", 1)[0]
    out = []
    for row in rows.splitlines()[2:]:
        name, module, phases, group = (c.strip() for c in row.strip().strip("|").split("|"))
        out.append(
            (name.strip("`"), module.strip("`"), [p.strip() for p in phases.split(",") if p], group)
        )
    return out


def test_the_step_components_are_the_ones_the_architecture_page_draws():
    """The page's table of step components is the registry's: names, modules, the phases each
    adds at, the input group each owns, in the registered order."""
    from graphamp.step.components import COMPONENTS, Phase

    registered = [
        (
            c.name,
            f"{type(c).__module__.rsplit('.', 1)[-1]}.py",
            [p.name for p in Phase if c.adds_at(p)],
            f"`{c.group}`" if c.group else "",
        )
        for c in COMPONENTS
    ]
    assert _documented_components() == registered


def test_every_component_declares_its_skipped_step_and_its_ranks_as_the_page_draws():
    """Each component says what a skipped step does with what it keeps and what the ranks
    agree on ("nothing" included); the page's table is those declarations, in order."""
    from graphamp.step.components import COMPONENTS

    page = ARCHITECTURE_PAGE.read_text()
    table = page.split("| component | on a skipped step | across ranks |", 1)[1]
    rows = [
        tuple(c.strip() for c in row.strip().strip("|").split("|"))
        for row in table.split("\n\n", 1)[0].splitlines()[2:]
    ]
    declared = [(f"`{c.name}`", c.on_skip, c.across_ranks) for c in COMPONENTS]
    assert all(c.on_skip and c.across_ranks for c in COMPONENTS)
    assert rows == declared


def test_every_state_group_of_the_step_belongs_to_one_component():
    """A step input group is the forward's, the optimizers', or one component's (which names
    its placeholders and makes its example tensors)."""
    from graphamp.step.components import COMPONENTS

    owners = collections.Counter(c.group for c in COMPONENTS if c.group is not None)
    assert [g for g, n in owners.items() if n > 1] == []
    assert set(STEP_INPUT_GROUPS) == _CORE_INPUT_GROUPS
    assert not set(owners) & _CORE_INPUT_GROUPS


def test_components_are_registered_in_one_place():
    """Only ``step/components/__init__.py`` makes the components (one registration), and only
    assembly and the plan's helpers run them."""
    problems = []
    for path in PACKAGE.glob("**/*.py"):
        if path == PACKAGE / "step" / "components" / "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and path.parent.name != "components":
                bases = {ast.unparse(b) for b in node.bases}
                if "StepComponent" in bases:
                    problems.append(f"{path.relative_to(ROOT)}: class {node.name}")
            if isinstance(node, ast.Name) and node.id == "COMPONENTS":
                if path.relative_to(PACKAGE).as_posix() not in ("pipeline/stage_errors.py",):
                    problems.append(f"{path.relative_to(ROOT)}:{node.lineno}: COMPONENTS")
    assert not problems, "\n".join(problems)


# The files under graphamp/ that name fp8: the feature's own (its pass, its numerics, its step
# component, its report), the records and public settings it declares, and one registration
# each in the pass pipeline (its order and PASS_SETTINGS), the component list, the op library
# and the passes' table. A stage, the runtime or the plan naming it is the feature leaking out.
_FP8_FEATURE = {"passes/fp8_matmuls.py", "torchkit/fp8_numerics.py", "step/components/fp8.py"}
_FP8_DECLARED = {"inspect/fp8_report.py", "records/amp.py", "records/settings.py"}
_FP8_PUBLIC = {"config.py", "graph.py"}
_FP8_REGISTRATIONS = {
    "passes/amp_pipeline.py",
    "step/components/__init__.py",
    "torchkit/ops.py",
    "passes/README.md",
}


def _files_naming(pattern: str, own: tuple[str, ...]) -> set[str]:
    return {
        name
        for p in PACKAGE.glob("**/*")
        if p.suffix in (".py", ".md")
        and not (name := p.relative_to(PACKAGE).as_posix()).startswith(own)
        and re.search(pattern, p.read_text())
    }


def test_fp8_is_named_only_by_its_modules_and_its_registrations():
    naming = _files_naming("(?i)fp8", own=())
    assert naming == _FP8_FEATURE | _FP8_DECLARED | _FP8_PUBLIC | _FP8_REGISTRATIONS


# ZeRO's code: the sharding package and its step component. Outside them, the modules that read
# its settings and the ones that import the package, each for the reason given; a stage, the
# runner or the plan doing either is the feature leaking out (they ask the plan's placement and
# the components' hooks instead).
_ZERO_SETTINGS = ("zero_stage", "zero_reshard_after_forward")
_ZERO_SETTING_READERS = {
    "config.py": "enable_zero sets them",
    "records/settings.py": "the ConfigSnapshot declares them",
    "step/components/zero.py": "the component",
    "integrations/transformers.py": "the Trainer's fsdp arguments become enable_zero",
}
_SHARDING_IMPORTERS = {
    "__init__.py": "gathered_parameters, public",
    "graph.py": "a fully_shard wrap recognised at registration",
    "pipeline/build.py": "a fully_shard wrap taken over at the first build",
    "pipeline/stages.py": "foreign DTensors refused; the group the parameters are shards over",
    "step/components/zero.py": "the component",
    "integrations/lightning.py": "gathered_parameters for the loop's eager forwards",
    "integrations/transformers.py": "gathered_parameters for the loop's eager forwards",
}


def test_zero_is_read_only_by_its_component_its_package_and_its_settings():
    readers, importers = set(), set()
    for path in PACKAGE.glob("**/*.py"):
        name = path.relative_to(PACKAGE).as_posix()
        if name.startswith("sharding/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in _ZERO_SETTINGS:
                readers.add(name)
            if isinstance(node, ast.keyword) and node.arg in _ZERO_SETTINGS:
                readers.add(name)
            if isinstance(node, ast.AnnAssign) and ast.unparse(node.target) in _ZERO_SETTINGS:
                readers.add(name)
            if isinstance(node, ast.ImportFrom) and "sharding" in (node.module or "").split("."):
                importers.add(name)
    assert readers == set(_ZERO_SETTING_READERS)
    assert importers == set(_SHARDING_IMPORTERS)


# Where ZeRO and the overflow probes are named at all (code, comments, docs), outside their own
# code, each file for its reason: the records they declare, the public config, their one
# registration and the words a user reads. A generic hook names the hook, not its one user.
_ZERO_CODE = ("sharding/", "step/components/zero.py")
_ZERO_NAMED_BY = {
    "records/placement.py": "declares the Placement RowPlacement is one of",
    "records/settings.py": "declares the settings",
    "records/fully_shard.py": "declares the fully_shard wrap taken over as ZeRO-3",
    "records/stage_names.py": "declares its rewrite's stage",
    "config.py": "public config: enable_zero",
    "graph.py": "public: a fully_shard wrap recognised at registration",
    "step/components/__init__.py": "the one registration",
    "pipeline/stage_errors.py": "the words of its stage's errors",
    "integrations/trainer_checks.py": "the Trainer's fsdp arguments mapped onto enable_zero",
    "integrations/transformers.py": "the Trainer's fsdp arguments mapped onto enable_zero",
    "integrations/lightning.py": "Lightning's FSDP2 strategy mapped onto enable_zero",
}
_PROBES_CODE = ("forensics/", "step/components/overflow_probes.py")
_PROBES_NAMED_BY = {
    "records/probes.py": "declares ProbeTable and OverflowEvent",
    "records/history.py": "declares the host's overflow events",
    "records/spec.py": "declares StepPlan.probes",
    "records/subgraphs.py": "declares its subgraph tag",
    "step/components/__init__.py": "the one registration",
    "runner/runner.py": "makes the host's handle on each step's record",
    "runtime/overflows.py": "reads the record after a call (autofix, debug logging)",
}


def test_zero_and_the_probes_are_named_only_by_their_code_records_config_and_registration():
    zero = _files_naming(r"ZeRO|zero_stage|Zero\b|RowPlacement|zero_reshard", _ZERO_CODE)
    assert zero == set(_ZERO_NAMED_BY)
    assert _files_naming(r"(?i)probe", _PROBES_CODE) == set(_PROBES_NAMED_BY)


def test_stages_are_named_through_the_enum_and_each_has_its_words():
    """The build's stages are ``records.stage_names.Stage`` members: the pipeline runs them by
    member (no string literal names a stage), each has its words in ``stage_errors.py``, and a
    component that rewrites the assembled step names its stage."""
    from graphamp.pipeline.stage_errors import _STAGE_WORDS
    from graphamp.records.stage_names import Stage
    from graphamp.step.components import COMPONENTS, StepComponent

    assert set(_STAGE_WORDS) == set(Stage)
    problems = []
    for path in (PACKAGE / "pipeline").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            name = ast.unparse(node.func).rsplit(".", 1)[-1]
            first = node.args[0]
            if name in ("run", "worded", "stage_error") and isinstance(first, ast.Constant):
                problems.append(f"{path.name}:{node.lineno}: {ast.unparse(node)[:60]}")
    assert not problems, "\n".join(problems)
    for c in COMPONENTS:
        rewrites = type(c).rewrites is not StepComponent.rewrites
        assert rewrites == (c.rewrite_stage is not None), c.name
        assert c.rewrite_stage is None or isinstance(c.rewrite_stage, Stage)


def test_the_step_phases_are_the_components_methods():
    """Each ``Phase`` names the ``StepComponent`` method assembly calls for it."""
    from graphamp.step.components import Phase, StepComponent

    for phase in Phase:
        assert callable(getattr(StepComponent, phase.value)), phase


def test_subgraph_tags_are_written_through_the_enum():
    """The step's node tags are ``records.subgraphs.Subgraph`` members: no module spells the
    metadata key or a tag as a string of its own."""
    from graphamp.records.subgraphs import SUBGRAPH

    problems = []
    for path in PACKAGE.glob("**/*.py"):
        if path == PACKAGE / "records" / "subgraphs.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value == SUBGRAPH:
                problems.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not problems, "\n".join(problems)


# -- process-wide state: one module declares it, one module registers ops -------------------------

PROCESS_STATE_MODULE = PACKAGE / "torchkit" / "process_state.py"
OPS_MODULE = PACKAGE / "torchkit" / "ops.py"
# what registers with torch's op registry besides ``torch.library.*`` itself
_REGISTERING_METHODS = {
    "register_fake",
    "register_autograd",
    "register_kernel",
    "register_autocast",
    "register_torch_dispatch",
    "register_vmap",
    "py_impl",
}
_TRACE_HOOKS = {"sys.settrace", "sys.setprofile", "threading.settrace", "threading.setprofile"}
_GLOBAL_MODULE_HOOK = re.compile(r"^register_module_\w*hook$")


def _sources(skip: pathlib.Path) -> list[tuple[str, ast.Module]]:
    return [
        (str(path.relative_to(ROOT)), ast.parse(path.read_text()))
        for path in sorted(PACKAGE.glob("**/*.py"))
        if path != skip
    ]


def _op_registrations(tree: ast.AST) -> list[tuple[int, str]]:
    """Where a module uses ``torch.library`` or registers a kernel with torch's op registry."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            text = ast.unparse(node)
            if text.startswith("torch.library") or node.attr in _REGISTERING_METHODS:
                found.append((node.lineno, text))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.library"):
            found.append((node.lineno, f"from {node.module} import"))
        elif isinstance(node, ast.Import) and any(
            a.name.startswith("torch.library") for a in node.names
        ):
            found.append((node.lineno, "import torch.library"))
    return found


def test_only_the_ops_module_registers_torch_ops():
    """Every registration with torch's op registry (``torch.library``: ``custom_op``,
    ``Library``, ``define``, ``impl``, ``register_fake``, ``register_autograd``...) is in
    ``torchkit/ops.py``, made when it is imported: one module says what graphamp adds to
    torch's dispatcher (an op's kernel may live elsewhere, beside its math)."""
    problems = [
        f"{name}:{line}: {text}"
        for name, tree in _sources(skip=OPS_MODULE)
        for line, text in _op_registrations(tree)
    ]
    assert not problems, "\n".join(problems)
    assert _op_registrations(ast.parse(OPS_MODULE.read_text()))  # the check sees them there


def test_trace_functions_and_global_module_hooks_are_set_only_by_process_state():
    """``sys.settrace`` and torch's global module hooks (``register_module_*_hook``) change the
    whole process (or every frame of a thread): only ``torchkit/process_state.py`` sets them,
    each with its bound and why, and puts back what it replaced."""
    problems = []
    for name, tree in _sources(skip=PROCESS_STATE_MODULE):
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            text = ast.unparse(node.func)
            if text in _TRACE_HOOKS or _GLOBAL_MODULE_HOOK.match(text.rsplit(".", 1)[-1]):
                problems.append(f"{name}:{node.lineno}: {text}")
    assert not problems, "\n".join(problems)
    found = ast.unparse(ast.parse(PROCESS_STATE_MODULE.read_text()))
    assert "sys.settrace" in found and "register_module_forward_hook" in found


_CONTAINER_CALLS = re.compile(
    r"^((collections|weakref)\.)?(dict|list|set|Counter|OrderedDict|defaultdict|deque|"
    r"WeakKeyDictionary|WeakValueDictionary|WeakSet)$"
)
_CONTAINERS = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
_MUTATORS = {
    "append",
    "add",
    "update",
    "setdefault",
    "pop",
    "popitem",
    "clear",
    "extend",
    "insert",
    "remove",
    "discard",
    "appendleft",
    "popleft",
    "subtract",
}
_CACHES = {"functools.cache", "functools.lru_cache", "cache", "lru_cache"}


def _module_containers(tree: ast.Module) -> set[str]:
    """Names a module binds to a new mutable container at its top level."""
    names = set()
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if isinstance(value, _CONTAINERS) or (
            isinstance(value, ast.Call) and _CONTAINER_CALLS.match(ast.unparse(value.func))
        ):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]  # type: ignore[union-attr]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def _changed_in_functions(tree: ast.Module) -> set[str]:
    """Names a function of the module changes what they hold (``x[k] = v``, ``x.append(v)``,
    ``del x[k]``) or rebinds (``global x``)."""
    changed = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            changed |= set(node.names)
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            targets = [node.target] if isinstance(node, ast.AugAssign) else node.targets
            changed |= {
                t.value.id
                for t in targets
                if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name)
            }
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in _MUTATORS and isinstance(node.func.value, ast.Name):
                changed.add(node.func.value.id)
    return changed


def _process_wide_state(tree: ast.Module) -> set[str]:
    """The module-level names of a module that hold state for the process: the containers and
    globals its functions change, and its module-level functions cached (``functools.cache``).
    Changes made at the module's top level build constant tables at import."""
    functions = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef)]
    changed: set[str] = set()
    for scope in [*functions, *classes]:
        changed |= _changed_in_functions(scope)
    top_level = {
        t.id
        for node in tree.body
        for t in (node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)])
        if isinstance(t, ast.Name)
    }
    cached = {
        fn.name
        for fn in functions
        if any(ast.unparse(getattr(d, "func", d)) in _CACHES for d in fn.decorator_list)
    }
    return (changed & (top_level | _module_containers(tree))) | cached


def test_process_wide_state_is_declared_in_process_state():
    """Every module-level container graphamp changes after import, every module global a
    function rebinds and every module-level function cached for the process is an entry of
    ``process_state.PROCESS_STATE``, with its bound and why it is process-wide (a constant table
    built at import is not state)."""
    from graphamp.torchkit.process_state import PROCESS_STATE

    declared = {held.where for held in PROCESS_STATE}
    undeclared = [
        f"{name}:{state}"
        for name, tree in _sources(skip=PROCESS_STATE_MODULE)
        for state in sorted(_process_wide_state(tree))
        if f"{name}:{state}" not in declared
    ]
    assert not undeclared, "declare in torchkit/process_state.py:\n" + "\n".join(undeclared)


def test_every_process_state_entry_names_a_thing_that_exists():
    """``PROCESS_STATE`` names each thing by module and name; each is there, once, with its
    bound and its reason, and each module that makes a ``SharedPatch`` has an entry."""
    import importlib

    from graphamp.torchkit.process_state import PROCESS_STATE

    wheres = [held.where for held in PROCESS_STATE]
    assert len(wheres) == len(set(wheres))
    for held in PROCESS_STATE:
        path, name = held.where.split(":")
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        assert hasattr(module, name), held.where
        assert held.what and held.bound and held.why, held.where
    patching = {
        name
        for name, tree in _sources(skip=PROCESS_STATE_MODULE)
        if any(
            isinstance(n, ast.Call) and ast.unparse(n.func) == "SharedPatch" for n in ast.walk(tree)
        )
    }
    assert patching and patching <= {w.split(":")[0] for w in wheres}


# -- torch's private names: declared where they are read, with the torch releases checked --------

COMPAT_MODULE = PACKAGE / "torchkit" / "compat.py"
# A module that reads torch's private names says so near its top, in this form (names sorted,
# comma-separated, on `#   ` lines):
#   # torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   #   torch._foreach_mul, torch._subclasses, torch.utils._pytree
_PRIVATE_HEADER = "# torch private names read here (checked on torch {}: .ci/run's legs):"
_PRIVATE_HEADER_RE = re.compile(r"# torch private names read here \(checked on torch ([^:]*): ")
_TORCH_DOTTED = re.compile(r"torch(\.\w+)*")


def _private_part(dotted: str) -> str | None:
    """The name a declaration lists for a torch name graphamp reads: its dotted path up to and
    including its last private component (``_x``, not a dunder), or None if it has none:
    ``torch._C._nn.gelu`` -> ``torch._C._nn``, ``torch.ops.aten._to_copy.default`` ->
    ``torch.ops.aten._to_copy``, ``torch._subclasses.fake_tensor.FakeTensorMode`` ->
    ``torch._subclasses`` (the private attribute read; what is read from it is torch's too)."""
    parts = dotted.split(".")
    private = [
        i for i, p in enumerate(parts) if p.startswith("_") and not re.fullmatch(r"__\w+__", p)
    ]
    if parts[0] != "torch" or not private:
        return None
    return ".".join(parts[: private[-1] + 1])


def _dotted(node: ast.AST) -> list[str] | None:
    """``a.b.c`` as [a, b, c]; None unless the chain starts at a name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def _torch_aliases(tree: ast.AST) -> dict[str, str]:
    """Name -> the torch name it is bound to, in functions too: ``import torch``, ``import
    torch.utils._pytree as pytree``, ``from torch._inductor import config``, and plain
    assignments of a torch name (``aten = torch.ops.aten``)."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    aliases[a.asname or "torch"] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and not node.level:
            if (node.module or "").split(".")[0] == "torch":
                aliases |= {a.asname or a.name: f"{node.module}.{a.name}" for a in node.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and [type(t) for t in node.targets] == [ast.Name]:
            chain = _dotted(node.value)
            if chain and chain[0] in aliases:
                aliases[node.targets[0].id] = ".".join([aliases[chain[0]], *chain[1:]])
    return aliases


def _torch_owner(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """The torch name an expression is: a chain from a name bound to torch, or a string that is
    a whole dotted torch name (``"torch.utils._pytree"``)."""
    chain = _dotted(node)
    if chain and chain[0] in aliases:
        return ".".join([aliases[chain[0]], *chain[1:]])
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value if _TORCH_DOTTED.fullmatch(node.value) else None
    return None


def _torch_names_named(node: ast.AST, aliases: dict[str, str], inner: set[int]) -> list[str]:
    """The torch names one node names: an import, the longest attribute chain from a name
    bound to torch, a string that is a whole dotted torch name, or an attribute given as a
    string beside its owner, in a call's first two arguments or a pair (``getattr(torch._C,
    "_x")``, ``SharedPatch(torch.compiler, "_flag", ...)``, ``("torch.serialization", "_x")``)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and not node.level:
        return [f"{node.module}.{a.name}" for a in node.names]
    if isinstance(node, ast.Attribute | ast.Constant):
        owner = _torch_owner(node, aliases) if id(node) not in inner else None
        return [owner] if owner else []
    pair = node.args[:2] if isinstance(node, ast.Call) else getattr(node, "elts", [])
    if not isinstance(node, ast.Call | ast.Tuple) or len(pair) != 2:
        return []
    owner, attr = _torch_owner(pair[0], aliases), pair[1]
    if owner and isinstance(attr, ast.Constant) and str(attr.value).isidentifier():
        return [f"{owner}.{attr.value}"]
    return []


def _private_torch_names_read(tree: ast.AST) -> dict[str, int]:
    """{declared name: the first line naming it} for the private torch names a module reads."""
    aliases = _torch_aliases(tree)
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        for name in _torch_names_named(node, aliases, inner):
            private = _private_part(name)
            if private:
                found[private] = min(found.get(private, node.lineno), node.lineno)
    return found


def _private_declaration(text: str) -> tuple[str, list[str]] | None:
    """(the versions the comment names, the names it lists in order), or None without one."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if _PRIVATE_HEADER_RE.match(line)]
    if not starts:
        return None
    assert len(starts) == 1, "two declarations of torch private names in one module"
    versions = _PRIVATE_HEADER_RE.match(lines[starts[0]]).group(1)
    names: list[str] = []
    for line in lines[starts[0] + 1 :]:
        if not line.startswith("#   "):
            break
        names += [n.strip() for n in line[4:].split(",") if n.strip()]
    return versions, names


def _expected_declaration(names: list[str], versions: str) -> str:
    """The comment block for ``names``, wrapped at 100 columns."""
    lines, line = [_PRIVATE_HEADER.format(versions)], "#  "
    for i, name in enumerate(names):
        word = f" {name}" + ("," if i < len(names) - 1 else "")
        if len(line) + len(word) > 100 and line != "#  ":
            lines.append(line.rstrip())
            line = "#  "
        line += word
    return "\n".join([*lines, line])


def _declaration_problem(where: str, text: str, versions: str) -> str | None:
    """What to change in one module's declaration of the private torch names it reads."""
    read = _private_torch_names_read(ast.parse(text))
    declared = _private_declaration(text)
    if declared is None and not read:
        return None
    if not read:
        return f"{where}: reads no private torch name; remove its declaration comment"
    listed = declared[1] if declared else []
    if declared and declared[0] == versions and listed == sorted(read):
        return None
    missing = [f"{n} (line {read[n]})" for n in sorted(set(read) - set(listed))]
    stale = sorted(set(listed) - set(read))
    changes = [f"add {', '.join(missing)}"] if missing else []
    changes += [f"remove {', '.join(stale)}"] if stale else []
    if declared and declared[0] != versions:
        changes.append(f"name torch {versions}, not {declared[0]}")
    return (
        f"{where}: {'; '.join(changes or ['list each name once, sorted'])}. Its comment, after"
        " the docstring and `from __future__` import, just above the next import, should"
        " read:\n" + _expected_declaration(sorted(read), versions)
    )


def test_private_torch_names_are_declared_where_read():
    """Every private torch name a module names (a dotted torch name with a ``_x`` component,
    up to its last: ``_private_part``) is listed in the module's ``# torch private names read
    here`` comment, which names the torch releases .ci/run checks it on
    (``compat.CHECKED_TORCH``); no name is listed that the module does not read.
    ``torchkit/compat.py`` is the module for torch-version branches and needs none."""
    from graphamp.torchkit.compat import CHECKED_TORCH

    versions = ", ".join(CHECKED_TORCH)
    problems = [
        _declaration_problem(str(path.relative_to(ROOT)), path.read_text(), versions)
        for path in sorted(PACKAGE.glob("**/*.py"))
        if path != COMPAT_MODULE
    ]
    found = [p for p in problems if p]
    assert not found, "declare the private torch names each module reads:\n" + "\n".join(found)


def test_the_checked_torch_releases_are_the_ones_ci_installs():
    """``compat.CHECKED_TORCH`` is what .ci/run installs: the main leg's torch and the
    compatibility legs' (the ends of the range pyproject.toml claims)."""
    import tomllib

    from graphamp.torchkit.compat import CHECKED_TORCH

    ci = (ROOT / ".ci" / "run").read_text()
    compat_legs = re.search(r"for version in ([\d. ]+); do", ci).group(1).split()
    main_leg = re.search(r"main leg \(torch ([\d.]+), whole suite\)", ci).group(1)
    assert tuple(sorted([*compat_legs, main_leg], key=_release)) == CHECKED_TORCH
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    claimed = next(d for d in project["dependencies"] if d.startswith("torch"))
    low, high = re.fullmatch(r"torch>=([\d.]+),<([\d.]+)", claimed).groups()
    assert _release(CHECKED_TORCH[0])[:2] == _release(low)[:2], (claimed, CHECKED_TORCH)
    assert _release(CHECKED_TORCH[-1])[:2] == (_release(high)[0], _release(high)[1] - 1)
    assert f"torch {main_leg}" in ci.split("\n\n")[0]  # .ci/run's header names the main leg's
    # the test extra's torchvision pin is the build beside the main leg's torch
    assert f"torch {main_leg}" in (ROOT / "pyproject.toml").read_text()


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))
