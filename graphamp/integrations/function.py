"""``graphamp.training_step``: a Graph made from a plain step function, no subclass.

::

    @graphamp.training_step(model, opt, amp=torch.bfloat16, scaler=graphamp.GradScaler())
    def train_step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

``train_step`` *is* a ``graphamp.Graph`` (its class is named after the function): the function is
its ``build()``, the model is registered, the optimizer added, so every rule of the Graph holds
and every inspection is there (``print``, ``precision_report``, ``dump``, ``state_dict``,
``compiled_steps``, ``config``, ``history``). The function reads the model from its own scope:
graphamp registers that same object, so capture sees its parameters as inputs.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn as nn

from ..errors import ConfigError
from ..graph import Graph


def training_step(
    model: nn.Module | Mapping[str, nn.Module],
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    *,
    amp: torch.dtype | None = None,
    scaler: Any = None,
    lr_sch: Any = None,
    clip_grad_max_norm: float | None = None,
) -> Callable[[Callable], Graph]:
    """Decorate a step function: forward, loss, ``loss.backward()``, return what you want back.

    ``model``: the module the function calls, or ``{"name": module}`` for several (a GAN's
    generator and discriminator). ``optimizer``: one or a list (none: an eval step). ``amp``:
    ``torch.float16`` or ``torch.bfloat16`` (None: fp32). ``scaler``: as
    ``Graph.set_grad_scaler``. ``lr_sch``: one scheduler per optimizer (a list for several),
    stepped after each call. ``clip_grad_max_norm``: clip every optimizer's gradients, after
    unscaling. Everything else is set on the result, as on any Graph
    (``train_step.config.set_backend("aot_eager")``).
    """
    modules = _named_modules(model)
    optimizers = _as_list("optimizer", optimizer)
    schedulers = _as_list("lr_sch", lr_sch) or [None] * len(optimizers)
    if len(schedulers) != len(optimizers):
        raise ConfigError(
            f"graphamp.training_step got {len(optimizers)} optimizer(s) and {len(schedulers)} "
            "lr_sch: pass one scheduler per optimizer (None for an optimizer without one)"
        )
    if amp is not None and amp not in (torch.float16, torch.bfloat16):
        raise ConfigError(
            f"graphamp.training_step(amp={amp!r}): amp is torch.float16, torch.bfloat16 or None"
        )

    def make(fn: Callable) -> Graph:
        if not callable(fn):
            raise ConfigError(
                f"graphamp.training_step(...) decorates a step function, got {type(fn).__name__}"
            )
        # the function is the class's build() (a staticmethod: it takes no self), so the Graph
        # sees it from __init__ on, as it sees a subclass's build()
        body = {"__module__": fn.__module__, "__doc__": fn.__doc__, "build": staticmethod(fn)}
        g = type(fn.__name__, (Graph,), body)()
        for name, module in modules.items():
            setattr(g, name, module)
        for opt, sch in zip(optimizers, schedulers):
            g.add_optimizer(opt, lr_sch=sch, clip_grad_max_norm=clip_grad_max_norm)
        if amp is not None:
            g.config.enable_amp(True, dtype=amp)
        if scaler is not None:
            g.set_grad_scaler(scaler)
        return g

    return make


def _named_modules(model: Any) -> dict[str, nn.Module]:
    """The modules to register, by name: ``model`` alone is registered as ``model``."""
    named = {"model": model} if isinstance(model, nn.Module) else model
    if not isinstance(named, Mapping) or not named:
        raise ConfigError(
            "graphamp.training_step takes the model (an nn.Module) or a dict of named modules, "
            f"got {type(model).__name__}"
        )
    for name, module in named.items():
        if not isinstance(module, nn.Module):
            raise ConfigError(
                f"graphamp.training_step: {name!r} is a {type(module).__name__}, not an nn.Module"
            )
        if not isinstance(name, str) or not name.isidentifier() or _graph_owns(name):
            raise ConfigError(
                f"graphamp.training_step: {name!r} cannot name a module (an identifier that is "
                "not one of Graph's own attributes, such as 'model' or 'generator')"
            )
    return dict(named)


def _graph_owns(name: str) -> bool:
    """A Graph's own attribute: its methods and properties, its config, its private state."""
    return name.startswith("_") or name == "config" or hasattr(Graph, name)


def _as_list(what: str, value: Any) -> list:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    if what == "optimizer" and not isinstance(value, torch.optim.Optimizer):
        raise ConfigError(
            "graphamp.training_step's optimizer is a torch.optim.Optimizer or a list of them, "
            f"got {type(value).__name__}"
        )
    return [value]
