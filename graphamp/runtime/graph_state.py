"""A Graph's own state as a state dict: step count, scaler, optimizer step counters, history
(with the overflow events), AMP pins and autofix's partial counts; and loading one back, every
part checked first.

A checkpoint is the state: loading restores exactly the pins and counts that were saved, so a
resumed run pins at the same step as an uninterrupted one, and pins autofix made after the
checkpoint are dropped. The one exception is a pin written in code (``config.pin_fp32(AmpPin(...))``,
which has no ``step``): the code that built the Graph set it, so a load never removes it (it is
kept beside the saved pins)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..errors import ConfigError
from ..forensics.autofix import Autofix
from ..pipeline import checked_component_state, load_component_state, saved_component_state
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
    ranges = forensics.range_rows(run.state.history.overflows) if forensics is not None else []
    state = run.state
    return {
        "step": state.step_count,
        "grad_scaler": run.scaler.state_dict() if run.scaler is not None else None,
        "optimizer_steps": {k: int(v.item()) for k, v in state.counters.items()},
        "history": state.history.state_dict(),  # with the overflow events
        "amp_pins": [pin.to_dict() for pin in run.config.amp_pins],
        "autofix_counts": run.autofix.state_dict(),
        "momentum_fresh": _fresh_momentum(run),
        "ranges": [row.to_dict() for row in ranges],  # for `python -m graphamp plot`
        **saved_component_state(state),  # the step components' own (StepComponent.saved_key)
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
    counts = Autofix.check_state_dict(saved.get("autofix_counts", ()))
    fresh = _checked_fresh(saved.get("momentum_fresh", {}), run.optimizers)
    components = checked_component_state(saved)
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
    for k in run.state.counters.keys() - counters.keys():  # saved before its first step
        run.state.counters[k].fill_(0)  # in place: compiled steps hold the tensor
    run.state.history.load_state_dict(saved["history"])
    in_code = [p for p in run.config.amp_pins if p.step is None and p not in pins]
    run.config.clear_amp_pins()  # the same places again: the compiled steps stay valid
    run.config.pin_fp32(*pins, *in_code)
    run.autofix.load_counts(counts)
    _load_fresh(run, fresh)
    load_component_state(run.state, components)


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


def _flat_params(slot: OptimizerSlot) -> list[torch.Tensor]:
    return [p for group in slot.optimizer.param_groups for p in group["params"]]


def _fresh_momentum(run: GraphRuntime) -> dict[int, list[int]]:
    """Per optimizer, the positions (in its param_groups, flattened) of the parameters whose
    SGD momentum buffer has not started yet (``runner/momentum.py``)."""
    out = {}
    for k, slot in enumerate(run.optimizers):
        starts = [run.state.momentum.get(p) for p in _flat_params(slot)]
        fresh = [i for i, s in enumerate(starts) if s is not None and bool(s.flag)]
        if fresh:
            out[k] = fresh
    return out


def _checked_fresh(saved: Any, slots: list[OptimizerSlot]) -> dict[int, set[int]]:
    if not isinstance(saved, dict):
        raise ConfigError(f"momentum_fresh must be a dict, got {type(saved).__name__}")
    out: dict[int, set[int]] = {}
    for k, positions in saved.items():
        k = check_int("a momentum_fresh key", k, at_least=0)
        if k >= len(slots) or not isinstance(positions, (list, tuple)):
            raise ConfigError(
                f"the saved momentum_fresh names optimizer {k} with {positions!r}: this graph "
                f"has {len(slots)} optimizer(s), and each entry is a list of positions"
            )
        n = len(_flat_params(slots[k]))
        out[k] = set()
        for i in positions:
            if check_int(f"a momentum_fresh position of optimizer {k}", i, at_least=0) >= n:
                raise ConfigError(
                    f"the saved momentum_fresh names parameter {i} of optimizer {k}, which "
                    f"has {n}: the state belongs to other param groups"
                )
            out[k].add(i)
    return out


def _load_fresh(run: GraphRuntime, fresh: dict[int, set[int]]) -> None:
    """The saved flags; the others are left to the buffers (set where one is missing). Each
    belongs to whichever buffer the next lookup finds (the optimizer state may load later)."""
    for k, slot in enumerate(run.optimizers):
        for i, p in enumerate(_flat_params(slot)):
            if i in fresh.get(k, ()) or p in run.state.momentum:
                start = run.state.momentum_start(p)
                start.flag.fill_(i in fresh.get(k, ()))
                start.buffer = None
