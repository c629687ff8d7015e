"""The graph's own state, shared by all of its compiled steps.

A Graph may hold several compiled steps (one per input signature); they all update the same
optimizer step counters and the same history, exactly as one eager training loop would. The user's parameters, buffers and optimizer state are not
here: they stay in the user's objects, which remain the truth.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .history import TrainingHistory


@dataclass
class SharedState:
    history: TrainingHistory
    counters: dict[int, torch.Tensor] = field(default_factory=dict)  # optimizer index -> steps
    broadcast_done: bool = False  # data parallel: rank 0's state was broadcast once
    step_count: int = 0  # calls of the Graph that ran (overflow-skipped steps included)

    def counter(self, index: int, device: torch.device, started: bool) -> torch.Tensor:
        """Optimizer ``index``'s applied-step counter on ``device`` (created once; a new one
        starts at 1 if the optimizer already has state, so Adam-style bias corrections and
        SGD's first-step dampening rule continue rather than restart)."""
        counter = self.counters.get(index)
        if counter is None or counter.device != device:
            counter = torch.full((), int(started), dtype=torch.int64, device=device)
            self.counters[index] = counter
        return counter
