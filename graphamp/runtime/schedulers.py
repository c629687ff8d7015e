"""What graphamp does to the user's lr schedulers around a step.

A scheduler's ``step()`` runs inside the step's transaction (``calls.run_step``): if anything
after it raises, the scheduler must be put back as it was. ``snapshot`` copies what ``step()``
changes; ``restore`` puts it back. Both run on every call, so they copy attributes (one level
deep, enough for torch's schedulers, which replace or extend their lists and numbers) rather
than going through ``state_dict()``.
"""

from __future__ import annotations

from typing import Any

import torch

Snapshot = tuple[list[tuple[Any, dict]], list[dict]]


def snapshot(sch: Any) -> Snapshot:
    """What ``sch.step()`` changes: its attributes (and those of the schedulers it chains, as
    SequentialLR and ChainedScheduler do) and its optimizer's hyperparameters."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in sch.optimizer.param_groups]
    return _attributes(sch), groups


def restore(saved: Snapshot) -> None:
    attributes, groups = saved
    for sch, values in attributes:
        sch.__dict__.clear()
        sch.__dict__.update(values)
    for group, values in zip(attributes[0][0].optimizer.param_groups, groups):
        group.update(values)


def silence_order_warning(optimizer: torch.optim.Optimizer) -> None:
    """LR schedulers warn when step() runs before optimizer.step(); graphamp steps the optimizer
    inside the compiled program, so mark it as stepped for them."""
    # the flag torch's schedulers check
    optimizer._opt_called = True  # type: ignore[attr-defined]


def _attributes(sch: Any) -> list[tuple[Any, dict]]:
    saved = {k: (list(v) if type(v) is list else v) for k, v in vars(sch).items()}
    nested = [a for s in vars(sch).get("_schedulers", ()) for a in _attributes(s)]
    return [(sch, saved), *nested]
