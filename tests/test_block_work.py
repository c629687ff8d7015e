"""The CPU's default outlines repeated blocks only where outlining pays on the steady step
(``step/block_work.py``): the step's forward work per block against the fixed cost of a call
of an outlined block."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.fx as fx
from helpers import make_graph
from models import TinyGPT, lm_loss

import graphamp.step.block_work as block_work

aten = torch.ops.aten


def _node(graph: fx.Graph, target, args, shape, path: str | None) -> fx.Node:
    node = graph.call_function(target, args)
    node.meta["val"] = torch.empty(shape, device="meta")
    if path is not None:
        node.meta["nn_module_stack"] = {path: (path, torch.nn.Linear)}
    return node


def _graph() -> fx.GraphModule:
    """Two numbered blocks of one 8x16 @ 16x32 matmul each, and a head outside them."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(8, 16, device="meta")
    w = graph.placeholder("w")
    w.meta["val"] = torch.empty(16, 32, device="meta")
    a = _node(graph, aten.mm.default, (x, w), (8, 32), "model.blocks.0.fc")
    b = _node(graph, aten.mm.default, (x, w), (8, 32), "model.blocks.1.fc")
    head = _node(graph, aten.mm.default, (x, w), (8, 32), "model.head")
    graph.output((a, b, head))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_the_work_per_block_is_the_whole_forward_over_the_numbered_blocks():
    one = 2 * 8 * 32 * 16  # 2 x the multiply-adds of one matmul
    assert block_work.flops_per_block(_graph()) == 3 * one / 2


def test_outlining_pays_from_the_threshold_on(monkeypatch):
    gm = _graph()
    work = block_work.flops_per_block(gm)
    monkeypatch.setattr(block_work, "OUTLINE_MIN_FLOPS_PER_BLOCK", work)
    assert block_work.outlining_pays(gm)
    monkeypatch.setattr(block_work, "OUTLINE_MIN_FLOPS_PER_BLOCK", work + 1)
    assert not block_work.outlining_pays(gm)


def _train(configure=None):
    torch.manual_seed(0)
    model = TinyGPT()
    g = make_graph(
        model,
        lm_loss,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        amp=torch.bfloat16,
        configure=configure,
    )
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        x = torch.randint(0, 64, (4, 16), generator=gen)
        g(x, torch.roll(x, 1, 1))
    return g


def test_a_model_with_small_blocks_is_inlined_by_default_and_says_why(caplog):
    with caplog.at_level(logging.INFO, logger="graphamp"):
        g = _train()
    assert "repeated blocks inlined: the step does" in caplog.text
    assert "outline" not in g.compiled_steps[-1].timings


@pytest.mark.parametrize("how", ["asked", "large blocks"])
def test_outlined_where_asked_or_where_the_blocks_are_large(how, monkeypatch, caplog):
    if how == "large blocks":
        monkeypatch.setattr(block_work, "OUTLINE_MIN_FLOPS_PER_BLOCK", 1.0)
    configure = (lambda g: g.config.set_outline_blocks(True)) if how == "asked" else None
    with caplog.at_level(logging.INFO, logger="graphamp"):
        g = _train(configure)
    assert "repeated blocks inlined" not in caplog.text
    assert "outline" in g.compiled_steps[-1].timings


def test_the_losses_are_the_same_either_way():
    inlined = _train()
    outlined = _train(lambda g: g.config.set_outline_blocks(True))
    for a, b in zip(inlined.history.fetch()["loss"], outlined.history.fetch()["loss"]):
        assert abs(a - b) <= 1e-6 * max(1.0, abs(b))
