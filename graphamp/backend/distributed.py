"""Data parallel on torch.distributed: what happens on the host when a step is (re)built.

Inside the step (step/components/data_parallel.py), gradients are averaged with one coalesced functional
all-reduce and the overflow flags with an all-reduce max. Here, once per build: rank 0's
parameters and buffers are broadcast (as DDP does at construction), every rank builds its
program, and the ranks compare a fingerprint of the captured step through the group's store
(``torchkit/rank_store.py``: never a collective, which could meet a peer's cached step). A rank that
failed to build, or built a different graph, makes every building rank raise; a peer running
the step it had raises once its collectives fail, naming the rank and its cause.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Callable, TypeVar, cast

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from ..errors import CaptureError, ConfigError
from ..records.settings import ConfigSnapshot
from ..torchkit.rank_store import RankLink

log = logging.getLogger("graphamp")
T = TypeVar("T")


def process_group(graph_name: str, config: ConfigSnapshot):
    """The group a data-parallel graph averages over (the world by default)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            f"{graph_name}: data parallel needs an initialised process group: start with "
            "torchrun and call torch.distributed.init_process_group(backend) first"
        )
    return config.process_group or dist.group.WORLD


def _agree(graph_name: str, link: RankLink, status: tuple, what: str) -> list:
    """Each rank's (ok|error, detail) through the store; every building rank raises if any
    failed (a failed rank raises its own error without waiting)."""
    try:
        statuses = link.exchange(status)
    except dist.DistStoreError as e:
        raise CaptureError(
            f"{graph_name}: rank {link.rank} built its step, but its peers did not build at this "
            f"call within the process group's timeout (they ran the step they had, or stopped): "
            "every rank must build at the same calls, with inputs of the same shapes and the "
            f"same settings ({e})"
        ) from None
    failed = [(r, s[1]) for r, s in enumerate(statuses) if s[0] == "error"]
    if failed and status[0] != "error":
        r, message = failed[0]
        raise CaptureError(
            f"{graph_name}: rank {r} failed {what}, so every rank stops "
            f"(none is left waiting in a collective): {message}"
        )
    return statuses


def broadcast_state(graph_name: str, root: nn.Module, group, link: RankLink) -> None:
    """Rank 0's parameters and buffers on every rank (once, like DDP's constructor), after
    checking that every rank holds the same tensors (a mismatched broadcast would abort)."""
    tensors = [*root.named_parameters(), *root.named_buffers()]
    layout = [(n, tuple(t.shape), str(t.dtype)) for n, t in tensors]
    statuses = _agree(graph_name, link, ("ok", layout), "to describe its model")
    if any(s[1] != statuses[0][1] for s in statuses):
        differ = [r for r, s in enumerate(statuses) if s[1] != statuses[0][1]]
        first = (
            next((a, b) for a, b in zip(statuses[0][1], statuses[differ[0]][1]) if a != b)
            if len(statuses[0][1]) == len(statuses[differ[0]][1])
            else ("tensor count", "")
        )
        raise CaptureError(
            f"{graph_name}: the ranks hold different models (ranks {differ} differ "
            f"from rank 0, first at {first[0]} vs {first[1]}); data parallel needs the same "
            "model on every rank"
        )
    from torch.distributed.tensor import DTensor

    src = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
    with torch.no_grad():
        for _, tensor in tensors:
            # sharded parameters (DTensors) differ by rank, as they should: a DTensor
            # is one global value already
            if not isinstance(tensor, DTensor):
                dist.broadcast(tensor.data, src=src, group=group)


def fingerprint(step_gm: fx.GraphModule, names: list[str]) -> str:
    text = step_gm.code + "|" + "|".join(names)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def build_on_every_rank(
    graph_name: str, link: RankLink, build: Callable[[], T], fingerprint_of: Callable[[T], str]
) -> T:
    """``build()`` on this rank; every rank raises if any rank failed or built another step."""
    rank = link.rank
    result, error, status = None, None, None
    try:
        result = build()
        status = ("ok", fingerprint_of(result))
    except Exception as e:  # reported to every building rank below, then re-raised
        error = e
        status = ("error", f"{type(e).__name__}: {e}")
    statuses = _agree(graph_name, link, status, "to build its step")
    if error is not None:
        raise error
    prints = {s[1] for s in statuses}
    if len(prints) > 1:
        by_print: dict[str, list[int]] = {}
        for r, s in enumerate(statuses):
            by_print.setdefault(s[1], []).append(r)
        groups = "; ".join(f"ranks {v}" for v in by_print.values())
        raise CaptureError(
            f"{graph_name}: the ranks captured different training steps ({groups}). Every rank "
            "must run the same build() on the same model with inputs of the same shapes; rank "
            f"{rank} is in the group with fingerprint {status[1]}"
        )
    log.info(
        "%s: rank %d built the same step as its %d peers (%s)",
        graph_name,
        rank,
        len(statuses) - 1,
        status[1],
    )
    return cast(T, result)  # every rank built (a failure raised above)
