"""What the ranks of a data-parallel Graph tell each other on the host: through the process
group's key-value store (the TCPStore ``init_process_group`` made), never through the group's
collectives.

Why not a collective: a rank that rebuilds its step while its peers run the step they have
(one rank's batch changed shape; its call raised) would meet their step's all-gathers or
all-reduces with a host collective of another size, and gloo then aborts the process from C++
(SIGABRT, "Received data size doesn't match"): no rank hears why. A store key meets nothing.

Two things pass through it:

- each build's status (ok and its fingerprint, or the error), exchanged by the ranks that build
  (``exchange``): a rank that failed writes its status and raises at once; one that built waits
  for its peers' statuses, up to the store's timeout (the process group's timeout).
- a failed call's cause (``publish_failure``): a peer whose step then fails in its collectives
  (this rank is gone, or never came within the group's timeout) reads it and raises an error
  that names this rank and its cause (``peer_failures``).

Keys are ``graphamp/<graph name>#<n>/...``: the n-th data-parallel Graph of that name built in
this process, the same Graph on every rank (every rank builds its Graphs in the same order, as
it must call their collectives in the same order).
"""

from __future__ import annotations

import collections
import json
import logging
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..errors import RankFailedError
from .compat import process_group_store

log = logging.getLogger("graphamp")

# graph name -> how many data-parallel Graphs of that name this process has linked
_LINKED: collections.Counter[str] = collections.Counter()


@dataclass
class RankLink:
    """One data-parallel Graph's channel to the same Graph on the other ranks."""

    store: Any
    key: str
    rank: int
    world: int
    rounds: int = 0  # status exchanges so far (every rank counts the same builds)
    published: bool = False  # this rank's failure record is in the store

    @staticmethod
    def open(graph_name: str, group: Any) -> RankLink:
        _LINKED[graph_name] += 1
        return RankLink(
            store=process_group_store(group),
            key=f"graphamp/{graph_name}#{_LINKED[graph_name]}",
            rank=dist.get_rank(group),
            world=dist.get_world_size(group),
        )

    def exchange(self, status: tuple) -> list:
        """Every rank's status, by rank (as JSON gives them back: tuples become lists). A
        failed status is written and returned alone: its rank raises without waiting."""
        self.rounds += 1
        prefix = f"{self.key}/round{self.rounds}"
        self.store.set(f"{prefix}/{self.rank}", json.dumps(status))
        if status[0] == "error":
            return [json.loads(json.dumps(status))]
        keys = [f"{prefix}/{r}" for r in range(self.world)]
        self.store.wait(keys)  # raises DistStoreError after the group's timeout
        return [json.loads(self.store.get(k)) for k in keys]

    def publish_failure(self, step: int, error: BaseException) -> None:
        """Say why this rank's call ``step`` failed, for peers whose step it leaves stuck."""
        text = f"{type(error).__name__}: {error}".strip()
        try:
            self.store.set(f"{self.key}/failed/{self.rank}", json.dumps([step, text[:2000]]))
            self.published = True
        except Exception as e:  # the store is gone too: nothing to tell anyone
            log.debug("could not record rank %d's failure: %s", self.rank, e)

    def clear_failure(self) -> None:
        """This rank's call went through: an old failure record no longer explains anything."""
        if self.published:
            self.store.delete_key(f"{self.key}/failed/{self.rank}")
            self.published = False

    def peer_failures(self) -> list[tuple[int, str]]:
        """(rank, what it did) for each peer that recorded a failed call, or, failing that,
        that is building a step this rank is not (a status for the next exchange); [] if none
        or the store is unreachable (the rank hosting it exited)."""
        failed, building = [], []
        for r in range(self.world):
            if r == self.rank:
                continue
            try:
                key = f"{self.key}/failed/{r}"
                if self.store.check([key]):
                    step, text = json.loads(self.store.get(key))
                    failed.append((r, f"failed at its call {step} ({_first_line(text)})"))
                elif self.store.check([f"{self.key}/round{self.rounds + 1}/{r}"]):
                    building.append((r, _BUILDING))
            except Exception as e:
                log.debug("could not read rank %d's records: %s", r, e)
        return failed or building


_BUILDING = (
    "built a new step at this call while this rank ran the step it had: the ranks' inputs "
    "(their shapes) or settings differ at this call"
)


def raise_if_a_peer_failed(graph_name: str, link: RankLink, error: Exception) -> None:
    """``error`` stopped this rank's step: if a peer recorded a failed call, or is building a
    step at this call, the step stopped in the collectives that peer never joined, and the
    error says so (this rank's state is from before the step: nothing was applied)."""
    failures = link.peer_failures()
    if not failures:
        return
    rank, what = failures[0]
    raise RankFailedError(
        f"{graph_name}: rank {rank} {what}, so this rank's step stopped in the collectives "
        f"rank {rank} did not join ({type(error).__name__}: {_first_line(str(error))[:300]}). "
        "Nothing of this step was applied on this rank; the ranks must stop, or resume "
        "together from a checkpoint"
    ) from error


def _first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0] if lines else ""
