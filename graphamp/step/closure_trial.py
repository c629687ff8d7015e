"""Is an optimizer's ``step()`` given a closure, and can graphamp give it one exactly?

graphamp gives ``step()`` a closure where eager code must: its signature requires one (LBFGS),
or a trial step without one raised and takes a ``closure`` (pytorch_optimizer's AliG raises
``NoClosureError``). That closure (``runner/closure.py``) returns the call's own loss and
gradients at its first evaluation and runs the compiled step again for each later one, so it
is exact only for an optimizer that evaluates the loss before it moves a parameter (LBFGS's
first step, AliG's step size). A trial on a copy says which: ``step(closure)`` runs on the
copy with a closure that notes whether a parameter changed before its first call (a
perturbation first, as BSAM's), and such an optimizer is refused by name. Nothing of the
user's is touched: the trial runs on the copy, with the random generators put back.
"""

from __future__ import annotations

import collections
import inspect
from typing import Any

import torch

from ..errors import UnsupportedOptimizerError
from ..records.update_paths import CLOSURE_REASON
from ..torchkit.host_generators import kept_host_generators
from .trial_step import RAISED, small_copy, trial_step


def _closure_parameter(optimizer: Any) -> inspect.Parameter | None:
    try:
        return inspect.signature(type(optimizer).step).parameters.get("closure")
    except (TypeError, ValueError, AttributeError):  # no step, or no signature to read
        return None


def requires_closure(optimizer: Any) -> bool:
    """Does ``step``'s signature require a closure (no default)?"""
    closure = _closure_parameter(optimizer)
    return closure is not None and closure.default is inspect.Parameter.empty


def python_step(optimizer: Any, traced: bool) -> str | None:
    """Why ``optimizer``'s own step() runs in Python after the compiled step
    (``CLOSURE_REASON``: given a closure), or None. ``traced``: its path would trace its
    step(), which a trial step decides; raises UnsupportedOptimizerError for a closure
    graphamp cannot give exactly."""
    if requires_closure(optimizer):
        _trial(optimizer, with_closure=True)
        return CLOSURE_REASON
    why = trial_step(optimizer) if traced else None
    if why is not None and why.startswith(RAISED) and _closure_parameter(optimizer) is not None:
        # the same zeros with and without a closure: only the closure tells them apart (SOAP's
        # trial raised on its NaN gradients, and runs on zeros either way)
        if not _trial(optimizer, with_closure=False) and _trial(optimizer, with_closure=True):
            return CLOSURE_REASON
    return why


def _trial(optimizer: Any, with_closure: bool) -> bool:
    """Does a copy's step() run on zero gradients, given a closure or not? With one, raises
    where it changes a parameter before it first evaluates the closure."""
    twin = small_copy(optimizer)
    twin.state = collections.defaultdict(dict, twin.state)  # as Optimizer.__init__ makes it
    params = [p for group in twin.param_groups for p in group["params"]]
    versions = [p._version for p in params]
    moved_first: list[bool] = []

    def closure() -> torch.Tensor:
        if not moved_first:
            moved_first.append(any(p._version != v for p, v in zip(params, versions)))
        for p in params:
            p.grad = torch.zeros_like(p)
        return torch.zeros(())

    for p in params:
        p.grad = torch.zeros_like(p)
    try:
        with kept_host_generators():
            type(twin).step(twin, *([closure] if with_closure else []))
        ran = True
    except Exception:  # its own code, on a trial's zeros
        ran = False
    if moved_first and moved_first[0]:
        raise UnsupportedOptimizerError(
            f"{type(optimizer).__name__}.step(closure) changes the parameters before it first "
            "evaluates its closure (a perturbation, as SAM's), so graphamp's closure could not "
            "stand its first evaluation in for the step's own forward and backward: train it "
            "eagerly, or write the perturbation in build() (gradient code in build(), as "
            "docs/what-works.md shows for SAM)"
        )
    return ran
