"""Any optimizer's own ``step()``, traced into the step (the optimizers graphamp has no
multi-tensor update of its own for: RMSprop, NAdam, RAdam, Adamax, Adadelta, Adagrad, ASGD,
Rprop, Muon, third-party ones written in plain torch).

The optimizer's ``step()`` runs during assembly on a shadow of the optimizer: the same class
and defaults, one param group whose parameters are copies of the step's traced parameters
(their ``.grad`` the traced gradients) and whose state is the step's state inputs. torch's
optimizers take their compiled path (``torch.compiler.is_compiling()`` is True while it runs,
as under ``torch.compile``) in capturable form on the single-tensor path, so step counters
stay tensors on the device. The learning rate is a step input (a 0-dim float32 tensor), so a
scheduler changing it compiles nothing; where an optimizer passes it to an op as a Python
number (``add(alpha=-lr)``, ``addcdiv(value=-lr)``), that read is rewritten as tensor
arithmetic (``tensorify_scalar_reads``). What the shadow's step wrote is then masked by the
overflow flag and written back, as for the built-in updates.

An optimizer creates its state at its first step. Its first values are found once, eagerly, by
one step of the shadow on a copy of each parameter, with NaN gradients, recording what each
state key is first set to (``initial_state_by_eager_step``): a value that holds NaN depends on the
gradient, and such an optimizer is refused, as is state that is not a tensor (a Python step
count would be baked into the step).
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch.ops.aten._local_scalar_dense
import collections
from typing import Any

import torch
import torch.compiler
import torch.fx as fx

from ..errors import UnsupportedOptimizerError
from ..records.optimizers import InitialState
from ..records.subgraphs import Subgraph, subgraph_of
from ..torchkit.fxutil import drop_profiler_markers
from ..torchkit.host_generators import kept_host_generators
from ..torchkit.process_state import compiling

# group options set for the traced step: the capturable single-tensor form, no fused kernels
TRACE_OPTIONS = {"capturable": True, "foreach": False, "fused": False, "differentiable": False}
_EAGER_STEP_OPTIONS = {
    "capturable": False,
    "foreach": False,
    "fused": False,
    "differentiable": False,
}


def initial_state_by_eager_step(
    optimizer: torch.optim.Optimizer, group_index: int, params: list[torch.Tensor]
) -> list[dict[str, InitialState]]:
    """Per parameter, the state the optimizer creates at its first step (module docstring)."""
    group = optimizer.param_groups[group_index]
    out = []
    for p in params:
        existing = optimizer.state.get(p)
        if existing:  # made at construction (Adagrad's sum) or by earlier eager steps
            out.append(_initial(optimizer, existing))
            continue
        work = p.detach().clone()
        work.grad = torch.full_like(work, float("nan"))
        state: collections.defaultdict = collections.defaultdict(FirstValues)
        shadow = _shadow(
            optimizer, {**group, **_options(group, _EAGER_STEP_OPTIONS)}, [work], state
        )
        with kept_host_generators(), torch.no_grad():
            type(optimizer).step(shadow)  # not an instance attribute (a scheduler wraps one)
        out.append(_initial(optimizer, state[work].first))
    return out


def traced_update(
    optimizer: torch.optim.Optimizer,
    group_index: int,
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    states: list[dict[str, torch.Tensor]],
    lr: torch.Tensor,
) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """The optimizer's step on traced values: (new parameters, new state), nothing written."""
    group = optimizer.param_groups[group_index]
    group = {**group, **_options(group, TRACE_OPTIONS), "lr": lr}
    work = [p.clone() for p in params]
    for w, g in zip(work, grads):
        w.grad = g.clone()
    state = collections.defaultdict(
        dict, {w: {k: v.clone() for k, v in s.items()} for w, s in zip(work, states)}
    )
    shadow = _shadow(optimizer, group, work, state)
    with compiling(), torch.no_grad():
        type(optimizer).step(shadow)
    return work, [dict(state[w]) for w in work]


def tensorify_scalar_reads(gm: fx.GraphModule) -> None:
    """In the optimizer's part of the step, a 0-dim tensor read as a Python number for an op's
    scalar argument (``add(x, y, alpha=-lr)``) becomes tensor arithmetic on that tensor; the
    graph's profiler markers (``record_function`` around ``step()``) are dropped. A read this
    cannot rewrite is refused, by op: it would be a host read, a sync on a GPU, every step."""
    graph = gm.graph
    drop_profiler_markers(graph)
    reads = [n for n in graph.nodes if n.target is torch.ops.aten._local_scalar_dense.default]
    for read in reads:
        if subgraph_of(read) != Subgraph.OPTIMIZER:
            continue
        for user in list(read.users):
            with graph.inserting_before(user):
                replacement = _tensor_form(graph, user, read, read.args[0])
            if replacement is None:
                raise UnsupportedOptimizerError(
                    f"the optimizer's step passes a tensor as a Python number to {user.target}, "
                    "a host read at every step that graphamp cannot rewrite"
                )
            replacement.meta.update(user.meta)
            user.replace_all_uses_with(replacement)
            graph.erase_node(user)
        graph.erase_node(read)
    graph.lint()
    gm.recompile()


def _tensor_form(graph: fx.Graph, user: fx.Node, read: fx.Node, t: fx.Node) -> fx.Node | None:
    """``user`` (which takes ``read``, the number in ``t``) as ops on ``t``; None if unknown."""
    aten = torch.ops.aten
    args, kwargs = list(user.args), dict(user.kwargs)

    def call(op: Any, *a: Any) -> fx.Node:
        return graph.call_function(op, tuple(a))

    target = user.target
    if target in (aten.add.Tensor, aten.sub.Tensor) and kwargs.get("alpha") is read:
        if read in args:
            return None
        return call(target, args[0], call(aten.mul.Tensor, args[1], t))
    if target in (aten.mul.Tensor, aten.div.Tensor, aten.add.Tensor, aten.sub.Tensor):
        if kwargs or args[0] is read:
            return None
        return call(target, args[0], t)
    if target in (aten.addcdiv.default, aten.addcmul.default) and kwargs.get("value") is read:
        x, a, b = args
        combine = aten.div.Tensor if target is aten.addcdiv.default else aten.mul.Tensor
        return call(aten.add.Tensor, x, call(combine, call(aten.mul.Tensor, a, t), b))
    if target is aten.lerp.Scalar and args[2] is read:
        return call(aten.lerp.Tensor, args[0], args[1], t)
    return None


def _shadow(optimizer: Any, group: dict, params: list, state: Any) -> Any:
    """An optimizer of the same class and settings over ``params`` and ``state``, without the
    user's step hooks (the step is traced; hooks would run at assembly, not at every call)."""
    shadow = object.__new__(type(optimizer))
    shadow.__dict__.update(optimizer.__dict__)
    shadow.param_groups = [{**group, "params": params}]
    shadow.state = state
    shadow._optimizer_step_pre_hooks = collections.OrderedDict()
    shadow._optimizer_step_post_hooks = collections.OrderedDict()
    return shadow


def _options(group: dict, options: dict) -> dict:
    return {k: v for k, v in options.items() if k in group}


class FirstValues(dict):
    """A parameter's state dict that remembers what each key it did not hold was first set
    to."""

    def __init__(self, existing: dict | None = None) -> None:
        super().__init__(existing or {})
        self.first: dict[str, Any] = {}

    def __setitem__(self, key: str, value: Any) -> None:
        if key not in self.first:
            self.first[key] = value.detach().clone() if isinstance(value, torch.Tensor) else value
        super().__setitem__(key, value)


def _initial(optimizer: Any, state: dict) -> dict[str, InitialState]:
    """A parameter's state as its first values, each checked (``_check_initial``)."""
    for key, value in state.items():
        _check_initial(optimizer, key, value)
    return {key: InitialState.of(value) for key, value in state.items()}


def _check_initial(optimizer: Any, key: str, value: Any) -> None:
    name = type(optimizer).__name__
    if not isinstance(value, torch.Tensor):
        raise UnsupportedOptimizerError(
            f"{name} keeps state[{key!r}] as a Python {type(value).__name__}: traced into the "
            "step it would be baked in at its first value. Only tensor state can be a step's "
            "state"
        )
    if value.is_floating_point() and bool(torch.isnan(value).any()):
        raise UnsupportedOptimizerError(
            f"{name} starts state[{key!r}] from the first gradient (its first value depends on "
            "it), which graphamp's traced update cannot reproduce yet: train it eagerly"
        )
