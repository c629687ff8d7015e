"""A Graph's compiled steps, found by what each one assumes (``records/guards.py``).

A steady call costs one dict lookup (the call's input signature and structure, memoised with the
program that served them) and the check of the attribute values and state sizes the program
assumes. A call no memo entry serves is offered to every cached program, newest first: a static
program serves its own signature, a dynamic one every batch its shape guard admits. When none
does, the Graph builds a new one, and this module says why (``why_rebuilt``) and which batch
dimensions that build should make symbolic (``dynamic_dims``): automatic dynamic shapes, as
torch.compile's, where a dimension whose size changed between two calls of the same family is
traced as a symbol from then on.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

from ..errors import RecompileLimitError
from ..records.guards import Change, Guards, Structure, family
from ..records.inputs import FlatInputs, InputSignature
from ..records.spec import Program
from ..torchkit.fxutil import is_compute_node, module_path, op_name

log = logging.getLogger("graphamp")

_MEMO_LIMIT = 4096  # calls remembered; beyond it the memo starts again (each entry is small)

Key = tuple[InputSignature, Structure]


class ProgramCache(Mapping[int, Program]):
    """The cached programs of one Graph, least recently used first (a read-only mapping from a
    build number to its Program, for inspection), and the memo of which program served which
    (signature, structure)."""

    def __init__(self) -> None:
        self._programs: OrderedDict[int, Program] = OrderedDict()
        self._memo: dict[Key, Program] = {}
        self._serial = 0
        self._last = 0  # the serial of the most recently used program
        self.builds: dict[Structure, list[tuple[str, str]]] = {}  # per structure: each build's why

    # -- Mapping ---------------------------------------------------------------------------
    def __getitem__(self, serial: int) -> Program:
        return self._programs[serial]

    def __iter__(self) -> Iterator[int]:
        return iter(self._programs)

    def __len__(self) -> int:
        return len(self._programs)

    # -- lookup ----------------------------------------------------------------------------
    def find(self, key: Key, inputs: FlatInputs) -> Program | None:
        """The program that serves this call, or None (then the Graph builds one); it becomes
        the most recently used."""
        program = self._memo.get(key)
        if program is not None and program.guards is not None and program.guards.values_hold():
            if self._last != program.serial:
                self._programs.move_to_end(program.serial)
                self._last = program.serial
            return program
        signature, structure = key
        for serial in reversed(self._programs):
            candidate = self._programs[serial]
            guards = candidate.guards
            if guards is not None and guards.serves(structure, signature, inputs.tensors):
                self._remember(key, candidate)
                self._programs.move_to_end(serial)
                self._last = serial
                return candidate
        return None

    def _remember(self, key: Key, program: Program) -> None:
        if len(self._memo) >= _MEMO_LIMIT:
            self._memo.clear()
        self._memo[key] = program

    # -- building --------------------------------------------------------------------------
    def last(self) -> Program | None:
        return self._programs[next(reversed(self._programs))] if self._programs else None

    def why_rebuilt(self, key: Key, inputs: FlatInputs, input_names: Any) -> Change | None:
        """Why the most recently used program does not serve this call (None: no program yet)."""
        last = self.last()
        if last is None or last.guards is None:
            return None
        return last.guards.first_change(key[1], key[0], inputs.tensors, input_names)

    def dynamic_dims(
        self, key: Key, marked: frozenset[tuple[int, int]], mode: bool | None
    ) -> frozenset[tuple[int, int]]:
        """The batch dimensions a new build should trace as symbols.

        ``mode`` False: none. True: every dimension of every batch tensor. None (automatic): the
        ones marked dynamic (``torch._dynamo.mark_dynamic``), the ones earlier programs of the
        same family made dynamic, and the ones whose size differs from such a program's."""
        signature = key[0]
        if mode is False:
            return frozenset()
        if mode is True:
            every = frozenset(
                (i, d)
                for i, (shape, *_rest) in enumerate(signature.tensors)
                for d in range(len(shape))
            )
            return every - self.family_pinned(key)
        dims = set(marked) | self.family_dynamic(key)
        for guards in self._family(key):
            for i, (old, new) in enumerate(zip(guards.signature.tensors, signature.tensors)):
                dims |= {(i, d) for d, (a, b) in enumerate(zip(old[0], new[0])) if a != b}
        return frozenset(dims) - self.family_pinned(key)

    def family_pinned(self, key: Key) -> frozenset[tuple[int, int]]:
        """The dimensions an earlier build of this call's family was asked to trace as symbols
        and pinned to one size: traced as numbers from then on (``ShapeGuard.pinned``)."""
        return frozenset(d for guards in self._family(key) for d in guards.shapes.pinned)

    def family_member(self, key: Key) -> Program | None:
        """The most recently used program of this call's family (same structure; signatures
        that differ in sizes only)."""
        for serial in reversed(self._programs):
            program = self._programs[serial]
            if _in_family(program.guards, key):
                return program
        return None

    def family_dynamic(self, key: Key) -> frozenset[tuple[int, int]]:
        """The dimensions already dynamic (and not pinned) in programs of this call's family."""
        return frozenset(
            d for guards in self._family(key) for d in guards.shapes.dynamic - guards.shapes.pinned
        )

    def _family(self, key: Key) -> list[Guards]:
        """The guards of the cached programs of this call's family, least recently used first."""
        return [
            p.guards
            for p in self._programs.values()
            if p.guards is not None and _in_family(p.guards, key)
        ]

    def count_build(
        self, graph_name: str, structure: Structure, why: tuple[str, str], limit: int
    ) -> None:
        """Count a build for ``structure`` (``why``: what changed, and in words);
        RecompileLimitError beyond ``limit`` builds, naming what kept changing."""
        reasons = self.builds.setdefault(structure, [])
        if len(reasons) >= limit:
            raise RecompileLimitError(_limit_message(graph_name, limit, reasons[1:] + [why]))
        reasons.append(why)

    def keep(self, key: Key, program: Program, capacity: int) -> list[Program]:
        """Cache a new program (most recently used); return those dropped beyond ``capacity``."""
        self._serial += 1
        program.serial = self._last = self._serial
        self._programs[self._serial] = program
        self._remember(key, program)
        dropped = []
        while len(self._programs) > capacity:
            _, old = self._programs.popitem(last=False)
            dropped.append(old)
        if dropped:
            self._memo = {k: p for k, p in self._memo.items() if p not in dropped}
        return dropped

    def clear(self) -> None:
        self._programs.clear()
        self._memo.clear()
        self._last = 0


def _in_family(guards: Guards | None, key: Key) -> bool:
    signature, structure = key
    return (
        guards is not None
        and guards.structure == structure
        and family(guards.signature) == family(signature)
    )


def precision_differences(old: Program, new: Program) -> list[str]:
    """The ops both forwards run in the same module that ``new`` gives other precisions than
    ``old`` (low precision or fp32): empty when the two agree. A dynamic step is traced from
    the same build(), so this should be empty: sizes must not decide precision. An op only one
    of them has is no difference: sizes decide which ops a trace records (a slice of a whole
    dimension is left out of a static trace and kept in a symbolic one)."""
    before, after = _decisions(old), _decisions(new)
    return [
        f"{op} in {module or 'build()'}: {'/'.join(sorted(before[op, module]))} before, "
        f"{'/'.join(sorted(after[op, module]))} now"
        for op, module in sorted(before.keys() & after.keys())
        if before[op, module] != after[op, module]
    ]


def _decisions(program: Program) -> dict[tuple[str, str], set[str]]:
    """(op, module) -> the colours its nodes got in ``program``'s forward."""
    colours: dict[tuple[str, str], set[str]] = {}
    for n in program.forward.graph.nodes:
        if is_compute_node(n) and n.meta.get("amp_colour") in ("allow", "deny"):
            colours.setdefault((op_name(n), module_path(n) or ""), set()).add(n.meta["amp_colour"])
    return colours


def marked_dynamic(tensors: list) -> frozenset[tuple[int, int]]:
    """The dimensions the user marked with ``torch._dynamo.mark_dynamic`` (or
    ``maybe_mark_dynamic``), which torch.compile users already write: (tensor index, dim)."""
    dims = set()
    for i, t in enumerate(tensors):
        for attr in ("_dynamo_dynamic_indices", "_dynamo_weak_dynamic_indices"):
            dims |= {(i, d) for d in getattr(t, attr, ())}
    return frozenset(dims)


def _limit_message(graph_name: str, limit: int, reasons: list[tuple[str, str]]) -> str:
    counts: dict[str, int] = {}
    last: dict[str, str] = {}
    for subject, words in reasons:  # by what changed, whatever its values
        counts[subject] = counts.get(subject, 0) + 1
        last[subject] = words
    common = sorted(counts.items(), key=lambda kv: -kv[1])[:3]
    listed = "; ".join(f"{last[subject]} ({n}x)" for subject, n in common)
    return (
        f"{graph_name}: {limit} steps were compiled for the same model and config "
        f"(config.set_recompile_limit({limit})); calls keep changing what a compiled step "
        f"assumes: {listed}. Keep it fixed between calls: pass changing numbers as tensors "
        "(torch.tensor(value)); leave attributes build() reads alone or pass them to g(...) as "
        "tensors; let sizes vary (config.set_dynamic_shapes(None), the default) or mark them "
        "with torch._dynamo.mark_dynamic(tensor, dim); or raise the limit"
    )
