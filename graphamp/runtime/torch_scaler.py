"""A torch.amp.GradScaler handed to ``set_grad_scaler``: graphamp runs it, the user's object
stays the truth.

Users keep calling their own scaler: ``scaler.get_scale()`` for logging, ``scaler.state_dict()``
in the checkpoint beside the model's and the optimizer's, ``scaler.load_state_dict(...)`` on
resume. A copy taken at ``set_grad_scaler`` would go stale after the first step, and those
calls would save the initial state and load into nothing. So the compiled step updates the
torch scaler's own ``_scale`` and ``_growth_tracker`` tensors in place (no host sync), and its
schedule is read from the torch object at every call: a ``load_state_dict`` on either object
is seen by the next step (a changed schedule recompiles, as any scaler setting does).

torch's semantics are kept exactly: no floor, no cap, no hysteresis.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import ConfigError
from ..scaler import GradScaler

_TORCH_SCALER_TYPES = tuple(
    c
    for c in (getattr(torch.amp, "GradScaler", None), getattr(torch.cuda.amp, "GradScaler", None))
    if c
)


class TakenOverGradScaler(GradScaler):
    """graphamp's scaler whose settings and state live in a torch.amp.GradScaler."""

    torch_scaler: Any  # the user's torch.amp.GradScaler (set first in __init__)

    def __init__(self, torch_scaler: Any):
        # set first: the settings below are written through to it
        self.__dict__["torch_scaler"] = torch_scaler
        super().__init__(
            init_scale=torch_scaler._init_scale,
            growth_factor=torch_scaler._growth_factor,
            backoff_factor=torch_scaler._backoff_factor,
            growth_interval=torch_scaler._growth_interval,
            max_scale=math.inf,
            min_scale=0.0,
            hysteresis=1,
        )

    # the schedule: the torch object's attributes, read and written through
    growth_factor = property(
        lambda self: self.torch_scaler._growth_factor,
        lambda self, v: setattr(self.torch_scaler, "_growth_factor", v),
    )
    backoff_factor = property(
        lambda self: self.torch_scaler._backoff_factor,
        lambda self, v: setattr(self.torch_scaler, "_backoff_factor", v),
    )
    growth_interval = property(
        lambda self: self.torch_scaler._growth_interval,
        lambda self, v: setattr(self.torch_scaler, "_growth_interval", v),
    )

    def _materialize(self, device: torch.device) -> None:
        theirs = self.torch_scaler
        if theirs._scale is None:
            theirs._lazy_init_scale_growth_tracker(device)
        elif theirs._scale.device != device:
            raise ConfigError(
                f"the torch.amp.GradScaler given to set_grad_scaler holds its scale on "
                f"{theirs._scale.device}, and the graph runs on {device}: make it with "
                f"torch.amp.GradScaler({device.type!r}, ...)"
            )
        # the step writes these in place: they are the torch scaler's own tensors
        self._scale, self._growth_tracker = theirs._scale, theirs._growth_tracker
        if self._hysteresis_tracker is None or self._hysteresis_tracker.device != device:
            self._hysteresis_tracker = torch.ones((), dtype=torch.int32, device=device)
            self._found_inf = torch.zeros((), dtype=torch.float32, device=device)
        self._pending = None

    def _host_values(self) -> dict[str, Any]:
        theirs = self.torch_scaler
        if theirs._scale is None:
            return {
                "scale": theirs._init_scale,
                "growth_tracker": theirs._init_growth_tracker,
                "hysteresis_tracker": 1,
            }
        return {
            "scale": theirs._scale.item(),
            "growth_tracker": int(theirs._growth_tracker.item()),
            "hysteresis_tracker": 1,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a graphamp or torch scaler's state into the torch scaler, after checking it;
        torch's semantics stay (graphamp's floor, cap and hysteresis are not taken)."""
        settings, values = self.check_state_dict(state_dict)
        self.torch_scaler.load_state_dict(
            {
                "scale": values["scale"],
                "_growth_tracker": values["growth_tracker"],
                "growth_factor": settings.get("growth_factor", self.growth_factor),
                "backoff_factor": settings.get("backoff_factor", self.backoff_factor),
                "growth_interval": settings.get("growth_interval", self.growth_interval),
            }
        )

    def __repr__(self) -> str:
        return (
            f"TakenOverGradScaler({type(self.torch_scaler).__name__}, "
            f"scale={self.get_scale()}, growth_factor={self.growth_factor}, "
            f"backoff_factor={self.backoff_factor}, growth_interval={self.growth_interval})"
        )


def as_graphamp_scaler(scaler: Any) -> GradScaler:
    """What set_grad_scaler accepts: graphamp scalers, or a torch.amp.GradScaler (taken over;
    a disabled one, ``GradScaler(enabled=use_amp)``, is a disabled graphamp scaler)."""
    if isinstance(scaler, GradScaler):
        return scaler
    if isinstance(scaler, _TORCH_SCALER_TYPES):
        return TakenOverGradScaler(scaler) if scaler.is_enabled() else GradScaler(enabled=False)
    raise ConfigError(
        f"set_grad_scaler takes graphamp.GradScaler, graphamp.StaticGradScaler or "
        f"torch.amp.GradScaler, got {type(scaler).__name__}"
    )
