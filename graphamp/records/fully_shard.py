"""What graphamp keeps of a model the user wrapped with FSDP2's ``fully_shard`` (a setting:
``sharding/fsdp_adopt.py`` reads the wrap, the config holds it)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class FullyShardWrap:
    """What graphamp kept of a model the user wrapped with FSDP2's ``fully_shard``
    (sharding/fsdp_adopt.py): the step is ZeRO-3 over ``group``, gathering each wrapped module's
    parameters as one block, and the wrap's ``MixedPrecisionPolicy`` is checked against AMP."""

    group: Any  # the 1-D mesh's process group
    blocks: tuple[str, ...]  # the wrapped modules' paths from the Graph ("model.layers.0", "model")
    param_dtype: torch.dtype | None  # MixedPrecisionPolicy.param_dtype: must be AMP's dtype
    # the blocks whose wrap keeps its gathered parameters from the forward to the backward
    # (reshard_after_forward=False, or FSDP2's default for the root)
    kept: tuple[str, ...] = ()

    def merged(self, other: FullyShardWrap) -> FullyShardWrap:
        """Two registered wraps (a model and its loss module, say) on one group."""
        return dataclasses.replace(
            self, blocks=self.blocks + other.blocks, kept=self.kept + other.kept
        )
