"""The ranks' host-side channel (``torchkit/rank_store.py``) on one process: two RankLinks over
one in-memory store stand for two ranks of a data-parallel Graph. tests/test_distributed.py runs
it across processes (a rank that fails or rebuilds alone, under ZeRO-3)."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

import graphamp
from graphamp.step import block_update
from graphamp.torchkit.process_state import BoundedCache
from graphamp.torchkit.rank_store import RankLink, raise_if_a_peer_failed


def _ranks(timeout_s: float = 0.5) -> tuple[RankLink, RankLink]:
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    key = "graphamp/G#1"
    return RankLink(store, key, rank=0, world=2), RankLink(store, key, rank=1, world=2)


def test_ranks_that_both_build_see_each_others_status_in_rank_order():
    rank0, rank1 = _ranks()
    rank1.store.set(f"{rank1.key}/round1/1", '["ok", "b"]')  # rank 1's, written first
    rank1.rounds = 1
    assert rank0.exchange(("ok", "a")) == [["ok", "a"], ["ok", "b"]]
    # the next build is the next round on both: rank 1's round-1 status does not answer it
    with pytest.raises(dist.DistStoreError):
        rank0.exchange(("ok", "c"))
    assert rank1.exchange(("ok", "d")) == [["ok", "c"], ["ok", "d"]]


def test_a_failed_rank_does_not_wait_and_a_building_peer_reads_its_error():
    rank0, rank1 = _ranks()
    assert rank1.exchange(("error", "ValueError: bad width")) == [
        ["error", "ValueError: bad width"]
    ]
    statuses = rank0.exchange(("ok", "a"))
    assert statuses[1] == ["error", "ValueError: bad width"]


def test_a_rank_that_builds_alone_times_out_and_its_peer_names_it():
    rank0, rank1 = _ranks()
    with pytest.raises(dist.DistStoreError):
        rank1.exchange(("ok", "b"))  # rank 0 runs the step it has: never writes round 1
    with pytest.raises(graphamp.RankFailedError, match="rank 1 built a new step at this call"):
        raise_if_a_peer_failed("G", rank0, RuntimeError("Timed out waiting 500ms for recv"))


def test_a_recorded_failure_names_the_rank_its_call_and_error_until_it_is_cleared():
    rank0, rank1 = _ranks()
    raise_if_a_peer_failed("G", rank0, RuntimeError("connection reset"))  # nobody failed: no-op
    rank1.publish_failure(5, ValueError("bad width\n(details)"))
    with pytest.raises(graphamp.RankFailedError) as raised:
        raise_if_a_peer_failed("G", rank0, RuntimeError("Connection reset by peer\nmore"))
    text = str(raised.value)
    assert "rank 1 failed at its call 5 (ValueError: bad width)" in text
    assert "(RuntimeError: Connection reset by peer)" in text and "docs/refusals.md" in text
    assert isinstance(raised.value.__cause__, RuntimeError)
    rank1.clear_failure()  # rank 1's next call went through
    raise_if_a_peer_failed("G", rank0, RuntimeError("another error"))


def test_the_block_kernel_cache_keeps_at_most_its_bound(monkeypatch):
    monkeypatch.setattr(block_update, "_KERNELS", BoundedCache(2))
    for i in range(3):
        block_update._remember((f"spec{i}", ()), lambda: i)
    assert list(block_update._KERNELS) == [("spec1", ()), ("spec2", ())]
