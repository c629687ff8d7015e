"""What a compiled step assumes, checked before every call: one record, one way to say what changed.

A program is built from one call of build(). Besides its inputs' signature it assumes:
- the structure (``records.guards.Structure``, computed by ``runtime.structure_key``): registered modules, their modes, the
  optimizers' structure, the config, the scaler's settings, torch modes, hooks;
- the batch's shapes (``ShapeGuard``): every size and stride it was traced with, except the
  dimensions that are symbolic, whose relations, ranges and strides the ShapeEnv recorded while
  tracing and which are checked by the guard expression it produced;
- the Python values build() read, with the values they had (``AttributeRead``): attributes of
  the registered objects and of their classes, globals and closure variables of the code it
  ran, and the contents of small containers among them (``capture/reads.py``,
  ``capture/scope_reads.py``);
- the sizes of the parameters and buffers (``StateSize``): ``p.data = bigger`` keeps the
  parameter object but not its shape.
Input aliasing is not assumed: every tensor of the batch is traced as a tensor of its own (no
memory shared with another input or with the state), so ``g(x, x)`` and ``g(noisy, x)`` run the
same program and compute what eager computes; a batch tensor that shares memory with the state
is copied before the step (``runtime.runner``), since the step writes the state in place.

``Guards.first_change`` names the first assumption a call breaks; ``describe_change`` is the
wording every log line and error uses.
"""

from __future__ import annotations

import contextvars
import dataclasses
import sys
from dataclasses import dataclass, field
from types import CodeType
from typing import Any, NamedTuple, Sequence

import torch

from .inputs import InputSignature
from .validate import dtype_name

ABSENT = object()  # an attribute or global that is not there (also: "read on the class")


@dataclass(frozen=True, eq=False)
class AttributeRead:
    """A Python attribute build() read at capture, and the value it had."""

    label: str  # as the user writes it: "self.model.drop.p", "global beta", "Block.scale"
    # where the value lives: an object's __dict__, a class's, a module's globals, a closure cell
    namespace: Any  # anything with .get(name, default)
    name: str
    value: Any
    by_value: bool  # compared with ==; otherwise by identity (objects whose insides may change)

    def current(self) -> Any:
        return self.namespace.get(self.name, ABSENT)

    def place(self) -> tuple[int, str]:
        """Where the value lives, the same for every read of it (a class's and a closure's
        namespaces are stand-ins made at each read: their ``owner`` is the class or cell)."""
        return id(getattr(self.namespace, "owner", self.namespace)), self.name

    def write(self, value: Any) -> None:
        """Put ``value`` where the read found its value (``ABSENT`` deletes)."""
        if value is ABSENT:
            self.namespace.pop(self.name, None)
        else:
            self.namespace[self.name] = value

    def describe_change(self) -> str:
        now = self.current()
        if self.value is ABSENT:  # a class attribute's read, now shadowed
            if isinstance(self.namespace, ContextValue):
                return f"{self.label} was set to {now!r}"
            on = "subclass" if isinstance(self.namespace, ClassNamespace) else "instance"
            return f"{self.label} was set on the {on} to {now!r}"
        shown = "deleted" if now is ABSENT else f"{now!r}"
        return f"{self.label} changed from {self.value!r} to {shown}"

    def holds(self) -> bool:
        now = self.namespace.get(self.name, ABSENT)
        if now is self.value:
            return True
        if not self.by_value or now is ABSENT:
            return False
        try:
            return bool(now == self.value)
        except Exception:  # a value that cannot say whether it is equal has changed
            return False


class ClassNamespace:
    """A class's attributes as a namespace (``vars(cls)`` is read-only)."""

    def __init__(self, owner: type) -> None:
        self.owner = owner

    def get(self, name: str, default: Any = None) -> Any:
        return vars(self.owner).get(name, default)

    def __setitem__(self, name: str, value: Any) -> None:
        setattr(self.owner, name, value)

    def pop(self, name: str, default: Any = None) -> Any:
        value = self.get(name, default)
        if name in vars(self.owner):
            delattr(self.owner, name)
        return value


class SlotNamespace:
    """An object's slot (a name in its class's ``__slots__``) as a namespace of one variable:
    the value lives in the object, read and written through the class's descriptor."""

    def __init__(self, owner: Any, slot: Any) -> None:
        self.owner = owner
        self.slot = slot  # the class's member descriptor

    def get(self, _name: str, default: Any = None) -> Any:
        try:
            return self.slot.__get__(self.owner, type(self.owner))
        except AttributeError:  # the slot is not set
            return default

    def __setitem__(self, _name: str, value: Any) -> None:
        self.slot.__set__(self.owner, value)

    def pop(self, name: str, default: Any = None) -> Any:
        value = self.get(name, default)
        try:
            self.slot.__delete__(self.owner)
        except AttributeError:
            pass
        return value


class ObjectAttributes:
    """An object's attributes as a namespace, read and written as attributes: a function's
    ``__defaults__`` and ``__kwdefaults__``, a ``functools.partial``'s ``keywords``."""

    def __init__(self, owner: Any) -> None:
        self.owner = owner

    def get(self, name: str, default: Any = None) -> Any:
        return getattr(self.owner, name, default)

    def __setitem__(self, name: str, value: Any) -> None:
        setattr(self.owner, name, value)

    def pop(self, name: str, default: Any = None) -> Any:
        value = self.get(name, default)
        try:
            delattr(self.owner, name)
        except (AttributeError, TypeError):  # read-only (a partial's keywords)
            pass
        return value


class ContextValue:
    """A ``contextvars.ContextVar``'s value in the running context, as a namespace of one
    variable: what ``var.get()`` returns where the step is called (the variable's default
    where the context holds no value).

    A value written here (a lifted value's stand-in while build() is traced) is set with a
    token, and writing back what ``var.get()`` returned before resets it: the context is left
    as it was found, holding no value where it held none."""

    def __init__(self, owner: Any) -> None:
        self.owner = owner  # the ContextVar
        self._token: contextvars.Token | None = None  # of the first write not yet undone

    def get(self, _name: str, default: Any = None) -> Any:
        try:
            return self.owner.get()
        except LookupError:  # no value in this context and no default
            return default

    def __setitem__(self, _name: str, value: Any) -> None:
        if self._token is not None and value is self._before(self._token):
            self._undo()
            return
        token = self.owner.set(value)
        if self._token is None:
            self._token = token

    def pop(self, name: str, default: Any = None) -> Any:
        value = self.get(name, default)
        if self._token is not None:  # a value cannot be unset but by its token
            self._undo()
        return value

    def _before(self, token: contextvars.Token) -> Any:
        """What ``var.get()`` returned before ``token``'s write."""
        if token.old_value is not contextvars.Token.MISSING:
            return token.old_value
        return contextvars.Context().run(self.get, "", ABSENT)  # the default, in no context

    def _undo(self) -> None:
        token, self._token = self._token, None
        try:
            self.owner.reset(token)
        except ValueError:  # made in another context: that context keeps its value
            pass


class CellNamespace:
    """A closure cell as a namespace of one variable."""

    def __init__(self, owner: Any) -> None:
        self.owner = owner  # a types.CellType

    def get(self, _name: str, default: Any = None) -> Any:
        try:
            return self.owner.cell_contents
        except ValueError:  # an empty cell
            return default

    def __setitem__(self, _name: str, value: Any) -> None:
        self.owner.cell_contents = value

    def pop(self, name: str, default: Any = None) -> Any:
        value = self.get(name, default)
        del self.owner.cell_contents
        return value


@dataclass(frozen=True, eq=False)
class LiftedValue:
    """A Python float build() reads, fed to the step as a 0-dim float32 tensor at every call
    instead of being baked in (a KL weight annealed by the training loop compiles once more,
    not once per value). The program assumes it stays a float.

    float32, as the arithmetic of a float32 tensor with a Python number rounds the number to
    float32 (eager's result, bitwise). Where a Python number would not change an operand's
    dtype but a float32 tensor does (a 0-dim float16 tensor times it, a float64 tensor times it
    keeps only float32 of the value) the step differs from eager: such a value is better
    passed as a tensor of the dtype wanted."""

    read: AttributeRead  # where the value lives
    holder: torch.Tensor  # the step's input: the value, copied in before each call

    def holds(self) -> bool:
        return is_float_number(self.read.current())

    def feed(self) -> float:
        """Copy the value into its tensor; the value, as build() would have read it."""
        value = float(self.read.current())
        self.holder.fill_(value)
        return value


def liftable(read: AttributeRead | None) -> bool:
    """Can the value a changed read found be fed as a step input (a float that stayed one)?"""
    return (
        read is not None
        and read.by_value
        and is_float_number(read.value)
        and is_float_number(read.current())
    )


def is_float_number(value: Any) -> bool:
    """A Python float, or numpy's (a schedule made with ``np.linspace``: ``np.float64``,
    ``np.float32``), which torch's ops take as a Python number; not a bool or an int."""
    if type(value) is float:
        return True
    numpy = sys.modules.get("numpy")  # never imported here: a value of it means it is
    return numpy is not None and isinstance(value, numpy.floating)


@dataclass(frozen=True, eq=False)
class StateSize:
    """A parameter's or buffer's shape when the step was traced (looked up live at every call)."""

    label: str
    namespace: dict  # the module's _parameters or _buffers
    name: str
    shape: torch.Size

    def holds(self) -> bool:
        tensor = self.namespace.get(self.name)
        return tensor is not None and tensor.shape == self.shape


@dataclass(frozen=True, eq=False)
class ShapeGuard:
    """The batch shapes a program serves.

    ``dynamic`` lists the symbolic dimensions (tensor index among g(...)'s tensors, dimension).
    A static program (no symbolic dimension) serves exactly the signature it was traced with;
    a dynamic one serves every batch of that signature's family (pytree structure, Python
    numbers, dtypes, devices, numbers of dimensions) for which ``expression`` holds: the
    ShapeEnv's guards over the sizes and strides of ``L['t0']``, ``L['t1']``, ...
    """

    dynamic: frozenset[tuple[int, int]] = frozenset()
    expression: str | None = None
    code: CodeType | None = field(default=None, repr=False)
    # of ``dynamic``, the dimensions the trace pinned to their traced size (a size read as a
    # number: ``int(t.shape[1])``, a branch on ``t == 12``, or torch 2.11's fake tensors under
    # functionalization): the program serves that size only, and later builds of the family
    # trace them as numbers (``runtime/programs.dynamic_dims``)
    pinned: frozenset[tuple[int, int]] = frozenset()
    globals: dict = field(default_factory=dict, repr=False)

    def admits(self, traced: InputSignature, call: InputSignature, tensors: Sequence) -> bool:
        if not self.dynamic or self.code is None:
            return call == traced
        if family(call) != family(traced):
            return False
        try:
            return bool(eval(self.code, self.globals, {"L": _Args(tensors)}))
        except Exception:  # a guard that cannot be evaluated does not hold
            return False


class _Args(dict):
    """``L['t3']`` -> the fourth batch tensor (the names the ShapeEnv's guards use)."""

    def __init__(self, tensors: Sequence) -> None:
        super().__init__()
        self.tensors = tensors

    def __missing__(self, key: str) -> Any:
        return self.tensors[int(key[1:])]


def family(signature: InputSignature) -> tuple:
    """What two signatures must share for one dynamic program to serve both: everything but the
    sizes and strides of the tensors."""
    return (
        signature.structure,
        signature.constants,
        tuple((len(shape), dtype, device) for shape, dtype, device, _ in signature.tensors),
    )


@dataclass(frozen=True, eq=False)
class Change:
    """The first assumption of a program that a call breaks, in words."""

    kind: str  # "structure", "inputs", "attribute", "state size"
    words: str
    read: AttributeRead | None = None  # the read that no longer holds (kind "attribute")
    # the program's other reads this call breaks too (two floats annealed by one loop)
    also: tuple[AttributeRead, ...] = ()

    def __str__(self) -> str:
        return self.words

    @property
    def subject(self) -> str:
        """What changed, without its values: the recompile limit counts changes by it."""
        return self.read.label if self.read is not None else self.words


@dataclass(frozen=True)
class BuildRequest:
    """What the runtime asks of a build besides the registration and the batch."""

    structure: Structure  # the structure key of the call (the program assumes it)
    dynamic: frozenset[tuple[int, int]] = frozenset()  # batch dimensions traced as symbols
    lifted: tuple[AttributeRead, ...] = ()  # Python floats traced as inputs (LiftedValue)
    lifted_inputs: frozenset[int] = frozenset()  # tensor inputs that are float arguments


@dataclass(eq=False)
class Guards:
    """Everything a program assumes besides the values of its tensors (module docstring)."""

    structure: Structure  # at build time
    signature: InputSignature  # of the call it was built from
    shapes: ShapeGuard
    attributes: tuple[AttributeRead, ...] = ()
    state_sizes: tuple[StateSize, ...] = ()
    lifted: tuple[LiftedValue, ...] = ()

    def values_hold(self) -> bool:
        """The attribute values and state sizes (the part a structure and signature match
        cannot tell); cheap: one dict lookup and comparison each."""
        return self._first_broken() is None

    def _first_broken(self) -> AttributeRead | LiftedValue | StateSize | None:
        """The first value guard that does not hold, in the one order every check and every
        message walks them: attributes, lifted values, state sizes."""
        for read in self.attributes:
            if not read.holds():
                return read
        for value in self.lifted:
            if not value.holds():
                return value
        for size in self.state_sizes:
            if not size.holds():
                return size
        return None

    def serves(self, structure: Structure, signature: InputSignature, tensors: Sequence) -> bool:
        """Does the program serve this call? (``first_change`` says why not, in words.)"""
        return (
            structure == self.structure
            and self.shapes.admits(self.signature, signature, tensors)
            and self.values_hold()
        )

    def first_change(
        self, structure: Any, signature: InputSignature, tensors: Sequence, input_names: Sequence
    ) -> Change | None:
        """The first assumption this call breaks, or None when the program serves it."""
        if structure != self.structure:
            return Change("structure", structure_words(self.structure, structure))
        if not self.shapes.admits(self.signature, signature, tensors):
            return Change("inputs", describe_signatures(self.signature, signature, input_names))
        broken = self._first_broken()
        if isinstance(broken, AttributeRead):
            also = tuple(r for r in self.attributes if r is not broken and not r.holds())
            return Change("attribute", broken.describe_change(), broken, also)
        if isinstance(broken, LiftedValue):
            now = broken.read.current()
            shown = "deleted" if now is ABSENT else f"{now!r}"
            return Change("attribute", f"{broken.read.label}, a step input, is now {shown}")
        if isinstance(broken, StateSize):
            now = broken.namespace.get(broken.name)
            shown = str(tuple(now.shape)) if now is not None else "missing"
            return Change(
                "state size", f"{broken.label} changed shape from {tuple(broken.shape)} to {shown}"
            )
        return None


def describe_change(
    old: Guards,
    structure: Any,
    signature: InputSignature,
    tensors: Sequence,
    input_names: Sequence,
) -> str:
    """In words, why ``old`` does not serve this call ("nothing" when it does)."""
    change = old.first_change(structure, signature, tensors, input_names)
    return "nothing" if change is None else change.words


def describe_signatures(old: InputSignature, new: InputSignature, names: Sequence[str]) -> str:
    """What differs between two input signatures: the first tensor dimension, dtype or layout,
    or the Python numbers and structure."""
    if old.structure != new.structure or len(old.tensors) != len(new.tensors):
        return "the structure of g(...)'s arguments changed"
    if old.constants != new.constants:
        return "a Python number or string among g(...)'s arguments changed"
    for i, (a, b) in enumerate(zip(old.tensors, new.tensors)):
        name = names[i] if i < len(names) else f"tensor {i}"
        (shape_a, dtype_a, device_a, stride_a), (shape_b, dtype_b, device_b, stride_b) = a, b
        if dtype_a != dtype_b:
            return f"input {name!r} changed dtype ({dtype_name(dtype_a)} to {dtype_name(dtype_b)})"
        if device_a != device_b:
            return f"input {name!r} moved from {device_a} to {device_b}"
        if len(shape_a) != len(shape_b):
            return f"input {name!r} changed its number of dimensions ({len(shape_a)} to {len(shape_b)})"
        for d, (x, y) in enumerate(zip(shape_a, shape_b)):
            if x != y:
                return f"input {name!r} dimension {d} changed size ({x} to {y})"
        if stride_a != stride_b:
            return f"input {name!r} changed memory layout (strides {stride_a} to {stride_b})"
    return "the batch's sizes fall outside what the dynamic step was traced for"


class Structure(NamedTuple):
    """What a compiled step depends on besides its inputs, part by part (computed at every call
    by ``runtime.structure_key.StructureKey``)."""

    modules: tuple  # names, identities, parameters and buffers of the registered module tree
    module_modes: tuple  # training flags and child/parameter/buffer counts; declared fp32 parts
    optimizers: tuple  # each optimizer slot's structure()
    config: Any  # the ConfigSnapshot
    grad_scaler: tuple | None  # (identity, settings) of the scaler in use
    torch_modes: tuple  # ambient.mode_key(): default dtype, deterministic algorithms
    hooks: tuple  # ids of the module hooks registered anywhere (each refused or traced at capture)


_STRUCTURE_CHANGES = {
    "modules": "the registered modules changed (a layer, parameter or buffer was added, removed "
    "or replaced)",
    "module_modes": "a module switched between train() and eval(), lost a child, or changed the "
    "parts it declares fp32 (_keep_in_fp32_modules)",
    "optimizers": "an optimizer's param groups changed (parameters, requires_grad, or an "
    "option baked into the step: momentum or amsgrad on or off, a traced optimizer's options "
    "other than lr)",
    "config": "the graph's config changed",
    "grad_scaler": "the grad scaler's settings changed",
    "torch_modes": "the default dtype or torch.use_deterministic_algorithms changed",
    "hooks": "a forward or backward hook was registered or removed",
}


def structure_words(old: Structure, new: Structure) -> str:
    """Which parts of two structures differ, in words."""
    words = []
    for part in Structure._fields:
        if getattr(old, part) != getattr(new, part):
            extra = _config_fields(old.config, new.config) if part == "config" else ""
            words.append(_STRUCTURE_CHANGES[part] + extra)
    return "; ".join(words) or "nothing the structure records"


def _config_fields(old: Any, new: Any) -> str:
    """' (field, field)': the settings two config snapshots differ in (AMP pins, overflow
    tracing, backend, ...), or '' when they are not dataclasses."""
    if not (dataclasses.is_dataclass(old) and dataclasses.is_dataclass(new)):
        return ""
    fields = [
        f.name for f in dataclasses.fields(old) if getattr(old, f.name) != getattr(new, f.name)
    ]
    return f" ({', '.join(fields)})" if fields else ""
