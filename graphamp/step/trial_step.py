"""Can an optimizer's ``step()`` be traced into the step exactly? One trial step on a copy says.

A traced ``step()`` is a snapshot of one run of its Python code: a Python number it reads is
baked in, a Python object it writes is written once, at assembly, on a shadow. That is exact
only for an update that is tensor arithmetic on its tensor state. Before an optimizer outside
graphamp's own updates is traced, one step of a deep copy of it runs (gradients NaN, as
``traced_optimizer.initial_state_by_eager_step`` feeds them; the same options the trace uses:
capturable, single-tensor, ``torch.compiler.is_compiling()`` true), and everything it did
outside its tensors is compared with what the trace could reproduce:
- a Python value it wrote: into a param group (``group["step"] += 1``: every
  ``pytorch_optimizer`` optimizer, timm's Lamb), into its own attributes, or as state (a Python
  ``step`` count, CAME's float ``RMS``);
- state whose first value depends on the gradient (Adan's ``previous_grad``);
- a tensor value read on the host (``.item()``, ``bool(t)``: Prodigy, Adafactor), each a sync
  on a GPU and a value a trace would freeze;
- another optimizer it wraps (Lookahead), whose own groups the shadow could not take;
- its step raising on the trial, or the optimizer not copying.
Any of these, and ``step()`` runs as eager runs it, in Python after the compiled step
(``records.update_paths.PYTHON_STEP``), with the gradients the step computed; ``trial_step`` returns
the reason, which ``print(g)`` and the INFO line give. Nothing of the user's is touched: the
trial runs on the copy, and the random generators it drew from are put back.
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch.ops.aten._local_scalar_dense, torch.utils._python_dispatch
import collections
import copy
import dataclasses
import math
import os
import sys
import types
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..torchkit.host_generators import kept_host_generators
from ..torchkit.process_state import compiling
from .traced_optimizer import TRACE_OPTIONS, FirstValues

RAISED = "its step() raised on a trial step"  # the reason's start (closure_trial.py reads it)
_HOOKS = frozenset(
    {
        "_optimizer_step_pre_hooks",
        "_optimizer_step_post_hooks",
        "_optimizer_state_dict_pre_hooks",
        "_optimizer_state_dict_post_hooks",
        "_optimizer_load_state_dict_pre_hooks",
        "_optimizer_load_state_dict_post_hooks",
        "_zero_grad_profile_name",
    }
)


def trial_step(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer.step()`` cannot be traced exactly (module docstring); None if it can."""
    inner = next((k for k, v in vars(optimizer).items() if _is_optimizer(v)), None)
    if inner is not None:
        return f"it wraps another optimizer (.{inner}), whose step() it calls"
    try:
        twin = small_copy(optimizer)
    except Exception as e:  # an optimizer holding something that does not copy
        return f"it cannot be copied for a trial step ({type(e).__name__}: {_first_line(e)})"
    # what each state key is first set to: a NaN there came from the (NaN) gradient
    twin.state = collections.defaultdict(
        FirstValues, {p: FirstValues(s) for p, s in twin.state.items()}
    )
    for group in twin.param_groups:
        group.update({k: v for k, v in TRACE_OPTIONS.items() if k in group})
        for p in group["params"]:
            p.grad = torch.full_like(p, math.nan) if p.requires_grad else None
    groups_before = [_snapshot(g, skip={"params"}) for g in twin.param_groups]
    attributes_before = _snapshot(vars(twin), skip={"param_groups", "state", *_HOOKS})
    reads = _HostReads()
    try:  # the generators are the user's: a step that draws leaves them as they were
        with kept_host_generators(), compiling(), torch.no_grad(), reads:
            type(twin).step(twin)
    except Exception as e:  # its own code, on NaN gradients: eager runs it on real ones
        return f"{RAISED} ({type(e).__name__}: {_first_line(e)})"
    return (
        _written_groups(twin, groups_before)
        or _written_attributes(twin, attributes_before)
        or _untraceable_state(twin)
        or (
            f"its step() reads a tensor's value on the host ({reads.first})"
            if reads.first
            else None
        )
    )


def small_copy(optimizer: torch.optim.Optimizer) -> Any:
    """A deep copy of the optimizer over one trainable parameter of each group (and its state):
    what its step() does outside its tensors does not depend on how many it updates, and the
    trial then costs one parameter per group, not a copy of the model. Not copy.deepcopy:
    Optimizer.__getstate__ keeps only defaults, state and groups."""
    groups = []
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if p.requires_grad][:1]
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    state = {p: optimizer.state[p] for g in groups for p in g["params"] if p in optimizer.state}
    twin = object.__new__(type(optimizer))
    twin.__dict__.update(copy.deepcopy({**vars(optimizer), "param_groups": groups, "state": state}))
    return twin


def _written_groups(twin: Any, before: list[dict]) -> str | None:
    for i, (group, old) in enumerate(zip(twin.param_groups, before)):
        new = _snapshot(group, skip={"params"})
        key = _first_written(old, new)
        if key is not _GONE:
            return (
                f"its step() writes param_groups[{i}][{key!r}] (now "
                f"{_shown(new.get(key, _GONE))}), a Python value a traced step would write once"
            )
    return None


def _written_attributes(twin: Any, before: dict) -> str | None:
    key = _first_written(before, _snapshot(vars(twin), skip={"param_groups", "state", *_HOOKS}))
    if key is _GONE:
        return None
    return f"its step() writes its attribute .{key}, which a traced step would write once"


def _first_written(before: dict, after: dict) -> Any:
    """The first key added, removed or changed between two snapshots (``_GONE``: none)."""
    for key in sorted(set(after) | set(before), key=str):
        if key not in before or not _same(before[key], after.get(key, _GONE)):
            return key
    return _GONE


def _untraceable_state(twin: Any) -> str | None:
    for per_param in twin.state.values():
        for key, value in {**per_param, **per_param.first}.items():
            if not isinstance(value, torch.Tensor):
                return (
                    f"it keeps state[{key!r}] as a Python {type(value).__name__}, which a "
                    "traced step would bake in at its first value"
                )
            if key in per_param.first and _has_nan(per_param.first[key]):
                return f"it starts state[{key!r}] from the first gradient"
    return None


def _has_nan(value: torch.Tensor) -> bool:
    return value.is_floating_point() and bool(torch.isnan(value).any())


_GONE = object()


def _snapshot(namespace: dict, skip: set[str]) -> dict:
    """The namespace's entries but ``skip``, copied; a tensor as which one it is and how often
    it was written (``group["step"].add_(1)``: timm's Lamb keeps its count so)."""
    out = {}
    for key, value in namespace.items():
        if key in skip:
            continue
        if isinstance(value, torch.Tensor):
            out[key] = _TensorSeen(id(value), value._version)
            continue
        try:
            out[key] = copy.deepcopy(value)
        except Exception:  # compared by identity instead
            out[key] = value
    return out


@dataclasses.dataclass(frozen=True)
class _TensorSeen:
    identity: int
    version: int

    def __repr__(self) -> str:
        return "a tensor written in place"


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:  # tensors inside containers, objects without __eq__
        return False


def _shown(value: Any) -> str:
    return "deleted" if value is _GONE else repr(value)[:60]


def _is_optimizer(value: Any) -> bool:
    return isinstance(value, torch.optim.Optimizer)


def _first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [""])[0][:160]


class _HostReads(TorchDispatchMode):
    """Notes the first tensor value read on the host (``aten._local_scalar_dense``: what
    ``.item()``, ``float(t)`` and ``bool(t)`` dispatch to) that the trace could not keep on the
    device. A number read only to be the scalar argument of the next op (``addcdiv_(value=
    -clr)`` with a tensor ``clr``: torch's Adagrad) is one ``tensorify_scalar_reads`` rewrites
    as tensor arithmetic, so it is no host read of the traced step."""

    first: str | None = None
    _pending: tuple[Any, str] | None = None  # the number just read, and where

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ARG002 - torch's
        kwargs = kwargs or {}
        if self._pending is not None:
            value, where = self._pending
            self._pending = None
            if not _takes_as_scalar(func, args, kwargs, value):
                self.first = self.first or where
        out = func(*args, **kwargs)
        if func is torch.ops.aten._local_scalar_dense.default:
            self._pending = (out, _caller())
        return out

    def __exit__(self, *exc: Any) -> Any:
        if self._pending is not None:  # the read was the last thing it did
            self.first = self.first or self._pending[1]
        return super().__exit__(*exc)


# op -> the argument (position, or keyword) tensorify_scalar_reads rewrites when it is a read
_SCALAR_ARGUMENTS = {
    "add": ("alpha", 1),
    "sub": ("alpha", 1),
    "mul": (1,),
    "div": (1,),
    "addcdiv": ("value",),
    "addcmul": ("value",),
    "lerp": (2,),
}


def _takes_as_scalar(func: Any, args: tuple, kwargs: dict, value: Any) -> bool:
    name = func.overloadpacket.__name__.rstrip("_")
    for where in _SCALAR_ARGUMENTS.get(name, ()):
        got = (
            kwargs.get(where) if isinstance(where, str) else (args[where : where + 1] or [None])[0]
        )
        if not isinstance(got, torch.Tensor) and got is not None and _same(got, value):
            return True
    return False


def _caller() -> str:
    """The optimizer's line that read the value (the innermost frame outside torch's
    dispatch and disabling wrappers and this module)."""
    frame: types.FrameType | None = sys._getframe(2)
    while frame is not None and _machinery(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return "a value read as a Python number"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def _machinery(filename: str) -> bool:
    return filename == __file__ or any(
        part in filename for part in ("torch/utils/", "torch/_dynamo/", "torch/_compile")
    )
