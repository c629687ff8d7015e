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
    "ForwardInputs",
    "ForwardLayout",
    "STEP_INPUT_GROUPS",
    "StepInputs",
    "StepLayout",
]

T = TypeVar("T")


# -- the captured forward ------------------------------------------------------------------------


@dataclass
class ForwardInputs(Generic[T]):
    """The forward graph's inputs by group: values, placeholder nodes or names."""

    params: list[T]
    buffers: list[T]
    inputs: list[T]  # the tensor leaves of g(...)'s arguments
    loss_scale: T  # 0-dim fp32: gradients build() takes itself are scaled by it (1: no scaler)
    constants: list[T]  # tensors build() read that are neither state nor arguments
    param_copies: list[T]  # low-precision parameter copies (StepPlan.param_casts order)
    fp8_state: list[T]  # the delayed fp8 recipe's amax histories (StepPlan.fp8_state order)


@dataclass(frozen=True)
class ForwardLayout:
    """The order of the forward graph's inputs:
    ``(*params, *buffers, *inputs, loss_scale, *constants, *param_copies, *fp8_state)``.

    Capture traces build() over the first four groups and lifts what build() read from outside
    into ``constants`` after them (``CapturedForward.layout``); the AMP pass
    ``hoist_parameter_casts`` appends the low-precision parameter copies
    and ``use_fp8_matmuls`` the delayed recipe's histories (``StepPlan.forward_layout``).
    Capture, the planner, the overflow probes, the gradients
    subgraph and the eval step build and read the forward's inputs through this class only.
    """

    params: int
    buffers: int
    inputs: int
    constants: int = 0
    param_copies: int = 0
    fp8_state: int = 0

    def flatten(
        self,
        *,
        params: Sequence[T],
        buffers: Sequence[T],
        inputs: Sequence[T],
        loss_scale: T,
        constants: Sequence[T] = (),
        param_copies: Sequence[T] = (),
        fp8_state: Sequence[T] = (),
    ) -> list[T]:
        """The forward's flat inputs; ValueError if a group's size is not the layout's."""
        groups = {
            "params": params,
            "buffers": buffers,
            "inputs": inputs,
            "constants": constants,
            "param_copies": param_copies,
            "fp8_state": fp8_state,
        }
        for name, values in groups.items():
            if len(values) != getattr(self, name):
                raise ValueError(
                    f"forward input group {name!r} has {len(values)} values, the layout "
                    f"{getattr(self, name)}"
                )
        return [*params, *buffers, *inputs, loss_scale, *constants, *param_copies, *fp8_state]

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
            self.fp8_state,
        ]
        cuts, start = [], 0
        for n in ends:
            cuts.append(list(flat[start : start + n]))
            start += n
        params, buffers, inputs, (loss_scale,), constants, copies, fp8 = cuts
        return ForwardInputs(params, buffers, inputs, loss_scale, constants, copies, fp8)

    def with_param_copies(self, n: int) -> ForwardLayout:
        """This layout after the AMP passes hoisted ``n`` parameter casts."""
        return dataclasses.replace(self, param_copies=n)

    def with_fp8_state(self, n: int) -> ForwardLayout:
        """This layout after ``use_fp8_matmuls`` gave ``n`` matmuls a delayed-scaling state."""
        return dataclasses.replace(self, fp8_state=n)

    def __len__(self) -> int:
        fixed = self.params + self.buffers + self.inputs + 1 + self.constants
        return fixed + self.param_copies + self.fp8_state


# -- the compiled step ---------------------------------------------------------------------------


@dataclass
class StepInputs(Generic[T]):
    """The compiled step's inputs by group, in this order (``STEP_INPUT_GROUPS``); the batch
    comes last, so the runtime can tell state (kept at fixed addresses, e.g. for CUDA graphs)
    from per-call inputs."""

    params: list[T]
    buffers: list[T]
    opt_state: list[T]  # OptimizerPlan.state_slots() order, optimizer by optimizer
    hyper: list[T]  # per param group: OptimizerPlan.hyper_names
    counters: list[T]  # one applied-step counter per optimizer
    # per parameter of SGD groups with momentum and dampening (OptimizerPlan.fresh_params):
    # True until its momentum buffer's first applied step (then it starts from the gradient)
    momentum_fresh: list[T]
    scaler: list[T]  # scale, growth tracker, hysteresis tracker, found_inf (or none)
    history: list[T]  # step, table (training graphs)
    shard: list[T]  # ZeRO: this rank's index
    forensics: list[T]  # count, ring, ranges (overflow tracing)
    fp8: list[T]  # the delayed fp8 recipe's amax histories (StepPlan.fp8_state)
    constants: list[T]
    inputs: list[T]

    @property
    def scale(self) -> T | None:
        """The loss scale (None without a scaler)."""
        return self.scaler[0] if self.scaler else None

    @property
    def history_step(self) -> T:
        """The history's step counter: the graph's step number."""
        return self.history[0]

    @property
    def zero_rank(self) -> T:
        return self.shard[0]


STEP_INPUT_GROUPS = tuple(f.name for f in dataclasses.fields(StepInputs))


class StepLayout:
    """The order of the compiled step's inputs.

    Every group of ``STEP_INPUT_GROUPS`` has a list of placeholder names (possibly empty); the
    step's flat inputs are the groups concatenated in that order.
    """

    def __init__(self, names: Mapping[str, Sequence[str]]):
        unknown = set(names) - set(STEP_INPUT_GROUPS)
        if unknown:
            raise ValueError(f"unknown step input groups {sorted(unknown)}")
        self.sizes = {g: len(names.get(g, ())) for g in STEP_INPUT_GROUPS}
        self.names = [n for g in STEP_INPUT_GROUPS for n in names.get(g, ())]
        self.n_state = len(self.names) - self.sizes["inputs"]  # tensors before the batch

    def flatten(self, groups: Mapping[str, Sequence[Any]]) -> list[Any]:
        """The step's flat inputs from ``{group: values}`` (absent groups must be empty)."""
        flat: list[Any] = []
        for g in STEP_INPUT_GROUPS:
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
        for g in STEP_INPUT_GROUPS:
            n = self.sizes[g]
            out[g] = list(flat[i : i + n])
            i += n
        return StepInputs(**out)

    def __len__(self) -> int:
        return len(self.names)
