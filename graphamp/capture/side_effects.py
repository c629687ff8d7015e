"""Module hooks at capture: traced where known to be pure, refused by name otherwise.

build() runs once, on fake tensors; the compiled step then runs without Python. A hook on a
module would run once at capture (a hook recording activations would keep a FakeTensor) and
never again, unless all it does is compute on the tensors it is given and hand them to the
same forward: then tracing it records exactly what it means. Those hooks are listed here
(``_TRACEABLE_HOOKS``); any other is refused with a CaptureError naming it and where it is
defined, before anything runs. What build() writes on the user's objects (attributes, caches,
hooks a library installs on first use) is ``state_writes.py`` and ``steady_state.py``.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torch.nn.modules import module as module_globals
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.utils.prune import BasePruningMethod
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from ..errors import CaptureError

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


# Hooks known to act only on the tensors they are given, with no Python side effect outside
# the call: tracing them records exactly what they mean. (module, qualified name) of the hook
# function.
_TRACEABLE_HOOKS = frozenset(
    {
        # transformers' enable_input_require_grads (gradient_checkpointing_enable, PEFT/LoRA): sets
        # requires_grad on the embedding output
        (
            "transformers.modeling_utils",
            "PreTrainedModel.enable_input_require_grads.<locals>.make_inputs_require_grads",
        ),
        # transformers 5's output capturing (output_hidden_states, output_attentions,
        # output_router_logits): installed on first use, each hook appends its module's output
        # to the collector of the forward that is running, which returns them
        (
            "transformers.utils.output_capturing",
            "install_output_capuring_hook.<locals>.output_capturing_hook",
        ),
        (
            "transformers.utils.output_capturing",
            "install_output_capturing_hook.<locals>.output_capturing_hook",
        ),
    }
)

# torch's hook objects that compute a parameter from others and set it as a plain attribute of
# the module before each forward: the legacy weight_norm and spectral_norm (audio models:
# HiFi-GAN, EnCodec; spectral_norm also updates its power-iteration buffers in place) and every
# pruning method (the weight times its mask). The attribute is a write the step replays after
# every call (``steady_state.py``), as eager leaves it.
_TRACEABLE_HOOK_CLASSES = (WeightNorm, SpectralNorm, BasePruningMethod)


def refuse_hooks(graph_name: str, modules: list[tuple[str, nn.Module]]) -> None:
    """CaptureError for the first module hook (or global module hook) found that is not known
    to be traceable; changes nothing."""
    for attr, kind in _GLOBAL_HOOKS:
        for hook in getattr(module_globals, attr, {}).values():
            if not _traceable(hook):
                raise _hook_error(graph_name, kind, "every module", hook)
    for path, module in modules:
        _refuse_lazy(graph_name, path, module)
        for attr, kind in _HOOK_KINDS:
            for hook in getattr(module, attr).values():
                if not _traceable(hook):
                    raise _hook_error(graph_name, kind, repr(path) if path else "the root", hook)


def _refuse_lazy(graph_name: str, path: str, module: nn.Module) -> None:
    """A lazy module (``nn.LazyLinear``) whose parameters its first forward has not made yet:
    the step's parameters are fixed when it is built, and the shapes come from that forward."""
    if isinstance(module, LazyModuleMixin) and module.has_uninitialized_params():
        raise CaptureError(
            f"{graph_name}: module {path!r} ({type(module).__name__}) makes its parameters at "
            "its first forward, from the input's shape, and the compiled step's parameters are "
            "fixed when it is built. Run the model once eagerly before the first call, as torch "
            "advises for lazy modules (with torch.no_grad(): model(example_batch)), then make "
            "the optimizer over its parameters"
        )


def registered_hook_error(graph_name: str, attr: str, where: str, hook: Any) -> CaptureError | None:
    """The error for a hook build() itself registers in the module dict ``attr`` (None when it
    is no module hook dict, or the hook is traceable: then the next trace runs it)."""
    kind = dict(_HOOK_KINDS).get(attr)
    if kind is None or not callable(hook) or _traceable(hook):
        return None
    name, defined = _describe_callable(hook)
    return CaptureError(
        f"{graph_name}.build() registers the {kind} {name}{defined} on {where}. graphamp "
        "captures build() once and the compiled step calls no Python hooks, so it would run "
        "once, at capture, on fake values, and never again. Return what it computes from "
        "build() instead (build() may return any structure of tensors). Your objects were put "
        "back as they were"
    )


def _traceable(hook: Any) -> bool:
    target = getattr(hook, "func", hook)  # functools.partial
    if isinstance(target, _TRACEABLE_HOOK_CLASSES):
        return True
    return (
        getattr(target, "__module__", None),
        getattr(target, "__qualname__", None),
    ) in _TRACEABLE_HOOKS


def _hook_error(graph_name: str, kind: str, where: str, hook: Any) -> CaptureError:
    name, defined = _describe_callable(hook)
    return CaptureError(
        f"{graph_name}: module {where} has the {kind} {name}{defined}. graphamp captures build() "
        "once on fake tensors and the compiled step calls no Python hooks, so it would run "
        "once, at capture, on fake values, and never again: remove it (handle.remove()) before "
        "the first call and return what it computes from build() instead (build() may return "
        "any structure of tensors)"
    )


def _describe_callable(fn: Any) -> tuple[str, str]:
    target = getattr(fn, "func", fn)  # functools.partial
    target = getattr(target, "__func__", target)  # bound methods
    name = getattr(target, "__qualname__", type(target).__qualname__)
    code = getattr(target, "__code__", None)
    defined = f" (defined at {code.co_filename}:{code.co_firstlineno})" if code else ""
    return name, defined
