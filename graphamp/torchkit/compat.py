"""Every place graphamp's code depends on the torch release, in one module.

Each branch names the torch versions that need it. graphamp supports the range in
``pyproject.toml`` (tested by ``.ci/run``'s version matrix); when the oldest supported release
moves past a branch's version, delete the branch.

Elsewhere in graphamp a module that reads torch's private names (``torch._foreach_mul``,
``torch.utils._pytree``...) lists them in a comment near its top with the releases they were
checked on, ``CHECKED_TORCH`` (tests/test_architecture.py keeps both true).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch._subclasses.functional_tensor import dispatch_functionalize as _torch_functionalize

try:  # torch >= 2.13
    from torch.fx.experimental.symbolic_shapes import guarding_hint_or_throw, has_guarding_hint
except ImportError:  # torch < 2.13: 2.11, the oldest pyproject.toml claims (a .ci/run leg)
    from torch.fx.experimental.symbolic_shapes import (  # type: ignore[attr-defined,no-redef]
        has_hint as has_guarding_hint,
    )
    from torch.fx.experimental.symbolic_shapes import (  # type: ignore[attr-defined,no-redef]
        hint_int as guarding_hint_or_throw,
    )

__all__ = [
    "CHECKED_TORCH",
    "FullyShardGroup",
    "FullyShardState",
    "TORCH_VERSION",
    "dispatch_functionalize",
    "fully_shard_state",
    "guarding_hint_or_throw",
    "has_guarding_hint",
    "preserve_backward_stack_traces",
    "remove_fully_shard",
]

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])

# The torch releases .ci/run tests graphamp on: the main leg's (the whole suite) and the
# compatibility legs' (the ends of pyproject.toml's range: .ci/compat_tests, a subset, and the
# demo). The comments declaring the torch private names a module reads name these.
CHECKED_TORCH = ("2.11.0", "2.14.1", "2.15.0")

_HAS_PROPAGATE = "propagate_input_mutations" in inspect.signature(_torch_functionalize).parameters


def dispatch_functionalize(
    fn: Callable[..., Any], mode: FunctionalTensorMode, *, propagate_input_mutations: bool
) -> Callable[..., Any]:
    """torch's Python functionalization of ``fn``, writing in-place updates of its inputs back
    into them (as trailing ``copy_`` nodes in a trace) when ``propagate_input_mutations``."""
    if _HAS_PROPAGATE or not propagate_input_mutations:  # torch >= 2.14: built in
        kwargs = {"propagate_input_mutations": True} if propagate_input_mutations else {}
        return _torch_functionalize(fn, mode, **kwargs)
    return _propagating_functionalize(fn, mode)


def _propagating_functionalize(
    fn: Callable[..., Any], mode: FunctionalTensorMode
) -> Callable[..., Any]:
    """torch 2.13: ``dispatch_functionalize`` drops mutations of the inputs. Same wrapping as
    torch's, then each input's final functional value is copied back with torch's own helper."""
    from torch._C._functorch import _propagate_functional_input_mutation

    def inner(*args: Any) -> Any:
        exclude = torch._C._ExcludeDispatchKeyGuard(  # as torch's own wrapper
            torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize)
        )
        with exclude:
            with mode:
                wrapped = [
                    FunctionalTensor.to_functional(a) if isinstance(a, torch.Tensor) else a
                    for a in args
                ]
                outputs = fn(*wrapped)
                outputs = pytree.tree_map_only(FunctionalTensor, _unwrap, outputs)
            for arg, func_arg in zip(args, wrapped):
                if isinstance(func_arg, FunctionalTensor):
                    _propagate_functional_input_mutation(arg, func_arg.elem)
        return outputs

    return inner


def _unwrap(t: FunctionalTensor) -> torch.Tensor:
    torch._sync(t)
    return torch._from_functional_tensor(t.elem)


def preserve_backward_stack_traces(losses: list[torch.Tensor]) -> None:
    """Backward nodes traced from ``losses`` get their forward op's stack trace and seq_nr
    (torch's private AOTAutograd helper; its ``_from_tensors`` form is new in torch 2.13)."""
    from torch._functorch._aot_autograd import logging_utils

    roots = [t.grad_fn for t in losses if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    if roots:
        logging_utils.setup_stacktrace_preservation_hooks(roots)


def backed_sizes(shape_env: Any) -> dict:
    """A ShapeEnv's symbol -> value map of the sizes it was given (the hints): torch 2.14
    renamed ``var_to_val`` to ``backed_var_to_val`` (the old name warns there)."""
    values = getattr(shape_env, "backed_var_to_val", None)
    return values if values is not None else shape_env.var_to_val


def process_group_store(group: Any) -> Any:
    """The key-value store a process group was made with (``init_process_group``'s, prefixed
    for a subgroup): torch keeps it only in its private group map (torch 2.13-2.15)."""
    import torch.distributed.distributed_c10d as c10d

    getter = getattr(c10d, "_get_process_group_store", None)
    if getter is not None:
        return getter(group)
    return c10d._get_default_store()


# -- FSDP2's private state (sharding/fsdp_adopt.py takes a fully_shard wrap over) -----------------
# Read and changed on torch 2.14.1 by tests/test_zero.py's fully_shard cases; on 2.11.0 and
# 2.15.0 CI's compatibility legs only import this module. FSDP2 keeps these facts nowhere public.


@dataclass(frozen=True)
class FullyShardGroup:
    """One FSDP2 parameter group of a wrapped module, as graphamp needs it."""

    mesh: Any  # its DeviceMesh
    cpu_offload: bool  # offload_policy=CPUOffloadPolicy()
    keeps_gathered: bool  # its gathered parameters stay from the forward to the backward


@dataclass(frozen=True)
class FullyShardState:
    """What FSDP2's state holds of one ``fully_shard``-wrapped module."""

    param_dtype: torch.dtype | None  # MixedPrecisionPolicy's
    reduce_dtype: torch.dtype | None
    output_dtype: torch.dtype | None
    groups: tuple[FullyShardGroup, ...]


def fully_shard_state(module: Any, is_root: bool) -> FullyShardState:
    """FSDP2's state of ``module`` (a ``fully_shard`` wrap), its parameters resharded first
    (so they are the sharded DTensors)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    state = module._get_fsdp_state()
    module.reshard()
    policy = state._mp_policy
    groups = tuple(
        FullyShardGroup(
            group.mesh_info.mesh,
            isinstance(group.offload_policy, CPUOffloadPolicy),
            # reshard_after_forward=False, or the root left at FSDP2's default
            group.post_forward_mesh_info is None or (is_root and state._auto_reshard_after_forward),
        )
        for group in state._fsdp_param_groups
    )
    return FullyShardState(policy.param_dtype, policy.reduce_dtype, policy.output_dtype, groups)


def remove_fully_shard(module: Any, fsdp_module_class: type) -> None:
    """``module`` as it was before ``fully_shard``: FSDP2's forward hooks removed, its class
    put back (``fully_shard`` made ``FSDP<Cls>(FSDPModule, Cls)``), its state dropped."""
    from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY
    from torch.distributed._composable_state import _module_state_mapping

    state = module._get_fsdp_state()
    state._pre_forward_hook_handle.remove()
    state._post_forward_hook_handle.remove()
    module.__class__ = next(c for c in type(module).__bases__ if c is not fsdp_module_class)
    states = module.__dict__.get(STATE_KEY, {})
    for key in [k for k, v in states.items() if v is state]:
        del states[key]
    module.__dict__.get(REGISTRY_KEY, {}).pop("fully_shard", None)
    # torch's module -> state map (weak to the state): left behind, torch's state-dict tools
    # would find the module, then its dead state, and fail
    _module_state_mapping.pop(module, None)
