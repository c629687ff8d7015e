"""The step cache's key: one digest of everything assembly and outlining read.

Assembly (``step/assemble.py``) traces the step from the plan, the forward after the AMP passes
and the metadata of the example inputs; outlining reads the traced step. Those are fed into the
key in full, by one walker (``_Digest``), together with the versions of torch and graphamp's
own source. The user's code reaches the key through the forward: capture runs build() again in
every process, so a changed model, build(), config value or attribute read gives a different
forward graph (or plan) and a different key. Where in the user's files each op was traced is
not in the key: an edit that only moves lines is the same step. Nothing is left out by default:
an object the walker does not know makes the step uncacheable (``Uncacheable``, with the
reason) rather than a key that might not see a change.

Steps whose assembly runs user Python outside the forward graph are refused for that reason:
a custom autograd Function (assembly calls its forward and backward again) and a GradScaler
subclass (its update is traced into the step). A data-parallel step's process group enters the
key as its name, backend and size: the step's collectives name the group, and its averaging
divides by the size; each rank's own position is a step input.
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._ops
import dataclasses
import enum
import functools
import hashlib
import os
import re
from typing import Any, Iterable

import sympy
import torch
import torch.fx as fx
import torch.nn as nn

from ..records.frames import SOURCE_LINE_META, UserFrame
from ..records.layouts import StepLayout
from ..records.optimizers import OptimizerPlan
from ..records.replays import Place
from ..records.update_paths import MULTI_TENSOR
from ..torchkit.function_calls import FunctionCall

FORMAT = "graphamp-step-1"

# provenance kept for debugging, which does not change what a node computes: node names and
# graph ids of earlier passes (``id()``, different in every process), and where in the user's
# files the node was traced (a line moved by an edit elsewhere in the script is the same step;
# the assembled step keeps no source lines, so a loaded one never shows stale ones)
_SKIPPED_META = frozenset({"from_node", *SOURCE_LINE_META})
# fields that are not inputs of assembly: what capture read (its values shaped the forward,
# which is in the key) and a callback that undoes capture's writes if a later stage fails
_SKIPPED_FIELDS = {
    "CapturedForward": frozenset({"undo_writes", "attribute_reads"}),
    # a traced optimizer's first state values: used when the state is made, not traced
    "GroupPlan": frozenset({"initial"}),
}


class Uncacheable(Exception):
    """The step depends on something the key cannot see; the message says what."""


def step_key(parts: Iterable[Any]) -> str:
    """The hex digest of ``parts`` (each walked in full), with the torch and graphamp versions."""
    digest = _Digest()
    digest.feed((FORMAT, torch.__version__, torch.version.git_version, graphamp_source()))
    for part in parts:
        digest.feed(part)
    return digest.hexdigest()


@functools.cache
def graphamp_source() -> str:
    """A digest of graphamp's own Python source (an edited graphamp never meets an old entry)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


class _Digest:
    """sha256 over a canonical text of an object tree (see the module docstring)."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()

    def hexdigest(self) -> str:
        return self._h.hexdigest()

    def _text(self, text: str) -> None:
        self._h.update(text.encode())
        self._h.update(b"\x00")

    def feed(self, obj: Any) -> None:
        if not (self._value(obj) or self._container(obj) or self._record(obj)):
            raise Uncacheable(f"the step depends on a {_qualname(type(obj))}")

    def _value(self, obj: Any) -> bool:
        """Scalars, torch's value types, types, ops and library functions."""
        if isinstance(obj, str):
            # Jupyter names a cell's file after the kernel's process id (ipykernel_<pid>/...):
            # the same cell's code after a kernel restart is the same step
            self._text("str:" + _IPYKERNEL.sub("ipykernel", obj))
        elif obj is None or isinstance(obj, (bool, int, float, bytes)):
            self._text(f"{type(obj).__name__}:{obj!r}")
        elif isinstance(obj, _TORCH_VALUES):
            self._text(f"torch:{obj}")
        elif isinstance(obj, sympy.Basic):  # sizes of data-dependent shapes (unbacked_bindings)
            self._text(f"sympy:{obj}")
        elif isinstance(obj, enum.Enum):
            self._text(f"enum:{_qualname(type(obj))}.{obj.name}")
        elif isinstance(obj, type):
            self._text(f"type:{_qualname(obj)}")
        elif isinstance(obj, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            self._text(f"op:{obj}")
        elif isinstance(obj, torch._ops.HigherOrderOperator):
            self._text(f"hop:{obj.name()}")
        elif callable(obj) and getattr(obj, "__module__", None) in _LIBRARY_FUNCTIONS:
            self._text(f"fn:{obj.__module__}.{obj.__qualname__}")
        else:
            return False
        return True

    def _container(self, obj: Any) -> bool:
        """Tensors (their metadata), graphs, and the containers of the above."""
        if isinstance(obj, torch.Tensor):
            self._tensor(obj)
        elif isinstance(obj, fx.Node):
            self._text(f"%{obj.name}")
        elif isinstance(obj, fx.GraphModule):
            self._graph_module(obj)
        elif isinstance(obj, (list, tuple)):
            self._text(f"{type(obj).__name__}[{len(obj)}")
            for item in obj:
                self.feed(item)
            self._text("]")
        elif isinstance(obj, dict):
            self._text(f"dict[{len(obj)}")
            for key in sorted(obj, key=repr):
                self.feed(key)
                self.feed(obj[key])
            self._text("]")
        elif isinstance(obj, (set, frozenset)):
            self._text(f"set[{sorted(map(_short, obj))!r}]")
        elif _is_treespec(obj):
            self._text(f"treespec:{obj}")
        else:
            return False
        return True

    def _record(self, obj: Any) -> bool:
        """graphamp's records (dataclasses, field by field) and the user objects a plan holds."""
        if isinstance(obj, FunctionCall):
            raise Uncacheable(
                f"the step calls the custom autograd Function {_qualname(obj.cls)}, whose "
                "Python code the key cannot see"
            )
        if _is_process_group(obj):
            # what a step traced over the group depends on: the collectives name the group,
            # the averaging divides by its size (the rank is a step input, not in the graph)
            self._text(f"group:{obj.group_name}:{obj.name()}:{obj.size()}")
        elif _is_grad_scaler(obj):
            self._text("scaler")
            self.feed(obj.settings())
        elif isinstance(obj, torch.optim.Optimizer) or (
            isinstance(obj, OptimizerPlan) and obj.path.in_python
        ):
            self._optimizer(obj)
        elif isinstance(obj, Place):
            # where the runtime puts a tensor build() wrote (records/replays.py): the step only
            # outputs it, and the place is this process's capture's, never the cache's; so it
            # is keyed by how the user names it, not by the object that holds it (a module, a
            # module's globals), which would make the step uncacheable
            self._text("place")
            self.feed((obj.kind, obj.name, repr(obj.key), obj.label))
        elif isinstance(obj, StepLayout):
            self._text("layout")
            self.feed(obj.names)
            self.feed(sorted(obj.sizes.items()))
        elif isinstance(obj, nn.Module):
            raise Uncacheable(f"the plan holds the module {_qualname(type(obj))}")
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            self._dataclass(obj)
        elif type(obj) is object:  # a sentinel (records.spec.TENSOR, replays.TENSOR_SLOT)
            self._text("sentinel")
        else:
            return False
        return True

    def _optimizer(self, obj: torch.optim.Optimizer | OptimizerPlan) -> None:
        if isinstance(obj, OptimizerPlan):
            # its step() runs in Python after the step: no code of it is in the step, which
            # only hands it its parameters' gradients (in the plan's order, fed below)
            self._text(f"eager-optimizer:{_qualname(type(obj.optimizer))}")
            self.feed([g.params for g in obj.groups])
            self.feed((obj.index, obj.clip_max_norm, obj.clip_norm_type))
            return
        # its options that change the traced update are the plan's GroupPlan.flags; the
        # hyperparameters are inputs of the step. An optimizer outside torch.optim whose
        # own step() is traced runs code the key cannot see
        if type(obj) not in MULTI_TENSOR and not type(obj).__module__.startswith("torch.optim"):
            raise Uncacheable(
                f"the step traces {_qualname(type(obj))}.step(), whose Python code the key "
                "cannot see"
            )
        self._text(f"optimizer:{_qualname(type(obj))}")

    def _tensor(self, t: torch.Tensor) -> None:
        self._text(
            f"tensor:{tuple(t.shape)}:{t.stride() if t.layout is torch.strided else ''}:"
            f"{t.dtype}:{t.device}:{t.requires_grad}"  # cuda:1 is not cuda:0's step
        )

    def _values(self, t: torch.Tensor) -> None:
        self._tensor(t)
        self._h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())

    def _dataclass(self, obj: Any) -> None:
        if isinstance(obj, UserFrame):  # where something was traced (see _SKIPPED_META)
            self._text("frame")
            return
        name = type(obj).__name__
        self._text(f"dataclass:{_qualname(type(obj))}")
        skipped = _SKIPPED_FIELDS.get(name, frozenset())
        for f in dataclasses.fields(obj):
            if f.name not in skipped:
                self._text(f.name)
                self.feed(getattr(obj, f.name))

    def _graph_module(self, gm: fx.GraphModule) -> None:
        """Every node with its target, arguments and metadata; the values of the tensors the
        graph holds as attributes; the same for its graph submodules (outlined regions)."""
        self._text(f"graph[{len(gm.graph.nodes)}")
        for node in gm.graph.nodes:
            self._text(f"{node.op}:{node.name}:{_target(node.target)}")
            self.feed(node.args)
            self.feed(node.kwargs)
            self.feed({k: v for k, v in node.meta.items() if k not in _SKIPPED_META})
        for name, value in sorted(vars(gm).items()):
            if isinstance(value, torch.Tensor):
                self._text(name)
                self._values(value)
        for name, t in [*gm.named_parameters(), *gm.named_buffers()]:
            self._text(name)
            self._values(t)
        for name, sub in gm.named_children():
            self._text(f"child:{name}")
            if isinstance(sub, fx.GraphModule):
                self._graph_module(sub)
            else:
                raise Uncacheable(f"the graph holds the module {_qualname(type(sub))}")
        self._text("]")


# functions that appear as node targets or in node metadata (source_fn_stack): torch's and
# graphamp's, whose code is in the key through the versions above
_LIBRARY_FUNCTIONS = ("builtins", "_operator", "operator", "math")
_TORCH_VALUES = (
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    torch.SymInt,
    torch.SymFloat,
    torch.SymBool,
)
_IPYKERNEL = re.compile(r"ipykernel_\d+")


def _is_process_group(obj: Any) -> bool:
    group_class = getattr(torch.distributed, "ProcessGroup", None)  # None: built without it
    return group_class is not None and isinstance(obj, group_class)


def _target(target: Any) -> str:
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None) or ""
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        if _namespace(target) not in _TORCH_NAMESPACES:
            raise Uncacheable(
                f"the step calls the custom op {target}, whose Python kernels (autograd, fake) "
                "the key cannot see"
            )
        return str(target)
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"hop:{target.name()}"
    if module.split(".")[0] in ("torch", "graphamp", *_LIBRARY_FUNCTIONS):
        return f"{module}.{getattr(target, '__qualname__', target)}"
    raise Uncacheable(f"a graph node calls {module}.{getattr(target, '__qualname__', target)}")


# the op libraries of torch and graphamp, whose kernels are fixed by torch's version and
# graphamp's source (both in the key); another library's op (torch.library.custom_op, a
# package's extension) may have a Python backward or fake kernel that changes between runs
_TORCH_NAMESPACES = frozenset(
    {
        "aten",
        "prims",
        "rngprims",
        "graphamp",
        "_c10d_functional",
        "c10d_functional",
        "_c10d_functional_autograd",
        "_dtensor",
        "inductor",
        "quantized",
        "_quantized",
        "quantized_decomposed",
        "mkldnn",
        "onednn",
    }
)


def _namespace(op: Any) -> str:
    name = getattr(op, "_qualified_op_name", None) or op.name()
    return name.split("::")[0]


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _short(obj: Any) -> str:
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return repr(obj)
    raise Uncacheable(f"the step depends on a set of {_qualname(type(obj))}")


def _is_grad_scaler(obj: Any) -> bool:
    # by name: the runtime layer does not import the user-facing scaler module
    if not any(
        c.__module__ == "graphamp.scaler" and c.__name__ == "GradScaler" for c in type(obj).__mro__
    ):
        return False
    if type(obj).__module__.split(".")[0] != "graphamp":
        raise Uncacheable(
            f"the step traces {_qualname(type(obj))}, a GradScaler subclass whose Python "
            "code the key cannot see"
        )
    return True


def _is_treespec(obj: Any) -> bool:
    return type(obj).__name__ == "TreeSpec"
