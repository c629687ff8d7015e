"""What graphamp knows about torch's optimizers: which it supports, and their state format.

The optimizer state lives in ``optimizer.state`` in torch's own format (``momentum_buffer``;
``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``), updated in place by the compiled step,
so ``optimizer.state_dict()`` is always current. ``step`` tensors live on the parameters'
device, as torch keeps them for ``capturable=True``. The update math itself is traced by
``step/optimizer_update.py``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from ..errors import ConfigError, UnsupportedOptimizerError
from .validate import check_number

SUPPORTED = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adam"}
# Every other optimizer's own step() is traced into the step (step/traced_optimizer.py)...
TRACED = "traced"
# ... unless a trial step shows the trace could not be exact (step/trial_step.py): then its
# step() runs in Python after the compiled step, on the gradients the step computed, skipped
# on overflow (one host read), as eager's GradScaler.step runs it
EAGER = "eager"
# The float hyperparameters each kind reads per param group: graph inputs (0-dim fp32 tensors),
# so a scheduler changing them never recompiles. A traced optimizer's other options are baked
# into its step and part of the key (group_flags).
HYPER = {
    "sgd": ("lr", "momentum", "dampening", "weight_decay"),
    "adam": ("lr", "beta1", "beta2", "eps", "weight_decay"),
    TRACED: ("lr",),
    EAGER: (),  # its step() reads its param groups itself
}


def optimizer_kind(optimizer: Any, eager: str | None = None) -> str:
    """ "sgd" or "adam" (graphamp's multi-tensor updates), "traced" for any other optimizer,
    "eager" where ``eager`` says why its step() cannot be traced exactly; raises for
    optimizers and options that cannot be one update inside the step."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UnsupportedOptimizerError(
            f"{type(optimizer).__qualname__} is not a torch.optim.Optimizer"
        )
    kind = kind_of(optimizer, eager)
    if kind == TRACED:
        refuse_untraceable(optimizer)
    for group in optimizer.param_groups:
        if group.get("differentiable"):
            raise UnsupportedOptimizerError(
                f"{type(optimizer).__name__}(differentiable=True) is not supported in a Graph"
            )
        if (
            kind == "sgd"
            and group.get("nesterov")
            and (group["momentum"] <= 0 or group["dampening"] != 0)
        ):
            raise ConfigError("SGD nesterov momentum requires a momentum and zero dampening")
    return kind


def update_path(optimizer: torch.optim.Optimizer, eager: str | None = None) -> str:
    """How the step updates with this optimizer, in words (``print(g)``)."""
    kind = kind_of(optimizer, eager)
    if kind == EAGER:
        return f"its own step() in Python after the compiled step ({eager})"
    if kind == TRACED:
        return "its step() traced"
    if kind == "adam" and any(g.get("fused") for g in optimizer.param_groups):
        return "torch's fused kernel (fused=True) in the step"
    return "graphamp's multi-tensor update"


def check_optimizer_slot(
    optimizer: Any, lr_sch: Any, max_norm: Any, norm_type: Any, added: list[Any]
) -> tuple[float | None, float]:
    """Check what ``Graph.add_optimizer`` was given (``added``: the optimizers added before);
    returns the clipping settings as floats."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"add_optimizer takes a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    optimizer_kind(optimizer)  # raises for unsupported optimizers, here and now
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


def group_flags(
    kind: str, optimizer: torch.optim.Optimizer, group: dict, tensor: Callable | None = None
) -> tuple:
    """The options of a param group that change the traced update (part of the cache key).

    ``tensor``: how a tensor-valued option is recorded; its values by default (the build's
    key), ``tensor_version`` in the per-call structure, which must not read a device tensor on
    the host."""
    tensor = tensor or _tensor_values
    if kind == EAGER:  # nothing of it is in the step: its step() reads its groups as they are
        return ()
    if kind == TRACED:  # every option but the lr (an input) is baked into the traced step
        return tuple(
            (k, _frozen(v, tensor)) for k, v in sorted(group.items()) if k not in ("params", "lr")
        )
    maximize = bool(group.get("maximize", False))
    if kind == "sgd":
        return (
            ("momentum", group["momentum"] != 0),
            ("dampening", group["dampening"] != 0),
            ("nesterov", bool(group["nesterov"])),
            ("weight_decay", group["weight_decay"] != 0),
            ("maximize", maximize),
        )
    decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(
        group.get("decoupled_weight_decay", False)
    )
    # fused=True: torch's fused kernel takes these as floats, baked into the step
    fused = (group["betas"], group["eps"], group["weight_decay"]) if group.get("fused") else None
    return (
        ("amsgrad", bool(group["amsgrad"])),
        ("decoupled", decoupled),
        ("weight_decay", group["weight_decay"] != 0),
        ("maximize", maximize),
        ("fused", _frozen(fused, tensor)),
    )


def kind_of(optimizer: torch.optim.Optimizer, eager: str | None = None) -> str:
    """``optimizer_kind`` of an optimizer it has accepted already, without its checks."""
    if eager is not None:
        return EAGER
    return SUPPORTED.get(type(optimizer), TRACED)


def _frozen(value: Any, tensor: Callable) -> Any:
    """An option's value as something hashable that a key can hold."""
    if isinstance(value, torch.Tensor):
        return tensor(value)
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v, tensor) for v in value)
    return value


def _tensor_values(t: torch.Tensor) -> tuple:
    return ("tensor", tuple(t.detach().reshape(-1).tolist()))


def tensor_version(t: torch.Tensor) -> tuple:
    """A tensor option as which tensor it is and how often it was written: changes whenever
    its values can have, with no read of them."""
    return ("tensor", id(t), t._version)


def state_keys(kind: str, flags: dict) -> tuple[str, ...]:
    """The per-parameter state torch keeps for a group with these flags (a traced optimizer's
    are found per parameter: ``GroupPlan.param_keys``)."""
    if kind in (TRACED, EAGER):
        return ()
    if kind == "sgd":
        return ("momentum_buffer",) if flags["momentum"] else ()
    return ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if flags["amsgrad"] else ())


def starts_from_gradient(kind: str, flags: dict) -> bool:
    """Does the step need to know, per parameter, whether its momentum buffer has started?

    torch's SGD starts each parameter's momentum buffer as a copy of its first gradient (not
    dampened), whenever that parameter first gets one: a group added later, a layer unfrozen
    mid-run, a state cleared or deleted. With dampening 0 a zero buffer gives the same first
    step, so only SGD with momentum and dampening needs a flag per parameter
    (``StepInputs.momentum_fresh``)."""
    return kind == "sgd" and bool(flags["momentum"]) and bool(flags["dampening"])


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
    kind: str  # a value of SUPPORTED
    groups: list[GroupPlan]  # one per param group, same order
    clip_max_norm: float | None
    clip_norm_type: float
    params: list[torch.Tensor]  # the parameters it updates, in forward_positions order

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
        if self.kind != TRACED:
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
            if starts_from_gradient(self.kind, dict(group.flags)):
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
        return HYPER[self.kind]

    def hyper_inputs(self, k: int, device: torch.device) -> list[torch.Tensor]:
        """Param group ``k``'s hyperparameter inputs (``hyper_names``), zeros: float32, or
        float64 for a fused group on the CPU, whose kernel then reads the lr as the same double
        eager passes it (float32 rounds it: parameters 1e-8 off eager's fused run)."""
        wide = self.groups[k].fused and device.type == "cpu"
        dtype = torch.float64 if wide else torch.float32
        return [torch.zeros((), dtype=dtype, device=device) for _ in self.hyper_names]

    def hyper_values(self, group: dict) -> tuple[Any, ...]:
        if self.kind == EAGER:
            return ()
        if self.kind == TRACED:
            return (float(group["lr"]),)
        if self.kind == "sgd":
            return (group["lr"], group["momentum"], group["dampening"], group["weight_decay"])
        beta1, beta2 = group["betas"]
        return (group["lr"], beta1, beta2, group["eps"], group["weight_decay"])


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


def refuse_untraceable(optimizer: torch.optim.Optimizer) -> None:
    """UnsupportedOptimizerError for optimizers whose step cannot be one traced update."""
    name = type(optimizer).__name__
    closure = inspect.signature(type(optimizer).step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise UnsupportedOptimizerError(
            f"{name}.step(closure) evaluates the loss again inside the step (a line search), "
            "which one traced step cannot do: train it eagerly, or use an optimizer whose "
            "step takes no closure"
        )
    if getattr(optimizer, "_step_supports_amp_scaling", False) and not type(
        optimizer
    ).__module__.startswith("torch.optim"):
        raise UnsupportedOptimizerError(
            f"{name}.step() takes the grad scaler itself (_step_supports_amp_scaling) to "
            "unscale and skip inside its step; graphamp's step unscales and skips for every "
            "optimizer, so this one's own scaling would run on nothing: use its plain form"
        )
    if isinstance(optimizer, torch.optim.SparseAdam):
        raise UnsupportedOptimizerError(
            "SparseAdam updates sparse gradients only, and graphamp's gradients are dense: use "
            "torch.optim.Adam (nn.Embedding(sparse=False))"
        )
