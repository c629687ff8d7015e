"""What the AMP passes read, and what they report back: one record per build.

The pipeline makes it from the config (``pipeline/stages.amp_passes``); the passes
(``graphamp.passes``) fill in what they found; the plan and the inspection read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

import torch

from .layouts import PassState
from .validate import check_low_precision_dtype, check_opt_level

if TYPE_CHECKING:  # the passes' own type, named only
    from ..passes.lists import PrecisionLists

__all__ = ["AmpContext"]

# The colours a pass after the lists gives ops that run finer than the AMP dtype (the precision
# report counts them among the low-precision ops), and what its summary calls them.
FINER_COLOURS: dict[str, str] = {"fp8": "fp8 matmuls"}


@dataclass(frozen=True)
class Fp8Options:
    """fp8 matmuls on top of bf16 AMP (``config.enable_fp8``, ``passes/fp8_matmuls.py``)."""

    recipe: str  # torchkit.fp8_numerics.RECIPES
    keep: frozenset[str] = frozenset()  # module paths whose matmuls stay bf16
    keep_first_last: bool = True  # the input projection and output layer stay bf16
    history: int = 16  # the delayed recipe's history length (steps) and margin
    margin: int = 0


@dataclass(frozen=True)
class SpeedCheck:
    """Time the ops whose low-precision kernel can be the slower one, and keep fp32 where it is
    faster (``config.set_fp32_where_faster``, ``passes/fp32_where_faster.py``)."""

    training: bool  # time forward and backward (a training graph), or the forward only
    # the step is compiled by inductor: the attention written as matmuls is timed by its
    # products and softmax (inductor fuses the rest into them), not op by op
    compiled: bool = False


@dataclass
class AmpContext:
    """Everything the AMP passes read, and what they report back."""

    lists: PrecisionLists  # which ops run in low precision, fp32, or follow their inputs
    dtype: torch.dtype = torch.float16
    opt_level: str = "O1"
    pinned_paths: frozenset[str] = frozenset()  # module paths whose ops stay fp32
    pin_reasons: dict[str, str] = field(default_factory=dict)  # path -> who pinned it, if known
    pinned_nodes: Mapping[str, str] = field(default_factory=dict)  # node name -> why it is fp32
    # placeholder names of parameters (hoist_parameter_casts may give them shadows)
    parameters: frozenset[str] = frozenset()
    # the graph's first outputs are build()'s results: where an op computed one wider than it
    # was captured (fp32 from low-precision inputs, as autocast's fp32 ops do) it is returned
    # wide, so it cannot overflow where autocast's does not (insert_casts.fix_outputs)
    user_outputs: int = 0
    fp8: Fp8Options | None = None  # fp8 matmuls (passes/fp8_matmuls.py); None: none
    speed_check: SpeedCheck | None = None  # passes/fp32_where_faster.py; None: the lists only
    # ops a later pass rewrites in low precision (its settings say so): not timed for fp32
    rewritten_later: frozenset = frozenset()
    # filled by the passes
    stats: dict[str, Any] = field(default_factory=dict)
    unknown_ops: dict[str, int] = field(default_factory=dict)
    # the ops speed_check kept fp32: node name -> (low-precision ms, fp32 ms) as timed
    kept_fp32_timings: dict[str, tuple[float, float]] = field(default_factory=dict)
    # the attention it wrote as low-precision matmuls: node name -> (low, fp32, matmuls) ms
    matmul_attention_timings: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    hoisted: list[tuple[str, torch.dtype]] = field(default_factory=list)
    # state tensors a pass gave the forward (ForwardLayout.pass_state), after the parameter copies
    pass_state: list[PassState] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_low_precision_dtype("AmpContext(dtype", self.dtype)
        check_opt_level(self.opt_level)
