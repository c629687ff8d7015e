"""The graph's own state, shared by all of its compiled steps.

A Graph may hold several compiled steps (one per input signature); they all update the same
optimizer step counters and the same history, exactly as one eager training loop would. The user's parameters, buffers and optimizer state are not
here: they stay in the user's objects, which remain the truth.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .history import TrainingHistory
from .layouts import PassState


@dataclass
class MomentumStart:
    """Whether one parameter's SGD momentum buffer has started (``starts_from_gradient``).

    ``flag`` is a step input (0-dim bool on the parameter's device) that every compiled step of
    the Graph reads and writes: True until the buffer's first applied step. It belongs to the
    buffer ``buffer``: a buffer the user (or a loaded optimizer state) put in its place has
    started. ``buffer`` None means "whichever buffer is there next" (a loaded graph state)."""

    flag: torch.Tensor
    buffer: torch.Tensor | None = None


@dataclass
class SharedState:
    history: TrainingHistory
    counters: dict[int, torch.Tensor] = field(default_factory=dict)  # optimizer index -> steps
    # parameter -> its MomentumStart (by identity; dropped with the parameter)
    momentum: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)
    broadcast_done: bool = False  # data parallel: rank 0's state was broadcast once
    rank_link: Any = None  # data parallel: torchkit.rank_store.RankLink, made at the first build
    step_count: int = 0  # calls of the Graph that ran (overflow-skipped steps included)
    # the AMP passes' state tensors (records.layouts.PassState), by forward input name
    pass_state: dict[str, torch.Tensor] = field(default_factory=dict)

    def pass_state_tensors(
        self, entries: list[PassState], device: torch.device
    ) -> list[torch.Tensor]:
        """The tensors of the pass states ``entries``: made once as zeros, shared by every
        compiled step of the graph; one of another shape starts afresh."""
        out = []
        for entry in entries:
            state = self.pass_state.get(entry.name)
            if state is None or tuple(state.shape) != entry.shape:
                state = torch.zeros(entry.shape, dtype=torch.float32, device=device)
            self.pass_state[entry.name] = state = state.to(device)  # a loaded one moves along
            out.append(state)
        return out

    def counter(self, index: int, device: torch.device, started: bool) -> torch.Tensor:
        """Optimizer ``index``'s applied-step counter on ``device`` (created once; a new one
        starts at 1 if the optimizer already has state): steps applied, skipped ones not
        counted. Saved in the graph's state dict; the update math reads per-parameter state."""
        counter = self.counters.get(index)
        if counter is None or counter.device != device:
            counter = torch.full((), int(started), dtype=torch.int64, device=device)
            self.counters[index] = counter
        return counter

    def momentum_start(self, param: torch.Tensor) -> MomentumStart:
        """``param``'s MomentumStart, made (not started, no buffer yet) on first use."""
        start = self.momentum.get(param)
        if start is None:
            flag = torch.zeros((), dtype=torch.bool, device=param.device)
            start = self.momentum[param] = MomentumStart(flag)
        elif start.flag.device != param.device:  # the parameter moved (.to()): so does its flag
            start.flag = start.flag.to(param.device)
        return start
