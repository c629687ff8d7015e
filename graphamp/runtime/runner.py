"""Running a compiled step: gather the live state, refresh what changed, call the program.

The user's parameters, buffers and optimizer state stay the truth: each call looks them up
again through the dicts that hold them (so reassignment and ``.to()`` are followed), refreshes
the hyperparameter tensors whose values changed (a device copy, no recompile) and the
low-precision copies of parameters changed outside the step, and passes everything to the
compiled step in the order of the plan's StepLayout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
from torch.autograd.graph import increment_version

from ..errors import CaptureError
from ..forensics import ForensicsState
from ..optimizers import OptimizerPlan, init_state
from ..spec import StepPlan
from ..state import SharedState, ShadowEntry

Slot = tuple[dict, str]  # (the dict holding a tensor, its key): a live lookup


@dataclass
class HyperSlot:
    """One param group's hyperparameters as device tensors, refreshed when the group changes."""

    plan: OptimizerPlan
    group: dict
    tensors: list[torch.Tensor]
    values: tuple

    def sync(self) -> None:
        values = self.plan.hyper_values(self.group)
        if values == self.values:
            return
        for t, v, old in zip(self.tensors, values, self.values):
            if isinstance(v, torch.Tensor):
                t.copy_(v)  # a tensor lr: device copy, no sync
            elif v != old:
                t.fill_(v)  # a kernel argument, no sync
        self.values = values


class Runner:
    """The runtime side of one Program (spec.StepRunner)."""

    def __init__(self, plan: StepPlan, root: nn.Module, state: SharedState,
                 device: torch.device):
        cap = plan.captured
        self.plan = plan
        self.param_slots = _slots(root, cap.param_names, "_parameters")
        self.buffer_slots = _slots(root, cap.buffer_names, "_buffers")
        self.hyper = [_hyper_slot(opt, group, device) for opt in plan.optimizers
                      for group in opt.optimizer.param_groups]
        self.counters = [state.counter(opt.index, device, _has_state(opt))
                         for opt in plan.optimizers]
        self.scaler_state: list[torch.Tensor] = []
        if plan.scaler is not None:
            plan.scaler._materialize(device)
            self.scaler_state = plan.scaler.state_tensors()
        self.history = state.history.materialize(device) if plan.training else []
        # overflow tracing: this step's own record (its probes are its own)
        self.forensics = ForensicsState(plan.probes, device) if plan.probes is not None else None
        self.shadow_slots: list[tuple[Slot, ShadowEntry]] = [
            (self.param_slots[i], state.shadow(_get(self.param_slots[i]), dtype))
            for i, dtype in plan.shadows]
        self.opt_state: list[torch.Tensor] | None = None
        self.compiled: Callable[..., Sequence[torch.Tensor]] | None = None
        self.uses_cuda_graph = False
        self.calls = 0
        # the parameters each call updates in place (fixed per plan): version counters to bump
        self.updated_params = [p for opt in plan.optimizers for p in opt.params]

    def example_inputs(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Tensors shaped like the step's inputs, for tracing and compiling; nothing installed
        in the user's optimizer."""
        return self.plan.layout.flatten(self._groups(_example_optimizer_state(self.plan),
                                                     inputs, detach=True))

    def gather(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The step's flat inputs for this call, with every refresh applied."""
        if self.opt_state is None:
            self.opt_state = materialize_optimizer_state(self.plan)
        for slot in self.hyper:
            slot.sync()
        for (d, k), entry in self.shadow_slots:
            entry.sync(d[k])
        return self.plan.layout.flatten(self._groups(self.opt_state, inputs))

    def _groups(self, opt_state: list[torch.Tensor], inputs: list[torch.Tensor],
                detach: bool = False) -> dict[str, list[torch.Tensor]]:
        params = [d[k] for d, k in self.param_slots]
        return {
            "params": [p.detach() for p in params] if detach else params,
            "buffers": [d[k] for d, k in self.buffer_slots],
            "opt_state": opt_state,
            "hyper": [t for slot in self.hyper for t in slot.tensors],
            "counters": self.counters,
            "scaler": self.scaler_state,
            "history": self.history,
            "forensics": self.forensics.tensors() if self.forensics is not None else [],
            "shadows": [entry.tensor for _, entry in self.shadow_slots],
            "constants": self.plan.captured.constants,
            "inputs": inputs,
        }

    def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        flat = self.gather(inputs)
        with torch.no_grad():
            outputs = self.compiled(*flat)
        self.calls += 1
        if self.plan.training:
            # In-place updates bump version counters, as eager optimizer steps do: autograd and
            # other graphs sharing these parameters (their shadows) see the change.
            _increment_versions(self.updated_params)
            for (d, k), entry in self.shadow_slots:
                entry.version = d[k]._version
        return list(outputs)

    def invalidate_optimizer_state(self) -> None:
        """The user loaded an optimizer state dict: gather its tensors again at the next call
        (a CUDA graph notices the new addresses and is captured again)."""
        self.opt_state = None


def _get(slot: Slot) -> torch.Tensor:
    return slot[0][slot[1]]


def _slots(root: nn.Module, names: list[str], kind: str) -> list[Slot]:
    """(the dict holding a tensor, its key): a live lookup that follows reassignment and .to()."""
    slots = []
    for name in names:
        prefix, _, attr = name.rpartition(".")
        module = root.get_submodule(prefix) if prefix else root
        slots.append((getattr(module, kind), attr))
    return slots


def _hyper_slot(opt: OptimizerPlan, group: dict, device: torch.device) -> HyperSlot:
    values = opt.hyper_values(group)
    tensors = [torch.as_tensor(v, dtype=torch.float32).to(device).clone().reshape(())
               for v in values]
    return HyperSlot(opt, group, tensors, values)


def _has_state(opt: OptimizerPlan) -> bool:
    return any(opt.optimizer.state.get(p) for p in opt.params)


def _increment_versions(tensors: list[torch.Tensor]) -> None:
    try:
        increment_version(tensors)
    except TypeError:  # torch versions whose increment_version takes one tensor
        for t in tensors:
            increment_version(t)


def materialize_optimizer_state(plan: StepPlan) -> list[torch.Tensor]:
    """The optimizer state tensors in layout order, created in torch's format where missing.

    Existing state (from a checkpoint or earlier eager steps) is kept; a ``step`` on the CPU is
    moved to the parameters' device, where the compiled step can update it without a sync.
    """
    flat = []
    for opt in plan.optimizers:
        for p, key in opt.state_slots():
            state = opt.optimizer.state[p]
            t = state.get(key)
            if t is None:
                t = init_state(opt.kind, key, p)
            elif key == "step":
                t = torch.as_tensor(t).to(device=p.device, dtype=torch.float32)
            elif t.shape != p.shape or t.device != p.device:
                raise CaptureError(
                    f"optimizer {opt.index} state {key!r} has shape {tuple(t.shape)} on "
                    f"{t.device}, its parameter {tuple(p.shape)} on {p.device}: the loaded "
                    "optimizer state does not belong to these parameters")
            state[key] = t
            flat.append(t)
    return flat


def _example_optimizer_state(plan: StepPlan) -> list[Any]:
    """Tensors shaped like the optimizer state, for tracing and compiling; nothing installed."""
    out = []
    for opt in plan.optimizers:
        for p, key in opt.state_slots():
            existing = opt.optimizer.state.get(p, {}).get(key)
            if isinstance(existing, torch.Tensor) and key != "step":
                out.append(existing)
            else:
                out.append(init_state(opt.kind, key, p))
    return out
