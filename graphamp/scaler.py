"""Loss scalers and the grad-scaler subgraph they put into the step.

``GradScaler`` follows ``torch.amp.GradScaler`` exactly when ``hysteresis=1``, ``min_scale=0``
and ``max_scale=inf`` (what ``set_grad_scaler(torch.amp.GradScaler(...))`` gives, through
``torch_scaler.TakenOverGradScaler``, which keeps the user's torch object current): the step
multiplies the loss by the scale, unscales the gradients with
``_amp_foreach_non_finite_check_and_unscale_``, skips each optimizer whose gradients are not
finite, and updates the scale as ``_amp_update_scale_`` does, all inside the compiled step on
device tensors: no host sync. Its defaults add two guards users of dynamic loss scaling ask for:
``max_scale=2**24`` (apex's cap) and ``min_scale=1.0`` (Megatron's and DeepSpeed's floor), so a
run of bad batches cannot collapse the scale to zero.

The state dict has ``torch.amp.GradScaler``'s keys and meaning (a state saved by either loads
into the other), plus graphamp's fields.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .errors import ConfigError
from .records.validate import check_bool, check_int, check_number

_TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


class GradScaler:
    """Dynamic loss scaling inside the compiled step.

    Args:
        init_scale: starting scale.
        growth_factor: multiplies the scale after ``growth_interval`` clean steps (> 1).
        backoff_factor: multiplies the scale on an overflow step (in (0, 1)).
        growth_interval: clean steps between growths (a positive int).
        max_scale / min_scale: the scale stays within [min_scale, max_scale].
        hysteresis: overflow steps tolerated before backing off (Megatron's meaning; 1 backs
            off on every overflow, as torch does). Every overflow step is skipped regardless.
        enabled: False makes the scaler a no-op (scale 1, no skipping), as in torch.
    """

    dynamic = True

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        max_scale: float = 2.0**24,
        min_scale: float = 1.0,
        hysteresis: int = 1,
        enabled: bool = True,
    ):
        init_scale = check_number("init_scale", init_scale, above=0)
        growth_factor = check_number("growth_factor", growth_factor, above=1)
        backoff_factor = check_number("backoff_factor", backoff_factor, above=0, below=1)
        growth_interval = check_int("growth_interval", growth_interval, at_least=1)
        hysteresis = check_int("hysteresis", hysteresis, at_least=1)
        min_scale = check_number("min_scale", min_scale, at_least=0)
        max_scale = check_number("max_scale", max_scale, above=0, allow_inf=True)
        if min_scale > max_scale:
            raise ConfigError(f"min_scale ({min_scale}) is greater than max_scale ({max_scale})")
        if not min_scale <= init_scale <= max_scale:
            raise ConfigError(
                f"init_scale ({init_scale}) must lie within [min_scale, max_scale] = "
                f"[{min_scale}, {max_scale}]"
            )
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.max_scale = max_scale
        self.min_scale = float(min_scale)
        self.hysteresis = hysteresis
        self.enabled = check_bool("enabled", enabled)
        self._init_scale = init_scale
        # Host values until the first call creates device tensors; then the tensors are truth.
        self._pending: dict[str, Any] | None = {
            "scale": init_scale,
            "growth_tracker": 0,
            "hysteresis_tracker": hysteresis,
        }
        self._scale: torch.Tensor | None = None
        self._growth_tracker: torch.Tensor | None = None
        self._hysteresis_tracker: torch.Tensor | None = None
        self._found_inf: torch.Tensor | None = None

    # -- device state ---------------------------------------------------------------------------
    def _materialize(self, device: torch.device) -> None:
        if self._scale is not None and self._scale.device == device:
            return
        current = self._host_values()
        self._scale = torch.full((), current["scale"], dtype=torch.float32, device=device)
        self._growth_tracker = torch.full(
            (), current["growth_tracker"], dtype=torch.int32, device=device
        )
        self._hysteresis_tracker = torch.full(
            (), current["hysteresis_tracker"], dtype=torch.int32, device=device
        )
        self._found_inf = torch.zeros((), dtype=torch.float32, device=device)
        self._pending = None

    def _host_values(self) -> dict[str, Any]:
        if self._pending is not None:
            return dict(self._pending)
        scale, growth, hysteresis, _ = self.state_tensors()
        return {
            "scale": scale.item(),
            "growth_tracker": int(growth.item()),
            "hysteresis_tracker": int(hysteresis.item()),
        }

    def state_tensors(self) -> list[torch.Tensor]:
        """scale, growth tracker, hysteresis tracker, last found_inf: updated in place per step
        (created by the first call)."""
        tensors = [self._scale, self._growth_tracker, self._hysteresis_tracker, self._found_inf]
        if any(t is None for t in tensors):
            raise RuntimeError("the scaler's device state is made by the first call")
        return [t for t in tensors if t is not None]

    # -- user API -------------------------------------------------------------------------------
    def get_scale(self) -> float:
        """The current scale as a Python float (syncs with the device; for logging)."""
        if not self.enabled:
            return 1.0
        return float(self._host_values()["scale"])

    @property
    def scale(self) -> torch.Tensor | None:
        """The current scale as a device tensor (no sync); None before the first call."""
        return self._scale

    @property
    def found_inf(self) -> torch.Tensor | None:
        """1.0 if the last step overflowed (and was skipped), else 0.0; a device tensor."""
        return self._found_inf

    def is_enabled(self) -> bool:
        return self.enabled

    def state_dict(self) -> dict[str, Any]:
        if not self.enabled:
            return {}
        values = self._host_values()
        state = {
            "scale": float(values["scale"]),
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": int(values["growth_tracker"]),
            "max_scale": self.max_scale,
            "min_scale": self.min_scale,
            "hysteresis": self.hysteresis,
            "_hysteresis_tracker": int(values["hysteresis_tracker"]),
        }
        return state if self.dynamic else {**state, "static": True}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by a graphamp or torch scaler; everything is checked before
        anything changes. The schedule (growth and backoff settings, bounds) comes with a
        dynamic scaler's state; a static scaler's state carries only its scale, and a static
        scaler loads only the scale of any state."""
        if not self.enabled:
            return
        settings, values = self.check_state_dict(state_dict)
        for name, value in settings.items():
            setattr(self, name, value)
        if self._scale is None:
            self._pending = values
        else:
            scale, growth, hysteresis, _ = self.state_tensors()
            scale.fill_(values["scale"])
            growth.fill_(values["growth_tracker"])
            hysteresis.fill_(values["hysteresis_tracker"])

    def check_state_dict(self, state: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """(settings, values) a state dict would load; ConfigError if anything is invalid."""
        if isinstance(state, dict) and len(state) == 0:
            raise ConfigError(
                "the grad scaler state dict is empty, possibly because it was "
                "saved from a disabled GradScaler"
            )
        if not isinstance(state, dict):
            raise ConfigError(f"a grad scaler state dict is a dict, got {type(state).__name__}")
        missing = [k for k in _TORCH_KEYS if k not in state]
        if missing:
            raise ConfigError(f"grad scaler state dict lacks {missing}; it holds {sorted(state)}")
        if not self.dynamic:  # a static scaler takes the scale of any state
            return {}, self._checked_values(state, None)
        if state.get("static"):  # the scale only: this scaler's schedule and bounds stay
            return {}, self._checked_values(state, self._bounds())
        settings = self._checked_settings(state)
        return settings, self._checked_values(state, settings)

    def _bounds(self) -> dict[str, Any]:
        return {"min_scale": self.min_scale, "max_scale": self.max_scale, "hysteresis": None}

    def _checked_values(self, state: dict, settings: dict[str, Any] | None) -> dict[str, Any]:
        """The scale and trackers of ``state``, checked against the ``settings`` they will run
        with, as the constructor checks init_scale: within [min_scale, max_scale], and positive
        except where min_scale is 0 (a long run of overflows with no floor underflows to 0, in
        torch too); a static scaler (``settings`` None) takes any positive scale. The hysteresis
        tracker is at most ``hysteresis``; states saved before it stopped at 0 go below 0 and
        load as 0, which backs off the same."""
        low, high = (
            (0.0, math.inf) if settings is None else (settings["min_scale"], settings["max_scale"])
        )
        if settings is not None and low == 0:
            scale = check_number("the loaded scale", state["scale"], at_least=0)
        else:
            scale = check_number("the loaded scale", state["scale"], above=0)
        if not low <= scale <= high:
            raise ConfigError(
                f"the loaded scale ({scale}) lies outside [min_scale, max_scale] = [{low}, "
                f"{high}] of this scaler: make it with bounds that include it (for torch's "
                "semantics, set_grad_scaler(torch.amp.GradScaler(...)))"
            )
        hysteresis = settings["hysteresis"] if settings is not None else None
        tracker = state.get("_hysteresis_tracker", hysteresis or self.hysteresis)
        tracker = check_int("the loaded _hysteresis_tracker", tracker, at_least=-(2**62))
        if hysteresis is not None and tracker > hysteresis:
            raise ConfigError(
                f"the loaded _hysteresis_tracker ({tracker}) is greater than its hysteresis "
                f"({hysteresis}): a run never produces that"
            )
        return {
            "scale": scale,
            "growth_tracker": check_int(
                "the loaded _growth_tracker", state["_growth_tracker"], at_least=0
            ),
            "hysteresis_tracker": max(tracker, 0),
        }

    def _checked_settings(self, state: dict) -> dict[str, Any]:
        """A dynamic scaler's schedule from ``state``, checked as the constructor checks it
        (graphamp's own fields default to this scaler's where a torch state lacks them)."""
        settings = {
            "growth_factor": check_number(
                "the loaded growth_factor", state["growth_factor"], above=1
            ),
            "backoff_factor": check_number(
                "the loaded backoff_factor", state["backoff_factor"], above=0, below=1
            ),
            "growth_interval": check_int(
                "the loaded growth_interval", state["growth_interval"], at_least=1
            ),
            "max_scale": check_number(
                "the loaded max_scale",
                state.get("max_scale", self.max_scale),
                above=0,
                allow_inf=True,
            ),
            "min_scale": check_number(
                "the loaded min_scale", state.get("min_scale", self.min_scale), at_least=0
            ),
            "hysteresis": check_int(
                "the loaded hysteresis", state.get("hysteresis", self.hysteresis), at_least=1
            ),
        }
        if settings["min_scale"] > settings["max_scale"]:
            raise ConfigError(
                f"the loaded min_scale ({settings['min_scale']}) is greater than "
                f"its max_scale ({settings['max_scale']})"
            )
        return settings

    def settings(self) -> tuple:
        """What the traced update depends on (part of the compiled step's cache key)."""
        return (
            type(self).__name__,
            self.enabled,
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
            self.max_scale,
            self.min_scale,
            self.hysteresis,
        )

    def __repr__(self) -> str:
        if not self.enabled:
            return f"{type(self).__name__}(enabled=False)"
        return (
            f"{type(self).__name__}(scale={self.get_scale()}, "
            f"growth_factor={self.growth_factor}, "
            f"backoff_factor={self.backoff_factor}, growth_interval={self.growth_interval}, "
            f"min_scale={self.min_scale}, max_scale={self.max_scale}, "
            f"hysteresis={self.hysteresis})"
        )

    # -- traced into the step -------------------------------------------------------------------
    def update_scale(
        self,
        scale: torch.Tensor,
        growth_tracker: torch.Tensor,
        hysteresis_tracker: torch.Tensor,
        found_inf: torch.Tensor,
    ):
        """New (scale, growth_tracker, hysteresis_tracker) after a step; traced, no host sync.

        With hysteresis=1, min_scale=0, max_scale=inf this is ``torch._amp_update_scale_``:
        products are taken in float64 and rounded to fp32, as its kernels do.
        """
        overflow = found_inf > 0
        wide = scale.double()
        backed_off = (wide * self.backoff_factor).float()
        backed_off = torch.clamp(backed_off, min=self.min_scale)
        hysteresis_left = hysteresis_tracker - 1
        backoff_now = hysteresis_left <= 0
        scale_on_overflow = torch.where(backoff_now, backed_off, scale)
        successful = growth_tracker + 1
        grow = successful == self.growth_interval
        grown = (wide * self.growth_factor).float()
        grown = torch.where(torch.isfinite(grown), torch.clamp(grown, max=self.max_scale), scale)
        scale_on_success = torch.where(grow, grown, scale)
        new_scale = torch.where(overflow, scale_on_overflow, scale_on_success)
        zero = torch.zeros_like(growth_tracker)
        new_growth = torch.where(overflow | grow, zero, successful)
        # the tracker stops at 0: below it every overflow backs off anyway, and the state a
        # run produces stays one the constructor's settings describe (it loads back)
        new_hysteresis = torch.where(
            overflow,
            torch.clamp(hysteresis_left, min=0),
            torch.where(
                grow, torch.full_like(hysteresis_tracker, self.hysteresis), hysteresis_tracker
            ),
        )
        return new_scale, new_growth, new_hysteresis


class StaticGradScaler(GradScaler):
    """A fixed loss scale. Steps whose gradients are not finite are still skipped."""

    dynamic = False

    def __init__(self, scale: float):
        scale = check_number("scale", scale, above=0)
        super().__init__(
            init_scale=scale,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=1,
            max_scale=max(scale, 1.0),
            min_scale=min(scale, 1.0),
        )

    def update_scale(self, scale, growth_tracker, hysteresis_tracker, found_inf):  # noqa: ARG002 - GradScaler.update_scale's signature
        return scale, growth_tracker, hysteresis_tracker

    def __repr__(self) -> str:
        return f"StaticGradScaler(scale={self.get_scale()})"
