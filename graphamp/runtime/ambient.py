"""The torch-wide modes around a call, and what graphamp does with each.

A compiled step must not depend on where the user happened to call it from. Three kinds of mode:

- Modes graphamp switches off for the length of a call, because graphamp already does their
  job inside the step: an ambient ``torch.autocast`` (graphamp's own AMP decides precision; an
  autocast left enabled would re-cast the compiled program's ops at run time, or be baked into
  the capture), ``torch.inference_mode`` (state tensors created under it could never be updated
  in place again) and anomaly detection (capture would trip on it; the compiled step runs no
  autograd: its overflow check is the grad scaler's). ``neutral_modes`` says which are on.
- Modes that change what build() means, kept in the cache key so a change captures again:
  the default dtype (factories in build() follow it, as in eager) and deterministic algorithms
  (a backend may choose kernels by it when it compiles). ``mode_key``.
- Grad modes (``no_grad``, ``enable_grad``, ``set_grad_enabled``): capture always records
  gradients and the step always runs under ``no_grad``, so they change nothing.

The checks run at every call, so each is one cheap C call and nothing is entered in the
common case where no such mode is on.
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._C, torch._C._get_deterministic_algorithms, torch._C._is_any_autocast_enabled
import contextlib
from typing import ContextManager

import torch

_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None)
_inference_mode_on = torch.is_inference_mode_enabled
_default_dtype = torch.get_default_dtype
_deterministic = getattr(
    torch._C, "_get_deterministic_algorithms", torch.are_deterministic_algorithms_enabled
)
_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "mtia")


def _autocast_on() -> bool:
    return torch.is_autocast_enabled() or torch.is_autocast_cpu_enabled()


if _any_autocast is not None:  # one C call where torch has it
    _autocast_on = _any_autocast


def neutral_modes() -> ContextManager | None:
    """A context that switches off the ambient autocast and inference mode for one call, or
    None when neither is on (the common case)."""
    autocast, inference = _autocast_on(), _inference_mode_on()
    if not (autocast or inference):
        return None
    stack = contextlib.ExitStack()
    if inference:
        stack.enter_context(torch.inference_mode(False))
    if autocast:
        for device in _autocast_devices_on():
            stack.enter_context(torch.autocast(device, enabled=False))
    return stack


def _autocast_devices_on() -> list[str]:
    on = []
    for device in _AUTOCAST_DEVICES:
        try:
            if torch.is_autocast_enabled(device):
                on.append(device)
        except (RuntimeError, TypeError):  # a device type this torch build does not know
            continue
    return on


def capture_modes() -> ContextManager:
    """For capture and compile only: anomaly detection off (it makes traced backward passes
    guard on data; the compiled step runs no autograd for it to watch)."""
    if torch.is_anomaly_enabled():
        return torch.autograd.set_detect_anomaly(False)
    return contextlib.nullcontext()


def mode_key() -> tuple:
    """The modes that change the captured program: part of the cache key."""
    return _default_dtype(), _deterministic()
