"""Which instructions of which code a capture's trace function watches (``scope_reads.py``).

The user's code only: not torch's, graphamp's or Python's standard library; code compiled
from text (``exec``, ``python -c``, a console) where it runs in a user's module. In it, the
reads and writes of globals and closure variables (with the attribute the next instruction
reads off the value, ``Config.kl_weight``), and the attribute reads off a class the code
reaches without naming it (``cls.scale``, ``type(obj).scale``, ``obj.__class__.scale``).
Each code object is analysed once (``ops_of``, kept weakly by code object).
"""

from __future__ import annotations

import dis
import types
import weakref
from typing import Any

from ..records.replays import MISSING
from ..torchkit.fxutil import is_library_file
from .reads import INSTALLED, PYTHONS_OWN, is_user_code

_WATCHED_OPS = {"LOAD_GLOBAL", "LOAD_DEREF", "LOAD_CLASSDEREF", "STORE_GLOBAL", "STORE_DEREF"}
_ATTRIBUTE_OPS = {"LOAD_ATTR", "LOAD_METHOD"}
_Op = tuple[str, str, "str | None"]  # opname, the variable's name, the attribute read off it
# per code object, what to watch in it; weak: a notebook cell run again makes new code objects
_traced_code: weakref.WeakKeyDictionary[types.CodeType, dict[int, _Op] | None] = (
    weakref.WeakKeyDictionary()
)


def ops_of(code: types.CodeType, module_globals: dict) -> dict[int, _Op] | None:
    """{offset: (opname, name, attribute)} of the reads and writes to watch in ``code``; None
    for code that is not the user's. ``attribute``: the name the next instruction reads off the
    variable's value (``Config.kl_weight``), where it does so on every path."""
    ops = _traced_code.get(code, _traced_code)
    if ops is not _traced_code:
        return ops  # type: ignore[return-value]
    ops = None
    filename = code.co_filename
    if filename.startswith("<"):  # compiled from text: ``exec``, ``python -c``, a console
        watched = is_user_code(filename, module_globals)
    else:
        standard = filename.startswith(PYTHONS_OWN) and not filename.startswith(INSTALLED)
        watched = not is_library_file(filename) and not standard
    if watched:
        ops = {}
        instructions = list(dis.get_instructions(code))
        for i, after in zip(instructions, [*instructions[1:], instructions[-1]]):
            if i.opname in _WATCHED_OPS:
                read_off = after is not i and after.opname in _ATTRIBUTE_OPS
                attribute = after.argval if read_off and not after.is_jump_target else None
                ops[i.offset] = (i.opname, i.argval, attribute)
        ops.update(_class_reads_of_locals(instructions))
    _traced_code[code] = ops
    return ops


_CALL_OPS = {"PRECALL", "CALL"}  # a call of one argument: 3.11 has both, 3.12 only CALL
_NAME_LOADS = {"LOAD_FAST", "LOAD_GLOBAL", "LOAD_DEREF"}


def _class_reads_of_locals(instructions: list[dis.Instruction]) -> dict[int, _Op]:
    """The attribute reads off a class that code reaches without naming it: ``cls.scale`` in a
    classmethod (``CLASS_IN``: a local holding a class), ``type(obj).scale`` and
    ``obj.__class__.scale`` (``CLASS_OF`` a local, global or closure variable, whose load
    follows the op's name). A class's own attribute reads go through its metaclass, which
    capture cannot watch, so these are read when the op runs; ``self.x`` is an object's read
    (``reads.watch_object``), and ``Config.x`` a global's (``_read_global``)."""
    ops: dict[int, _Op] = {}

    def read_off(k: int) -> str | None:
        i = instructions[k] if k < len(instructions) else None
        good = i is not None and i.opname in _ATTRIBUTE_OPS and not i.is_jump_target
        return i.argval if good else None  # type: ignore[union-attr]

    for k, i in enumerate(instructions):
        if i.opname not in _NAME_LOADS:
            continue
        first = read_off(k + 1)
        if first == "__class__" and read_off(k + 2):  # obj.__class__.scale, at __class__
            ops[instructions[k + 1].offset] = (f"CLASS_OF_{i.opname}", i.argval, read_off(k + 2))
        elif first is not None and i.opname == "LOAD_FAST" and i.argval != "self":
            ops[i.offset] = ("CLASS_IN", i.argval, first)
        elif k and instructions[k - 1].opname == "LOAD_GLOBAL":
            before = instructions[k - 1]
            end = k + 1
            while end < len(instructions) and instructions[end].opname in _CALL_OPS:
                end += 1
            if before.argval == "type" and end > k + 1 and read_off(end):  # type(obj).scale
                ops[before.offset] = (f"CLASS_OF_{i.opname}", i.argval, read_off(end))
    return ops


def loaded(frame: types.FrameType, load: str, name: str) -> Any:
    """What ``load`` of ``name`` gives in ``frame`` now (MISSING: unbound)."""
    if load == "LOAD_GLOBAL":
        return frame.f_globals.get(name, MISSING)
    return frame.f_locals.get(name, MISSING)  # locals, cells and free variables
