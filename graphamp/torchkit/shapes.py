"""The batch as one build sees it: fake tensors of one ShapeEnv, some dimensions symbolic.

Every stage of a build (capture, assembly, the backend's own trace) runs on fake tensors of one
``FakeTensorMode`` and its ``ShapeEnv``, so that a dimension made symbolic for the batch is the
same symbol everywhere, and whatever the stages assume of it (a relation between two sizes, a
range, a stride written in terms of sizes) ends up as one list of guards, which
``shape_guard`` turns into the expression a later batch is checked with.

Each batch tensor is faked on its own, from its sizes and strides alone: no fake shares memory
with another input or with the state, so a program never assumes that two arguments are the same
tensor, or that an argument is a view of a parameter (see ``guards``).

Sizes 0 and 1 are never symbolic (the ShapeEnv specialises them, as torch.compile does: broadcasting
and empty tensors behave differently there), and no two dimensions share a symbol just because
their sizes were equal when traced (``duck_shape=False``): only what the code requires is assumed.
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._dynamo, torch._subclasses
from typing import Any, Iterable, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import (
    SYMPY_INTERP,
    DimDynamic,
    ShapeEnv,
    StatelessSymbolicContext,
)

from ..records.guards import ShapeGuard
from .compat import guarding_hint_or_throw

Dims = frozenset[tuple[int, int]]  # (tensor index among g(...)'s tensors, dimension)


def new_fake_mode() -> FakeTensorMode:
    """The fake mode of one build. Real tensors may appear beside fakes: capture reads plain
    tensors a module holds (lifted as constants) and parameters are faked as they are met."""
    return FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv(duck_shape=False))


def fake_batch(
    mode: FakeTensorMode, tensors: Iterable[torch.Tensor], dynamic: Dims
) -> list[torch.Tensor]:
    """A fake of each batch tensor: same dtype, device, sizes and strides (symbolic where
    ``dynamic`` says), sharing memory with nothing."""
    out: list[torch.Tensor] = []
    for i, t in enumerate(tensors):
        stand_in = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        context: StatelessSymbolicContext = StatelessSymbolicContext(
            dynamic_sizes=[
                DimDynamic.DYNAMIC if (i, d) in dynamic else DimDynamic.STATIC
                for d in range(t.dim())
            ]
        )
        fake = mode.from_tensor(stand_in, symbolic_context=context)
        fake.fake_device = t.device  # the stand-in lives on meta; the batch on t.device
        if t.requires_grad:
            fake.requires_grad_(True)
        out.append(fake)
    return out


def scratch_batch(batch: list[torch.Tensor]) -> list[torch.Tensor]:
    """``batch`` (fakes of one build) faked again in a fake mode of its own, each symbolic size
    a fresh symbol with the same value: for a trace whose assumptions about the sizes must not
    become the build's guards (capture's trace of the state before build()'s first call)."""
    mode = new_fake_mode()
    out: list[torch.Tensor] = []
    for t in batch:
        shape = [guarding_hint_or_throw(s) for s in t.shape]
        stride = [guarding_hint_or_throw(s) for s in t.stride()]
        stand_in = torch.empty_strided(shape, stride, dtype=t.dtype, device="meta")
        sizes = [
            DimDynamic.DYNAMIC if isinstance(s, torch.SymInt) else DimDynamic.STATIC
            for s in t.shape
        ]
        context: StatelessSymbolicContext = StatelessSymbolicContext(dynamic_sizes=sizes)
        fake = mode.from_tensor(stand_in, symbolic_context=context)
        fake.fake_device = t.device
        if t.requires_grad:
            fake.requires_grad_(True)
        out.append(fake)
    return out


def is_symbolic(fake: torch.Tensor) -> bool:
    return any(isinstance(s, torch.SymInt) for s in (*fake.shape, *fake.stride()))


def shape_guard(mode: FakeTensorMode, batch: list[torch.Tensor], dynamic: Dims) -> ShapeGuard:
    """What a dynamic program requires of a later batch: the ShapeEnv's guards (everything the
    build assumed of the symbols) and every static size and stride, over ``L['t<i>']``. The
    storage offset is left out: the compiled step reads each input wherever it starts."""
    if not dynamic or not any(is_symbolic(t) for t in batch):
        return ShapeGuard()
    env = mode.shape_env
    if env is None:  # a mode without a ShapeEnv makes no symbols
        return ShapeGuard()
    # torch._dynamo is imported on first use (it is slow to import), as runtime.compile does
    from torch._dynamo.source import LocalSource

    sources = [LocalSource(f"t{i}") for i in range(len(batch))]
    guards = env.produce_guards(batch, sources, ignore_static=False)
    kept = [g for g in guards if "storage_offset()" not in g]
    expression = " and ".join(f"({g})" for g in kept) or "True"
    return ShapeGuard(
        dynamic=frozenset(dynamic),
        pinned=frozenset(
            (i, d) for i, d in dynamic if env.simplify(_expr(batch[i].shape[d])).is_number
        ),
        expression=expression,
        code=compile(expression, "<graphamp shape guard>", "eval"),
        globals=dict(SYMPY_INTERP),
    )


def _expr(size: Any) -> Any:
    """A size as a sympy expression (a traced symbol's, or the number)."""
    import sympy

    return size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(size)


def memory_order(strides: Sequence[int]) -> list[int]:
    """The dimensions of a tensor of these strides from the outermost in memory to the
    innermost."""
    return sorted(range(len(strides)), key=lambda d: -strides[d])


def inverse_permutation(order: Sequence[int]) -> list[int]:
    """The permutation that undoes ``permute(order)``."""
    return sorted(range(len(order)), key=order.__getitem__)


def size_hint(n: Any) -> int:
    """``n`` as a plain int: a symbolic size's value as traced (its hint), 0 where it has none
    (an unbacked size). For estimates only: it reads the value without guarding on it."""
    if isinstance(n, int):
        return n
    hint = getattr(getattr(n, "node", None), "hint", None)
    return int(hint) if hint is not None else 0
