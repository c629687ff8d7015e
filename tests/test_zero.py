"""ZeRO stages 1, 2 and 3 on torch.distributed (gloo, CPU processes under torchrun).

Oracle: the same training in one process on the global batch (graphamp without ZeRO, which
tests/test_scaler.py holds to torch.amp.GradScaler and torch.optim.AdamW).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from dist_worker import POISON_STEP, STEPS, global_batches, make_model
from helpers import torchrun
from zero_worker import WIDTH, make_training, state_bytes

import graphamp
from graphamp.sharding.cuts import chunk_of

HERE = os.path.dirname(os.path.abspath(__file__))


def run_zero(
    nproc: int, stage: int, out, *, acc=1, first=0, last=STEPS, resume=None, sizes=None, env=None
):
    out.mkdir(exist_ok=True)
    args = [str(stage), str(acc), str(first), str(last), str(out)] + (
        [str(resume)] if resume else []
    )
    env = dict(env or {})
    if sizes is not None:
        env["GRAPHAMP_TEST_SIZES"] = ",".join(map(str, sizes))
    stderr = torchrun(
        os.path.join(HERE, "zero_worker.py"), *args, nproc=nproc, timeout=400, env=env
    )
    (out / "stderr.txt").write_text(stderr)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(nproc)]


def single_process(steps=STEPS, sizes=None, fused=False):
    model = make_model(seed=0, width=WIDTH)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g, opt = make_training(0, 1, model, fused=fused)
        for step, (x, y) in enumerate(global_batches()[:steps]):
            n = sizes[step] if sizes else len(x)
            g(x[:n], y[:n])
    return model.state_dict(), opt.state_dict(), g.history.fetch()["skipped"], state_bytes(opt)


def _assert_like_one_process(ranks, reference):
    params, opt_sd, skipped, _ = reference
    for r in ranks:  # every rank: the same parameters, bitwise, and the same skipped steps
        for k, v in r["params"].items():
            assert torch.equal(v, ranks[0]["params"][k]), k
        assert r["skipped"] == skipped
    assert skipped[POISON_STEP] == 1.0 and sum(skipped) == 1.0
    for k, v in params.items():
        torch.testing.assert_close(ranks[0]["params"][k], v, rtol=1e-5, atol=1e-6)
    for index, state in opt_sd["state"].items():  # torch's format, gathered from the rows
        for key, value in state.items():
            got = ranks[0]["opt"]["state"][index][key]
            assert got.shape == value.shape, (index, key)
            torch.testing.assert_close(got, value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "nproc,stage,acc",
    [
        pytest.param(2, 1, 1, marks=pytest.mark.slow),
        pytest.param(4, 2, 2, marks=pytest.mark.slow),
        pytest.param(2, 3, 1, marks=pytest.mark.slow),
        pytest.param(4, 3, 2, marks=pytest.mark.slow),
    ],
)
def test_zero_trains_like_one_process_with_an_overflow_on_one_rank(nproc, stage, acc, tmp_path):
    reference = single_process()
    ranks = run_zero(nproc, stage, tmp_path / "run", acc=acc)
    _assert_like_one_process(ranks, reference)
    whole_bytes = sum(4 * v.numel() for v in reference[0].values())
    if stage == 3:  # the ranks' shards partition the parameters: each holds about 1/W
        assert sum(r["param_bytes"] for r in ranks) == whole_bytes
        assert all(r["param_bytes"] <= whole_bytes / nproc * 1.05 for r in ranks)
    else:
        assert all(r["param_bytes"] == whole_bytes for r in ranks)
    # each rank holds its rows of exp_avg and exp_avg_sq (+ the step scalars): about 1/W
    full_bytes = reference[3]
    steps_bytes = 4 * 4  # four 0-dim fp32 step tensors, replicated
    rows_bytes = sum(2 * 4 * chunk_of(v.shape, nproc) for v in reference[0].values())
    for r in ranks:
        assert r["state_bytes"] == rows_bytes + steps_bytes
    assert rows_bytes <= (full_bytes - steps_bytes) / nproc * 1.05


@pytest.mark.slow
def test_zero2_with_a_fused_adamw_runs_its_kernel_on_the_rows(tmp_path):
    """AdamW(fused=True) under ZeRO-2: torch's fused kernel updates each rank's rows (odd
    sizes, an overflow on one rank skips the step on all), like one process with the same
    optimizer."""
    reference = single_process(fused=True)
    env = {"GRAPHAMP_TEST_FUSED": "1"}
    ranks = run_zero(2, 2, tmp_path / "run", env=env)
    _assert_like_one_process(ranks, reference)


@pytest.mark.slow
@pytest.mark.parametrize("stage,acc", [(1, 1), (2, 2)])
def test_zero_with_a_changing_batch_size_trains_like_one_process(stage, acc, tmp_path):
    """The global batch changes size every step (the poisoned step keeps its full batch):
    every rank makes its batch dimension dynamic at the same call, builds together, and the
    run equals one process on the same global batches."""
    sizes = (16, 8, 16, 12, 8, 16)
    reference = single_process(sizes=sizes)
    ranks = run_zero(2, stage, tmp_path / "run", acc=acc, sizes=sizes)
    _assert_like_one_process(ranks, reference)
    # the first size, then one step for every other size: on every rank
    assert [r["compiled_steps"] for r in ranks] == [2, 2]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_zero3_with_bf16_amp_gathers_the_low_precision_copies_and_trains_like_zero2(
    backend, tmp_path
):
    """bf16 AMP on 2 ranks: ZeRO-3 gathers each matmul weight's bf16 copy (its row cast first:
    the same values, half the bytes) where ZeRO-2 casts the float32 whole; the two train
    bitwise alike (a sum of two ranks' gradients does not depend on how it is bucketed), with
    aot_eager and with inductor compiling the step. The first block also holds a LayerNorm,
    whose float32 parameters travel as bytes in the block's one all-gather beside the bf16
    copies."""
    env = {"GRAPHAMP_TEST_AMP": "bf16", "GRAPHAMP_TEST_BACKEND": backend, "GRAPHAMP_TEST_NORM": "1"}
    runs = {}
    for stage in (2, 3):
        out = tmp_path / str(stage)
        out.mkdir()
        args = [str(stage), "1", "0", str(STEPS), str(out)]
        torchrun(os.path.join(HERE, "zero_worker.py"), *args, nproc=2, timeout=400, env=env)
        runs[stage] = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for a, b in zip(runs[2], runs[3]):
        for k, v in a["params"].items():
            assert torch.equal(v, b["params"][k]), k
        assert a["skipped"] == b["skipped"]
    assert runs[3][0]["gathered_bf16"] > 0
    # one all-gather per block: the mixed first block's (bytes), the second block's (bf16)
    assert runs[3][0]["gathered_bytes"] > 0 and runs[3][0]["gather_buckets"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("first_stage,then_stage", [(1, 2), (3, 3)])
def test_a_checkpoint_from_two_ranks_resumes_with_four_and_in_one_process(
    first_stage, then_stage, tmp_path
):
    """ZeRO-3's checkpoint holds whole tensors (torch's get_model_state_dict gathers the
    shards), so it loads on another number of ranks and in one process alike."""
    reference = single_process()
    run_zero(2, first_stage, tmp_path / "first", last=3)
    resumed = run_zero(4, then_stage, tmp_path / "second", first=3, resume=tmp_path / "first")
    params = reference[0]
    for k, v in params.items():
        torch.testing.assert_close(resumed[0]["params"][k], v, rtol=1e-5, atol=1e-6)
    # the same checkpoint in one process, without ZeRO
    ckpt = torch.load(tmp_path / "first" / "ckpt.pt", weights_only=True)
    model = make_model(seed=0, width=WIDTH)
    g, opt = make_training(0, 1, model)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    g.load_state_dict(ckpt["graph"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for x, y in global_batches()[3:]:
            g(x, y)
    for k, v in params.items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_zero3_shards_tied_frozen_and_tiny_parameters_and_fsdp2_reads_its_checkpoint(tmp_path):
    """4 ranks, ZeRO-3, a model whose head is tied to its embedding, with a frozen layer and a
    parameter of 3 rows (one rank holds none of it): trains like one process; the tied
    parameter stays one parameter, sharded once; the shards, saved with
    torch.distributed.checkpoint, load into an FSDP2 model (fully_shard) bitwise; an eval
    Graph and an eager forward under graphamp.gathered_parameters see the trained model; torch's
    set_model_state_dict loads a whole state dict into the shards in place."""
    from zero3_worker import global_batches as lm_batches
    from zero3_worker import make_model as make_lm
    from zero3_worker import make_training as lm_training

    torchrun(os.path.join(HERE, "zero3_worker.py"), str(tmp_path), nproc=4, timeout=400)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    model = make_lm()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g, _ = lm_training(model, zero=False)
        for ids, targets in lm_batches():
            g(ids, targets)
    start = make_lm().state_dict()
    for k, v in model.state_dict().items():
        if not k.startswith("frozen"):
            assert not torch.equal(v, start[k]), k  # it trained
        for r in ranks:
            torch.testing.assert_close(r["params"][k], v, rtol=1e-5, atol=1e-6)
            assert torch.equal(r["fsdp"][k], r["params"][k]), k
    assert all(r["tied"] for r in ranks)
    model.eval()
    with torch.no_grad():
        logits = model(lm_batches()[0][0])
    for r in ranks:  # an eval Graph gathers the shards; so does gathered_parameters, eagerly
        torch.testing.assert_close(r["evaluated"], logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r["eager"], logits, rtol=1e-5, atol=1e-5)
        assert r["shards_kept"]
        # torch's set_model_state_dict loads a whole state dict into the shards, in place
        assert r["reloaded_equal"] and r["still_shards"]
        with torch.no_grad():
            untrained = make_lm().eval()(lm_batches()[0][0])
        torch.testing.assert_close(r["reloaded_logits"], untrained, rtol=1e-5, atol=1e-5)
    for r in ranks:  # the DCP checkpoint loaded into the sharded model in place
        assert r["dcp_reloaded_equal"] and r["dcp_still_shards"]
        assert torch.equal(r["dcp_logits"], r["evaluated"])
    assert [r["held"]["gate"] for r in ranks] == [1, 1, 1, 0]
    assert [r["held"]["embed.weight"] for r in ranks] == [48, 48, 48, 32]  # 11 rows: 3, 3, 3, 2


@pytest.mark.slow
@pytest.mark.parametrize("nproc,wrap", [(2, "blocks"), (4, "root")])
def test_a_model_wrapped_with_fully_shard_trains_like_one_process(nproc, wrap, tmp_path):
    """FSDP2's fully_shard per layer then the root (or the root alone), registered as is:
    graphamp takes the wrap over (ZeRO-3 over its mesh, one gather bucket per wrapped module
    holding parameters) and trains like one process on the global batch, skipping the
    overflow step on every rank."""
    reference = single_process()
    ranks = run_zero(nproc, 3, tmp_path / "run", env={"GRAPHAMP_TEST_FULLY_SHARD": wrap})
    _assert_like_one_process(ranks, reference)
    whole_bytes = sum(4 * v.numel() for v in reference[0].values())
    assert sum(r["param_bytes"] for r in ranks) == whole_bytes
    # the wrap is the bucket plan: two layers, or everything in the root's one bucket. The
    # first layer is gathered again for its backward (the last one's forward and backward
    # run back to back: one gather), the root's kept from its forward (FSDP2's default)
    assert all(r["gather_buckets"] == (2 if wrap == "blocks" else 1) for r in ranks)
    assert all(r["all_gathers"] == (3 if wrap == "blocks" else 1) for r in ranks)


@pytest.mark.slow
def test_fully_shard_with_fp16_amp_skips_the_overflow_step_on_every_rank_like_one_process(
    tmp_path, monkeypatch
):
    """param_dtype=fp16 with fp16 AMP and a scaler on 2 ranks against one process with fp16
    AMP on the global batch: the same skipped step everywhere. The parameters agree within
    1e-3, not 1e-5: each rank's fp16 matmuls round its half-batch weight gradient to fp16
    before the ranks' sum, where one process rounds the whole batch's once (measured: at most
    1e-4 apart after 6 steps)."""
    monkeypatch.setenv("GRAPHAMP_TEST_AMP", "fp16")
    params, _, skipped, _ = single_process()
    env = {"GRAPHAMP_TEST_AMP": "fp16", "GRAPHAMP_TEST_FULLY_SHARD": "blocks"}
    ranks = run_zero(2, 3, tmp_path / "run", env=env)
    assert skipped[POISON_STEP] == 1.0 and sum(skipped) == 1.0
    for r in ranks:
        assert r["skipped"] == skipped
        for k, v in params.items():
            assert torch.equal(r["params"][k], ranks[0]["params"][k]), k
            torch.testing.assert_close(r["params"][k], v, rtol=1e-3, atol=1e-3)


@pytest.mark.slow
def test_fully_shard_with_bf16_param_dtype_trains_bitwise_like_zero3_with_bf16_amp(tmp_path):
    """MixedPrecisionPolicy(param_dtype=bf16) maps onto enable_amp(dtype=bf16): the same
    step as enable_zero(stage=3), bitwise."""
    bf16 = {"GRAPHAMP_TEST_AMP": "bf16"}
    zero3 = run_zero(2, 3, tmp_path / "zero3", env=bf16)
    wrapped = run_zero(2, 3, tmp_path / "fsdp", env={**bf16, "GRAPHAMP_TEST_FULLY_SHARD": "blocks"})
    for a, b in zip(zero3, wrapped):
        assert a["skipped"] == b["skipped"]
        for k, v in a["params"].items():
            assert torch.equal(v, b["params"][k]), k
        assert b["gathered_bf16"] > 0


@pytest.mark.slow
def test_zero3_keeping_the_gathered_parameters_gathers_once_and_trains_bitwise_alike(tmp_path):
    """enable_zero(stage=3, reshard_after_forward=False): each block gathered once a step
    (2 all-gathers for 2 blocks, against 3: by default the first block is gathered again for
    its backward; the last one's forward and backward run back to back), the same training
    bitwise."""
    default = run_zero(2, 3, tmp_path / "default")
    kept = run_zero(2, 3, tmp_path / "kept", env={"GRAPHAMP_TEST_KEEP": "1"})
    assert [r["all_gathers"] for r in default] == [3, 3]
    assert [r["all_gathers"] for r in kept] == [2, 2]
    for a, b in zip(default, kept):
        assert a["skipped"] == b["skipped"]
        for k, v in a["params"].items():
            assert torch.equal(v, b["params"][k]), k


@pytest.mark.slow
def test_fully_shard_settings_graphamp_cannot_honour_are_refused_by_name(tmp_path):
    torchrun(os.path.join(HERE, "fsdp_worker.py"), str(tmp_path), timeout=300)
    for r in range(2):
        got = torch.load(tmp_path / f"rank{r}.pt", weights_only=True)
        assert got["output_dtype"].startswith("GraphDefinitionError"), got
        assert "output_dtype" in got["output_dtype"]
        assert "reduce_dtype" in got["reduce_dtype"] and "float32" in got["reduce_dtype"]
        assert got["enable_zero"].startswith("ConfigError") and "fully_shard" in got["enable_zero"]
        assert got["amp_off"].startswith("ConfigError") and "enable_amp" in got["amp_off"]
        assert got["still_wrapped"] == [True, True, True] and got["fsdp_grads"], got
        # an eval Graph over a wrapped model: the whole model's logits
        torch.testing.assert_close(got["eval_logits"], got["eager_logits"], rtol=1e-5, atol=1e-6)


def test_a_fully_shard_wrap_is_the_bucket_plan_and_excludes_enable_zero():
    from helpers import make_graph

    from graphamp.records.fully_shard import FullyShardWrap
    from graphamp.sharding.cuts import block_of
    from graphamp.sharding.fsdp_adopt import check_policy as check_fully_shard_policy

    blocks = ("model.layers.0", "model")
    assert block_of("model.layers.0.attn.q.weight", blocks) == "model.layers.0"
    assert block_of("model.layers.1.attn.q.weight", blocks) == "model"  # not wrapped: the root
    assert block_of("model.layers.1.attn.q.weight") == "model.layers.1"  # graphamp's own plan
    assert block_of("loss_fn.weight", blocks) == "loss_fn"

    g = make_graph(make_model(0), torch.nn.CrossEntropyLoss(), None)
    wrap = FullyShardWrap(group=object(), blocks=blocks, param_dtype=torch.bfloat16)
    g.config._adopt_fully_shard(wrap)
    assert (g.config.zero_stage, g.config.data_parallel) == (3, True)
    with pytest.raises(graphamp.ConfigError, match="enable_zero beside a model wrapped"):
        g.config.enable_zero(stage=2)
    with pytest.raises(graphamp.ConfigError, match="fully_shard"):
        g.config.enable_data_parallel(False)
    with pytest.raises(graphamp.ConfigError, match="enable_amp.True, dtype=torch.bfloat16"):
        check_fully_shard_policy("G", g.config.snapshot())
    g.config.enable_amp(True, dtype=torch.bfloat16)
    check_fully_shard_policy("G", g.config.snapshot())  # param_dtype is AMP's: accepted


def test_enable_zero_needs_a_process_group():
    from helpers import make_graph

    g = make_graph(make_model(0), torch.nn.CrossEntropyLoss(), None)
    with pytest.raises(graphamp.ConfigError, match="init_process_group"):
        g.config.enable_zero(stage=1)
    with pytest.raises(graphamp.ConfigError, match="choose one of 1, 2, 3"):
        g.config.enable_zero(stage=4)
    with pytest.raises(graphamp.ConfigError, match="only stage 3 shards the parameters"):
        g.config.enable_zero(stage=2, reshard_after_forward=False)


def test_zero_refuses_a_traced_update_and_gradient_code_on_every_rank_and_changes_nothing():
    """ZeRO updates rows with graphamp's own update math, on the whole batch's gradients: an
    optimizer whose own step() is traced (Adagrad) and build() code that reads ``.grad`` are
    refused by name at the first call on both ranks, with the model and optimizer as they
    were; the same objects then train in a data-parallel Graph (zero_refusals_worker.py)."""
    stderr = torchrun(os.path.join(HERE, "zero_refusals_worker.py"), nproc=2, timeout=200)
    # counted in the whole stream: the two ranks share stderr, and a refusal's message spans
    # lines, so one rank's line may run on into the other's (seen once in the default lane)
    assert stderr.count("refused: ") == 4, stderr[-2000:]  # two refusals, each on both ranks
    assert stderr.count("Adagrad's own step() is traced whole") == 2, stderr[-2000:]
    assert stderr.count("build() reads or writes .grad") == 2, stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2, 3, "fully_shard"])
def test_a_data_parallel_step_loads_from_the_step_cache_on_every_rank(stage, tmp_path):
    """Data parallel (stage 0), ZeRO-2, ZeRO-3 and a fully_shard model on 2 gloo ranks: the
    first run assembles the step and saves it; a restart in fresh processes loads it on both
    ranks (no assembly) and trains bitwise like the assembled step."""
    env = {"GRAPHAMP_CACHE_DIR": str(tmp_path / "cache")}
    if stage == "fully_shard":
        stage, env["GRAPHAMP_TEST_FULLY_SHARD"] = 3, "blocks"
    runs = []
    for name in ("cold", "restart"):
        out = tmp_path / name
        out.mkdir()
        args = [str(stage), "1", "0", "3", str(out)]
        torchrun(os.path.join(HERE, "zero_worker.py"), *args, nproc=2, timeout=400, env=env)
        runs.append([torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)])
    cold, restart = runs
    assert all("assemble" in r["stages"] for r in cold)
    assert all("assemble" not in r["stages"] and "step_cache" in r["stages"] for r in restart)
    for a, b in zip(cold, restart):
        for k, v in a["params"].items():
            assert torch.equal(v, b["params"][k]), k
        assert a["skipped"] == b["skipped"]


@pytest.mark.slow
def test_a_rank_whose_step_cache_entry_is_missing_builds_it_and_the_ranks_agree(tmp_path):
    """A restart where rank 1's cache lost its entry: rank 0 loads the step, rank 1 assembles
    it; both built the same step (the fingerprint agreement) and train as before."""
    import shutil

    env = {"GRAPHAMP_CACHE_DIR": str(tmp_path / "cache"), "GRAPHAMP_TEST_CACHE_PER_RANK": "1"}
    runs = []
    for name in ("cold", "restart"):
        out = tmp_path / name
        out.mkdir()
        torchrun(os.path.join(HERE, "zero_worker.py"), "2", "1", "0", "3", str(out), env=env)
        runs.append([torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)])
        shutil.rmtree(tmp_path / "cache" / "1")
    cold, restart = runs
    assert "assemble" not in restart[0]["stages"] and "assemble" in restart[1]["stages"]
    for a, b in zip(cold, restart):
        for k, v in a["params"].items():
            assert torch.equal(v, b["params"][k]), k
