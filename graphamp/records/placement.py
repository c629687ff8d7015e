"""Where the step's parameters and optimizer state live: whole on every rank (``WHOLE``), or
cut into rows across ranks (``sharding/row_placement.py``: ZeRO).

The plan holds one ``Placement`` (``StepPlan.placement``). The runner (the live inputs of every
call) and ``step/examples.py`` (the inputs the step is traced and compiled with) ask it how the
step takes each parameter and state tensor, so the two cannot disagree, and neither knows
which placement it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .optimizers import OptimizerPlan


@dataclass(frozen=True)
class Placement:
    """Whole tensors: the step takes each parameter and its optimizer state as they are. A
    frozen dataclass, as its subclasses: the step key reads a placement field by field."""

    sharded = False  # are the parameters or their state cut across ranks?

    def parameter(self, p: torch.Tensor) -> torch.Tensor:
        """The step's input for parameter ``p``."""
        return p

    def state_is_row(self, key: str) -> bool:  # noqa: ARG002 - overridden
        """Does the step hold optimizer state ``key`` as this rank's row?"""
        return False

    def state_row_example(self, p: torch.Tensor) -> torch.Tensor:
        """A tensor shaped as this rank's row of ``p``'s state (nothing installed)."""
        raise NotImplementedError(f"{type(self).__name__} holds whole state")

    def state_row(
        self, opt: OptimizerPlan, key: str, p: torch.Tensor, existing: torch.Tensor | None
    ) -> torch.Tensor:
        """This rank's live state row for (``p``, ``key``) of ``opt`` (ValueError where
        ``existing`` is not state of ``p``)."""
        raise NotImplementedError(f"{type(self).__name__} holds whole state")

    def track(self, optimizers: list[OptimizerPlan]) -> None:
        """Called once per compiled step with its optimizers (rows need their
        ``state_dict()`` to gather torch's format)."""


WHOLE = Placement()
