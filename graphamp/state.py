"""The graph's own state, shared by all of its compiled steps.

A Graph may hold several compiled steps (one per input signature); they all update the same
optimizer step counters, the same low-precision parameter copies and the same history, exactly
as one eager training loop would. The user's parameters, buffers and optimizer state are not
here: they stay in the user's objects, which remain the truth.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .history import TrainingHistory


@dataclass
class ShadowEntry:
    """A persistent low-precision copy of a parameter (see passes/hoist_param_casts.py).

    The compiled step refreshes it together with the parameter. If the parameter changes outside
    the graph (load_state_dict, manual edits, eager steps, another graph), its version counter
    moves and the copy is refreshed before the next call.
    """

    tensor: torch.Tensor
    param: torch.Tensor
    version: int

    def sync(self, param: torch.Tensor) -> None:
        if param is not self.param or param._version != self.version:
            if param is not self.param and param.shape != self.tensor.shape:
                self.tensor = torch.empty_like(param, dtype=self.tensor.dtype)
            with torch.no_grad():
                self.tensor.copy_(param)
            self.param = param
            self.version = param._version


@dataclass
class SharedState:
    history: TrainingHistory
    counters: dict[int, torch.Tensor] = field(default_factory=dict)  # optimizer index -> steps
    shadows: dict[tuple[int, torch.dtype], ShadowEntry] = field(default_factory=dict)
    broadcast_done: bool = False  # data parallel: rank 0's state was broadcast once

    def counter(self, index: int, device: torch.device, started: bool) -> torch.Tensor:
        """Optimizer ``index``'s applied-step counter on ``device`` (created once; a new one
        starts at 1 if the optimizer already has state, so Adam-style bias corrections and
        SGD's first-step dampening rule continue rather than restart)."""
        counter = self.counters.get(index)
        if counter is None or counter.device != device:
            counter = torch.full((), int(started), dtype=torch.int64, device=device)
            self.counters[index] = counter
        return counter

    def shadow(self, param: torch.Tensor, dtype: torch.dtype) -> ShadowEntry:
        """The low-precision copy of ``param`` in ``dtype``, shared by every compiled step."""
        key = (id(param), dtype)
        entry = self.shadows.get(key)
        if entry is None or entry.param is not param:
            # Convolution weights on CUDA are kept channels-last: cuDNN's fast kernels are NHWC,
            # and a copy in that layout saves a transpose in every forward and backward conv.
            layout = (torch.channels_last if param.dim() == 4 and param.is_cuda
                      else torch.contiguous_format)
            with torch.no_grad():
                shadow = param.detach().to(dtype=dtype, memory_format=layout)
            entry = ShadowEntry(shadow, param, param._version)
            self.shadows[key] = entry
        return entry
