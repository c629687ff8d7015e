"""The one owner of each input order: the captured forward's (``ForwardLayout``) and the
compiled step's (``StepLayout``).

Both graphs take flat lists of inputs. Whoever builds, traces, feeds or reads them goes through
a layout's ``flatten`` / ``split``, never through hand-kept indexes, and reads the groups by
name (``ForwardInputs``, ``StepInputs``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Generic, Mapping, Sequence, TypeVar

__all__ = [
    "CALL_GROUPS",
    "ForwardInputs",
    "ForwardLayout",
    "PassState",
    "STATE_GROUPS",
    "STEP_INPUT_GROUPS",
    "StepInputs",
    "StepLayout",
]

T = TypeVar("T")


# -- the captured forward ------------------------------------------------------------------------


@dataclass(frozen=True)
class PassState:
    """A state tensor an AMP pass gave the forward: a placeholder (``name``) that the pass's ops
    read and write in place every step. It starts as float32 zeros of ``shape``, made once per
    graph and shared by its compiled steps (``SharedState.pass_state``)."""

    name: str
    shape: tuple[int, ...]


@dataclass
class ForwardInputs(Generic[T]):
    """The forward graph's inputs by group: values, placeholder nodes or names."""

    params: list[T]
    buffers: list[T]
    inputs: list[T]  # the tensor leaves of g(...)'s arguments
    loss_scale: T  # 0-dim fp32: gradients build() takes itself are scaled by it (1: no scaler)
    constants: list[T]  # tensors build() read that are neither state nor arguments
    param_copies: list[T]  # low-precision parameter copies (StepPlan.param_casts order)
    pass_state: list[T]  # state an AMP pass gave the forward (StepPlan.pass_state order)


@dataclass(frozen=True)
class ForwardLayout:
    """The order of the forward graph's inputs:
    ``(*params, *buffers, *inputs, loss_scale, *constants, *param_copies, *pass_state)``.

    Capture traces build() over the first four groups and lifts what build() read from outside
    into ``constants`` after them (``CapturedForward.layout``); the AMP pass
    ``hoist_parameter_casts`` appends the low-precision parameter copies, and a pass whose ops
    keep state from step to step appends that state (``AmpContext.pass_state``,
    ``StepPlan.forward_layout``).
    Capture, the planner, the step components, the gradients
    subgraph and the eval step build and read the forward's inputs through this class only.
    """

    params: int
    buffers: int
    inputs: int
    constants: int = 0
    param_copies: int = 0
    pass_state: int = 0

    def flatten(
        self,
        *,
        params: Sequence[T],
        buffers: Sequence[T],
        inputs: Sequence[T],
        loss_scale: T,
        constants: Sequence[T] = (),
        param_copies: Sequence[T] = (),
        pass_state: Sequence[T] = (),
    ) -> list[T]:
        """The forward's flat inputs; ValueError if a group's size is not the layout's."""
        groups = {
            "params": params,
            "buffers": buffers,
            "inputs": inputs,
            "constants": constants,
            "param_copies": param_copies,
            "pass_state": pass_state,
        }
        for name, values in groups.items():
            if len(values) != getattr(self, name):
                raise ValueError(
                    f"forward input group {name!r} has {len(values)} values, the layout "
                    f"{getattr(self, name)}"
                )
        return [*params, *buffers, *inputs, loss_scale, *constants, *param_copies, *pass_state]

    def split(self, flat: Sequence[T]) -> ForwardInputs[T]:
        """The groups of the forward's flat inputs (or of its placeholders)."""
        if len(flat) != len(self):
            raise ValueError(f"the forward has {len(self)} inputs, got {len(flat)}")
        ends = [
            self.params,
            self.buffers,
            self.inputs,
            1,
            self.constants,
            self.param_copies,
            self.pass_state,
        ]
        cuts, start = [], 0
        for n in ends:
            cuts.append(list(flat[start : start + n]))
            start += n
        params, buffers, inputs, (loss_scale,), constants, copies, state = cuts
        return ForwardInputs(params, buffers, inputs, loss_scale, constants, copies, state)

    def with_param_copies(self, n: int) -> ForwardLayout:
        """This layout after the AMP passes hoisted ``n`` parameter casts."""
        return dataclasses.replace(self, param_copies=n)

    def with_pass_state(self, n: int) -> ForwardLayout:
        """This layout after the AMP passes appended ``n`` state inputs."""
        return dataclasses.replace(self, pass_state=n)

    def __len__(self) -> int:
        fixed = self.params + self.buffers + self.inputs + 1 + self.constants
        return fixed + self.param_copies + self.pass_state


# -- the compiled step ---------------------------------------------------------------------------


@dataclass
class StepInputs(Generic[T]):
    """The compiled step's inputs by group: the core's groups before (``STATE_GROUPS``), the
    step components' groups (``owned``, by group name, in the layout's order), then the core's
    per-call groups (``CALL_GROUPS``); the batch comes last, so the runtime can tell state (kept
    at fixed addresses, e.g. for CUDA graphs) from per-call inputs."""

    params: list[T]
    buffers: list[T]
    opt_state: list[T]  # OptimizerPlan.state_slots() order, optimizer by optimizer
    hyper: list[T]  # per param group: OptimizerPlan.hyper_names
    counters: list[T]  # one applied-step counter per optimizer
    # per parameter of SGD groups with momentum and dampening (OptimizerPlan.fresh_params):
    # True until its momentum buffer's first applied step (then it starts from the gradient)
    momentum_fresh: list[T]
    pass_state: list[T]  # the forward's state from the AMP passes (StepPlan.pass_state)
    constants: list[T]
    inputs: list[T]
    # each step component's group (StepComponent.group): its state, read and written in place
    owned: dict[str, list[T]] = dataclasses.field(default_factory=dict)


# The core's groups: the forward's and the optimizers' state, then (after the components'
# groups) the per-call ones.
STATE_GROUPS = (
    "params",
    "buffers",
    "opt_state",
    "hyper",
    "counters",
    "momentum_fresh",
    "pass_state",
)
CALL_GROUPS = ("constants", "inputs")
STEP_INPUT_GROUPS = STATE_GROUPS + CALL_GROUPS


class StepLayout:
    """The order of the compiled step's inputs.

    ``names`` gives every group's placeholder names (possibly empty): the core's groups
    (``STEP_INPUT_GROUPS``, each required) and the step components' groups, which go between
    the core's state and its per-call groups in the order ``names`` lists them. The step's flat
    inputs are the groups concatenated in that order.
    """

    def __init__(self, names: Mapping[str, Sequence[str]]):
        owned = [g for g in names if g not in STEP_INPUT_GROUPS]
        self.groups = (*STATE_GROUPS, *owned, *CALL_GROUPS)
        self.owned = tuple(owned)
        self.sizes = {g: len(names.get(g, ())) for g in self.groups}
        self.names = [n for g in self.groups for n in names.get(g, ())]
        self.n_state = len(self.names) - self.sizes["inputs"]  # tensors before the batch

    def flatten(self, groups: Mapping[str, Sequence[Any]]) -> list[Any]:
        """The step's flat inputs from ``{group: values}`` (absent groups must be empty)."""
        unknown = set(groups) - set(self.groups)
        if unknown:
            raise ValueError(f"step input groups {sorted(unknown)} are not in the layout")
        flat: list[Any] = []
        for g in self.groups:
            values = groups.get(g, ())
            if len(values) != self.sizes[g]:
                raise ValueError(
                    f"step input group {g!r} has {len(values)} values, the layout {self.sizes[g]}"
                )
            flat.extend(values)
        return flat

    def split(self, flat: Sequence[T]) -> StepInputs[T]:
        """The groups of the step's flat inputs, by name."""
        out, i = {}, 0
        for g in self.groups:
            n = self.sizes[g]
            out[g] = list(flat[i : i + n])
            i += n
        core = {g: out[g] for g in STEP_INPUT_GROUPS}
        return StepInputs(**core, owned={g: out[g] for g in self.owned})

    def __len__(self) -> int:
        return len(self.names)
