"""One call of a Graph: find its compiled step (built by the pipeline on a miss), and run it
as a transaction.

A Graph owns one ``GraphRuntime``: what its calls share besides the compiled steps' own runners
(the cache of Programs, the structure key, the graph's own state, the scaler, autofix). Its
containers are the Graph's own (registered modules, optimizer slots, config), so what the user
registers or sets is what the next call sees. ``call`` is the one function a call enters in
``runtime/``; on a miss ``_build`` hands a GraphSpec (``graph_spec``) to
``pipeline.build_program`` and keeps the Program it returns; ``run_step`` owns a step. Nothing
here calls back into the Graph.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn as nn

from ..errors import CaptureError, RankFailedError
from ..forensics.autofix import Autofix
from ..inspect.report import log_program_summary
from ..pipeline import build_program
from ..records.guards import AttributeRead, BuildRequest, Change, is_float_number, liftable
from ..records.inputs import (
    FlatInputs,
    changed_floats,
    check_arity,
    flatten_inputs,
    lift_numbers,
    lifted_tensor_indices,
)
from ..records.spec import GraphSpec, OptimizerSlot, Program
from ..records.state import SharedState
from ..torchkit import dispatch_state
from ..torchkit.frame_stack import on_roomy_stack
from ..torchkit.rank_store import raise_if_a_peer_failed
from . import ambient, interrupts, schedulers
from .lifting import Lifting
from .overflows import read_overflows, watch_overflows
from .programs import Key, ProgramCache, marked_dynamic, precision_differences
from .structure_key import (
    StructureKey,
    log_pinned,
    log_rebuild,
    numbers_baked_in,
    warn_about_numbers,
)

if TYPE_CHECKING:  # the user's objects, held and called, never constructed here
    from ..config import GraphConfig
    from ..scaler import GradScaler

log = logging.getLogger("graphamp")


@dataclass(eq=False)
class GraphRuntime:
    """What a Graph's calls read and write (see the module docstring)."""

    name: str  # the Graph subclass's name: every message starts with it
    modules: dict[str, nn.Module]  # the Graph's registered modules (the same dict)
    optimizers: list[OptimizerSlot]  # the Graph's add_optimizer slots (the same list)
    config: GraphConfig  # the Graph's config: snapshot() at every call; autofix settings
    state: SharedState  # step count, optimizer step counters, history
    build: Callable[..., Any]  # the Graph's bound build(): its signature names the inputs
    owner: Any = None  # the Graph: build() reads its attributes as settings (GraphSpec.owner)
    own_attributes: frozenset[str] = frozenset()  # the Graph's attributes that are graphamp's
    programs: ProgramCache = field(default_factory=ProgramCache)
    structure: StructureKey = field(default_factory=StructureKey)
    autofix: Autofix = field(default_factory=Autofix)
    scaler: GradScaler | None = None  # set_grad_scaler's (disabled ones included)
    debug_level: int = 0
    warned_numbers: bool = False  # the baked-in numbers warning is given once
    # Python floats that changed between calls, traced as step inputs from then on
    # (lifting.py): those build() reads, by place, and g(...)'s float arguments, by position
    read_lifting: Lifting = field(default_factory=Lifting)
    arg_lifting: Lifting = field(default_factory=Lifting)
    # (position, device) -> the 0-dim float32 tensor a lifted argument is filled into at each
    # call: a fill on the device, where a new tensor would copy from the host (a sync on a GPU)
    arg_holders: dict[tuple[int, torch.device], torch.Tensor] = field(default_factory=dict)


def graph_spec(run: GraphRuntime) -> GraphSpec:
    """What the pipeline may read of the Graph, as of now."""
    scaler = run.scaler
    return GraphSpec(
        name=run.name,
        modules=tuple(run.modules.items()),
        build=run.build,
        optimizers=tuple(run.optimizers),
        scaler=scaler if scaler is not None and scaler.enabled else None,
        config=run.config.snapshot(),
        history_capacity=run.state.history.capacity,
        debug_level=run.debug_level,
        progress=run.config.progress,
        keep_cpu_memory=run.config.keep_cpu_memory,
        owner=run.owner,
        own_attributes=run.own_attributes,
    )


# the name of the Graph whose build() this thread is capturing (a Graph called inside another's
# build() is refused: Graph.__call__ reads it)
_building = threading.local()


def building_graph() -> str | None:
    """The Graph whose step this thread is building, or None."""
    return getattr(_building, "name", None)


def call(run: GraphRuntime, args: tuple, kwargs: dict) -> Any:
    """``g(*args, **kwargs)``: the compiled step for these inputs (built through the pipeline
    on a miss), run as one step; build()'s return value with this step's tensors."""
    neutral = ambient.neutral_modes()  # an ambient autocast or inference mode
    entry = dispatch_state.snapshot()
    try:
        if neutral is None:
            out = _call(run, args, kwargs)
        else:
            with neutral:
                out = _call(run, args, kwargs)
    except BaseException as e:
        _restore_dispatch_state(entry, e)
        link = run.state.rank_link
        if link is not None and not isinstance(e, RankFailedError):
            # data parallel: peers left in this step's collectives can say why
            link.publish_failure(run.state.step_count + 1, e)
        raise
    if run.state.rank_link is not None:
        run.state.rank_link.clear_failure()
    return out


def _restore_dispatch_state(entry: dispatch_state.DispatchState, error: BaseException) -> None:
    """torch's dispatch state as at the call's entry, where an interrupt left it half set
    (``torchkit/dispatch_state.py``): the process goes on working after a Ctrl-C."""
    repaired = dispatch_state.restore(entry)
    if repaired:
        log.warning(
            "%s during this call left torch's dispatch state changed; put back as it was: %s",
            type(error).__name__, ", ".join(repaired),
        )  # fmt: skip


def _call(run: GraphRuntime, args: tuple, kwargs: dict) -> Any:
    inputs = _lifted_inputs(run, args, kwargs)
    key = _key(run, inputs)
    program = run.programs.find(key, inputs)
    if program is None:
        program, inputs = _build_lifting(run, args, kwargs, inputs, key)
    if program.tier_up is not None:  # the chosen step compiled beside: started, or taken over
        program.tier_up.on_call(program)
    outputs = run_step(run, program, inputs)
    return program.captured.unflatten_outputs(outputs, program.runner.fed)


def _lifted_inputs(run: GraphRuntime, args: tuple, kwargs: dict) -> FlatInputs:
    """The call's inputs, its float arguments at lifted positions as 0-dim tensors."""
    inputs = flatten_inputs(args, kwargs)
    if not run.arg_lifting.lifted:
        return inputs
    device = _value_device(run, inputs)

    def holder(position: int, value: float) -> torch.Tensor:
        held = run.arg_holders.get((position, device))
        if held is None:
            held = torch.empty((), dtype=torch.float32, device=device)
            run.arg_holders[(position, device)] = held
        return held.fill_(value)

    args, kwargs = lift_numbers(args, kwargs, frozenset(run.arg_lifting.lifted), holder)
    return flatten_inputs(args, kwargs)


def _build_lifting(
    run: GraphRuntime, args: tuple, kwargs: dict, inputs: FlatInputs, key: tuple
) -> tuple[Program, FlatInputs]:
    """``_build``, after lifting the float arguments whose change caused it (``lifting.py``):
    from then on each is a step input, a 0-dim float32 tensor, as a changed float that
    build() reads is. If build() needs one as a Python number, capture fails and the ones
    lifted since the last step that built are baked in again, for good. Returns the program
    and the inputs it runs on."""
    lifting = run.arg_lifting
    changed: set[int] = set()
    for program in run.programs.values():
        if program.guards is not None:
            changed |= changed_floats(program.guards.signature, inputs.signature)
    new = [i for i in sorted(changed) if lifting.lift(i)]
    if new:
        names = inputs.leaf_names(run.build)
        log.info(
            "%s: the float argument(s) %s of g(...) changed between calls: from now on the step "
            "takes them as inputs (0-dim float32 tensors), so a new value compiles nothing",
            run.name,
            ", ".join(names[i][0] for i in new),
        )
        inputs = _lifted_inputs(run, args, kwargs)
        key = _key(run, inputs)
        found = run.programs.find(key, inputs)
        if found is not None:
            return found, inputs
    try:
        program = _build(run, inputs, key)
    except CaptureError as e:
        if not lifting.unproven():
            raise
        blamed = lifting.blame(_named_arguments(e, inputs.leaf_names(run.build), lifting))
        log.info(
            "%s: capturing with float argument(s) %s as step inputs failed (%s): build() needs "
            "them as Python numbers, so each new value compiles a step of its own",
            run.name,
            ", ".join(sorted(inputs.leaf_names(run.build)[i][0] for i in blamed)),
            str(e).splitlines()[0][:200],
        )
        inputs = _lifted_inputs(run, args, kwargs)
        key = _key(run, inputs)
        return run.programs.find(key, inputs) or _build(run, inputs, key), inputs
    lifting.built()
    return program, inputs


def _named_arguments(e: CaptureError, names: list[tuple[str, bool]], lifting: Lifting) -> set:
    """The lifted float arguments a failed capture names as needed as Python numbers (a
    slope and a weight changed together: the slope alone is baked in)."""
    needed = set(getattr(e, "needs_numbers", ()))
    return {i for i in lifting.unproven() if f"argument {names[i][0]}" in needed}


def _value_device(run: GraphRuntime, inputs: FlatInputs) -> torch.device:
    """Where the step's lifted values live: its inputs' device, else its parameters'."""
    for t in inputs.tensors:
        return t.device
    for module in run.modules.values():
        for p in module.parameters():
            return p.device
    return torch.device("cpu")


def _build(run: GraphRuntime, inputs: FlatInputs, key: tuple) -> Program:
    """No cached step serves this call: say why, choose the dimensions to make symbolic, build
    one (the Graph's pipeline) and keep it."""
    check_arity(run.build, inputs.args, inputs.kwargs, run.name)
    names = inputs.names(run.build)
    change = run.programs.why_rebuilt(key, inputs, names)
    config = run.config
    marked = marked_dynamic(inputs.tensors)
    dynamic = run.programs.dynamic_dims(key, marked, config.dynamic_shapes)
    log_rebuild(run.name, change, dynamic, run.programs.family_dynamic(key), names)
    baked = numbers_baked_in(run.programs.values(), inputs, run.build)
    if baked is not None and not run.warned_numbers:
        run.warned_numbers = True
        warn_about_numbers(run.name, *baked)
    why = (change.subject, change.words) if change is not None else ("first call", "first call")
    run.programs.count_build(run.name, key[1], why, config.recompile_limit)
    sibling = run.programs.family_member(key)
    lifted_args = frozenset(run.arg_lifting.lifted)
    lifted_inputs = lifted_tensor_indices(inputs.args, inputs.kwargs, lifted_args)
    request = BuildRequest(key[1], dynamic, _lifted(run, change), lifted_inputs)
    program = _compile(run, inputs, request)
    log_pinned(run.name, program, names)
    # the build may have changed the user's objects (capture settled build()'s first-call
    # state; a step component's prepare_model made the parameters shards): the program is kept
    # under the objects' new structure, which the next call sees
    key, program = _settled(run, inputs, program)
    if sibling is not None and program.amp is not None and sibling.amp is not None:
        differ = precision_differences(sibling, program)
        if differ:
            log.info(
                "%s: the new step's precision decisions differ from the step for %s, which "
                "should not happen (sizes must not decide precision): %s",
                run.name,
                sibling.signature.describe(sibling.dynamic),
                "; ".join(differ[:5]),
            )
    for dropped in run.programs.keep(key, program, config.max_cached_graphs):
        read_overflows(run, dropped)  # its device record goes with it
        log.info(
            "%s: dropped the least recently used compiled step (cache holds %d)",
            run.name,
            config.max_cached_graphs,
        )
    return program


def _lifted(run: GraphRuntime, change: Change | None) -> tuple[AttributeRead, ...]:
    """The Python floats to trace as inputs: the ones lifted before, and those whose change
    caused this build (``lifting.py``): every float the call changed, so two floats a loop
    anneals together compile once more, not once each."""
    changed = (change.read, *change.also) if change is not None and change.read else ()
    for read in changed:
        if liftable(read) and run.read_lifting.lift(read.place(), read):
            log.info(
                "%s: %s changed between calls: from now on the step takes it as an input (a "
                "0-dim float32 tensor), so a new value compiles nothing",
                run.name,
                read.label,
            )
    return tuple(r for r in run.read_lifting.lifted.values() if is_float_number(r.current()))


def _pipeline(run: GraphRuntime, inputs: FlatInputs, request: BuildRequest) -> Program:
    """``pipeline.build_program`` for this call, under the modes a capture runs in."""
    _building.name = run.name
    try:
        with ambient.capture_modes():
            program = on_roomy_stack(build_program, graph_spec(run), inputs, run.state, request)
    finally:
        _building.name = None
    log_program_summary(program)
    return program


def _compile(run: GraphRuntime, inputs: FlatInputs, request: BuildRequest) -> Program:
    """The pipeline; a capture that fails with values lifted (build() uses one as a Python
    number: a branch, a size, an argument that must be a float) is tried again with the ones
    no earlier build took as inputs baked in (``lifting.py``), and they stay baked in."""
    lifting = run.read_lifting
    try:
        program = _pipeline(run, inputs, request)
    except CaptureError as e:
        if not request.lifted:
            raise
        reads = dict(lifting.lifted)
        named = {p for p, r in reads.items() if r.label in getattr(e, "needs_numbers", ())}
        unproven = [p for p in reads if p in lifting.unproven()]
        if not named and len(unproven) > 1:
            # several floats lifted at once and the failure names none of them: try them one
            # at a time, the first alone; the others are baked in until they change again
            lifting.withdraw(set(unproven[1:]))
            kept = tuple(r for r in request.lifted if r.place() not in unproven[1:])
            return _compile(run, inputs, dataclasses.replace(request, lifted=kept))
        blamed = {place: reads[place] for place in lifting.blame(named)}
        kept = tuple(r for r in request.lifted if r.place() not in blamed)
        if len(kept) == len(request.lifted):  # none of this build's was blamed: not theirs
            raise
        log.info(
            "%s: capturing with %s as a step input failed (%s): build() needs it as a Python "
            "number, so each new value compiles a step of its own",
            run.name,
            ", ".join(read.label for read in blamed.values()),
            str(e).splitlines()[0][:200],
        )
        return _compile(run, inputs, dataclasses.replace(request, lifted=kept))
    lifting.built()
    return program


def _key(run: GraphRuntime, inputs: FlatInputs) -> Key:
    """The (signature, structure) of a call with ``inputs``, as the Graph's objects are now."""
    structure = run.structure(
        run.modules, run.optimizers, run.config.snapshot(), run.scaler, ambient.mode_key()
    )
    return (inputs.signature, structure)


def _settled(run: GraphRuntime, inputs: FlatInputs, program: Program) -> tuple[Key, Program]:
    """The build left the user's objects as the calls to come see them (build() set up state
    on its first call, hooks or caches, ``capture/steady_state.py``; a step component
    sharded the parameters): the program is kept under, and assumes, their structure now, or
    the next call would not find it."""
    key = _key(run, inputs)
    if program.guards is None:
        return key, program
    guards = dataclasses.replace(program.guards, structure=key[1])
    return key, dataclasses.replace(program, guards=guards)


def run_step(run: GraphRuntime, program: Program, inputs: FlatInputs) -> list[torch.Tensor]:
    """One step as a transaction: whatever raises, parameters, optimizer state, scaler,
    counters, history and schedulers are all from before the step or all from after it.

    The step's inputs (this step's learning rates included) are gathered first. Then, with
    Ctrl-C held back (``interrupts.py``): the schedulers step (snapshotted first), the
    bookkeeping is recorded, and the compiled step runs, last, as the one thing that cannot be
    undone. If anything before it fails, the rest is undone. With overflow tracing the compiled
    step writes its overflow record on the device with the rest of the state; what the host then
    reads of it (``watch_overflows``) happens after the step is committed, still with Ctrl-C
    held, so the host's list of overflows and the device count it has read up to move together.
    """
    runner = program.runner
    flat = runner.gather(inputs.tensors)
    stepping = [s.lr_sch for s in run.optimizers if s.lr_sch is not None]
    # an optimizer whose own step() runs after the compiled step reads its lr then: the
    # schedulers step after it, as in eager's loop; otherwise before the step, so that the
    # compiled step is the last thing that happens (this step's lr is already gathered)
    early = stepping if not program.plan.eager_outputs else []
    saved = [schedulers.snapshot(sch) for sch in early]
    undo = None
    held = interrupts.hold_interrupts()
    try:
        try:
            for sch in early:
                sch.step()  # sets the next step's lr; this step's is already gathered
            undo = runner.record_step()
            run.state.step_count += 1
            outputs = runner.execute(flat)
        except BaseException as e:
            if undo is not None:
                undo()
                run.state.step_count -= 1
            for snapshot in saved:
                schedulers.restore(snapshot)
            if run.state.rank_link is not None and isinstance(e, Exception):
                raise_if_a_peer_failed(run.name, run.state.rank_link, e)
            raise
        # committed: from here on nothing undoes the step. An optimizer's own step() that
        # raises leaves its parameters as it left them, as in eager
        runner.step_eagerly(outputs, lambda: runner.run_again(inputs.tensors))
        if not early:
            for sch in stepping:
                sch.step()
        if runner.forensics is not None:
            watch_overflows(run, program)
    finally:
        if held:
            interrupts.release_interrupts()  # a Ctrl-C that arrived meanwhile is raised here
    return outputs
