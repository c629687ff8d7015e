"""One build, start to end: the stages in order, as straight-line code.

    GraphSpec + inputs ─capture─▶ Captured ─amp_passes─▶ Passed ─plan─▶ StepPlan
      ─examples─▶ example inputs ─(choices)─▶ step_cache ─▶ StepGraph loaded, or
      assemble ─▶ [rewrites: recompute] ─▶ outline ─▶ [rewrites: place_collectives]
      ─▶ save_step
      ─compile─▶ Runner ─▶ Program

``_Stages`` runs each one: it times it, logs its INFO line and turns whatever torch raised into
graphamp's error for that stage (``stage_errors.py``): the one place a failure is worded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Iterator, TypeVar, cast

from ..backend import distributed
from ..backend.compile import views_as_reshapes
from ..backend.progress import log_stage
from ..capture import BuildRoot, autocast_forward, refuse_sparse_tensors
from ..records.guards import BuildRequest, Guards, StateSize
from ..records.inputs import FlatInputs
from ..records.spec import AutocastTrace, GraphSpec, Program, StepPlan
from ..records.stage_names import Stage
from ..records.state import SharedState
from ..sharding.fsdp_adopt import adopt_at_first_build
from ..step import (
    StepComponent,
    count_block_updates,
    prepare_model_for_components,
    step_rewrites,
)
from ..torchkit.rank_store import RankLink
from ..torchkit.shapes import fake_batch, new_fake_mode, shape_guard
from . import stages
from .stage_errors import PASS_THROUGH, stage_error
from .stages import BuildContext, Captured, Passed, StepGraph, nodes
from .tier_up import Later, Made, TierUp, step_request

log = logging.getLogger("graphamp")

T = TypeVar("T")


def build_program(
    spec: GraphSpec, inputs: FlatInputs, state: SharedState, request: BuildRequest
) -> Program:
    """Every stage, in order, for one input signature (``request.dynamic``: the batch
    dimensions traced as symbols; the program then serves every size its guards admit).

    Whatever a stage raises reaches the user as a graphamp error naming the stage, the user's
    line where the failure has one, and what to try; torch's exception is its ``__cause__``.
    graphamp's own errors, Ctrl-C and out-of-memory errors pass through as they are. Python
    state capture settled on the user's objects (``capture/steady_state.py``) is put back on
    any failure."""
    with _one_build_at_a_time(spec.name):
        # a fully_shard wrap, accepted at registration, checked and taken over (once)
        adopt_at_first_build(spec.name, spec.modules, spec.config)
        root = BuildRoot(spec.modules, spec.build, spec.owner, spec.own_attributes)
        refuse_sparse_tensors(spec.name, root, inputs)  # before anything fakes them
        fake_mode = new_fake_mode()
        ctx = BuildContext(
            spec=spec,
            inputs=inputs,
            state=state,
            request=request,
            fake_mode=fake_mode,
            batch=inputs.with_tensors(fake_batch(fake_mode, inputs.tensors, request.dynamic)),
            root=root,
        )
        if not spec.config.data_parallel:
            return _build(ctx)
        return _build_on_every_rank(ctx)


def _build_on_every_rank(ctx: BuildContext) -> Program:
    """Data parallel: the model's state broadcast from rank 0 once, then every rank builds and
    all agree that they built the same step (``backend/distributed.py``)."""
    spec, stages_ = ctx.spec, _Stages(ctx.spec)
    group = stages_.worded(Stage.CAPTURE, distributed.process_group, spec.name, spec.config)
    if ctx.state.rank_link is None:
        ctx.state.rank_link = RankLink.open(spec.name, group)
    link = ctx.state.rank_link
    if not ctx.state.broadcast_done:
        stages_.worded(Stage.CAPTURE, distributed.broadcast_state, spec.name, ctx.root, group, link)
        ctx.state.broadcast_done = True
    # the components' changes to how the model holds its state, on every rank before capture
    stages_.worded(Stage.CAPTURE, prepare_model_for_components, spec, ctx.root, group)
    ctx = dataclasses.replace(ctx, process_group=group)
    return distributed.build_on_every_rank(
        spec.name,
        link,
        lambda: _build(ctx),
        lambda p: distributed.fingerprint(p.step_gm, p.plan.layout.names),
    )


def _build(ctx: BuildContext) -> Program:
    run = _Stages(ctx.spec)
    captured = run(
        Stage.CAPTURE, stages.capture, ctx, describe=lambda c: f"{nodes(c.forward.gm)} nodes"
    )
    ctx = stages.on_traced_batch(ctx, captured)
    try:
        return _build_after_capture(ctx, run, captured)
    except BaseException:
        if captured.forward.undo_writes is not None:
            captured.forward.undo_writes()
        raise


def _build_after_capture(ctx: BuildContext, run: _Stages, captured: Captured) -> Program:
    capture_seconds = run.timings[Stage.CAPTURE.value]
    passed = run(
        Stage.AMP_PASSES, stages.amp_passes, ctx, captured, capture_seconds, describe=_passes
    )
    plan = run(Stage.PLAN, stages.plan, ctx, captured, passed)
    example = run(Stage.EXAMPLES, stages.examples, ctx, plan, captured.device)
    step = _step_graph(ctx, run, captured, passed, plan, example)
    try:
        compiled = run(
            Stage.COMPILE,
            stages.compile,
            ctx,
            plan,
            step,
            example,
            captured.device,
            describe=lambda c: c.detail,
        )
    finally:
        if step.side is not None:  # done with, or left by a failed compile
            step.side.stop()
    return Program(
        spec=ctx.spec,
        signature=ctx.inputs.signature,
        captured=captured.forward,
        forward=passed.forward,
        amp=passed.amp,
        plan=plan,
        step=step.graph,
        runner=compiled.runner,
        device=captured.device,
        timings=dict(run.timings),
        pass_records=passed.records,
        example_inputs=ctx.inputs.as_meta(),
        guards=_guards(ctx, captured),
        tier_up=step.tier_up,
    )


def _step_graph(
    ctx: BuildContext,
    run: _Stages,
    captured: Captured,
    passed: Passed,
    plan: StepPlan,
    example: list,
) -> StepGraph:
    """The whole step as one graph: loaded from the step cache, or assembled (recomputed,
    outlined) and saved, as ``stages.choose`` decided once. Where the chosen step compiles
    slowly and is not noted yet, the step that compiles fastest, carrying the chosen one to
    take over later (``tier_up.py``; it keeps this build's context until then)."""
    choices = stages.choose(ctx, captured, plan)
    first = stages.first_choices(ctx, plan, choices, captured.device)
    later = None
    if first is not None:  # the chosen step noted by an earlier run, or compiled beside later
        what = (ctx, captured, passed, plan, example, choices)
        found = run(Stage.STEP_CACHE, stages.look_up, *what, describe=lambda f: f.note)
        if found.step is not None:
            return found.step
        if found.key is not None:
            later = _later(ctx, passed, plan, example, choices, found.key)
            choices = first
    key = None
    if choices.cache:
        what = (ctx, captured, passed, plan, example, choices)
        found = run(Stage.STEP_CACHE, stages.look_up, *what, describe=lambda f: f.note)
        if found.step is not None:
            return _then(found.step, ctx, later)
        key = found.key
    # the blocks' kernels compiled beside the step: the child imports torch while this assembles
    side = stages.side_compile(ctx, choices, captured.device) if key is not None else None
    try:
        step = _assembled_step(ctx, run, passed, plan, example, choices)
        if key is not None:
            run(Stage.SAVE_STEP, stages.save_step, ctx, key, step, describe=str)
            # saved or not: compile notes its key under it
            step = dataclasses.replace(step, key=key, side=side)
    except BaseException:
        if side is not None:
            side.stop()
        raise
    return _then(step, ctx, later)


def _then(step: StepGraph, ctx: BuildContext, later: Later | None) -> StepGraph:
    """``step``, with the chosen step to take over from it later, if any (``tier_up.py``)."""
    if later is None:
        return step
    return dataclasses.replace(step, tier_up=TierUp(ctx.spec.name, later))


def _later(
    ctx: BuildContext,
    passed: Passed,
    plan: StepPlan,
    example: list,
    choices: stages.Choices,
    key: str,
) -> Later:
    """How the step of ``choices`` is assembled and saved under ``key``, and made from the
    note the child writes, after this build (``tier_up.py``)."""

    def prepare() -> bool:
        with _one_build_at_a_time(ctx.spec.name):
            env = ctx.fake_mode.shape_env
            assumed = len(env.guards) if env is not None else 0
            run = _Stages(ctx.spec)
            step = _assembled_step(ctx, run, passed, plan, example, choices)
            if env is not None and len(env.guards) != assumed:
                # the program's guards were made before: they would not check these
                raise ValueError("its assembly assumed more of the batch's sizes than the step")
            return run(Stage.SAVE_STEP, stages.save_step, ctx, key, step, describe=str) == "saved"

    def make() -> Made:
        with _one_build_at_a_time(ctx.spec.name):
            return stages.made_from_note(ctx, key, example)

    config = ctx.spec.config
    request = step_request(
        ctx.spec.name,
        key,
        example,
        ctx.inputs.tensors,
        ctx.request.dynamic,
        dict(config.inductor_options),
    )
    words = "inlined step" if not choices.outline else "step without block updates"
    return Later(prepare, make, request, words)


def _assembled_step(
    ctx: BuildContext,
    run: _Stages,
    passed: Passed,
    plan: StepPlan,
    example: list,
    choices: stages.Choices,
) -> StepGraph:
    """Assembled, recomputed, outlined, as the backend takes it."""
    step = run(Stage.ASSEMBLE, stages.assemble, plan, passed, example, choices, describe=_assembled)
    # the components' rewrites, each at its stage: before outlining (activation checkpointing's
    # copies are outlined with their block) or after it (a rewrite that sees outlining's calls)
    rewrites = step_rewrites(plan)
    step = _rewritten(run, plan, step, [c for c in rewrites if c.rewrites_before_outlining])
    if choices.outline:
        step = run(Stage.OUTLINE, stages.outline, step, describe=_outline_line)
    step = _rewritten(run, plan, step, [c for c in rewrites if not c.rewrites_before_outlining])
    # as the backend takes it (eager: as traced), so that a step loaded later needs no change
    if ctx.spec.config.backend != "eager":
        views_as_reshapes(step.gm)
    return step


class _Stages:
    """Runs one stage: its seconds timed, its INFO line logged, what it raises worded."""

    def __init__(self, spec: GraphSpec) -> None:
        self.spec = spec
        self.timings: dict[str, float] = {}

    def run(
        self,
        name: Stage,
        fn: Callable[..., T],
        *args: Any,
        describe: Callable[[T], str] | None = None,
    ) -> T:
        start = time.perf_counter()
        result = self.worded(name, fn, *args)
        # plain strings: timings are user-facing (CompiledStep.timings) and saved with torch.save
        self.timings[name.value] = seconds = time.perf_counter() - start
        log_stage(self.spec.name, name, seconds, describe(result) if describe else "")
        return result

    def worded(self, name: Stage, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, what it raises worded as stage ``name``'s failure (the one place)."""
        try:
            return fn(*args)
        except PASS_THROUGH:
            raise
        except Exception as e:  # every other failure becomes graphamp's, worded for the stage
            raise stage_error(self.spec, name, e) from e

    __call__ = run


def _passes(passed: Passed) -> str:
    amp = passed.amp
    casts = f"{amp.stats.get('casts', 0)} casts" if amp is not None else "AMP off"
    return f"{nodes(passed.forward)} nodes, {casts}"


def _rewritten(
    run: _Stages, plan: StepPlan, step: StepGraph, components: list[StepComponent]
) -> StepGraph:
    """``step`` after each of ``components``' rewrites, each run as its stage."""
    for c in components:
        step, _ = run(cast(Stage, c.rewrite_stage), stages.rewrite, c, plan, step, describe=_words)
    return step


def _words(rewritten: tuple[StepGraph, str]) -> str:
    return rewritten[1]


def _size(step: StepGraph) -> str:
    return f"{nodes(step.gm)} nodes"


def _assembled(step: StepGraph) -> str:
    calls, kernels = count_block_updates(step.gm)
    if not calls:
        return _size(step)
    return f"{_size(step)}; the update of {calls} blocks by {kernels} kernel{'s' * (kernels > 1)}"


def _outline_line(step: StepGraph) -> str:
    o = step.outline
    if o is None:  # the outline stage always sets it; a step without it: its size
        return _size(step)
    text = f"{nodes(step.gm)} nodes, {o.blocks} blocks, {o.distinct} distinct regions"
    text += f", {o.outlined} regions outlined"
    if o.saves.recomputed:
        text += (
            f"; backwards recompute {o.saves.recomputed} cheap values, the forwards store "
            f"{o.saves.after / 2**20:.1f} MiB instead of {o.saves.before / 2**20:.1f}"
        )
    if o.left_inline:
        text += f"; inline: {', '.join(o.left_inline[:4])}" + (
            " ..." if len(o.left_inline) > 4 else ""
        )
    return text


def _guards(ctx: BuildContext, captured: Captured) -> Guards:
    """What the program assumes (``records.guards``): the structure it was built for, the
    batch's shapes (the ShapeEnv's guards where dimensions are symbolic), the attributes build()
    read, the parameters' and buffers' sizes."""
    modules = dict(ctx.root.named_modules())
    sizes = []
    for kind, named in (
        ("_parameters", ctx.root.named_parameters()),
        ("_buffers", ctx.root.named_buffers()),
    ):
        for name, tensor in named:
            owner, _, attr = name.rpartition(".")
            namespace = getattr(modules[owner], kind)
            sizes.append(StateSize(f"self.{name}", namespace, attr, tensor.shape))
    return Guards(
        structure=ctx.request.structure,
        signature=ctx.inputs.signature,
        shapes=shape_guard(ctx.fake_mode, ctx.batch.tensors, ctx.request.dynamic),
        attributes=captured.forward.attribute_reads,
        state_sizes=tuple(sizes),
        lifted=captured.forward.lifted,
    )


# torch's tracing (make_fx, fake tensors, the backends' compilers) keeps process-wide state,
# and capture installs process-wide hooks and patches: two builds in two threads would trip
# over each other's. Builds take turns (steady calls, which trace nothing, do not wait).
_BUILD_LOCK = threading.RLock()


@contextlib.contextmanager
def _one_build_at_a_time(name: str) -> Iterator[None]:
    if not _BUILD_LOCK.acquire(blocking=False):
        log.info("%s: waiting for another Graph's capture and compile to finish", name)
        _BUILD_LOCK.acquire()
    try:
        yield
    finally:
        _BUILD_LOCK.release()


def trace_autocast(program: Program) -> AutocastTrace:
    """What torch.autocast does on the program's forward (the precision report's oracle)."""
    spec = program.spec
    root = BuildRoot(spec.modules, spec.build, spec.owner, spec.own_attributes)
    amp, example = program.amp, program.example_inputs
    if amp is None or example is None:
        raise ValueError("trace_autocast needs a program built with AMP")
    with _one_build_at_a_time(spec.name):
        return _Stages(spec).worded(
            Stage.CAPTURE, autocast_forward, root, example, amp.dtype, program.device
        )
