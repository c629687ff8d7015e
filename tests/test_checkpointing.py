"""Activation checkpointing (config.enable_activation_checkpointing): recompute in the backward.

Oracle: the same Graph without checkpointing. Recomputing the same ops in the same order gives
the same bits in fp32 and under AMP; the saved memory is counted on the step graph.
"""

import copy
import csv
import logging
import os

import pytest
import torch
from helpers import make_graph
from models import Block, TinyGPT, lm_loss

import graphamp
from graphamp.inspect.memory import step_memory


def _train(
    base, *, ckpt=None, amp=None, steps=2, dropout_seed=None, backend="aot_eager", accumulate=1
):
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def configure(g):
        if ckpt:
            g.config.enable_activation_checkpointing(*ckpt)
        if accumulate > 1:
            g.config.set_gradient_accumulation_steps(accumulate)

    g = make_graph(
        model,
        lm_loss,
        opt,
        amp=amp,
        configure=configure,
        backend=backend,
        scaler=graphamp.GradScaler(init_scale=2.0**8) if amp else None,
    )
    gen = torch.Generator().manual_seed(1)
    if dropout_seed is not None:
        torch.manual_seed(dropout_seed)
    for _ in range(steps):
        idx = torch.randint(0, 64, (16, 32), generator=gen)
        g(idx, torch.roll(idx, 1, 1))
    return model, g


def _gpt(dropout=0.0):
    torch.manual_seed(0)
    return TinyGPT(vocab=64, dim=32, heads=4, layers=2, seq=32, dropout=dropout)


def _step_gm(g):
    return next(iter(g._programs.values())).step_gm


def _assert_equal_states(a, b):
    for (k, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), k


@pytest.mark.parametrize("amp", [None, pytest.param(torch.float16, marks=pytest.mark.slow)])
def test_checkpointed_blocks_train_bitwise_like_no_checkpointing_with_less_memory(amp):
    base = _gpt()
    plain, g_plain = _train(base, amp=amp)
    ckpt, g_ckpt = _train(base, ckpt=(Block,), amp=amp)
    _assert_equal_states(plain, ckpt)
    before, after = step_memory(_step_gm(g_plain)), step_memory(_step_gm(g_ckpt))
    assert after.resident_bytes == before.resident_bytes
    assert after.peak_intermediate_bytes < before.peak_intermediate_bytes, (before, after)


def test_checkpointing_with_gradient_accumulation_recomputes_each_micro_batch_bitwise():
    """Each micro-batch's forward is its own instance of a checkpointed region: it is copied
    before that micro-batch's backward (not all micro-batches before the first backward)."""
    base = _gpt()
    plain, _ = _train(base, accumulate=2, backend="eager")
    ckpt, g = _train(base, ckpt=(Block,), accumulate=2, backend="eager")
    _assert_equal_states(plain, ckpt)
    gm = _step_gm(g)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    copies = [n for n in gm.graph.nodes if n.meta.get("graphamp_subgraph") == "recompute"]
    assert {n.meta["micro_batch"] for n in copies} == {0, 1}
    for c in copies:  # its inputs come from its own micro-batch (or are shared inputs)
        assert all(
            a.meta.get("micro_batch", c.meta["micro_batch"]) == c.meta["micro_batch"]
            for a in c.all_input_nodes
        ), c
        assert all(order[a] < order[c] for a in c.all_input_nodes)


def test_the_recompute_rewrite_is_counted_and_logged_as_its_stage(caplog):
    """Checkpointing is a step component whose rewrite runs as the ``recompute`` stage: its
    INFO line says what it recomputed, and the compiled step's node count is the rewritten
    step's (accumulation keeps the step inlined, so no outlining follows the rewrite)."""
    with caplog.at_level(logging.INFO, logger="graphamp"):
        _, g = _train(_gpt(), ckpt=(Block,), accumulate=2, backend="eager")
    (step,) = g.compiled_steps
    assert step.step_nodes == len(step.step_graph.graph.nodes)
    assert "recompute" in step.timings
    line = next(r.getMessage() for r in caplog.records if "recomputes" in r.getMessage())
    assert "ops in 2 regions" in line and f"{step.step_nodes} nodes" in line


def test_recomputed_regions_keep_their_precision_and_are_reported(tmp_path):
    base = _gpt()
    # the eager backend runs the same graph without compiling it (the test reads the graph)
    _, g = _train(base, ckpt=("model.blocks.1",), amp=torch.float16, steps=1, backend="eager")
    gm = _step_gm(g)
    copies = [n for n in gm.graph.nodes if n.meta.get("graphamp_subgraph") == "recompute"]
    assert copies and {n.meta["recompute_region"] for n in copies} == {"model.blocks.1"}
    by_name = {n.name: n for n in gm.graph.nodes}
    for c in copies:  # same op, same dtype as the forward node it recomputes: no new casts
        orig = by_name[c.meta["recomputed_from"]]
        assert c.target is orig.target
        if isinstance(orig.meta.get("val"), torch.Tensor):
            assert c.meta["val"].dtype == orig.meta["val"].dtype
    report = g.precision_report(with_autocast=False)
    marked = [r for r in report.rows if r["recomputed"] == "yes"]
    assert marked and all(r["module"].startswith("model.blocks.1") for r in marked)
    assert "recomputed in the backward" in report.summary()
    out = g.dump(str(tmp_path / "dump"))
    rows = list(csv.DictReader(open(os.path.join(out, "precision.csv"))))
    assert {r["node"] for r in rows if r["recomputed"] == "yes"} == {r["node"] for r in marked}
    plain = _train(base, amp=torch.float16, steps=1, backend="eager")[1].precision_report(
        with_autocast=False
    )
    assert report.casts == plain.casts and report.parameter_copies == plain.parameter_copies


def test_random_ops_are_not_recomputed_so_dropout_masks_match():
    base = _gpt(dropout=0.2)
    plain, _ = _train(base, dropout_seed=5, backend="eager")
    ckpt, g = _train(base, ckpt=(Block,), dropout_seed=5, backend="eager")
    _assert_equal_states(plain, ckpt)
    copies = [n for n in _step_gm(g).graph.nodes if n.meta.get("graphamp_subgraph") == "recompute"]
    assert copies and not any(
        torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ()) for n in copies
    )


def test_unknown_module_name_is_a_config_error_naming_the_fix():
    model = _gpt()
    g = make_graph(
        model,
        lm_loss,
        torch.optim.SGD(model.parameters(), lr=0.1),
        configure=lambda g: g.config.enable_activation_checkpointing("model.block.0"),
    )
    idx = torch.randint(0, 64, (2, 32))
    with pytest.raises(graphamp.errors.ConfigError, match="did you mean 'model.blocks.0'"):
        g(idx, idx)
    with pytest.raises(graphamp.errors.ConfigError, match="nn.Module classes"):
        g.config.enable_activation_checkpointing(3)


@pytest.mark.parametrize(
    "configure",
    [
        lambda g: g.config.enable_activation_checkpointing(torch.nn.Conv2d),
        lambda g: g.config.pin_fp32(torch.nn.Conv2d),
    ],
    ids=["checkpointing", "pin_fp32"],
)
def test_a_module_type_the_model_does_not_have_is_a_warning_naming_it(configure, caplog):
    """A type matches no module of a model without it: a config shared by several models may
    name it, so it is a warning, not an error, but never silence."""
    model = _gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = make_graph(model, lm_loss, opt, amp=torch.bfloat16, configure=configure)
    idx = torch.randint(0, 64, (2, 32))
    with caplog.at_level(logging.WARNING, logger="graphamp"):
        g(idx, idx)
    assert "no registered module is a Conv2d, so it changes nothing here" in caplog.text


class _ReentrantOnInputs(torch.nn.Module):
    """torch.utils.checkpoint(use_reentrant=True) straight on the batch: the classic pitfall
    (transformers' enable_input_require_grads exists for it)."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return self.head(checkpoint(self.inner, torch.relu(x), use_reentrant=True))


@pytest.mark.parametrize("grad_input", [False, True], ids=["plain_input", "input_requires_grad"])
def test_reentrant_checkpoint_without_inputs_that_require_grad_trains_like_eager(grad_input):
    """eager: the checkpoint's output does not require grad, so the wrapped layer gets no
    gradient (AdamW then leaves it alone, weight decay included), and torch warns. graphamp:
    the same warning and the same training. An input that requires grad trains both layers."""
    import warnings

    from helpers import assert_optimizer_close, assert_state_close

    torch.manual_seed(0)
    model = _ReentrantOnInputs()
    ref, initial = copy.deepcopy(model), model.inner.weight.detach().clone()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = make_graph(model, torch.nn.functional.cross_entropy, opt)
    gen = torch.Generator().manual_seed(0)
    for step in range(2):
        x, y = torch.randn(4, 8, generator=gen), torch.randint(0, 3, (4,), generator=gen)
        x.requires_grad_(grad_input)
        with warnings.catch_warnings(record=True) as ours:
            warnings.simplefilter("always")
            g(x, y)
        with warnings.catch_warnings(record=True) as theirs:
            warnings.simplefilter("always")
            ref_opt.zero_grad()
            torch.nn.functional.cross_entropy(ref(x), y).backward()
            ref_opt.step()
        said = "None of the inputs have requires_grad=True. Gradients will be None"
        assert any(said in str(w.message) for w in theirs) == (not grad_input)
        # once, at capture (the compiled step runs no Python; Python's default filter shows
        # torch's warning once too)
        assert any(said in str(w.message) for w in ours) == (not grad_input and step == 0)
    assert_state_close(model, ref)
    assert_optimizer_close(opt, ref_opt)
    trained = not torch.equal(model.inner.weight, initial)
    assert trained == grad_input
