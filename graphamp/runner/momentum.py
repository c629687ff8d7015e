"""SGD momentum buffers that start from a gradient, parameter by parameter.

torch's SGD with momentum starts a parameter's buffer as a copy of its first gradient (not
dampened) whenever that parameter first gets one: on the optimizer's first step, in a group
added with ``add_param_group``, for a layer unfrozen mid-run, after ``optimizer.state`` was
cleared or one parameter's state deleted. With dampening that first step differs from a
zero buffer's, so the step reads one flag per such parameter (``StepInputs.momentum_fresh``,
``records.update_paths.UpdatePath.starts_from_gradient``), kept in the Graph's ``SharedState`` so that every
compiled step of the Graph reads and writes the same one. The step clears a flag on the
parameter's first applied step (a skipped step leaves it set, as torch, which then does not
step, leaves the buffer missing).

A flag belongs to one buffer. At each lookup of the optimizer state (first call, a load, the
user's edit): a buffer graphamp creates because it is missing starts set; a buffer that is
not the one the flag belongs to (the user's, a loaded optimizer state's) has started.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..records.spec import StepPlan
from ..records.state import MomentumStart, SharedState


@dataclass
class FlagWrite:
    """What a committed step sets one flag to (``value`` None: keeps it) and which buffer it
    then belongs to."""

    start: MomentumStart
    value: bool | None
    buffer: torch.Tensor


def momentum_flags(
    plan: StepPlan, shared: SharedState, state_slots: list[tuple], flat: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[FlagWrite]]:
    """(the step's ``momentum_fresh`` inputs, the writes ``commit`` makes). ``state_slots`` are
    (optimizer plan, (parameter, key)) in the layout order of ``flat``, the state tensors the
    step will use; nothing is installed in the optimizer yet, so a missing buffer is missing
    from ``optimizer.state``."""
    used = {
        (id(o.optimizer), id(p)): t
        for (o, (p, key)), t in zip(state_slots, flat)
        if key == "momentum_buffer"
    }
    flags, writes = [], []
    for opt in plan.optimizers:
        for p in opt.fresh_params():
            start = shared.momentum_start(p)
            buffer = used[(id(opt.optimizer), id(p))]
            existing = opt.optimizer.state.get(p, {}).get("momentum_buffer")
            if existing is None:
                value: bool | None = True  # torch would start it from this step's gradient
            elif start.buffer is None or start.buffer is existing or start.buffer is buffer:
                value = None  # its own buffer (or a loaded graph state's choice): as it is
            else:
                value = False  # a buffer put there by the user or a loaded optimizer state
            writes.append(FlagWrite(start, value, buffer))
            flags.append(start.flag)
    return flags, writes


def commit(writes: list[FlagWrite]) -> Callable[[], None]:
    """Apply ``writes`` (a step is being committed); returns what undoes them."""
    before = [(w.start, w.start.flag.clone(), w.start.buffer) for w in writes]
    for w in writes:
        if w.value is not None:
            w.start.flag.fill_(w.value)
        w.start.buffer = w.buffer

    def undo() -> None:
        for start, flag, buffer in before:
            start.flag.copy_(flag)
            start.buffer = buffer

    return undo
