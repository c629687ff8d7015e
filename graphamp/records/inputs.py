"""Flatten g(...)'s arguments into tensors + a hashable signature, and rebuild them.

A compiled step is specialised on its input signature: the pytree structure, each tensor's
shape, dtype, device and strides, and the value of every non-tensor leaf (baked into the graph).
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch.utils._pytree
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from ..errors import InputError
from .validate import dtype_name

# Non-tensor leaves must be hashable values that tracing can bake into the graph.
CONSTANT_TYPES = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device)

TensorKey = tuple  # (shape, dtype, device, stride)


def _tensor_key(t: torch.Tensor) -> TensorKey:
    # a sparse tensor has no strides: its layout stands in (refused by name at the build)
    layout = t.stride() if t.layout == torch.strided else (str(t.layout),)
    return (tuple(t.shape), t.dtype, t.device, layout)


@dataclass(frozen=True)
class InputSignature:
    structure: Any  # a hashable description of the pytree structure
    tensors: tuple[TensorKey, ...]
    constants: tuple[Any, ...]

    def describe(self, dynamic: frozenset[tuple[int, int]] = frozenset()) -> str:
        """ "4x128 float32, 4 int64"; a dynamic dimension (tensor, dim) shows as "?"."""
        parts = []
        for i, (shape, dtype, _, _) in enumerate(self.tensors):
            sizes = "x".join("?" if (i, d) in dynamic else str(n) for d, n in enumerate(shape))
            parts.append(f"{sizes or 'scalar'} {dtype_name(dtype)}")
        return ", ".join(parts) or "no tensors"


@dataclass
class FlatInputs:
    tensors: list[torch.Tensor]
    signature: InputSignature
    args: tuple
    kwargs: dict
    devices: list[torch.device] | None = None  # set by as_meta(): where the real tensors were

    def rebuild(self, tensors: list[Any]) -> tuple[tuple, dict]:
        """args and kwargs with the tensor leaves replaced by ``tensors`` (in order)."""
        leaves, spec = pytree.tree_flatten((self.args, self.kwargs))
        it = iter(tensors)
        leaves = [next(it) if isinstance(x, torch.Tensor) else x for x in leaves]
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        return tuple(args), dict(kwargs)

    def as_meta(self) -> FlatInputs:
        """The same structure with meta tensors (shapes only), to rerun build() on fakes later."""
        metas = [
            torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            for t in self.tensors
        ]
        args, kwargs = self.rebuild(metas)
        return FlatInputs(metas, self.signature, args, kwargs, [t.device for t in self.tensors])

    def with_tensors(self, tensors: list[torch.Tensor]) -> FlatInputs:
        """The same call with other tensors in place of its tensor leaves (fakes, for a build)."""
        args, kwargs = self.rebuild(tensors)
        return FlatInputs(tensors, self.signature, args, kwargs)

    def check_micro_batches(self, n: int, graph_name: str) -> None:
        """InputError unless every tensor splits into n equal slices along dim 0."""
        for i, t in enumerate(self.tensors):
            if t.dim() == 0 or t.shape[0] % n:
                raise InputError(
                    f"{graph_name}(...): gradient accumulation over {n} micro-batches splits every "
                    f"tensor argument along dim 0, but tensor argument {i} has shape "
                    f"{tuple(t.shape)}; pass batches whose first dimension is a multiple of {n}"
                )

    def micro_batch(self, n: int) -> FlatInputs:
        """The first of n equal slices along dim 0 of every tensor (gradient accumulation;
        ``check_micro_batches`` first). On fakes with a symbolic batch size the slice's size is
        that symbol // n; asking whether it divides by n makes the ShapeEnv keep that as a guard,
        so a later batch that does not divide is not served by this program."""
        if any(t.shape[0] % n != 0 for t in self.tensors):
            raise ValueError("micro_batch: call check_micro_batches first")
        sliced = [t[: t.shape[0] // n] for t in self.tensors]
        args, kwargs = self.rebuild(sliced)
        return FlatInputs(sliced, self.signature, args, kwargs)

    def names(self, build: Callable) -> list[str]:
        """Readable names for the tensor leaves, from build()'s parameter names."""
        leaves = self.leaf_names(build)
        return [name for name, is_tensor in leaves if is_tensor]

    def leaf_names(self, build: Callable) -> list[tuple[str, bool]]:
        """(readable name, is a tensor) for every leaf of g(...)'s arguments, in order."""
        try:
            params = [
                p
                for p in inspect.signature(build).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
            ]
        except (TypeError, ValueError):
            params = []
        names = []
        leaves, _ = pytree.tree_flatten_with_path((self.args, self.kwargs))
        for path, leaf in leaves:
            keys = [getattr(k, "idx", getattr(k, "key", None)) for k in path]
            if keys and keys[0] == 0 and len(keys) > 1 and isinstance(keys[1], int):
                i = keys[1]
                base = (
                    params[i].name
                    if i < len(params) and params[i].kind != params[i].VAR_POSITIONAL
                    else f"arg{i}"
                )
                rest = keys[2:]
            else:
                base, rest = "kw", keys[1:]
            names.append(("_".join([base, *map(str, rest)]), isinstance(leaf, torch.Tensor)))
        return names


def flatten_inputs(args: tuple, kwargs: dict) -> FlatInputs:
    # Fast path for the common call g(x, y) with tensors only: no pytree walk per step.
    if not kwargs and all(type(a) is torch.Tensor for a in args):
        sig = InputSignature(("flat", len(args)), tuple(_tensor_key(a) for a in args), ())
        return FlatInputs(list(args), sig, args, kwargs)
    leaves, spec = pytree.tree_flatten((args, kwargs))
    tensors: list[torch.Tensor] = []
    keys: list[TensorKey] = []
    constants: list[Any] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
            keys.append(_tensor_key(leaf))
            constants.append(None)
        elif isinstance(leaf, CONSTANT_TYPES):
            constants.append(leaf)
        else:
            raise InputError(
                f"g(...) got an argument of type {type(leaf).__name__}; arguments may be tensors, "
                "Python numbers, strings, None, and tuples/lists/dicts of those. Convert it first "
                "(for example torch.as_tensor(value))"
            )
    sig = InputSignature(("tree", str(spec)), tuple(keys), tuple(constants))
    return FlatInputs(tensors, sig, args, kwargs)


def lift_numbers(
    args: tuple, kwargs: dict, positions: frozenset[int], holder: Callable[[int, float], Any]
) -> tuple[tuple, dict]:
    """g(...)'s arguments with the Python floats at these leaf positions replaced by
    ``holder(position, value)`` (a 0-dim float32 tensor holding the value): step inputs, so a
    new value compiles nothing (``runtime/calls``)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    for i in positions:
        if i < len(leaves) and type(leaves[i]) is float:
            leaves[i] = holder(i, leaves[i])
    args, kwargs = pytree.tree_unflatten(leaves, spec)
    return tuple(args), dict(kwargs)


def lifted_tensor_indices(args: tuple, kwargs: dict, positions: frozenset[int]) -> frozenset[int]:
    """Which tensor inputs (indices among the call's tensors) are lifted float arguments."""
    leaves, _ = pytree.tree_flatten((args, kwargs))
    out, n = set(), 0
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            if i in positions:
                out.add(n)
            n += 1
    return frozenset(out)


def changed_floats(old: InputSignature, new: InputSignature) -> frozenset[int]:
    """The leaf positions of the Python floats whose values differ between two calls with the
    same structure and tensors (none when anything else differs)."""
    if old.structure != new.structure or old.tensors != new.tensors:
        return frozenset()
    pairs = enumerate(zip(old.constants, new.constants))
    return frozenset(i for i, (a, b) in pairs if type(a) is type(b) is float and a != b)


def check_arity(build: Callable, args: tuple, kwargs: dict, graph_name: str) -> None:
    """Raise InputError naming build()'s signature if g(...) cannot bind to it."""
    try:
        inspect.signature(build).bind(*args, **kwargs)
    except TypeError as e:
        raise InputError(
            f"{graph_name}(...) does not match build{inspect.signature(build)}: {e}. Call the "
            "graph with the arguments build() takes"
        ) from None
