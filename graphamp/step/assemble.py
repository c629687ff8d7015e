"""Stage 4, assemble: the AMP-rewritten forward traced again inside one functional training step.

    parameter casts → forward → loss × scale → grads (autograd) → [all-reduce | ZeRO
    reduce-scatter]
    → unscale + found_inf → [+ the .grad build() left, checked] → clip → optimizer update masked by found_inf → [overflow record]
    → history row → [ZeRO all-gather of the updated parameters] → scale update → BatchNorm
    statistics masked

The whole step becomes one FX graph (make_fx over Python functionalization, fake tensors). Its
inputs are the state tensors and the batch (``plan.layout``); it writes every state tensor in
place (``copy_`` into its inputs, which the compiler keeps in place) and returns build()'s
tensors (then, for an optimizer whose own step() runs after it, its gradients: ``_eager_outputs``). Nodes carry ``meta["graphamp_subgraph"]``: parameter_casts, forward, backward,
grad_scaler, clip_grad, data_parallel, zero, optimizer, forensics (overflow tracing only), fp8
(the delayed recipe's histories), history (and recompute, added after tracing by
``recompute.py``).
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback

from ..records.frames import SOURCE_LINE_META
from ..records.layouts import StepInputs
from ..records.optimizers import OptimizerPlan
from ..records.sharding import block_of
from ..records.spec import StepPlan
from ..torchkit.fp8_numerics import rolled_history
from ..torchkit.fxutil import NodeTagger, graph_modules, rename_placeholders, trace_functional
from ..torchkit.update_region import UPDATE_TAG
from .block_update import pass_gradients_uncast
from .collectives import agree_on_amax, agree_on_overflow, agree_on_probes, average_over_ranks
from .gradients import (
    ForwardResult,
    cast_for_forward,
    forward_and_gradients,
    parameter_casts,
    run_forward,
)
from .history_row import record_history
from .optimizer_update import densify_sparse_grads, update_optimizer
from .overflow_probes import ProbeRecorder, record_overflow
from .scaling import (
    add_explicit_gradients,
    clip_grad_norm,
    count_nonfinite_norm,
    unscale_and_check,
    write_scale_update,
)
from .shard_gathers import GATHER, KEEP_GATHERED, SCATTER
from .traced_optimizer import tensorify_scalar_reads
from .update_math import masked
from .zero import gather_parameters, global_norm, local_rows, scatter_gradients


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
    """The functional step over the flat inputs of ``plan.layout``, one subgraph per call."""

    def step(*flat):
        s, rows, copies = _whole_parameters(plan, fwd_gm, plan.layout.split(flat))
        if not plan.training:
            return _eval_step(plan, fwd_gm, s, copies)
        scale = s.scale
        _clear_step_amaxes(s.fp8)
        reduce_each = (
            (lambda grads: _scatter_per_optimizer(plan, grads))
            if plan.zero_stage >= 2 and plan.acc_steps > 1
            else None
        )
        recorder = ProbeRecorder(plan.probes) if plan.probes is not None else None
        fwd = forward_and_gradients(
            plan, fwd_gm, s, scale, reduce_each, recorder, record_origins, copies
        )
        grads = fwd.grads
        if recorder is not None and reduce_each is None:  # whole gradients, before any scatter
            recorder.observe_param_grads(grads)
        if plan.zero_stage and reduce_each is None:
            grads = _scatter_per_optimizer(plan, grads)
        elif plan.process_group is not None and not plan.zero_stage:
            with NodeTagger({"graphamp_subgraph": "data_parallel"}):
                grads = average_over_ranks(grads, plan.process_group)
        before = _write_changed_params(plan, s, fwd)
        updates, norms = _unscale_and_clip(plan, grads, scale, fwd)
        _update_optimizers(plan, s, updates, rows, block_updates)
        found_total = any_skip = None
        if plan.scaler is not None:
            with NodeTagger({"graphamp_subgraph": "grad_scaler"}):
                found_total = _total(updates)
                any_skip = found_total > 0
            _unless_skipped(s.params, before, any_skip)
        if recorder is not None:  # reads the step counter and scale before they are written
            agree = (
                (lambda v: agree_on_probes(v, plan.process_group))
                if plan.process_group is not None
                else None
            )
            record_overflow(s.forensics, recorder, s.history_step, scale, any_skip, agree)
        with NodeTagger({"graphamp_subgraph": "history"}):
            # before the scaler state is written: a read after copy_ sees the new value
            record_history(s.history, fwd.losses, scale, any_skip, norms)
        _roll_fp8_histories(plan, s.fp8, any_skip)
        if plan.scaler is not None:
            with NodeTagger({"graphamp_subgraph": "grad_scaler"}):
                write_scale_update(plan.scaler, s.scaler, found_total, any_skip)
        for i, value in zip(plan.captured.mutated_buffers, fwd.new_buffers):
            s.buffers[i].copy_(masked(any_skip, s.buffers[i], value))
        return (*fwd.user, *_eager_outputs(updates, any_skip))

    return step


def _eager_outputs(updates: list[_OptimizerUpdate], any_skip) -> list[torch.Tensor]:
    """What the optimizers whose own step() runs after the step take from it (after build()'s
    tensors, ``StepPlan.eager_outputs`` of them): their final gradients, and whether the step
    overflowed (with a scaler)."""
    grads = [g for u in updates if u.opt.path.in_python for g in u.grads]
    if not grads:
        return []
    return grads if any_skip is None else [*grads, any_skip]


def _write_changed_params(plan: StepPlan, s: StepInputs, fwd: ForwardResult) -> dict:
    """The parameters build() changed in place (SAM's restore, a clamp) take their new values:
    the optimizer updates those. Returns the values before, by position (with a scaler: a
    skipped step puts them back, as it keeps the buffers)."""
    before = {}
    for i, value in zip(plan.captured.gradient_code.changed_params, fwd.new_params):
        if plan.scaler is not None:
            before[i] = s.params[i].clone()
        s.params[i].copy_(value)
    return before


def _clear_step_amaxes(histories: list) -> None:
    """The delayed fp8 recipe: this step's amaxes (column 0) start afresh (a skipped step
    left the last one there)."""
    for history in histories:
        history[:, 0] = 0.0


def _roll_fp8_histories(plan: StepPlan, histories: list, any_skip) -> None:
    """The delayed fp8 recipe: this step's amaxes (agreed across ranks) pushed into each
    history; a skipped step leaves the histories as they were."""
    if not histories:
        return
    with NodeTagger({"graphamp_subgraph": "fp8"}):
        if plan.process_group is not None:
            agreed = agree_on_amax(torch.stack([h[:, 0] for h in histories]), plan.process_group)
            for h, amax in zip(histories, agreed.unbind(0)):
                h[:, 0] = amax
        for h in histories:
            h.copy_(masked(any_skip, h, rolled_history(h)))


def _unless_skipped(params: list, before: dict, any_skip: torch.Tensor) -> None:
    """A skipped step is skipped whole: parameters build() changed get their values back, as
    the buffers do."""
    for i, old in before.items():
        params[i].copy_(masked(any_skip, old, params[i]))


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
        fp8_state=s.fp8,
    )
    outs = run_forward(fwd_gm, forward_inputs)
    user, _, _, new_buffers = cap.split_outputs(outs)
    for i, value in zip(cap.mutated_buffers, new_buffers):
        s.buffers[i].copy_(value)
    for i, value in zip(cap.gradient_code.changed_params, cap.gradient_code_outputs(outs)[1]):
        s.params[i].copy_(value)
    return tuple(user)


def _scatter_per_optimizer(plan: StepPlan, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """ZeRO: this rank's rows of the averaged gradients (``grads`` and the result in
    ``plan.trainable`` order). One reduce-scatter per optimizer; under ZeRO-3 one per block
    of each optimizer's parameters, which ``shard_gathers.place_collectives`` moves to just
    after the block's last gradient, so a block's whole gradients die as its backward ends."""
    position = {p: j for j, p in enumerate(plan.trainable)}
    names = plan.captured.param_names
    out = list(grads)
    buckets: dict[tuple[int, str], list[int]] = {}
    for k, opt in enumerate(plan.optimizers):
        for i in opt.forward_positions:
            block = block_of(names[i], plan.gather_blocks) if plan.zero_stage == 3 else ""
            buckets.setdefault((k, block), []).append(position[i])
    with NodeTagger({"graphamp_subgraph": "zero"}):
        for number, js in enumerate(buckets.values()):
            dense = [g.to_dense() if g.is_sparse else g for g in (grads[j] for j in js)]
            with NodeTagger({SCATTER: number}):
                shards = scatter_gradients(dense, plan.process_group)
            for j, shard in zip(js, shards):
                out[j] = shard
    return out


@dataclass
class _OptimizerUpdate:
    opt: OptimizerPlan
    grads: list[torch.Tensor]  # unscaled and clipped, in opt.forward_positions order
    found: torch.Tensor | None  # this optimizer's overflow flag (None without a scaler)


def _unscale_and_clip(
    plan: StepPlan, grads: list[torch.Tensor], scale: torch.Tensor | None, fwd: ForwardResult
):
    """Per optimizer: unscale and check for overflow, add the .grad build() left (unscaled
    already) and check the sums (after the user's gradient code), then clip (after unscaling,
    always)."""
    position = {p: j for j, p in enumerate(plan.trainable)}
    updates, norms = [], []
    for opt in plan.optimizers:
        opt_grads = densify_sparse_grads(opt, [grads[position[i]] for i in opt.forward_positions])
        found = None
        if scale is not None:
            with NodeTagger({"graphamp_subgraph": "grad_scaler"}):
                opt_grads, found = unscale_and_check(opt_grads, scale)
        if fwd.explicit:
            with NodeTagger({"graphamp_subgraph": "grad_scaler"}):
                opt_grads, found = add_explicit_gradients(
                    opt.forward_positions, opt_grads, fwd.explicit, fwd.reached, found
                )
        if opt.clip_max_norm is not None:
            with NodeTagger({"graphamp_subgraph": "clip_grad"}):
                norm_of = (
                    (lambda g, p: global_norm(g, p, plan.process_group))
                    if plan.zero_stage
                    else None
                )
                opt_grads, total_norm = clip_grad_norm(
                    opt_grads, opt.clip_max_norm, opt.clip_norm_type, norm_of
                )
                if total_norm is not None:
                    norms.append(total_norm)
                    found = count_nonfinite_norm(found, total_norm)
        updates.append(_OptimizerUpdate(opt, opt_grads, found))
    if plan.process_group is not None and any(u.found is not None for u in updates):
        with NodeTagger({"graphamp_subgraph": "data_parallel"}):
            agreed = iter(
                agree_on_overflow(
                    [u.found for u in updates if u.found is not None], plan.process_group
                )
            )
        for u in updates:
            u.found = next(agreed) if u.found is not None else None
    return updates, norms


def _update_optimizers(
    plan: StepPlan,
    s: StepInputs,
    updates: list[_OptimizerUpdate],
    rows: list[torch.Tensor] | None,
    block_updates: int,
):
    """Each optimizer's masked update (ZeRO-1/2: of this rank's rows, then all-gathered;
    ZeRO-3: of the step's inputs, which are the rows). ``block_updates``: whole parameters'
    blocks repeated at least this many times by one kernel each (shards have no blocks)."""
    by_block = block_updates and rows is None and not plan.zero_stage
    states, hypers, fresh = iter(s.opt_state), iter(s.hyper), iter(s.momentum_fresh)
    params = s.params
    for u, counter in zip(updates, s.counters):
        skip = u.found > 0 if u.found is not None else None
        if u.opt.path.in_python:  # its own step() runs after this one, on u.grads
            with NodeTagger({"graphamp_subgraph": "optimizer"}):
                counter.copy_(masked(skip, counter, counter + 1))
            continue
        if rows is not None:
            mine = [rows[i] for i in u.opt.forward_positions]
        else:
            mine = [params[i] for i in u.opt.forward_positions]
        if plan.zero_stage in (1, 2):
            with NodeTagger({"graphamp_subgraph": "zero"}):
                mine = local_rows(mine, s.zero_rank, plan.process_group)
        with NodeTagger({"graphamp_subgraph": "optimizer"}, custom={UPDATE_TAG: True}):
            names = (
                [plan.captured.param_names[i] for i in u.opt.forward_positions]
                if by_block
                else None
            )
            update_optimizer(
                u.opt, mine, u.grads, states, hypers, counter, skip, fresh, names, block_updates
            )
        if plan.zero_stage in (1, 2):
            with NodeTagger({"graphamp_subgraph": "zero"}):
                full = [params[i] for i in u.opt.forward_positions]
                shapes = [p.shape for p in full]
                for p, new in zip(full, gather_parameters(mine, shapes, plan.process_group)):
                    p.copy_(new)


def _whole_parameters(
    plan: StepPlan, fwd_gm: fx.GraphModule, s: StepInputs
) -> tuple[StepInputs, list[torch.Tensor] | None, list[torch.Tensor] | None]:
    """ZeRO-3: the step's parameter inputs are this rank's rows; the forward and backward read
    wholes gathered from them. Returns the inputs with the wholes in place of the rows, the
    rows (which the optimizer updates) and AMP's low-precision copies; without ZeRO-3,
    ``(s, None, None)`` (the copies are cast from the parameters as usual)."""
    if plan.zero_stage != 3:
        return s, None, None
    with NodeTagger({"graphamp_subgraph": "zero"}):
        whole, copies = _gather_shards(plan, fwd_gm, s.params)
    return dataclasses.replace(s, params=whole), s.params, copies


def _gather_shards(plan: StepPlan, fwd_gm: fx.GraphModule, rows: list[torch.Tensor]):
    """ZeRO-3: (the whole parameters, AMP's low-precision copies) from every rank's rows, one
    all-gather per block of parameters (``records.sharding.block_of``), its dtypes as bytes
    when it holds several. A parameter the forward reads only through its low-precision copy
    is gathered in that dtype (its row cast first: the same values, half the bytes of
    float32), and its whole is never made (an empty tensor stands for it, read for its shape
    only). Traced here, at the start of the step;
    ``shard_gathers.place_collectives`` then moves each block's gather to where it is read."""
    placeholders = [n for n in fwd_gm.graph.nodes if n.op == "placeholder"]
    shapes = [node.meta["val"].shape for node in plan.forward_layout.split(placeholders).params]
    cast_only = {i: dtype for i, dtype in plan.param_casts if i not in plan.direct_use}
    # block -> [(i, the dtype its row travels in)], in parameter order
    buckets: dict[str, list[tuple[int, torch.dtype]]] = {}
    for i, (name, row) in enumerate(zip(plan.captured.param_names, rows)):
        dtype = cast_only.get(i, row.dtype)
        buckets.setdefault(block_of(name, plan.gather_blocks), []).append((i, dtype))
    gathered: dict[int, torch.Tensor] = {}
    for number, (block, members) in enumerate(buckets.items()):
        keep = not plan.reshard_after_forward or block in plan.kept_blocks
        # the casts too: they move with the gather
        with NodeTagger({GATHER: number, **({KEEP_GATHERED: True} if keep else {})}):
            pieces = [rows[i].to(dtype) for i, dtype in members]
            values = gather_parameters(pieces, [shapes[i] for i, _ in members], plan.process_group)
        gathered.update((i, value) for (i, _), value in zip(members, values))
    whole = [
        rows[i].new_empty(shapes[i]) if i in cast_only else gathered[i] for i in range(len(rows))
    ]
    with NodeTagger({"graphamp_subgraph": "parameter_casts"}):
        copies = [
            cast_for_forward(gathered[i] if i in cast_only else whole[i], dtype)
            for i, dtype in plan.param_casts
        ]
    return whole, copies


def _total(updates: list[_OptimizerUpdate]) -> torch.Tensor:
    """The overflow flags of all optimizers, summed (> 0: the step overflowed somewhere)."""
    found = [u.found for u in updates if u.found is not None]
    total = found[0]
    for f in found[1:]:
        total = total + f
    return total
