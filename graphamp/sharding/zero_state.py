"""ZeRO's optimizer state on the host: each rank's rows in ``optimizer.state``, torch's format
in ``optimizer.state_dict()``.

A rank keeps, for every parameter ``p`` and state key (``exp_avg``, ``momentum_buffer``, ...),
the 1-D row ``step/components/zero.py`` assigns it (``chunk_of(p.shape, W)`` elements); ``step`` stays
a scalar on every rank. ``optimizer.state_dict()`` gathers the rows into tensors of ``p``'s
shape (a collective: every rank must call it, as with FSDP's state dicts), so a checkpoint is
torch's own format and loads with any number of ranks, or in a single process. A state tensor
of ``p``'s shape found at a call (a loaded state dict, eager steps before) is cut to this
rank's row.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..records.optimizers import OptimizerPlan
from .cuts import chunk_of
from .sharded_params import row_from

_REGISTRY: weakref.WeakKeyDictionary[torch.optim.Optimizer, _ShardedOptimizer] = (
    weakref.WeakKeyDictionary()
)


@dataclass
class _ShardedOptimizer:
    group: Any  # the process group the rows are sharded over
    # the rows this module made, by id (tensors compare by value, so no WeakSet)
    shards: dict[int, weakref.ref] = field(default_factory=dict)

    def add(self, t: torch.Tensor) -> None:
        self.shards[id(t)] = weakref.ref(t)

    def holds(self, t: object) -> bool:
        ref = self.shards.get(id(t))
        return ref is not None and ref() is t


def track(plan: OptimizerPlan, group) -> None:
    """Make ``plan.optimizer.state_dict()`` gather the rows of this rank (once per optimizer)."""
    opt = plan.optimizer
    if opt in _REGISTRY:
        _REGISTRY[opt].group = group
        return
    _REGISTRY[opt] = _ShardedOptimizer(group)
    opt.register_state_dict_post_hook(_gather_state_dict)


def is_shard(opt: torch.optim.Optimizer, t: torch.Tensor) -> bool:
    entry = _REGISTRY.get(opt)
    return entry is not None and entry.holds(t)


def local_state(
    opt: torch.optim.Optimizer, key: str, p: torch.Tensor, existing: torch.Tensor | None, group
) -> torch.Tensor:
    """This rank's state tensor for (``p``, ``key``): ``existing`` if it is already a row, its
    row if it has ``p``'s shape (a DTensor's read from its shard where the layouts agree), a
    zero row if missing."""
    if existing is not None and is_shard(opt, existing):
        return existing
    if existing is None:
        chunk = chunk_of(p.shape, dist.get_world_size(group))
        row = torch.zeros(chunk, dtype=p.dtype, device=p.device)
    elif existing.shape != p.shape:
        raise ValueError(
            f"state {key!r} has shape {tuple(existing.shape)}, its parameter {tuple(p.shape)}"
        )
    else:  # a whole tensor, or FSDP2's sharded state (a resumed fully_shard run)
        row = row_from(existing, group).to(device=p.device)
    _REGISTRY[opt].add(row)
    return row


def _gather_state_dict(opt: torch.optim.Optimizer, state_dict: dict) -> dict:
    """torch's format: every row gathered into a tensor of its parameter's shape."""
    entry = _REGISTRY[opt]
    params = [p for g in opt.param_groups for p in g["params"]]
    world = dist.get_world_size(entry.group)
    state = {}
    for index, values in state_dict["state"].items():
        p = params[index]
        state[index] = {
            key: _gather(t, p, world, entry.group) if entry.holds(t) else t
            for key, t in values.items()
        }
    return {**state_dict, "state": state}  # new dicts: the optimizer keeps its rows


def _gather(row: torch.Tensor, p: torch.Tensor, world: int, group) -> torch.Tensor:
    out = torch.empty(row.numel() * world, dtype=row.dtype, device=row.device)
    dist.all_gather_into_tensor(out, row.contiguous(), group=group)
    return out[: p.numel()].view(p.shape).clone()
