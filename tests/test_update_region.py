"""Inductor's pass handing it the optimizer update as one node (graphamp/torchkit/update_region.py):
what it gathers, what it leaves alone, and an inductor step bitwise unchanged with fewer
buffers built."""

from __future__ import annotations

import models
import pytest
import torch
import torch.nn as nn
from helpers import make_graph
from torch.fx.experimental.proxy_tensor import make_fx

import graphamp
from graphamp.torchkit import update_region
from graphamp.torchkit.update_region import UPDATE_TAG, gather_update

aten = torch.ops.aten


def _inputs():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(4, 3, generator=gen) for _ in range(3)]


def _tag(gm, *targets):
    """Tags the nodes of ``targets`` as the update, as assembly does."""
    for node in gm.graph.nodes:
        if node.target in targets:
            node.meta["custom"] = {UPDATE_TAG: True}


def _calls(gm):
    return [n for n in gm.graph.nodes if n.target is update_region.update_region]


def _same_values(f, gm):
    """``gm`` writes and returns what ``f`` does, on fresh copies of the inputs."""
    ref_in, got_in = _inputs(), _inputs()
    ref_out, got_out = f(*ref_in), gm(*got_in)
    assert torch.equal(ref_out, got_out)
    for a, b in zip(ref_in, got_in):
        assert torch.equal(a, b)


def _update_step(p, m, g):
    """A momentum step: the writes at the end, as AOTAutograd leaves them."""
    m_new = m.mul(0.9).add(g)
    p_new = p.sub(m_new.mul(0.1))
    loss = g.sum()
    p.copy_(p_new)
    m.copy_(m_new)
    return loss


def test_the_update_becomes_one_call_whose_items_the_writes_take():
    gm = make_fx(_update_step)(*_inputs())
    _tag(gm, aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor)
    assert gather_update(gm.graph) == 4  # the two muls, the add, the sub
    gm.recompile()
    (call,) = _calls(gm)
    assert len(call.meta["val"]) == 2  # the new moment and the new parameter
    writes = list(gm.graph.find_nodes(op="call_function", target=aten.copy_.default))
    assert {w.args[1].args[0] for w in writes} == {call}
    assert not [n for n in gm.graph.nodes if n.target is aten.mul.Tensor]
    _same_values(_update_step, gm)


def test_a_reader_of_the_update_among_its_nodes_moves_after_the_call():
    def step(p, m, g):
        m_new = m.mul(0.9).add(g)
        seen = m_new.sum()  # read between the update's nodes, not part of it
        p_new = p.sub(m_new.mul(0.1))
        p.copy_(p_new)
        m.copy_(m_new)
        return seen

    gm = make_fx(step)(*_inputs())
    _tag(gm, aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor)
    assert gather_update(gm.graph) == 4
    gm.recompile()
    order = list(gm.graph.nodes)
    (call,) = _calls(gm)
    (seen,) = gm.graph.find_nodes(op="call_function", target=aten.sum.default)
    assert order.index(seen) > order.index(call)
    _same_values(step, gm)


def test_an_update_that_writes_in_place_is_left_as_it_is():
    def step(p, m, g):
        m.mul_(0.9)
        p.sub_(m.add(g))
        return g.sum()

    gm = make_fx(step)(*_inputs())
    _tag(gm, aten.mul_.Tensor, aten.add.Tensor, aten.sub_.Tensor)
    before = [n.format_node() for n in gm.graph.nodes]
    assert gather_update(gm.graph) == 0
    assert [n.format_node() for n in gm.graph.nodes] == before


def test_an_update_fed_by_its_own_reader_is_left_as_it_is():
    def step(p, m, g):
        m_new = m.mul(0.9)
        norm = m_new.sum()  # reads the update and feeds it: one call cannot stand for both
        p_new = p.sub(m_new.mul(norm))
        p.copy_(p_new)
        return norm

    gm = make_fx(step)(*_inputs())
    _tag(gm, aten.mul.Tensor, aten.sub.Tensor)
    assert gather_update(gm.graph) == 0
    assert not _calls(gm)


def _train(gather: bool, scheduled: list[int]) -> list[torch.Tensor]:
    """Five fp16 steps of an MLP (an AdamW group and an amsgrad one, a grad scaler, one
    overflow, clipping) under inductor, with graphamp's pass or without it: the parameters and
    optimizer state after."""
    torch.manual_seed(0)
    model = models.mlp(16, 16, 16, 16, act_last=True)
    opt = torch.optim.AdamW(
        [{"params": model[0].parameters()}, {"params": model[2].parameters(), "amsgrad": True}],
        lr=1e-2,
        weight_decay=0.1,
    )

    def configure(g):
        g.config.set_step_cache(False)
        g.config.set_inductor_options(force_disable_caches=True)  # the pass runs in every run
        if not gather:
            g.config.set_inductor_options(post_grad_custom_post_pass=None)

    g = make_graph(
        model,
        nn.functional.mse_loss,
        opt,
        backend="inductor",
        amp=torch.float16,
        scaler=graphamp.GradScaler(init_scale=2.0**8),
        clip=1.0,
        configure=configure,
    )
    scheduled.clear()
    gen = torch.Generator().manual_seed(3)
    for step in range(5):
        x = torch.randn(8, 16, generator=gen)
        if step == 2:
            x[0, 0] = float("inf")  # a skipped step: every write masked
        g(x, torch.randn(8, 16, generator=gen))
    tensors = [p.detach().clone() for p in model.parameters()]
    for state in opt.state.values():
        tensors += [v.clone() for v in state.values()]
    return tensors


@pytest.mark.slow
def test_an_inductor_step_is_bitwise_the_same_with_fewer_buffers(monkeypatch):
    from torch._inductor.scheduler import Scheduler

    gathered, scheduled = [], []
    gather, schedule = update_region.gather_update, Scheduler.__init__
    monkeypatch.setattr(
        update_region, "gather_update", lambda graph: gathered.append(gather(graph))
    )

    def counting(self, nodes, *args, **kwargs):  # the operations lowering built
        nodes = list(nodes)
        scheduled.append(len(nodes))
        schedule(self, nodes, *args, **kwargs)

    monkeypatch.setattr(Scheduler, "__init__", counting)
    got = _train(gather=True, scheduled=scheduled)
    assert gathered and max(gathered) > 0, "the pass did not gather the update"
    built = max(scheduled)  # the outer step graph's
    gathered.clear()
    ref = _train(gather=False, scheduled=scheduled)
    assert not gathered, "None in the inductor options turns the pass off"
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        assert torch.equal(a, b), (a - b).abs().max()
    assert built < max(scheduled), (built, max(scheduled))
