"""What a step knows of each optimizer: its plan (``OptimizerPlan``: its update path, param
groups, state slots and hyperparameter inputs) and torch's state format.

The optimizer state lives in ``optimizer.state`` in torch's own format (``momentum_buffer``;
``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``), updated in place by the compiled step,
so ``optimizer.state_dict()`` is always current. ``step`` tensors live on the parameters'
device, as torch keeps them for ``capturable=True``. How each optimizer updates is its
``UpdatePath`` (``update_paths.py``); the update math itself is traced by
``step/optimizer_update.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch

from ..errors import ConfigError
from .update_paths import PATHS, UpdatePath, checked_path
from .validate import check_number


def check_optimizer_slot(
    optimizer: Any, lr_sch: Any, max_norm: Any, norm_type: Any, added: list[Any]
) -> tuple[float | None, float]:
    """Check what ``Graph.add_optimizer`` was given (``added``: the optimizers added before);
    returns the clipping settings as floats."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"add_optimizer takes a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    checked_path(optimizer)  # raises for unsupported optimizers, here and now
    if any(o is optimizer for o in added):
        raise ConfigError("this optimizer is already added to the graph")
    if isinstance(lr_sch, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ConfigError(
            "ReduceLROnPlateau cannot be passed as lr_sch: its step() needs the metric, "
            "which graphamp does not have. Leave lr_sch out and call sch.step(metric) "
            "yourself after g(...), outside the Graph; the lr it sets is a graph input, so "
            "the next call uses it without recompiling"
        )
    if lr_sch is not None and getattr(lr_sch, "optimizer", None) is not optimizer:
        raise ConfigError("lr_sch must be a learning-rate scheduler of this optimizer")
    return validate_clip(max_norm, norm_type)


def validate_clip(max_norm: Any, norm_type: Any) -> tuple[float | None, float]:
    if max_norm is not None:
        max_norm = check_number("clip_grad_max_norm", max_norm, above=0)
    return max_norm, check_number("clip_grad_norm_type", norm_type, above=0, allow_inf=True)


def init_state(key: str, param: torch.Tensor) -> torch.Tensor:
    """A fresh state tensor in torch's format (step on the param's device)."""
    if key == "step":
        return torch.zeros((), dtype=torch.float32, device=param.device)
    return torch.zeros_like(param, memory_format=torch.preserve_format)


@dataclass
class GroupPlan:
    """One param group: which parameters it updates, its state keys and structural flags."""

    params: list[int]  # forward-parameter positions of the group's trainable parameters
    flags: tuple  # structure that changes the traced graph (part of the cache key)
    state_keys: tuple[str, ...]  # per-parameter state in torch's format, for this group
    # a traced optimizer's: each parameter's state keys, and their first values (not in the key)
    param_keys: list[tuple[str, ...]] | None = None
    initial: list[dict[str, Any]] | None = None

    @property
    def fused(self) -> bool:
        """An Adam/AdamW group built with ``fused=True``: torch's fused kernel updates it."""
        return dict(self.flags).get("fused") is not None


@dataclass
class OptimizerPlan:
    index: int  # position among the Graph's optimizers
    optimizer: torch.optim.Optimizer
    kind: str  # its UpdatePath's name (``path``)
    groups: list[GroupPlan]  # one per param group, same order
    clip_max_norm: float | None
    clip_norm_type: float
    params: list[torch.Tensor]  # the parameters it updates, in forward_positions order

    @property
    def path(self) -> UpdatePath:
        return PATHS[self.kind]

    def state_slots(self) -> list[tuple[torch.Tensor, str]]:
        """(parameter, state key) for every state tensor, in the step's input order."""
        out = []
        for group, params in self._group_params():
            if group.param_keys is not None:  # a traced optimizer: parameter by parameter
                out += [(p, key) for p, keys in zip(params, group.param_keys) for key in keys]
            else:
                out += [(p, key) for key in group.state_keys for p in params]
        return out

    def initial_state(self, p: torch.Tensor, key: str) -> torch.Tensor:
        """A fresh state tensor: torch's format for graphamp's own updates, what the
        optimizer's first step creates for a traced one (on the parameter's device)."""
        if not self.path.traced:
            return init_state(key, p)
        return self.first_state(p, key).make(p.device)

    def first_state(self, p: torch.Tensor, key: str) -> InitialState:
        """A traced optimizer's record of what its first step makes of ``p``'s ``key``."""
        for group, params in self._group_params():
            for q, first in zip(params, group.initial or ()):
                if q is p:
                    return first[key]
        raise KeyError(key)

    def fresh_params(self) -> list[torch.Tensor]:
        """The parameters that need a momentum-start flag (``starts_from_gradient``), group by
        group: the order of this optimizer's ``StepInputs.momentum_fresh``."""
        out = []
        for group, params in self._group_params():
            if self.path.starts_from_gradient(dict(group.flags)):
                out += params
        return out

    def _group_params(self) -> Iterator[tuple[GroupPlan, list[torch.Tensor]]]:
        """Each group with its parameters (``params`` holds them group after group)."""
        i = 0
        for group in self.groups:
            yield group, self.params[i : i + len(group.params)]
            i += len(group.params)

    def has_state(self) -> bool:
        """Has the optimizer stepped before (eagerly, or in a loaded checkpoint)?"""
        return any(self.optimizer.state.get(p) for p in self.params)

    @property
    def forward_positions(self) -> list[int]:
        """Forward-parameter positions of every parameter this optimizer updates, group order."""
        return [i for g in self.groups for i in g.params]

    @property
    def hyper_names(self) -> tuple[str, ...]:
        return self.path.hypers

    def hyper_inputs(self, k: int, device: torch.device) -> list[torch.Tensor]:
        """Param group ``k``'s hyperparameter inputs (``hyper_names``), zeros: float32, or
        float64 for a fused group on the CPU, whose kernel then reads the lr as the same double
        eager passes it (float32 rounds it: parameters 1e-8 off eager's fused run)."""
        wide = self.groups[k].fused and device.type == "cpu"
        dtype = torch.float64 if wide else torch.float32
        return [torch.zeros((), dtype=dtype, device=device) for _ in self.hyper_names]

    def hyper_values(self, group: dict) -> tuple[Any, ...]:
        return self.path.hyper_values(group)


@dataclass(frozen=True)
class InitialState:
    """One state tensor as the optimizer first creates it: a constant fill (zeros, ones,
    ``full(lr)``), or the tensor itself when its elements differ."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    fill: float | None
    value: torch.Tensor | None = None

    @staticmethod
    def of(t: torch.Tensor) -> InitialState:
        flat = t.detach().reshape(-1)
        constant = flat.numel() == 0 or bool((flat == flat[0]).all())
        if constant:
            return InitialState(tuple(t.shape), t.dtype, float(flat[0]) if flat.numel() else 0.0)
        return InitialState(tuple(t.shape), t.dtype, None, t.detach().clone().cpu())

    def make(self, device: torch.device) -> torch.Tensor:
        if self.value is not None:
            return self.value.to(device)
        return torch.full(self.shape, self.fill or 0.0, dtype=self.dtype, device=device)
