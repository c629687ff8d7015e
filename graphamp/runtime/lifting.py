"""Which Python floats a step takes as inputs instead of baking them in: one policy for all.

A float that changed between calls (a KL weight annealed by the loop, a temperature passed to
``g(...)``) is likely to change again: from its first change on, the step takes it as an input
(a 0-dim float32 tensor filled before each call), so a new value compiles nothing. Where
build() needs it as a Python number (a branch, a size, an op's argument that must be a float)
the capture fails with it lifted; then it, and only it, is baked in for good (each value
compiles a step of its own, up to the recompile limit). Floats that changed at one call are
lifted together; where the failure names the ones an op needs as numbers (``needs_numbers``),
only those are baked in; where it names none, the values build() reads are tried one at a
time (``withdraw``), and g(...)'s arguments are all baked in. A value that an earlier build took as
an input is not blamed for a later failure: an unrelated change (a loss's ``label_smoothing``,
which must stay a Python number) never demotes an annealed weight that was running as an input.

The same ``Lifting`` serves ``g(...)``'s float arguments (by position among its leaves) and the
values build() reads (attributes, globals, closure variables, by place).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Lifting:
    """The lifted values of one kind of source, by key (module docstring)."""

    lifted: dict[Any, Any] = field(default_factory=dict)  # key -> its read (or None)
    unliftable: set[Any] = field(default_factory=set)  # build() needs them as numbers
    proven: set[Any] = field(default_factory=set)  # lifted in a build that succeeded

    def lift(self, key: Any, what: Any = None) -> bool:
        """Lift ``key`` from the next build on; False where it is lifted already or must stay
        a Python number."""
        if key in self.unliftable or key in self.lifted:
            return False
        self.lifted[key] = what
        return True

    def withdraw(self, keys: set[Any]) -> None:
        """Bake ``keys`` in for the next build without blaming them: a later change lifts
        them again."""
        for key in keys:
            self.lifted.pop(key, None)

    def unproven(self) -> set[Any]:
        """The lifted values no build has taken as inputs yet."""
        return set(self.lifted) - self.proven

    def built(self) -> None:
        """A build took the lifted values as inputs: none of them is blamed later."""
        self.proven = set(self.lifted)

    def blame(self, named: set[Any] | None = None) -> list[Any]:
        """A capture failed with values lifted: the ones it ``named`` as needed as Python
        numbers, else the ones no build has taken yet (all of them, where each had built
        before), stay baked in from now on. Returns them."""
        unproven = self.unproven()
        if named:
            blamed = [k for k in self.lifted if k in named]
        else:
            blamed = [k for k in self.lifted if k in unproven] or list(self.lifted)
        for key in blamed:
            self.unliftable.add(key)
            del self.lifted[key]
        self.proven -= set(blamed)
        return blamed
