# ruff: noqa: ARG002 - the paths share UpdatePath's method signatures; each reads what it needs
"""How the step updates with one optimizer: one ``UpdatePath`` per way, chosen once per
optimizer (``path_of``) and asked, never tested by name, by everything downstream.

- ``SGD``, ``ADAM``: graphamp's own multi-tensor updates of torch's SGD, Adam and AdamW
  (``step/update_math.py``; an Adam group built with ``fused=True`` runs torch's fused kernel
  as one op of the step), their state in torch's format, by rows where the plan's placement
  shards it, and
  updated block by block where blocks repeat (``step/block_update.py``);
- ``TRACED_STEP``: any other optimizer's own ``step()``, traced into the step
  (``step/traced_optimizer.py``);
- ``PYTHON_STEP``: an optimizer whose ``step()`` a trial step showed could not be traced exactly
  (``step/trial_step.py``): it runs in Python after the
  compiled step, on the gradients the step computed, skipped on overflow (one host read), as
  eager's GradScaler.step runs it;
- ``CLOSURE_STEP``: as ``PYTHON_STEP``, for an optimizer whose ``step()`` must be given a
  closure (LBFGS; ``step/closure_trial.py``): the closure runs the compiled step again
  (``runner/closure.py``).

Each path owns what differs between them: the float hyperparameters it reads per param group
(step inputs, so a scheduler never recompiles), the group options baked into the traced update
(part of the cache key), its per-parameter state keys, and how ``print(g)`` words it. Its
``name`` is what plans, keys and block kernels record.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar

import torch

from ..errors import ConfigError, UnsupportedOptimizerError


def _frozen(value: Any, tensor: Callable) -> Any:
    """An option's value as something hashable that a key can hold."""
    if isinstance(value, torch.Tensor):
        return tensor(value)
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v, tensor) for v in value)
    return value


def tensor_values(t: torch.Tensor) -> tuple:
    """A tensor option as its values (the build's key)."""
    return ("tensor", tuple(t.detach().reshape(-1).tolist()))


def tensor_version(t: torch.Tensor) -> tuple:
    """A tensor option as which tensor it is and how often it was written: changes whenever
    its values can have, with no read of them (the per-call structure)."""
    return ("tensor", id(t), t._version)


class UpdatePath:
    name: ClassVar[str]
    hypers: ClassVar[tuple[str, ...]] = ()  # float options per group, step inputs
    multi_tensor: ClassVar[bool] = False  # graphamp's own update: state by rows, block kernels
    traced: ClassVar[bool] = False  # the optimizer's own step() is traced into the step
    in_python: ClassVar[bool] = False  # the optimizer's own step() runs after the step
    given_closure: ClassVar[bool] = False  # ... as step(closure), the closure running it again

    def check(self, optimizer: torch.optim.Optimizer) -> None:
        """Raise for options this path cannot run the way eager does."""

    def flags(
        self,
        optimizer: torch.optim.Optimizer,
        group: dict,
        tensor: Callable = tensor_values,
    ) -> tuple:
        """The options of ``group`` that change the traced update (part of the cache key).
        ``tensor``: how a tensor-valued option is recorded; its values by default (the build's
        key), ``tensor_version`` in the per-call structure, which must not read a device
        tensor on the host."""
        return ()

    def state_keys(self, flags: dict) -> tuple[str, ...]:
        """The per-parameter state torch keeps for a group with these flags (a traced
        optimizer's are found per parameter: ``GroupPlan.param_keys``)."""
        return ()

    def starts_from_gradient(self, flags: dict) -> bool:
        """Does the step need a per-parameter flag saying whether its momentum started?"""
        return False

    def hyper_values(self, group: dict) -> tuple[Any, ...]:
        """``group``'s values of ``hypers``, in order."""
        return ()

    def describe(self, optimizer: torch.optim.Optimizer, eager: str | None) -> str:
        raise NotImplementedError


class _SGD(UpdatePath):
    name = "sgd"
    hypers = ("lr", "momentum", "dampening", "weight_decay")
    multi_tensor = True

    def check(self, optimizer):
        for group in optimizer.param_groups:
            if group.get("nesterov") and (group["momentum"] <= 0 or group["dampening"] != 0):
                raise ConfigError("SGD nesterov momentum requires a momentum and zero dampening")

    def flags(self, optimizer, group, tensor=tensor_values):
        return (
            ("momentum", group["momentum"] != 0),
            ("dampening", group["dampening"] != 0),
            ("nesterov", bool(group["nesterov"])),
            ("weight_decay", group["weight_decay"] != 0),
            ("maximize", bool(group.get("maximize", False))),
        )

    def state_keys(self, flags):
        return ("momentum_buffer",) if flags["momentum"] else ()

    def starts_from_gradient(self, flags):
        """torch's SGD starts each parameter's momentum buffer as a copy of its first gradient
        (not dampened), whenever that parameter first gets one: a group added later, a layer
        unfrozen mid-run, a state cleared. With dampening 0 a zero buffer gives the same first
        step, so only momentum with dampening needs the flag (``StepInputs.momentum_fresh``)."""
        return bool(flags["momentum"]) and bool(flags["dampening"])

    def hyper_values(self, group):
        return (group["lr"], group["momentum"], group["dampening"], group["weight_decay"])

    def describe(self, optimizer, eager):
        return "graphamp's multi-tensor update"


class _Adam(UpdatePath):
    name = "adam"
    hypers = ("lr", "beta1", "beta2", "eps", "weight_decay")
    multi_tensor = True

    def flags(self, optimizer, group, tensor=tensor_values):
        decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(
            group.get("decoupled_weight_decay", False)
        )
        # fused=True: torch's fused kernel takes these as floats, baked into the step
        fused = (
            (group["betas"], group["eps"], group["weight_decay"]) if group.get("fused") else None
        )
        return (
            ("amsgrad", bool(group["amsgrad"])),
            ("decoupled", decoupled),
            ("weight_decay", group["weight_decay"] != 0),
            ("maximize", bool(group.get("maximize", False))),
            ("fused", _frozen(fused, tensor)),
        )

    def state_keys(self, flags):
        return ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if flags["amsgrad"] else ())

    def hyper_values(self, group):
        beta1, beta2 = group["betas"]
        return (group["lr"], beta1, beta2, group["eps"], group["weight_decay"])

    def describe(self, optimizer, eager):
        if any(g.get("fused") for g in optimizer.param_groups):
            return "torch's fused kernel (fused=True) in the step"
        return "graphamp's multi-tensor update"


class _TracedStep(UpdatePath):
    name = "traced"
    hypers = ("lr",)  # every other option is baked into the traced step
    traced = True

    def check(self, optimizer):
        refuse_untraceable(optimizer)

    def flags(self, optimizer, group, tensor=tensor_values):
        return tuple(
            (k, _frozen(v, tensor)) for k, v in sorted(group.items()) if k not in ("params", "lr")
        )

    def hyper_values(self, group):
        return (float(group["lr"]),)

    def describe(self, optimizer, eager):
        return "its step() traced"


class _PythonStep(UpdatePath):
    name = "eager"  # nothing of it is in the step: its step() reads its groups as they are
    in_python = True

    def describe(self, optimizer, eager):
        return f"its own step() in Python after the compiled step ({eager})"


class _ClosureStep(_PythonStep):
    name = "closure"  # its step(closure), whose closure runs the compiled step again
    given_closure = True

    def describe(self, optimizer, eager):
        return f"its own step(closure) in Python after the compiled step ({eager})"


CLOSURE_REASON = (
    "its step() evaluates a closure; the first evaluation is the call's own forward and "
    "backward, each later one runs the compiled step again"
)
SGD, ADAM, TRACED_STEP = _SGD(), _Adam(), _TracedStep()
PYTHON_STEP, CLOSURE_STEP = _PythonStep(), _ClosureStep()
PATHS: dict[str, UpdatePath] = {
    p.name: p for p in (SGD, ADAM, TRACED_STEP, PYTHON_STEP, CLOSURE_STEP)
}
# the optimizers graphamp updates with its own multi-tensor code (exact types: a subclass may
# change step(), so its own step() is traced)
MULTI_TENSOR: dict[type, UpdatePath] = {
    torch.optim.SGD: SGD,
    torch.optim.Adam: ADAM,
    torch.optim.AdamW: ADAM,
}


def path_of(optimizer: torch.optim.Optimizer, eager: str | None = None) -> UpdatePath:
    """The path of an optimizer already accepted (``checked_path``); ``eager``: why a trial
    step chose to run its step() in Python (``CLOSURE_REASON``: given a closure), or None."""
    if eager == CLOSURE_REASON:
        return CLOSURE_STEP
    if eager is not None:
        return PYTHON_STEP
    return MULTI_TENSOR.get(type(optimizer), TRACED_STEP)


def checked_path(optimizer: Any, eager: str | None = None) -> UpdatePath:
    """``path_of``, after refusing optimizers and options that cannot be one update inside the
    step."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UnsupportedOptimizerError(
            f"{type(optimizer).__qualname__} is not a torch.optim.Optimizer"
        )
    path = path_of(optimizer, eager)
    for group in optimizer.param_groups:
        if group.get("differentiable"):
            raise UnsupportedOptimizerError(
                f"{type(optimizer).__name__}(differentiable=True) is not supported in a Graph"
            )
    path.check(optimizer)
    return path


def refuse_untraceable(optimizer: torch.optim.Optimizer) -> None:
    """UnsupportedOptimizerError for optimizers whose step cannot be one traced update."""
    name = type(optimizer).__name__
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
