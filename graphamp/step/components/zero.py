"""ZeRO inside the step: reduce-scatter the gradients, update this rank's rows, all-gather.

Every parameter is cut along its first dimension as ``torch.chunk`` cuts it (FSDP2's layout):
``ceil(d0 / W)`` rows of the first dimension per rank, padded, flattened into a row of
``chunk = ceil(d0 / W) * prod(shape[1:])`` elements (``sharding/cuts.chunk_of``): rank ``r``
owns row ``r`` of every parameter. An optimizer's parameters form one bucket, ``(W, sum of chunks)``, so each step has
one reduce-scatter of gradients and one all-gather of updated parameters per optimizer, both
functional collectives inside the compiled program. The optimizer state held on a rank is its
rows only (``sharding/zero_state.py`` keeps them in ``optimizer.state`` and gathers torch's
format for ``optimizer.state_dict()``).

The update math is elementwise (SGD, Adam), so running it on a shard equals running it on the
whole tensor and slicing. What needs every shard is said where it happens: the overflow flag
(all-reduce max, as for data parallel) and the clipping norm (all-reduce of the local norms).
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._foreach_norm, torch.distributed._functional_collectives
import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.fx as fx
import torch.nn as nn

from ...errors import CaptureError, ConfigError, UnsupportedOptimizerError
from ...records.optimizers import OptimizerPlan
from ...records.spec import GraphSpec, StepPlan
from ...records.stage_names import Stage
from ...records.state import SharedState
from ...records.subgraphs import Subgraph
from ...records.update_paths import UpdatePath
from ...sharding.cuts import block_of, chunk_of
from ...sharding.row_placement import RowPlacement
from ...sharding.shard_gathers import GATHER, KEEP_GATHERED, SCATTER, place_collectives
from ...sharding.sharded_params import shard_parameters
from ...torchkit.fxutil import NodeTagger
from ..gradients import cast_for_forward
from .component import OptimizerUpdate, Planning, StepComponent, StepContext


def _rows(tensors: list[torch.Tensor], world: int) -> torch.Tensor:
    """The bucket ``(W, sum of chunks)``: each tensor flattened, padded, cut into W rows."""
    parts = []
    for t in tensors:
        chunk = chunk_of(t.shape, world)
        flat = t.reshape(-1)
        pad = chunk * world - flat.numel()
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        parts.append(flat.view(world, chunk))
    return torch.cat(parts, dim=1)


def _split_row(row: torch.Tensor, shapes: list, world: int) -> list[torch.Tensor]:
    return list(row.split([chunk_of(shape, world) for shape in shapes], dim=-1))


def scatter_gradients(grads: list[torch.Tensor], group) -> list[torch.Tensor]:
    """This rank's rows of the gradients averaged over the ranks (one reduce-scatter)."""
    if not grads:
        return []
    world = dist.get_world_size(group)
    bucket = _rows(grads, world).reshape(-1)
    row = funcol.reduce_scatter_tensor(bucket, "sum", 0, group) / world
    return _split_row(row, [g.shape for g in grads], world)


def local_rows(params: list[torch.Tensor], rank: torch.Tensor, group) -> list[torch.Tensor]:
    """This rank's rows of the parameters. ``rank`` is a graph input (0-dim int64), so every
    rank traces the same graph (the ranks compare their graphs at build time)."""
    if not params:
        return []
    world = dist.get_world_size(group)
    row = _rows(params, world).index_select(0, rank.reshape(1)).squeeze(0)
    # separate tensors, not views of one row: the optimizer writes each in place, and writes
    # into views of a shared base make functionalization regenerate the whole row every time
    return [piece.clone() for piece in _split_row(row, [p.shape for p in params], world)]


def gather_parameters(rows: list[torch.Tensor], shapes: list[torch.Size], group) -> list:
    """The whole parameters of ``shapes`` from every rank's rows (one all-gather). Rows of
    several dtypes (a block's bf16 copies and its float32 norms) travel as bytes in that one
    all-gather, as FSDP2's copy-in does: ``_gather_bytes``."""
    if not rows:
        return []
    if len({row.dtype for row in rows}) > 1:
        return _gather_bytes(rows, shapes, group)
    world = dist.get_world_size(group)
    gathered = funcol.all_gather_tensor(torch.cat(rows), 0, group).view(world, -1)
    pieces = _split_row(gathered, shapes, world)
    return [
        piece.reshape(-1)[: math.prod(shape)].view(shape) for piece, shape in zip(pieces, shapes)
    ]


_ALIGN = 16  # bytes: every rank's part starts where any dtype's view of it may start


def _gather_bytes(rows: list[torch.Tensor], shapes: list[torch.Size], group) -> list:
    """``gather_parameters`` for rows of mixed dtypes: each row viewed as bytes, the widest
    dtypes first (so every piece starts at a multiple of its element size), each rank's part
    padded to ``_ALIGN`` bytes; after the gather each piece is viewed back as its dtype."""
    world = dist.get_world_size(group)
    order = sorted(range(len(rows)), key=lambda i: -rows[i].element_size())
    sizes = [rows[i].numel() * rows[i].element_size() for i in order]
    padding = -sum(sizes) % _ALIGN
    parts = [rows[i].contiguous().view(torch.uint8) for i in order]
    if padding:
        parts.append(rows[0].new_zeros(padding, dtype=torch.uint8))
    gathered = funcol.all_gather_tensor(torch.cat(parts), 0, group).view(world, -1)
    pieces = gathered.split([*sizes, padding], dim=-1)
    out: list = [None] * len(rows)
    for i, piece in zip(order, pieces):
        whole = piece.contiguous().view(rows[i].dtype).reshape(-1)
        out[i] = whole[: math.prod(shapes[i])].view(shapes[i])
    return out


def global_norm(shards: list[torch.Tensor], norm_type: float, group) -> torch.Tensor:
    """``clip_grad_norm_``'s total norm of the whole gradients, from each rank's rows (padding
    is zero, so it adds nothing)."""
    norms = torch._foreach_norm(shards, norm_type)
    local = torch.linalg.vector_norm(torch.stack(list(norms)), norm_type)
    if math.isinf(norm_type):
        return funcol.all_reduce(local, "max", group)
    return funcol.all_reduce(local**norm_type, "sum", group) ** (1.0 / norm_type)


def _zero_stage(planning: Planning) -> tuple[int, Any]:
    """(ZeRO stage, the group the step's collectives use). Parameters that are ZeRO-3 shards
    make any graph ZeRO-3 over their group, an eval graph too: it must gather them."""
    spec, group = planning.spec, planning.process_group
    if planning.shard_group is None:
        return (spec.config.zero_stage if spec.training and group is not None else 0), group
    if planning.captured.gradient_code.changed_params:
        raise CaptureError(
            f"{spec.name}.build() changes parameters in place, and they are ZeRO-3 shards: the "
            "step reads gathered copies, so the change would be lost. Change them in a Graph "
            "without ZeRO-3"
        )
    return 3, planning.shard_group


def _placement(plan: StepPlan) -> RowPlacement:
    """The plan's placement, ZeRO's wherever the component is active (``Zero.active``)."""
    if not isinstance(plan.placement, RowPlacement):
        raise TypeError(
            f"graphamp's ZeRO component ran on a plan whose placement is "
            f"{type(plan.placement).__name__}, not RowPlacement: please report it"
        )
    return plan.placement


def _check_gradient_code(planning: Planning) -> None:
    """Gradient code in build() (``GradientCode``) runs on the whole batch's gradients, not
    on this rank's shards of them."""
    spec = planning.spec
    if spec.training and planning.captured.gradient_code.present:
        raise CaptureError(
            f"{spec.name}.build() reads or writes .grad, or changes parameters in place, and "
            "the Graph uses ZeRO: graphamp does not combine the two yet. Fix: train this "
            "step without ZeRO (data parallel keeps gradient code), or move the gradient code "
            "to add_optimizer's clip_grad_max_norm where it is clipping"
        )


def _check_buckets(spec: GraphSpec, plans: list[OptimizerPlan]) -> None:
    """ZeRO flattens each optimizer's parameters into one bucket: one dtype per optimizer."""
    for opt in plans:
        dtypes = {p.dtype for p in opt.params}
        if len(dtypes) > 1:
            raise ConfigError(
                f"{spec.name}: enable_zero shards each optimizer's parameters as one flat "
                f"bucket, but optimizer {opt.index} holds {sorted(map(str, dtypes))}: give "
                "parameters of each dtype their own optimizer (add_optimizer twice)"
            )


class Zero(StepComponent):
    """ZeRO in the step. Stages 1 and 2: each rank updates its rows of the averaged gradients
    (one reduce-scatter per optimizer; stage 2 under accumulation reduces each micro-batch's)
    and the whole parameters are all-gathered after the update. Stage 3: the step's parameter
    inputs are the rows; the forward and backward read wholes gathered block by block
    (``sharding/shard_gathers.place_collectives`` moves each gather to where it is read, the
    component's rewrite of the assembled step), and the optimizer updates the rows. The
    clipping norm is the norm over every rank's rows. The plan's ``placement`` is ZeRO's
    (``sharding/row_placement.RowPlacement``): the component decides it and reads its settings."""

    name = "zero"
    part = "ZeRO's sharded update"
    group = "shard"
    inputs = ("zero_rank",)
    on_skip = (
        "nothing of its own: the masked update leaves the rows, and the wholes gathered from them, "
        "as they were"
    )
    across_ranks = (
        "each rank updates its own rows; the all-gather makes the whole parameters equal on every "
        "rank"
    )

    rewrite_stage = Stage.PLACE_COLLECTIVES  # after outlining: it moves gathers around its calls

    def active(self, plan: StepPlan) -> bool:
        return isinstance(plan.placement, RowPlacement)

    def check_optimizer(self, spec: GraphSpec, optimizer: Any, path: UpdatePath) -> None:
        """ZeRO updates rows: only an update of graphamp's own multi-tensor math can run on them."""
        if spec.config.zero_stage and not path.multi_tensor:
            how = "is traced whole" if path.traced else "runs in Python on whole gradients"
            raise UnsupportedOptimizerError(
                f"{spec.name}: ZeRO shards the state of graphamp's own SGD, Adam and AdamW "
                f"updates; {type(optimizer).__name__}'s own step() {how}, not by rows. Use one of "
                "those three, or leave ZeRO off (data parallel without it keeps any optimizer)"
            )

    def prepare_model(self, spec: GraphSpec, root: nn.Module, group: Any) -> None:
        # ZeRO-3 keeps the parameters as shards from here on; a fully_shard model's FSDP2
        # shards become graphamp's, in an eval Graph too (nothing else could gather them)
        if spec.config.zero_stage == 3 and (spec.training or spec.config.fully_shard is not None):
            optimizers = [slot.optimizer for slot in spec.optimizers]
            shard_parameters(spec.name, root, optimizers, group)

    def plan_fields(self, planning: Planning) -> dict[str, Any]:
        spec = planning.spec
        stage, group = _zero_stage(planning)
        if not stage:
            return {}
        _check_gradient_code(planning)
        _check_buckets(spec, planning.optimizers)
        wrap = spec.config.fully_shard
        placement = RowPlacement(
            stage,
            group,
            # ZeRO-3's gather plan: a fully_shard wrap's blocks and the ones it keeps gathered
            # from the forward to the backward, or enable_zero's setting for every block
            gather_blocks=wrap.blocks if wrap is not None else (),
            reshard_after_forward=spec.config.zero_reshard_after_forward,
            kept_blocks=wrap.kept if wrap is not None else (),
        )
        # an eval graph over shards gathers them: it needs the group too
        return {"placement": placement, "process_group": group}

    def rewrites(self, plan: StepPlan) -> bool:
        return _placement(plan).stage == 3

    def rewrite_step(self, plan: StepPlan, gm: fx.GraphModule) -> str:  # noqa: ARG002
        place_collectives(gm)
        return ""

    def example_inputs(
        self,
        plan: StepPlan,
        state: SharedState,  # noqa: ARG002 - every component's signature
        device: torch.device,
    ) -> list:
        rank = dist.get_rank(plan.process_group)
        return [torch.tensor(rank, dtype=torch.int64, device=device)]

    def start(self, ctx: StepContext) -> None:
        plan, placement = ctx.plan, _placement(ctx.plan)
        if placement.stage == 3:
            rows = ctx.inputs.params
            with NodeTagger(Subgraph.ZERO.tag()):
                whole, ctx.copies = _gather_shards(plan, ctx.fwd_gm, rows)
            ctx.inputs, ctx.rows = dataclasses.replace(ctx.inputs, params=whole), rows
        if not plan.training:
            return
        ctx.grads_reduced = True  # by the reduce-scatter, not data parallel's all-reduce
        if placement.stage >= 2 and plan.acc_steps > 1:
            ctx.reduce_each = lambda grads: _scatter_per_optimizer(plan, grads)
        ctx.norm_of = lambda grads, norm_type: global_norm(grads, norm_type, plan.process_group)
        ctx.whole_updates = False

    def gradients(self, ctx: StepContext) -> None:
        if ctx.reduce_each is None:  # stage 2 under accumulation reduced each micro-batch's
            ctx.grads = _scatter_per_optimizer(ctx.plan, ctx.grads)

    def before_update(self, ctx: StepContext, u: OptimizerUpdate, tensors: list) -> list:
        if ctx.rows is not None:  # stage 3: the rows are the step's inputs
            return [ctx.rows[i] for i in u.opt.forward_positions]
        with NodeTagger(Subgraph.ZERO.tag()):
            return local_rows(tensors, self.own(ctx)[0], ctx.plan.process_group)

    def after_update(self, ctx: StepContext, u: OptimizerUpdate, tensors: list) -> None:
        if ctx.rows is not None:
            return
        with NodeTagger(Subgraph.ZERO.tag()):
            whole = [ctx.inputs.params[i] for i in u.opt.forward_positions]
            shapes = [p.shape for p in whole]
            for p, new in zip(whole, gather_parameters(tensors, shapes, ctx.plan.process_group)):
                p.copy_(new)


def _scatter_per_optimizer(plan: StepPlan, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """This rank's rows of the averaged gradients (``grads`` and the result in
    ``plan.trainable`` order). One reduce-scatter per optimizer; under ZeRO-3 one per block
    of each optimizer's parameters, which ``sharding/shard_gathers.place_collectives`` moves to just
    after the block's last gradient, so a block's whole gradients die as its backward ends."""
    position = {p: j for j, p in enumerate(plan.trainable)}
    names, placement = plan.captured.param_names, _placement(plan)
    out = list(grads)
    buckets: dict[tuple[int, str], list[int]] = {}
    for k, opt in enumerate(plan.optimizers):
        for i in opt.forward_positions:
            block = block_of(names[i], placement.gather_blocks) if placement.stage == 3 else ""
            buckets.setdefault((k, block), []).append(position[i])
    with NodeTagger(Subgraph.ZERO.tag()):
        for number, js in enumerate(buckets.values()):
            dense = [g.to_dense() if g.is_sparse else g for g in (grads[j] for j in js)]
            with NodeTagger({SCATTER: number}):
                shards = scatter_gradients(dense, plan.process_group)
            for j, shard in zip(js, shards):
                out[j] = shard
    return out


def _gather_shards(plan: StepPlan, fwd_gm: fx.GraphModule, rows: list[torch.Tensor]):
    """ZeRO-3: (the whole parameters, AMP's low-precision copies) from every rank's rows, one
    all-gather per block of parameters (``sharding.cuts.block_of``), its dtypes as bytes
    when it holds several. A parameter the forward reads only through its low-precision copy
    is gathered in that dtype (its row cast first: the same values, half the bytes of
    float32), and its whole is never made (an empty tensor stands for it, read for its shape
    only). Traced here, at the start of the step;
    ``sharding/shard_gathers.place_collectives`` then moves each block's gather to where it is read."""
    placeholders = [n for n in fwd_gm.graph.nodes if n.op == "placeholder"]
    shapes = [node.meta["val"].shape for node in plan.forward_layout.split(placeholders).params]
    cast_only = {i: dtype for i, dtype in plan.param_casts if i not in plan.direct_use}
    placement = _placement(plan)
    # block -> [(i, the dtype its row travels in)], in parameter order
    buckets: dict[str, list[tuple[int, torch.dtype]]] = {}
    for i, (name, row) in enumerate(zip(plan.captured.param_names, rows)):
        dtype = cast_only.get(i, row.dtype)
        buckets.setdefault(block_of(name, placement.gather_blocks), []).append((i, dtype))
    gathered: dict[int, torch.Tensor] = {}
    for number, (block, members) in enumerate(buckets.items()):
        keep = not placement.reshard_after_forward or block in placement.kept_blocks
        # the casts too: they move with the gather
        with NodeTagger({GATHER: number, **({KEEP_GATHERED: True} if keep else {})}):
            pieces = [rows[i].to(dtype) for i, dtype in members]
            values = gather_parameters(pieces, [shapes[i] for i, _ in members], plan.process_group)
        gathered.update((i, value) for (i, _), value in zip(members, values))
    whole = [
        rows[i].new_empty(shapes[i]) if i in cast_only else gathered[i] for i in range(len(rows))
    ]
    with NodeTagger(Subgraph.PARAMETER_CASTS.tag()):
        copies = [
            cast_for_forward(gathered[i] if i in cast_only else whole[i], dtype)
            for i, dtype in plan.param_casts
        ]
    return whole, copies
