"""The closure an optimizer's own ``step(closure)`` evaluates (LBFGS's line search): each
evaluation after the first runs the compiled step again on the same batch, at the parameters
the optimizer has moved to, and sets the gradients it computed, as an eager closure's
``zero_grad(); loss = ...; loss.backward()`` does; it returns build()'s loss.

The first evaluation is the call's own step, already run: its loss, with its gradients
already set, as eager's first closure call computes them. Everything else the step does runs
again with each evaluation, as eager's forward runs again (BatchNorm's running statistics,
dropout's draws, the tensors build() writes on the user's objects); the plan refuses what
must happen once per call (another optimizer's update, a grad scaler's decision,
accumulation: ``step/plan.py``). The step's outputs after build()'s hold one gradient per
parameter the optimizer updates (``StepPlan.eager_outputs``).
"""

from __future__ import annotations

from typing import Callable

import torch


class LossClosure:
    """``closure()`` for ``optimizer.step``: the call's loss first, then the step run again."""

    def __init__(
        self,
        outputs: list[torch.Tensor],
        params: list[torch.Tensor],
        again: Callable[[], list[torch.Tensor]],
    ) -> None:
        self._first: list[torch.Tensor] | None = outputs
        self._params = params
        self._again = again

    def __call__(self) -> torch.Tensor:
        outputs, self._first = self._first, None
        if outputs is None:
            outputs = self._again()
            grads = outputs[len(outputs) - len(self._params) :]
            for p, g in zip(self._params, grads):
                p.grad = g
        return outputs[0]
