"""Where the delayed fp8 recipe saturated: read from its amax histories, no device work beyond
one copy of them.

A delayed scale comes from the largest amax of the history before the step; a step whose amax
exceeds that (times ``2**margin``) clipped its largest values at the format's largest number.
After a step, a history's column 1 holds that step's amax and the columns after it the amaxes
its scale was computed from, so each operand's saturation can be told from the history alone.

A weight that grows a little every step always exceeds its history a little: its largest value
is clipped by less than the format rounds it anyway (half the spacing of the top binade: 1/16 of
the value in e4m3, 1/8 in e5m2). Such a step is not reported as saturated; ``factor`` still
says by how much the amax went past.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from ..errors import ConfigError
from ..records.spec import Program
from ..torchkit.fxutil import module_path
from ..torchkit.ops import FP8_MM_DELAYED

OPERANDS = ("input", "weight", "gradient")
# half the relative spacing of the format's top binade (its mantissa bits: e4m3 3, e5m2 2): a
# value clipped by less is changed less than rounding to the format changes it
_ROUNDING = {"input": 2.0**-4, "weight": 2.0**-4, "gradient": 2.0**-3}


@dataclass
class Fp8Row:
    module: str  # the linear layer's module path
    operand: str  # input, weight or gradient
    amax: float  # the last step's largest magnitude
    scaled_for: float  # the largest amax its scale was computed from (0: none yet)
    saturated: bool  # the last step clipped values at the format's largest number by more
    # than rounding to the format would change them
    factor: float  # amax / scaled_for (how far beyond the scale's range; 0 if none yet)


@dataclass
class Fp8Report:
    rows: list[Fp8Row]

    @property
    def saturated(self) -> list[Fp8Row]:
        return [r for r in self.rows if r.saturated]

    def __str__(self) -> str:
        lines = [f"{'module':24} {'operand':9} {'amax':>10} {'scaled for':>10}  saturated"]
        for r in self.rows:
            flag = f"yes, {r.factor:.1f}x" if r.saturated else "no"
            lines.append(
                f"{r.module[:24]:24} {r.operand:9} {r.amax:10.4g} {r.scaled_for:10.4g}  {flag}"
            )
        return "\n".join(lines)


def require_delayed(graph_name: str, recipe: str | None) -> None:
    """The report reads the delayed recipe's histories; the other recipes keep none."""
    if recipe != "delayed":
        raise ConfigError(
            f"{graph_name}: saturation is read from the delayed recipe's amax histories; "
            "enable_fp8(True, recipe='delayed') keeps them (the other recipes scale each "
            "tensor by its own amax and never saturate)"
        )


def fp8_report(program: Program, histories: dict[str, torch.Tensor], margin: int) -> Fp8Report:
    """One row per operand of each delayed fp8 matmul of ``program``'s forward."""
    rows = []
    for node in program.forward.graph.nodes:
        if node.target is not FP8_MM_DELAYED:
            continue
        state = node.args[2]
        history = histories.get(state.name) if isinstance(state, fx.Node) else None
        if history is None:
            continue
        values = history[:, 1:].detach().float().cpu()
        for row, operand in enumerate(OPERANDS):
            amax = float(values[row, 0])
            before = float(values[row, 1:].max()) if values.shape[1] > 1 else 0.0
            limit = before * 2.0**margin
            saturated = before > 0 and amax > limit * (1.0 + _ROUNDING[operand])
            factor = amax / before if before > 0 else 0.0
            rows.append(Fp8Row(module_path(node), operand, amax, before, saturated, factor))
    return Fp8Report(rows)
