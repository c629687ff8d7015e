"""A Graph's own state as a state dict: step count, scaler, optimizer step counters, history
(with the overflow events), AMP pins; and loading one back, every part checked first."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..errors import ConfigError
from ..records.pins import AmpPin
from ..records.spec import OptimizerSlot
from ..records.validate import check_int
from .overflows import read_overflows

if TYPE_CHECKING:
    from .calls import GraphRuntime

REQUIRED_KEYS = frozenset({"step", "grad_scaler", "optimizer_steps", "history"})


def graph_state_dict(run: GraphRuntime) -> dict[str, Any]:
    """What ``Graph.state_dict`` returns (loads with ``torch.load(..., weights_only=True)``)."""
    for program in run.programs.values():
        read_overflows(run, program)  # the history then holds every overflow event
    last = run.programs.last()
    forensics = last.runner.forensics if last is not None else None
    ranges = forensics.range_rows() if forensics is not None else []
    state = run.state
    return {
        "step": state.step_count,
        "grad_scaler": run.scaler.state_dict() if run.scaler is not None else None,
        "optimizer_steps": {k: int(v.item()) for k, v in state.counters.items()},
        "history": state.history.state_dict(),  # with the overflow events
        "amp_pins": [pin.to_dict() for pin in run.config.amp_pins],
        "ranges": [row.to_dict() for row in ranges],  # for `python -m graphamp plot`
    }


def load_graph_state(run: GraphRuntime, saved: Any) -> None:
    """Load what ``graph_state_dict`` saved. Every part is checked before anything changes: a
    bad state raises ConfigError and leaves the graph exactly as it was."""
    if not isinstance(saved, dict):
        raise ConfigError(f"a Graph state dict is a dict, got {type(saved).__name__}")
    missing = REQUIRED_KEYS - set(saved)
    if missing:
        raise ConfigError(f"not a graphamp Graph state dict: it lacks {sorted(missing)}")
    step = check_int("the saved step", saved["step"], at_least=0)
    scaler = run.scaler
    if saved["grad_scaler"] is not None and scaler is None:
        raise ConfigError(
            "the saved state has grad-scaler state but this graph has no "
            "scaler: call set_grad_scaler(...) before load_state_dict"
        )
    if scaler is not None and saved["grad_scaler"] is not None and scaler.enabled:
        scaler.check_state_dict(saved["grad_scaler"])
    counters = _checked_counters(saved["optimizer_steps"], len(run.optimizers))
    run.state.history.check_state_dict(saved["history"])
    # states saved before pins existed have no "amp_pins"; "ranges" are not loaded (they
    # belong to the compiled step that measured them)
    pins = _checked_pins(saved.get("amp_pins", ()))
    # everything checked: now apply
    if scaler is not None and saved["grad_scaler"] is not None:
        scaler.load_state_dict(saved["grad_scaler"])
    run.state.step_count = step
    for k, v in counters.items():
        if k in run.state.counters:
            run.state.counters[k].fill_(v)
        else:
            device = _first_param_device(run.optimizers, k)
            run.state.counters[k] = torch.full((), v, dtype=torch.int64, device=device)
    run.state.history.load_state_dict(saved["history"])
    if pins:
        run.config.pin_fp32(*pins)


def _checked_pins(saved: Any) -> list[AmpPin]:
    """The AMP pins of a saved graph state; ConfigError if they do not load."""
    if not isinstance(saved, (list, tuple)):
        raise ConfigError(f"the saved amp_pins must be a list, got {type(saved).__name__}")
    try:
        return [AmpPin.from_dict(d) for d in saved]
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ConfigError(f"the saved amp_pins do not load: {type(e).__name__}: {e}") from e


def _checked_counters(saved: Any, n_optimizers: int) -> dict[int, int]:
    if not isinstance(saved, dict):
        raise ConfigError(f"optimizer_steps must be a dict, got {type(saved).__name__}")
    out = {}
    for k, v in saved.items():
        index = check_int(
            "an optimizer_steps key",
            int(k) if isinstance(k, str) and k.isdigit() else k,
            at_least=0,
        )
        if index >= n_optimizers:
            raise ConfigError(
                f"the saved state has a step counter for optimizer {index}, but this "
                f"graph has {n_optimizers} optimizer(s): add them before loading"
            )
        out[index] = check_int(f"optimizer {index}'s saved step count", v, at_least=0)
    return out


def _first_param_device(slots: list[OptimizerSlot], k: int) -> torch.device:
    if k < len(slots):
        for group in slots[k].optimizer.param_groups:
            for p in group["params"]:
                return p.device
    return torch.device("cpu")
