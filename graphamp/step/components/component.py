"""What a step component is: the phases of the training step, and what a component adds at each.

The training step is the forward and backward (``gradients.py``) and the optimizers' updates
(``optimizer_update.py``); every feature around them (``components/__init__.COMPONENTS``) is
a ``StepComponent``: it says which plans it acts in (``active``), which group of the step's
inputs it owns (``group`` and ``input_names``; it reads them with ``own``), the optimizers it
refuses (``check_optimizer``), the StepPlan fields it decides (``plan_fields``: a sharding
component's is the plan's ``placement``), the state ``Graph.state_dict()`` saves for it
(``saved_key``), what a
skipped step does with what it keeps and what the ranks agree on (``on_skip``,
``across_ranks``), what it traces at each ``Phase``, and its rewrite of the assembled step
(``rewrite_stage``).
Assembly (``assemble.py``) runs the phases in order and, within a phase, the components in the
order ``components/__init__.py`` registers them. A component keeps what it needs between phases
on the ``StepContext`` of the one trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn

from ...records.layouts import StepInputs
from ...records.optimizers import OptimizerPlan
from ...records.spec import CapturedForward, GraphSpec, StepPlan
from ...records.stage_names import Stage
from ...records.state import SharedState
from ...records.update_paths import UpdatePath


class Phase(Enum):
    """The named points of the training step where components add their part, in step order.
    Each member's value is the ``StepComponent`` method assembly calls."""

    START = "start"  # before the forward: whole parameters, fresh amaxes, an observer set
    GRADIENTS = "gradients"  # every gradient made: observed, reduced across ranks
    OPTIMIZER_GRADIENTS = "optimizer_gradients"  # one optimizer's: unscaled, summed, clipped
    OVERFLOW = "overflow"  # every optimizer's overflow flag known: agreed across ranks
    BEFORE_UPDATE = "before_update"  # one optimizer's tensors to update chosen (a shard)
    AFTER_UPDATE = "after_update"  # one optimizer updated: the whole parameters back
    SKIP = "skip"  # whether the step is skipped decided; what build() changed put back
    RECORD = "record"  # the step's records (overflow record, history row, amax histories)
    FINISH = "finish"  # the scaler's state for the next step


@dataclass(frozen=True)
class Planning:
    """What the planner knows when the components settle their fields of the StepPlan."""

    spec: GraphSpec
    captured: CapturedForward
    forward: fx.GraphModule  # the graph after the AMP passes
    optimizers: list[OptimizerPlan]
    trainable: list[int]  # forward parameter positions that get gradients
    param_casts: list[tuple[int, torch.dtype]]  # StepPlan.param_casts
    process_group: Any  # data parallel's group (None: one process)
    shard_group: Any  # the group the parameters are shards over (None: not shards)
    regions: frozenset[str]  # the module paths activation checkpointing recomputes


@dataclass
class OptimizerUpdate:
    """One optimizer's part of the step, from its gradients to its update."""

    opt: OptimizerPlan
    grads: list[torch.Tensor]  # unscaled and clipped, in opt.forward_positions order
    found: torch.Tensor | None = None  # its overflow flag (None without a scaler)


@dataclass
class StepContext:
    """One trace of the step: the plan, the inputs, and what the phases made so far."""

    plan: StepPlan
    fwd_gm: fx.GraphModule
    inputs: StepInputs  # the step's inputs by group (sharded parameters: the wholes, after START)
    record_origins: bool = False
    # set at START by components that change how the forward runs
    rows: list[torch.Tensor] | None = None  # the parameters' shards the update writes
    copies: list[torch.Tensor] | None = None  # low-precision copies made from gathered wholes
    reduce_each: Callable[[list], list] | None = None  # each micro-batch's gradients reduced
    observer: Any = None  # sees every forward value and its gradient (overflow tracing)
    norm_of: Callable | None = None  # the gradients' total norm where they are shards
    grads_reduced: bool = False  # a component reduces the gradients over the ranks itself
    whole_updates: bool = True  # the update sees whole parameters (block kernels may run)
    # made by the forward and the phases
    fwd: Any = None  # gradients.ForwardResult
    grads: list[torch.Tensor] = field(default_factory=list)  # in plan.trainable order
    updates: list[OptimizerUpdate] = field(default_factory=list)
    norms: list[torch.Tensor] = field(default_factory=list)  # clipping's total norms
    scale: torch.Tensor | None = None  # the loss scale (set at START by the scaler; None: none)
    step_number: torch.Tensor | None = None  # the graph's step counter (the history's, at START)
    found_total: torch.Tensor | None = None  # every optimizer's overflow flags summed
    any_skip: torch.Tensor | None = None  # the step is skipped (None: no scaler)
    # per component, what it keeps from one phase to a later one
    kept: dict[str, Any] = field(default_factory=dict)

    def positions(self) -> dict[int, int]:
        """Forward parameter position -> index in ``grads`` (``plan.trainable`` order)."""
        return {p: j for j, p in enumerate(self.plan.trainable)}


class StepComponent:
    """One feature of the training step. Subclasses set ``name``, override ``active`` and the
    phase methods they add at; the defaults add nothing."""

    name = ""
    part = ""  # what it does, in the words of an error raised while it is traced
    group: str | None = None  # the StepInputs group whose tensors it owns, if any
    inputs: tuple[
        str, ...
    ] = ()  # that group's placeholder names, where the plan does not vary them

    # its key in ``Graph.state_dict()``, where it keeps state from step to step (None: none)
    saved_key: str | None = None
    # what a skipped step (an overflow) does with what it keeps, and what the ranks of a
    # data-parallel step agree on: every component says, "nothing" included
    # (docs/architecture.md draws them; tests/test_architecture.py checks the page)
    on_skip = ""
    across_ranks = ""
    # the pipeline stage (``pipeline/stage_errors.py`` words its errors) that runs
    # ``rewrite_step`` on the assembled step (None: it rewrites nothing); a stage the enum
    # orders before ``Stage.OUTLINE`` rewrites the inlined step, a later one the outlined step
    rewrite_stage: Stage | None = None

    def active(self, plan: StepPlan) -> bool:
        """Does this plan use the component?"""
        raise NotImplementedError

    def saved_state(self, state: SharedState) -> Any:
        """What ``Graph.state_dict()`` saves under ``saved_key`` (tensors and plain values:
        it loads with ``torch.load(..., weights_only=True)``)."""
        raise NotImplementedError(f"{type(self).__name__} saves no state")

    def checked_saved(self, saved: Any) -> Any:
        """A saved state of this component, checked before anything loads: ConfigError where
        it cannot load (the graph is then left as it was)."""
        return saved

    def load_saved(self, state: SharedState, checked: Any) -> None:
        """Load what ``checked_saved`` returned into the graph's state (in place where a
        compiled step holds it)."""
        raise NotImplementedError(f"{type(self).__name__} saves no state")

    def check_optimizer(  # noqa: B027 - a hook: most components refuse no optimizer
        self, spec: GraphSpec, optimizer: Any, path: UpdatePath
    ) -> None:
        """Refuse an optimizer (or its update path) this component cannot run with, before
        the planner runs anything for it (every component is asked, active or not)."""

    def prepare_model(  # noqa: B027 - a hook: most components leave the model as it is
        self, spec: GraphSpec, root: nn.Module, group: Any
    ) -> None:
        """Change how the model holds its state before capture, on every rank of a
        data-parallel build over ``group`` (every component is asked)."""

    def rewrites(self, plan: StepPlan) -> bool:  # noqa: ARG002 - overridden
        """Does it rewrite ``plan``'s assembled step (``rewrite_step``, when active)?"""
        return False

    def rewrite_step(self, plan: StepPlan, gm: fx.GraphModule) -> str:
        """Rewrite the assembled step in place, at ``rewrite_stage``; what it did, in words
        for the stage's INFO line ("": the step's size says enough)."""
        raise NotImplementedError(f"{type(self).__name__} rewrites no step")

    @property
    def rewrites_before_outlining(self) -> bool:
        """Is its rewrite made on the inlined step (its stage comes before outlining's)?"""
        stages = list(Stage)
        stage = self.rewrite_stage
        return stage is not None and stages.index(stage) < stages.index(Stage.OUTLINE)

    def plan_fields(self, planning: Planning) -> dict[str, Any]:  # noqa: ARG002 - overridden
        """The StepPlan fields this component decides (checked: a refusal raises here, before
        anything is traced); a field two components set is an error."""
        return {}

    def own(self, ctx: StepContext) -> list[torch.Tensor]:
        """Its input group's tensors in this trace of the step."""
        return ctx.inputs.owned[str(self.group)]

    def input_names(self, plan: StepPlan) -> list[str]:  # noqa: ARG002 - overridden by plan
        """The placeholder names of its input group (``group``), when active."""
        return list(self.inputs)

    def example_inputs(
        self, plan: StepPlan, state: SharedState, device: torch.device
    ) -> list[torch.Tensor]:
        """Its input group's tensors to trace and compile the step with: the live ones where
        they exist (``step/examples.py``), when active."""
        raise NotImplementedError(f"{type(self).__name__} owns no input group")

    def start(self, ctx: StepContext) -> None:
        """Also run for a forward-only (eval) step, the one phase it has."""

    def gradients(self, ctx: StepContext) -> None:
        pass

    def optimizer_gradients(self, ctx: StepContext, u: OptimizerUpdate) -> None:
        pass

    def overflow(self, ctx: StepContext) -> None:
        pass

    def before_update(
        self,
        ctx: StepContext,  # noqa: ARG002 - the phase's signature
        u: OptimizerUpdate,  # noqa: ARG002
        tensors: list[torch.Tensor],
    ) -> list[torch.Tensor]:
        return tensors

    def after_update(
        self, ctx: StepContext, u: OptimizerUpdate, tensors: list[torch.Tensor]
    ) -> None:
        pass

    def skip(self, ctx: StepContext) -> None:
        pass

    def record(self, ctx: StepContext) -> None:
        pass

    def finish(self, ctx: StepContext) -> None:
        pass

    def adds_at(self, phase: Phase) -> bool:
        """Does the component override the method of ``phase``?"""
        return getattr(type(self), phase.value) is not getattr(StepComponent, phase.value)
