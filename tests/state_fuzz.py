"""A differential fuzzer of the Python state a training step reads and writes.

Each case is a generated Python module (written to a file and imported, as a user's script
is): a small model whose ``forward`` and ``build`` read values held in every way Python code
holds them (globals, closures, module and Graph attributes, class attributes shadowed later,
containers small and large, dataclasses, namespaces, objects of the user's classes, function
defaults, partial keywords, a library's object's attributes and properties (a scheduler's), a ContextVar's value,
a module's globals read by name, code compiled from text, a
function whose code a reload replaces, a class attribute read off ``cls`` or ``type(obj)``, a
NumPy array changed in place, a container that holds itself, ``os.environ``, tensors, optimizer param groups, Python
numbers an optimizer keeps), of every kind (floats, ints, bools, strings, enums, tensors). A schedule then
changes some of them between calls (in place, rebound, shadowed, changed back, before the
first call), the same way for a Graph and for an eager copy of the model, and every call's loss
and the final parameters of the two are compared. A case whose source graphamp may refuse (a
value build() changes on every call) may end in a graphamp error that names it instead.

``run_case(seed, directory)`` runs one case and returns what happened; the failure message holds
the generated module and the schedule, so a failing seed is reproduced by running it again.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import os
import random
import sys
import textwrap
from typing import Any, Callable

import torch

import graphamp

# -- sources: one way of holding a value, how forward()/build() uses it, how the loop changes it


@dataclasses.dataclass
class Source:
    """One value held one way. ``decl``: module-level code; ``init``: lines of the model's
    ``__init__``; ``use``: a line of ``forward`` (``y`` in, ``y`` out) or, with ``in_build``,
    of build() (``loss`` in and out; ``holder`` is the Graph or its eager stand-in);
    ``changes``: code run between calls, with ``mod`` (the module), ``models``, ``holders``
    and ``opts`` (both sides') in scope; ``graph_attr``, ``base_attr``: (name, value) set on
    the Graph (and its stand-in), on the model's base class; ``may_refuse``: graphamp may
    refuse it by name."""

    kind: str
    decl: str = ""
    init: str = ""
    use: str = ""
    in_build: bool = False
    changes: list[str] = dataclasses.field(default_factory=list)
    graph_attr: tuple[str, float] | None = None
    base_attr: tuple[str, float] | None = None
    may_refuse: str | None = None  # the name graphamp's refusal of it must give
    every_call: str | None = None  # a change made before every call ({call}: its number)


def _float(rng: random.Random) -> float:
    return round(rng.uniform(0.25, 2.0), 3)


def _floats(rng: random.Random, first: float) -> list[float]:
    """New values for a float: fresh ones, and the first again (changed back)."""
    return [_float(rng), _float(rng), first]


def _global_float(i: int, rng: random.Random) -> Source:
    v = _float(rng)
    return Source(
        "global float",
        decl=f"G{i} = {v}",
        use=f"y = y * G{i}",
        changes=[f"mod.G{i} = {w}" for w in _floats(rng, v)],
    )


def _global_int(i: int, rng: random.Random) -> Source:
    return Source(
        "global int",
        decl=f"N{i} = 2",
        use=f"y = y * N{i}",
        changes=[f"mod.N{i} = {n}" for n in (3, 1, 2)],
    )


def _global_bool(i: int, rng: random.Random) -> Source:
    return Source(
        "global bool",
        decl=f"B{i} = True",
        use=f"y = y * 2.0 if B{i} else y - 1.0",
        changes=[f"mod.B{i} = False", f"mod.B{i} = True"],
    )


def _global_str(i: int, rng: random.Random) -> Source:
    return Source(
        "global string",
        decl=f'S{i} = "tanh"',
        use=f'y = torch.tanh(y) if S{i} == "tanh" else torch.sigmoid(y)',
        changes=[f'mod.S{i} = "sigmoid"', f'mod.S{i} = "tanh"'],
    )


def _global_enum(i: int, rng: random.Random) -> Source:
    return Source(
        "global enum",
        decl=f"class Mode{i}(enum.Enum):\n    A = 1\n    B = 2\n\nM{i} = Mode{i}.A",
        use=f"y = y + 1.0 if M{i} is Mode{i}.A else y * 0.5",
        changes=[f"mod.M{i} = mod.Mode{i}.B", f"mod.M{i} = mod.Mode{i}.A"],
    )


def _closure_float(i: int, rng: random.Random) -> Source:
    v = _float(rng)
    decl = f"""
    def _make{i}():
        c = {v}

        def read(y):
            return y * c

        def set_(value):
            nonlocal c
            c = value

        return read, set_

    READ{i}, SET{i} = _make{i}()
    """
    return Source(
        "closure variable",
        decl=textwrap.dedent(decl),
        use=f"y = READ{i}(y)",
        changes=[f"mod.SET{i}({w})" for w in _floats(rng, v)],
    )


def _module_attr(i: int, rng: random.Random) -> Source:
    v = _float(rng)
    return Source(
        "module attribute",
        init=f"self.a{i} = {v}",
        use=f"y = y * self.a{i}",
        changes=[f"for m in models: m.a{i} = {w}" for w in _floats(rng, v)],
    )


def _module_flag(i: int, rng: random.Random) -> Source:
    return Source(
        "module flag",
        init=f'self.act{i} = "relu"',
        use=f'y = F.relu(y) if self.act{i} == "relu" else F.gelu(y)',
        changes=[f'for m in models: m.act{i} = "gelu"', f'for m in models: m.act{i} = "relu"'],
    )


def _graph_attr(i: int, rng: random.Random) -> Source:
    v = _float(rng)
    return Source(
        "Graph attribute",
        use=f"loss = loss * holder.h{i}",
        in_build=True,
        graph_attr=(f"h{i}", v),
        changes=[f"for h in holders: h.h{i} = {w}" for w in _floats(rng, v)],
    )


def _class_attr(i: int, rng: random.Random) -> Source:
    v = _float(rng)
    changes = [
        f"mod.Model.C{i} = {_float(rng)}",  # shadowed on the subclass
        f"mod.Base.C{i} = {_float(rng)}",  # changed on the base (still shadowed)
        f"del mod.Model.C{i}",  # the base's shows again
        f"for m in models: m.C{i} = {_float(rng)}",  # shadowed on the instance
    ]
    return Source(
        "class attribute",
        base_attr=(f"C{i}", v),
        use=f"y = y * self.C{i}",
        changes=changes,
    )


def _class_read(i: int, rng: random.Random) -> Source:
    v = _float(rng)
    return Source(
        "attribute of a class",
        decl=f"class Cfg{i}:\n    k = {v}",
        use=f"y = y * Cfg{i}.k",
        changes=[f"mod.Cfg{i}.k = {w}" for w in _floats(rng, v)],
    )


def _dict_item(i: int, rng: random.Random) -> Source:
    v = _float(rng)
    mixed = rng.random() < 0.5
    extra = ', "act": torch.tanh' if mixed else ""
    return Source(
        "dict item" + (" (beside a function)" if mixed else ""),
        decl=f'D{i} = {{"w": {v}{extra}}}',
        use=f'y = y * D{i}["w"]',
        changes=[
            f'mod.D{i}["w"] = {_float(rng)}',
            f'mod.D{i} = {{"w": {_float(rng)}{extra}}}',
            f'mod.D{i}["w"] = {v}',
        ],
    )


def _big_dict(i: int, rng: random.Random) -> Source:
    n = rng.choice([300, 3000])
    return Source(
        f"dict of {n} values",
        decl=f'BIG{i} = {{f"k{{j}}": 1.0 for j in range({n})}}',
        use=f'y = y * BIG{i}["k7"]',
        changes=[f'mod.BIG{i}["k7"] = {_float(rng)}', f'mod.BIG{i}["k7"] = 1.0'],
    )


def _list_items(i: int, rng: random.Random) -> Source:
    v = _float(rng)
    return Source(
        "list (summed)",
        decl=f"L{i} = [{v}, 0.5]",
        use=f"y = y * sum(L{i})",
        changes=[f"mod.L{i}[0] = {_float(rng)}", f"mod.L{i}.append(0.25)", f"mod.L{i}.pop()"],
    )


def _nested(i: int, rng: random.Random) -> Source:
    v = _float(rng)
    return Source(
        "dict in a list",
        decl=f'NEST{i} = [{{"w": {v}}}, {{"w": 1.0}}]',
        use=f'y = y * NEST{i}[0]["w"]',
        changes=[f'mod.NEST{i}[0]["w"] = {w}' for w in _floats(rng, v)],
    )


def _dataclass_field(i: int, rng: random.Random) -> Source:
    v = _float(rng)
    decl = f"@dataclasses.dataclass\nclass Opts{i}:\n    s: float = {v}\n\nO{i} = Opts{i}()"
    return Source(
        "dataclass field",
        decl=decl,
        use=f"y = y * O{i}.s",
        changes=[f"mod.O{i}.s = {w}" for w in _floats(rng, v)],
    )


def _namespace_field(i: int, rng: random.Random) -> Source:
    v = _float(rng)
    return Source(
        "namespace field",
        decl=f"NS{i} = types.SimpleNamespace(s={v})",
        use=f"y = y * NS{i}.s",
        changes=[f"mod.NS{i}.s = {w}" for w in _floats(rng, v)],
    )


def _user_object(i: int, rng: random.Random) -> Source:
    v = _float(rng)
    return Source(
        "attribute of an object of the user's class",
        decl=f"class Knobs{i}:\n    def __init__(self):\n        self.s = {v}",
        init=f"self.knobs{i} = Knobs{i}()",
        use=f"y = y * self.knobs{i}.s",
        changes=[f"for m in models: m.knobs{i}.s = {w}" for w in _floats(rng, v)],
    )


def _library_object(i: int, rng: random.Random) -> Source:
    v = _float(rng)
    return Source(
        "attribute of a library's object (a scheduler's, here a logging.Formatter's)",
        decl="import logging",
        init=f"self.sched{i} = logging.Formatter()\nself.sched{i}.sigma = {v}",
        use=f"y = y * self.sched{i}.sigma",
        changes=[f"for m in models: m.sched{i}.sigma = {w}" for w in _floats(rng, v)],
    )


def _library_property(i: int, rng: random.Random) -> Source:
    return Source(
        "property of a library's object (logging.Handler.name)",
        decl=f"import logging\nHANDLER{i} = logging.Handler()\nHANDLER{i}.name = 'on'",
        use=f"y = y * (1.5 if HANDLER{i}.name == 'on' else 0.5)",
        changes=[f"mod.HANDLER{i}.name = {w!r}" for w in ("off", "on", "off")],
    )


def _context_variable(i: int, rng: random.Random) -> Source:
    v = _float(rng)
    return Source(
        "value of a contextvars.ContextVar",
        decl=f"import contextvars\nCV{i} = contextvars.ContextVar('cv{i}', default={v})",
        use=f"y = y * CV{i}.get()",
        changes=[f"mod.CV{i}.set({w})" for w in _floats(rng, v)],
    )


def _default_argument(i: int, rng: random.Random) -> Source:
    v = _float(rng)
    return Source(
        "function default",
        decl=f"def helper{i}(y, k={v}):\n    return y * k",
        use=f"y = helper{i}(y)",
        changes=[f"mod.helper{i}.__defaults__ = ({w},)" for w in _floats(rng, v)],
    )


def _module_getattr(i: int, rng: random.Random) -> Source:
    v = _float(rng)
    read = rng.choice([f'getattr(sys.modules[__name__], "GA{i}")', f"sys.modules[__name__].GA{i}"])
    return Source(
        "module global read by name",
        decl=f"GA{i} = {v}",
        use=f"y = y * {read}",
        changes=[f"mod.GA{i} = {w}" for w in _floats(rng, v)],
    )


def _text_code(i: int, rng: random.Random) -> Source:
    v = _float(rng)
    source = f"def text{i}(y):\\n    return y * T{i}\\n"
    return Source(
        "global read by code compiled from text",
        decl=f'T{i} = {v}\nexec(compile("{source}", "<string>", "exec"), globals())',
        use=f"y = text{i}(y)",
        changes=[f"mod.T{i} = {w}" for w in _floats(rng, v)],
    )


def _replaced_code(i: int, rng: random.Random) -> Source:
    values = [_float(rng), _float(rng), _float(rng)]
    versions = "\n".join(
        f"def _code{i}_{k}(y):\n    return y * {w}\n" for k, w in enumerate(values)
    )
    return Source(
        "function whose code is replaced (a reload)",
        decl=f"{versions}\nswapped{i} = types.FunctionType(_code{i}_0.__code__, globals())",
        use=f"y = swapped{i}(y)",
        changes=[f"mod.swapped{i}.__code__ = mod._code{i}_{k}.__code__" for k in (1, 2, 0)],
    )


def _class_through_local(i: int, rng: random.Random) -> Source:
    v = _float(rng)
    decl = f"""
    class Scales{i}:
        v = {v}

        @classmethod
        def get(cls):
            return cls.v


    SC{i} = Scales{i}()
    """
    use = rng.choice([f"Scales{i}.get()", f"type(SC{i}).v", f"SC{i}.__class__.v"])
    return Source(
        "class attribute read off a local (cls, type(obj))",
        decl=textwrap.dedent(decl),
        use=f"y = y * {use}",
        changes=[f"mod.Scales{i}.v = {w}" for w in _floats(rng, v)],
    )


def _cyclic_container(i: int, rng: random.Random) -> Source:
    v = _float(rng)
    decl = rng.choice(
        [
            f"CY{i} = {{'k': {v}}}\nCY{i}['self'] = CY{i}",  # a dict that holds itself
            f"CY{i} = types.SimpleNamespace(k={v}, children=[])\n"  # a tree knowing its parent
            f"CY{i}.children.append(types.SimpleNamespace(parent=CY{i}))",
        ]
    )
    read = f"CY{i}['k']" if "self" in decl else f"CY{i}.children[0].parent.k"
    change = f"mod.CY{i}['k'] = {{}}" if "self" in decl else f"mod.CY{i}.k = {{}}"
    return Source(
        "container that holds itself",
        decl=decl,
        use=f"y = y * {read}",
        changes=[change.format(w) for w in _floats(rng, v)],
    )


def _numpy_array(i: int, rng: random.Random) -> Source:
    v = _float(rng)
    return Source(
        "numpy array changed in place",
        decl=f"import numpy\nW{i} = numpy.array([{v}, 0.5], dtype=numpy.float32)",
        use=f"y = y * float(W{i}[0])",
        changes=[f"mod.W{i}[0] = {w}" for w in _floats(rng, v)],
    )


def _partial_keyword(i: int, rng: random.Random) -> Source:
    v = _float(rng)
    return Source(
        "partial keyword",
        decl=f"P{i} = functools.partial(torch.mul, other={v})",
        use=f"y = P{i}(y)",
        changes=[f'mod.P{i}.keywords["other"] = {w}' for w in _floats(rng, v)],
    )


def _environment(i: int, rng: random.Random) -> Source:
    v = _float(rng)
    read = rng.choice(
        [f'float(os.environ["GA_FUZZ_{i}"])', f'float(os.getenv("GA_FUZZ_{i}", "1"))']
    )
    return Source(
        "environment variable",
        decl=f'os.environ["GA_FUZZ_{i}"] = "{v}"',
        use=f"y = y * {read}",
        changes=[f'os.environ["GA_FUZZ_{i}"] = "{w}"' for w in _floats(rng, v)],
    )


def _tensor_attr(i: int, rng: random.Random) -> Source:
    v = _float(rng)
    return Source(
        "tensor attribute",
        init=f"self.t{i} = torch.full((3,), {v})",
        use=f"y = y * self.t{i}",
        changes=[
            f"for m in models: m.t{i} = torch.full((3,), {_float(rng)})",  # rebound
            f"for m in models: m.t{i}.fill_({_float(rng)})",  # changed in place: read live
        ],
    )


def _int_size(i: int, rng: random.Random) -> Source:
    return Source(
        "int used as a size",
        init=f"self.n{i} = 2",
        use=f"y = y * y[:, : self.n{i}].mean()",
        changes=[f"for m in models: m.n{i} = {n}" for n in (3, 1, 2)],
    )


def _annealed(i: int, rng: random.Random) -> Source:
    return Source(
        "float annealed before every call",
        decl=f"BETA{i} = 0.5",
        use=f"y = y * (1.0 + BETA{i})",
        every_call=f"mod.BETA{i} = 0.5 + 0.1 * {{call}}",
    )


def _python_number(i: int, rng: random.Random) -> Source:
    return Source(
        "float an op needs as a Python number",
        init=f"self.slope{i} = 0.01",
        use=f"y = F.leaky_relu(y, negative_slope=self.slope{i})",
        changes=[f"for m in models: m.slope{i} = {w}" for w in (0.2, 0.05)],
    )


def _counter_written(i: int, rng: random.Random) -> Source:
    return Source(
        "counter forward() writes every call",
        init=f"self.calls{i} = 0",
        use=f"self.calls{i} += 1\ny = y * (1.0 + 0.0 * self.calls{i})",
        may_refuse=f"calls{i}",
    )


def _settling_write(i: int, rng: random.Random) -> Source:
    v = _float(rng)
    return Source(
        "attribute written once (a cache)",
        use=f'if not hasattr(self, "cache{i}"):\n    self.cache{i} = {v}\ny = y * self.cache{i}',
        changes=[f"for m in models: m.cache{i} = {_float(rng)}"],
    )


def _param_group_entry(i: int, rng: random.Random) -> Source:
    """build() reads the lr off its optimizer's param groups as a number; the loop (or a
    scheduler, as here before every call) sets it."""
    annealed = rng.random() < 0.5
    return Source(
        "optimizer's lr read by build() off its param groups",
        use="loss = loss * (1.0 + holder.the_opt.param_groups[0]['lr'])",
        in_build=True,
        changes=[]
        if annealed
        else [f"for o in opts: o.param_groups[0]['lr'] = {w}" for w in (0.03, 0.01)],
        every_call="for o in opts: o.param_groups[0].update(lr=0.01 / ({call} + 1))"
        if annealed
        else None,
    )


def _scheduler_lr(i: int, rng: random.Random) -> Source:
    """build() reads the lr its LR scheduler last set (``get_last_lr()[0]``, as a Lightning
    training_step logs it); the loop steps the scheduler before every call."""
    make = "torch.optim.lr_scheduler.StepLR(h.the_opt, step_size=1, gamma=0.9)"
    return Source(
        "LR scheduler's get_last_lr() read by build()",
        use="loss = loss * (1.0 + holder.the_sch.get_last_lr()[0])",
        in_build=True,
        # stepped before the first optimizer step: torch warns that the schedule's first lr is
        # skipped, which is what the case means (both sides alike)
        every_call="import warnings\nwith warnings.catch_warnings():\n"
        "    warnings.simplefilter('ignore')\n"
        "    for h in holders: h.__dict__.setdefault('the_sch', " + make + ").step()",
    )


SOURCES: list[Callable[[int, random.Random], Source]] = [
    _global_float,
    _global_int,
    _global_bool,
    _global_str,
    _global_enum,
    _closure_float,
    _module_attr,
    _module_flag,
    _graph_attr,
    _class_attr,
    _class_read,
    _dict_item,
    _big_dict,
    _list_items,
    _nested,
    _dataclass_field,
    _namespace_field,
    _user_object,
    _library_object,
    _library_property,
    _context_variable,
    _default_argument,
    _partial_keyword,
    _module_getattr,
    _text_code,
    _replaced_code,
    _class_through_local,
    _numpy_array,
    _cyclic_container,
    _environment,
    _tensor_attr,
    _int_size,
    _annealed,
    _python_number,
    _counter_written,
    _settling_write,
    _param_group_entry,
    _scheduler_lr,
]

# -- optimizers: one per case, with the changes a loop makes to it

_COUNTING_OPTIMIZER = '''
class GroupCountSGD(torch.optim.Optimizer):
    """Keeps its step count in its param groups (as pytorch_optimizer's optimizers do)."""

    def __init__(self, params, lr=0.1, k=3):
        super().__init__(params, {"lr": lr, "k": k})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            scale = 1.0 / group["step"] if group["step"] % group["k"] else 2.0
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"] * scale)


class CountingSGD(torch.optim.Optimizer):
    """Keeps its step count in its param groups and a Python float in its state."""

    def __init__(self, params, lr=0.1, k=3):
        super().__init__(params, {"lr": lr, "k": k})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            boost = 2.0 if group["step"] % group["k"] == 0 else 1.0
            for p in group["params"]:
                state = self.state[p]
                state["seen"] = state.get("seen", 0.0) + 1.0
                p.add_(p.grad, alpha=-group["lr"] * boost / state["seen"])
'''

OPTIMIZERS = {
    "SGD": ("torch.optim.SGD(params, lr=0.1)", ["lr"]),
    "SGD with momentum": ("torch.optim.SGD(params, lr=0.05, momentum=0.9)", ["lr", "momentum"]),
    "Adam": ("torch.optim.Adam(params, lr=0.01)", ["lr", "weight_decay"]),
    "RMSprop (traced)": ("torch.optim.RMSprop(params, lr=0.01)", ["lr", "alpha"]),
    "Python counts in groups": ("GroupCountSGD(params, lr=0.1)", ["lr", "k"]),
    "Python counts in groups and state": ("CountingSGD(params, lr=0.1)", ["lr", "k"]),
}
_OPTION_VALUES = {
    "lr": [0.02, 0.05],
    "momentum": [0.5, 0.0],
    "weight_decay": [0.01, 0.0],
    "alpha": [0.9, 0.99],
    "k": [2, 4],
}

# -- one case


@dataclasses.dataclass
class Case:
    seed: int
    sources: list[Source]
    optimizer: str
    schedule: list[list[str]]  # per call, the changes made before it
    code: str

    def describe(self) -> str:
        kinds = ", ".join(s.kind for s in self.sources)
        lines = [f"seed {self.seed}: {kinds}; optimizer {self.optimizer}"]
        for call, changes in enumerate(self.schedule):
            lines += [f"  before call {call}: {c}" for c in changes]
        return "\n".join(lines)


def make_case(seed: int, calls: int = 6) -> Case:
    rng = random.Random(seed)
    makers = rng.sample(SOURCES, rng.randint(2, 4))
    sources = [make(i, rng) for i, make in enumerate(makers)]
    optimizer = rng.choice(list(OPTIMIZERS))
    lists = [s.changes for s in sources] + [
        [f"for o in opts: o.param_groups[0][{option!r}] = {w}" for w in _OPTION_VALUES[option]]
        for option in OPTIMIZERS[optimizer][1]
    ]
    # a prefix of each list (its changes keep their order: a shadow before its removal),
    # interleaved at random, made at calls in order (call 0: before the first call)
    queues = [lst[: rng.randint(0, len(lst))] for lst in lists]
    sequence = []
    while any(queues):
        queue = rng.choice([q for q in queues if q])
        sequence.append(queue.pop(0))
    at = sorted(rng.randrange(calls) for _ in sequence)
    schedule: list[list[str]] = [[] for _ in range(calls)]
    for call, change in zip(at, sequence):
        schedule[call].append(change)
    for source in sources:
        if source.every_call is not None:
            for call, changes in enumerate(schedule):
                changes.append(source.every_call.format(call=call))
    return Case(seed, sources, optimizer, schedule, _module_code(sources, optimizer))


def _indent(text: str, spaces: int) -> str:
    return textwrap.indent(text, " " * spaces)


def _module_code(sources: list[Source], optimizer: str) -> str:
    decls = "\n\n".join(s.decl for s in sources if s.decl)
    class_attrs = "".join(
        f"    {s.base_attr[0]} = {s.base_attr[1]}\n" for s in sources if s.base_attr
    )
    inits = "\n".join(s.init for s in sources if s.init)
    holder = [s.graph_attr for s in sources if s.graph_attr]
    forward = "\n".join(s.use for s in sources if not s.in_build)
    build = "\n".join(s.use for s in sources if s.in_build)
    return f'''"""A case of the state fuzzer (tests/state_fuzz.py)."""
import dataclasses
import enum
import functools
import os
import sys
import types

import torch
import torch.nn as nn
import torch.nn.functional as F

{_COUNTING_OPTIMIZER}

HOLDER_INIT = {holder!r}

{decls}


class Base(nn.Module):
{class_attrs or "    pass"}


class Model(Base):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
{_indent(inits, 8)}

    def forward(self, x):
        y = self.lin(x)
{_indent(forward, 8)}
        return y


def make_optimizer(params):
    return {OPTIMIZERS[optimizer][0]}


def build_step(holder, model, x, y):
    loss = F.mse_loss(model(x), y)
{_indent(build, 4)}
    return loss
'''


# -- running it


@dataclasses.dataclass
class Outcome:
    refused: str | None = None  # the graphamp error a may_refuse source ended the case with
    programs: int = 0


class _Holder:
    """The eager side's stand-in for the Graph (build() reads settings on it)."""


def _import(code: str, directory: str, seed: int) -> Any:
    name = f"ga_state_fuzz_{seed}"
    path = os.path.join(directory, f"{name}.py")
    with open(path, "w") as f:
        f.write(code)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _graph(mod: Any, model: torch.nn.Module, opt: torch.optim.Optimizer) -> graphamp.Graph:
    class FuzzGraph(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(opt)
            self.the_opt = opt
            for name, value in mod.HOLDER_INIT:
                setattr(self, name, value)
            self.config.set_backend("eager")
            self.config.set_step_cache(False)
            self.config.set_progress(False)
            self.config.set_recompile_limit(64)

        def build(self, x, y):
            loss = mod.build_step(self, self.model, x, y)
            loss.backward()
            return loss

    return FuzzGraph()


def run_case(seed: int, directory: str, calls: int = 6) -> Outcome:
    """Run case ``seed`` through a Graph and eagerly; raises AssertionError (with the case)
    where they differ, or where graphamp refused what it should run."""
    case = make_case(seed, calls)
    saved_env = dict(os.environ)
    mod = _import(case.code, directory, seed)
    try:
        return _run(case, mod)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{case.describe()}\n--- the module ---\n{case.code}") from None
    finally:
        sys.modules.pop(mod.__name__, None)
        os.environ.clear()
        os.environ.update(saved_env)


def _run(case: Case, mod: Any) -> Outcome:
    torch.manual_seed(case.seed)
    model = mod.Model()
    twin = copy.deepcopy(model)
    opt, eager_opt = mod.make_optimizer(model.parameters()), mod.make_optimizer(twin.parameters())
    g = _graph(mod, model, opt)
    holder = _Holder()
    holder.the_opt = eager_opt
    for name, value in mod.HOLDER_INIT:
        setattr(holder, name, value)
    scope = {"mod": mod, "models": [model, twin], "holders": [g, holder], "opts": [opt, eager_opt]}
    scope.update(os=os, torch=torch)
    gen = torch.Generator().manual_seed(case.seed)
    for call, changes in enumerate(case.schedule):
        for change in changes:
            exec(change, scope)  # noqa: S102 - the fuzzer's own generated code
        x, y = torch.randn(5, 4, generator=gen), torch.randn(5, 3, generator=gen)
        try:
            loss = g(x, y)
        except graphamp.GraphampError as e:
            if any(s.may_refuse and s.may_refuse in str(e) for s in case.sources):
                return Outcome(refused=str(e).splitlines()[0], programs=len(g.compiled_steps))
            raise AssertionError(f"call {call}: graphamp refused: {e}") from e
        eager_opt.zero_grad()
        eager_loss = mod.build_step(holder, twin, x, y)
        eager_loss.backward()
        eager_opt.step()
        _close(loss, eager_loss.detach(), f"call {call}: the loss")
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        _close(p, q, f"parameter {name}")
    budget = _program_budget(case)
    assert len(g.compiled_steps) <= budget, (
        f"{len(g.compiled_steps)} programs compiled where at most {budget} should be: one "
        "for the first call, one per call that follows changes (a float annealed every call "
        "at most once, lifted into a step input after its first change)"
    )
    _same_python_state(vars(model), vars(twin), "the model's attributes")
    for i, (a, b) in enumerate(zip(opt.param_groups, eager_opt.param_groups)):
        _same_python_state(a, b, f"the optimizer's param_groups[{i}]")
    for p, q in zip(model.parameters(), twin.parameters()):
        _same_python_state(opt.state.get(p, {}), eager_opt.state.get(q, {}), "optimizer state")
    return Outcome(programs=len(g.compiled_steps))


def _program_budget(case: Case) -> int:
    """The most programs the schedule may compile (see the assertion)."""
    annealed = [s.every_call for s in case.sources if s.every_call is not None]
    changed = 0
    for changes in case.schedule[1:]:
        changed += any(c not in annealed and not _is_annealing(c, annealed) for c in changes)
    return 1 + changed + (1 if annealed else 0)


def _is_annealing(change: str, annealed: list) -> bool:
    return any(change.startswith(a.split("=")[0]) for a in annealed)


def _same_python_state(ours: dict, eager: dict, what: str) -> None:
    """What the user reads on their objects after the calls: the same as eager's (Python
    values equal, tensors close; parameters, submodules and hooks are compared elsewhere)."""
    for key in set(ours) | set(eager):
        a, b = ours.get(key, "<absent>"), eager.get(key, "<absent>")
        if key == "params" or key.startswith("_") or isinstance(a, torch.nn.Module):
            continue
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            _close(a.float(), b.float(), f"{what} {key!r}")
        elif type(a) is type(b) and hasattr(a, "__dict__") and not isinstance(a, type):
            _same_python_state(vars(a), vars(b), f"{what} {key!r}")  # an object of the user's
        elif a != b:
            raise AssertionError(f"{what} {key!r}: {a!r}, eager {b!r}")


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if not torch.allclose(a, b, rtol=1e-4, atol=1e-5, equal_nan=True):
        raise AssertionError(f"{what} differs from eager: {a.tolist()} against {b.tolist()}")
