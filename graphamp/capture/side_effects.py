"""Python side effects of build(), found at capture and refused by name.

build() runs once, on fake tensors; the compiled step then runs without Python. So a hook
registered on a module would run once at capture (a hook recording activations would keep a
FakeTensor) and never again, and an attribute build() writes (a cache built lazily on the first
forward, a call counter) would be written once, with fake values. Both are refused with a
CaptureError naming the hook or the attribute, and the user's objects are left exactly as they
were: hooks are checked before anything runs, attributes are put back before the error is raised.

torch's own modules refresh private caches in forward (``nn.LSTM``'s ``_flat_weights``): those
are put back silently, since the next eager forward rebuilds them from the real parameters.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch.nn as nn
from torch.nn.modules import module as module_globals

from ..errors import CaptureError
from ..records.fxutil import UserFrame, current_user_frame
from .patching import SharedPatch

_HOOK_KINDS = (
    ("_forward_pre_hooks", "forward pre-hook"),
    ("_forward_hooks", "forward hook"),
    ("_backward_pre_hooks", "backward pre-hook"),
    ("_backward_hooks", "backward hook"),
)
_GLOBAL_HOOKS = (
    ("_global_forward_pre_hooks", "global forward pre-hook"),
    ("_global_forward_hooks", "global forward hook"),
    ("_global_backward_pre_hooks", "global backward pre-hook"),
    ("_global_backward_hooks", "global backward hook"),
)


# Hooks known to act only on the tensors they are given, with no Python side effect: tracing
# them records exactly what they mean. (module, qualified name) of the hook function.
_TRACEABLE_HOOKS = frozenset(
    {
        # transformers' enable_input_require_grads (gradient_checkpointing_enable, PEFT/LoRA): sets
        # requires_grad on the embedding output
        (
            "transformers.modeling_utils",
            "PreTrainedModel.enable_input_require_grads.<locals>.make_inputs_require_grads",
        ),
    }
)


def refuse_hooks(graph_name: str, modules: list[tuple[str, nn.Module]]) -> None:
    """CaptureError for the first module hook (or global module hook) found that is not known
    to be traceable; changes nothing."""
    for attr, kind in _GLOBAL_HOOKS:
        for hook in getattr(module_globals, attr, {}).values():
            if not _traceable(hook):
                raise _hook_error(graph_name, kind, "every module", hook)
    for path, module in modules:
        for attr, kind in _HOOK_KINDS:
            for hook in getattr(module, attr).values():
                if not _traceable(hook):
                    raise _hook_error(graph_name, kind, repr(path) if path else "the root", hook)


def _traceable(hook: Any) -> bool:
    target = getattr(hook, "func", hook)  # functools.partial
    return (
        getattr(target, "__module__", None),
        getattr(target, "__qualname__", None),
    ) in _TRACEABLE_HOOKS


def _hook_error(graph_name: str, kind: str, where: str, hook: Any) -> CaptureError:
    name, defined = _describe_callable(hook)
    legacy = type(hook).__name__ in ("WeightNorm", "SpectralNorm")
    fix = (
        "use torch.nn.utils.parametrizations."
        + ("weight_norm" if "Weight" in type(hook).__name__ else "spectral_norm")
        + ", which graphamp captures"
        if legacy
        else "remove it (handle.remove()) before the first call and return what it computes from "
        "build() instead (build() may return any structure of tensors)"
    )
    return CaptureError(
        f"{graph_name}: module {where} has the {kind} {name}{defined}. graphamp captures build() "
        "once on fake tensors and the compiled step calls no Python hooks, so it would run "
        f"once, at capture, on fake values, and never again: {fix}"
    )


def _describe_callable(fn: Any) -> tuple[str, str]:
    target = getattr(fn, "func", fn)  # functools.partial
    target = getattr(target, "__func__", target)  # bound methods
    name = getattr(target, "__qualname__", type(target).__qualname__)
    code = getattr(target, "__code__", None)
    defined = f" (defined at {code.co_filename}:{code.co_firstlineno})" if code else ""
    return name, defined


# -- attributes written during capture ---------------------------------------------------------

_local = threading.local()  # .lines: {(id(obj), name): UserFrame} for the capture in this thread


def _recording_setattr(self: nn.Module, name: str, value: Any) -> None:
    lines = getattr(_local, "lines", None)
    if lines is not None and (id(self), name) not in lines:
        lines[(id(self), name)] = current_user_frame()
    _PATCH.original(self, name, value)


_PATCH = SharedPatch(nn.Module, "__setattr__", _recording_setattr)


@contextlib.contextmanager
def _recording_lines() -> Iterator[dict]:
    """Where each module attribute is first written during the block (this thread's writes)."""
    with _PATCH.applied():
        _local.lines = {}
        try:
            yield _local.lines
        finally:
            _local.lines = None


@contextlib.contextmanager
def refusing_attribute_writes(graph_name: str, watched: list[tuple[str, Any]]) -> Iterator[None]:
    """Inside the block build() runs; after it every watched object's attributes are exactly
    as before, and a write build() made to one of the user's objects is a CaptureError.

    ``watched``: (the name the user knows it by, the object)."""
    saved = [(label, obj, dict(vars(obj))) for label, obj in watched]
    with _recording_lines() as lines:
        try:
            yield
        finally:
            writes = [
                (label, obj, name) for label, obj, before in saved for name in _restore(obj, before)
            ]
    for label, obj, name in writes:
        if not _is_torch_internal(obj):
            raise _write_error(graph_name, label, name, lines.get((id(obj), name)))


def _restore(obj: Any, before: dict) -> list[str]:
    """Put ``obj``'s attributes back as in ``before``; the names that had changed."""
    now = vars(obj)
    changed = [
        k
        for k in now.keys() | before.keys()
        if k not in now or k not in before or now[k] is not before[k]
    ]
    if changed:
        now.clear()
        now.update(before)
    return sorted(changed)


def _is_torch_internal(obj: Any) -> bool:
    return isinstance(obj, nn.Module) and type(obj).__module__.startswith("torch.")


def _write_error(graph_name: str, label: str, name: str, frame: UserFrame | None) -> CaptureError:
    where = f" at {frame}" if frame else ""
    return CaptureError(
        f"{graph_name}.build() sets the attribute {label}.{name}{where}. build() is captured once "
        "on fake tensors and the compiled step runs no Python, so the attribute would be written "
        "once, with a fake value, and never updated again (it was put back as it was). Compute "
        "it outside build() (in __init__, or from the values g(...) returns), make a tensor that "
        "the step should update a buffer (register_buffer), or return it from build()"
    )
