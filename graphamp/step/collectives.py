"""Data parallel inside the step: functional collectives on torch.distributed."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


def average_over_ranks(grads: list[torch.Tensor], group) -> list[torch.Tensor]:
    """DDP's gradient averaging, as one coalesced functional all-reduce inside the step."""
    world = dist.get_world_size(group)
    reduced = funcol.all_reduce_coalesced(list(grads), "sum", group)
    return [g / world for g in reduced]


def agree_on_overflow(found_infs: list[torch.Tensor], group) -> list[torch.Tensor]:
    """Every rank skips a step if any rank overflowed (all-reduce max of the flags)."""
    agreed = funcol.all_reduce(torch.stack(found_infs), "max", group)
    return list(agreed.unbind(0))


def agree_on_probes(vector: torch.Tensor, group) -> torch.Tensor:
    """Overflow tracing's probe vector (largest magnitudes, NaN or inf where a value was not
    finite) made the same on every rank: per probe, the largest finite magnitude over the ranks,
    or inf/NaN where any rank's was (NaN wins). One all-reduce max; NaN is encoded first, since
    max over NaN is not reliably NaN in every backend's reduction."""
    finite = torch.isfinite(vector)
    magnitude = torch.where(finite, vector, torch.zeros_like(vector))
    code = torch.where(
        finite,
        torch.zeros_like(vector),
        torch.where(torch.isnan(vector), torch.full_like(vector, 2.0), torch.ones_like(vector)),
    )
    agreed = funcol.all_reduce(torch.cat([magnitude, code]), "max", group)
    magnitude, code = agreed.split(vector.shape[0])
    inf, nan = torch.full_like(vector, math.inf), torch.full_like(vector, math.nan)
    return torch.where(code == 0, magnitude, torch.where(code == 2, nan, inf))


def agree_on_amax(amaxes: torch.Tensor, group) -> torch.Tensor:
    """The delayed fp8 recipe's amaxes of this step, the largest over the ranks (finite by
    construction: non-finite values are never recorded), so every rank scales alike."""
    return funcol.all_reduce(amaxes, "max", group)
