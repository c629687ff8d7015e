"""build()'s writes to the user's objects, brought to the state eager PyTorch leaves.

Libraries write Python state in forward: transformers installs its output-capturing hooks on
first use and sets ``_output_capturing_hooks_installed``; a rotary embedding builds its
cos/sin cache on first use; torchvision's RAFT keeps the correlation pyramid it builds and
reads in the same forward. The compiled step runs no Python, so capture does what
torch.compile's guards and side-effect replay amount to, once, at capture:

1. The first trace records every change build() made (``state_writes.py``); the objects are
   put back. No change: that trace is the program (the common case, no extra cost).
2. Otherwise the changes are *settled*: Python values (flags, sizes, hooks) are applied as
   eager's first call leaves them; tensors computed from parameters, buffers and constants
   only (a rotary cache) are computed for real from the first trace's graph, once, as eager's
   first call computes them; tensors computed from the call's batch get zero stand-ins.
3. build() is traced again on that state. This second trace is the program: what build() does
   on every call after the first. Its own changes must leave the state as it found it (the
   same Python values, tensors of the same shapes), and it must not read a stand-in: then
   every call after the first does the same, and the only writes left are tensors computed on
   every call, which the step outputs and the runtime replays after each call
   (``records/replays.py``). A Python value that changes on every call (a call counter), a
   value computed from one call's batch and read by the next, one written on the first call
   only, or a tensor attribute read and rewritten every call (not a buffer): refused by name,
   and the user's objects are put back exactly as they were (``Settled.undo``).

Symbolic sizes (dynamic shapes, ``torchkit/shapes.py``): the first trace runs on a copy of the
batch in a ShapeEnv of its own (what it assumes of the sizes, in the state before the call, is
no guard of the program); a size build() stores, and a tensor sized by the batch's sizes, are
settled at this call's sizes, as eager's call leaves them (a rotary cache grown to this length).
The second trace then assumes that state (``max_len <= 9``). A size stored on every call is
refused: the step serves many sizes and runs no Python.

The settled state stays on the user's objects (eager leaves it too); a later stage's failure
undoes it (``pipeline.build_program``).
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._subclasses, torch.utils._pytree
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

from ..errors import CaptureError
from ..records.replays import MISSING, TENSOR_SLOT, Place, StateReplay
from ..records.spec import CapturedForward
from ..torchkit.compat import guarding_hint_or_throw, has_guarding_hint
from .side_effects import registered_hook_error
from .state_writes import Change


@dataclass
class WrittenValue:
    """One change build() made, its value as leaves: ``traced`` marks the leaves that are
    values of the trace (outputs of the forward, ``first_output`` onwards among the extra
    outputs); parameters and buffers build() stored are the user's real tensors here."""

    change: Change
    spec: pytree.TreeSpec
    leaves: list[Any]
    traced: list[bool]
    first_output: int

    @property
    def place(self) -> Place:
        return self.change.place

    def replay(self) -> StateReplay:
        template = tuple(TENSOR_SLOT if t else leaf for leaf, t in zip(self.leaves, self.traced))
        return StateReplay(self.place, self.spec, template)


def written_values(
    graph_name: str, changes: list[Change], real_of: dict[int, torch.Tensor]
) -> tuple[list[WrittenValue], list[torch.Tensor]]:
    """The changes as WrittenValues, and the traced tensors among them in order (the extra
    outputs of the forward). ``real_of``: id of a traced parameter or buffer -> the user's
    tensor. Called inside the trace, while the values are live."""
    written: list[WrittenValue] = []
    outputs: list[torch.Tensor] = []
    for change in changes:
        _refuse_registration(graph_name, change)
        value = change.after
        leaves, spec = pytree.tree_flatten(value)
        leaves = [real_of.get(id(x), x) if isinstance(x, torch.Tensor) else x for x in leaves]
        traced = [_is_traced(x) for x in leaves]
        for leaf in leaves:
            if _is_symbolic(leaf) and not _is_batch_size(leaf):
                raise _error(graph_name, change, "stores a size that depends on tensor values")
        written.append(WrittenValue(change, spec, leaves, traced, len(outputs)))
        outputs += [x for x, t in zip(leaves, traced) if t]
    return written, outputs


def _is_traced(x: Any) -> bool:
    return isinstance(x, (FakeTensor, FunctionalTensor))


def _is_symbolic(x: Any) -> bool:
    return isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool))


def _is_batch_size(x: Any) -> bool:
    """A size (or a comparison of sizes) of the batch's symbolic dimensions (torchkit/shapes.py):
    this call's value is known; a size that depends on tensor values (nonzero) is not."""
    return isinstance(x, (torch.SymInt, torch.SymBool)) and has_guarding_hint(x)


def _this_call(x: Any) -> Any:
    """A size of the batch as this call's value (what eager's call leaves); other leaves as
    they are."""
    return guarding_hint_or_throw(x) if _is_batch_size(x) else x


def _refuse_registration(graph_name: str, change: Change) -> None:
    """A parameter or submodule created in forward (lazy modules) cannot be traced: the step's
    parameters are fixed when it is built."""
    place = change.place
    if place.kind == "entry" and place.name in ("_parameters", "_modules"):
        what = "a parameter" if place.name == "_parameters" else "a submodule"
        raise CaptureError(
            f"{graph_name}.build() registers {what} {place.label}.{place.key}"
            f"{change.where()}: The compiled step's parameters and modules are fixed when it "
            "is built: create it in __init__ (for lazy modules such as nn.LazyLinear, run one "
            "forward before the first call)"
        )


@dataclass
class Settled:
    """The state eager's first call leaves, applied on the user's objects (undo puts back)."""

    graph_name: str
    first: list[WrittenValue]
    stand_ins: dict[int, WrittenValue] = field(default_factory=dict)  # id(stand-in) -> write
    per_call: list[WrittenValue] = field(default_factory=list)  # writes with stand-ins

    def undo(self) -> None:
        for w in reversed(self.first):
            w.place.write(w.change.before)

    def steady_replays(
        self, second: CapturedForward, again: list[WrittenValue]
    ) -> list[StateReplay]:
        """Check that the second trace ``second`` (changes ``again``) is the steady state; the
        writes to replay after every call. Puts the places that had stand-ins back."""
        read = {id(t) for t in second.constants}
        rewritten = {_key(w.place) for w in again}
        for w in again:
            if any(_is_symbolic(x) for x in _leaves(w.change.after)):
                raise _error(
                    self.graph_name,
                    w.change,
                    "stores a size of g(...)'s inputs on every call, which the step traced as "
                    "symbolic (it serves several sizes and runs no Python). Compute it outside "
                    "build(), or write it only when it changes (as a cache that grows)",
                )
            if _signature(w.change.before) != _signature(w.change.after):
                raise _changes_every_call(self.graph_name, w)
            if w.change.after is w.change.before:  # set again to the very value it held
                continue
            if any(isinstance(x, torch.Tensor) and id(x) in read for x in _leaves(w.change.before)):
                raise _error(
                    self.graph_name,
                    w.change,
                    "reads the tensor and writes a new one on every call: each call needs the "
                    "last one's value. Make it a buffer (module.register_buffer) that "
                    "build() updates in place: the step then carries it from call to call",
                )
        for stand_in, w in self.stand_ins.items():
            if stand_in in read:
                raise _error(
                    self.graph_name,
                    w.change,
                    "keeps a value computed from one call's inputs that the next call reads "
                    "back: the compiled step would read a constant. Pass it to g(...) as "
                    "an input, or make it a buffer that build() updates",
                )
        for w in self.per_call:
            if _key(w.place) not in rewritten:
                raise _error(
                    self.graph_name,
                    w.change,
                    "sets it on the first call only, from that call's values; the compiled "
                    "step cannot keep a value of the first call. Compute it before the first "
                    "call, outside build()",
                )
            w.place.write(w.change.before)
        # every write is replayed, plain values too: another program (another size) may have
        # left another value there since
        return [w.replay() for w in again]


def settle(
    graph_name: str,
    written: list[WrittenValue],
    extras: list[fx.Node],
    evaluate: Callable[[list[fx.Node]], list[torch.Tensor | None]],
) -> Settled:
    """Apply the state eager's first call leaves (module docstring, step 2). ``extras``: the
    first trace's nodes of the written tensors; ``evaluate`` computes nodes for real where
    they depend on no batch input (None elsewhere)."""
    for w in written:
        place = w.place
        if place.kind == "entry":
            where = f"{place.label}{w.change.where()}"
            error = registered_hook_error(graph_name, place.name, where, w.change.after)
            if error is not None:
                raise error
    settled = Settled(graph_name, written)
    values = evaluate(extras) if extras else []
    for w in written:
        leaves = [_this_call(x) for x in w.leaves]
        slots = [i for i, t in enumerate(w.traced) if t]
        for k, i in enumerate(slots):
            real = values[w.first_output + k]
            if real is None:
                real = _stand_in(leaves[i])
                if real is None:
                    raise _error(
                        graph_name,
                        w.change,
                        "stores a tensor whose size depends on tensor values (nonzero, "
                        "boolean-mask indexing)",
                    )
                settled.stand_ins[id(real)] = w
                if not settled.per_call or settled.per_call[-1] is not w:
                    settled.per_call.append(w)
            leaves[i] = real
        if w.place.name == "_buffers" and w in settled.per_call:
            raise _error(
                graph_name,
                w.change,
                "registers a buffer from the call's inputs: register it in __init__",
            )
        w.place.write(pytree.tree_unflatten(leaves, w.spec))
    return settled


def _stand_in(traced: torch.Tensor) -> torch.Tensor | None:
    """A real zero tensor like a traced one (shape, dtype, device), for a per-call value: of
    this call's sizes where the batch's are symbolic; None where a size depends on values."""
    shape = [_this_call(s) for s in traced.shape]
    if any(_is_symbolic(s) for s in shape):
        return None
    return torch.zeros(shape, dtype=traced.dtype, device=traced.device)


def _key(place: Place) -> tuple:
    return (id(place.owner), place.name, place.kind, place.key)


def _leaves(value: Any) -> list[Any]:
    return [] if value is MISSING else pytree.tree_leaves(value)


def _signature(value: Any) -> Any:
    """What the next call's Python can tell apart: the structure, each tensor's shape, dtype and
    device, every other leaf's value (plain values) or identity (other objects)."""
    if value is MISSING:
        return ("missing",)
    leaves, spec = pytree.tree_flatten(value)
    return (spec, tuple(_leaf_signature(x) for x in leaves))


_PLAIN = (int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device)


def _leaf_signature(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), x.dtype, x.device.type)
    if isinstance(x, _PLAIN):
        return ("value", type(x), x)
    if isinstance(x, (tuple, frozenset)):
        return ("value", type(x), x)
    return ("object", id(x))


def _changes_every_call(graph_name: str, w: WrittenValue) -> CaptureError:
    before, after = _show(w.change.before), _show(w.change.after)
    return _error(
        graph_name,
        w.change,
        f"changes it on every call ({before} after the first call, {after} after the "
        "second): graphamp compiles build() once and runs no Python in later steps, so it "
        "cannot replay a Python value that changes from call to call. Keep it outside build() "
        "(g.step_count counts the steps), or make it a tensor buffer (register_buffer) that "
        "build() updates in place",
    )


def _show(value: Any) -> str:
    if value is MISSING:
        return "unset"
    text = repr(value) if not isinstance(value, torch.Tensor) else "a tensor"
    return text if len(text) <= 60 else text[:57] + "..."


def _error(graph_name: str, change: Change, what: str) -> CaptureError:
    return CaptureError(
        f"{graph_name}.build() writes {change.place.describe()}{change.where()}, and {what}. "
        "Your objects were put back as they were"
    )
