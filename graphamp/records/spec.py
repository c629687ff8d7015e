"""The records the stages hand each other (``docs/architecture.md`` draws them).

    GraphSpec ──capture──▶ CapturedForward ──AMP passes──▶ forward + AmpContext
              ──plan──▶ StepPlan (with its StepLayout) ──assemble──▶ step graph
              ──compile──▶ Program

Each field states the invariant the stage that writes it keeps and the stages that read it rely
on. Records hold no reference to ``Graph``: a stage sees only what its record gives it.
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch.utils._pytree
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from .deferred import DeferredGraph
from .frames import UserFrame
from .guards import AttributeRead, Guards, LiftedValue
from .inputs import FlatInputs, InputSignature
from .layouts import ForwardLayout, PassState, StepLayout
from .optimizers import OptimizerPlan
from .placement import WHOLE, Placement
from .probes import ProbeTable
from .replays import StateReplay
from .settings import ConfigSnapshot
from .update_paths import UpdatePath, path_of, tensor_version

if TYPE_CHECKING:  # records of other stages, typed only
    from ..forensics.device_record import ForensicsState
    from ..scaler import GradScaler
    from ..torchkit.function_calls import FunctionCall
    from .amp import AmpContext

__all__ = [
    "AutocastTrace",
    "CapturedForward",
    "CompiledStep",
    "GraphSpec",
    "OptimizerSlot",
    "OracleOp",
    "PassRecord",
    "Program",
    "STRUCTURAL_OPS",
    "StepPlan",
    "StepRunner",
]


# a compiled step: the step's flat inputs -> its flat outputs (``backend/compile.py`` makes it)
StepFn = Callable[..., Sequence[torch.Tensor]]


# -- what the user registered and configured ------------------------------------------------------


@dataclass(frozen=True)
class OptimizerSlot:
    """One ``add_optimizer`` call."""

    optimizer: torch.optim.Optimizer  # a supported torch optimizer (checked at add_optimizer)
    lr_sch: Any  # None, or a scheduler whose .optimizer is ``optimizer``
    clip_max_norm: float | None  # None (no clipping) or a positive finite number
    clip_norm_type: float  # positive, or inf
    # why its step() runs in Python after the compiled step (step/trial_step.py), or None:
    # the step updates with it (records.update_paths.PYTHON_STEP)
    eager: str | None = None

    @property
    def path(self) -> UpdatePath:
        return path_of(self.optimizer, self.eager)

    def structure(self) -> tuple:
        """What the traced update depends on besides its input values, read at every call:
        each group's parameters and the options the build baked into the step
        (``UpdatePath.flags``: SGD's momentum on or off, Adam's amsgrad, every option of a traced
        optimizer but its lr), so changing one builds again instead of being ignored."""
        opt, path = self.optimizer, self.path
        groups = tuple(
            (
                tuple((id(p), p.requires_grad) for p in g["params"]),
                path.flags(opt, g, tensor=tensor_version),
            )
            for g in opt.param_groups
        )
        # a traced step() may read its optimizer's own settings too (self.defaults, a flag):
        # baked in like its group options
        settings = _optimizer_settings(opt) if path.traced else ()
        return (type(opt), groups, self.clip_max_norm, self.clip_norm_type, settings)


def _optimizer_settings(opt: torch.optim.Optimizer) -> tuple:
    """An optimizer's public attributes that hold plain values, and its ``defaults``."""
    out = []
    for name, value in vars(opt).items():
        if name.startswith("_") or name in ("state", "param_groups"):
            continue
        if isinstance(value, dict):
            value = tuple(sorted((str(k), v) for k, v in value.items() if _plain(v)))
        if _plain(value):
            out.append((name, value))
    return tuple(out)


def _plain(value: Any) -> bool:
    if isinstance(value, (bool, int, float, str, type(None), torch.dtype)):
        return True
    return isinstance(value, tuple) and all(_plain(v) for v in value)


@dataclass(frozen=True)
class GraphSpec:
    """Everything a build reads from the Graph, taken when the build starts."""

    name: str  # the Graph subclass's name: every message starts with it
    modules: tuple[tuple[str, nn.Module], ...]  # registered modules, in registration order
    build: Callable[..., Any]  # the bound build() method
    optimizers: tuple[OptimizerSlot, ...]  # in add_optimizer order; index = optimizer number
    scaler: GradScaler | None  # None: no loss scaling
    config: ConfigSnapshot  # frozen: a later setter changes the cache key, not this build
    history_capacity: int  # rows of the on-device history table
    debug_level: int  # 0..3, as set by Graph.debug
    progress: bool = True  # config.set_progress: a progress line on a terminal while compiling
    keep_cpu_memory: bool = True  # config.set_keep_cpu_memory: glibc keeps freed memory
    # the object build() reads settings on as self.<name> (the Graph), watched by capture like
    # the modules, and its attributes that are graphamp's own (not settings)
    owner: Any = None
    own_attributes: frozenset[str] = frozenset()

    @property
    def training(self) -> bool:
        """A Graph with an optimizer trains; one without is an eval graph."""
        return bool(self.optimizers)


# -- what capture hands the AMP passes and the planner ----------------------------------------------


@dataclass(frozen=True)
class GradientCode:
    """What build() did with gradients itself (``capture/gradient_book.py``): read or wrote a
    ``.grad``, or changed parameters in place (SAM's perturbation). The forward's outputs end with
    the parameters' ``.grad`` build() left (``grad_params`` order), then the new values of the
    parameters it changed (``changed_params`` order)."""

    losses_taken: int = 0  # the first n losses: build() took their gradients; the step does not
    grad_params: tuple[int, ...] = ()  # parameter positions whose .grad build() left set
    changed_params: tuple[int, ...] = ()  # parameter positions build() changed in place

    def __post_init__(self) -> None:
        if list(self.grad_params) != sorted(set(self.grad_params)):
            raise ValueError(f"grad_params must ascend without repeats: {self.grad_params}")

    @property
    def present(self) -> bool:
        return bool(self.losses_taken or self.grad_params or self.changed_params)

    @property
    def num_outputs(self) -> int:
        return len(self.grad_params) + len(self.changed_params)


@dataclass
class CapturedForward:
    """build() traced once on fake tensors: a functional aten-level forward graph.

    Placeholders are in ``layout`` order (``ForwardLayout``: parameters, buffers, input
    tensors, loss_scale, constants, named by ``param_names``, ``buffer_names``, ``input_names``,
    ``constant_names``); ``loss_scale`` (0-dim fp32) scales the gradients build() takes itself
    (``torch.autograd.grad``), 1 without a scaler. Outputs are ``(*build()'s tensors, *tensors
    build() writes on the user's objects, *losses, *explicit loss gradients, *new values of
    mutated buffers, *gradient_code's outputs)``: ``split_outputs`` cuts them (the written tensors count among the user
    outputs; ``replays`` says where each goes after a call).
    """

    gm: fx.GraphModule  # linted and recompiled; no in-place op on a placeholder
    param_names: list[str]  # qualified names from the registered modules, tied ones once
    buffer_names: list[str]
    input_names: list[str]  # readable names of g(...)'s tensor leaves
    num_user_outputs: int  # tensors among build()'s return leaves
    output_spec: pytree.TreeSpec  # build()'s return structure
    output_template: list[Any]  # build()'s return leaves, with TENSOR where a tensor goes
    loss_frames: list[UserFrame | None]  # where each backward() was called
    loss_grad_given: list[bool]  # backward(gradient=...) for that loss
    mutated_buffers: list[int]  # indexes into buffer_names, in output order
    # per loss: the parameter positions backward(inputs=...) named, or None for all
    loss_inputs: list[frozenset[int] | None] = field(default_factory=list)
    unused_params: set[int] = field(default_factory=set)  # params no loss sends gradients to
    # custom autograd Functions captured as graphamp.autograd_function nodes (kept alive here)
    function_calls: list[FunctionCall] = field(default_factory=list)
    # tensors build() read that are neither state nor arguments: the live objects, passed to
    # every call (in-place changes are seen), and their names (attribute paths where known)
    constants: list[torch.Tensor] = field(default_factory=list)
    constant_names: list[str] = field(default_factory=list)
    # tensors build() writes on the user's objects on every call: the last ``num_written`` user
    # outputs, put where build() put them after every call (records/replays.py); their count
    # is the replays' num_tensors summed
    num_written: int = 0
    replays: list[StateReplay] = field(default_factory=list)
    # puts back the Python state capture settled on the user's objects (a later stage failed)
    undo_writes: Callable[[], None] | None = None
    # the Python attributes build() read, with their values: the program assumes them (guards)
    attribute_reads: tuple[AttributeRead, ...] = ()
    lifted: tuple[
        LiftedValue, ...
    ] = ()  # Python floats fed as inputs (their holders lead constants)
    gradient_code: GradientCode = field(default_factory=GradientCode)
    # the batch the kept trace ran on (records.inputs.FlatInputs) where it is not the one
    # capture was given: a copy in a fake mode of its own (capture/trace.py, ``may_move``)
    moved_to: Any = None

    def __post_init__(self) -> None:
        if len(self.loss_grad_given) != len(self.loss_frames):
            raise ValueError("CapturedForward: one loss_grad_given per loss_frames entry")
        if len(self.constant_names) != len(self.constants):
            raise ValueError("CapturedForward: one constant_names entry per constant")
        if not 0 <= self.num_written <= self.num_user_outputs:
            raise ValueError(
                f"CapturedForward: num_written {self.num_written} must be among the "
                f"{self.num_user_outputs} user outputs"
            )

    @property
    def num_losses(self) -> int:
        return len(self.loss_frames)

    @property
    def layout(self) -> ForwardLayout:
        """The order of this forward's inputs (no parameter copies: the AMP passes add them)."""
        return ForwardLayout(
            len(self.param_names),
            len(self.buffer_names),
            len(self.input_names),
            len(self.constant_names),
        )

    def split_outputs(self, outs: Sequence[Any]) -> tuple[list, list, list, list]:
        """(build()'s tensors, losses, explicit loss gradients, new buffer values)."""
        n_out, n_loss = self.num_user_outputs, self.num_losses
        n_grad = sum(self.loss_grad_given)
        end = len(outs) - self.gradient_code.num_outputs
        return (
            list(outs[:n_out]),
            list(outs[n_out : n_out + n_loss]),
            list(outs[n_out + n_loss : n_out + n_loss + n_grad]),
            list(outs[n_out + n_loss + n_grad : end]),
        )

    def gradient_code_outputs(self, outs: Sequence[Any]) -> tuple[list, list]:
        """(the parameters' .grad build() left, the new values of the parameters it changed):
        ``gradient_code``'s outputs, after the buffers'."""
        code = self.gradient_code
        tail = list(outs[len(outs) - code.num_outputs :]) if code.num_outputs else []
        return tail[: len(code.grad_params)], tail[len(code.grad_params) :]

    def unflatten_outputs(self, tensors: Sequence[Any], fed: Sequence[float] = ()) -> Any:
        """build()'s return value with ``tensors`` where it returned tensors (the written
        tensors that follow them are left out) and the call's lifted floats (``fed``) where it
        returned one of them as it read it."""
        it = iter(tensors)
        leaves = [
            next(it) if x is TENSOR else fed[x.index] if isinstance(x, LiftedOutput) else x
            for x in self.output_template
        ]
        return pytree.tree_unflatten(leaves, self.output_spec)


TENSOR = object()  # marks where build()'s return value held a tensor


@dataclass(frozen=True)
class LiftedOutput:
    """Marks where build() returned a lifted float as it read it (``return loss, lr``): the
    call's value, a Python float as in eager, not the step's float32 tensor of it."""

    index: int  # among the lifted values


# -- what the planner hands assembly and the runtime ----------------------------------------------


@dataclass
class StepPlan:
    """What the training step does, decided before it is traced."""

    captured: CapturedForward
    training: bool  # False: forward only (an eval graph); True: at least one optimizer
    # forward-parameter positions that get gradients, each once (by optimizer, then position)
    trainable: list[int]
    optimizers: list[OptimizerPlan]  # one per add_optimizer, same order
    scaler: GradScaler | None  # None for eval graphs and graphs without a scaler
    layout: StepLayout
    # parameters the forward reads in low precision (hoist_parameter_casts): (position, dtype),
    # cast once at the start of every step, so edits made outside the step (p.data, init,
    # load_state_dict) are always seen
    param_casts: list[tuple[int, torch.dtype]] = field(default_factory=list)
    # parameters the forward also reads directly (in their own dtype)
    direct_use: set[int] = field(default_factory=set)
    acc_steps: int = 1  # gradient accumulation: micro-batches per step (>= 1)
    process_group: Any = None  # data parallel: gradients averaged over this group
    # where the parameters and their optimizer state live: whole (WHOLE), or a component's
    # placement (rows across ranks: sharding/row_placement.py); the runner and the examples ask it
    placement: Placement = WHOLE
    # overflow tracing: the values the step measures (None: tracing off, or an eval graph)
    probes: ProbeTable | None = None
    # the state tensors the AMP passes gave the forward (after the parameter copies)
    pass_state: list[PassState] = field(default_factory=list)
    # activation checkpointing: the module paths the training step recomputes for the backward,
    # sorted (empty: none)
    checkpointed: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if len(set(self.trainable)) != len(self.trainable):
            raise ValueError(f"StepPlan.trainable names a parameter twice: {self.trainable}")
        if self.acc_steps < 1:
            raise ValueError(f"StepPlan.acc_steps must be at least 1, got {self.acc_steps}")
        if not self.training and (self.optimizers or self.scaler is not None):
            raise ValueError("an eval StepPlan (training=False) has no optimizer and no scaler")
        if self.placement.sharded and self.process_group is None:
            raise ValueError("a StepPlan over sharded tensors needs the process group")

    @property
    def recomputes(self) -> bool:
        """Activation checkpointing: the training step recomputes the forward's checkpointed
        regions for the backward (``step/components/activation_checkpointing.py``)."""
        return bool(self.checkpointed)

    @property
    def eager_outputs(self) -> int:
        """How many of the step's outputs, after build()'s, are for the optimizers whose own
        step() runs after it (``records.update_paths.PYTHON_STEP``): their gradients, then whether the
        step overflowed (with a scaler)."""
        grads = sum(len(o.params) for o in self.optimizers if o.path.in_python)
        return grads + (1 if grads and self.scaler is not None else 0)

    @property
    def forward_layout(self) -> ForwardLayout:
        """The order of the inputs of the forward the step runs (after the AMP passes)."""
        layout = self.captured.layout.with_param_copies(len(self.param_casts))
        return layout.with_pass_state(len(self.pass_state))


# -- what a build leaves for running and inspection -------------------------------------------------


@dataclass
class PassRecord:
    """The forward graph's code after one stage, kept for dumps and debug output."""

    name: str
    code: str
    seconds: float
    modified: bool


class PendingStep(Protocol):
    """A step compiled beside training that takes a program over when it is ready."""

    def on_call(self, program: Program) -> None:
        """Before each call of ``program``: start compiling, or take over."""
        ...


class StepRunner(Protocol):
    """The runtime side of a Program: runs the compiled step on the live state."""

    calls: int  # how many times the step ran
    uses_cuda_graph: bool
    forensics: ForensicsState | None  # this step's overflow record (overflow tracing on)
    fed: list[float]  # the lifted floats ``gather`` fed the step, as they were read

    def gather(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The step's flat inputs for this call; changes nothing the user can see."""
        ...

    def record_step(self) -> Callable[[], None]:
        """The step's bookkeeping, done before the program runs; returns its undo."""
        ...

    def execute(self, flat: list[torch.Tensor]) -> list[torch.Tensor]:
        """Run the compiled program on ``gather``'s inputs (it writes the state in place)."""
        ...

    def run_again(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The program run again on the call's batch (an optimizer's closure); what counts
        calls is put back."""
        ...

    def step_eagerly(
        self, outputs: list[torch.Tensor], again: Callable[[], list[torch.Tensor]]
    ) -> None:
        """The optimizers whose own step() runs after the program, on its outputs; ``again``
        runs the program again, for an optimizer's closure."""
        ...

    def invalidate_optimizer_state(self) -> None: ...


@dataclass
class Program:
    """One compiled step for one input signature: what each stage made of it, and its runner."""

    spec: GraphSpec  # the registration and settings it was built from
    signature: InputSignature
    captured: CapturedForward
    forward: fx.GraphModule  # the forward after the AMP passes (the captured one if AMP is off)
    amp: AmpContext | None  # the passes' context and statistics; None when AMP is off
    plan: StepPlan
    step: DeferredGraph  # the whole step as compiled (a restart's: loaded when first read)
    runner: StepRunner
    device: torch.device
    timings: dict[str, float] = field(default_factory=dict)  # stage name -> seconds
    pass_records: list[PassRecord] = field(default_factory=list)
    example_inputs: FlatInputs | None = None  # meta copies, to rerun build() on fakes later
    guards: Guards | None = None  # what it assumes; the runtime checks it before every call
    serial: int = 0  # its number in the Graph's cache (set when it is kept)
    # the chosen step compiled beside training, to take over from this one (pipeline/tier_up.py)
    tier_up: PendingStep | None = None

    @property
    def dynamic(self) -> frozenset[tuple[int, int]]:
        """The batch dimensions (tensor index, dim) it traced as symbols."""
        return self.guards.shapes.dynamic if self.guards is not None else frozenset()

    @property
    def step_gm(self) -> fx.GraphModule:
        return self.step.gm


# -- what the autocast oracle measures (read by the inspection modules) ----------------------------

# Ops that move or alias data without computing: the oracle records them as neither ops nor
# casts, and the comparison leaves them out.
STRUCTURAL_OPS = frozenset(
    {
        "aten._to_copy",
        "aten.detach",
        "aten.alias",
        "aten.lift_fresh",
        "aten.lift_fresh_copy",
        "aten.empty",
        "aten.copy",
        "prim.device",
        "aten.empty_strided",
    }
)


@dataclass
class OracleOp:
    op: str
    module: str
    dtype: torch.dtype | None  # the floating dtype it computed in (output, else first input)


@dataclass
class AutocastTrace:
    """torch.autocast's decisions on the same forward, measured with a dispatch mode."""

    device_type: str
    dtype: torch.dtype
    ops: list[OracleOp]
    casts: int
    cast_ops: list[OracleOp] = field(default_factory=list)

    @property
    def ops_low(self) -> int:
        return sum(op.dtype == self.dtype for op in self.ops)


# -- what users may read about the compiled steps (Graph.compiled_steps) --------------------------


@dataclass(frozen=True)
class CompiledStep:
    """A read-only view of one compiled step of a Graph.

    ``forward_graph`` and ``step_graph`` are the FX graph modules themselves: read them (nodes,
    ``.code``, ``node.meta``), do not edit them.
    """

    signature: str  # the input signature it was built for, e.g. "128x256 float32, 128 int64"
    dynamic: tuple[tuple[int, int], ...]  # (tensor argument, dimension) pairs it serves any size of
    training: bool
    amp_dtype: torch.dtype | None  # None when AMP is off
    backend: str
    cuda_graph: bool  # replayed as a CUDA graph
    timings: Mapping[str, float]  # seconds per stage of the build
    forward_nodes: int  # nodes of the forward after the AMP passes
    step_nodes: int  # nodes of the whole compiled step
    calls: int  # how many times it ran (when the view was taken)
    # the step the cost model chose is compiled beside training and takes over this one when
    # ready (pipeline/tier_up.py); the view shows the step that runs now
    taking_over: bool
    forward_graph: fx.GraphModule
    step: DeferredGraph = field(repr=False)  # read through ``step_graph``

    @property
    def step_graph(self) -> fx.GraphModule:
        """The whole step's graph module (a restart's step is loaded from the step cache at
        this first read)."""
        return self.step.gm

    @classmethod
    def of(cls, program: Program) -> CompiledStep:
        return cls(
            signature=program.signature.describe(program.dynamic),
            dynamic=tuple(sorted(program.dynamic)),
            training=program.plan.training,
            amp_dtype=program.amp.dtype if program.amp is not None else None,
            backend=program.spec.config.backend,
            cuda_graph=program.runner.uses_cuda_graph,
            timings=dict(program.timings),
            forward_nodes=len(program.forward.graph.nodes),
            step_nodes=program.step.nodes,
            calls=program.runner.calls,
            taking_over=program.tier_up is not None,
            forward_graph=program.forward,
            step=program.step,
        )
