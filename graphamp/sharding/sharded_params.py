"""ZeRO-3 on the host: every parameter held as this rank's shard, a DTensor as FSDP2's are.

``shard_parameters`` replaces each parameter of the registered modules, once, by an
``nn.Parameter`` holding a ``DTensor`` placed ``Shard(0)`` over the data-parallel group (the
layout of ``sharding/cuts.py``, FSDP2's). The DTensor's local tensor is a view of a flat,
zero-padded row of ``chunk_of(shape, W)`` elements that graphamp keeps: that row is what the
compiled step takes as the parameter's input and updates in place, so the user's DTensor always
shows the current values without a copy. Because the parameters are ordinary DTensors, torch's
own tools read them: ``model.state_dict()`` holds the shards,
``torch.distributed.checkpoint.state_dict.get_model_state_dict(model,
options=StateDictOptions(full_state_dict=True))`` gathers the whole tensors,
``set_model_state_dict`` loads a whole state dict into them in place, and a
``torch.distributed.checkpoint`` of the shards loads into an FSDP2 model (tests/test_zero.py).

The optimizers are pointed at the new parameters (their ``param_groups`` and ``state`` keys),
as a user does by creating the optimizer after FSDP2's ``fully_shard``. A parameter object that
is not graphamp's shard at a later build (a DTensor of someone else's, a plain tensor put in
its place) is sharded again from its whole value, and the optimizers holding that object follow.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterable, Iterator, cast

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import ConfigError
from .cuts import chunk_of, rows_held, rows_of
from .rows import forget_released_rows, is_shard, register_row


def shard_parameters(
    graph_name: str, root: nn.Module, optimizers: Iterable[torch.optim.Optimizer], group
) -> int:
    """Make every parameter of ``root`` this rank's shard (those that are already kept);
    returns how many were sharded now. Every rank calls it (a parameter that is a DTensor of
    someone else's is gathered whole first, a collective)."""
    forget_released_rows()
    replaced: dict[int, nn.Parameter] = {}
    for path, module in root.named_modules(remove_duplicate=False):
        for name, p in list(module._parameters.items()):
            if p is None or is_shard(p):
                continue
            if id(p) not in replaced:  # a tied parameter is sharded once
                replaced[id(p)] = _shard(graph_name, f"{path}.{name}".lstrip("."), p, group)
            module._parameters[name] = replaced[id(p)]
    if replaced:
        _point_optimizers_at(optimizers, replaced)
    return len(replaced)


def _shard(graph_name: str, name: str, p: torch.Tensor, group) -> nn.Parameter:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    if p.dim() == 0:
        raise ConfigError(
            f"{graph_name}: enable_zero(stage=3) shards parameters along their first "
            f"dimension, as FSDP2 does, and {name!r} is 0-dim: give it a shape of (1,) or train "
            "with enable_zero(stage=2)"
        )
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    shape = p.shape
    held = rows_held(shape, world, rank)
    row = row_from(p, group)
    local = row[: held * math.prod(shape[1:])].view(held, *shape[1:])
    mesh = DeviceMesh.from_group(group, p.device.type)
    with torch.no_grad():
        shard = DTensor.from_local(
            local,
            mesh,
            [Shard(0)],
            run_check=False,
            shape=shape,
            stride=torch.empty(shape, device="meta").stride(),  # contiguous
        )
    param = nn.Parameter(shard, requires_grad=p.requires_grad)
    register_row(row)
    return param


def row_from(t: torch.Tensor, group) -> torch.Tensor:
    """This rank's flat, zero-padded row of ``t``'s whole value (a new tensor): a plain
    tensor is cut (a 0-dim one counts as one row), a DTensor read locally where it can be
    (``_rank_rows``). ZeRO-3's parameters and every stage's optimizer state are cut here."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if t.dim() == 0:
        t = t.reshape(1)
    rows, held = rows_of(t.shape, world), rows_held(t.shape, world, rank)
    row = torch.zeros(chunk_of(t.shape, world), dtype=t.dtype, device=t.device)
    with torch.no_grad():
        row[: held * math.prod(t.shape[1:])] = _rank_rows(t, group, rank * rows, held).reshape(-1)
    return row


def _rank_rows(p: torch.Tensor, group, start: int, held: int) -> torch.Tensor:
    """Rows ``[start, start + held)`` of ``p``'s whole value. A DTensor in the same layout
    over the same group (FSDP2's ``fully_shard``, or an earlier sharding) already holds them
    locally; any other DTensor is gathered whole first (a collective)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(p, DTensor):
        return p.detach()[start : start + held]
    mesh = p.device_mesh
    if (
        mesh.ndim == 1
        and tuple(p.placements) == (Shard(0),)
        and dist.get_process_group_ranks(mesh.get_group()) == dist.get_process_group_ranks(group)
        and mesh.get_local_rank() == dist.get_rank(group)
        and p.to_local().shape[0] == held
    ):
        return p.to_local().detach()
    return p.full_tensor().detach()[start : start + held]


def _point_optimizers_at(
    optimizers: Iterable[torch.optim.Optimizer], replaced: dict[int, nn.Parameter]
) -> None:
    """The optimizers hold the new parameters where they held the old ones; their state moves
    with them (a whole-shaped state tensor is cut to this rank's row at the first step)."""
    for opt in optimizers:
        for group in opt.param_groups:
            old = group["params"]
            group["params"] = [replaced.get(id(p), p) for p in old]
            for p in old:
                new = replaced.get(id(p))
                if new is not None and p in opt.state:
                    opt.state[new] = opt.state.pop(p)


def shard_group(graph_name: str, root: nn.Module):
    """The process group ``root``'s parameters are ZeRO-3 shards over, or None when none is
    a shard. A graph whose modules mix shards and whole parameters is refused: it could not
    tell which to gather."""
    params = list(root.parameters())
    shards = [p for p in params if is_shard(p)]
    if not shards:
        return None
    if len(shards) != len(params):
        whole = next(n for n, p in root.named_parameters() if not is_shard(p))
        raise ConfigError(
            f"{graph_name}: some registered parameters are ZeRO-3 shards (a Graph with "
            f"enable_zero(stage=3) sharded them) and {whole!r} is not: register modules that "
            "are all sharded, or none (a module of its own Graph)"
        )
    return cast(Any, shards[0]).device_mesh.get_group()


@contextlib.contextmanager
def gathered_parameters(module: nn.Module) -> Iterator[nn.Module]:
    """``module`` with its ZeRO-3 shards swapped for whole parameters while the block runs, for
    eager use outside a Graph (``model(x)`` to evaluate, ``generate``): every rank must enter it
    (each whole is all-gathered). What the block writes into the wholes is not kept; the
    shards are put back on exit."""
    swapped = []
    cache: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is None or not is_shard(p):
                continue
            if id(p) not in cache:
                whole = cast(Any, p).full_tensor().detach()
                cache[id(p)] = nn.Parameter(whole, requires_grad=p.requires_grad)
            swapped.append((sub, name, p))
            sub._parameters[name] = cache[id(p)]
    try:
        yield module
    finally:
        for sub, name, p in swapped:
            sub._parameters[name] = p
