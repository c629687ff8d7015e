"""What a compiled step depends on besides its inputs, checked at every call.

A compiled step bakes in the module tree it was captured from (which modules, parameters and
buffers exist and which are in training mode), each optimizer's param groups (which parameters,
``requires_grad``, structural options such as momentum on/off), the config, the scaler's
settings and the fp32 parts a transformers model declares (``model_pins.py``). ``StructureKey``
turns all of that into one hashable ``Structure`` per call; the Graph's cache of compiled steps
is keyed on it and the input signature (``ProgramKey``), so any change rebuilds the step, and
``describe_change`` names what changed for the log.

Walking every module's children at every call would cost tens of microseconds on a large
model, so the tree's identity fingerprint is recomputed only when torch registered a module,
parameter or buffer anywhere since the last look (global registration hooks bump an epoch) or
when a module lost a child, a parameter or a buffer (the per-call sizes below).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Any, Iterable, NamedTuple

import torch.nn as nn
from torch.nn.modules import module as module_hooks

from ..records.fxutil import warn_at_user_line
from ..records.inputs import FlatInputs, InputSignature
from ..records.model_pins import declared_patterns, declaring_models

log = logging.getLogger("graphamp")

_epoch = itertools.count()
_current = [next(_epoch)]


def _bump(*_hook_args: Any) -> None:
    _current[0] = next(_epoch)


# Any assignment of a module, parameter or buffer anywhere (model.fc = nn.Linear(...),
# seq.append(...), model.weight = nn.Parameter(...)) moves the epoch; graphamp's own capture
# writes the dicts directly and moves nothing.
module_hooks.register_module_module_registration_hook(_bump)
module_hooks.register_module_parameter_registration_hook(_bump)
module_hooks.register_module_buffer_registration_hook(_bump)

_global_hooks = (
    module_hooks._global_forward_hooks,
    module_hooks._global_forward_pre_hooks,
    module_hooks._global_backward_hooks,
    module_hooks._global_backward_pre_hooks,
)


class Structure(NamedTuple):
    """What a compiled step depends on besides its inputs, part by part."""

    modules: tuple  # names, identities, parameters and buffers of the registered module tree
    module_modes: tuple  # training flags and child/parameter/buffer counts; declared fp32 parts
    optimizers: tuple  # each optimizer slot's structure()
    config: Any  # the ConfigSnapshot
    grad_scaler: tuple | None  # (identity, settings) of the scaler in use
    torch_modes: tuple  # ambient.mode_key(): default dtype, deterministic algorithms
    hooks: int  # module hooks registered anywhere (each is refused or traced at capture)


class ProgramKey(NamedTuple):
    """The key of a Graph's cache of compiled steps."""

    signature: InputSignature
    structure: Structure


_new_tuple = tuple.__new__


class StructureKey:
    """Computes a Graph's ``Structure`` at every call (see the module docstring)."""

    def __init__(self) -> None:
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
        if self._epoch != _current[0] or roots != self._roots:
            self._refresh(roots)
        sizes_and_modes = tuple(
            (m.training, len(m._modules), len(m._parameters), len(m._buffers))
            for m in self._modules
        )
        # a hook registered after the first call would never run in the compiled step: its
        # arrival captures again, and capture refuses it by name (capture/side_effects.py).
        # Programs exist only for models whose hooks are all traceable (side_effects.py), so
        # the number of hooks is all the key needs.
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
                sum(map(len, self._hook_dicts)),  # hooks
            ),
        )

    def _refresh(self, roots: tuple) -> None:
        self._epoch, self._roots = _current[0], roots
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


_CHANGES = {
    "modules": "the registered modules changed (a layer, parameter or buffer was added, removed "
    "or replaced)",
    "module_modes": "a module switched between train() and eval(), lost a child, or changed the "
    "parts it declares fp32 (_keep_in_fp32_modules)",
    "optimizers": "an optimizer's param groups changed (parameters, requires_grad or options "
    "such as momentum)",
    "config": "the graph's config changed",
    "grad_scaler": "the grad scaler's settings changed",
    "torch_modes": "the default dtype or torch.use_deterministic_algorithms changed",
    "hooks": "a forward or backward hook was registered or removed",
}


def describe_change(old: Structure, new: Structure) -> str:
    """Which parts of two structures differ, in words."""
    words = []
    for part in Structure._fields:
        if getattr(old, part) != getattr(new, part):
            extra = _config_fields(old.config, new.config) if part == "config" else ""
            words.append(_CHANGES[part] + extra)
    return "; ".join(words) or "nothing the key records"


def log_why_rebuilt(graph_name: str, last: ProgramKey | None, key: ProgramKey) -> None:
    """One INFO line: why a call found no compiled step (after the first)."""
    if last is None:
        return
    if key.structure == last.structure:
        log.info(
            "%s: new input signature (%s): capturing and compiling again",
            graph_name,
            key.signature.describe(),
        )
    else:
        log.info(
            "%s: %s: capturing and compiling again",
            graph_name,
            describe_change(last.structure, key.structure),
        )


RECOMPILES_BEFORE_WARNING = 4


def numbers_baked_in(
    keys: Iterable[ProgramKey], inputs: FlatInputs, build: Any
) -> tuple[int, list[str]] | None:
    """A Python number among g(...)'s arguments is baked into the compiled step: one that
    changes every call compiles every call. (how many values, the arguments' names) once the
    same tensors came with ``RECOMPILES_BEFORE_WARNING`` different numbers, else None."""
    sig = inputs.signature
    same_tensors = [
        k.signature
        for k in keys
        if k.signature.structure == sig.structure
        and k.signature.tensors == sig.tensors
        and k.signature.constants != sig.constants
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


def _config_fields(old: Any, new: Any) -> str:
    """' (field, field)': the settings two config snapshots differ in (AMP pins, overflow
    tracing, backend, ...), or '' when they are not dataclasses."""
    if not (dataclasses.is_dataclass(old) and dataclasses.is_dataclass(new)):
        return ""
    fields = [
        f.name for f in dataclasses.fields(old) if getattr(old, f.name) != getattr(new, f.name)
    ]
    return f" ({', '.join(fields)})" if fields else ""
