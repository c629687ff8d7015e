"""In-graph optimizers, read from the user's own torch.optim objects.

Each supported optimizer becomes a functional update that step assembly traces into the step
graph. The math follows torch's single-tensor implementations (``torch/optim/sgd.py``,
``adam.py``) in their capturable form: the learning rate and the other float hyperparameters
are graph inputs (0-dim fp32 tensors), so a scheduler changing them never recompiles, and the
bias corrections use the step tensor on the device, so nothing syncs with the host.

The optimizer state lives in ``optimizer.state`` in torch's own format (``momentum_buffer``;
``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``), updated in place by the compiled step,
so ``optimizer.state_dict()`` is always current. ``step`` tensors live on the parameters'
device, as torch keeps them for ``capturable=True``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .errors import ConfigError, UnsupportedOptimizerError
from .validate import check_number

SUPPORTED = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adam"}
_HYPER = {"sgd": ("lr", "momentum", "dampening", "weight_decay"),
          "adam": ("lr", "beta1", "beta2", "eps", "weight_decay")}


def optimizer_kind(optimizer: Any) -> str:
    kind = SUPPORTED.get(type(optimizer))
    if kind is None:
        names = ", ".join(f"torch.optim.{c.__name__}" for c in SUPPORTED)
        raise UnsupportedOptimizerError(
            f"{type(optimizer).__module__}.{type(optimizer).__qualname__} has no in-graph "
            f"implementation; graphamp supports {names}. Use one of those, or train that part "
            "eagerly outside the Graph"
        )
    for group in optimizer.param_groups:
        if group.get("differentiable"):
            raise UnsupportedOptimizerError(
                f"{type(optimizer).__name__}(differentiable=True) is not supported in a Graph"
            )
        if kind == "sgd" and group.get("nesterov") and (
            group["momentum"] <= 0 or group["dampening"] != 0
        ):
            raise ConfigError("SGD nesterov momentum requires a momentum and zero dampening")
    return kind


@dataclass
class GroupPlan:
    """One param group: which parameters it updates, its state keys and structural flags."""

    params: list[int]  # forward-parameter positions of the group's trainable parameters
    flags: tuple  # structure that changes the traced graph (part of the cache key)
    state_keys: tuple[str, ...]  # per-parameter state in torch's format, for this group


@dataclass
class OptimizerPlan:
    index: int
    optimizer: torch.optim.Optimizer
    kind: str
    groups: list[GroupPlan]
    clip_max_norm: float | None
    clip_norm_type: float
    params: list[torch.Tensor]  # the parameters it updates, in forward_positions order

    def state_slots(self) -> list[tuple[torch.Tensor, str]]:
        """(parameter, state key) for every state tensor, in the step's input order."""
        out, i = [], 0
        for group in self.groups:
            params = self.params[i : i + len(group.params)]
            i += len(group.params)
            out += [(p, key) for key in group.state_keys for p in params]
        return out
    @property
    def forward_positions(self) -> list[int]:
        """Forward-parameter positions of every parameter this optimizer updates, group order."""
        return [i for g in self.groups for i in g.params]

    @property
    def hyper_names(self) -> tuple[str, ...]:
        return _HYPER[self.kind]

    def hyper_values(self, group: dict) -> tuple[float, ...]:
        if self.kind == "sgd":
            return (group["lr"], group["momentum"], group["dampening"], group["weight_decay"])
        beta1, beta2 = group["betas"]
        return (group["lr"], beta1, beta2, group["eps"], group["weight_decay"])

    def structure(self) -> tuple:
        return (self.kind, self.clip_max_norm, self.clip_norm_type,
                tuple((tuple(g.params), g.flags) for g in self.groups))


def group_flags(kind: str, optimizer: torch.optim.Optimizer, group: dict) -> tuple:
    maximize = bool(group.get("maximize", False))
    if kind == "sgd":
        return (("momentum", group["momentum"] != 0), ("dampening", group["dampening"] != 0),
                ("nesterov", bool(group["nesterov"])), ("weight_decay", group["weight_decay"] != 0),
                ("maximize", maximize))
    decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(
        group.get("decoupled_weight_decay", False))
    return (("amsgrad", bool(group["amsgrad"])), ("decoupled", decoupled),
            ("weight_decay", group["weight_decay"] != 0), ("maximize", maximize))


def state_keys(kind: str, flags: dict) -> tuple[str, ...]:
    """The per-parameter state torch keeps for a group with these flags."""
    if kind == "sgd":
        return ("momentum_buffer",) if flags["momentum"] else ()
    return ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if flags["amsgrad"] else ())


def init_state(kind: str, key: str, param: torch.Tensor) -> torch.Tensor:
    """A fresh state tensor in torch's format (step on the param's device)."""
    if key == "step":
        return torch.zeros((), dtype=torch.float32, device=param.device)
    return torch.zeros_like(param, memory_format=torch.preserve_format)


@dataclass
class GroupTensors:
    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    state: dict[str, list[torch.Tensor]]
    hyper: dict[str, torch.Tensor]


def sgd_update(t: GroupTensors, flags: dict, first_step: torch.Tensor | None):
    """torch.optim.SGD's update. Returns (new params, new state)."""
    lr = t.hyper["lr"]
    new_params, new_bufs = [], []
    for i, (p, g) in enumerate(zip(t.params, t.grads)):
        if flags["maximize"]:
            g = -g
        if flags["weight_decay"]:
            g = g + t.hyper["weight_decay"] * p
        if flags["momentum"]:
            buf = t.state["momentum_buffer"][i]
            momentum = t.hyper["momentum"]
            new_buf = momentum * buf + (1 - t.hyper["dampening"]) * g
            if flags["dampening"] and first_step is not None:
                # torch starts the buffer as a copy of the first gradient (no dampening)
                new_buf = torch.where(first_step, g, new_buf)
            new_bufs.append(new_buf)
            g = g + momentum * new_buf if flags["nesterov"] else new_buf
        new_params.append(p - lr * g)
    state = {"momentum_buffer": new_bufs} if flags["momentum"] else {}
    return new_params, state


def adam_update(t: GroupTensors, flags: dict):
    """torch.optim.Adam / AdamW's update (capturable form). Returns (new params, new state)."""
    lr, beta1, beta2 = t.hyper["lr"], t.hyper["beta1"], t.hyper["beta2"]
    eps, wd = t.hyper["eps"], t.hyper["weight_decay"]
    out = {k: [] for k in t.state}
    new_params = []
    for i, (p, g) in enumerate(zip(t.params, t.grads)):
        if flags["maximize"]:
            g = -g
        step = t.state["step"][i] + 1
        if flags["weight_decay"]:
            if flags["decoupled"]:
                p = p * (1 - lr * wd)
            else:
                g = g + wd * p
        exp_avg = t.state["exp_avg"][i].lerp(g, 1 - beta1)
        exp_avg_sq = t.state["exp_avg_sq"][i] * beta2 + (1 - beta2) * g * g
        bias_correction1 = 1 - torch.pow(beta1, step)
        bias_correction2 = 1 - torch.pow(beta2, step)
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2.sqrt()
        if flags["amsgrad"]:
            max_sq = torch.maximum(t.state["max_exp_avg_sq"][i], exp_avg_sq)
            out["max_exp_avg_sq"].append(max_sq)
            denom = max_sq.sqrt() / bias_correction2_sqrt + eps
        else:
            denom = exp_avg_sq.sqrt() / bias_correction2_sqrt + eps
        new_params.append(p - step_size * exp_avg / denom)
        out["step"].append(step)
        out["exp_avg"].append(exp_avg)
        out["exp_avg_sq"].append(exp_avg_sq)
    return new_params, out


def apply_update(plan: OptimizerPlan, group: GroupPlan, tensors: GroupTensors,
                 first_step: torch.Tensor | None):
    flags = dict(group.flags)
    if plan.kind == "sgd":
        return sgd_update(tensors, flags, first_step)
    return adam_update(tensors, flags)


def validate_clip(max_norm: Any, norm_type: Any) -> tuple[float | None, float]:
    if max_norm is not None:
        max_norm = check_number("clip_grad_max_norm", max_norm, above=0)
    return max_norm, check_number("clip_grad_norm_type", norm_type, above=0, allow_inf=True)
