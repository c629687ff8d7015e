"""Data parallel on torch.distributed, two CPU processes on gloo, under torchrun."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn as nn
from dist_worker import (
    INTERRUPTED_STEP,
    POISON_STEP,
    TIMEOUT_S,
    autofix_batches,
    configure_autofix,
    global_batches,
    make_model,
    overflowing_model,
    sam_step,
)
from helpers import make_graph, torchrun

import graphamp

HERE = os.path.dirname(os.path.abspath(__file__))


def run_ranks(mode: str, tmp_path) -> list[dict]:
    stderr = torchrun(os.path.join(HERE, "dist_worker.py"), mode, str(tmp_path))
    (tmp_path / "stderr.txt").write_text(stderr)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]


def single_process_reference(mode="train"):
    """The same training on one process with the concatenated batch."""
    model = make_model(seed=0)
    if mode == "rmsprop":
        opt = torch.optim.RMSprop(model.parameters(), lr=1e-3, momentum=0.9)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = make_graph(
            model, nn.CrossEntropyLoss(), opt, scaler=graphamp.GradScaler(init_scale=256.0)
        )
        for x, y in global_batches():
            g(x, y)
    return model.state_dict(), g.history.fetch()["skipped"], g.grad_scaler.get_scale()


@pytest.mark.parametrize(
    "mode",
    [
        "train",
        pytest.param("ddp", marks=pytest.mark.slow),
        pytest.param("rmsprop", marks=pytest.mark.slow),
    ],
)
def test_data_parallel_ranks_agree_and_equal_one_process(mode, tmp_path):
    """SGD (graphamp's own update), SGD under DDP, and RMSprop (its own step() traced)."""
    ranks = run_ranks(mode, tmp_path)
    for k in ranks[0]["params"]:
        assert torch.equal(ranks[0]["params"][k], ranks[1]["params"][k]), k  # bitwise
    expected_skips = [1.0 if s == POISON_STEP else 0.0 for s in range(len(ranks[0]["skipped"]))]
    assert ranks[0]["skipped"] == ranks[1]["skipped"] == expected_skips  # all ranks skipped it
    params, skipped, scale = single_process_reference(mode)
    assert skipped == expected_skips and ranks[0]["scale"] == ranks[1]["scale"] == scale
    for k, v in params.items():
        torch.testing.assert_close(ranks[0]["params"][k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # moved from the default lane to keep it near 10 minutes (--durations)
def test_data_parallel_autofix_pins_on_every_rank_when_one_ranks_data_overflows(tmp_path):
    """Only rank 1's shard overflows fp16 in the first layer's matmul. Every rank records the
    same overflowing steps, pins the same op after the same step and rebuilds with the others
    (none waits in a collective until the timeout); the ranks stay bitwise equal and train like
    one process on the whole batch, which pins the same op at the same step."""
    ranks = run_ranks("autofix", tmp_path)
    assert "error" not in ranks[0] and "error" not in ranks[1], ranks
    # the first layer after its 2nd overflow; then the second, which reads its fp32 output
    # (~5e5) in fp16, after 2 more
    pins = [("aten.addmm in model.0", 1), ("aten.addmm in model.2", 3)]
    assert ranks[0]["pins"] == ranks[1]["pins"] == pins
    assert ranks[0]["skipped"] == ranks[1]["skipped"] == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    for k in ranks[0]["params"]:
        assert torch.equal(ranks[0]["params"][k], ranks[1]["params"][k]), k
    model = overflowing_model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6, momentum=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = make_graph(
            model,
            nn.CrossEntropyLoss(),
            opt,
            scaler=graphamp.GradScaler(init_scale=256.0),
            configure=configure_autofix,
        )
        for x, y in autofix_batches():
            g(x, y)
    assert [(p.describe(), p.step) for p in g.config.amp_pins] == ranks[0]["pins"]
    assert g.history.fetch()["skipped"] == ranks[0]["skipped"]
    for k, v in model.state_dict().items():
        torch.testing.assert_close(ranks[0]["params"][k], v, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_data_parallel_with_bf16_amp(tmp_path):
    ranks = run_ranks("bf16", tmp_path)
    for k in ranks[0]["params"]:
        assert torch.equal(ranks[0]["params"][k], ranks[1]["params"][k]), k
        assert torch.isfinite(ranks[0]["params"][k]).all()


@pytest.mark.slow
def test_ranks_with_different_graphs_all_raise_and_none_hangs(tmp_path):
    ranks = run_ranks("mismatch", tmp_path)
    for r in ranks:
        assert "error" in r
    for r in ranks:
        assert "the ranks hold different models" in r["error"], r["error"]
        assert "0.weight" in r["error"]


@pytest.mark.slow
def test_an_interrupted_rank_makes_the_others_raise_within_the_timeout(tmp_path):
    """Rank 1 stops at a step (a Ctrl-C in a notebook) and stays alive. Rank 0's call
    of that step raises once the process group's timeout has passed, and leaves rank 0's state
    from before the step: it can be saved, and training resumed from it by every rank."""
    rank0 = run_ranks("interrupt", tmp_path)[0]
    assert "error" in rank0, rank0
    assert rank0["waited_s"] < TIMEOUT_S + 20, rank0
    assert rank0["unchanged"] and rank0["step_count"] == INTERRUPTED_STEP, rank0


@pytest.mark.parametrize(
    "mode",
    [
        "failing_rank_zero3",
        pytest.param("failing_rank", marks=pytest.mark.slow),
        pytest.param("failing_rank_alive_zero3", marks=pytest.mark.slow),
    ],
)
def test_a_rank_whose_batch_is_wrong_raises_in_python_and_its_peer_names_it(mode, tmp_path):
    """Rank 1's batch has 31 features at one step, so rank 1 rebuilds while rank 0 runs the
    step it has. Rank 1 raises its own error; rank 0's step stops in the collectives rank 1
    never joins, and raises an error naming rank 1 and its cause (rank 1 exited, or, ``alive``,
    once the group's timeout passed). Both exit normally: under ZeRO-3 the rebuild's host-side
    agreement met rank 0's all-gather and gloo killed rank 1 (SIGABRT) before this was fixed.
    ``torchrun`` fails the test on a non-zero exit or a signal."""
    rank0, rank1 = run_ranks(mode, tmp_path)
    assert rank1["step"] == rank0["step"] == INTERRUPTED_STEP, (rank0, rank1)
    assert rank1["error"].startswith("CaptureError"), rank1["error"]
    assert "same reduction dim" in rank1["error"], rank1["error"]
    assert rank0["error"].startswith("RankFailedError: DP: rank 1 failed at its call 5"), rank0
    assert "same reduction dim" in rank0["error"], rank0["error"]
    assert rank0["waited_s"] < TIMEOUT_S + 20, rank0


@pytest.mark.slow
def test_a_rank_that_alone_builds_a_new_step_raises_and_its_peer_names_it(tmp_path):
    """Rank 1's batch has one row fewer at one step: a valid batch, so rank 1 builds a step
    while rank 0 runs the one it has. Rank 1 waits for its peers' build statuses until the
    group's timeout and raises; rank 0's step stops in its collectives and names rank 1 as the
    rank that built at this call. Neither is killed."""
    rank0, rank1 = run_ranks("rebuilding_rank_zero3", tmp_path)
    assert rank1["step"] == rank0["step"] == INTERRUPTED_STEP, (rank0, rank1)
    assert "its peers did not build at this call" in rank1["error"], rank1["error"]
    assert rank0["error"].startswith("RankFailedError: DP: rank 1 built a new step"), rank0
    assert rank0["waited_s"] < TIMEOUT_S + 20 and rank1["waited_s"] < 2 * TIMEOUT_S + 20


def test_data_parallel_without_a_process_group_is_a_clear_error():
    g = make_graph(make_model(0), nn.CrossEntropyLoss(), None)
    with pytest.raises(graphamp.ConfigError, match="init_process_group"):
        g.config.enable_data_parallel()


@pytest.mark.slow
def test_delayed_fp8_histories_agree_across_ranks(tmp_path):
    """Each rank sees its own shard, so its amaxes differ; the step agrees on the largest
    (one all-reduce max), so every rank's histories, and so its scales, are the same. The
    poisoned step is skipped on both ranks and leaves the histories as they were."""
    ranks = run_ranks("fp8_delayed", tmp_path)
    assert all("error" not in r for r in ranks), [r.get("error") for r in ranks]
    first, second = (r["fp8_histories"] for r in ranks)
    assert first and first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name
        assert (first[name] > 0).any()
    assert list(ranks[0]["skipped"]) == list(ranks[1]["skipped"])
    assert ranks[0]["skipped"][POISON_STEP]
    for (k, v), w in zip(ranks[0]["params"].items(), ranks[1]["params"].values()):
        assert torch.equal(v, w), k


@pytest.mark.slow
def test_gradient_code_in_build_trains_like_one_process_on_the_global_batch(tmp_path):
    """SAM in build() under data parallel: the gradients it reads are averaged over the ranks
    before its code sees them (as DDP's backward() does), so both ranks perturb alike and the
    run equals one process on the concatenated batch; the poisoned step is skipped by both."""
    ranks = run_ranks("sam", tmp_path)
    assert all("error" not in r for r in ranks), [r.get("error") for r in ranks]
    model = make_model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = make_graph(
            model,
            None,
            opt,
            scaler=graphamp.GradScaler(init_scale=256.0),
            build=lambda self, x, y: sam_step(self.model, x, y),
        )
        for x, y in global_batches():
            g(x, y)
    for r in ranks:
        assert list(r["skipped"]) == g.history.fetch()["skipped"]
        for k, v in model.state_dict().items():
            torch.testing.assert_close(r["params"][k], v, rtol=1e-5, atol=1e-6, msg=k)
