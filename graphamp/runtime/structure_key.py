"""What a compiled step depends on besides its inputs, checked at every call.

A compiled step bakes in the module tree it was captured from (which modules, parameters and
buffers exist and which are in training mode), each optimizer's param groups (which parameters,
``requires_grad``, the options the update bakes in: momentum on/off, a traced optimizer's
options but its lr), the config, the scaler's settings and the fp32 parts a transformers model
declares (``model_pins.py``). ``StructureKey`` turns all of that into one hashable
``records.guards.Structure`` per call; each compiled step assumes the one it was built for
(``Guards.structure``), so any change rebuilds the step, and ``records.guards.structure_words``
names what changed for the log.

Walking every module's children at every call would cost tens of microseconds on a large
model, so the tree's identity fingerprint is recomputed only when torch registered a module,
parameter or buffer anywhere since the last look (torch's global registration hooks,
installed once per process, move an epoch: ``process_state.REGISTRATIONS``) or when a module
lost a child, a parameter or a buffer (the per-call sizes below).
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch.nn.modules.module._global_backward_hooks,
#   torch.nn.modules.module._global_backward_pre_hooks,
#   torch.nn.modules.module._global_forward_hooks, torch.nn.modules.module._global_forward_pre_hooks
import itertools
import logging
from typing import Any, Iterable

import torch.nn as nn
from torch.nn.modules import module as module_hooks

from ..records.guards import Change, Structure
from ..records.inputs import FlatInputs
from ..records.model_pins import declared_patterns, declaring_models
from ..records.spec import Program
from ..torchkit.fxutil import warn_at_user_line
from ..torchkit.process_state import REGISTRATIONS

log = logging.getLogger("graphamp")

_global_hooks = (
    module_hooks._global_forward_hooks,
    module_hooks._global_forward_pre_hooks,
    module_hooks._global_backward_hooks,
    module_hooks._global_backward_pre_hooks,
)


_new_tuple = tuple.__new__


class StructureKey:
    """Computes a Graph's ``Structure`` at every call (see the module docstring)."""

    def __init__(self) -> None:
        REGISTRATIONS.watch()  # torch's global registration hooks, once per process
        self._epoch = -1
        self._roots: tuple = ()
        self._modules: list[nn.Module] = []
        self._fingerprint: tuple = ()
        self._hook_dicts: list[dict] = list(_global_hooks)
        self._declaring: list[nn.Module] = []  # models that declare fp32 parts (model_pins.py)

    def __call__(
        self,
        registered: dict[str, nn.Module],
        optimizers: Iterable[Any],
        config: Any,
        scaler: Any,
        modes: tuple = (),
    ) -> Structure:
        roots = tuple(registered.items())
        if self._epoch != REGISTRATIONS.epoch or roots != self._roots:
            self._refresh(roots)
        sizes_and_modes = tuple(
            (m.training, len(m._modules), len(m._parameters), len(m._buffers))
            for m in self._modules
        )
        # a hook registered after the first call would never run in the compiled step: its
        # arrival captures again, and capture refuses it by name (capture/side_effects.py).
        # Hooks are kept by their handles' ids (unique per registration), not counted: one
        # removed and another added is another set of hooks.
        declared = tuple(declared_patterns(m) for m in self._declaring)
        # tuple.__new__: the NamedTuple without its Python-level constructor (every call)
        return _new_tuple(
            Structure,
            (
                self._fingerprint,  # modules
                (sizes_and_modes, declared),  # module_modes
                tuple(slot.structure() for slot in optimizers),  # optimizers
                config,  # config
                (id(scaler), scaler.settings()) if scaler is not None else None,  # grad_scaler
                modes,  # torch_modes
                tuple(itertools.chain.from_iterable(self._hook_dicts)),  # hooks
            ),
        )

    def _refresh(self, roots: tuple) -> None:
        self._epoch, self._roots = REGISTRATIONS.epoch, roots
        self._modules = [m for _, top in roots for m in top.modules()]
        # the hook dicts are created with each module and changed in place: kept once here
        self._hook_dicts = [
            *_global_hooks,
            *(
                d
                for m in self._modules
                for d in (
                    m._forward_hooks,
                    m._forward_pre_hooks,
                    m._backward_hooks,
                    m._backward_pre_hooks,
                )
            ),
        ]
        self._declaring = [m for _, top in roots for _, m in declaring_models(top)]
        self._fingerprint = tuple(
            (
                name,
                id(top),
                tuple(
                    (
                        path,
                        id(m),
                        tuple(map(id, m._parameters.values())),
                        tuple(map(id, m._buffers.values())),
                    )
                    for path, m in top.named_modules()
                ),
            )
            for name, top in roots
        )


def log_pinned(graph_name: str, program: Program, names: list[str]) -> None:
    """One INFO line where a build traced dimensions as symbols and the trace pinned them to
    their sizes (``ShapeGuard.pinned``): the step serves those sizes only."""
    pinned = sorted(program.guards.shapes.pinned) if program.guards is not None else []
    if not pinned:
        return
    log.info(
        "%s: the trace pinned %s to the traced size (a size read as a number: int() of a "
        "size, a branch on a size's equality, or torch 2.11's fake tensors): this step serves "
        "that size only, and each new size builds a step for its sizes",
        graph_name,
        _dimension_words(pinned, names),
    )


def _dimension_words(dims: list[tuple[int, int]], names: list[str]) -> str:
    """``'x' dimension 1, 'y' dimension 1``: batch dimensions by their input's name."""
    return ", ".join(f"{names[i] if i < len(names) else i!r} dimension {d}" for i, d in dims)


def log_rebuild(
    graph_name: str,
    change: Change | None,
    dynamic: frozenset[tuple[int, int]],
    before: frozenset[tuple[int, int]],
    names: list[str],
) -> None:
    """One INFO line: why a call found no compiled step (after the first), and which batch
    dimensions become dynamic from this build on."""
    new = sorted(dynamic - before)
    if new:
        dims = _dimension_words(new, names)
        # found by a second size, the step for the first was built for nothing: say how a run
        # builds once (round 9 of variable_shapes_cpu.md: 36 s marked against 58 s found)
        hint = (
            ""
            if change is None
            else "; marking it before the first call "
            "(torch._dynamo.mark_dynamic(tensor, dim)) builds only this step"
        )
        log.info(
            "%s: %s: capturing and compiling a step where %s %s dynamic (symbolic); later "
            "sizes reuse it%s",
            graph_name,
            change or "marked with torch._dynamo.mark_dynamic",
            dims,
            "is" if len(new) == 1 else "are",
            hint,
        )
    elif change is not None:
        log.info("%s: %s: capturing and compiling again", graph_name, change)


RECOMPILES_BEFORE_WARNING = 4


def numbers_baked_in(
    programs: Iterable[Program], inputs: FlatInputs, build: Any
) -> tuple[int, list[str]] | None:
    """A Python number among g(...)'s arguments is baked into the compiled step: one that
    changes every call compiles every call. (how many values, the arguments' names) once the
    same tensors came with ``RECOMPILES_BEFORE_WARNING`` different numbers, else None."""
    sig = inputs.signature
    signatures = [p.guards.signature for p in programs if p.guards is not None]
    same_tensors = [
        s
        for s in signatures
        if s.structure == sig.structure
        and s.tensors == sig.tensors
        and s.constants != sig.constants
    ]
    if len(same_tensors) + 1 < RECOMPILES_BEFORE_WARNING:
        return None
    names = inputs.leaf_names(build)
    changing = {
        names[i][0]
        for s in same_tensors
        for i, (a, b) in enumerate(zip(s.constants, sig.constants))
        if a != b
    }
    return len(same_tensors) + 1, sorted(changing)


def warn_about_numbers(graph_name: str, values: int, names: list[str]) -> None:
    warn_at_user_line(
        f"{graph_name}: the Python number argument(s) {', '.join(names)} of g(...) took "
        f"{values} different values, each compiling a new step (numbers are baked into the "
        "graph). Pass them as tensors (torch.tensor(value)) so one compiled step serves every "
        "value"
    )
