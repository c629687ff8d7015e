"""A model the user wrapped with FSDP2's ``fully_shard`` trains as graphamp's ZeRO-3.

Between steps FSDP2 and graphamp's ZeRO-3 hold the same thing: every parameter a ``DTensor``
placed ``Shard(0)`` on a 1-D mesh, cut as ``torch.chunk`` cuts (sharding/cuts.py). They differ
in where the collectives run: FSDP2 all-gathers and reduce-scatters in module hooks, outside any
graph (capture cannot trace them), graphamp inside the compiled step. So when such a model is
registered, graphamp takes the wrap over:

- the wrap's mesh becomes the step's process group, and ZeRO-3 is on;
- each wrapped module (each block, then the root, as FSDP2's docs wrap) is one gather bucket;
- ``MixedPrecisionPolicy.param_dtype`` must be AMP's dtype (checked at the first call, when the
  settings are final: ``check_policy``): graphamp gathers a parameter read only through its
  cast in that dtype, as FSDP2 does, but decides each op's precision from its lists;
- at the first build, once every check passed (``adopt_at_first_build``), FSDP2's hooks and
  module classes are removed, so the model is a plain module whose parameters are still
  FSDP2's DTensor shards; the build then copies each rank's local shard into graphamp's row
  (``sharding/sharded_params.py``; no collective: the layouts are the same) and points the
  optimizers at the new parameters. Until then the model is the user's wrap, as it was: a
  refusal (at registration or at the first call) leaves a model FSDP2 itself still trains.

Refused by name: a 2-D (HSDP) mesh, CPU offload, ``output_dtype``, a ``reduce_dtype`` other
than float32 (graphamp reduces the float32 gradients as they are), and ``enable_zero`` beside
the wrap. ``reshard_after_forward=False`` (and FSDP2's default for the root) keeps that
block's gathered parameters from its forward to its backward, as FSDP2 does. FSDP2's own
methods (``unshard``, ``set_requires_gradient_sync``) are gone from the model afterwards: the
step does what they did.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch
import torch.nn as nn

from ..errors import ConfigError, GraphDefinitionError
from ..records.fully_shard import FullyShardWrap
from ..records.settings import ConfigSnapshot
from ..torchkit.compat import fully_shard_state, remove_fully_shard
from .rows import is_shard

log = logging.getLogger("graphamp")


def _fsdp_module_class() -> Any:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return None
    return FSDPModule


def is_fully_shard_class(cls: type) -> bool:
    """Is ``cls`` FSDP2's (``FSDPModule``, or the class ``fully_shard`` made for a module)?"""
    fsdp_module = _fsdp_module_class()
    return fsdp_module is not None and issubclass(cls, fsdp_module)


def fully_shard_wrap(graph_name: str, name: str, module: nn.Module) -> FullyShardWrap | None:
    """What the ``fully_shard`` wraps inside ``module`` (registered as ``name``) ask for, after
    refusing what graphamp cannot do the same way; None when nothing in it is wrapped. Changes
    nothing but resharding a module left unsharded (FSDP2's state between steps):
    ``adopt_at_first_build`` removes the wrap, once every check passed."""
    wrapped = _wrapped_modules(module)
    if not wrapped:
        return None
    where = f"{graph_name}.{name}"
    facts = [_wrap_facts(where, path, m) for path, m in wrapped]
    groups = {_ranks(group): group for group, _, _ in facts if group is not None}
    if len(groups) > 1:
        raise GraphDefinitionError(
            f"{where}: its fully_shard wraps use different meshes ({sorted(groups)}); graphamp "
            "shards every parameter over one process group"
        )
    dtypes = {dtype for _, dtype, _ in facts}
    if len(dtypes) > 1:
        raise GraphDefinitionError(
            f"{where}: its fully_shard wraps ask for different MixedPrecisionPolicy "
            f"param_dtype ({sorted(map(str, dtypes))}); graphamp's AMP runs one low precision"
        )
    import torch.distributed as dist

    group = next(iter(groups.values())) if groups else dist.group.WORLD
    blocks = tuple(f"{name}.{path}" if path else name for path, _ in wrapped)
    kept = tuple(block for block, (_, _, keep) in zip(blocks, facts) if keep)
    return FullyShardWrap(group=group, blocks=blocks, param_dtype=dtypes.pop(), kept=kept)


def check_policy(graph_name: str, config: ConfigSnapshot) -> None:
    """A wrap's ``param_dtype`` is AMP's dtype (read at the first call: AMP may be enabled
    after the model is registered)."""
    wrap = config.fully_shard
    if wrap is None or wrap.param_dtype is None:
        return
    if not config.amp_active or config.amp_dtype != wrap.param_dtype:
        amp = f"AMP in {config.amp_dtype}" if config.amp_active else "AMP off"
        raise ConfigError(
            f"{graph_name}: the model's fully_shard asks for MixedPrecisionPolicy(param_dtype="
            f"{wrap.param_dtype}) and the Graph has {amp}. graphamp runs low precision "
            "through its AMP, op by op: call self.config.enable_amp(True, "
            f"dtype={wrap.param_dtype}) (the parameters it casts are gathered in that dtype, "
            "as FSDP2's are), or wrap without param_dtype"
        )


def adopt_at_first_build(
    graph_name: str, modules: Iterable[tuple[str, nn.Module]], config: ConfigSnapshot
) -> None:
    """Before a build: the registered models' fully_shard wraps, accepted at registration,
    checked against the final settings and then removed (nothing to do once they are)."""
    if config.fully_shard is None:
        return
    check_policy(graph_name, config)
    for name, module in modules:
        take_over(graph_name, name, module)


def take_over(graph_name: str, name: str, module: nn.Module) -> None:
    """``module``'s wraps removed: a plain module holding FSDP2's shards, which the first call
    makes graphamp's (``sharded_params.shard_parameters``)."""
    wrapped = _wrapped_modules(module)
    if not wrapped:
        return
    for _, m in wrapped:
        remove_fully_shard(m, _fsdp_module_class())
    log.info(
        "%s.%s is wrapped with fully_shard (%d modules): graphamp trains it with ZeRO-3 inside "
        "the compiled step, one all-gather and one reduce-scatter per wrapped module",
        graph_name,
        name,
        len(wrapped),
    )


def _wrapped_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    fsdp_module = _fsdp_module_class()
    if fsdp_module is None:
        return []
    return [(path, m) for path, m in module.named_modules() if isinstance(m, fsdp_module)]


def _wrap_facts(where: str, path: str, module: nn.Module) -> tuple[Any, torch.dtype | None, bool]:
    """(its mesh's process group or None when it holds no parameter, its param_dtype, whether
    its gathered parameters stay from the forward to the backward), after refusing what
    graphamp cannot do the same way."""
    label = f"{where}.{path}" if path else where
    state = fully_shard_state(module, is_root=not path)
    if state.output_dtype is not None:
        raise GraphDefinitionError(
            f"{label}: fully_shard(mp_policy=MixedPrecisionPolicy(output_dtype="
            f"{state.output_dtype})) casts the module's outputs, which graphamp does not: its "
            "AMP decides each op's dtype. Leave output_dtype None"
        )
    if state.reduce_dtype not in (None, torch.float32):
        raise GraphDefinitionError(
            f"{label}: fully_shard(mp_policy=MixedPrecisionPolicy(reduce_dtype="
            f"{state.reduce_dtype})): graphamp reduce-scatters the float32 gradients as they "
            "are. Leave reduce_dtype None or torch.float32"
        )
    group, keep = None, False
    for param_group in state.groups:
        if param_group.mesh.ndim != 1:
            raise GraphDefinitionError(
                f"{label}: fully_shard on a {param_group.mesh.ndim}-D mesh (HSDP) is not "
                "supported by graphamp: it shards over one process group. Wrap with a 1-D mesh"
            )
        if param_group.cpu_offload:
            raise GraphDefinitionError(
                f"{label}: fully_shard(offload_policy=CPUOffloadPolicy()) is not supported by "
                "graphamp: its step updates the shards on the device that runs it"
            )
        group, keep = param_group.mesh.get_group(), param_group.keeps_gathered
    return group, state.param_dtype, keep


def _ranks(group) -> tuple[int, ...]:
    import torch.distributed as dist

    return tuple(dist.get_process_group_ranks(group))


def refuse_foreign_dtensors(graph_name: str, root: nn.Module) -> None:
    """Refuse DTensor parameters that are not graphamp's shards (tensor parallel, or a wrap
    put on after registration): their collectives run outside any graph, which make_fx cannot
    trace through (measured on torch 2.14, gloo: "'FunctionalTensor' object has no attribute
    '_local_tensor'"). A ``fully_shard`` wrap registered on the Graph was taken over already,
    before the build (``adopt_at_first_build``)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return
    for name, p in root.named_parameters():
        if isinstance(p, DTensor) and not is_shard(p):
            raise ConfigError(
                f"{graph_name}: parameter {name!r} is a DTensor that graphamp did not shard "
                "(tensor parallel, or fully_shard applied after the model was registered), "
                "which graphamp cannot capture. Wrap with fully_shard before registering the "
                "model (graphamp takes the wrap over), or register the plain model and call "
                "self.config.enable_zero(stage=3): it shards the parameters, gradients and "
                "optimizer state inside the compiled step, as DTensors in FSDP2's layout"
            )
