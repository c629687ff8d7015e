"""fp32 pins of single ops or modules: what ``config.pin_fp32(AmpPin(...))`` and autofix add.

A pin names a place in the user's model, not a node of one traced graph, so that it survives a
recapture, a new input signature and a resumed run: the module path from the Graph (``''`` for
code outside any module), the op (``aten.mm``) and which of that module's ops of that name it is,
counted in graph order. ``op=None`` pins the whole module, as ``config.pin_fp32("path")`` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError

__all__ = ["AmpPin"]


@dataclass(frozen=True)
class AmpPin:
    """One op (``op`` set) or one whole module (``op=None``) kept in fp32.

    Two pins are equal when they name the same place; ``reason`` and ``step`` only say why and
    when it was made (autofix fills them; they are shown, saved and never compared).
    """

    module: str  # module path from the Graph, e.g. "model.encoder.block.0.layer.1.wo"; "" = none
    op: str | None = None  # "aten.mm"; None pins every op inside ``module``
    index: int = 0  # the index-th op named ``op`` inside ``module`` (graph order), from 0
    reason: str = field(default="", compare=False)
    step: int | None = field(default=None, compare=False)  # the step autofix pinned it after

    def __post_init__(self) -> None:
        if not isinstance(self.module, str):
            raise ConfigError(f"AmpPin(module=...) takes a module path string, got {self.module!r}")
        if self.op is None and not self.module:
            raise ConfigError(
                "AmpPin without an op pins a whole module: name the module (pinning "
                "'' would keep the whole model in fp32; disable AMP instead)"
            )
        if self.op is not None and not (isinstance(self.op, str) and self.op):
            raise ConfigError(f"AmpPin(op=...) takes an op name like 'aten.mm', got {self.op!r}")
        if isinstance(self.index, bool) or not isinstance(self.index, int) or self.index < 0:
            raise ConfigError(f"AmpPin(index=...) must be an int >= 0, got {self.index!r}")
        if not isinstance(self.reason, str):
            raise ConfigError(f"AmpPin(reason=...) takes a string, got {self.reason!r}")
        step = self.step
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ConfigError(f"AmpPin(step=...) must be None or an int >= 0, got {step!r}")

    def describe(self) -> str:
        where = self.module or "code outside any module"
        if self.op is None:
            return f"module {where}"
        nth = f" #{self.index}" if self.index else ""
        return f"{self.op}{nth} in {where}"

    def to_dict(self) -> dict[str, Any]:
        """Plain values only, so a state dict holding it loads with ``weights_only=True``."""
        return {
            "module": self.module,
            "op": self.op,
            "index": self.index,
            "reason": self.reason,
            "step": self.step,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AmpPin:
        """What ``to_dict`` wrote, checked as the constructor checks its arguments."""
        return cls(d["module"], d.get("op"), d.get("index", 0), d.get("reason", ""), d.get("step"))
