"""The settings a compiled step is built with, as the stages read them: frozen and hashable.

``config.GraphConfig`` (the user's face: verb-named setters that validate) keeps one
``ConfigSnapshot`` and replaces it on every change; the Graph hands the current one to the
pipeline inside the ``GraphSpec``, and it is part of the compiled-step cache key. The stages read
this module, never ``config.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .fully_shard import FullyShardWrap
from .pins import AmpPin

BACKENDS = ("inductor", "aot_eager", "eager")
__all__ = ["AutofixSettings", "BACKENDS", "ConfigSnapshot", "ListOverrides"]


@dataclasses.dataclass(frozen=True)
class ListOverrides:
    """Ops moved between the precision lists by the user (names are resolved by the AMP passes)."""

    allow: tuple[Any, ...] = ()
    deny: tuple[Any, ...] = ()
    infer: tuple[Any, ...] = ()
    clear: tuple[Any, ...] = ()
    remove: tuple[Any, ...] = ()


@dataclasses.dataclass(frozen=True)
class AutofixSettings:
    """enable_amp_autofix: pin an op to fp32 once it was the first non-finite producer on
    ``after`` skipped steps, at most ``max_pins`` times. Read on the host after each step; not
    part of the compiled step (changing it rebuilds nothing)."""

    max_pins: int
    after: int


@dataclasses.dataclass(frozen=True)
class ConfigSnapshot:
    """The settings a compiled step was built with: frozen, hashable, read by every stage."""

    amp_enabled: bool
    amp_dtype: torch.dtype
    amp_opt_level: str
    list_overrides: ListOverrides
    fp32_module_types: tuple[type, ...]
    fp32_module_names: tuple[str, ...]
    backend: str
    cuda_graph: bool | None  # None: on for CUDA (the default)
    grad_acc_steps: int
    inductor_options: tuple[tuple[str, Any], ...]
    data_parallel: bool
    process_group: Any
    overflow_tracing: bool = False  # the step records which node first went non-finite
    amp_pins: tuple[AmpPin, ...] = ()  # single ops or modules kept fp32 (by the user or autofix)
    checkpoint_module_types: tuple[type, ...] = ()
    checkpoint_module_names: tuple[str, ...] = ()
    zero_stage: int = 0  # 0: optimizer state replicated; 1, 2: sharded; 3: parameters too
    fully_shard: FullyShardWrap | None = None  # a model wrapped with fully_shard (ZeRO-3 then)
    zero_reshard_after_forward: bool = True  # ZeRO-3: gather again for the backward
    cuda_graph_sizes: int = 8  # CUDA graphs kept per dynamic step, one per batch shape (0: none)
    # repeated blocks as shared subgraphs (set_outline_blocks); None: where it costs nothing
    outline_blocks: bool | None = None
    # each outlined block's optimizer update by one kernel compiled once (set_block_updates);
    # None: where blocks are outlined by default and repeat at least 3 times
    block_updates: bool | None = None
    step_cache: bool = True  # assembled steps saved on disk for restarts (set_step_cache)
    # ops whose fp32 kernel measured faster than their low-precision one stay fp32 (CPU only)
    fp32_where_faster: bool = True
    fp8_recipe: str | None = None  # fp8 matmuls (enable_fp8): "tensorwise", "rowwise" or off
    fp8_keep: tuple[str, ...] = ()  # module paths whose matmuls stay bf16
    fp8_keep_first_last: bool = True  # the input projection and the output layer stay bf16
    fp8_history: int = 16  # delayed recipe: steps of amax history per operand
    fp8_margin: int = 0  # delayed recipe: scales divided by 2**margin

    @property
    def amp_active(self) -> bool:
        """AMP is on and its opt level changes something (O0 is fp32)."""
        return self.amp_enabled and self.amp_opt_level != "O0"

    def __hash__(self) -> int:
        # part of the cache key looked up at every call: computed once. Inductor option values
        # may be lists or dicts, so they are hashed by their text.
        cached = self.__dict__.get("_hash")
        if cached is None:
            fields = [
                getattr(self, f.name)
                for f in dataclasses.fields(self)
                if f.name != "inductor_options"
            ]
            cached = hash((*fields, repr(self.inductor_options)))
            object.__setattr__(self, "_hash", cached)
        return cached
