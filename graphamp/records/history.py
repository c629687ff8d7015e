"""Training history kept on the device: one row per step, written by the compiled step itself.

Columns: step, loss (sum of scalar losses), scale (the loss scale used), skipped (1.0 when the
step overflowed and was skipped), grad_norm (the clipped optimizers' total norm; NaN without
clipping). The table is float64, so the step column is exact for 2**53 steps (fp32 values are
stored exactly). Nothing is copied to the host until ``fetch()`` is called. A saved table loads
into a history of any capacity: its last steps keep their places in the ring.

With overflow tracing on, ``overflows`` holds what went non-finite first on each overflowing
step (``probes.OverflowEvent``, oldest first), filled when the Graph reads the device record
(``g.overflow_report()``, ``g.state_dict()``, and after every step with autofix or debug >= 1).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, cast

import torch

from ..errors import ConfigError
from .probes import OverflowEvent
from .validate import check_int

HISTORY_COLUMNS = ("step", "loss", "scale", "skipped", "grad_norm")
MAX_OVERFLOW_EVENTS = 1000  # the oldest are dropped (and counted) beyond this


class TrainingHistory:
    def __init__(self, capacity: int = 10_000):
        self.capacity = check_int("history capacity", capacity, at_least=1)
        self.step: torch.Tensor | None = None
        self.table: torch.Tensor | None = None
        self._pending: dict[str, Any] | None = None
        self.overflows: list[OverflowEvent] = []
        self.overflows_lost = 0  # overflowing steps recorded but not analysed (or dropped)

    def add_overflows(self, events: list[OverflowEvent], lost: int = 0) -> None:
        self.overflows.extend(events)
        self.overflows_lost += lost
        extra = len(self.overflows) - MAX_OVERFLOW_EVENTS
        if extra > 0:
            del self.overflows[:extra]
            self.overflows_lost += extra

    def materialize(self, device: torch.device) -> list[torch.Tensor]:
        if self.table is None or self.table.device != device:
            step = torch.zeros((), dtype=torch.int64, device=device)
            table = torch.full(
                (self.capacity, len(HISTORY_COLUMNS)),
                float("nan"),
                dtype=torch.float64,
                device=device,
            )
            if self.table is not None and self.step is not None:
                step.copy_(self.step)
                table.copy_(self.table)
            elif self._pending is not None:
                step.fill_(int(self._pending["step"]))
                table.copy_(self._pending["table"])
                self._pending = None
            self.step, self.table = step, table
        return [cast(torch.Tensor, self.step), self.table]

    def _last_index(self) -> torch.Tensor:
        """The table row the last step wrote, on the device."""
        return torch.remainder(cast(torch.Tensor, self.step) - 1, self.capacity).reshape(1)

    @contextlib.contextmanager
    def last_step_kept(self) -> Iterator[None]:
        """The step count and the last step's row as they are now, put back (on the device)
        after the block: what runs in it (the step run again for an optimizer's closure) leaves
        the history as one step left it."""
        if self.table is None or self.step is None:
            yield
            return
        step, index = self.step.clone(), self._last_index()
        row = self.table.index_select(0, index)
        yield
        self.step.copy_(step)
        self.table.index_copy_(0, index, row)

    def latest(self) -> dict[str, torch.Tensor]:
        """The last step's row as 0-dim tensors on the device, read without a host sync (what
        the trainer integrations log); empty before the first step."""
        if self.table is None or self.step is None:
            return {}
        row = self.table.index_select(0, self._last_index())[0]
        return {c: row[i] for i, c in enumerate(HISTORY_COLUMNS)}

    def fetch(self) -> dict[str, list[float]]:
        """The recorded rows in step order, as Python lists per column (one device sync)."""
        if self.table is not None and self.step is not None:
            steps, table = int(self.step.item()), self.table.cpu()
        elif self._pending is not None:  # loaded, not run yet
            steps, table = int(self._pending["step"]), self._pending["table"]
        else:
            return {c: [] for c in HISTORY_COLUMNS}
        n = min(steps, self.capacity)
        start = steps % self.capacity if steps > self.capacity else 0
        order = [(start + i) % self.capacity for i in range(n)]
        rows = table[order] if order else table[:0]
        return {c: rows[:, i].tolist() for i, c in enumerate(HISTORY_COLUMNS)}

    def state_dict(self) -> dict[str, Any]:
        overflows = {
            "overflows": [e.to_dict() for e in self.overflows],
            "overflows_lost": self.overflows_lost,
        }
        if self.table is None or self.step is None:
            rows = self._pending or {"step": 0, "table": _ring(0, torch.zeros(0), self.capacity)}
            return {"step": rows["step"], "table": rows["table"].clone(), **overflows}
        return {
            "step": int(self.step.item()),
            "table": self.table.detach().cpu().clone(),
            **overflows,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        step, rows, overflows, lost = self.check_state_dict(state)
        self.overflows, self.overflows_lost = overflows, lost
        table = _ring(step, rows, self.capacity)
        if self.table is None or self.step is None:
            self._pending = {"step": step, "table": table}
            return
        self.step.fill_(step)
        self.table.copy_(table)

    @staticmethod
    def check_state_dict(state: Any) -> tuple[int, torch.Tensor, list[OverflowEvent], int]:
        """(step, rows, overflow events, overflows lost) a state dict would load; ConfigError if
        it is not a history's. States saved before overflow tracing existed have only 'step' and
        'table'."""
        required, optional = {"step", "table"}, {"overflows", "overflows_lost"}
        if not isinstance(state, dict) or not required <= set(state) <= required | optional:
            raise ConfigError(
                "a history state dict has the keys 'step' and 'table' (and, with "
                "overflow tracing, 'overflows' and 'overflows_lost'), got "
                f"{sorted(state) if isinstance(state, dict) else type(state).__name__}"
            )
        step = check_int("the history's step", state["step"], at_least=0)
        table = state["table"]
        if (
            not isinstance(table, torch.Tensor)
            or table.dim() != 2
            or table.shape[1] != len(HISTORY_COLUMNS)
            or not table.dtype.is_floating_point
        ):
            raise ConfigError(
                f"the history's table must be a float tensor of shape (rows, "
                f"{len(HISTORY_COLUMNS)}) (columns {', '.join(HISTORY_COLUMNS)}), got "
                f"{tuple(table.shape) if isinstance(table, torch.Tensor) else table!r}"
            )
        lost = check_int("the history's overflows_lost", state.get("overflows_lost", 0), at_least=0)
        try:
            overflows = [OverflowEvent.from_dict(d) for d in state.get("overflows", ())]
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(
                f"the history's overflow records do not load: {type(e).__name__}: {e}"
            ) from e
        return step, table.detach().to("cpu", torch.float64), overflows, lost


def _ring(step: int, saved: torch.Tensor, capacity: int) -> torch.Tensor:
    """A table of ``capacity`` rows (float64, NaN where nothing was written) holding the last
    steps of ``saved``, a ring of its own length at ``step``: row ``s % capacity`` is step
    ``s``, whatever capacity the saving graph had."""
    out = torch.full((capacity, len(HISTORY_COLUMNS)), float("nan"), dtype=torch.float64)
    n = min(step, saved.shape[0], capacity)
    if n:
        steps = torch.arange(step - n, step)
        out[steps % capacity] = saved[steps % saved.shape[0]].to(torch.float64)
    return out
