"""Stage 4, assemble: the AMP-rewritten forward traced again inside one functional training step.

    [START] parameter casts → forward → loss × scale → grads (autograd) → [GRADIENTS] →
    per optimizer [OPTIMIZER_GRADIENTS] → [OVERFLOW] → per optimizer [BEFORE_UPDATE] masked
    update [AFTER_UPDATE] → [SKIP] → [RECORD] → [FINISH] → BatchNorm statistics masked

The step's core is the forward and gradients (``gradients.py``) and each optimizer's update
(``optimizer_update.py``); at each bracketed phase the plan's components add their part
(``components/__init__.COMPONENTS``), in their registered order. The whole step becomes one
FX graph (make_fx over Python functionalization, fake tensors). Its inputs are the state tensors
and the batch (``plan.layout``); it writes every state tensor in place (``copy_`` into its
inputs, which the compiler keeps in place) and returns build()'s tensors (then, for an optimizer
whose own step() runs after it, its gradients: ``_eager_outputs``). Every node carries its
``records.subgraphs.Subgraph`` tag (recompute's, added after tracing by ``recompute.py``).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback

from ..records.frames import SOURCE_LINE_META
from ..records.layouts import StepInputs
from ..records.spec import StepPlan
from ..records.subgraphs import Subgraph
from ..torchkit.fxutil import NodeTagger, graph_modules, rename_placeholders, trace_functional
from ..torchkit.update_region import UPDATE_TAG
from .block_update import pass_gradients_uncast
from .components import OptimizerUpdate, Phase, StepComponent, StepContext, active_components
from .gradients import forward_and_gradients, parameter_casts, run_forward
from .optimizer_update import densify_sparse_grads, update_optimizer
from .traced_optimizer import tensorify_scalar_reads
from .update_math import masked


def assemble_step(
    plan: StepPlan,
    fwd_gm: fx.GraphModule,
    example: list[torch.Tensor],
    record_origins: bool = False,
    block_updates: int = 0,
) -> fx.GraphModule:
    """Trace the step into one FX graph over fake copies of ``example`` (nothing runs).

    ``record_origins``: every backward node also carries the autograd ``seq_nr`` of the forward
    op it differentiates (what ``outline.py`` finds a block's backward by). ``block_updates``:
    where at least this many equal blocks repeat, each one's parameters are updated by one
    kernel compiled once per distinct block (``block_update.py``); 0: the update inline."""
    step = make_step_function(plan, fwd_gm, record_origins, block_updates)
    # a failure here (a custom Function's backward, a bug) becomes a graphamp error, naming the
    # user's line, where the pipeline runs the stage (pipeline/build.py)
    with fx_traceback.preserve_node_meta() if record_origins else nullcontext():
        gm = trace_functional(step, example, propagate_input_mutations=True)
    rename_placeholders(gm, plan.layout.names)
    if any(o.path.traced for o in plan.optimizers):
        tensorify_scalar_reads(gm)
    if block_updates:
        pass_gradients_uncast(gm)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    _drop_source_lines(gm)
    # make_fx leaves its tracer class on the module and its graph; only copy.deepcopy reads
    # it. A step loaded from the step cache has none (the cache's unpickler builds no tracer),
    # and AOTAutograd's cache key hashes the module's attributes: with it, a restart that
    # loaded a step outlining had not copied missed that cache and traced the step again
    gm._tracer_cls = gm.graph._tracer_cls = None
    gm.recompile()
    return gm


def _drop_source_lines(gm: fx.GraphModule) -> None:
    """The step keeps no record of where its nodes were traced in the user's files. The step
    cache's key leaves them out (an edit that only moves lines is the same step), so a step
    loaded from it could only show stale ones; without them the assembled and the loaded step
    are one code, which AOTAutograd's cache key hashes (FX writes stack traces into the code as
    comments). The precision and overflow reports read the forward and the plan, made afresh
    by every build."""
    for module in graph_modules(gm):
        for node in module.graph.nodes:
            for key in SOURCE_LINE_META:
                node.meta.pop(key, None)
        if module is not gm:  # the step itself is recompiled below
            module.recompile()


def make_step_function(
    plan: StepPlan,
    fwd_gm: fx.GraphModule,
    record_origins: bool = False,
    block_updates: int = 0,
):
    """The functional step over the flat inputs of ``plan.layout``: the forward and gradients,
    each optimizer's update, and the plan's components at their phases (``components/``)."""
    components = active_components(plan)

    def run(phase: Phase, ctx: StepContext) -> None:
        for c in components:
            getattr(c, phase.value)(ctx)

    def step(*flat):
        ctx = StepContext(plan, fwd_gm, plan.layout.split(flat), record_origins)
        run(Phase.START, ctx)
        if not plan.training:
            return _eval_step(plan, fwd_gm, ctx.inputs, ctx.copies)
        s = ctx.inputs
        ctx.fwd = forward_and_gradients(
            plan, fwd_gm, s, ctx.scale, ctx.reduce_each, ctx.observer, record_origins, ctx.copies
        )
        ctx.grads = ctx.fwd.grads
        run(Phase.GRADIENTS, ctx)
        position = ctx.positions()
        for opt in plan.optimizers:
            grads = densify_sparse_grads(
                opt, [ctx.grads[position[i]] for i in opt.forward_positions]
            )
            ctx.updates.append(u := OptimizerUpdate(opt, grads))
            for c in components:
                c.optimizer_gradients(ctx, u)
        run(Phase.OVERFLOW, ctx)
        _update_optimizers(ctx, components, block_updates)
        run(Phase.SKIP, ctx)
        run(Phase.RECORD, ctx)
        run(Phase.FINISH, ctx)
        for i, value in zip(plan.captured.mutated_buffers, ctx.fwd.new_buffers):
            s.buffers[i].copy_(masked(ctx.any_skip, s.buffers[i], value))
        return (*ctx.fwd.user, *_eager_outputs(ctx.updates, ctx.any_skip))

    return step


def _eager_outputs(updates: list[OptimizerUpdate], any_skip) -> list[torch.Tensor]:
    """What the optimizers whose own step() runs after the step take from it (after build()'s
    tensors, ``StepPlan.eager_outputs`` of them): their final gradients, and whether the step
    overflowed (with a scaler)."""
    grads = [g for u in updates if u.opt.path.in_python for g in u.grads]
    if not grads:
        return []
    return grads if any_skip is None else [*grads, any_skip]


def _update_optimizers(
    ctx: StepContext, components: list[StepComponent], block_updates: int
) -> None:
    """Each optimizer's update, masked by its own overflow flag, of the tensors the components
    choose (a sharded step: this rank's rows). ``block_updates``: whole parameters' blocks
    repeated at least this many times are updated by one kernel each (shards have no
    blocks)."""
    plan, s = ctx.plan, ctx.inputs
    by_block = block_updates and ctx.whole_updates
    states, hypers, fresh = iter(s.opt_state), iter(s.hyper), iter(s.momentum_fresh)
    for u, counter in zip(ctx.updates, s.counters):
        skip = u.found > 0 if u.found is not None else None
        if u.opt.path.in_python:  # its own step() runs after this one, on u.grads
            with NodeTagger(Subgraph.OPTIMIZER.tag()):
                counter.copy_(masked(skip, counter, counter + 1))
            continue
        mine = [s.params[i] for i in u.opt.forward_positions]
        for c in components:
            mine = c.before_update(ctx, u, mine)
        with NodeTagger(Subgraph.OPTIMIZER.tag(), custom={UPDATE_TAG: True}):
            names = (
                [plan.captured.param_names[i] for i in u.opt.forward_positions]
                if by_block
                else None
            )
            update_optimizer(
                u.opt, mine, u.grads, states, hypers, counter, skip, fresh, names, block_updates
            )
        for c in components:
            c.after_update(ctx, u, mine)


def _eval_step(
    plan: StepPlan, fwd_gm: fx.GraphModule, s: StepInputs, copies: list | None = None
) -> tuple:
    cap = plan.captured
    one = torch.ones((), dtype=torch.float32, device=s.params[0].device if s.params else None)
    forward_inputs = plan.forward_layout.flatten(
        params=s.params,
        buffers=s.buffers,
        inputs=s.inputs,
        loss_scale=one,
        constants=s.constants,
        param_copies=copies if copies is not None else parameter_casts(plan, s.params),
        pass_state=s.pass_state,
    )
    outs = run_forward(fwd_gm, forward_inputs)
    user, _, _, new_buffers = cap.split_outputs(outs)
    for i, value in zip(cap.mutated_buffers, new_buffers):
        s.buffers[i].copy_(value)
    for i, value in zip(cap.gradient_code.changed_params, cap.gradient_code_outputs(outs)[1]):
        s.params[i].copy_(value)
    return tuple(user)
